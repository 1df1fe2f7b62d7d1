"""Packed pairs (GroupedGemmSm90 packed_pairs, MOE_GEMM_PACKED_PAIRS=1): the two CTAs of a 2x1
cluster take two consecutive tiles of the tile order, across experts, B multicast where the
pair shares an expert and a column and loaded by each CTA alone where not. Experts with odd
and even m-tile counts, empty experts, one-row experts, the zero tail (a fresh out) and rows
past offs[-1] left alone (a given out): the result equals the cluster-tile kernel's bit for
bit and the fp32 reference within bf16 accuracy, and the kernel stores each tile where
moe_gemm.ops.schedule.packed_pair_tiles says."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.choice_switches import PACKED_PAIRS_ENV
from moe_gemm.ops.launch_info import last_launch

from .gpu_report import record
from .helpers import check, switch_case, varlen_low

pytestmark = pytest.mark.gpu

CONFIGS = [("cooperative", (128, 256)), ("pingpong", (64, 256)), ("pingpong", (128, 128)),
           ("cooperative", (128, 192))]
IDS = [f"{s[:4]}{t[0]}x{t[1]}" for s, t in CONFIGS]


def _counts(tile_m: int) -> list[int]:
    """Experts of 1, 2 and 3 m-tiles and partial tails, empty ones between, one row alone."""
    t = tile_m
    return [3 * t - 5, 0, t + 1, 1, 2 * t, 0, 0, t - 1, 3 * t, 5, 2 * t + 7, t]


@pytest.mark.parametrize("schedule,tile", CONFIGS, ids=IDS)
@pytest.mark.parametrize("K", [64, 1000])
@pytest.mark.parametrize("given_out", [False, True])
def test_packed_pairs_equal_cluster_tiles(monkeypatch, schedule, tile, K, given_out):
    counts = _counts(tile[0])
    tail = 37
    x, w, offs, T, cfg = switch_case(counts, K, 31 + K, tail, schedule, tile, (2, 1))
    E, N = len(counts), w.shape[2]
    outs = {}
    for packed in ("0", "1"):
        monkeypatch.setenv(PACKED_PAIRS_ENV, packed)
        if given_out:
            out = torch.full((T, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            out[T - tail:] = 7.0
            y = moe_gemm.grouped_mm(x, w, offs, out=out, config=cfg)
        else:
            y = moe_gemm.grouped_mm(x, w, offs, config=cfg)
        assert last_launch().choice.packed_pairs == (packed == "1")
        outs[packed] = y
    torch.cuda.synchronize()
    assert torch.equal(outs["0"], outs["1"]), "packed pairs changed the result"
    y = outs["1"]
    rows = T - tail
    if given_out:
        assert bool((y[rows:] == 7.0).all()), "rows past offs[-1] were written"
    else:
        assert bool((y[rows:] == 0).all()), "rows past offs[-1] are not zero"
    ref = moe_gemm.ops.reference.grouped_mm_ref(x[:rows], w, offs)
    low = varlen_low(x, w, counts)
    check(f"packed-pairs/{schedule}/{tile[0]}x{tile[1]}/K={K}/out={given_out}", y[:rows], ref,
          low, E=E, T=T, N=N, K=K)


@pytest.mark.parametrize("schedule,tile", CONFIGS[:2], ids=IDS[:2])
def test_packed_pairs_store_where_the_schedule_says(monkeypatch, schedule, tile):
    from moe_gemm.ops.launch_info import trace_assignment
    from moe_gemm.ops.mm_launch import grouped_mm_cute
    from moe_gemm.ops.validation import check_grouped_mm

    monkeypatch.setenv(PACKED_PAIRS_ENV, "1")
    counts = _counts(tile[0]) * 3
    x, w, offs, T, cfg = switch_case(counts, 128, 3, 50, schedule, tile, (2, 1), N=1000)
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), cfg, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    assert ch.packed_pairs
    sizes = [(r, w.shape[2]) for r in counts + [T - sum(counts)]]  # the zero tail is problem E
    want = sched.packed_pair_tiles(sizes, len(counts), ch.tile_m, ch.tile_n, info.num_ctas,
                                   ch.swizzle)
    ok = trace_assignment(info) == want
    record(f"packed-pairs/trace/{schedule}/{tile[0]}x{tile[1]}", ok, choice=str(ch))
    assert ok, "kernel tile visits differ from moe_gemm.ops.schedule.packed_pair_tiles"


@pytest.mark.parametrize("schedule,tile", CONFIGS[:2], ids=IDS[:2])
def test_packed_pairs_with_n_major_weights(monkeypatch, schedule, tile):
    """Weights stored (E, K, N), N contiguous (the B-alone atom loads the other major)."""
    counts = _counts(tile[0])
    K, tail = 320, 9
    x, w_k, offs, T, cfg = switch_case(counts, K, 17, tail, schedule, tile, (2, 1))
    w = w_k.contiguous()  # (E, K, N) with N contiguous: the same values
    assert w.stride(2) == 1
    outs = {}
    for packed in ("0", "1"):
        monkeypatch.setenv(PACKED_PAIRS_ENV, packed)
        outs[packed] = moe_gemm.grouped_mm(x, w, offs, config=cfg)
        assert last_launch().choice.packed_pairs == (packed == "1")
    torch.cuda.synchronize()
    assert torch.equal(outs["0"], outs["1"]), "packed pairs changed the result"
    rows = T - tail
    assert bool((outs["1"][rows:] == 0).all()), "rows past offs[-1] are not zero"
    ref = moe_gemm.ops.reference.grouped_mm_ref(x[:rows], w, offs)
    check(f"packed-pairs/n-major/{schedule}/{tile[0]}x{tile[1]}", outs["1"][:rows], ref,
          varlen_low(x, w, counts), E=len(counts), T=T, N=w.shape[2], K=K)
