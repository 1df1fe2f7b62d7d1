"""Host wrapper for GroupedGemmSm90: torch tensors in, one grouped launch out.

Turns validated arguments (moe_gemm.validation) into launch arguments: picks the kernel
choice (moe_gemm.heuristics), builds the per-problem metadata (pointers, leading dims, sizes)
in pinned memory and copies it to the GPU in one transfer, builds or reuses the host
visitor's table, and calls the compiled kernel (moe_gemm.cache) on the current stream through
TVM-FFI. grouped_mm never reads GPU values on the host unless visitor="host" is asked for.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from moe_gemm.capability import device_name, sm_count
from moe_gemm.config import GemmConfig
from moe_gemm.env import env_get
from moe_gemm.kernels.sm90.constants import DESC_RING, SLOT_INTS, split_workspace_bytes
from moe_gemm.ops import kernel_cache as cache
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.heuristics import KernelChoice, choose_batched, choose_general, choose_varlen
from moe_gemm.ops.support import (
    TMA_ALIGN_BYTES,
    GeneralLayout,
    analyze_general,
    operand_major,
    tma_view,
)
from moe_gemm.ops.validation import GroupedBmmArgs, GroupedGemmArgs, GroupedMmArgs

_TORCH_TO_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_local = threading.local()

# Programmatic dependent launch of the main kernel (see GroupedGemmSm90.__call__): opt-in
# (MOE_GEMM_PDL=1). Measured neutral on an H200 (2026-11-21, scripts/tune.py back-to-back,
# on / off): mixtral 2831 / 2826 us, uniform list 559 / 555, moe-decode 288 / 283,
# k-varying 122 / 124; the GPU tests pass both ways. A module attribute so tune.py can
# compare both in one process.
PDL = 1 if os.environ.get("MOE_GEMM_PDL", "0") not in ("", "0") else 0


@dataclass(frozen=True)
class LaunchInfo:
    """What the last launch on this thread used (for tests, benchmarks and `trace`)."""

    choice: KernelChoice
    num_ctas: int
    num_problems: int
    order: tuple[int, ...] | None
    trace: torch.Tensor | None


def last_launch() -> LaunchInfo | None:
    """The LaunchInfo of this thread's last launch (the same object until the next launch).

    Launches record a plain tuple (cheaper on the per-call path); it becomes a LaunchInfo here.
    """
    raw = getattr(_local, "raw", None)
    if raw is None:
        return None
    if getattr(_local, "info_of", None) is not raw:
        _local.info = LaunchInfo(*raw)
        _local.info_of = raw
    return _local.info


def _compile_key(form, ab, d, b_major, choice: KernelChoice, trace: bool):
    from moe_gemm.kernels.sm90.compile import CompileKey

    return CompileKey(
        form, _TORCH_TO_NAME[ab], _TORCH_TO_NAME[d], b_major, choice.schedule, choice.visitor,
        choice.tile_m, choice.tile_n, choice.stages, trace, choice.l2_hints, choice.epi_n,
        choice.cluster_m, choice.cluster_n, choice.epi_whole, choice.tail_split,
    )


@functools.lru_cache(maxsize=16)
def max_clusters(device_index: int, size: int, nsm: int) -> int:
    """How many `size`-CTA clusters of our kernel (one CTA per SM) can be resident at once:
    the persistent grid must not exceed it, or the excess clusters would wait for the first
    ones to finish. GPCs have an uneven SM count, so this can be below nsm / 2 (H200: 66)."""
    if size == 1:
        return nsm
    try:
        from cutlass.utils import HardwareInfo

        return max(1, int(HardwareInfo(device_index).get_max_active_clusters(size)))
    except Exception:  # noqa: BLE001 - a driver without the query: a safe lower bound
        return max(1, nsm // (2 * size))


def _device_index(device: torch.device | None) -> int:
    """A CUDA device's index (None or no index: the current device)."""
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _grid(device: torch.device, nsm: int, size: int, units: int) -> tuple[int, int]:
    """(CTAs, units per cluster upper bound) for `units` cluster tiles of work."""
    idx = _device_index(device)
    clusters = max(1, min(max_clusters(idx, size, nsm), nsm // size, units))
    return clusters * size, -(-units // clusters)


@functools.lru_cache(maxsize=256)
def _kernel_for(form, ab, d, b_major, choice: KernelChoice, trace: bool):
    """The compiled kernel for a launch's static choices (one dict lookup per call)."""
    return _compiled(_compile_key(form, ab, d, b_major, choice, trace))


@functools.lru_cache(maxsize=64)
def _general_placeholders(device: torch.device, ab: torch.dtype, d: torch.dtype, b_major: str):
    """The general form's unused/seed arguments (the real operands come from the metadata)."""
    return _new_placeholders(device, ab, d, b_major)


def _new_placeholders(device, ab, d, b_major):
    return (
        _new_small("seed_a", device, ab, (128, 64), "n"),
        _new_small("seed_w", device, ab, (64, 64), b_major),
        _new_small("seed_d", device, d, (128, 64), "n"),
        _new_small("offs", device, torch.int32, (1,), "n"),
        _new_small("table", device, torch.int32, (1, 1, 2), "n"),
        _new_small("trace", device, torch.int32, (1, 1, 4), "n"),
    )


def _table_device(device: torch.device | None) -> str | None:
    """The name tuned tables are keyed by: the CUDA device's, None elsewhere (rules only)."""
    return device_name(device) if device is not None and device.type == "cuda" else None


def _maybe_autotune(form: str, args, config: GemmConfig) -> None:
    """Online autotune (MOE_GEMM_AUTOTUNE=1, moe_gemm.tuning.online) of a new grouped_mm
    signature, before its kernel is chosen; never while a CUDA graph is being captured."""
    if env_get("MOE_GEMM_AUTOTUNE") and not _capturing():
        from moe_gemm.tuning import online

        if online.requested(config):
            tune = online.ensure_tuned_varlen if form == "varlen" else online.ensure_tuned_batched
            tune(args, config)


def _compiled(key):
    from moe_gemm.kernels.sm90.compile import compile_variant

    return cache.get_or_compile(key, key.name, lambda: compile_variant(key))


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (one C call: this runs per launch;
    everything in this module runs on CUDA devices only)."""
    return torch._C._cuda_isCurrentStreamCapturing()


_workspaces: dict[tuple, torch.Tensor] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda idx: torch.cuda.current_stream(idx).cuda_stream
)


def _kernel_workspace(device: torch.device, num_ctas: int, choice: KernelChoice) -> torch.Tensor:
    """The launch's workspace: the CTAs' descriptor rings, and with the tail split its
    counters (zero between launches: each finisher resets its own) and partial tiles."""
    if not choice.tail_split:
        return _workspace(device, num_ctas * DESC_RING * SLOT_INTS)
    total = split_workspace_bytes(num_ctas, choice.tile_m, choice.tile_n)[2]
    return _workspace(device, -(-total // 8), zeroed=True)


def _workspace(device: torch.device, ints: int, zeroed: bool = False) -> torch.Tensor:
    """The descriptor rings the kernel's scheduler warps write and its load/store warps read.

    Reused per (device, stream, thread, size): launches on one stream run one after the other
    (under the opt-in PDL a kernel waits on griddepcontrol before touching global memory), so
    no two launches ever use one workspace at once. Saves an allocator call per call (~1.5 us
    of host time). Never reused while a CUDA graph is being captured: a captured workspace
    belongs to the graph.
    """
    idx = _device_index(device)
    new = torch.zeros if zeroed else torch.empty
    if _capturing():
        return new(ints, dtype=torch.int64, device=device)  # (a zeroing is captured too)
    # `zeroed` in the key: a tail-split kernel's counters must never share memory with
    # another kernel's descriptor rings.
    key = (idx, _raw_stream(idx), threading.get_ident(), ints, zeroed)
    ws = _workspaces.get(key)
    if ws is None:
        if len(_workspaces) >= 256:
            _workspaces.clear()  # the caching allocator keeps the memory stream-ordered
        ws = _workspaces[key] = new(ints, dtype=torch.int64, device=device)
    return ws


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


_graph_keepalive: list[torch.Tensor] = []
# Uploaded general-form metadata by (shape, device, stream, operand addresses and leading
# dims, out addresses and strides); see GeneralLaunch. 64 entries of G * 64 bytes of GPU memory.
META_CACHE_ENTRIES = 64
_meta_cache: dict[tuple, torch.Tensor] = {}


class GeneralShape:
    """Everything about a general-form launch that depends only on the problem sizes, dtypes,
    B's major, the config and the device's SM count: the kernel choice, problem order, grid,
    compiled kernel, and the layout of the outputs we allocate. Built once per problem set
    (general_shape caches it), so a repeated grouped_gemm call only gathers pointers.

    Own outputs live in one allocation: with one N for all problems (every MoE layer) a
    (sum M_i, N) block split by rows in one call; otherwise a flat block of 16-byte-padded
    pieces. Their byte offsets from the block's start are fixed here, so the per-call
    metadata needs the block's address only.
    """

    def __init__(self, sizes: tuple, ab: torch.dtype, d: torch.dtype, b_major: str,
                 config: GemmConfig, nsm: int, trace: bool, device: torch.device | None = None):
        self.G = G = len(sizes)
        self.sizes = sizes
        self.ab_dtype = ab
        self.out_dtype = d
        self.b_major = b_major
        self.choice = choice = choose_general(
            config, sizes, nsm, d.itemsize, device=_table_device(device),
            dtype=_TORCH_TO_NAME[ab], out_dtype=_TORCH_TO_NAME[d])
        order = sched.ksort_permutation(sizes) if choice.sort_by_k else None
        # None when the order is the caller's: the per-call metadata then skips a gather.
        self.order = tuple(order) if order and order != list(range(G)) else None
        self.order_np = np.asarray(self.order, dtype=np.int64) if self.order else None
        self.launch_order = self.order or tuple(range(G))  # what LaunchInfo reports
        ordered = [sizes[i] for i in self.order] if self.order else sizes
        self.counts = tuple(sched.tiles_per_problem(ordered, choice.tile_m, choice.tile_n))
        self.total = sum(self.counts)
        size = choice.cluster_m * choice.cluster_n
        if size == 1:
            self.num_ctas = max(1, min(nsm, self.total))
            self.max_tiles = -(-self.total // self.num_ctas)  # records per CTA, at most
        else:
            # A cluster walks cluster tiles (units): pairs of adjacent tiles of one problem.
            units = sum(sched.tiles_per_problem(ordered, choice.tile_m * choice.cluster_m,
                                                choice.tile_n * choice.cluster_n))
            self.num_ctas, self.max_tiles = _grid(None, nsm, size, units)
        elem = d.itemsize
        ns = {n for _, n, _ in sizes}
        if len(ns) == 1:  # rows of one width: every piece starts on a row, 16-byte aligned
            n = ns.pop()
            self.rows: list[int] | None = [m for m, _, _ in sizes]
            self.out_shape = (sum(self.rows), n)
            pieces = [m * n for m in self.rows]  # n * elem is a 16-byte multiple (support)
        else:
            self.rows = None
            pad = max(1, TMA_ALIGN_BYTES // elem)
            self.lens = pieces = [-(-(m * n) // pad) * pad for m, n, _ in sizes]
            self.out_shape = (sum(self.lens),)
        d_off = [start * elem for start in itertools.accumulate(pieces, initial=0)][:G]
        d_ld = [n for _, n, _ in sizes]
        # Metadata columns that do not change between calls, in the caller's problem order:
        # [D byte offset, D leading dim, M | N << 32, K].
        self.static = np.array(
            [[off, ld, m | (n << 32), k] for off, ld, (m, n, k) in zip(d_off, d_ld, sizes)],
            dtype=np.int64).reshape(G, 4)
        self.kernel = (_kernel_for("general", ab, d, b_major, choice, trace)
                       if self.total else None)

    def new_outputs(self, device: torch.device) -> tuple[list[torch.Tensor], int]:
        """The G outputs as views of one fresh allocation, and its address."""
        block = torch.empty(self.out_shape, dtype=self.out_dtype, device=device)
        if self.rows is not None:
            return list(block.split_with_sizes(self.rows)), block.data_ptr()
        parts = block.split_with_sizes(self.lens)
        return ([p[: m * n].view(m, n) for p, (m, n, _) in zip(parts, self.sizes)],
                block.data_ptr())

    def metadata(self, a_ptr, b_ptr, a_ld, b_ld, out_cols=None) -> torch.Tensor:
        """The (G, 8) int64 rows [a_ptr, b_ptr, d_ptr - d_base, a_ld, b_ld, d_ld, M | N << 32,
        K] in launch order, in pinned host memory, filled column by column (numpy).
        out_cols: a caller's outputs (addresses, row strides); None = our block's layout."""
        meta = _pinned((self.G, 8), torch.int64)
        m = meta.numpy()
        m[:, 0] = a_ptr
        m[:, 1] = b_ptr
        m[:, 3] = a_ld
        m[:, 4] = b_ld
        m[:, 6:] = self.static[:, 2:]
        if out_cols is None:
            m[:, 2] = self.static[:, 0]
            m[:, 5] = self.static[:, 1]
        else:
            m[:, 2], m[:, 5] = out_cols
        if self.order_np is not None:
            m[:] = m[self.order_np]
        return meta


@functools.lru_cache(maxsize=256)
def general_shape(sizes: tuple, ab: torch.dtype, d: torch.dtype, b_major: str,
                  config: GemmConfig, nsm: int, trace: bool, l2_env: str | None,
                  device: torch.device) -> GeneralShape:
    """The GeneralShape of a problem set, cached (l2_env: MOE_GEMM_L2_HINTS, which the kernel
    choice reads, so a changed switch gets a new entry; device: its name picks tuned
    tables)."""
    return GeneralShape(sizes, ab, d, b_major, config, nsm, trace, device)


def grouped_gemm_cute(
    args: GroupedGemmArgs, config: GemmConfig, *, layout: GeneralLayout | None = None,
    trace: bool = False,
) -> list[torch.Tensor]:
    return GeneralLaunch(args, config, layout=layout, trace=trace).launch()


def _general_table(shape: GeneralShape, device: torch.device, placeholders: tuple):
    """The host visitor's tile table, or the unused placeholder for the device visitor."""
    if shape.choice.visitor == "host":
        return _table_tensor(shape.counts, shape.num_ctas, device)
    return placeholders[4]


def _general_args(shape: GeneralShape, placeholders: tuple, meta_dev: torch.Tensor, table,
                  workspace: torch.Tensor, trace_t: torch.Tensor) -> tuple:
    """The general kernel's arguments but the last (d_base), in its signature's order."""
    choice = shape.choice
    seed_a, seed_w, seed_d, offs = placeholders[:4]
    return (seed_a, seed_w, seed_d, meta_dev, meta_dev.view(torch.int32), offs, table,
            workspace, trace_t, shape.G, shape.num_ctas, choice.swizzle, choice.a_policy,
            choice.b_policy, PDL)


class GeneralLaunch:
    """One general-form launch prepared: kernel and grid (from the cached GeneralShape),
    per-problem metadata, outputs. grouped_gemm builds one per call; a GroupedGemmPlan keeps
    one (persistent=True: the metadata is uploaded once and each launch only re-copies
    minority-layout B operands)."""

    def __init__(self, args: GroupedGemmArgs, config: GemmConfig, *,
                 layout: GeneralLayout | None = None, trace: bool = False,
                 persistent: bool = False):
        if layout is None:
            res = analyze_general(args)
            if isinstance(res, str):
                raise ValueError(f"backend='cute' cannot take this input: {res}")
            layout = res
        self.device = device = args.device
        self.G = len(args.a)
        self.trace = trace
        self.persistent = persistent
        self.shape = shape = general_shape(
            tuple(args.sizes), args.dtype, args.out_dtype, layout.b_major, config,
            sm_count(device), trace, env_get("MOE_GEMM_L2_HINTS"), device)
        self.choice = shape.choice
        b_major = layout.b_major
        b_ptr, b_ld = layout.b_ptr, layout.b_ld
        self.fixes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (B as given, its copy)
        if layout.b_fix:
            b_ptr, b_ld = list(b_ptr), list(b_ld)
            for i in layout.b_fix:
                b = args.b[i]
                fixed = b.t().contiguous().t() if b_major == "k" else b.contiguous()
                self.fixes.append((b, fixed))
                b_ptr[i] = fixed.data_ptr()
                b_ld[i] = fixed.stride(1) if b_major == "k" else fixed.stride(0)
        if args.out is None:
            outs, self.d_base = shape.new_outputs(device)
        else:
            outs, self.d_base = args.out, 0
        self.outs = outs
        if shape.total == 0:
            return
        capturing = _capturing()
        if capturing and persistent:
            raise RuntimeError("build a GroupedGemmPlan outside CUDA-graph capture (its "
                               "launches can be captured)")
        # The metadata depends on the operands' addresses and leading dims only (our own
        # outputs enter as offsets from d_base, a kernel argument): a repeated call on the
        # same buffers, the usual serving loop, reuses the uploaded copy and skips the
        # pinned staging buffer and the host-to-device copy (~10 us of the per-call cost).
        # A caller's `out`: its addresses and row strides are metadata columns (d_base is 0).
        out_cols = (None if args.out is None else
                    ([o.data_ptr() for o in outs], [o.stride(0) for o in outs]))
        key = None
        if not (persistent or capturing or self.fixes):
            idx = _device_index(device)
            operands = tuple(layout.a_ptr + b_ptr + layout.a_ld + b_ld)
            key = (shape, idx, _raw_stream(idx), operands,
                   None if out_cols is None else tuple(out_cols[0] + out_cols[1]))
            meta_dev = _meta_cache.get(key)
        else:
            meta_dev = None
        if meta_dev is None:
            meta = shape.metadata(layout.a_ptr, b_ptr, layout.a_ld, b_ld, out_cols)
            if persistent:
                meta_dev = meta.to(device)  # once, synchronously: the pinned buffer can go
            else:
                meta_dev = meta.to(device, non_blocking=True)
            if capturing:
                # The captured copy reads this pinned buffer at every replay: keep it alive.
                _graph_keepalive.append(meta)
                _graph_keepalive.extend(f for _, f in self.fixes)
            elif key is not None:
                if len(_meta_cache) >= META_CACHE_ENTRIES:
                    # Oldest first. Safe while a launch may still read it: the entry was made
                    # on this key's stream, so the allocator reuses it only after that work.
                    # (pop, not del: another thread may have evicted the same entry)
                    _meta_cache.pop(next(iter(_meta_cache), None), None)
                _meta_cache[key] = meta_dev
        self.meta_dev = meta_dev
        if capturing:
            placeholders = _new_placeholders(device, args.dtype, args.out_dtype, b_major)
        else:
            placeholders = _general_placeholders(device, args.dtype, args.out_dtype, b_major)
        self.placeholders = placeholders
        self.table = _general_table(shape, device, placeholders)

    def launch(self) -> list[torch.Tensor]:
        shape = self.shape
        if shape.total == 0:
            return list(self.outs)
        if self.persistent:
            for b, fixed in self.fixes:  # B may have new values since the plan was built
                fixed.copy_(b)
        num_ctas = shape.num_ctas
        # Per CTA, a ring of descriptor slots that the scheduler warp writes.
        workspace = _kernel_workspace(self.device, num_ctas, shape.choice)
        trace_t = (_trace_tensor(num_ctas, shape.max_tiles, self.device)
                   if self.trace else self.placeholders[5])
        shape.kernel(*_general_args(shape, self.placeholders, self.meta_dev, self.table,
                                    workspace, trace_t), self.d_base)
        _local.raw = (shape.choice, num_ctas, self.G, shape.launch_order,
                      trace_t if self.trace else None)
        return list(self.outs)


class MmPlan:
    """Everything about a grouped_mm launch that depends only on shapes, strides, dtypes and
    the config: built once per signature (ops.grouped_mm caches it), so a repeated call costs
    two allocations and the kernel call."""

    def __init__(self, args: GroupedMmArgs, config: GemmConfig, trace: bool = False):
        x, w = args.x, args.w
        self.device = device = x.device
        T, K, E, N = args.T, args.K, args.E, args.N
        self.T, self.N, self.E = T, N, E
        self.out_dtype = args.out_dtype
        self.zero_tail = args.out is None
        self.trivial = T == 0 or N == 0 or E == 0
        if self.trivial:
            return
        nsm = sm_count(device)
        _maybe_autotune("varlen", args, config)
        self.choice = choice = choose_varlen(
            config, T, E, N, K, nsm, args.out_dtype.itemsize, device=_table_device(device),
            dtype=_TORCH_TO_NAME[args.dtype], out_dtype=_TORCH_TO_NAME[args.out_dtype])
        b_major = "k" if operand_major(w) == "col" else "n"
        self.num_problems = E + (1 if self.zero_tail else 0)
        self.tiles_n = -(-N // choice.tile_n)
        self.nsm = nsm
        self.trace = trace
        if choice.visitor == "device":
            # Upper bound on (cluster) tiles: sum over experts of ceil(rows_e / unit) is at
            # most ceil(T / unit) + one partial unit per problem.
            unit = choice.tile_m * choice.cluster_m
            units_n = -(-N // (choice.tile_n * choice.cluster_n))
            bound = (-(-T // unit) + self.num_problems) * units_n
            self.num_ctas, self.max_tiles = _grid(device, nsm, choice.cluster_m * choice.cluster_n,
                                                  bound)
        self.meta = _small("meta", device, torch.int64, (1, 8))
        self.meta32 = self.meta.view(torch.int32)
        self.no_table = _small("table", device, torch.int32, (1, 1, 2))
        self.no_trace = _small("trace", device, torch.int32, (1, 1, 4))
        self.kernel = _compiled(_compile_key("varlen", args.dtype, args.out_dtype, b_major,
                                             choice, trace))

    def __call__(self, x, w, offs, out):
        if out is None:
            out = torch.empty(self.T, self.N, dtype=self.out_dtype, device=self.device)
        if self.trivial:
            return out.zero_() if self.zero_tail and self.E == 0 else out
        choice = self.choice
        if choice.visitor == "host":
            # The host visitor needs per-expert sizes on the host: one device-to-host copy
            # of offs (a synchronisation). "auto" never picks it for grouped_mm.
            T = self.T
            bounds = offs.to("cpu", torch.int64).clamp(0, T).tolist()
            starts = [0] + bounds[:-1]
            rows = [max(0, e - s) for s, e in zip(starts, bounds)]
            if self.zero_tail:
                rows.append(max(0, T - (bounds[-1] if bounds else 0)))
            counts = tuple(-(-r // choice.tile_m) * self.tiles_n for r in rows)
            total = sum(counts)
            if total == 0:
                return out
            num_ctas = max(1, min(self.nsm, total))
            table = _table_tensor(counts, num_ctas, self.device)
            max_tiles = -(-total // num_ctas)
        else:
            num_ctas, table, max_tiles = self.num_ctas, self.no_table, self.max_tiles
        # Per CTA, a ring of DESC_RING D descriptors that the scheduler warp writes.
        workspace = _kernel_workspace(self.device, num_ctas, choice)
        trace_t = _trace_tensor(num_ctas, max_tiles, self.device) if self.trace else self.no_trace
        self.kernel(x, w, out, self.meta, self.meta32, offs, table, workspace, trace_t,
                    self.num_problems, num_ctas, choice.swizzle, choice.a_policy,
                    choice.b_policy, PDL, 0)
        _local.raw = (choice, num_ctas, self.num_problems, None,
                      trace_t if self.trace else None)
        return out

def grouped_mm_cute(args: GroupedMmArgs, config: GemmConfig, *, trace: bool = False
                    ) -> torch.Tensor:
    offs = args.offs if args.offs.is_contiguous() else args.offs.contiguous()
    return MmPlan(args, config, trace)(args.x, args.w, offs, args.out)


class BmmPlan:
    """grouped_mm's 3D x 3D (batched) launch, built once per signature like MmPlan: one
    descriptor per operand, no per-problem metadata, so a call is O(1) on the host."""

    def __init__(self, args: GroupedBmmArgs, config: GemmConfig, trace: bool = False):
        x, w = args.x, args.w
        self.device = device = x.device
        G, M, N, K = args.G, args.M, args.N, args.K
        self.shape = (G, M, N)
        self.out_dtype = args.out_dtype
        self.trivial = G == 0 or M == 0 or N == 0
        self.zero = K == 0
        if self.trivial or self.zero:
            return
        nsm = sm_count(device)
        _maybe_autotune("batched", args, config)
        self.choice = choice = choose_batched(
            config, G, M, N, K, nsm, args.out_dtype.itemsize, device=_table_device(device),
            dtype=_TORCH_TO_NAME[args.dtype], out_dtype=_TORCH_TO_NAME[args.out_dtype])
        self.w_major = "k" if operand_major(w) == "col" else "n"
        self.w_unit = 1 if self.w_major == "k" else 2
        self.tiles = G * (-(-M // (choice.tile_m * choice.cluster_m))) * (
            -(-N // (choice.tile_n * choice.cluster_n)))
        self.num_ctas, self.max_tiles = _grid(device, nsm, choice.cluster_m * choice.cluster_n,
                                              self.tiles)
        self.trace = trace
        self.meta = _small("meta", device, torch.int64, (1, 8))
        self.meta32 = self.meta.view(torch.int32)
        self.offs = _small("offs", device, torch.int32, (1,))
        self.no_table = _small("table", device, torch.int32, (1, 1, 2))
        self.no_trace = _small("trace", device, torch.int32, (1, 1, 4))
        self.workspace = _small("workspace", device, torch.int64, (16,))
        self.kernel = _compiled(_compile_key("batched", args.dtype, args.out_dtype,
                                             self.w_major, choice, trace))
        # Plans are cached per strides (ops._bmm_plan_key), so whether a size-1 dimension's
        # stride needs rewriting is known here; our own `out` is contiguous and never does.
        self.fix_x = tma_view(x, 2) is not x
        self.fix_w = tma_view(w, self.w_unit) is not w
        self.fix_out = args.out is not None and tma_view(args.out, 2) is not args.out

    def __call__(self, x, w, out):
        if out is None:
            out = torch.empty(self.shape, dtype=self.out_dtype, device=self.device)
        if self.trivial:
            return out
        if self.zero:
            return out.zero_()
        choice = self.choice
        trace_t = (_trace_tensor(self.num_ctas, self.max_tiles, self.device)
                   if self.trace else self.no_trace)
        xv = tma_view(x, 2) if self.fix_x else x
        wv = tma_view(w, self.w_unit) if self.fix_w else w
        ov = tma_view(out, 2) if self.fix_out else out
        workspace = (_kernel_workspace(self.device, self.num_ctas, choice)
                     if choice.tail_split else self.workspace)
        self.kernel(xv, wv, ov, self.meta,
                    self.meta32, self.offs, self.no_table, workspace, trace_t,
                    self.shape[0], self.num_ctas, choice.swizzle, choice.a_policy,
                    choice.b_policy, PDL, 0)
        _local.raw = (choice, self.num_ctas, self.shape[0], None,
                      trace_t if self.trace else None)
        return out

def grouped_bmm_cute(args: GroupedBmmArgs, config: GemmConfig, *, trace: bool = False
                     ) -> torch.Tensor:
    return BmmPlan(args, config, trace)(args.x, args.w, args.out)


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

