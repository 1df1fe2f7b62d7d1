"""Trimmed A loads (kernels/sm90/trimmed_a.py): an expert's last tile loads only its own rows
of x, as 64-, 32- and 16-row boxes. Every box combination a tile can take (tails of 1 to
tile_m - 1 rows, every residue mod 16), experts that end exactly on a tile, empty experts,
a cluster rank past its expert's end (no boxes) and rows past offs[-1]: the result equals the
whole-box kernel's bit for bit and the fp32 reference within bf16 accuracy."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm.ops.heuristics import TRIM_A_ENV
from moe_gemm.ops.launch_info import last_launch

from .helpers import check, switch_case, varlen_low

pytestmark = pytest.mark.gpu

# (schedule, tile, cluster): 128-row tiles (64 + 32 + 16 boxes), 64-row tiles (32 + 16),
# 256-row tiles (three 64s + 32 + 16), the 2x1 cluster (a rank past the expert loads no A),
# the 1x2 cluster (the first CTA multicasts a trimmed tile's boxes to both).
CONFIGS = [("cooperative", (128, 256), (1, 1)), ("pingpong", (64, 256), (2, 1)),
           ("cooperative", (256, 128), (1, 1)), ("pingpong", (128, 192), (1, 1)),
           ("cooperative", (128, 128), (2, 1)), ("pingpong", (128, 128), (1, 2)),
           ("cooperative", (128, 192), (1, 2))]


def trim_counts(tile_m: int) -> list[int]:
    """Expert row counts whose last tiles cover every tail a tile_m tile can have."""
    tails = list(range(1, tile_m, 7)) + [15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, tile_m - 1]
    counts = []
    for i, t in enumerate(sorted(set(t for t in tails if t < tile_m))):
        counts.append(t + (i % 3) * tile_m)  # a tail alone, after one or after two whole tiles
        if i % 5 == 0:
            counts.append(0)  # an empty expert between them
    return counts + [tile_m, 2 * tile_m]  # experts that end exactly on a tile


@pytest.mark.parametrize("schedule,tile,cluster", CONFIGS,
                         ids=[f"{s[:4]}{t[0]}x{t[1]}c{c[0]}x{c[1]}" for s, t, c in CONFIGS])
@pytest.mark.parametrize("K", [64, 1000])
def test_trimmed_equals_whole_boxes(monkeypatch, schedule, tile, cluster, K):
    counts = trim_counts(tile[0])
    tail = 37
    x, w, offs, T, cfg = switch_case(counts, K, 17 + K, tail, schedule, tile, cluster)
    E, N = len(counts), w.shape[2]
    outs = {}
    for value in ("0", "1"):
        monkeypatch.setenv(TRIM_A_ENV, value)
        out = torch.full((T, N), 7.0, dtype=torch.bfloat16, device="cuda")
        moe_gemm.grouped_mm(x, w, offs, out=out, config=cfg)
        assert last_launch().choice.trim_a == (value == "1")
        outs[value] = out
    torch.cuda.synchronize()
    assert torch.equal(outs["0"], outs["1"]), "trimmed A loads changed the result"
    y = outs["1"]
    assert bool((y[T - tail:] == 7.0).all()), "rows past offs[-1] were written"
    rows = T - tail
    ref = moe_gemm.ops.reference.grouped_mm_ref(x[:rows], w, offs)
    low = varlen_low(x, w, counts)
    check(f"trimmed-a/{schedule}/{tile[0]}x{tile[1]}/K={K}", y[:rows], ref, low, E=E, T=T, N=N,
          K=K)
