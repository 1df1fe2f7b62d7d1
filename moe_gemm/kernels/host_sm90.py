"""Host wrapper for GroupedGemmSm90: torch tensors in, one grouped launch out.

Turns validated arguments (moe_gemm.validation) into launch arguments: picks the kernel
choice (moe_gemm.heuristics), builds the per-problem metadata (pointers, leading dims, sizes)
in pinned memory and copies it to the GPU in one transfer, builds or reuses the host
visitor's table, and calls the compiled kernel (moe_gemm.cache) on the current stream through
TVM-FFI. grouped_mm never reads GPU values on the host unless visitor="host" is asked for.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import torch

from .. import cache
from .. import schedule as sched
from ..capability import sm_count
from ..config import GemmConfig
from ..heuristics import KernelChoice, choose_general, choose_varlen
from ..validation import GroupedGemmArgs, GroupedMmArgs
from .support import operand_major

TILE_K = 64
_TORCH_TO_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_local = threading.local()


@dataclass(frozen=True)
class LaunchInfo:
    """What the last launch on this thread used (for tests, benchmarks and `trace`)."""

    choice: KernelChoice
    num_ctas: int
    num_problems: int
    order: tuple[int, ...] | None
    trace: torch.Tensor | None


def last_launch() -> LaunchInfo | None:
    return getattr(_local, "last", None)


def _compile_key(form, ab, d, b_major, choice: KernelChoice, trace: bool):
    from .compile_sm90 import CompileKey

    return CompileKey(
        form, _TORCH_TO_NAME[ab], _TORCH_TO_NAME[d], b_major, choice.schedule, choice.visitor,
        choice.tile_m, choice.tile_n, choice.stages, trace,
    )


def _compiled(key):
    from .compile_sm90 import compile_variant

    return cache.get_or_compile(key, key.name(), lambda: compile_variant(key))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=64)
def _cached_small(kind: str, device: torch.device, dtype: torch.dtype, shape: tuple, major: str):
    return _new_small(kind, device, dtype, shape, major)


def _new_small(kind: str, device: torch.device, dtype: torch.dtype, shape: tuple, major: str):
    if major == "k":  # (K, N) with K contiguous
        return torch.zeros(shape[::-1], dtype=dtype, device=device).t()
    return torch.zeros(shape, dtype=dtype, device=device)


def _small(kind, device, dtype, shape, major="n"):
    """Placeholder tensors (seeds, unused slots). Cached, except while a CUDA graph is being
    captured (an allocation made then belongs to the graph's private pool)."""
    if _capturing():
        return _new_small(kind, device, dtype, shape, major)
    return _cached_small(kind, device, dtype, shape, major)


def _table_tensor(counts: tuple[int, ...], num_ctas: int, device: torch.device) -> torch.Tensor:
    if _capturing():
        return torch.from_numpy(sched.host_precompute_table(counts, num_ctas)).to(device)
    return _cached_table(counts, num_ctas, device)


@functools.lru_cache(maxsize=128)
def _cached_table(counts: tuple[int, ...], num_ctas: int, device: torch.device) -> torch.Tensor:
    """The host visitor's table, uploaded once per problem set (tile counts) and grid."""
    return torch.from_numpy(sched.host_precompute_table(counts, num_ctas)).to(device)


def _pinned(shape, dtype) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError:  # no CUDA host allocator (unusual); pageable still works
        return torch.empty(shape, dtype=dtype)


def _trace_tensor(num_ctas: int, max_tiles: int, device: torch.device) -> torch.Tensor:
    return torch.full((num_ctas, max(1, max_tiles), 4), -1, dtype=torch.int32, device=device)


def grouped_gemm_cute(
    args: GroupedGemmArgs, config: GemmConfig, *, trace: bool = False
) -> list[torch.Tensor]:
    device = args.device
    G = len(args.a)
    sizes = tuple(args.sizes)
    nsm = sm_count(device)
    choice = choose_general(config, sizes, nsm)

    # B's major: the kernel takes one per launch; the minority layout is copied to match.
    majors = [operand_major(b) if b.numel() else None for b in args.b]
    n_major = sum(m == "row" for m in majors)
    k_major = sum(m == "col" for m in majors)
    b_major = "k" if k_major > n_major else "n"
    want = "col" if b_major == "k" else "row"
    b_list = [
        b if (m is None or m == want) else (b.t().contiguous().t() if want == "col"
                                            else b.contiguous())
        for b, m in zip(args.b, majors)
    ]
    outs = args.out if args.out is not None else [
        torch.empty(m, n, dtype=args.out_dtype, device=device) for m, n, _ in sizes
    ]

    order = sched.ksort_permutation(sizes) if choice.sort_by_k else list(range(G))
    ordered_sizes = [sizes[i] for i in order]
    counts = tuple(sched.tiles_per_problem(ordered_sizes, choice.tile_m, choice.tile_n))
    total = sum(counts)
    if total == 0:
        return list(outs)
    num_ctas = max(1, min(nsm, total))

    meta = _pinned((G, 8), torch.int64)
    m_np = meta.numpy()
    for row, p in enumerate(order):
        a, b, d = args.a[p], b_list[p], outs[p]
        M, N, K = sizes[p]
        ldb = b.stride(1) if b_major == "k" else b.stride(0)
        m_np[row] = (a.data_ptr(), b.data_ptr(), d.data_ptr(), a.stride(0), ldb, d.stride(0),
                     M | (N << 32), K)
    meta_dev = meta.to(device, non_blocking=True)

    table = (
        _table_tensor(counts, num_ctas, device) if choice.visitor == "host"
        else _small("table", device, torch.int32, (1, 1, 2))
    )
    workspace = torch.empty(G * 3 * 16, dtype=torch.int64, device=device)
    trace_t = (_trace_tensor(num_ctas, math.ceil(total / num_ctas), device) if trace
               else _small("trace", device, torch.int32, (1, 1, 4)))
    seed_a = _small("seed_a", device, args.dtype, (128, 64))
    seed_w = _small("seed_w", device, args.dtype, (64, 64), b_major)
    seed_d = _small("seed_d", device, args.out_dtype, (128, 64))
    offs = _small("offs", device, torch.int32, (1,))
    key = _compile_key("general", args.dtype, args.out_dtype, b_major, choice, trace)
    kernel = _compiled(key)
    kernel(seed_a, seed_w, seed_d, meta_dev, meta_dev.view(torch.int32), offs, table, workspace,
           trace_t, G, num_ctas, choice.swizzle, choice.a_policy, choice.b_policy)
    _local.last = LaunchInfo(choice, num_ctas, G, tuple(order), trace_t if trace else None)
    return list(outs)


def grouped_mm_cute(args: GroupedMmArgs, config: GemmConfig, *, trace: bool = False
                    ) -> torch.Tensor:
    x, w, offs = args.x, args.w, args.offs
    device = x.device
    T, K, E, N = args.T, args.K, args.E, args.N
    zero_tail = args.out is None
    out = args.out if args.out is not None else torch.empty(T, N, dtype=args.out_dtype,
                                                             device=device)
    if T == 0 or N == 0:
        return out
    if E == 0:
        return out.zero_() if zero_tail else out
    nsm = sm_count(device)
    choice = choose_varlen(config, T, E, N, K, nsm)
    b_major = "k" if operand_major(w) == "col" else "n"
    num_problems = E + (1 if zero_tail else 0)
    tiles_n = -(-N // choice.tile_n)

    if choice.visitor == "host":
        # The host visitor needs the per-expert sizes on the host: one device-to-host copy
        # of offs (a synchronisation). "auto" never picks it for grouped_mm.
        bounds = offs.to("cpu", torch.int64).clamp(0, T).tolist()
        starts = [0] + bounds[:-1]
        rows = [max(0, e - s) for s, e in zip(starts, bounds)]
        if zero_tail:
            rows.append(max(0, T - (bounds[-1] if bounds else 0)))
        counts = tuple(-(-r // choice.tile_m) * tiles_n for r in rows)
        total = sum(counts)
        if total == 0:
            return out
        num_ctas = max(1, min(nsm, total))
        table = _table_tensor(counts, num_ctas, device)
        max_tiles = -(-total // num_ctas)
    else:
        bound = (-(-T // choice.tile_m) + num_problems) * tiles_n
        num_ctas = max(1, min(nsm, bound))
        table = _small("table", device, torch.int32, (1, 1, 2))
        max_tiles = -(-bound // num_ctas)

    meta = _small("meta", device, torch.int64, (1, 8))
    workspace = torch.empty(num_problems * 3 * 16, dtype=torch.int64, device=device)
    trace_t = (_trace_tensor(num_ctas, max_tiles, device) if trace
               else _small("trace", device, torch.int32, (1, 1, 4)))
    key = _compile_key("varlen", args.dtype, args.out_dtype, b_major, choice, trace)
    kernel = _compiled(key)
    kernel(x, w, out, meta, meta.view(torch.int32), offs, table, workspace, trace_t,
           num_problems, num_ctas, choice.swizzle, choice.a_policy, choice.b_policy)
    _local.last = LaunchInfo(choice, num_ctas, num_problems, None, trace_t if trace else None)
    return out


def trace_assignment(info: LaunchInfo) -> list[list[tuple[int, int, int]]]:
    """Per CTA, the (problem, m_tile, n_tile) records the kernel wrote, in tile order, with
    problems mapped back to the caller's indices (K-sort undone)."""
    assert info.trace is not None
    t = info.trace.cpu().numpy()
    order = info.order
    per_cta = []
    for c in range(t.shape[0]):
        rows = [r for r in t[c] if r[0] >= 0]
        per_cta.append([
            (int(order[r[0]]) if order is not None else int(r[0]), int(r[1]), int(r[2]))
            for r in rows
        ])
    return per_cta

