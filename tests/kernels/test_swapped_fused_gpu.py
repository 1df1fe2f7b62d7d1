"""Swapped tiles with the fused MoE options (kernels/sm90/swapped_fused.py) on the GPU, against
the fp32 loop reference (test_fused_moe_gpu.py's cases and 2x rule): every gate over concat
weights, with and without a bias and row weights; the down GEMM's row weights and bias in
both weight majors; experts from empty to several 256-row tiles, rows crossing every 16-row
line, rows past offs[-1] (zeros, or untouched in a given out), K off the 64-deep stage, I off
the 64-column output tile; fp16; routed rows gathered by the plan (index_select). Then a CUDA
graph replayed with new offsets, and the default's window for each GEMM (MOE_GEMM_SWAP_AB=0
turns it off). A few cases pin the 1x2 cluster (the rows of x multicast to two weight-column
tiles), with an odd column-tile count (the pair's second tile past the edge stores nothing).

    python3 scripts/gpu_session.py --paths tests/kernels/test_swapped_fused_gpu.py --out $OUT
"""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref
from moe_gemm.ops.launch_info import last_launch
from moe_gemm.ops.swap_rules import SWAP_AB_ENV

from .gpu_report import record
from .helpers import check
from .test_fused_moe_gpu import case, run_case

pytestmark = pytest.mark.gpu

SWAP = GemmConfig(backend="cute", swap_ab=True)
PAIR = GemmConfig(backend="cute", swap_ab=True, cluster_m=1, cluster_n=2)


def swapped(name, config=SWAP, **kw):
    return case(f"swapped-fused/{name}", config=config, kernel_gather=False, **kw)


CASES = [
    *(swapped(f"gate/{g}", gate=g, bias=bias, scale=scale, K=264, N=400)
      for g in ("silu", "gelu", "gelu_tanh", "clamped_swiglu")
      for bias, scale in ((False, False), (True, True))),
    swapped("gate/silu/long-k", gate="silu", K=2056, N=256, S=1500, E=4, empty=(2,)),
    swapped("gate/silu/several-tiles", gate="silu", K=128, N=528, T=900, S=2100, E=3,
            empty=(), tail=17),
    swapped("gate/silu/fp16-ours", gate="silu", bias=True, dtype=torch.float16,
            out_mode="ours"),
    swapped("down/scale", scale=True, gather=False, N=400, K=200),
    swapped("down/bias-scale/n", bias=True, scale=True, gather=False, w_major="n", N=264,
            K=320),
    swapped("down/bias-scale/k", bias=True, scale=True, gather=False, w_major="k", N=1000,
            K=136, S=2100, E=4, empty=(0,), out_mode="ours"),
    swapped("down/one-row-experts", scale=True, gather=False, S=40, E=37, empty=(), tail=3,
            N=192, K=64),
    # The 1x2 pair: 2I = 400 and N = 264 and 1000 are 4, 3 and 8 weight-column tiles.
    swapped("1x2/gate/silu", config=PAIR, gate="silu", bias=True, scale=True, K=264, N=400),
    swapped("1x2/gate/clamped_swiglu/long-k", config=PAIR, gate="clamped_swiglu", K=2056,
            N=256, S=1500, E=4, empty=(2,)),
    swapped("1x2/down/bias-scale/n", config=PAIR, bias=True, scale=True, gather=False,
            w_major="n", N=264, K=320),
    swapped("1x2/down/scale/k", config=PAIR, scale=True, gather=False, w_major="k", N=1000,
            K=136, S=2100, E=4, empty=(0,), out_mode="ours"),
]


@pytest.mark.parametrize("c", CASES, ids=[c["name"] for c in CASES])
def test_swapped_fused_matches_the_reference(c):
    run_case(c)
    info = last_launch()
    ok = info is not None and info.choice.swap_ab and (
        info.choice.cluster_n == (c["config"].cluster_n or 1))
    record(f"{c['name']}/swapped", ok)
    assert ok, "the launch did not run swapped tiles in the pinned cluster"


