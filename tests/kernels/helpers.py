"""Shared pieces of the GPU kernel tests: random operands, the 2x-rule check, and runners for
the three forms (general lists, varlen MoE, batched) that poison outputs and compare with a
float32 reference.

The 2x rule: the kernel's error may be at most twice that of torch's own low-precision GEMM
plus a small absolute term, and NaN (an unwritten element) never passes.
"""

from __future__ import annotations

import random
import zlib

import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops import schedule as sched

from .gpu_report import record

SCHEDULES = ["pingpong", "cooperative"]
VISITORS = ["device", "host"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CLUSTER_SHAPES = {"2x1": {"cluster_m": 2, "cluster_n": 1}, "1x2": {"cluster_m": 1, "cluster_n": 2}}
# Row counts on both sides of the 64-row line of a 128-row tile (where each math warpgroup's
# m64 slice starts).
EDGE_ROWS = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 320, 385, 448]


def rand(shape, dtype, gen):
    return (torch.randn(shape, generator=gen, device="cuda") * 0.5).to(dtype)


def check(name, out, ref32, low, **info):
    """2x rule against torch's low-precision result; NaN (an unwritten element) never passes."""
    if out.numel() == 0:
        record(name, True, max_rel_err=0.0, **info)
        return
    finite = bool(torch.isfinite(out).all())
    err = (out.float() - ref32).abs().max().item()
    base = (low.float() - ref32).abs().max().item()
    scale = ref32.abs().max().item() + 1e-6
    tol = 2 * base + 1e-3 * scale
    passed = finite and err <= tol
    record(name, passed, max_abs_err=err, max_rel_err=err / scale, baseline_err=base,
           finite=finite, **info)
    assert finite, f"{name}: output has NaN/inf (unwritten elements?)"
    assert err <= tol, f"{name}: max err {err:.3e} > tol {tol:.3e} (torch low-prec {base:.3e})"


def check_mm(name, y, x, w, offs):
    """grouped_mm's result against the fp32 reference, torch's bf16 experts as the baseline."""
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = moe_gemm.grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
    check(name, y, ref, low)


# ---------------------------------------------------------------------------------------------
# General form (grouped_gemm's lists)


def general_case(kind: str, rng: random.Random):
    if kind == "mixed":
        return [(1, 64, 64), (0, 128, 64), (130, 200, 72), (256, 512, 1024), (77, 8, 16),
                (128, 128, 0), (5, 1000, 4096), (129, 136, 7176)]
    if kind == "many":
        return [(rng.choice([0, 1, 3, 64, 100, 128, 200]), 8 * rng.randint(1, 40),
                 8 * rng.randint(2, 80)) for _ in range(1100)]
    if kind == "one":
        return [(300, 264, 7176)]
    if kind == "kvary":
        base = [(1152, 768, 128), (1152, 768, 1024), (768, 1152, 128), (768, 1152, 1024)]
        return base * 4
    if kind == "headline":
        return [(128, 512, 7168)] * 256
    raise ValueError(kind)


