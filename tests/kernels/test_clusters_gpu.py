"""GPU tests of 2x1 / 1x2 thread-block clusters (B / A multicast) in every form.

Varlen and batched: the two CTAs of a cluster take adjacent m- (2x1) or n-tiles (1x2) of one
problem. General form (grouped_gemm's lists): both CTAs encode the same problem's
descriptors, with the multicast box for the shared operand. Odd tile counts leave the pair's
second CTA past the edge, which must then store nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig

from .gpu_report import record
from .helpers import (
    CLUSTER_SHAPES,
    DTYPES,
    EDGE_ROWS,
    check_general,
    general_case,
    general_problems,
    rand,
    run_batched,
    run_general,
    run_varlen,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("counts_kind", ["holes", "zipf"])
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("out_mode", ["given", "alloc"])
def test_cluster_varlen(cl, counts_kind, w_layout, out_mode):
    cfg = GemmConfig(backend="cute", **CLUSTER_SHAPES[cl])
    # N = 264: 3 n-tiles of 128 (1x2: an odd last column) or 2 of 256
    run_varlen(f"cluster{cl}/varlen/{counts_kind}/{w_layout}/{out_mode}", 24, 3000, 264, 200,
               counts_kind, torch.bfloat16, w_layout, cfg, out_mode, tail=37)


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cluster_varlen_tiles_and_long_k(cl, tile_n, dtype):
    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=128, tile_n=tile_n,
                     **CLUSTER_SHAPES[cl])
    run_varlen(f"cluster{cl}/varlen/128x{tile_n}/{dtype}", 8, 2100, 640, 4160, "zipf",
               DTYPES[dtype], "nk_view", cfg, "alloc")


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
def test_cluster_varlen_single_row_and_empty(cl):
    cfg = GemmConfig(backend="cute", **CLUSTER_SHAPES[cl])
    run_varlen(f"cluster{cl}/varlen/one-row", 4, 1, 256, 128, "holes", torch.bfloat16, "kn",
               cfg, "alloc")
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, 128, 256, device="cuda", dtype=torch.bfloat16)
    offs = torch.zeros(3, dtype=torch.int32, device="cuda")
    y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
    torch.cuda.synchronize()
    ok = bool((y == 0).all())
    record(f"cluster{cl}/varlen/all-empty", ok)
    assert ok


CLUSTER_BATCHED_SHAPES = [(5, 130, 264, 200), (3, 300, 512, 1104), (7, 1, 256, 64),
                          (2, 513, 128, 4096), (256, 128, 512, 7168)]


@pytest.mark.parametrize("cl", list(CLUSTER_SHAPES))
@pytest.mark.parametrize("shape", CLUSTER_BATCHED_SHAPES)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_cluster_batched(cl, shape, out_dtype):
    G, M, N, K = shape
    cfg = GemmConfig(backend="cute", **CLUSTER_SHAPES[cl])
    run_batched(f"cluster{cl}/batched{shape}/{out_dtype}", G, M, N, K, config=cfg,
                out_mode="given", out_dtype=out_dtype, w_layout="nk_view")


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
    from moe_gemm.ops.launch_info import last_launch

    cfg = GemmConfig(backend="cute", sort_by_k=sort_by_k, **CLUSTER_SHAPES[cl])
    run_general(f"cluster{cl}/general/{kind}/{b_layout}/sort={sort_by_k}",
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
    run_general(f"cluster{cl}/general/128x{tile_n}/{dtype}/{out_dtype}",
                GENERAL_CLUSTER_CASES["mixed"], DTYPES[dtype], "col", cfg, out_dtype=out_dtype)


def test_cluster_general_many_problems():
    sizes = general_case("many", random.Random(17))
    cfg = GemmConfig(backend="cute", cluster_m=1, cluster_n=2)
    run_general("cluster1x2/general/many", sizes, torch.bfloat16, "row", cfg,
                check_subset=random.Random(3).sample(range(len(sizes)), 64))


# Problems with pairs of n-tiles (cooperative 128x256): the default picks 1x2 for them. Enough
# of them to fill the grid (a set of a few tiles would take a narrower tile instead:
# grid_fit.fill_grid).
DEFAULT_1X2_SIZES = ((128, 512, 1088), (1, 512, 2056), (0, 512, 64), (200, 1024, 1088),
                     (129, 512, 4096), (64, 512, 1088)) * 8


def test_cluster_general_default_through_every_route():
    """The default picks 1x2 for a set whose problems have pairs of n-tiles (cooperative
    128x256): right through grouped_gemm's every route (first call, a repeated call, new
    operand addresses, `out=`, a GroupedGemmPlan, a captured CUDA graph)."""
    from moe_gemm.ops.launch_info import last_launch

    sizes = DEFAULT_1X2_SIZES
    a, b, gen = general_problems(91, sizes)
    res = moe_gemm.grouped_gemm(a, b)
    c = last_launch().choice
    ok = (c.schedule, c.tile_n, c.cluster_m, c.cluster_n) == ("cooperative", 256, 1, 2)
    record("cluster1x2/general/default-picks-1x2", ok, choice=str(c))
    assert ok, c
    torch.cuda.synchronize()
    check_general("cluster1x2/general/default/first", res, a, b)
    again = moe_gemm.grouped_gemm(a, b)  # the cached metadata upload
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(res, again))
    for step in range(3):  # new operand addresses
        a = [rand(t.shape, torch.bfloat16, gen) for t in a]
        res = moe_gemm.grouped_gemm(a, b)
        torch.cuda.synchronize()
        check_general(f"cluster1x2/general/default/new-addresses{step}", res, a, b)
    out = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
           for m, n, _ in sizes]
    moe_gemm.grouped_gemm(a, b, out=out)
    torch.cuda.synchronize()
    check_general("cluster1x2/general/default/out", out, a, b)
    plan = moe_gemm.GroupedGemmPlan(a, b)
    for t in a:
        t.copy_(rand(t.shape, torch.bfloat16, gen))
    torch.cuda.synchronize()
    check_general("cluster1x2/general/default/plan", plan(), a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_gemm.grouped_gemm(a, b)
    for t in (*a, *b):
        t.copy_(rand(t.shape, torch.bfloat16, gen))
    graph.replay()
    torch.cuda.synchronize()
    check_general("cluster1x2/general/default/graph", captured, a, b)
