"""GPU tests of the sm90 kernels (run on the device: `pytest -m gpu`).

Every case draws fresh random data, poisons the outputs with NaN before the launch (so an
unwritten element fails), and compares with a float32 reference by the 2x rule: the kernel's
error may be at most twice that of torch's own low-precision GEMM plus a small absolute term.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.validation import check_grouped_gemm, check_grouped_mm

from .gpu_report import record

pytestmark = pytest.mark.gpu

SCHEDULES = ["pingpong", "cooperative"]
VISITORS = ["device", "host"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _rand(shape, dtype, gen):
    return (torch.randn(shape, generator=gen, device="cuda") * 0.5).to(dtype)


def _check(name, out, ref32, low, **info):
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


def _check_mm(name, y, x, w, offs):
    """grouped_mm's result against the fp32 reference, torch's bf16 experts as the baseline."""
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = moe_gemm.grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
    _check(name, y, ref, low)


# ---------------------------------------------------------------------------------------------
# General form


def _general_case(kind: str, rng: random.Random):
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


def _run_general(name, sizes, dtype, b_layout, config, out_dtype=None, check_subset=None):
    gen = torch.Generator(device="cuda").manual_seed(1234)
    a = [_rand((m, k), dtype, gen) for m, n, k in sizes]
    if b_layout == "col":
        b = [_rand((n, k), dtype, gen).t() for m, n, k in sizes]
    else:
        b = [_rand((k, n), dtype, gen) for m, n, k in sizes]
    odt = out_dtype or dtype
    out = [torch.full((m, n), float("nan"), dtype=odt, device="cuda") for m, n, k in sizes]
    res = moe_gemm.grouped_gemm(a, b, out=out, config=config)
    torch.cuda.synchronize()
    assert all(r is o for r, o in zip(res, out))
    idx = range(len(sizes)) if check_subset is None else check_subset
    for i in idx:
        ref = a[i].float() @ b[i].float()
        low = (a[i] @ b[i]).to(odt) if a[i].shape[1] > 0 else torch.zeros_like(ref).to(odt)
        _check(f"{name}[{i}]", out[i], ref, low, size=sizes[i])
    # Every output element written, also outside the checked subset.
    assert all(bool(torch.isfinite(o).all()) for o in out), f"{name}: NaN left in an output"


@pytest.mark.parametrize("kind", ["mixed", "many", "one", "kvary"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("visitor", VISITORS)
@pytest.mark.parametrize("sort_by_k", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_general_matrix(kind, schedule, visitor, sort_by_k, dtype):
    rng = random.Random(7)
    sizes = _general_case(kind, rng)
    cfg = GemmConfig(backend="cute", schedule=schedule, visitor=visitor, sort_by_k=sort_by_k)
    subset = None if len(sizes) < 64 else rng.sample(range(len(sizes)), 48)
    _run_general(f"general/{kind}/{schedule}/{visitor}/sort={sort_by_k}/{dtype}", sizes,
                 DTYPES[dtype], "col" if kind != "many" else "row", cfg, check_subset=subset)


@pytest.mark.parametrize("b_layout", ["row", "col"])
@pytest.mark.parametrize("out_dtype", [torch.float32, None])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_general_layouts_and_out_dtype(b_layout, out_dtype, schedule):
    sizes = _general_case("mixed", random.Random(3))
    cfg = GemmConfig(backend="cute", schedule=schedule)
    _run_general(f"general/layout={b_layout}/out={out_dtype}/{schedule}", sizes, torch.bfloat16,
                 b_layout, cfg, out_dtype=out_dtype)


@pytest.mark.parametrize("tile", [(64, 128), (64, 256), (128, 64), (128, 192)])
def test_general_pingpong_tiles(tile):
    sizes = _general_case("mixed", random.Random(5))
    cfg = GemmConfig(backend="cute", schedule="pingpong", tile_m=tile[0], tile_n=tile[1])
    _run_general(f"general/pingpong-tile={tile}", sizes, torch.bfloat16, "col", cfg)


@pytest.mark.parametrize("tile", [(128, 64), (128, 128), (128, 192)])
def test_general_cooperative_tiles(tile):
    sizes = _general_case("mixed", random.Random(5))
    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=tile[0], tile_n=tile[1])
    _run_general(f"general/cooperative-tile={tile}", sizes, torch.bfloat16, "row", cfg)


@pytest.mark.parametrize("config", [None, GemmConfig(backend="cute", schedule="cooperative")],
                         ids=["default", "cooperative"])
def test_headline(config):
    sizes = _general_case("headline", random.Random(1))
    name = "headline/" + ("default" if config is None else config.schedule)
    _run_general(name, sizes, torch.bfloat16, "col", config,
                 check_subset=random.Random(2).sample(range(256), 24))


def test_default_picks_cute():
    from moe_gemm.ops.launch import last_launch

    a = [torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)]
    b = [torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)]
    moe_gemm.grouped_gemm(a, b)
    info = last_launch()
    record("default_picks_cute", info is not None)
    assert info is not None


# ---------------------------------------------------------------------------------------------
# Varlen (MoE) form


# Row counts on both sides of the 64-row line of a 128-row tile (edge-rows tests below).
EDGE_ROWS = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 320, 385, 448]


def _counts(kind: str, E: int, T: int, gen: torch.Generator) -> list[int]:
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


def _run_varlen(name, E, T, N, K, counts_kind, dtype, w_layout, config, out_mode, tail=0):
    gen = torch.Generator().manual_seed(99)
    counts = _counts(counts_kind, E, T - tail, gen)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = _rand((T, K), dtype, g)
    if w_layout == "nk_view":
        w = _rand((E, N, K), dtype, g).transpose(1, 2)
    else:
        w = _rand((E, K, N), dtype, g)
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
    start = 0
    for e, c in enumerate(counts):
        if c:
            low[start:start + c] = x[start:start + c] @ w[e]
        start += c
    if out_mode == "given" and tail:
        untouched = bool((y[T - tail:] == 7.0).all())
        record(f"{name}/tail-untouched", untouched)
        assert untouched, "rows past offs[-1] were written"
        _check(name, y[:T - tail], ref[:T - tail], low[:T - tail], E=E, T=T, N=N, K=K)
    else:
        _check(name, y, ref, low, E=E, T=T, N=N, K=K)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("visitor", VISITORS)
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("out_mode", ["given", "alloc"])
def test_varlen_matrix(schedule, visitor, w_layout, dtype, out_mode):
    cfg = GemmConfig(backend="cute", schedule=schedule, visitor=visitor)
    _run_varlen(f"varlen/holes/{schedule}/{visitor}/{w_layout}/{dtype}/{out_mode}", 10, 1000,
                136, 264, "holes", DTYPES[dtype], w_layout, cfg, out_mode, tail=99)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_varlen_decode_shape(schedule):
    cfg = GemmConfig(backend="cute", schedule=schedule)
    _run_varlen(f"varlen/decode/{schedule}", 256, 1024, 512, 7168, "zipf", torch.bfloat16,
                "nk_view", cfg, "alloc")


def test_varlen_default_prefill_like():
    _run_varlen("varlen/prefill-like/default", 8, 8192, 1024, 2048, "zipf", torch.bfloat16,
                "nk_view", None, "given", tail=17)


def test_varlen_default_short_k():
    # K <= 1024 with >= 128 rows per expert: the default is ping-pong 128x192.
    from moe_gemm.ops.launch import last_launch

    _run_varlen("varlen/short-k/default", 24, 6000, 392, 768, "edges", torch.bfloat16,
                "nk_view", None, "given", tail=5)
    info = last_launch()
    c = info.choice if info is not None else None
    ok = c is not None and (c.schedule, c.tile_m, c.tile_n) == ("pingpong", 128, 192)
    record("varlen/short-k/default-is-pingpong-128x192", ok)
    assert ok, c


@pytest.mark.parametrize("tile", [(64, 256), (128, 128), (128, 192)])
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
def test_varlen_pingpong_tile_shapes(tile, w_layout):
    cfg = GemmConfig(backend="cute", schedule="pingpong", tile_m=tile[0], tile_n=tile[1])
    _run_varlen(f"varlen/pingpong-tile={tile}/{w_layout}", 14, 2600, 520, 1000, "edges",
                torch.float16, w_layout, cfg, "alloc")


def test_aliasing_out_sharing_memory_with_operands():
    # The kernels read A and B while other CTAs store D: an out overlapping an operand runs
    # through a temporary (moe_gemm/aliasing.py) and must equal the result on clones.
    cfg = GemmConfig(backend="cute")
    g = torch.Generator(device="cuda").manual_seed(21)
    E, T, K = 4, 300, 256
    buf = _rand((T + 64, K), torch.bfloat16, g)
    x = buf[:T]
    w = _rand((E, K, K), torch.bfloat16, g)
    offs = torch.tensor([50, 120, 120, 290], dtype=torch.int32, device="cuda")
    want = moe_gemm.grouped_mm(x.clone(), w.clone(), offs, config=cfg)
    tail = buf[64 + 290:64 + T].clone()
    y = moe_gemm.grouped_mm(x, w, offs, out=buf[64:], config=cfg)  # out 64 rows past x
    torch.cuda.synchronize()
    ok = bool(torch.equal(y[:290], want[:290])) and bool(torch.equal(y[290:], tail))
    record("aliasing/grouped_mm-out-over-x", ok)
    assert ok
    xb = _rand((3, 128, K), torch.bfloat16, g)
    wb = _rand((3, K, K), torch.bfloat16, g)
    want = moe_gemm.grouped_mm(xb.clone(), wb, config=cfg)
    y = moe_gemm.grouped_mm(xb, wb, out=xb, config=cfg)  # batched, in place over x
    torch.cuda.synchronize()
    ok = y is xb and bool(torch.equal(y, want))
    record("aliasing/batched-out-is-x", ok)
    assert ok
    a = [_rand((96, K), torch.bfloat16, g) for _ in range(3)]
    b = [_rand((K, K), torch.bfloat16, g) for _ in range(3)]
    want = moe_gemm.grouped_gemm([t.clone() for t in a], [t.clone() for t in b], config=cfg)
    out = [torch.empty(96, K, device="cuda", dtype=torch.bfloat16), a[0][:, :K], a[2]]
    res = moe_gemm.grouped_gemm(a, b, out=out, config=cfg)
    torch.cuda.synchronize()
    ok = all(r is o and torch.equal(r, w_) for r, o, w_ in zip(res, out, want))
    record("aliasing/grouped_gemm-out-is-a", ok)
    assert ok


def test_varlen_single_row_and_all_empty():
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, 64, 32, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(backend="cute")
    y = moe_gemm.grouped_mm(x, w, torch.tensor([0, 1, 1], dtype=torch.int32, device="cuda"),
                            config=cfg)
    ref = x.float() @ w[1].float()
    _check("varlen/single-row", y, ref, (x @ w[1]))
    y0 = moe_gemm.grouped_mm(x, w, torch.zeros(3, dtype=torch.int32, device="cuda"), config=cfg)
    ok = bool((y0 == 0).all())
    record("varlen/all-empty-zero", ok)
    assert ok


def test_cuda_graph_replay_with_new_offsets():
    E, T, N, K = 16, 512, 128, 256
    dev = "cuda"
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.linspace(0, T, E, device=dev).round().to(torch.int32)
    cfg = GemmConfig(backend="cute")
    moe_gemm.grouped_mm(x, w, offs, config=cfg)  # compile + warm outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    for trial in range(3):
        gen = torch.Generator().manual_seed(trial)
        counts = torch.multinomial(torch.ones(E), T, replacement=True, generator=gen)
        new = torch.bincount(counts, minlength=E).cumsum(0).to(torch.int32)
        offs.copy_(new)
        x.copy_(torch.randn(T, K, device=dev, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _check_mm(f"cuda-graph/replay{trial}", y, x, w, offs)


def test_grouped_mm_no_host_sync():
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([10, 100, 100, 250], dtype=torch.int32, device="cuda")
    cfg = GemmConfig(backend="cute")
    moe_gemm.grouped_mm(x, w, offs, config=cfg)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_gemm.grouped_mm(x, w, offs, config=cfg)
        ok = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record("grouped_mm/no-host-sync", ok)


# ---------------------------------------------------------------------------------------------
# The kernel visits tiles exactly as moe_gemm.schedule says


def _expected(counts, sizes_mn, tile_m, tile_n, num_ctas, swizzle):
    owners = sched.linear_assignment(counts, num_ctas).per_cta
    out = []
    for cta in owners:
        row = []
        for p, local in cta:
            tm = -(-sizes_mn[p][0] // tile_m)
            tn = -(-sizes_mn[p][1] // tile_n)
            m, n = sched.tile_coord(local, tm, tn, swizzle)
            row.append((p, m, n))
        out.append(row)
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("visitor", VISITORS)
@pytest.mark.parametrize("sort_by_k", [False, True])
def test_trace_general_matches_schedule(schedule, visitor, sort_by_k):
    from moe_gemm.ops.launch import grouped_gemm_cute, last_launch, trace_assignment

    rng = random.Random(11)
    sizes = [(rng.choice([0, 1, 130, 257, 600]), 8 * rng.randint(1, 50), 8 * rng.randint(1, 90))
             for _ in range(90)]
    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m, n, k in sizes]
    b = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for m, n, k in sizes]
    cfg = GemmConfig(backend="cute", schedule=schedule, visitor=visitor, sort_by_k=sort_by_k)
    grouped_gemm_cute(check_grouped_gemm(a, b, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    got = trace_assignment(info)
    order = list(info.order)
    ordered = [sizes[i] for i in order]
    ch = info.choice
    if ch.cluster_m * ch.cluster_n > 1:  # (the rules may pair n-tiles: the cluster schedule)
        want = _expected_cluster([(m, n) for m, n, _ in ordered], ch.tile_m, ch.tile_n,
                                 info.num_ctas, ch.swizzle, ch.cluster_m, ch.cluster_n)
    else:
        counts = sched.tiles_per_problem(ordered, ch.tile_m, ch.tile_n)
        want = _expected(counts, [(m, n) for m, n, _ in ordered], ch.tile_m, ch.tile_n,
                         info.num_ctas, ch.swizzle)
    want = [[(order[p], m, n) for p, m, n in row] for row in want]
    ok = got == want
    record(f"trace/general/{schedule}/{visitor}/sort={sort_by_k}", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("visitor", VISITORS)
def test_trace_varlen_matches_schedule(schedule, visitor):
    from moe_gemm.ops.launch import grouped_mm_cute, last_launch, trace_assignment

    E, T, N, K = 40, 3000, 264, 128
    counts = _counts("holes", E, T - 50, torch.Generator().manual_seed(1))
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(backend="cute", schedule=schedule, visitor=visitor)
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    got = trace_assignment(info)
    rows = counts + [T - sum(counts)]  # the zero tail is problem E
    ch = info.choice
    tile_counts = [-(-r // ch.tile_m) * -(-N // ch.tile_n) for r in rows]
    want = _expected(tile_counts, [(r, N) for r in rows], ch.tile_m, ch.tile_n, info.num_ctas,
                     ch.swizzle)
    ok = got == want
    record(f"trace/varlen/{schedule}/{visitor}", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule"


# ---------------------------------------------------------------------------------------------
# Batched form: grouped_mm(x (G, M, K), w (G, K, N)) without offs


def _run_batched(name, G, M, N, K, dtype=torch.bfloat16, w_layout="kn", config=None,
                 out_mode="alloc", out_dtype=None, x_view=False):
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    if x_view:  # a strided slice: problem stride > M * K, row stride > K
        x = _rand((G, M + 3, K + 8), dtype, gen)[:, 1:M + 1, 8:]
    else:
        x = _rand((G, M, K), dtype, gen)
    if w_layout == "kn":
        w = _rand((G, K, N), dtype, gen)
    else:  # the transpose of an (G, N, K) weight: K contiguous
        w = _rand((G, N, K), dtype, gen).transpose(1, 2)
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
    _check(name, y, ref, low, G=G, M=M, N=N, K=K)
    return y


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("out_mode", ["given", "alloc", "view"])
def test_batched_matrix(schedule, w_layout, dtype, out_mode):
    cfg = GemmConfig(backend="cute", schedule=schedule)
    _run_batched(f"batched/{schedule}/{w_layout}/{dtype}/{out_mode}", 7, 130, 200, 72,
                 DTYPES[dtype], w_layout, cfg, out_mode)


@pytest.mark.parametrize("shape", [(1, 1, 8, 16), (3, 1, 64, 64), (5, 77, 136, 7176),
                                   (300, 64, 128, 256), (1, 1000, 4096, 128), (2, 257, 8, 8),
                                   (9, 129, 264, 1032), (40, 16, 512, 7168)])
@pytest.mark.parametrize("schedule", ["auto", *SCHEDULES])
def test_batched_shapes(shape, schedule):
    G, M, N, K = shape
    cfg = GemmConfig(backend="cute", schedule=schedule)
    _run_batched(f"batched/shape{shape}/{schedule}", G, M, N, K, config=cfg, out_mode="given")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_batched_out_dtype_and_strided_x(out_dtype, schedule):
    cfg = GemmConfig(backend="cute", schedule=schedule)
    _run_batched(f"batched/out={out_dtype}/{schedule}/x-view", 6, 100, 192, 320,
                 config=cfg, out_mode="given", out_dtype=out_dtype, x_view=True)


@pytest.mark.parametrize("tile", [(64, 128), (64, 256), (128, 64), (128, 128), (128, 192)])
def test_batched_pingpong_tiles(tile):
    cfg = GemmConfig(backend="cute", schedule="pingpong", tile_m=tile[0], tile_n=tile[1])
    _run_batched(f"batched/pingpong{tile}", 5, 200, 264, 200, config=cfg, out_mode="given")


@pytest.mark.parametrize("tile", [(128, 64), (128, 128), (128, 192), (128, 256)])
def test_batched_cooperative_tiles(tile):
    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=tile[0], tile_n=tile[1])
    _run_batched(f"batched/cooperative{tile}", 5, 200, 264, 200, config=cfg, out_mode="given")


def test_batched_empty_and_zero_k():
    cfg = GemmConfig(backend="cute")
    for G, M, N in ((0, 4, 8), (3, 0, 8), (3, 4, 0)):
        x = torch.randn(G, M, 16, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(G, 16, N, device="cuda", dtype=torch.bfloat16)
        assert moe_gemm.grouped_mm(x, w, config=cfg).shape == (G, M, N)
    x = torch.randn(3, 4, 0, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, 0, 8, device="cuda", dtype=torch.bfloat16)
    out = torch.full((3, 4, 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = moe_gemm.grouped_mm(x, w, out=out, config=cfg)
    ok = bool((y == 0).all())
    record("batched/empty-and-zero-k", ok)
    assert ok


def test_batched_size_one_dims_with_odd_strides():
    """A (G, 1, K) slice whose row stride is not 16-byte aligned (never used to address)."""
    cfg = GemmConfig(backend="cute")
    base = torch.randn(4, 2, 12, device="cuda", dtype=torch.bfloat16)
    x = base[:, :1, :8]  # strides (24, 12, 1): 12 elements = 24 bytes
    w = torch.randn(4, 8, 16, device="cuda", dtype=torch.bfloat16)
    y = moe_gemm.grouped_mm(x, w, config=cfg)
    torch.cuda.synchronize()
    ref = x.float() @ w.float()
    _check("batched/size-one-odd-stride", y, ref, torch.bmm(x, w))


@pytest.mark.parametrize("pdl", [0, 1])
def test_batched_graph_replay_and_pdl(pdl, monkeypatch):
    from moe_gemm.ops import launch as host_sm90

    monkeypatch.setattr(host_sm90, "PDL", pdl)
    G, M, N, K = 16, 96, 256, 512
    x = torch.randn(G, M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(backend="cute")
    moe_gemm.grouped_mm(x, w, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.grouped_mm(x, w, config=cfg)
    for trial in range(2):
        x.copy_(torch.randn_like(x))
        w.copy_(torch.randn_like(w))
        graph.replay()
        torch.cuda.synchronize()
        _check(f"batched/graph/pdl={pdl}/{trial}", y, x.float() @ w.float(), torch.bmm(x, w))
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_gemm.grouped_mm(x, w, config=cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("pdl", [0, 1])
def test_general_and_varlen_without_pdl(pdl, monkeypatch):
    """Both launch modes of the descriptor prologue + main kernel pair give the same bits."""
    from moe_gemm.ops import launch as host_sm90

    monkeypatch.setattr(host_sm90, "PDL", pdl)
    _run_general(f"general/pdl={pdl}", [(130, 200, 72), (256, 512, 1024), (1, 64, 64)],
                 torch.bfloat16, "row", GemmConfig(backend="cute"))
    _run_varlen(f"varlen/pdl={pdl}", 8, 700, 256, 512, "holes", torch.bfloat16, "kn",
                GemmConfig(backend="cute"), "alloc")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trace_batched_matches_schedule(schedule):
    from moe_gemm.ops.launch import grouped_bmm_cute, last_launch, trace_assignment
    from moe_gemm.ops.validation import check_grouped_bmm

    G, M, N, K = 37, 300, 264, 128
    x = torch.randn(G, M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(backend="cute", schedule=schedule)
    grouped_bmm_cute(check_grouped_bmm(x, w, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    got = trace_assignment(info)
    ch = info.choice
    counts = [-(-M // ch.tile_m) * -(-N // ch.tile_n)] * G
    want = _expected(counts, [(M, N)] * G, ch.tile_m, ch.tile_n, info.num_ctas, ch.swizzle)
    ok = got == want
    record(f"trace/batched/{schedule}", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule"


# ---------------------------------------------------------------------------------------------
# Problems that end on both sides of the 64-row line inside a 128-row tile (where each math
# warpgroup's m64 slice starts), in every form, with and without clusters; the rows past the
# last expert stay untouched.

@pytest.mark.parametrize("cluster", [(1, 1), (2, 1), (1, 2)], ids=["1x1", "2x1", "1x2"])
@pytest.mark.parametrize("k", [72, 4160])
def test_edge_rows_varlen(cluster, k):
    cfg = GemmConfig(backend="cute", schedule="cooperative", cluster_m=cluster[0],
                     cluster_n=cluster[1])
    _run_varlen(f"edge-rows/varlen/c{cluster[0]}x{cluster[1]}/K={k}", 16, 2800, 520, k, "edges",
                torch.bfloat16, "nk_view", cfg, "given", tail=33)


@pytest.mark.parametrize("tile_n", [128, 256])
def test_edge_rows_general(tile_n):
    sizes = [(m, 8 * (17 + i), 64 * (1 + i % 5)) for i, m in enumerate(EDGE_ROWS)]
    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=128, tile_n=tile_n)
    _run_general(f"edge-rows/general/128x{tile_n}", sizes, torch.bfloat16, "col", cfg)


@pytest.mark.parametrize("m", [1, 64, 65, 193])
def test_edge_rows_batched(m):
    cfg = GemmConfig(backend="cute", schedule="cooperative", cluster_m=2, cluster_n=1)
    _run_batched(f"edge-rows/batched/M={m}/c2x1", 5, m, 264, 136, config=cfg, out_mode="given")
    _run_batched(f"edge-rows/batched/M={m}", 5, m, 264, 136,
                 config=GemmConfig(backend="cute", schedule="cooperative"), out_mode="view")


# 2x1 / 1x2 clusters (B / A multicast): grouped_mm's varlen and batched forms (the general
# form below)

CLUSTER_SHAPES = {"2x1": {"cluster_m": 2, "cluster_n": 1}, "1x2": {"cluster_m": 1, "cluster_n": 2}}


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("counts_kind", ["holes", "zipf"])
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("out_mode", ["given", "alloc"])
def test_cluster_varlen(cl, counts_kind, w_layout, out_mode):
    cfg = GemmConfig(backend="cute", **CLUSTER_SHAPES[cl])
    # N = 264: 3 n-tiles of 128 (1x2: an odd last column) or 2 of 256
    _run_varlen(f"cluster{cl}/varlen/{counts_kind}/{w_layout}/{out_mode}", 24, 3000, 264, 200,
                counts_kind, torch.bfloat16, w_layout, cfg, out_mode, tail=37)


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cluster_varlen_tiles_and_long_k(cl, tile_n, dtype):
    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=128, tile_n=tile_n,
                     **CLUSTER_SHAPES[cl])
    _run_varlen(f"cluster{cl}/varlen/128x{tile_n}/{dtype}", 8, 2100, 640, 4160, "zipf",
                DTYPES[dtype], "nk_view", cfg, "alloc")


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
def test_cluster_varlen_single_row_and_empty(cl):
    C2 = CLUSTER_SHAPES[cl]
    cfg = GemmConfig(backend="cute", **C2)
    _run_varlen(f"cluster{cl}/varlen/one-row", 4, 1, 256, 128, "holes", torch.bfloat16, "kn",
                cfg, "alloc")
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, 128, 256, device="cuda", dtype=torch.bfloat16)
    offs = torch.zeros(3, dtype=torch.int32, device="cuda")
    y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    torch.cuda.synchronize()
    ok = bool((y == 0).all())
    record(f"cluster{cl}/varlen/all-empty", ok)
    assert ok


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("shape", [(5, 130, 264, 200), (3, 300, 512, 1104), (7, 1, 256, 64),
                                   (2, 513, 128, 4096), (256, 128, 512, 7168)])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_cluster_batched(cl, shape, out_dtype):
    G, M, N, K = shape
    cfg = GemmConfig(backend="cute", **CLUSTER_SHAPES[cl])
    _run_batched(f"cluster{cl}/batched{shape}/{out_dtype}", G, M, N, K, config=cfg,
                 out_mode="given", out_dtype=out_dtype, w_layout="nk_view")


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
def test_cluster_graph_replay_with_new_offsets(cl):
    C2 = CLUSTER_SHAPES[cl]
    E, T, N, K = 16, 700, 256, 256
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.linspace(0, T, E, device="cuda").round().to(torch.int32)
    cfg = GemmConfig(backend="cute", **C2)
    moe_gemm.grouped_mm(x, w, offs, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    for trial in range(3):
        gen = torch.Generator().manual_seed(100 + trial)
        counts = torch.multinomial(torch.ones(E), T - 20, replacement=True, generator=gen)
        offs.copy_(torch.bincount(counts, minlength=E).cumsum(0).to(torch.int32))
        x.copy_(torch.randn(T, K, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _check_mm(f"cluster{cl}/graph/replay{trial}", y, x, w, offs)


def _expected_cluster(rows_n, tile_m, tile_n, num_ctas, swizzle, cm, cn):
    """Per CTA (problem, m_tile, n_tile) for a cm x cn cluster grid (see scheduler_warp)."""
    size = cm * cn
    units = [-(-r // (tile_m * cm)) * -(-n // (tile_n * cn)) for r, n in rows_n]
    owners = sched.linear_assignment(units, num_ctas // size).per_cta
    out = [[] for _ in range(num_ctas)]
    for c, cluster in enumerate(owners):
        for p, local in cluster:
            r, n = rows_n[p]
            tiles_m, tiles_n = -(-r // tile_m), -(-n // tile_n)
            mu, nu = sched.tile_coord(local, -(-r // (tile_m * cm)), -(-n // (tile_n * cn)),
                                      swizzle)
            for rank in range(size):
                m = mu * cm + (rank if cm > 1 else 0)
                n_t = nu * cn + (rank if cn > 1 else 0)
                if m < tiles_m and n_t < tiles_n:
                    out[c * size + rank].append((p, m, n_t))
    return out


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
def test_trace_cluster_varlen_and_batched_match_schedule(cl):
    from moe_gemm.ops.launch import (
        grouped_bmm_cute,
        grouped_mm_cute,
        last_launch,
        trace_assignment,
    )
    from moe_gemm.ops.validation import check_grouped_bmm

    cfg = GemmConfig(backend="cute", **CLUSTER_SHAPES[cl])
    cm, cn = CLUSTER_SHAPES[cl]["cluster_m"], CLUSTER_SHAPES[cl]["cluster_n"]
    E, T, N, K = 40, 3000, 264, 128
    counts = _counts("holes", E, T - 50, torch.Generator().manual_seed(1))
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    rows = counts + [T - sum(counts)]
    ch = info.choice
    assert (ch.cluster_m, ch.cluster_n) == (cm, cn) and info.num_ctas % 2 == 0
    want = _expected_cluster([(r, N) for r in rows], ch.tile_m, ch.tile_n, info.num_ctas,
                             ch.swizzle, cm, cn)
    ok_varlen = trace_assignment(info) == want
    record(f"trace/cluster{cl}/varlen", ok_varlen)

    G, M = 9, 300
    x3 = torch.randn(G, M, K, device="cuda", dtype=torch.bfloat16)
    w3 = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16)
    grouped_bmm_cute(check_grouped_bmm(x3, w3, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    want = _expected_cluster([(M, N)] * G, ch.tile_m, ch.tile_n, info.num_ctas, ch.swizzle,
                             cm, cn)
    ok_batched = trace_assignment(info) == want
    record(f"trace/cluster{cl}/batched", ok_batched)
    assert ok_varlen and ok_batched, "kernel tile visits differ from the cluster schedule"


# 2x1 / 1x2 clusters in the general form (grouped_gemm's lists): both CTAs of a cluster encode
# the same problem's descriptors, with the multicast box for the shared operand.

GENERAL_CLUSTER_CASES = {
    # M=1, empty, K=0, sizes off the tiles, odd n-tile counts (1x2: the pair's second CTA
    # past the edge) and odd m-tile counts (2x1), N not a multiple of 8 * 16.
    "mixed": [(1, 64, 64), (0, 128, 64), (130, 200, 72), (256, 512, 1024), (77, 8, 16),
              (128, 128, 0), (5, 1000, 4096), (129, 136, 7176), (300, 520, 200)],
    "edges": [(m, 8 * (17 + 5 * i), 64 * (1 + i % 5)) for i, m in enumerate(EDGE_ROWS)],
    "pairs": [(m, 512, 1088) for m in (1, 64, 127, 128, 129, 200, 255, 256, 384, 0)],
}


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("kind", list(GENERAL_CLUSTER_CASES))
@pytest.mark.parametrize("b_layout", ["row", "col"])
@pytest.mark.parametrize("sort_by_k", [False, True])
def test_cluster_general(cl, kind, b_layout, sort_by_k):
    from moe_gemm.ops.launch import last_launch

    cfg = GemmConfig(backend="cute", sort_by_k=sort_by_k, **CLUSTER_SHAPES[cl])
    _run_general(f"cluster{cl}/general/{kind}/{b_layout}/sort={sort_by_k}",
                 GENERAL_CLUSTER_CASES[kind], torch.bfloat16, b_layout, cfg)
    c = last_launch().choice
    assert (c.cluster_m, c.cluster_n, c.schedule) == (CLUSTER_SHAPES[cl]["cluster_m"],
                                                      CLUSTER_SHAPES[cl]["cluster_n"],
                                                      "cooperative")


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("dtype,out_dtype", [("bf16", None), ("fp16", None),
                                             ("bf16", torch.float32)])
def test_cluster_general_tiles_and_dtypes(cl, tile_n, dtype, out_dtype):
    cfg = GemmConfig(backend="cute", tile_m=128, tile_n=tile_n, **CLUSTER_SHAPES[cl])
    _run_general(f"cluster{cl}/general/128x{tile_n}/{dtype}/{out_dtype}",
                 GENERAL_CLUSTER_CASES["mixed"], DTYPES[dtype], "col", cfg,
                 out_dtype=out_dtype)


def test_cluster_general_many_problems():
    sizes = _general_case("many", random.Random(17))
    cfg = GemmConfig(backend="cute", cluster_m=1, cluster_n=2)
    _run_general("cluster1x2/general/many", sizes, torch.bfloat16, "row", cfg,
                 check_subset=random.Random(3).sample(range(len(sizes)), 64))


def test_cluster_general_default_headline_and_fast_path():
    """The default picks 1x2 for a set whose problems have pairs of n-tiles (cooperative
    128x256): right through grouped_gemm's every route (first call, launch record, new
    operand addresses, `out=`, a GroupedGemmPlan, a captured CUDA graph)."""
    from moe_gemm.ops.launch import last_launch

    sizes = ((128, 512, 1088), (1, 512, 2056), (0, 512, 64), (200, 1024, 1088),
             (129, 512, 4096), (64, 512, 1088))
    a, b, gen = _general_problems(91, sizes)
    res = moe_gemm.grouped_gemm(a, b)
    c = last_launch().choice
    ok = (c.schedule, c.tile_n, c.cluster_m, c.cluster_n) == ("cooperative", 256, 1, 2)
    record("cluster1x2/general/default-picks-1x2", ok, choice=str(c))
    assert ok, c
    torch.cuda.synchronize()
    _check_general("cluster1x2/general/default/first", res, a, b)
    again = moe_gemm.grouped_gemm(a, b)  # from a launch record
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(res, again))
    for step in range(3):  # new operand addresses: one-off, then records
        a = [_rand(t.shape, torch.bfloat16, gen) for t in a]
        res = moe_gemm.grouped_gemm(a, b)
        torch.cuda.synchronize()
        _check_general(f"cluster1x2/general/default/new-addresses{step}", res, a, b)
    out = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
           for m, n, _ in sizes]
    moe_gemm.grouped_gemm(a, b, out=out)
    torch.cuda.synchronize()
    _check_general("cluster1x2/general/default/out", out, a, b)
    plan = moe_gemm.GroupedGemmPlan(a, b)
    for t in a:
        t.copy_(_rand(t.shape, torch.bfloat16, gen))
    torch.cuda.synchronize()
    _check_general("cluster1x2/general/default/plan", plan(), a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_gemm.grouped_gemm(a, b)
    for t in (*a, *b):
        t.copy_(_rand(t.shape, torch.bfloat16, gen))
    graph.replay()
    torch.cuda.synchronize()
    _check_general("cluster1x2/general/default/graph", captured, a, b)


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("sort_by_k", [False, True])
def test_trace_cluster_general_matches_schedule(cl, sort_by_k):
    from moe_gemm.ops.launch import grouped_gemm_cute, last_launch, trace_assignment

    rng = random.Random(12)
    sizes = [(rng.choice([0, 1, 130, 257, 600]), 8 * rng.randint(1, 80), 8 * rng.randint(1, 90))
             for _ in range(70)]
    a = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m, n, k in sizes]
    b = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for m, n, k in sizes]
    cfg = GemmConfig(backend="cute", sort_by_k=sort_by_k, **CLUSTER_SHAPES[cl])
    grouped_gemm_cute(check_grouped_gemm(a, b, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    assert (ch.cluster_m, ch.cluster_n) == (CLUSTER_SHAPES[cl]["cluster_m"],
                                            CLUSTER_SHAPES[cl]["cluster_n"])
    order = list(info.order)
    want = _expected_cluster([(sizes[i][0], sizes[i][1]) for i in order], ch.tile_m, ch.tile_n,
                             info.num_ctas, ch.swizzle, ch.cluster_m, ch.cluster_n)
    want = [[(order[p], m, n) for p, m, n in row] for row in want]
    ok = trace_assignment(info) == want
    record(f"trace/cluster{cl}/general/sort={sort_by_k}", ok)
    assert ok, "kernel tile visits differ from the cluster schedule"


# ---------------------------------------------------------------------------------------------
# grouped_gemm without `out` (the one-pass host path, kernels/support.fast_general)


@pytest.mark.parametrize("kind", ["mixed", "kvary", "mixed-majors", "tuple"])
@pytest.mark.parametrize("config", [None, GemmConfig(backend="cute", schedule="pingpong")],
                         ids=["default", "pingpong"])
def test_general_fast_path_without_out(kind, config):
    from moe_gemm.ops.launch import last_launch

    rng = random.Random(7)
    sizes = _general_case("mixed" if kind in ("mixed-majors", "tuple") else kind, rng)
    gen = torch.Generator(device="cuda").manual_seed(77)
    a = [_rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    b = []
    for i, (m, n, k) in enumerate(sizes):
        if kind == "mixed-majors" and i % 3 == 0:
            b.append(_rand((n, k), torch.bfloat16, gen).t())  # minority layout: copied
        else:
            b.append(_rand((k, n), torch.bfloat16, gen))
    if kind == "tuple":
        a, b = tuple(a), tuple(b)
    before = last_launch()
    res = moe_gemm.grouped_gemm(a, b, config=config)
    torch.cuda.synchronize()
    assert last_launch() is not before  # the kernel ran
    for i, (ai, bi) in enumerate(zip(a, b)):
        ref = ai.float() @ bi.float()
        low = (ai @ bi) if ai.shape[1] > 0 else torch.zeros_like(ref).to(torch.bfloat16)
        assert res[i].shape == (ai.shape[0], bi.shape[1]) and res[i].dtype == torch.bfloat16
        _check(f"general/fast/{kind}/{'default' if config is None else 'pingpong'}[{i}]",
               res[i], ref, low)


@pytest.mark.parametrize("config", [None, GemmConfig(sort_by_k=True, visitor="host")])
def test_general_fast_path_repeated_calls_reuse_metadata(config):
    """Repeated grouped_gemm calls on the same buffers reuse one metadata upload (the C++
    module's launch record, or host_sm90's cache on the Python scan): every call must still
    write its own fresh outputs, see values updated in place, and work from another stream;
    `out=` tensors that change between calls are honoured."""
    from moe_gemm.ops import launch as host_sm90
    from moe_gemm.ops import native

    mod = native.loaded()

    def uploads():
        return mod.stats()[1] if mod is not None else len(host_sm90._meta_cache)

    sizes = [(37, 256, 512), (0, 256, 64), (128, 256, 4096), (1, 256, 72), (200, 256, 1024)]
    gen = torch.Generator(device="cuda").manual_seed(21)
    a = [_rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    b = [_rand((k, n), torch.bfloat16, gen) for m, n, k in sizes]
    host_sm90._meta_cache.clear()
    native.forget()

    def check(tag, res):
        for i, (ai, bi) in enumerate(zip(a, b)):
            ref = ai.float() @ bi.float()
            _check(f"general/meta-cache/{tag}[{i}]", res[i], ref, ai @ bi)

    first = moe_gemm.grouped_gemm(a, b, config=config)
    entries = uploads()
    assert entries == 1
    torch.cuda.synchronize()
    check("first", first)
    kept = [r.clone() for r in first]
    for t in a:  # new values, same addresses
        t.copy_(_rand(t.shape, torch.bfloat16, gen))
    second = moe_gemm.grouped_gemm(a, b, config=config)
    assert uploads() == entries  # reused, not uploaded again
    assert second[0].data_ptr() != first[0].data_ptr()
    torch.cuda.synchronize()
    check("second", second)
    assert all(torch.equal(x, y) for x, y in zip(first, kept))  # first results untouched
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        third = moe_gemm.grouped_gemm(a, b, config=config)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    check("side-stream", third)
    for rep in range(2):
        out = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
               for m, n, _ in sizes]
        res = moe_gemm.grouped_gemm(a, b, out=out, config=config)
        torch.cuda.synchronize()
        assert all(r is o for r, o in zip(res, out))
        check(f"out{rep}", res)


@pytest.mark.parametrize("seed", range(3))
def test_general_fast_path_native_scan(seed):
    """grouped_gemm without `out` reads its operands through the C++ scan (kernels/native.py):
    fresh random problem sets (empty, M=1, K=0, sizes off the tiles, K-major B for odd seeds)
    match the float32 reference and, bitwise, the same call through the Python scan."""
    from moe_gemm.ops import launch as host_sm90
    from moe_gemm.ops import native

    assert native.status() == "native", native.status()
    rng = random.Random(seed)
    sizes = [(rng.choice([0, 1, 7, 64, 130, 300]), 8 * rng.randint(1, 48),
              rng.choice([0, 8, 72, 520, 2056])) for _ in range(rng.randint(3, 20))]
    gen = torch.Generator(device="cuda").manual_seed(300 + seed)
    a = [_rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    if seed % 2:
        b = [_rand((n, k), torch.bfloat16, gen).t() for m, n, k in sizes]
    else:
        b = [_rand((k, n), torch.bfloat16, gen) for m, n, k in sizes]
    host_sm90._meta_cache.clear()
    res = moe_gemm.grouped_gemm(a, b)
    torch.cuda.synchronize()
    for i, (ai, bi) in enumerate(zip(a, b)):
        assert res[i].shape == (ai.shape[0], bi.shape[1])
        ref = ai.float() @ bi.float()
        low = (ai @ bi) if ai.shape[1] else torch.zeros_like(ref).to(torch.bfloat16)
        _check(f"general/native-scan/{seed}[{i}]", res[i], ref, low, size=sizes[i])
    with native.python_scan():
        again = moe_gemm.grouped_gemm(a, b)
    torch.cuda.synchronize()
    same = all(torch.equal(x, y) for x, y in zip(res, again))
    record(f"general/native-scan/{seed}/python-scan-bitwise", same)
    assert same
    repeat = moe_gemm.grouped_gemm(a, b)  # from the launch record
    torch.cuda.synchronize()
    same = all(torch.equal(x, y) for x, y in zip(res, repeat))
    record(f"general/native-scan/{seed}/record-bitwise", same)
    assert same


def _general_problems(seed, sizes=((64, 256, 512), (0, 256, 64), (129, 256, 1024),
                                   (1, 256, 72), (300, 256, 264))):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = [_rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    b = [_rand((k, n), torch.bfloat16, gen) for m, n, k in sizes]
    return a, b, gen


def _check_general(tag, res, a, b):
    for i, (ai, bi) in enumerate(zip(a, b)):
        ref = ai.float() @ bi.float()
        low = (ai @ bi) if ai.shape[1] else torch.zeros_like(ref).to(torch.bfloat16)
        _check(f"{tag}[{i}]", res[i], ref, low)


@pytest.mark.parametrize("config", [None, GemmConfig(sort_by_k=True, visitor="host")])
def test_general_fast_path_new_addresses(config):
    """New operand addresses for a problem set launched before (fresh activations each step):
    seen once, the C++ module launches them through its scratch metadata rows; seen again, it
    makes them a launch record. Every call right against float32 and bitwise equal to the
    Python scan, on the default and a side stream, with earlier inputs freed and their memory
    handed back with new values."""
    from moe_gemm.kernels import native

    mod = native.loaded()
    assert mod is not None, native.status()
    sizes = ((64, 256, 512), (0, 256, 64), (129, 256, 1024), (1, 256, 72), (300, 256, 264),
             (17, 256, 2056))
    a, b, gen = _general_problems(70, sizes)
    moe_gemm.grouped_gemm(a, b, config=config)  # the problem set's first launch (Python)
    made, once, ring, _ = mod.stats()[2:6]
    side = torch.cuda.Stream()
    kept = [a]
    for step in range(6):
        if step == 3:  # steps 0-2: new addresses each, launched once, then from a record
            assert mod.stats()[2:4] == (made + 3, once + 3)
        if step == 4:
            kept.clear()  # old inputs freed: their addresses come back with new values
        a = [_rand(t.shape, torch.bfloat16, gen) for t in a]
        kept.append(a)
        if step % 3 == 2:
            b = [_rand(t.shape, torch.bfloat16, gen) for t in b]
        stream = side if step >= 4 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            res = moe_gemm.grouped_gemm(a, b, config=config)
            res2 = moe_gemm.grouped_gemm(a, b, config=config)  # same addresses again
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        _check_general(f"general/new-addresses/{step}", res, a, b)
        with native.python_scan():
            again = moe_gemm.grouped_gemm(a, b, config=config)
        torch.cuda.synchronize()
        same = all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(res, again, res2))
        record(f"general/new-addresses/{step}/python-scan-and-repeat-bitwise", same)
        assert same
    assert sum(mod.stats()[2:4]) >= made + once + 8
    # Their metadata went up through the module's pinned ring (the driver was found).
    assert mod.stats()[4] >= ring + 8


def test_general_fast_path_upload_ring_behind_the_host():
    """The GPU held back (a sleep kernel) while the host makes ~100 launches on new addresses
    through a small ring (1 KiB chunks, 40 uploads a lap): the ring declines to torch's copy
    once a lap is used instead of writing over rows a queued copy has yet to read. Every
    output right against float32, one-off launches and made records alike."""
    from moe_gemm.kernels import native

    mod = native.loaded()
    assert mod is not None, native.status()
    sizes = ((64, 256, 512), (5, 256, 1024), (130, 256, 264))
    a, b, gen = _general_problems(71, sizes)
    mod.upload_testing(0, 1024, 0)  # rings made from now on: 1 KiB chunks
    try:
        side = torch.cuda.Stream()  # a new stream: a new ring
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            inputs = [[_rand(t.shape, torch.bfloat16, gen) for t in a] for _ in range(60)]
            # (taken before the first launch, whose rows also go up through the ring)
            ring, torch_copies = mod.stats()[4:6]
            moe_gemm.grouped_gemm(a, b)  # the problem set's first launch here (Python)
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of everything below
            results = []  # (tag, inputs, outputs)
            for i, a1 in enumerate(inputs):
                results.append((f"{i}/once", a1, moe_gemm.grouped_gemm(a1, b)))
                if i % 2:  # seen again: a record
                    results.append((f"{i}/again", a1, moe_gemm.grouped_gemm(a1, b)))
            queued = mod.stats()[4:6]
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    finally:
        mod.upload_testing(0, 0, 0)
    record("general/upload-ring/declined-while-behind", queued[1] > torch_copies,
           ring=queued[0] - ring, torch=queued[1] - torch_copies)
    assert queued[0] - ring >= 40 and queued[1] > torch_copies
    for tag, a1, res in results:
        _check_general(f"general/upload-ring/{tag}", res, a1, b)


def test_general_fast_path_graph_capture_after_records():
    """grouped_gemm captured in a CUDA graph after eager calls made launch records: the
    capture takes the Python path (the module declines while capturing) and replays with
    new operand values in place."""
    a, b, gen = _general_problems(31)
    for _ in range(2):
        eager = moe_gemm.grouped_gemm(a, b)
    torch.cuda.synchronize()
    _check_general("general/fast-path-graph/eager", eager, a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_gemm.grouped_gemm(a, b)
    for trial in range(3):
        for t in (*a, *b):
            t.copy_(_rand(t.shape, torch.bfloat16, gen))
        graph.replay()
        torch.cuda.synchronize()
        _check_general(f"general/fast-path-graph/replay{trial}", captured, a, b)
        again = moe_gemm.grouped_gemm(a, b)
        torch.cuda.synchronize()
        same = all(torch.equal(x, y) for x, y in zip(again, captured))
        record(f"general/fast-path-graph/replay{trial}/eager-bitwise", same)
        assert same


def test_general_fast_path_threads():
    """Threads calling grouped_gemm at once (each its own operands, then shared ones): every
    result right; records are per thread and stream."""
    import threading

    sets = [_general_problems(40 + i) for i in range(4)]
    shared = _general_problems(50)
    results: dict[tuple, list] = {}
    errors: list[BaseException] = []

    def work(i):
        try:
            for rep in range(5):
                a, b, _ = sets[i]
                results[(i, rep)] = moe_gemm.grouped_gemm(a, b)
                results[(i, rep, "shared")] = moe_gemm.grouped_gemm(shared[0], shared[1])
            torch.cuda.current_stream().synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    for key, res in results.items():
        a, b = (shared[0], shared[1]) if "shared" in key else sets[key[0]][:2]
        _check_general(f"general/fast-path-threads/{key}", res, a, b)


def test_general_fast_path_grad_and_no_grad():
    """Operands requiring grad: under no_grad grouped_gemm runs from the launch record; under
    grad mode (a record exists by then) it takes the Python path, whose outputs are linked to
    the graph so that backward raises (inference-only kernels)."""
    a, b, _ = _general_problems(60)
    w = [t.clone().requires_grad_() for t in b]
    with torch.no_grad():
        first = moe_gemm.grouped_gemm(a, w)
        second = moe_gemm.grouped_gemm(a, w)
    torch.cuda.synchronize()
    _check_general("general/fast-path-grad/no-grad", second, a, b)
    assert all(torch.equal(x, y) for x, y in zip(first, second))
    linked = moe_gemm.grouped_gemm(a, w)
    torch.cuda.synchronize()
    assert all(r.requires_grad for r in linked if r.numel())
    _check_general("general/fast-path-grad/grad-mode", [r.detach() for r in linked], a, b)
    with pytest.raises(RuntimeError, match="inference-only"):
        sum(r.float().sum() for r in linked).backward()


# ---------------------------------------------------------------------------------------------
# Whole-tile epilogue variant (compile-time; tune.py's ew1)


@pytest.mark.parametrize("form", ["general", "varlen", "batched"])
def test_epilogue_whole_tile_variant(form, monkeypatch):
    import dataclasses

    from moe_gemm.ops import launch as host_sm90

    for name in ("choose_general", "choose_varlen", "choose_batched"):
        orig = getattr(host_sm90, name)
        monkeypatch.setattr(host_sm90, name, lambda *a, _o=orig, **k: dataclasses.replace(
            _o(*a, **k), epi_whole=True))
    cfg = GemmConfig(backend="cute", schedule="cooperative")
    if form == "general":
        _run_general("epi-whole/general", [(130, 200, 72), (256, 512, 1024), (1, 64, 64),
                                           (300, 264, 4096)], torch.bfloat16, "row", cfg)
    elif form == "varlen":
        _run_varlen("epi-whole/varlen", 12, 2500, 512, 640, "holes", torch.bfloat16, "nk_view",
                    cfg, "given", tail=21)
    else:
        _run_batched("epi-whole/batched", 9, 300, 512, 1024, config=cfg, out_mode="given")
        _run_batched("epi-whole/batched-fp16", 4, 129, 264, 200, torch.float16, config=cfg,
                     out_mode="alloc")
    info = host_sm90.last_launch()
    assert info is not None and info.choice.epi_whole


def test_default_picks_cute_and_backward_raises():
    """The kernels have no backward: with inputs that require grad, backward says so."""
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([10, 30, 30, 64], dtype=torch.int32, device="cuda")
    cfg = GemmConfig(backend="cute")
    for _ in range(2):  # first call builds the plan, the second takes the cached one
        y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
        assert y.requires_grad
        with pytest.raises(RuntimeError, match="inference-only"):
            y.float().sum().backward()
    y3 = moe_gemm.grouped_mm(x.view(4, 16, 128), w, config=cfg)
    with pytest.raises(RuntimeError, match="inference-only"):
        y3.float().sum().backward()
    outs = moe_gemm.grouped_gemm([x[:10], x[10:]], [w[0], w[1]], config=cfg)
    with pytest.raises(RuntimeError, match="inference-only"):
        sum(o.float().sum() for o in outs).backward()
    with torch.no_grad():
        assert moe_gemm.grouped_mm(x, w, offs, config=cfg).grad_fn is None
    # The values are the kernel's either way.
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w.detach(), offs)
    _check("autograd-link/values", y.detach(), ref, moe_gemm.grouped_mm(
        x, w.detach(), offs, config=GemmConfig(backend="torch")))
    record("autograd-link/backward-raises", True)


# ---------------------------------------------------------------------------------------------
# GroupedGemmPlan: prepared once, recomputed from current values (general-other group: fast_path)


def test_plan_fast_path_recomputes_and_captures():
    rng = random.Random(3)
    sizes = _general_case("mixed", rng)
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = [_rand((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    b = [(_rand((n, k), torch.bfloat16, gen).t() if i % 3 == 0 else
          _rand((k, n), torch.bfloat16, gen)) for i, (m, n, k) in enumerate(sizes)]
    plan = moe_gemm.GroupedGemmPlan(a, b, config=GemmConfig(backend="cute"))
    assert plan.backend == "cute"

    def check(tag):
        for i, (ai, bi) in enumerate(zip(a, b)):
            ref = ai.float() @ bi.float()
            low = (ai @ bi) if ai.shape[1] > 0 else torch.zeros_like(ref).to(torch.bfloat16)
            _check(f"plan/{tag}[{i}]", plan.out[i], ref, low)

    plan()
    torch.cuda.synchronize()
    check("first")
    for t in (*a, *b):  # new values in place, minority-layout B included
        t.copy_(_rand(t.shape, torch.bfloat16, gen))
    plan()
    torch.cuda.synchronize()
    check("updated")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan()
    for t in (*a, *b):
        t.copy_(_rand(t.shape, torch.bfloat16, gen))
    graph.replay()
    torch.cuda.synchronize()
    check("graph")


# ---------------------------------------------------------------------------------------------
# Tail split (cooperative, K >= 4096 by default; kernels/constants.py): a last wave of at most
# half the grid runs as half-K units on two CTAs joined through an fp32 workspace slot.

TS_N = 2048  # 8 n-tiles of 128x256


def _tail_split_counts(num_ctas: int, zero_tail_tiles: int) -> list[int]:
    """Expert rows (empty experts, 1 row, edges of a 128-row tile) whose tile count (plus
    the zero tail's m-tiles, when the kernel writes it) leaves a last wave of at most half the
    grid, so the kernel splits it."""
    counts = [1, 0, 700, 129, 1000, 300, 77, 0, 64]
    while True:
        m_tiles = sum(-(-c // 128) for c in counts) + zero_tail_tiles
        if sched.tail_split_units(m_tiles * TS_N // 256, num_ctas) is not None:
            return counts
        counts[2] += 128


def _nsm() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("dtype,out_dtype,w_layout,out_mode", [
    ("bf16", None, "nk_view", "given"),
    ("bf16", None, "kn", "alloc"),
    ("fp16", None, "nk_view", "alloc"),
    ("bf16", torch.float32, "nk_view", "alloc"),
])
def test_tail_split_rows(dtype, out_dtype, w_layout, out_mode):
    from moe_gemm.ops.launch import last_launch

    K, zero_tail = 4096, 50
    # The kernel zeroes rows past offs[-1] only in the output it allocates.
    counts = _tail_split_counts(_nsm(), 1 if out_mode == "alloc" else 0)
    E, T = len(counts), sum(counts) + zero_tail
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    g = torch.Generator(device="cuda").manual_seed(31)
    dt = DTYPES[dtype]
    x = _rand((T, K), dt, g)
    w = (_rand((E, TS_N, K), dt, g).transpose(1, 2) if w_layout == "nk_view"
         else _rand((E, K, TS_N), dt, g))
    odt = out_dtype or dt
    out = None
    if out_mode == "given":
        out = torch.full((T, TS_N), float("nan"), dtype=odt, device="cuda")
        out[T - zero_tail:] = 7.0  # rows past offs[-1] must stay untouched
    y = moe_gemm.grouped_mm(x, w, offs, out=out, out_dtype=out_dtype)
    torch.cuda.synchronize()
    info = last_launch()
    assert info.choice.tail_split and info.choice.schedule == "cooperative"
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = torch.zeros((T, TS_N), dtype=odt, device="cuda")
    start = 0
    for e, c in enumerate(counts):
        if c:
            low[start:start + c] = (x[start:start + c] @ w[e]).to(odt)
        start += c
    name = f"tail-split/{dtype}/{out_dtype}/{w_layout}/{out_mode}"
    if out_mode == "given":
        untouched = bool((y[T - zero_tail:] == 7.0).all())
        record(f"{name}/tail-untouched", untouched)
        assert untouched
        _check(name, y[:T - zero_tail], ref[:T - zero_tail], low[:T - zero_tail], T=T, K=K)
    else:
        zeros = bool((y[T - zero_tail:] == 0).all())
        record(f"{name}/zero-tail", zeros)
        assert zeros
        _check(name, y, ref, low, T=T, K=K)
    again = moe_gemm.grouped_mm(x, w, offs, out_dtype=out_dtype)
    same = torch.equal(again[:T - zero_tail], y[:T - zero_tail])
    record(f"{name}/run-to-run-bitwise", same)
    assert same


@pytest.mark.parametrize("extra_rows", [0, 40 * 128])
def test_tail_split_visits(extra_rows):
    """The trace (tiles stored per CTA) is schedule.tail_split_assignment: split tiles are
    stored by their finisher CTA; with a last wave over half the grid, plain round robin."""
    from moe_gemm.ops.launch import grouped_mm_cute, last_launch, trace_assignment

    K = 4096
    counts = _tail_split_counts(_nsm(), 0)
    counts[4] += extra_rows
    nsm = _nsm()
    while extra_rows and sched.tail_split_units(
            sum(-(-c // 128) for c in counts) * 8, nsm) is not None:
        counts[4] += 128  # make the last wave more than half full
    T = sum(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(counts), K, TS_N, device="cuda", dtype=torch.bfloat16)
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), GemmConfig(backend="cute"),
                    trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    assert info.choice.tail_split
    got = trace_assignment(info)
    ch = info.choice
    tiles = [-(-r // ch.tile_m) * (TS_N // ch.tile_n) for r in counts]
    owners = sched.tail_split_assignment(tiles, [K // 64] * len(counts), info.num_ctas).per_cta
    want = [[(p, *sched.tile_coord(local, -(-counts[p] // ch.tile_m), TS_N // ch.tile_n,
                                   ch.swizzle)) for p, local in cta] for cta in owners]
    ok = got == want
    split = sched.tail_split_units(sum(tiles), info.num_ctas) is not None
    assert split == (not extra_rows)
    record(f"tail-split/visits/split={split}", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule.tail_split_assignment"


def test_tail_split_replays_reset_counters():
    """Every finisher resets its counter: eager launches and CUDA-graph replays on new data
    stay right, and the counters read zero afterwards."""
    from moe_gemm.kernels.sm90.constants import split_workspace_bytes
    from moe_gemm.ops import launch as host_sm90

    K = 4096
    counts = _tail_split_counts(_nsm(), 0)
    T, E = sum(counts), len(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, TS_N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    for trial in range(3):
        x.copy_(torch.randn(T, K, device="cuda", dtype=torch.bfloat16))
        y = moe_gemm.grouped_mm(x, w, offs)
        torch.cuda.synchronize()
        _check_mm(f"tail-split/eager{trial}", y, x, w, offs)
    info = host_sm90.last_launch()
    assert info.choice.tail_split
    counters, _, total = split_workspace_bytes(info.num_ctas, info.choice.tile_m,
                                               info.choice.tile_n)
    spaces = [ws for key, ws in host_sm90._workspaces.items()
              if key[-1] and key[-2] == -(-total // 8)]
    assert spaces, "no tail-split workspace cached"
    for ws in spaces:
        raw = ws.view(torch.int32)[counters // 4:counters // 4 + info.num_ctas]
        zero = bool((raw == 0).all())
        record("tail-split/counters-zero-after-eager", zero)
        assert zero
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = moe_gemm.grouped_mm(x, w, offs)
    for trial in range(3):
        x.copy_(torch.randn(T, K, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        _check_mm(f"tail-split/graph-replay{trial}", yg, x, w, offs)
        eager = moe_gemm.grouped_mm(x, w, offs)
        same = torch.equal(eager, yg)
        record(f"tail-split/graph-replay{trial}/eager-bitwise", same)
        assert same


def test_tail_split_switch_applies_to_next_call(monkeypatch):
    """MOE_GEMM_TAIL_SPLIT=0 takes effect on the next call of a shape already planned, and
    unset again brings the split back; results stay right either way."""
    from moe_gemm.ops.launch import last_launch

    counts = _tail_split_counts(_nsm(), 0)
    T, E, K = sum(counts), len(counts), 4096
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, TS_N, device="cuda", dtype=torch.bfloat16)
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
    for value, want in ((None, True), ("0", False), (None, True)):
        if value is None:
            monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
        else:
            monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", value)
        y = moe_gemm.grouped_mm(x, w, offs)
        torch.cuda.synchronize()
        got = last_launch().choice.tail_split
        record(f"tail-split/switch={value}/applied", got == want)
        assert got == want
        _check_mm(f"tail-split/switch={value}", y, x, w, offs)


@pytest.mark.parametrize("G,M,N", [(37, 200, 512), (67, 1, 512), (70, 64, 264)])
def test_tail_split_bmm(G, M, N, monkeypatch):
    """The 3-D form with the tail split forced (not a default choice there)."""
    import dataclasses

    from moe_gemm.ops import launch as host_sm90

    orig = host_sm90.choose_batched
    monkeypatch.setattr(host_sm90, "choose_batched", lambda *a, **k: dataclasses.replace(
        orig(*a, **k), tail_split=True, cluster_m=1, cluster_n=1))
    cfg = GemmConfig(backend="cute", schedule="cooperative")
    _run_batched(f"tail-split/bmm/{G}x{M}x{N}", G, M, N, 4096, config=cfg, out_mode="given")
    info = host_sm90.last_launch()
    assert info.choice.tail_split


# ---------------------------------------------------------------------------------------------
# Operands whose memory is not plainly their value: stride-0 (expanded) dims, lazily negated
# views, a K == 1 B whose N stride is not 16-byte aligned. Each op must return the right values
# (on our kernels where they can take the layout, else on the torch backend).


def test_expanded_or_negated_operands_general():
    gen = torch.Generator(device="cuda").manual_seed(70)
    bf = torch.bfloat16
    row = _rand((1, 256), bf, gen)
    cols = _rand((1, 128), bf, gen)
    w = _rand((256, 128), bf, gen)
    w33 = _rand((128, 33), bf, gen)
    cases = {
        "a-expanded-rows": ([row.expand(64, 256)], [w]),
        "b-expanded-k": ([_rand((64, 256), bf, gen)], [cols.expand(256, 128)]),
        "b-neg-view": ([_rand((64, 256), bf, gen)], [torch._neg_view(w)]),
        "a-neg-view": ([torch._neg_view(_rand((64, 256), bf, gen))], [w]),
        "b-k1-odd-n-stride": ([_rand((64, 1), bf, gen)], [w33[:, :1].t()]),
    }
    import warnings

    for name, (a, b) in cases.items():
        for rep in range(2):  # the second call from the C++ module's record where it took it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                res = moe_gemm.grouped_gemm(a, b)
            torch.cuda.synchronize()
            for i, (ai, bi) in enumerate(zip(a, b)):
                ref = ai.float() @ bi.float()
                _check(f"expanded/general/{name}/{rep}[{i}]", res[i], ref,
                       (ai.resolve_neg() @ bi.resolve_neg()))


def test_expanded_or_negated_operands_grouped_mm():
    gen = torch.Generator(device="cuda").manual_seed(71)
    bf = torch.bfloat16
    E, K, N, T = 4, 256, 128, 300
    offs = torch.tensor([50, 50, 170, 300], dtype=torch.int32, device="cuda")
    x = _rand((T, K), bf, gen)
    w1 = _rand((1, K, N), bf, gen)
    w = _rand((E, K, N), bf, gen)
    cases = {
        "w-expanded-experts": (x, w1.expand(E, K, N)),
        "x-expanded-rows": (_rand((1, K), bf, gen).expand(T, K), w),
        "w-neg-view": (x, torch._neg_view(w)),
        "x-neg-view": (torch._neg_view(x), w),
    }
    import warnings

    for name, (xi, wi) in cases.items():
        for rep in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                y = moe_gemm.grouped_mm(xi, wi, offs)
            torch.cuda.synchronize()
            _check_mm(f"expanded/grouped_mm/{name}/{rep}", y, xi.resolve_neg(),
                      wi.resolve_neg(), offs)
    # The batched form.
    G, M = 3, 64
    xb = _rand((1, M, K), bf, gen)
    wb = _rand((G, K, N), bf, gen)
    for name, (xi, wi) in {"x-expanded-batch": (xb.expand(G, M, K), wb),
                           "w-expanded-batch": (_rand((G, M, K), bf, gen),
                                                wb[:1].expand(G, K, N)),
                           "w-neg-view": (_rand((G, M, K), bf, gen), torch._neg_view(wb))}.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            y = moe_gemm.grouped_mm(xi, wi)
        torch.cuda.synchronize()
        ref = xi.float() @ wi.resolve_neg().float()
        _check(f"expanded/batched/{name}", y, ref, torch.bmm(xi.resolve_neg(), wi.resolve_neg()))


# ---------------------------------------------------------------------------------------------
# grouped_mm's C++ path (kernels/native/mm_call.h): repeated calls launched from an entry
# through the compiled function's TVM-FFI C call


def _mm_launches() -> int:
    from moe_gemm.kernels import native

    stats = native.mm_stats()
    return -1 if stats is None else stats[2]


def _native_ready() -> None:
    from moe_gemm.kernels import native

    if native.status() != "native":
        pytest.skip(f"C++ module unavailable: {native.status()}")


MM_FAST_CASES = {
    # name: (T, row counts, N, K, dtype, out_dtype, w K-major, out given, config)
    "skewed": (1000, [0, 1, 300, 0, 99, 600], 256, 512, torch.bfloat16, None, False, False,
               None),
    "fp16-kmajor-fp32out": (515, [64, 1, 0, 450], 136, 264, torch.float16, torch.float32,
                            True, False, None),
    "out-given": (700, [200, 0, 500], 512, 1024, torch.bfloat16, None, False, True, None),
    "cooperative-256": (2048, [512] * 4, 1024, 2048, torch.bfloat16, None, True, False,
                        GemmConfig(schedule="cooperative", tile_m=128, tile_n=256)),
    "cluster-2x1": (1030, [7, 1000, 23], 512, 512, torch.bfloat16, None, False, False,
                    GemmConfig(schedule="cooperative", cluster_m=2, cluster_n=1)),
    "tail-split-default": (8192, [1024] * 8, 2048, 4096, torch.bfloat16, None, True, False,
                           None),
}


@pytest.mark.parametrize("case", sorted(MM_FAST_CASES))
def test_mm_fast_path_matches_reference(case):
    """Calls 1-2 run through Python (the plan, then the entry); later ones from the C++ entry,
    with new x values at the same address, a new x tensor, new offs values, new outputs."""
    _native_ready()
    T, counts, N, K, dtype, out_dtype, k_major, with_out, cfg = MM_FAST_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(case.encode()))
    E = len(counts)
    w = (_rand((E, N, K), dtype, gen).transpose(1, 2) if k_major
         else _rand((E, K, N), dtype, gen))
    x = _rand((T, K), dtype, gen)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    odt = out_dtype or dtype
    out = torch.empty(T, N, dtype=odt, device="cuda") if with_out else None

    def run(xv, ov):
        return moe_gemm.grouped_mm(xv, w, offs, out=ov, config=cfg, out_dtype=out_dtype)

    run(x, out)
    run(x, out)
    before = _mm_launches()
    for step in range(4):
        if step == 1:
            x.copy_(_rand((T, K), dtype, gen))  # same address, new values
        if step == 2:
            x = _rand((T, K), dtype, gen)  # a new tensor (same alignment)
        if step == 3:  # new offs values, same shape (the kernel reads them on the GPU)
            cuts = sorted(random.Random(step).sample(range(T - 4), E - 1))
            offs.copy_(torch.tensor(cuts + [T - 5], dtype=torch.int32))
        ov = torch.full((T, N), float("nan"), dtype=odt, device="cuda") if with_out else None
        y = run(x, ov)
        if with_out:
            assert y is ov
        ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
        low = moe_gemm.grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
        end = int(offs[-1])
        if with_out:  # rows past offs[-1] are the caller's (left as they were)
            y, ref, low = y[:end], ref[:end], low[:end]
        else:
            assert bool((y[end:] == 0).all())
        _check(f"mm-fast/{case}/{step}", y, ref, low.to(odt))
    assert _mm_launches() == before + 4, "the repeated calls did not launch from the entry"


def test_mm_fast_path_batched_matches_reference():
    _native_ready()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for G, M, N, K, k_major in ((6, 100, 264, 512, False), (3, 1, 512, 1024, True),
                                (64, 128, 512, 7168, False)):
        w = (_rand((G, N, K), torch.bfloat16, gen).transpose(1, 2) if k_major
             else _rand((G, K, N), torch.bfloat16, gen))
        x = _rand((G, M, K), torch.bfloat16, gen)
        moe_gemm.grouped_mm(x, w)
        moe_gemm.grouped_mm(x, w)
        before = _mm_launches()
        for _ in range(2):
            x = _rand((G, M, K), torch.bfloat16, gen)
            y = moe_gemm.grouped_mm(x, w)
            ref = torch.bmm(x.float(), w.float())
            _check(f"mm-fast/batched/{G}x{M}x{N}x{K}", y, ref, torch.bmm(x, w))
        assert _mm_launches() == before + 2


def test_mm_fast_path_launches_on_the_current_stream():
    """The entry launches on the caller's current stream (the TVM-FFI environment stream set
    per call): behind a long sleep on a side stream, then a copy into x on it, the kernel must
    read the new x."""
    _native_ready()
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = _rand((512, 256), torch.bfloat16, gen)
    w = _rand((4, 256, 128), torch.bfloat16, gen)
    offs = torch.tensor([100, 200, 400, 512], dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    new_x = _rand((512, 256), torch.bfloat16, gen)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(3):  # plan, entry, then launches from the entry on this stream
            moe_gemm.grouped_mm(x, w, offs)
        before = _mm_launches()
        torch.cuda._sleep(200_000_000)  # ~0.1 s at ~2 GHz
        x.copy_(new_x)
        y = moe_gemm.grouped_mm(x, w, offs)
        assert _mm_launches() == before + 1
    side.synchronize()
    ref = moe_gemm.ops.reference.grouped_mm_ref(new_x, w, offs)
    low = moe_gemm.grouped_mm(new_x, w, offs, config=GemmConfig(backend="torch"))
    _check("mm-fast/side-stream", y, ref, low)
    # And the default stream's own entry is another one (its workspace is its own).
    torch.cuda.synchronize()
    for _ in range(3):
        y2 = moe_gemm.grouped_mm(new_x, w, offs)
    torch.cuda.synchronize()
    _check("mm-fast/default-stream", y2, ref, low)


def test_mm_fast_path_declines_during_graph_capture():
    _native_ready()
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = _rand((300, 128), torch.bfloat16, gen)
    w = _rand((3, 128, 256), torch.bfloat16, gen)
    offs = torch.tensor([100, 100, 290], dtype=torch.int32, device="cuda")
    for _ in range(3):
        moe_gemm.grouped_mm(x, w, offs)
    torch.cuda.synchronize()
    before = _mm_launches()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph):
            y = moe_gemm.grouped_mm(x, w, offs)
    assert _mm_launches() == before, "a launch from an entry was captured"
    x.copy_(_rand((300, 128), torch.bfloat16, gen))
    offs.copy_(torch.tensor([0, 150, 300], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = moe_gemm.grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
    _check("mm-fast/graph-replay", y, ref, low)
    z = moe_gemm.grouped_mm(x, w, offs)  # after the capture: from the entry again
    assert _mm_launches() == before + 1
    _check("mm-fast/after-capture", z, ref, low)


def test_mm_fast_path_grad_mode():
    """Grad-requiring weights under grad mode take the Python path (backward raises); under
    no_grad the entry launches."""
    _native_ready()
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = _rand((256, 128), torch.bfloat16, gen)
    w = torch.nn.Parameter(_rand((2, 128, 128), torch.bfloat16, gen))
    offs = torch.tensor([100, 256], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            moe_gemm.grouped_mm(x, w, offs)
        before = _mm_launches()
        moe_gemm.grouped_mm(x, w, offs)
        assert _mm_launches() == before + 1
    y = moe_gemm.grouped_mm(x, w, offs)
    assert _mm_launches() == before + 1
    with pytest.raises(RuntimeError):
        y.float().sum().backward()
