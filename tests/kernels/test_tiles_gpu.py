"""GPU tests of the sm90 tile family, ping-pong clusters and raster orders (`pytest -m gpu`).

Every new tile (ping-pong 64x192, 128x160, 128x208, 192x128; cooperative 128x160, 128x224 and the
256-row 256x{128,160,192,208}) in all three forms (general lists, varlen MoE, batched), both
B majors, with M = 1, empty problems, K = 0, sizes off the tiles, long K (which turns on the
tail split for cooperative varlen), 16-bit and fp32 output; ping-pong with 2x1 / 1x2 clusters
(experts ending inside a pair, odd tile counts: the pair's CTA past the edge stores nothing);
256-row tiles with clusters; and the kernel's tile order against moe_gemm.ops.schedule
(`cta_tiles`) for the new tiles, both visitors, clusters and raster codes.

Fresh random data per case; outputs poisoned with NaN before the launch (an unwritten
element fails); the float32 reference by the 2x rule (the kernel's error at most twice
torch's own low-precision GEMM's, plus 1e-3 of the scale); rows past offs[-1] given as 7.0
must stay 7.0.

Parallel runs: MOE_GEMM_TEST_SHARD=i/n runs the i-th of n disjoint shares of the cases (a
share by a hash of the test id), so n processes can split the file (with a shared
MOE_GEMM_CACHE_DIR, a kernel compiled by one is loaded by the others). About 90 kernels
compile (~1-3 s each on the device), e.g. eight processes on one GPU:

    export MOE_GEMM_CACHE_DIR=/tmp/kcache PYTHONUNBUFFERED=1
    for i in 0 1 2 3 4 5 6 7; do MOE_GEMM_TEST_SHARD=$i/8 MOE_GEMM_GPU_REPORT=/tmp/tiles-$i.jsonl \
      timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_tiles_gpu.py \
      > /tmp/tiles-$i.log 2>&1 & done; wait
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.kernels.sm90.constants import raster_code
from moe_gemm.ops import schedule as sched

from .gpu_report import record
from .helpers import check, rand

pytestmark = pytest.mark.gpu
DEV = "cuda"

# (schedule, tile) of every tile this file covers beyond 128x{64,128,192,256} and 64x{128,256}.
NEW_TILES = [("pingpong", (64, 192)), ("pingpong", (128, 160)), ("pingpong", (128, 208)),
             ("pingpong", (192, 128)),
             ("cooperative", (128, 160)), ("cooperative", (128, 224)),
             ("cooperative", (256, 128)), ("cooperative", (256, 160)),
             ("cooperative", (256, 192)), ("cooperative", (256, 208))]
TILE_IDS = [f"{s[:4]}{m}x{n}" for s, (m, n) in NEW_TILES]
CLUSTERS = {"2x1": (2, 1), "1x2": (1, 2)}


@pytest.fixture(autouse=True)
def _shard(request):
    spec = os.environ.get("MOE_GEMM_TEST_SHARD")
    if spec:
        i, n = (int(v) for v in spec.split("/"))
        if zlib.crc32(request.node.nodeid.encode()) % n != i:
            pytest.skip(f"shard {spec}: another process runs this case")


def _cfg(schedule, tile, cluster=(1, 1), **extra):
    return GemmConfig(backend="cute", schedule=schedule, tile_m=tile[0], tile_n=tile[1],
                      cluster_m=cluster[0], cluster_n=cluster[1], **extra)


def _gen(name):
    return torch.Generator(device=DEV).manual_seed(zlib.crc32(name.encode()))


def _assert_choice(name, cfg):
    """The launch ran the config's tile, schedule and cluster (nothing chose around it)."""
    from moe_gemm.ops.launch_info import last_launch

    c = last_launch().choice
    got = (c.schedule, c.tile_m, c.tile_n, c.cluster_m, c.cluster_n)
    want = (cfg.schedule, cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n)
    record(f"{name}/choice", got == want, choice=str(c))
    assert got == want, (got, want)
    return c


# ---------------------------------------------------------------------------------------------
# Runners: one per form