def _layer_operands(counts, I, H, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, S = len(counts), sum(counts)
    x = (torch.randn(S, H, generator=g, device="cuda") * 0.5).bfloat16()
    w1 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I ** 0.5).bfloat16()
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    weight = torch.rand(S, generator=g, device="cuda")
    return x, w1.transpose(1, 2), w2.transpose(1, 2), offs, weight


def _both(x, w1, w2, offs, weight, config=None):
    a = moe_gemm.fused_grouped_mm(x, w1, offs, gate="silu", config=config)
    gate_up = last_launch().choice.swap_ab
    y = moe_gemm.fused_grouped_mm(a, w2, offs, row_weight=weight, config=config)
    return a, y, gate_up, last_launch().choice.swap_ab


def _check_ref(name, got, x, w, offs, *outs, **options):
    """`got` (and each of `outs`) against fused_grouped_mm_ref of (x, w, offs, options) in
    fp32, with its bf16-rounded twin for the tolerance (helpers.check)."""
    ref = fused_grouped_mm_ref(x, w, offs, dtype=torch.float32, **options)
    low = fused_grouped_mm_ref(x, w, offs, dtype=torch.bfloat16, **options)
    check(name, got, ref, low)
    for extra_name, extra in outs:
        check(extra_name, extra, ref, low)


