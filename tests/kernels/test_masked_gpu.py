"""GPU tests of the masked form (DeepGEMM's masked layout): grouped_mm_masked and
scaled_grouped_mm_masked, x (G, M, K) @ w (G, K, N) on each problem's first masked_m[g] rows.

Only the valid rows are compared (rows past the counts of a new output are unspecified): the
16-bit kernel against float32 x @ w by the 2x rule (helpers.check), the FP8 kernel against the
fp64 product of the dequantized operands (scaled_grouped_mm_ref). Cases: both schedules, both
w layouts and both 16-bit dtypes with counts on every side of the 64- and 128-row lines;
decode-like to prefill-like shapes, N and K off the tiles; pinned tiles and clusters; fp32 and
fp16 outputs; a given `out` (NaN-filled) whose rows past the counts must keep the NaN; strided
operands and counts; unchecked counts (negative, past M) clamped into [0, M] by the kernel and
never a write outside `out`; CUDA-graph replay with new counts; no host synchronisation; FP8
block and row-wise scales.
"""

from __future__ import annotations

import pytest
import torch

from moe_gemm import GemmConfig, grouped_mm_masked, scaled_grouped_mm_masked
from moe_gemm.ops import launch_info
from moe_gemm.ops.scaled_reference import scaled_grouped_mm_ref
from moe_gemm.testing_fp8 import REL_BOUND, fp8_errors, make_fp8_batched_inputs

