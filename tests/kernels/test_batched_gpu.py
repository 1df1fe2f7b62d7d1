"""GPU tests of the batched form: grouped_mm(x (G, M, K), w (G, K, N)) without offs, against
torch.bmm in float32: both weight layouts, our / a given / a strided `out`, every tile, empty
and size-one dimensions."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig

from .gpu_report import record
from .helpers import DTYPES, SCHEDULES, check, run_batched

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("out_mode", ["given", "alloc", "view"])
def test_batched_matrix(schedule, w_layout, dtype, out_mode):
    cfg = GemmConfig(backend="cute", schedule=schedule)
    run_batched(f"batched/{schedule}/{w_layout}/{dtype}/{out_mode}", 7, 130, 200, 72,
                DTYPES[dtype], w_layout, cfg, out_mode)


BATCHED_SHAPES = [(1, 1, 8, 16), (3, 1, 64, 64), (5, 77, 136, 7176), (300, 64, 128, 256),
                  (1, 1000, 4096, 128), (2, 257, 8, 8), (9, 129, 264, 1032), (40, 16, 512, 7168)]


@pytest.mark.parametrize("shape", BATCHED_SHAPES)
@pytest.mark.parametrize("schedule", ["auto", *SCHEDULES])
def test_batched_shapes(shape, schedule):
    G, M, N, K = shape
    cfg = GemmConfig(backend="cute", schedule=schedule)
    run_batched(f"batched/shape{shape}/{schedule}", G, M, N, K, config=cfg, out_mode="given")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_batched_out_dtype_and_strided_x(out_dtype, schedule):
    cfg = GemmConfig(backend="cute", schedule=schedule)
    run_batched(f"batched/out={out_dtype}/{schedule}/x-view", 6, 100, 192, 320,
                config=cfg, out_mode="given", out_dtype=out_dtype, x_view=True)


@pytest.mark.parametrize("tile", [(64, 128), (64, 256), (128, 64), (128, 128), (128, 192)])
def test_batched_pingpong_tiles(tile):
    cfg = GemmConfig(backend="cute", schedule="pingpong", tile_m=tile[0], tile_n=tile[1])
    run_batched(f"batched/pingpong{tile}", 5, 200, 264, 200, config=cfg, out_mode="given")


@pytest.mark.parametrize("tile", [(128, 64), (128, 128), (128, 192), (128, 256)])
def test_batched_cooperative_tiles(tile):
    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=tile[0], tile_n=tile[1])
    run_batched(f"batched/cooperative{tile}", 5, 200, 264, 200, config=cfg, out_mode="given")


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
    check("batched/size-one-odd-stride", y, ref, torch.bmm(x, w))


# The 3-D form's default fitted to whole waves (ops/grid_fit.py): it runs the fitted choice
# and gives the right result.
@pytest.mark.parametrize("G,M,N,K", [(3, 1500, 1024, 2048), (2, 1000, 3072, 2048)])
def test_batched_default_whole_wave_fit(G, M, N, K):
    from moe_gemm.ops import heuristics, launch_info, launch_kernel

    dev = torch.device("cuda")
    keys = launch_kernel.table_keys(dev, torch.bfloat16, torch.bfloat16)
    want = heuristics.choose_batched(GemmConfig(), G, M, N, K, launch_kernel.sm_count(dev),
                                    **keys)
    run_batched(f"batched/wave-fit/{G}x{M}x{N}x{K}", G, M, N, K)
    got = launch_info.last_launch().choice
    assert (got.schedule, got.tile_m, got.tile_n, got.cluster_m, got.cluster_n) == (
        want.schedule, want.tile_m, want.tile_n, want.cluster_m, want.cluster_n)
