"""GPU tests of the varlen (MoE) form: grouped_mm(x (T, K), w (E, K, N), offs), with empty
experts, rows past offs[-1] (left untouched in a given `out`, zero in ours), both weight
layouts and the default tile choices."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig

from .gpu_report import record
from .helpers import DTYPES, SCHEDULES, VISITORS, check, run_varlen

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("visitor", VISITORS)
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("out_mode", ["given", "alloc"])
def test_varlen_matrix(schedule, visitor, w_layout, dtype, out_mode):
    cfg = GemmConfig(backend="cute", schedule=schedule, visitor=visitor)
    run_varlen(f"varlen/holes/{schedule}/{visitor}/{w_layout}/{dtype}/{out_mode}", 10, 1000,
               136, 264, "holes", DTYPES[dtype], w_layout, cfg, out_mode, tail=99)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_varlen_decode_shape(schedule):
    cfg = GemmConfig(backend="cute", schedule=schedule)
    run_varlen(f"varlen/decode/{schedule}", 256, 1024, 512, 7168, "zipf", torch.bfloat16,
               "nk_view", cfg, "alloc")


def test_varlen_default_prefill_like():
    run_varlen("varlen/prefill-like/default", 8, 8192, 1024, 2048, "zipf", torch.bfloat16,
               "nk_view", None, "given", tail=17)


def test_varlen_default_short_k():
    # K <= 1024 with >= 128 rows per expert: the default is ping-pong 128x192.
    from moe_gemm.ops.launch_info import last_launch

    run_varlen("varlen/short-k/default", 24, 6000, 392, 768, "edges", torch.bfloat16,
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
    run_varlen(f"varlen/pingpong-tile={tile}/{w_layout}", 14, 2600, 520, 1000, "edges",
               torch.float16, w_layout, cfg, "alloc")


def test_varlen_single_row_and_all_empty():
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, 64, 32, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(backend="cute")
    y = moe_gemm.grouped_mm(x, w, torch.tensor([0, 1, 1], dtype=torch.int32, device="cuda"),
                            config=cfg)
    ref = x.float() @ w[1].float()
    check("varlen/single-row", y, ref, (x @ w[1]))
    y0 = moe_gemm.grouped_mm(x, w, torch.zeros(3, dtype=torch.int32, device="cuda"), config=cfg)
    ok = bool((y0 == 0).all())
    record("varlen/all-empty-zero", ok)
    assert ok


# Launches the whole-wave fit moves (ops/grid_fit.py): one expert, and a few experts whose
# routings all but fill whole waves in the fitted tile. The default must run the fitted
# choice (as choose_varlen gives it for this GPU) and give the right result.
@pytest.mark.parametrize("E,T,N,K", [(1, 3000, 1000, 1536), (2, 1800, 1536, 2560),
                                     (5, 2800, 1536, 2560), (3, 1000, 3072, 2048)])
def test_varlen_default_whole_wave_fit(E, T, N, K):
    from moe_gemm.ops import heuristics, launch_info, launch_kernel

    dev = torch.device("cuda")
    keys = launch_kernel.table_keys(dev, torch.bfloat16, torch.bfloat16)
    want = heuristics.choose_varlen(GemmConfig(), T, E, N, K, launch_kernel.sm_count(dev),
                                    **keys)
    run_varlen(f"varlen/wave-fit/{E}x{T}x{N}x{K}", E, T, N, K, "zipf", torch.bfloat16,
               "nk_view", None, "alloc")
    got = launch_info.last_launch().choice
    assert (got.schedule, got.tile_m, got.tile_n, got.cluster_m, got.cluster_n) == (
        want.schedule, want.tile_m, want.tile_n, want.cluster_m, want.cluster_n)