def test_cuda_graph_replays_with_new_offsets():
    counts = [300, 0, 257, 199]
    x, w1, w2, offs, weight = _layer_operands(counts, 192, 256, 5)
    _both(x, w1, w2, offs, weight, SWAP)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, y, _, _ = _both(x, w1, w2, offs, weight, SWAP)
    for new in ([300, 0, 257, 199], [1, 500, 0, 255], [16, 17, 600, 0]):
        offs.copy_(torch.tensor(new).cumsum(0).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        rows = sum(new)
        zero = bool((a[rows:] == 0).all()) and bool((y[rows:] == 0).all())
        record(f"swapped-fused/graph/{new}/tail", zero)
        assert zero, "rows past offs[-1] are not 0 after a replay"
        _check_ref(f"swapped-fused/graph/{new}/gate-up", a[:rows], x[:rows], w1, offs,
                   gate="silu")
        _check_ref(f"swapped-fused/graph/{new}/down", y[:rows], a[:rows], w2, offs,
                   row_weight=weight[:rows])


def _default_and_off(monkeypatch, x, w1, w2, offs, weight):
    """_both by default, then with MOE_GEMM_SWAP_AB=0, synchronized."""
    monkeypatch.delenv(SWAP_AB_ENV, raising=False)
    default = _both(x, w1, w2, offs, weight)
    monkeypatch.setenv(SWAP_AB_ENV, "0")
    off = _both(x, w1, w2, offs, weight)
    torch.cuda.synchronize()
    return default, off


def test_the_window_takes_it_by_default(monkeypatch):
    """256 rows on each of 8 experts of DeepSeek-V3's depth (K 7168 cut to 2048): the gated
    gate-up GEMM swapped by default (the down GEMM not on this short K: fused_launch.swappable),
    neither with MOE_GEMM_SWAP_AB=0, the same numbers either way."""
    counts = [256] * 8
    x, w1, w2, offs, weight = _layer_operands(counts, 2048, 2048, 6)
    (a, y, swap_a, swap_y), (a0, y0, off_a, off_y) = _default_and_off(
        monkeypatch, x, w1, w2, offs, weight)
    record("swapped-fused/window-default", swap_a and not (swap_y or off_a or off_y))
    assert swap_a and not (swap_y or off_a or off_y)
    _check_ref("swapped-fused/window/gate-up", a, x, w1, offs,
               ("swapped-fused/window-off/gate-up", a0), gate="silu")
    _check_ref("swapped-fused/window/down", y, a, w2, offs, row_weight=weight)
    _check_ref("swapped-fused/window-off/down", y0, a0, w2, offs, row_weight=weight)


def test_the_down_gemm_takes_them_by_default_on_long_k(monkeypatch):
    """Experts of 180-256 rows (one swapped tile each), the down GEMM's K 4096: both GEMMs
    swapped by default (fused_launch.swappable), neither with MOE_GEMM_SWAP_AB=0, the same
    numbers either way."""
    counts = [256, 200, 240, 180, 256, 230, 210, 220]
    x, w1, w2, offs, weight = _layer_operands(counts, 4096, 2304, 7)
    (a, y, swap_a, swap_y), (_, y0, off_a, off_y) = _default_and_off(
        monkeypatch, x, w1, w2, offs, weight)
    record("swapped-fused/long-k-down-default", swap_a and swap_y and not (off_a or off_y))
    assert swap_a and swap_y and not (off_a or off_y)
    _check_ref("swapped-fused/long-k/down", y, a, w2, offs,
               ("swapped-fused/long-k-off/down", y0), row_weight=weight)


def test_a_swapped_entry_the_fused_down_gemm_cannot_run_gives_way_to_its_shape_samples(
        monkeypatch, tmp_path):
    """A tuned entry naming the swapped kernel for a down GEMM of short K (2048: no swapped
    tiles for the fused kernels, fused_launch.swappable): grouped_mm runs the entry's swapped
    kernel, the fused down GEMM the fastest unswapped config the entry's search timed on that
    shape (tuned.unswapped_pick; here ping-pong 128x192 in a 1x2 cluster), not the bare
    rules, and both match the reference."""
    import json

    from moe_gemm.capability import device_name
    from moe_gemm.ops import heuristics, tuned

    counts = [256, 250, 262, 240, 256, 270, 244, 256]
    E, S, I, H = len(counts), sum(counts), 2048, 2304
    x, w1, w2, offs, weight = _layer_operands(counts, I, H, 8)
    dev = device_name(torch.device("cuda"))
    swap = {"schedule": "cooperative", "tile_m": 256, "tile_n": 128, "raster_panel": 16,
            "visitor": "device", "swap_ab": True}
    runner_up = {"schedule": "pingpong", "tile_m": 128, "tile_n": 192, "cluster_m": 1,
                 "cluster_n": 2, "raster_panel": 8, "visitor": "device"}
    slow = {"schedule": "cooperative", "tile_m": 128, "tile_n": 256, "raster_panel": 8,
            "visitor": "device"}
    shape = {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E, "N": H,
             "K": I}
    doc = {"format": tuned.FORMAT, "device": dev, "sm_count": torch.cuda.get_device_properties(
               0).multi_processor_count,
           "entries": [{**shape, "bucket": tuned.rows_bucket(S / E), "config": swap,
                        "us": 90.0}],
           "samples": [{**shape, "rows": S, "config": c, "us": us}
                       for c, us in ((swap, 90.0), (runner_up, 100.0), (slow, 130.0))]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(doc))
    monkeypatch.delenv(SWAP_AB_ENV, raising=False)
    monkeypatch.delenv(tuned.TABLES_ENV)  # (the tests' default turns the tables off)
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(path))
    tuned.clear_caches()
    heuristics.clear_caches()
    try:
        a = moe_gemm.fused_grouped_mm(x, w1, offs, gate="silu")
        plain = moe_gemm.grouped_mm(a, w2, offs)
        plain_choice = last_launch().choice
        y = moe_gemm.fused_grouped_mm(a, w2, offs, row_weight=weight)
        fused_choice = last_launch().choice
        torch.cuda.synchronize()
    finally:
        monkeypatch.delenv(tuned.USER_TABLE_ENV)
        tuned.clear_caches()
        heuristics.clear_caches()
    picked = (not fused_choice.swap_ab and fused_choice.schedule == "pingpong"
              and (fused_choice.tile_m, fused_choice.tile_n, fused_choice.cluster_n)
              == (128, 192, 2))
    record("swapped-fused/entry-runner-up", plain_choice.swap_ab and picked)
    assert plain_choice.swap_ab, "grouped_mm did not run the entry's swapped kernel"
    assert picked, f"the fused down GEMM took {fused_choice}, not the shape's runner-up"
    _check_ref("swapped-fused/entry-runner-up/down", y, a, w2, offs, row_weight=weight)
    _check_ref("swapped-fused/entry-runner-up/grouped_mm", plain, a, w2, offs)