def _general(name, sizes, b_major, cfg, dtype=torch.bfloat16, out_dtype=None):
    gen = _gen(name)
    a = [rand((m, k), dtype, gen) for m, n, k in sizes]
    if b_major == "k":  # (K, N) views of (N, K) tensors: K contiguous
        b = [rand((n, k), dtype, gen).t() for m, n, k in sizes]
    else:
        b = [rand((k, n), dtype, gen) for m, n, k in sizes]
    odt = out_dtype or dtype
    out = [torch.full((m, n), float("nan"), dtype=odt, device=DEV) for m, n, k in sizes]
    res = moe_gemm.grouped_gemm(a, b, out=out, config=cfg)
    torch.cuda.synchronize()
    _assert_choice(name, cfg)
    assert all(r is o for r, o in zip(res, out))
    for i, (m, n, k) in enumerate(sizes):
        ref = a[i].float() @ b[i].float()
        low = (a[i] @ b[i]).to(odt)
        check(f"{name}[{i}]", out[i], ref, low, size=sizes[i])


def _general_sizes(tile):
    """M = 1, an empty problem, K = 0, sizes off the tile in M, N and K, a long K, a problem
    narrower than one tile (N = 8), odd tile counts (2 * tile_m + 3 rows: 3 m-tiles)."""
    tm, tn = tile
    return [(1, tn + 8, 72), (0, 2 * tn, 64), (tm + 1, 2 * tn - 8, 1000),
            (2 * tm + 3, tn // 2 + 8, 136), (tm, tn, 0), (3, 8, 16), (tm - 1, tn + 24, 4160)]


def _varlen(name, counts, N, K, w_major, cfg, dtype=torch.bfloat16, out_dtype=None, tail=37,
            out_mode="given"):
    E = len(counts)
    T = sum(counts) + tail
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEV)
    gen = _gen(name)
    x = rand((T, K), dtype, gen)
    if w_major == "k":  # the transpose of an (E, N, K) weight (what transformers stores)
        w = rand((E, N, K), dtype, gen).transpose(1, 2)
    else:
        w = rand((E, K, N), dtype, gen)
    odt = out_dtype or dtype
    if out_mode == "given":
        out = torch.full((T, N), float("nan"), dtype=odt, device=DEV)
        out[T - tail:] = 7.0  # rows past offs[-1] must stay untouched
        y = moe_gemm.grouped_mm(x, w, offs, out=out, config=cfg)
        assert y is out
    else:  # allocated: rows past offs[-1] come back zero
        y = moe_gemm.grouped_mm(x, w, offs, config=cfg, out_dtype=out_dtype)
    torch.cuda.synchronize()
    _assert_choice(name, cfg)
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = torch.zeros(T, N, dtype=odt, device=DEV)
    start = 0
    for e, c in enumerate(counts):
        if c:
            low[start:start + c] = (x[start:start + c] @ w[e]).to(odt)
        start += c
    if out_mode == "given" and tail:
        untouched = bool((y[T - tail:] == 7.0).all())
        record(f"{name}/tail-untouched", untouched)
        assert untouched, "rows past offs[-1] were written"
        check(name, y[:T - tail], ref[:T - tail], low[:T - tail], E=E, T=T, N=N, K=K)
    else:
        check(name, y, ref, low, E=E, T=T, N=N, K=K)


def _edge_counts(tile_m):
    """Experts ending on both sides of every tile line: 1 row, tile_m - 1, tile_m, tile_m + 1,
    empty experts, 2 and 3 m-tiles (odd counts: a 2x1 pair's second CTA past the edge)."""
    tm = tile_m
    return [1, tm - 1, tm, tm + 1, 0, 2 * tm + 5, 3, tm // 2, 0, 2 * tm, tm + 63, 77]


def _batched(name, G, M, N, K, w_major, cfg, dtype=torch.bfloat16, out_dtype=None):
    gen = _gen(name)
    x = rand((G, M, K), dtype, gen)
    if w_major == "k":
        w = rand((G, N, K), dtype, gen).transpose(1, 2)
    else:
        w = rand((G, K, N), dtype, gen)
    odt = out_dtype or dtype
    out = torch.full((G, M, N), float("nan"), dtype=odt, device=DEV)
    y = moe_gemm.grouped_mm(x, w, out=out, config=cfg)
    torch.cuda.synchronize()
    _assert_choice(name, cfg)
    assert y.data_ptr() == out.data_ptr()
    check(name, y, x.float() @ w.float(), torch.bmm(x, w).to(odt), G=G, M=M, N=N, K=K)


# ---------------------------------------------------------------------------------------------
# The tile family in every form


@pytest.mark.parametrize("b_major", ["k", "n"])
@pytest.mark.parametrize("schedule,tile", NEW_TILES, ids=TILE_IDS)
def test_general(schedule, tile, b_major):
    _general(f"tiles/general/{schedule}{tile}/{b_major}", _general_sizes(tile), b_major,
             _cfg(schedule, tile))


@pytest.mark.parametrize("w_major", ["k", "n"])
@pytest.mark.parametrize("schedule,tile", NEW_TILES, ids=TILE_IDS)
def test_varlen(schedule, tile, w_major):
    # N = 2 tile_n + 24: three n-tiles, the last one mostly empty; K = 1000 off the k-tile.
    _varlen(f"tiles/varlen/{schedule}{tile}/{w_major}", _edge_counts(tile[0]), 2 * tile[1] + 24,
            1000, w_major, _cfg(schedule, tile))


@pytest.mark.parametrize("schedule,tile", NEW_TILES, ids=TILE_IDS)
def test_varlen_long_k_and_allocated_out(schedule, tile):
    # K = 4160 (65 k-tiles): the cooperative tiles run with the tail split. Twenty empty
    # experts keep the grid (sized from T and E on the host) over twice the 12 real tiles,
    # so every tile is split into two half-K units joined through the workspace.
    from moe_gemm.ops.launch_info import last_launch

    cfg = _cfg(schedule, tile)
    counts = [tile[0] + 3, 0, 1, 2 * tile[0] - 1] + [0] * 20
    N = tile[1] + 40
    _varlen(f"tiles/varlen-longk/{schedule}{tile}", counts, N, 4160, "k", cfg, out_mode="alloc",
            tail=29)
    info = last_launch()
    tiles = sum(-(-r // tile[0]) for r in counts + [29]) * -(-N // tile[1])
    split = info.choice.tail_split and sched.tail_split_units(tiles, info.num_ctas,
                                                              -(-4160 // 64)) is not None
    record(f"tiles/varlen-longk/{schedule}{tile}/tail-split", split == (schedule == "cooperative"))
    assert split == (schedule == "cooperative")


@pytest.mark.parametrize("schedule,tile", NEW_TILES, ids=TILE_IDS)
def test_varlen_one_row_and_all_empty(schedule, tile):
    cfg = _cfg(schedule, tile)
    _varlen(f"tiles/varlen-one-row/{schedule}{tile}", [0, 1, 0], 2 * tile[1] + 24, 1000, "n",
            cfg, tail=0, out_mode="alloc")
    x = torch.randn(70, 1000, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3, 1000, 2 * tile[1] + 24, device=DEV, dtype=torch.bfloat16)
    y = moe_gemm.grouped_mm(x, w, torch.zeros(3, dtype=torch.int32, device=DEV), config=cfg)
    torch.cuda.synchronize()
    ok = bool((y == 0).all())
    record(f"tiles/varlen-all-empty/{schedule}{tile}", ok)
    assert ok


@pytest.mark.parametrize("w_major", ["k", "n"])
@pytest.mark.parametrize("schedule,tile", NEW_TILES, ids=TILE_IDS)
def test_batched(schedule, tile, w_major):
    cfg = _cfg(schedule, tile)
    _batched(f"tiles/batched/{schedule}{tile}/{w_major}", 5, tile[0] + 37, tile[1] + 40, 200,
             w_major, cfg)
    _batched(f"tiles/batched-m1-longk/{schedule}{tile}/{w_major}", 3, 1, 2 * tile[1], 4160,
             w_major, cfg)


@pytest.mark.parametrize("schedule,tile,dtype,out_dtype", [
    ("pingpong", (128, 208), torch.float16, None),
    ("cooperative", (256, 160), torch.float16, None),
    ("pingpong", (128, 208), torch.bfloat16, torch.float32),
    ("cooperative", (256, 208), torch.bfloat16, torch.float32),
], ids=["pp128x208-fp16", "co256x160-fp16", "pp128x208-fp32out", "co256x208-fp32out"])
def test_dtypes(schedule, tile, dtype, out_dtype):
    cfg = _cfg(schedule, tile)
    tag = f"{schedule}{tile}/{dtype}/{out_dtype}"
    _varlen(f"tiles/dtypes/varlen/{tag}", _edge_counts(tile[0]), tile[1] + 8, 328, "n", cfg,
            dtype=dtype, out_dtype=out_dtype)
    _general(f"tiles/dtypes/general/{tag}", _general_sizes(tile), "k", cfg, dtype=dtype,
             out_dtype=out_dtype)


# ---------------------------------------------------------------------------------------------
# Clusters: ping-pong (new) and the 256-row cooperative tiles


PP_CLUSTER_TILES = [(128, 192), (128, 208), (64, 256), (192, 128)]


@pytest.mark.parametrize("cl", list(CLUSTERS))
@pytest.mark.parametrize("tile", PP_CLUSTER_TILES, ids=[f"{m}x{n}" for m, n in PP_CLUSTER_TILES])
def test_pingpong_cluster_varlen(cl, tile):
    # Experts end inside a 2x1 pair (odd m-tile counts) and N has three n-tiles (a 1x2 pair's
    # second CTA past the edge on the last column); both B majors (one per tile).
    w_major = "kn"[PP_CLUSTER_TILES.index(tile) % 2]
    _varlen(f"tiles/pp-cluster{cl}/varlen/{tile}/{w_major}", _edge_counts(tile[0]),
            2 * tile[1] + 24, 1000, w_major, _cfg("pingpong", tile, CLUSTERS[cl]))


@pytest.mark.parametrize("cl", list(CLUSTERS))
@pytest.mark.parametrize("tile", [(128, 192), (128, 208)], ids=["128x192", "128x208"])
def test_pingpong_cluster_general(cl, tile):
    sizes = _general_sizes(tile) + [(m, 3 * tile[1] - 16, 1088) for m in (1, 129, 255, 384)]
    _general(f"tiles/pp-cluster{cl}/general/{tile}", sizes, "n" if tile[1] == 192 else "k",
             _cfg("pingpong", tile, CLUSTERS[cl]))


@pytest.mark.parametrize("cl", list(CLUSTERS))
@pytest.mark.parametrize("tile", [(64, 256), (128, 160)], ids=["64x256", "128x160"])
def test_pingpong_cluster_batched(cl, tile):
    cfg = _cfg("pingpong", tile, CLUSTERS[cl])
    _batched(f"tiles/pp-cluster{cl}/batched/{tile}", 5, 3 * tile[0] - 7, 3 * tile[1] - 24, 264,
             "k" if tile[0] == 64 else "n", cfg)
    _batched(f"tiles/pp-cluster{cl}/batched-m1/{tile}", 3, 1, tile[1], 136, "n", cfg)


@pytest.mark.parametrize("cl", list(CLUSTERS))
def test_pingpong_cluster_graph_replay_with_new_offsets(cl):
    E, T, N, K = 16, 900, 424, 256
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.linspace(0, T, E, device=DEV).round().to(torch.int32)
    cfg = _cfg("pingpong", (128, 208), CLUSTERS[cl])
    moe_gemm.grouped_mm(x, w, offs, config=cfg)  # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    for trial in range(3):
        gen = torch.Generator().manual_seed(200 + trial)
        counts = torch.multinomial(torch.ones(E), T - 40, replacement=True, generator=gen)
        offs.copy_(torch.bincount(counts, minlength=E).cumsum(0).to(torch.int32))
        x.copy_(torch.randn(T, K, device=DEV, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
        low = moe_gemm.grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
        check(f"tiles/pp-cluster{cl}/graph/replay{trial}", y, ref, low)


@pytest.mark.parametrize("cl", list(CLUSTERS))
def test_cooperative_256_row_clusters(cl):
    cluster = CLUSTERS[cl]
    _varlen(f"tiles/co256-cluster{cl}/varlen", _edge_counts(256), 2 * 192 + 24, 1000, "n",
            _cfg("cooperative", (256, 192), cluster))
    _general(f"tiles/co256-cluster{cl}/general", _general_sizes((256, 128)), "k",
             _cfg("cooperative", (256, 128), cluster))
    _batched(f"tiles/co256-cluster{cl}/batched", 4, 3 * 256 - 9, 3 * 208 - 40, 520, "n",
             _cfg("cooperative", (256, 208), cluster))


# ---------------------------------------------------------------------------------------------
# Five A/B stages where the default epilogue staging holds four (D staged in fewer buffers)


DEEP = [("cooperative", (128, 192), (1, 2)), ("pingpong", (128, 208), (2, 1)),
        ("cooperative", (128, 192), (1, 1)), ("pingpong", (128, 208), (1, 1))]


@pytest.mark.parametrize("schedule,tile,cl", DEEP,
                         ids=[f"{s[:4]}{t[0]}x{t[1]}-c{c[0]}x{c[1]}" for s, t, c in DEEP])
def test_five_stages_with_fewer_staging_buffers(schedule, tile, cl):
    from moe_gemm.ops.launch_info import last_launch

    cfg = _cfg(schedule, tile, cl, stages=5)
    name = f"tiles/s5/{schedule}{tile}/c{cl[0]}x{cl[1]}"
    # Long K (65 k-tiles) so the five-deep ring wraps many times; experts end inside tiles and
    # cluster pairs; every subtile of several tiles goes through the three staging buffers.
    _varlen(f"{name}/varlen", _edge_counts(tile[0]), 2 * tile[1] + 24, 4160, "k", cfg)
    assert last_launch().choice.stages == 5
    _general(f"{name}/general", _general_sizes(tile), "n", cfg)
    # (fp32 output leaves room for four stages only: 16 KiB subtiles.)
    _batched(f"{name}/batched-fp16", 3, 2 * tile[0] + 5, tile[1] + 40, 1000, "k", cfg,
             dtype=torch.float16)


# ---------------------------------------------------------------------------------------------
# The kernel visits tiles exactly as moe_gemm.ops.schedule says


@pytest.fixture
def with_raster(monkeypatch):
    """Run launches with a given raster code in place of the heuristics' (any code, also
    those the config cannot pin, e.g. one panel): wraps the three choices the launch modules
    call."""
    from moe_gemm.ops import api, general_launch, mm_launch
    from moe_gemm.ops.signature import PlanCache

    def use(code):
        for module, name in ((general_launch, "choose_general"), (mm_launch, "choose_varlen"),
                             (mm_launch, "choose_batched")):
            fn = getattr(module, name)
            monkeypatch.setattr(
                module, name,
                lambda *a, _fn=fn, **k: dataclasses.replace(_fn(*a, **k), swizzle=code))
        general_launch.general_shape.cache_clear()
        # plans made before hold the old raster
        monkeypatch.setattr(api, "_mm_plans", PlanCache(per_bucket=8, buckets=256))
        monkeypatch.setattr(api, "_general_plans", PlanCache(per_bucket=4, buckets=64))

    yield use
    general_launch.general_shape.cache_clear()


def _trace_varlen(name, cfg, counts, N, K=128):
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.mm_launch import grouped_mm_cute
    from moe_gemm.ops.validation import check_grouped_mm

    T = sum(counts) + 50
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEV)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(len(counts), K, N, device=DEV, dtype=torch.bfloat16)
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    rows = counts + [T - sum(counts)]  # the zero tail is problem E
    if ch.tail_split:
        k_tiles = [-(-K // 64)] * len(counts) + [0]
        counts_t = [-(-r // ch.tile_m) * -(-N // ch.tile_n) for r in rows]
        per = sched.tail_split_assignment(counts_t, k_tiles, info.num_ctas).per_cta
        want = [[(p, *sched.tile_coord(j, -(-rows[p] // ch.tile_m), -(-N // ch.tile_n),
                                       ch.swizzle)) for p, j in cta] for cta in per]
    else:
        want = sched.cta_tiles([(r, N) for r in rows], ch.tile_m, ch.tile_n, info.num_ctas,
                               ch.swizzle, ch.cluster_m, ch.cluster_n)
    ok = trace_assignment(info) == want
    record(name, ok, choice=str(ch))
    assert ok, "kernel tile visits differ from moe_gemm.ops.schedule"


def _trace_general(name, cfg, seed=11):
    import random

    from moe_gemm.ops.general_launch import grouped_gemm_cute
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.validation import check_grouped_gemm

    rng = random.Random(seed)
    sizes = [(rng.choice([0, 1, 130, 257, 600]), 8 * rng.randint(1, 60), 8 * rng.randint(1, 90))
             for _ in range(70)]
    a = [torch.randn(m, k, device=DEV, dtype=torch.bfloat16) for m, n, k in sizes]
    b = [torch.randn(k, n, device=DEV, dtype=torch.bfloat16) for m, n, k in sizes]
    grouped_gemm_cute(check_grouped_gemm(a, b, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    order = list(info.order) if info.order is not None else list(range(len(sizes)))
    want = sched.cta_tiles([sizes[i][:2] for i in order], ch.tile_m, ch.tile_n, info.num_ctas,
                           ch.swizzle, ch.cluster_m, ch.cluster_n)
    want = [[(order[p], m, n) for p, m, n in row] for row in want]
    ok = trace_assignment(info) == want
    record(name, ok, choice=str(ch))
    assert ok, "kernel tile visits differ from moe_gemm.ops.schedule"


def _trace_batched(name, cfg, G=9, M=300, N=264, K=128):
    from moe_gemm.ops.launch_info import last_launch, trace_assignment
    from moe_gemm.ops.mm_launch import grouped_bmm_cute
    from moe_gemm.ops.validation import check_grouped_bmm

    x = torch.randn(G, M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device=DEV, dtype=torch.bfloat16)
    grouped_bmm_cute(check_grouped_bmm(x, w, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    want = sched.cta_tiles([(M, N)] * G, ch.tile_m, ch.tile_n, info.num_ctas, ch.swizzle,
                           ch.cluster_m, ch.cluster_n)
    ok = trace_assignment(info) == want
    record(name, ok, choice=str(ch))
    assert ok, "kernel tile visits differ from moe_gemm.ops.schedule"


HOLES = [0, 1, 129, 0, 64, 300, 7, 0, 200, 0] * 4 + [513, 257]


@pytest.mark.parametrize("schedule,tile,visitor", [
    ("pingpong", (128, 208), "device"), ("cooperative", (256, 208), "device"),
    ("pingpong", (64, 192), "host"), ("cooperative", (256, 160), "host"),
    ("pingpong", (192, 128), "device"), ("pingpong", (192, 128), "host"),
], ids=["pp128x208-dev", "co256x208-dev", "pp64x192-host", "co256x160-host", "pp192x128-dev",
        "pp192x128-host"])
def test_trace_new_tiles_varlen(schedule, tile, visitor):
    _trace_varlen(f"tiles/trace/varlen/{schedule}{tile}/{visitor}",
                  _cfg(schedule, tile, visitor=visitor), HOLES, 2 * tile[1] + 24)


@pytest.mark.parametrize("schedule,tile,visitor,sort_by_k", [
    ("pingpong", (128, 208), "device", True), ("cooperative", (256, 192), "host", True),
    ("cooperative", (128, 224), "device", False),
], ids=["pp128x208-dev-ksort", "co256x192-host-ksort", "co128x224-dev"])
def test_trace_new_tiles_general(schedule, tile, visitor, sort_by_k):
    _trace_general(f"tiles/trace/general/{schedule}{tile}/{visitor}/sort={sort_by_k}",
                   _cfg(schedule, tile, visitor=visitor, sort_by_k=sort_by_k))


@pytest.mark.parametrize("schedule,tile", [("cooperative", (256, 128)), ("pingpong", (128, 160))],
                         ids=["co256x128", "pp128x160"])
def test_trace_new_tiles_batched(schedule, tile):
    _trace_batched(f"tiles/trace/batched/{schedule}{tile}", _cfg(schedule, tile))


def test_trace_tail_split_256_rows():
    # K = 4160, 256x208 tiles, 9 experts of 1000 rows and 4 n-tiles: 144 tiles, so on a
    # 132-SM grid a last wave of 12 split tiles after a full one (fewer SMs: other splits).
    from moe_gemm.ops.launch_info import last_launch

    _trace_varlen("tiles/trace/varlen-tail-split/256x208", _cfg("cooperative", (256, 208)),
                  [1000] * 9, 4 * 208, K=4160)
    info = last_launch()
    assert info.choice.tail_split


@pytest.mark.parametrize("cl", list(CLUSTERS))
def test_trace_pingpong_clusters(cl):
    cluster = CLUSTERS[cl]
    _trace_varlen(f"tiles/trace/pp-cluster{cl}/varlen", _cfg("pingpong", (128, 192), cluster),
                  HOLES, 3 * 192 - 40)
    _trace_general(f"tiles/trace/pp-cluster{cl}/general", _cfg("pingpong", (128, 208), cluster,
                                                              sort_by_k=True))
    _trace_batched(f"tiles/trace/pp-cluster{cl}/batched", _cfg("pingpong", (64, 256), cluster),
                   G=7, M=3 * 64 + 1, N=3 * 256 - 8)


RASTERS = {"m4-serp": raster_code(4, "m", True), "n3": raster_code(3, "n"),
           "n2-serp": raster_code(2, "n", True), "one-panel": raster_code(0),
           "m1-serp": raster_code(1, "m", True)}


@pytest.mark.parametrize("raster", list(RASTERS))
def test_trace_raster_orders(raster, with_raster):
    with_raster(RASTERS[raster])
    _trace_varlen(f"tiles/trace/raster-{raster}/varlen", _cfg("pingpong", (128, 208)),
                  [1100, 0, 700, 129, 2000], 5 * 208 - 8)
    # (N a multiple of 8: the batched launch below is called directly, past the 16-byte
    # stride check that would send a 900-wide bf16 w to the torch backend)
    _trace_batched(f"tiles/trace/raster-{raster}/batched", _cfg("cooperative", (256, 128)),
                   G=3, M=1100, N=904)
    _trace_general(f"tiles/trace/raster-{raster}/general",
                   _cfg("pingpong", (128, 208), (2, 1), sort_by_k=False), seed=13)
    from moe_gemm.ops.launch_info import last_launch

    assert last_launch().choice.swizzle == RASTERS[raster]


def test_raster_pinned_by_the_config():
    # GemmConfig's raster pins reach the kernel: panels of 8 n-tiles, serpentine (QuACK's
    # varlen-M order), on the 192-row ping-pong tile in a 1x2 cluster; order and numbers.
    from moe_gemm.ops.launch_info import last_launch

    cfg = _cfg("pingpong", (192, 128), (1, 2), raster_panel=8, raster_along="n",
               raster_serpentine=True)
    _trace_varlen("tiles/trace/raster-config/varlen", cfg, [1100, 0, 700, 129, 2000],
                  17 * 128 - 8)
    assert last_launch().choice.swizzle == raster_code(8, "n", True)
    _varlen("tiles/raster-config/varlen", _edge_counts(192) * 2, 17 * 128 - 8, 520, "k", cfg)
    assert last_launch().choice.swizzle == raster_code(8, "n", True)


@pytest.mark.parametrize("raster", ["m4-serp", "n2-serp"])
def test_raster_orders_compute_the_same(raster, with_raster):
    # The order changes nothing but the order: results stay right with every raster.
    with_raster(RASTERS[raster])
    _varlen(f"tiles/raster-{raster}/varlen", _edge_counts(128) * 2, 5 * 208 - 8, 520, "n",
            _cfg("pingpong", (128, 208)))
    _general(f"tiles/raster-{raster}/general", _general_sizes((256, 192)), "n",
             _cfg("cooperative", (256, 192), (1, 2)))