def run_general(name, sizes, dtype, b_layout, config, out_dtype=None, check_subset=None):
    """grouped_gemm into NaN-poisoned `out` tensors; b_layout "col" gives K-major B views."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    a = [rand((m, k), dtype, gen) for m, n, k in sizes]
    if b_layout == "col":
        b = [rand((n, k), dtype, gen).t() for m, n, k in sizes]
    else:
        b = [rand((k, n), dtype, gen) for m, n, k in sizes]
    odt = out_dtype or dtype
    out = [torch.full((m, n), float("nan"), dtype=odt, device="cuda") for m, n, k in sizes]
    res = moe_gemm.grouped_gemm(a, b, out=out, config=config)
    torch.cuda.synchronize()
    assert all(r is o for r, o in zip(res, out))
    idx = range(len(sizes)) if check_subset is None else check_subset
    for i in idx:
        ref = a[i].float() @ b[i].float()
        low = (a[i] @ b[i]).to(odt) if a[i].shape[1] > 0 else torch.zeros_like(ref).to(odt)
        check(f"{name}[{i}]", out[i], ref, low, size=sizes[i])
    # Every output element written, also outside the checked subset.
    assert all(bool(torch.isfinite(o).all()) for o in out), f"{name}: NaN left in an output"


def general_problems(seed, sizes=((64, 256, 512), (0, 256, 64), (129, 256, 1024),
                                  (1, 256, 72), (300, 256, 264))):
    """Fresh bf16 operands (row-major B) for a problem set; returns (a, b, generator)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = [rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    b = [rand((k, n), torch.bfloat16, gen) for m, n, k in sizes]
    return a, b, gen


def check_general(tag, res, a, b):
    for i, (ai, bi) in enumerate(zip(a, b)):
        ref = ai.float() @ bi.float()
        low = (ai @ bi) if ai.shape[1] else torch.zeros_like(ref).to(torch.bfloat16)
        check(f"{tag}[{i}]", res[i], ref, low)


# ---------------------------------------------------------------------------------------------
# Varlen (MoE) form: grouped_mm(x (T, K), w (E, K, N), offs)


def expert_counts(kind: str, E: int, T: int, gen: torch.Generator) -> list[int]:
    if kind == "zipf":
        w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        w = w[torch.randperm(E, generator=gen)]
        idx = torch.multinomial(w, T, replacement=True, generator=gen)
        return torch.bincount(idx, minlength=E).tolist()
    if kind == "edges":  # EDGE_ROWS (last m-tiles of 1, 63, 64, 65, 127, 128 rows...), an empty one
        base = [*EDGE_ROWS[:10], 0, *EDGE_ROWS[10:]]
        counts = (base * (E // len(base) + 1))[:E]
        counts[-1] += T - sum(counts)
        assert counts[-1] >= 0, "T too small for the edge pattern"
        return counts
    if kind == "holes":  # empty first, middle and last experts; odd sizes; sums to T
        base = [0, 1, 129, 0, 64, 300, 7, 0, 200, 0]
        counts = (base * (E // len(base) + 1))[:E]
        scale = T / max(1, sum(counts))
        counts = [int(c * scale) for c in counts]
        counts[E // 2 if E > 2 else 0] += T - sum(counts)
        return counts
    raise ValueError(kind)


def varlen_low(x, w, counts) -> torch.Tensor:
    """The experts' rows computed in x's dtype by torch (the low-precision baseline `check`
    compares against), for the first sum(counts) rows of x."""
    rows = sum(counts)
    low = torch.zeros(rows, w.shape[2], dtype=x.dtype, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c:
            low[start:start + c] = x[start:start + c] @ w[e]
        start += c
    return low


def switch_case(counts, K, seed, tail, schedule, tile, cluster, N=264):
    """The operands of a kernel-switch A/B on grouped_mm (bf16, K-major w): (x, w, offs, T,
    config) for experts of `counts` rows and `tail` rows past offs[-1], pinned to `schedule`,
    `tile` (m, n) and `cluster` (m, n)."""
    T = sum(counts) + tail
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = rand((T, K), torch.bfloat16, g)
    w = rand((len(counts), N, K), torch.bfloat16, g).transpose(1, 2)
    cfg = GemmConfig(backend="cute", schedule=schedule, tile_m=tile[0], tile_n=tile[1],
                     cluster_m=cluster[0], cluster_n=cluster[1])
    return x, w, offs, T, cfg


def run_varlen(name, E, T, N, K, counts_kind, dtype, w_layout, config, out_mode, tail=0):
    """grouped_mm with `tail` rows past offs[-1]; out_mode "given" checks they stay untouched."""
    gen = torch.Generator().manual_seed(99)
    counts = expert_counts(counts_kind, E, T - tail, gen)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = rand((T, K), dtype, g)
    if w_layout == "nk_view":
        w = rand((E, N, K), dtype, g).transpose(1, 2)
    else:
        w = rand((E, K, N), dtype, g)
    if out_mode == "given":
        out = torch.full((T, N), float("nan"), dtype=dtype, device="cuda")
        out[T - tail:] = 7.0  # rows past offs[-1] must stay untouched
        y = moe_gemm.grouped_mm(x, w, offs, out=out, config=config)
        assert y is out
    else:
        y = moe_gemm.grouped_mm(x, w, offs, config=config)
    torch.cuda.synchronize()
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = torch.zeros_like(y)
    low[:T - tail] = varlen_low(x, w, counts)
    if out_mode == "given" and tail:
        untouched = bool((y[T - tail:] == 7.0).all())
        record(f"{name}/tail-untouched", untouched)
        assert untouched, "rows past offs[-1] were written"
        check(name, y[:T - tail], ref[:T - tail], low[:T - tail], E=E, T=T, N=N, K=K)
    else:
        check(name, y, ref, low, E=E, T=T, N=N, K=K)


# ---------------------------------------------------------------------------------------------
# Batched form: grouped_mm(x (G, M, K), w (G, K, N)) without offs


def run_batched(name, G, M, N, K, dtype=torch.bfloat16, w_layout="kn", config=None,
                out_mode="alloc", out_dtype=None, x_view=False):
    """out_mode: "alloc" (ours), "given" (NaN-poisoned), "view" (rows of a wider buffer)."""
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    if x_view:  # a strided slice: problem stride > M * K, row stride > K
        x = rand((G, M + 3, K + 8), dtype, gen)[:, 1:M + 1, 8:]
    else:
        x = rand((G, M, K), dtype, gen)
    if w_layout == "kn":
        w = rand((G, K, N), dtype, gen)
    else:  # the transpose of an (G, N, K) weight: K contiguous
        w = rand((G, N, K), dtype, gen).transpose(1, 2)
    odt = out_dtype or dtype
    out = None
    if out_mode == "given":
        out = torch.full((G, M, N), float("nan"), dtype=odt, device="cuda")
    elif out_mode == "view":  # rows of a wider buffer
        out = torch.full((G, M, N + 8), float("nan"), dtype=odt, device="cuda")[:, :, :N]
    cfg = config or GemmConfig(backend="cute")
    y = moe_gemm.grouped_mm(x, w, out=out, config=cfg, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert y.shape == (G, M, N) and y.dtype == odt
    if out is not None:
        assert y.data_ptr() == out.data_ptr()
    ref = x.float() @ w.float()
    low = torch.bmm(x, w).to(odt) if G else ref.to(odt)
    check(name, y, ref, low, G=G, M=M, N=N, K=K)
    return y


# ---------------------------------------------------------------------------------------------
# Tail split (cooperative, K >= 4096 by default; kernels/sm90/constants.py): a last wave of at
# most half the grid runs as half-K units on two CTAs joined through an fp32 workspace slot.

TS_N = 2048  # 8 n-tiles of 128x256
TS_K = 4096


def tail_split_counts(num_ctas: int, zero_tail_tiles: int) -> list[int]:
    """Expert rows (empty experts, 1 row, edges of a 128-row tile) whose tile count (plus
    the zero tail's m-tiles, when the kernel writes it) leaves a last wave of at most half the
    grid, so the kernel splits it."""
    counts = [1, 0, 700, 129, 1000, 300, 77, 0, 64]
    while True:
        m_tiles = sum(-(-c // 128) for c in counts) + zero_tail_tiles
        if sched.tail_split_units(m_tiles * TS_N // 256, num_ctas, TS_K // 64) is not None:
            return counts
        counts[2] += 128


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


# The masked layout's GPU tests (test_masked_gpu.py, test_fused_masked_gpu.py): row counts and
# the rows of a (G, M, N) tensor below and past them.
def masked_counts(values) -> torch.Tensor:
    """(G,) int32 row counts on the GPU."""
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def clamped_counts(counts, M) -> list[int]:
    """What the kernel reads: each count clamped into [0, M]."""
    return [max(0, min(int(c), M)) for c in counts]


def valid_rows(t, rows) -> torch.Tensor:
    """The valid rows of a (G, M, N) tensor, stacked: (sum(rows), N)."""
    return torch.cat([t.new_empty((0, t.shape[2]))] + [t[g, :r] for g, r in enumerate(rows)])


def rows_past(t, rows) -> torch.Tensor:
    """The rows at and past each problem's count, stacked."""
    return torch.cat([t.new_empty((0, t.shape[2]))] + [t[g, r:] for g, r in enumerate(rows)])