from .gpu_report import record
from .helpers import (
    CLUSTER_SHAPES,
    DTYPES,
    SCHEDULES,
    check,
    clamped_counts,
    masked_counts,
    rows_past,
    valid_rows,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
NAN = float("nan")
# Row counts on both sides of the 64-row line of a 128-row tile and of the tile, an empty and
# a full (M = 200) problem: G = 6 per call, all seven over the matrix test's two calls.
MATRIX_A = [0, 1, 63, 64, 65, 200]
MATRIX_B = [129, 200, 65, 0, 1, 63]


def cute(**fields) -> GemmConfig:
    return GemmConfig(backend="cute", **fields)


def _rand(shape, dtype, gen):
    return (torch.randn(shape, generator=gen, device=DEV) * 0.5).to(dtype)


def _operands(G, M, N, K, dtype=BF16, w_layout="kn", seed=0):
    """x (G, M, K) and w (G, K, N): row-major ("kn") or the transpose of a (G, N, K) weight
    ("nk_view", K contiguous)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = _rand((G, M, K), dtype, gen)
    if w_layout == "kn":
        w = _rand((G, K, N), dtype, gen)
    else:
        w = _rand((G, N, K), dtype, gen).transpose(1, 2)
    return x, w


def _ran_kernel(before) -> bool:
    """Whether a kernel launch was recorded since `before` (launch_info._local.raw's identity)."""
    return getattr(launch_info._local, "raw", None) is not before


def _tile() -> str:
    c = launch_info.last_launch().choice
    return f"{c.schedule} {c.tile_m}x{c.tile_n} c{c.cluster_m}x{c.cluster_n}"


def check_masked(name, y, x, w, counts, **info):
    """y's valid rows (the counts clamped into [0, M]) against float32 x @ w, torch's own
    product in y's dtype as the 2x rule's baseline."""
    G, M, K = x.shape
    N = w.shape[2]
    rows = clamped_counts(counts, M)
    empty = torch.zeros(0, N, device=x.device)
    ref = torch.cat([empty] + [x[g, :r].float() @ w[g].float() for g, r in enumerate(rows)])
    low = torch.cat([empty.to(y.dtype)]
                    + [(x[g, :r] @ w[g]).to(y.dtype) for g, r in enumerate(rows)])
    check(name, valid_rows(y, rows), ref, low, G=G, M=M, N=N, K=K, **info)


def check_untouched(name, out, counts):
    """The rows at and past each (clamped) count still hold the NaN they were filled with."""
    past = rows_past(out, clamped_counts(counts, out.shape[1]))
    untouched = bool(torch.isnan(past.float()).all())
    record(f"{name}/rows-past-counts-untouched", untouched)
    assert untouched, f"{name}: rows past masked_m were written"


def run_masked(name, G, M, N, K, counts, *, dtype=BF16, w_layout="kn", config=None,
               out_mode="given", out_dtype=None, expected_m=None, seed=0):
    """grouped_mm_masked into a NaN-filled `out` ("given") or a new output ("alloc")."""
    x, w = _operands(G, M, N, K, dtype, w_layout, seed)
    mm = masked_counts(counts)
    odt = out_dtype or dtype
    cfg = config or cute()
    before = getattr(launch_info._local, "raw", None)
    if out_mode == "given":
        out = torch.full((G, M, N), NAN, dtype=odt, device=DEV)
        y = grouped_mm_masked(x, w, mm, expected_m=expected_m, out=out, config=cfg,
                              out_dtype=out_dtype)
        assert y is out
    else:
        y = grouped_mm_masked(x, w, mm, expected_m=expected_m, config=cfg, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert y.shape == (G, M, N) and y.dtype == odt
    assert _ran_kernel(before), f"{name}: the masked kernel did not run"
    check_masked(name, y, x, w, counts, tile=_tile())
    if out_mode == "given":
        check_untouched(name, y, counts)
    return x, w, mm, y


# ---------------------------------------------------------------------------------------------
# 16-bit: numerics


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_masked_matrix(schedule, w_layout, dtype):
    name = f"masked/{schedule}/{w_layout}/{dtype}"
    cfg = cute(schedule=schedule)
    x, w, mm, _ = run_masked(name, 6, 200, 264, 136, MATRIX_A, dtype=DTYPES[dtype],
                             w_layout=w_layout, config=cfg, seed=1)
    assert launch_info.last_launch().choice.schedule == schedule
    # New counts in place (the cached plan reads them at launch), a new output.
    mm.copy_(masked_counts(MATRIX_B))
    y = grouped_mm_masked(x, w, mm, config=cfg)
    torch.cuda.synchronize()
    check_masked(f"{name}/new-counts", y, x, w, MATRIX_B, tile=_tile())


SHAPES = {
    # decode: a few tokens per expert (DeepEP low-latency dispatch), long K
    "decode": (32, 128, 4096, 7168, [g % 9 for g in range(32)], 8),
    # prefill: many rows per expert, some experts empty or full
    "prefill": (8, 1024, 2048, 1024, [1024, 0, 1, 511, 1000, 1024, 129, 768], None),
    # N and K not multiples of the tiles (N = 200: a partial n-tile; K = 72: a partial k-tile)
    "odd-nk": (5, 130, 200, 72, [0, 130, 7, 64, 129], None),
    "M=1": (16, 1, 256, 128, [g % 2 for g in range(16)], None),
    "G=1": (1, 513, 384, 520, [300], None),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("out_mode", ["given", "alloc"])
def test_masked_shapes(shape, out_mode):
    G, M, N, K, counts, expected_m = SHAPES[shape]
    run_masked(f"masked/shape={shape}/{out_mode}", G, M, N, K, counts, w_layout="nk_view",
               out_mode=out_mode, expected_m=expected_m, seed=2)


def test_masked_expected_m_is_a_hint():
    G, M, N, K = 16, 256, 1024, 2048
    counts = [g % 5 for g in range(G)]
    x, w, mm, y_small = run_masked("masked/expected_m=4", G, M, N, K, counts,
                                   w_layout="nk_view", out_mode="alloc", expected_m=4, seed=3)
    small = launch_info.last_launch().choice
    y_full = grouped_mm_masked(x, w, mm, config=cute())
    torch.cuda.synchronize()
    full = launch_info.last_launch().choice
    check_masked("masked/expected_m=None", y_full, x, w, counts, tile=_tile())
    record("masked/expected_m/choices", True, small=str(small), full=str(full))


PINNED = [("pingpong", 64, 128), ("pingpong", 64, 256), ("pingpong", 128, 64),
          ("pingpong", 128, 128), ("pingpong", 128, 192), ("pingpong", 192, 128),
          ("cooperative", 128, 64), ("cooperative", 128, 128), ("cooperative", 128, 256),
          ("cooperative", 256, 128)]


@pytest.mark.parametrize("pin", PINNED, ids=[f"{s}-{m}x{n}" for s, m, n in PINNED])
def test_masked_pinned_tiles(pin):
    schedule, tile_m, tile_n = pin
    cfg = cute(schedule=schedule, tile_m=tile_m, tile_n=tile_n)
    run_masked(f"masked/tile={schedule}-{tile_m}x{tile_n}", 5, 300, 264, 200,
               [0, 1, 129, 257, 300], config=cfg, seed=4)
    c = launch_info.last_launch().choice
    assert (c.schedule, c.tile_m, c.tile_n) == pin


@pytest.mark.parametrize("cluster", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_masked_clusters(cluster, schedule):
    # A cluster's two tiles belong to one problem: odd m-tile counts (1, 129, 257 rows) leave
    # the second CTA of a 2x1 pair without rows.
    cfg = cute(schedule=schedule, **CLUSTER_SHAPES[cluster])
    run_masked(f"masked/cluster={cluster}/{schedule}", 7, 384, 512, 256,
               [0, 1, 127, 128, 129, 257, 384], w_layout="nk_view", config=cfg, seed=5)
    c = launch_info.last_launch().choice
    assert (c.cluster_m, c.cluster_n) == (CLUSTER_SHAPES[cluster]["cluster_m"],
                                          CLUSTER_SHAPES[cluster]["cluster_n"])


@pytest.mark.parametrize("out_dtype", [FP32, FP16])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("out_mode", ["given", "alloc"])
def test_masked_out_dtype(out_dtype, schedule, out_mode):
    run_masked(f"masked/out={out_dtype}/{schedule}/{out_mode}", 6, 200, 192, 320,
               [200, 0, 65, 1, 128, 199], config=cute(schedule=schedule), out_mode=out_mode,
               out_dtype=out_dtype, seed=6)


def test_masked_strided_operands_and_counts():
    """x a strided slice (problem stride > M * K, row stride > K), masked_m a strided view,
    out rows of a wider buffer: only out's valid elements are written."""
    G, M, N, K = 5, 150, 256, 192
    gen = torch.Generator(device=DEV).manual_seed(7)
    x = _rand((G, M + 3, K + 8), BF16, gen)[:, 1:M + 1, 8:]
    w = _rand((G, N, K), BF16, gen).transpose(1, 2)
    counts = [150, 0, 1, 77, 129]
    base = torch.full((2 * G,), -1, dtype=I32, device=DEV)
    base[::2] = masked_counts(counts)
    buf = torch.full((G, M, N + 8), NAN, dtype=BF16, device=DEV)
    out = buf[:, :, :N]
    y = grouped_mm_masked(x, w, base[::2], out=out, config=cute())
    torch.cuda.synchronize()
    assert y is out
    check_masked("masked/strided", out, x, w, counts, tile=_tile())
    check_untouched("masked/strided", out, counts)
    margin = bool(torch.isnan(buf[:, :, N:].float()).all())
    record("masked/strided/margin-untouched", margin)
    assert margin, "columns past N of out's buffer were written"


def test_masked_empty_and_zero_k():
    cfg = cute()
    for G, M, N in ((0, 4, 8), (3, 0, 8), (3, 4, 0)):
        x, w = _operands(G, M, N, 16, seed=8)
        y = grouped_mm_masked(x, w, masked_counts([min(M, 2)] * G), config=cfg)
        assert y.shape == (G, M, N)
    x, w = _operands(3, 4, 8, 0, seed=9)
    counts = [4, 1, 0]
    out = torch.full((3, 4, 8), NAN, dtype=BF16, device=DEV)
    grouped_mm_masked(x, w, masked_counts(counts), out=out, config=cfg)
    torch.cuda.synchronize()
    zeros = bool((valid_rows(out, counts) == 0).all())
    record("masked/zero-k", zeros)
    assert zeros
    check_untouched("masked/zero-k", out, counts)
    y = grouped_mm_masked(x, w, masked_counts(counts), config=cfg)
    assert bool((valid_rows(y, counts) == 0).all())


# ---------------------------------------------------------------------------------------------
# 16-bit: counts on the GPU are not checked; the kernel clamps them


BAD_COUNTS = [[-3, 135, 2**31 - 1, -2**31, 7, 130], [-1, -1, -1, -1, -1, -1],
              [131, 1000, 130, 0, 2**30, 64]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_unchecked_counts_are_clamped(schedule):
    G, M, N, K = 6, 130, 136, 128
    cfg = cute(schedule=schedule)
    x, w = _operands(G, M, N, K, w_layout="nk_view", seed=10)
    mm = masked_counts(BAD_COUNTS[0])
    buf = torch.full((G + 2, M, N), NAN, dtype=BF16, device=DEV)
    out = buf[1:G + 1]
    for i, counts in enumerate(BAD_COUNTS):
        name = f"masked/clamped/{schedule}/{i}"
        mm.copy_(masked_counts(counts))
        buf.fill_(NAN)
        assert grouped_mm_masked(x, w, mm, out=out, config=cfg) is out
        torch.cuda.synchronize()
        check_masked(name, out, x, w, counts, given=counts)
        check_untouched(name, out, counts)
        intact = bool(torch.isnan(buf[0].float()).all() and torch.isnan(buf[G + 1].float()).all())
        record(f"{name}/outside-out-untouched", intact)
        assert intact, f"counts {counts} wrote outside out"
        y = grouped_mm_masked(x, w, mm, config=cfg)
        torch.cuda.synchronize()
        check_masked(f"{name}/alloc", y, x, w, counts)


def test_counts_checked_on_request(monkeypatch):
    x, w = _operands(3, 64, 128, 64, seed=11)
    monkeypatch.setenv("MOE_GEMM_CHECK_OFFS", "1")
    with pytest.raises(ValueError, match=r"masked_m\[1\]=65"):
        grouped_mm_masked(x, w, masked_counts([0, 65, 3]), config=cute())
    with pytest.raises(ValueError, match=r"masked_m\[0\]=-1"):
        grouped_mm_masked(x, w, masked_counts([-1, 0, 3]), config=cute())
    y = grouped_mm_masked(x, w, masked_counts([64, 0, 3]), config=cute())
    torch.cuda.synchronize()
    check_masked("masked/checked-on-request", y, x, w, [64, 0, 3])


# ---------------------------------------------------------------------------------------------
# 16-bit: CUDA graphs and host synchronisation


def test_no_host_sync():
    x, w = _operands(8, 128, 256, 256, w_layout="nk_view", seed=12)
    mm = masked_counts([0, 1, 5, 128, 64, 3, 2, 77])
    out = torch.full((8, 128, 256), NAN, dtype=BF16, device=DEV)
    cfg = cute()
    grouped_mm_masked(x, w, mm, config=cfg)  # compile + plan outside the check
    grouped_mm_masked(x, w, mm, out=out, config=cfg)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        y = grouped_mm_masked(x, w, mm, config=cfg)
        grouped_mm_masked(x, w, mm, out=out, config=cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record("masked/no-host-sync", True)
    torch.cuda.synchronize()
    check_masked("masked/no-host-sync", y, x, w, mm.tolist())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cuda_graph_replay_with_new_counts(schedule):
    """One capture of a new-output call and an out= call; each replay reads the counts (and
    x) written in place since, including counts the kernel must clamp."""
    G, M, N, K = 8, 256, 512, 384
    cfg = cute(schedule=schedule)
    x, w = _operands(G, M, N, K, w_layout="nk_view", seed=13)
    mm = masked_counts([256, 0, 1, 64, 65, 129, 200, 7])
    out = torch.full((G, M, N), NAN, dtype=BF16, device=DEV)
    grouped_mm_masked(x, w, mm, config=cfg)  # compile + plans outside the capture
    grouped_mm_masked(x, w, mm, out=out, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_mm_masked(x, w, mm, config=cfg)
        grouped_mm_masked(x, w, mm, out=out, config=cfg)
    gen = torch.Generator().manual_seed(14)
    trials = [torch.randint(0, M + 1, (G,), generator=gen).tolist() for _ in range(2)]
    trials += [[0] * G, [M] * G, [-5, M + 9, 3, 0, 2**31 - 1, 128, -2**31, 255]]
    xgen = torch.Generator(device=DEV).manual_seed(15)
    for trial, counts in enumerate(trials):
        mm.copy_(torch.tensor(counts, dtype=I32))
        x.copy_(_rand((G, M, K), BF16, xgen))
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        name = f"masked/cuda-graph/{schedule}/replay{trial}"
        check_masked(name, y, x, w, counts, given=counts)
        check_masked(f"{name}/out", out, x, w, counts, given=counts)
        check_untouched(f"{name}/out", out, counts)
    del graph


# ---------------------------------------------------------------------------------------------
# FP8: scaled_grouped_mm_masked


def check_fp8(name, y, ref, rows, **info):
    """y's valid rows against the fp64 reference's: relative (Frobenius) error within
    REL_BOUND of the output dtype, no element off by 2% of max|ref|, nothing non-finite."""
    out, r = valid_rows(y, rows), valid_rows(ref, rows)
    if out.numel() == 0:
        record(name, True, **info)
        return
    finite = bool(torch.isfinite(out.float()).all())
    e = fp8_errors(out, r)
    bound = REL_BOUND[out.dtype]
    passed = finite and e["rel"] <= bound and e["max_rel"] <= 2e-2
    record(name, passed, finite=finite, bound=bound, **e, **info)
    assert finite, f"{name}: output has NaN/inf in the valid rows (unwritten elements?)"
    assert e["rel"] <= bound, f"{name}: relative error {e['rel']:.3g} > {bound:g} ({e})"
    assert e["max_rel"] <= 2e-2, f"{name}: max error {e['max_rel']:.3g} of max|ref| ({e})"


def _fp8_ref(x, w, sa, sb, granularity, rows):
    """The fp64 reference on the first max(rows) rows of each problem only."""
    R = max(rows, default=0)
    if granularity == "tensor":
        return scaled_grouped_mm_ref(x[:, :R].contiguous(), w, sa, sb)
    return scaled_grouped_mm_ref(x[:, :R].contiguous(), w, sa[:, :R].contiguous(), sb)


def run_fp8(name, G, M, K, N, counts, granularity, *, config=None, out_mode="alloc",
            out_dtype=BF16, expected_m=None, seed=0):
    x, w, sa, sb = make_fp8_batched_inputs(G, M, K, N, granularity, device=DEV, seed=seed)
    mm = masked_counts(counts)
    cfg = config or cute()
    before = getattr(launch_info._local, "raw", None)
    if out_mode == "given":
        out = torch.full((G, M, N), NAN, dtype=out_dtype, device=DEV)
        y = scaled_grouped_mm_masked(x, w, sa, sb, mm, expected_m=expected_m, out=out,
                                     config=cfg)
        assert y is out
    else:
        y = scaled_grouped_mm_masked(x, w, sa, sb, mm, expected_m=expected_m,
                                     out_dtype=out_dtype, config=cfg)
    torch.cuda.synchronize()
    assert y.shape == (G, M, N) and y.dtype == out_dtype
    assert _ran_kernel(before), f"{name}: the FP8 masked kernel did not run"
    rows = clamped_counts(counts, M)
    check_fp8(name, y, _fp8_ref(x, w, sa, sb, granularity, rows), rows, tile=_tile())
    if out_mode == "given":
        check_untouched(name, y, counts)
    return x, w, sa, sb, mm, y


@pytest.mark.parametrize("out_mode", ["alloc", "given"])
def test_fp8_block_long_k(out_mode):
    run_fp8(f"fp8-masked/block/K=7168/{out_mode}", 4, 256, 7168, 512, [0, 1, 130, 256],
            "block", out_mode=out_mode, seed=20)


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("schedule,tile", [("cooperative", (128, 128)), ("pingpong", (64, 128))])
def test_fp8_granularities(granularity, schedule, tile):
    cfg = cute(schedule=schedule, tile_m=tile[0], tile_n=tile[1])
    run_fp8(f"fp8-masked/{granularity}/{schedule}", 6, 200, 384, 264, [0, 1, 63, 64, 129, 200],
            granularity, config=cfg, out_mode="given", seed=21)
    c = launch_info.last_launch().choice
    assert (c.schedule, c.tile_m, c.tile_n) == (schedule, *tile)


@pytest.mark.parametrize("granularity", ["block", "row"])
def test_fp8_decode(granularity):
    """DeepEP low-latency decode: 32 local experts of 128 rows' capacity, 0 to 8 tokens each."""
    run_fp8(f"fp8-masked/decode/{granularity}", 32, 128, 7168, 4096,
            [g % 9 for g in range(32)], granularity, expected_m=8, seed=22)


@pytest.mark.parametrize("out_dtype", [FP16, FP32])
def test_fp8_out_dtypes(out_dtype):
    run_fp8(f"fp8-masked/out={out_dtype}", 5, 160, 512, 200, [160, 0, 17, 1, 128], "block",
            out_mode="given", out_dtype=out_dtype, seed=23)


def test_fp8_unchecked_counts_and_cuda_graph():
    G, M, K, N = 4, 256, 512, 256
    x, w, sa, sb = make_fp8_batched_inputs(G, M, K, N, "block", device=DEV, seed=24)
    mm = masked_counts([-3, M + 5, 7, M])
    buf = torch.full((G + 2, M, N), NAN, dtype=BF16, device=DEV)
    out = buf[1:G + 1]
    cfg = cute()
    assert scaled_grouped_mm_masked(x, w, sa, sb, mm, out=out, config=cfg) is out
    torch.cuda.synchronize()
    rows = clamped_counts(mm.tolist(), M)
    ref = scaled_grouped_mm_ref(x, w, sa, sb)
    check_fp8("fp8-masked/clamped", out, ref, rows)
    check_untouched("fp8-masked/clamped", out, mm.tolist())
    intact = bool(torch.isnan(buf[0].float()).all() and torch.isnan(buf[G + 1].float()).all())
    record("fp8-masked/clamped/outside-out-untouched", intact)
    assert intact
    scaled_grouped_mm_masked(x, w, sa, sb, mm, config=cfg)  # the new-output plan
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = scaled_grouped_mm_masked(x, w, sa, sb, mm, config=cfg)
    for trial, counts in enumerate([[0, 1, 130, 256], [256, 255, 0, 64], [-1, 999, 128, 3]]):
        x2, _, sa2, _ = make_fp8_batched_inputs(G, M, K, N, "block", device=DEV,
                                                seed=100 + trial)
        x.copy_(x2)
        sa.copy_(sa2)
        mm.copy_(torch.tensor(counts, dtype=I32))
        graph.replay()
        torch.cuda.synchronize()
        check_fp8(f"fp8-masked/cuda-graph/replay{trial}", y, scaled_grouped_mm_ref(x, w, sa, sb),
                  clamped_counts(counts, M))
    del graph
