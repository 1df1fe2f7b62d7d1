"""Problems that end on both sides of the 64-row line inside a 128-row tile (where each math
warpgroup's m64 slice starts), in every form, with and without clusters; the rows past the
last expert stay untouched."""

from __future__ import annotations

import pytest
import torch

from moe_gemm import GemmConfig

from .helpers import EDGE_ROWS, run_batched, run_general, run_varlen

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cluster", [(1, 1), (2, 1), (1, 2)], ids=["1x1", "2x1", "1x2"])
@pytest.mark.parametrize("k", [72, 4160])
def test_edge_rows_varlen(cluster, k):
    cfg = GemmConfig(backend="cute", schedule="cooperative", cluster_m=cluster[0],
                     cluster_n=cluster[1])
    run_varlen(f"edge-rows/varlen/c{cluster[0]}x{cluster[1]}/K={k}", 16, 2800, 520, k, "edges",
               torch.bfloat16, "nk_view", cfg, "given", tail=33)


def edge_rows_general_sizes():
    return [(m, 8 * (17 + i), 64 * (1 + i % 5)) for i, m in enumerate(EDGE_ROWS)]


@pytest.mark.parametrize("tile_n", [128, 256])
def test_edge_rows_general(tile_n):
    cfg = GemmConfig(backend="cute", schedule="cooperative", tile_m=128, tile_n=tile_n)
    run_general(f"edge-rows/general/128x{tile_n}", edge_rows_general_sizes(), torch.bfloat16,
                "col", cfg)


@pytest.mark.parametrize("m", [1, 64, 65, 193])
def test_edge_rows_batched(m):
    cfg = GemmConfig(backend="cute", schedule="cooperative", cluster_m=2, cluster_n=1)
    run_batched(f"edge-rows/batched/M={m}/c2x1", 5, m, 264, 136, config=cfg, out_mode="given")
    run_batched(f"edge-rows/batched/M={m}", 5, m, 264, 136,
                config=GemmConfig(backend="cute", schedule="cooperative"), out_mode="view")
