"""Swapped tiles (kernels/sm90/swapped.py) on the GPU: every variant N = 16 ... 256 and the
even row split, against the fp32 reference, in both weight majors.

Expert sizes cross every 16-row line and every tile count (1 to 272 rows in one launch, then
up to several 256-row tiles), with empty experts, rows past offs[-1] (zeros, or untouched in
a given out), K not a multiple of the 64-deep stage, N not a multiple of the 128-column
tile; fp16; K = 0 is no launch. The kernel follows moe_gemm.ops.schedule's tile order (trace),
is captured in a CUDA graph and replayed with new offsets, and runs by default where the
window says (MOE_GEMM_SWAP_AB=0 turns it off). The 1x2 cluster pin (two weight-column tiles
sharing the rows of x by multicast) runs the same cases, N of an odd column-tile count
included (the pair's tile past the edge computes and stores nothing)."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops.heuristics import SWAP_AB_ENV
from moe_gemm.ops.launch_info import last_launch

from .gpu_report import record
from .helpers import check, rand, varlen_low
from .test_trace_gpu import expected, expected_cluster

pytestmark = pytest.mark.gpu

SWAP = GemmConfig(backend="cute", swap_ab=True)
PAIR = GemmConfig(backend="cute", swap_ab=True, cluster_m=1, cluster_n=2)
CONFIGS = pytest.mark.parametrize("config", [SWAP, PAIR], ids=["1x1", "1x2"])


def _operands(counts, N, K, layout, dtype, tail, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(counts) + tail
    x = rand((T, K), dtype, g)
    E = len(counts)
    w = rand((E, N, K), dtype, g).transpose(1, 2) if layout == "ENK" else rand((E, K, N), dtype, g)
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    return x, w, offs, T


def _run(name, counts, N, K, layout, dtype=torch.bfloat16, tail=0, given=False, seed=0,
         config=SWAP):
    x, w, offs, T = _operands(counts, N, K, layout, dtype, tail, seed)
    if config is PAIR:
        name += "/1x2"
    if given:
        out = torch.full((T, N), float("nan"), dtype=dtype, device="cuda")
        out[T - tail:] = 7.0
        y = moe_gemm.grouped_mm(x, w, offs, out=out, config=config)
        assert y is out
    else:
        y = moe_gemm.grouped_mm(x, w, offs, config=config)
    torch.cuda.synchronize()
    choice = last_launch().choice
    assert choice.swap_ab and choice.cluster_n == (config.cluster_n or 1)
    rows = T - tail
    past = y[rows:]
    untouched = bool((past == (7.0 if given else 0.0)).all())
    record(f"{name}/rows-past-offs", untouched)
    assert untouched, "rows past offs[-1] were written" if given else "the zero tail is not 0"
    ref = moe_gemm.ops.reference.grouped_mm_ref(x[:rows], w, offs)
    check(name, y[:rows], ref, varlen_low(x, w, counts), E=len(counts), T=T, N=N, K=K)


MIXED = [0, 1, 15, 16, 17, 31, 137, 255, 256, 257, 272, 300, 511, 512, 513, 567, 1000, 40]


@CONFIGS
@pytest.mark.parametrize("layout", ["ENK", "EKN"])
@pytest.mark.parametrize("N,K,tail,given", [(200, 320, 37, False), (384, 72, 0, True),
                                            (1024, 1000, 5, True)])
def test_swapped_matches_the_reference(layout, N, K, tail, given, config):
    # (N = 200 and 384: two and three 128-column tiles, a 1x2 pair's second past the edge)
    _run(f"swapped/{layout}/N={N}/K={K}", MIXED, N, K, layout, tail=tail, given=given,
         seed=N + K, config=config)


@CONFIGS
def test_every_row_count_to_two_tiles_in_one_launch(config):
    _run("swapped/rows-1-to-272", list(range(1, 273)), 136, 64, "ENK", tail=3, given=True,
         config=config)
    _run("swapped/rows-500-to-800", list(range(500, 800, 7)), 128, 192, "EKN", tail=9,
         config=config)


@CONFIGS
def test_fp16_and_empty_experts(config):
    _run("swapped/fp16", MIXED, 256, 128, "ENK", dtype=torch.float16, tail=11, given=True,
         config=config)
    _run("swapped/all-empty", [0, 0, 0], 128, 64, "ENK", tail=9, config=config)


@CONFIGS
def test_trace_follows_the_schedule(config):
    from moe_gemm.ops.launch_info import trace_assignment
    from moe_gemm.ops.mm_launch import grouped_mm_cute
    from moe_gemm.ops.validation import check_grouped_mm

    counts = MIXED * 3
    N, K = 264, 128  # (three column tiles: a 1x2 pair's second tile past the edge)
    x, w, offs, T = _operands(counts, N, K, "EKN", torch.bfloat16, 50, 1)
    grouped_mm_cute(check_grouped_mm(x, w, offs, None, None), config, trace=True)
    torch.cuda.synchronize()
    info = last_launch()
    ch = info.choice
    assert ch.swap_ab and (ch.tile_m, ch.tile_n) == (256, 128)
    assert (ch.cluster_m, ch.cluster_n) == (1, config.cluster_n or 1)
    rows = counts + [T - sum(counts)]  # the zero tail is problem E
    if ch.cluster_n > 1:
        want = expected_cluster([(r, N) for r in rows], ch.tile_m, ch.tile_n, info.num_ctas,
                                ch.swizzle, 1, ch.cluster_n)
    else:
        tile_counts = [-(-r // ch.tile_m) * -(-N // ch.tile_n) for r in rows]
        want = expected(tile_counts, [(r, N) for r in rows], ch.tile_m, ch.tile_n,
                        info.num_ctas, ch.swizzle)
    ok = trace_assignment(info) == want
    record(f"trace/varlen/swapped/{ch.cluster_m}x{ch.cluster_n}", ok)
    assert ok, "kernel tile visits differ from moe_gemm.schedule"


@CONFIGS
def test_cuda_graph_replays_with_new_offsets(config):
    x, w, offs, T = _operands([100, 200, 1, 699], 384, 256, "EKN", torch.bfloat16, 24, 3)
    moe_gemm.grouped_mm(x, w, offs, config=config)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.grouped_mm(x, w, offs, config=config)
    for counts in ([100, 200, 1, 699], [0, 513, 1, 486], [250, 0, 550, 200]):
        offs.copy_(torch.tensor(counts).cumsum(0).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        rows = sum(counts)
        ok = bool((y[rows:] == 0).all())
        assert ok, "rows past offs[-1] are not 0 after a replay"
        ref = moe_gemm.ops.reference.grouped_mm_ref(x[:rows], w, offs)
        check(f"swapped/graph/{config.cluster_n or 1}/{counts}", y[:rows], ref,
              varlen_low(x, w, counts))


def test_the_window_takes_it_by_default(monkeypatch):
    """256 rows on each of 16 experts (Llama-4-Scout's up-projection at 4096 tokens, N cut
    to 2048: 256 swapped tiles, two waves): swapped by default, not with MOE_GEMM_SWAP_AB=0,
    the same numbers either way."""
    counts = [256] * 16
    x, w, offs, _ = _operands(counts, 2048, 2048, "EKN", torch.bfloat16, 0, 4)
    monkeypatch.delenv(SWAP_AB_ENV, raising=False)
    a = moe_gemm.grouped_mm(x, w, offs)
    assert last_launch().choice.swap_ab
    monkeypatch.setenv(SWAP_AB_ENV, "0")
    b = moe_gemm.grouped_mm(x, w, offs)
    assert not last_launch().choice.swap_ab
    torch.cuda.synchronize()
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = varlen_low(x, w, counts)
    check("swapped/window-default", a, ref, low)
    check("swapped/window-off", b, ref, low)
