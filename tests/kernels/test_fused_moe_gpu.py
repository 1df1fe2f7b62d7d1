"""GPU tests of the fused MoE kernel (fused_grouped_mm on the cute backend) against the fp32
loop reference, with NaN-poisoned outputs, empty experts, rows past offs[-1], single rows,
sizes off the tile, long K, every gate and gate layout, bias, row weights and gather-A, the
default tile choices and forced ones (schedules, 256-row tiles, clusters, the tail split, the
whole-tile epilogue).

The 2x rule (helpers.check): max error against the fp32 reference at most twice that of the
same computation done by torch in the inputs' precision (the unfused path's rounding: bf16
GEMM output, bf16 bias, activation and weight), plus 1e-3 of the result's scale.

    python3 scripts/gpu_session.py --paths tests/kernels/test_fused_moe_gpu.py --out $OUT
"""

from __future__ import annotations

import contextlib
import os
import zlib
from unittest import mock

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref

from .gpu_report import record
from .helpers import check

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
# A limit the test values reach (|h| ~ 1), so the clamps are exercised; gpt-oss's 7.0 runs in
# the layer tests.
CLAMP = dict(gate_alpha=1.702, gate_limit=1.0)


def case(name, *, T=300, S=777, E=10, K=264, N=400, gate=None, layout="concat", w_major="k",
         gather=True, bias=False, scale=False, empty=(1, 4, 7), tail=23, config=None,
         out_mode="given", dtype=BF16, out_dtype=None, x_scale=0.5, kernel_gather=None):
    """One launch's arguments as a dict (the GPU run and kernels/variants.py read it).
    kernel_gather (default: gather): run under MOE_GEMM_FUSED_GATHER_WIDE=1, where the kernel
    gathers x's rows itself at every batch size (in registers on tiles that fit, else in
    shared memory): the cases test the kernel's gather past the default's decode sizes; the
    default's own choice is tested by cases with kernel_gather=False."""
    return dict(name=name, T=T, S=S, E=E, K=K, N=N, gate=gate, layout=layout, w_major=w_major,
                gather=gather, bias=bias, scale=scale, empty=empty, tail=tail, config=config,
                out_mode=out_mode, dtype=dtype, out_dtype=out_dtype, x_scale=x_scale,
                kernel_gather=gather if kernel_gather is None else kernel_gather)


def case_env(c: dict):
    """The switches c runs under (kernels/variants.py compiles its keys under them too)."""
    from moe_gemm.ops.fused_launch import GATHER_WIDE_ENV

    if c["kernel_gather"]:
        return mock.patch.dict(os.environ, {GATHER_WIDE_ENV: "1"})
    return contextlib.nullcontext()


def routed_counts(c: dict, gen: torch.Generator) -> list[int]:
    """Rows per expert: random, the `empty` experts 0, S - tail rows in all."""
    E, live = c["E"], c["S"] - c["tail"]
    keep = [e for e in range(E) if e not in c["empty"]] or [0]
    picks = torch.randint(0, len(keep), (live,), generator=gen)
    counts = [0] * E
    for i, n in enumerate(torch.bincount(picks, minlength=len(keep)).tolist()):
        counts[keep[i]] = n
    return counts


def inputs(c: dict):
    gen = torch.Generator().manual_seed(zlib.crc32(c["name"].encode()))
    T, S, E, K, N, dtype = c["T"], c["S"], c["E"], c["K"], c["N"], c["dtype"]
    counts = routed_counts(c, gen)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).cuda()
    rows = T if c["gather"] else S
    x = (torch.randn(rows, K, generator=gen) * c["x_scale"]).to(dtype).cuda()
    w = torch.randn(E, K, N, generator=gen) * (0.5 / K ** 0.5) * 4
    if c["w_major"] == "k":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    w = w.to(dtype).cuda()
    kw = {}
    if c["gather"]:
        kw["row_index"] = torch.randint(0, T, (S,), generator=gen).cuda()
    if c["bias"]:
        kw["bias"] = (torch.randn(E, N, generator=gen) * 0.5).cuda()
    if c["scale"]:
        kw["row_weight"] = torch.rand(S, generator=gen).cuda()
    if c["gate"]:
        kw.update(gate=c["gate"], gate_layout=c["layout"])
        if c["gate"] in ("clamped_swiglu", "clamped_silu"):
            kw.update(CLAMP)
    return x, w, offs, kw


def run_case(c: dict):
    with case_env(c):
        _run_case(c)


def _run_case(c: dict):
    x, w, offs, kw = inputs(c)
    S, live = c["S"], c["S"] - c["tail"]
    n_out = c["N"] // 2 if c["gate"] else c["N"]
    odt = c["out_dtype"] or c["dtype"]
    cfg = c["config"] or GemmConfig(backend="cute")
    if c["out_mode"] == "given":
        out = torch.full((S, n_out), float("nan"), dtype=odt, device="cuda")
        y = moe_gemm.fused_grouped_mm(x, w, offs, out=out, config=cfg, out_dtype=c["out_dtype"],
                                      **kw)
        assert y is out
    else:
        y = moe_gemm.fused_grouped_mm(x, w, offs, config=cfg, out_dtype=c["out_dtype"], **kw)
    torch.cuda.synchronize()
    assert y.shape == (S, n_out) and y.dtype == odt
    ref = fused_grouped_mm_ref(x, w, offs, dtype=torch.float32, **kw)
    low = fused_grouped_mm_ref(x, w, offs, dtype=c["dtype"], **kw)
    from moe_gemm.ops.launch_info import last_launch

    info = last_launch()
    tile = None if info is None else (info.choice.schedule, info.choice.tile_m,
                                      info.choice.tile_n)
    if c["tail"]:
        tail = y[live:]
        ok = bool(torch.isnan(tail).all()) if c["out_mode"] == "given" else bool(
            (tail == 0).all())
        record(f"{c['name']}/tail", ok, tile=tile)
        assert ok, "rows past offs[-1] must stay untouched (given out) or be zero (ours)"
    check(c["name"], y[:live], ref[:live], low[:live], tile=tile)


GATE_CASES = [
    case(f"gate/{g}/{lay}/{m}", gate=g, layout=lay, w_major=m)
    for g in ("silu", "gelu", "gelu_tanh", "clamped_swiglu", "clamped_silu")
    for lay, m in (("concat", "k"), ("interleaved", "n"), ("alternating", "n"))
] + [
    case("gate/silu/interleaved/k", gate="silu", layout="interleaved", w_major="k"),
    case("gate/silu/alternating/k", gate="silu", layout="alternating", w_major="k"),
]

OPTION_CASES = [
    case("plain/gather", gather=True),
    case("plain/no-gather", gather=False, w_major="n"),
    case("down/bias+scale", gather=False, bias=True, scale=True, w_major="n", N=328),
    case("down/scale/alloc", gather=False, scale=True, out_mode="alloc"),
    case("down/scale/fp32-out", gather=False, scale=True, out_dtype=torch.float32),
    case("up/bias/concat", gate="silu", bias=True),
    case("up/bias/clamped/alternating", gate="clamped_swiglu", layout="alternating",
         w_major="n", bias=True),
    case("up/bias/gelu/interleaved", gate="gelu", layout="interleaved", w_major="n", bias=True),
    case("up/scale/clamped-silu/concat", gate="clamped_silu", scale=True),
    case("up/all-options/fp16", gate="silu", bias=True, scale=True, dtype=torch.float16),
    case("up/no-gather/alloc", gate="gelu_tanh", gather=False, out_mode="alloc"),
]

EDGE_CASES = [
    case("edge/one-row", T=1, S=1, E=3, tail=0, empty=(0, 2), gate="silu"),
    case("edge/one-row-down", T=1, S=1, E=3, tail=0, empty=(0, 2), gather=False, scale=True,
         bias=True),
    case("edge/all-empty", E=4, empty=(0, 1, 2, 3), tail=777, gate="silu", bias=True),
    case("edge/one-expert", E=1, empty=(), gate="silu", layout="alternating", w_major="n"),
    case("edge/off-tile", T=77, S=203, E=5, K=72, N=208, gate="silu", bias=True),
    case("edge/narrow", T=40, S=90, E=3, K=16, N=32, gate="gelu", layout="interleaved",
         w_major="n", scale=True),
    case("edge/long-k-gather", T=512, S=1000, E=6, K=7176, N=256, gate="silu"),
    case("edge/long-k-down", T=512, S=1500, E=6, K=4104, N=520, gather=False, scale=True,
         bias=True, w_major="n"),
    case("edge/many-experts", T=256, S=1000, E=128, K=512, N=384, gate="silu",
         empty=tuple(range(0, 128, 3))),
]

_P, _C = "pingpong", "cooperative"
FORCED_CASES = [
    case(f"forced/{s}-{m}x{n}{'-c' + str(cm) + 'x1' if cm > 1 else ''}{'-ts' if ts else ''}"
         f"{'-ew' if ew else ''}/{g or 'plain'}/{'gather' if ga else 'rows'}",
         T=700, S=1000 if ga else 2100, E=8, K=1032 if not ts else 4168, N=512, gate=g,
         gather=ga,
         scale=not g, bias=True, config=GemmConfig(
             backend="cute", schedule=s, tile_m=m, tile_n=n,
             cluster_m=cm if cm > 1 else None, cluster_n=1 if cm > 1 else None,
             tail_split=ts or None, whole_epilogue=ew or None, stages=3 if ew else None))
    for s, m, n, cm, ts, ew, g, ga in [
        (_P, 128, 192, 1, False, False, "silu", False),
        (_P, 64, 256, 1, False, False, "silu", True),
        (_P, 128, 128, 2, False, False, "gelu", True),
        (_P, 128, 160, 1, False, False, None, False),
        (_C, 128, 256, 1, False, False, "silu", True),
        (_C, 256, 192, 1, False, False, "silu", False),
        (_C, 256, 128, 2, False, False, None, False),
        (_C, 128, 256, 2, False, False, "clamped_swiglu", True),
        (_C, 128, 256, 1, True, False, "silu", True),
        (_C, 128, 256, 1, True, True, "silu", False),
        (_C, 128, 224, 1, False, False, None, False),
        (_P, 192, 128, 1, False, False, "silu", False),
        (_P, 192, 128, 2, False, False, None, False),
    ]
] + [
    # Five A/B stages, the epilogue staged in fewer buffers (constants.ab_stage_limit's want).
    case(f"forced/{s}-{m}x{n}-s5/{g or 'plain'}", T=700, S=2100, E=8, K=1032, N=512, gate=g,
         gather=False, scale=not g, bias=True, config=GemmConfig(
             backend="cute", schedule=s, tile_m=m, tile_n=n, stages=5))
    for s, m, n, g in [(_C, 128, 192, "silu"), (_P, 128, 208, None)]
]

# Gather-A by default from GATHER_MAX_ROWS routed rows, or where the in-kernel gather would cap
# the tile: the plan gathers (index_select) and the kernel reads routed rows
# (ops/fused_launch.fused_choice); a cluster along N forces it on a small shape, a
# Mixtral-like gate-up takes it by default, a tile the gather keeps takes it at 1200 rows, the
# default config at 777 rows, and narrow weights (Qwen3-30B-A3B-like) at 1500-2400 rows.
PLAN_GATHER_CASES = [
    case("plan-gather/cluster-n", T=200, S=600, E=6, K=256, N=512, gate="silu",
         kernel_gather=False, config=GemmConfig(backend="cute", schedule="cooperative",
                                                 tile_m=128, tile_n=256, cluster_m=1,
                                                 cluster_n=2)),
    case("plan-gather/large-batch", T=600, S=1200, E=8, K=520, N=2560, gate="silu",
         bias=True, kernel_gather=False, config=GemmConfig(
             backend="cute", schedule="pingpong", tile_m=64, tile_n=256, cluster_m=2,
             cluster_n=1)),
    case("plan-gather/default-large", T=1024, S=2048, E=8, K=1024, N=4096, gate="silu",
         empty=(3,), tail=64, kernel_gather=False),
    case("plan-gather/default-mid", gate="silu", bias=True, kernel_gather=False),
    case("plan-gather/default-mid-alternating", T=40, S=320, gate="clamped_swiglu",
         layout="alternating", w_major="n", bias=True, kernel_gather=False),
    case("plan-gather/narrow-default", T=800, S=2400, E=8, K=520, N=1024, gate="silu",
         empty=(2,), tail=40, kernel_gather=False),
    case("plan-gather/narrow-plain-row-weights", T=600, S=1500, E=6, K=264, N=512,
         scale=True, kernel_gather=False,
         config=GemmConfig(backend="cute", schedule="pingpong", tile_m=128, tile_n=192)),
]

# Decode-sized batches (below GATHER_MAX_ROWS routed rows): the kernel gathers by default,
# in registers, on the default config's tile.
DECODE_GATHER_CASES = [
    case("decode-gather/silu", T=3, S=24, E=16, K=520, N=512, gate="silu", tail=2,
         kernel_gather=False),
    case("decode-gather/clamped-alternating-bias", T=1, S=4, E=32, K=264, N=384,
         gate="clamped_swiglu", layout="alternating", w_major="n", bias=True, empty=(0,),
         tail=0, kernel_gather=False),
    case("decode-gather/plain-row-weights", T=4, S=31, E=8, K=1032, N=256, scale=True,
         empty=(5,), tail=1, kernel_gather=False),
]

ALL_CASES = (GATE_CASES + OPTION_CASES + EDGE_CASES + FORCED_CASES + PLAN_GATHER_CASES
             + DECODE_GATHER_CASES)

# Both sigmoids (the SFU's, the default, and the IEEE one under MOE_GEMM_FUSED_FAST_GATE=0):
# SiLU and the clamped SwiGLU on the default tile, the in-kernel gather and a cooperative 2x1
# tile; gate values far past the exp2's overflow (x 60 times larger: |h| ~ 100) check the
# sigmoid's limits.
SIGMOID_CASES = [
    case("sigmoid/silu", gate="silu", bias=True),
    case("sigmoid/clamped/alternating", gate="clamped_swiglu", layout="alternating",
         w_major="n", bias=True),
    case("sigmoid/silu/gather-pp64x256", T=600, S=1000, E=8, K=520, N=512, gate="silu",
         config=GemmConfig(backend="cute", schedule="pingpong", tile_m=64, tile_n=256)),
    case("sigmoid/silu/coop128x256-c2x1", T=700, S=2100, E=8, K=1032, N=512, gate="silu",
         gather=False, config=GemmConfig(backend="cute", schedule="cooperative", tile_m=128,
                                         tile_n=256, cluster_m=2, cluster_n=1)),
    case("sigmoid/silu/large-values", gate="silu", x_scale=30.0),
    # A bias on 192 accumulator registers keeps the IEEE sigmoid (fused_launch).
    case("sigmoid/clamped/alternating-pp128x192", T=500, S=1500, E=8, K=512, N=768,
         gate="clamped_swiglu", layout="alternating", w_major="n", bias=True,
         config=GemmConfig(backend="cute", schedule="pingpong", tile_m=128, tile_n=192)),
]


def _wide(name, s, m, n, cm=1, **kw):
    return case(f"wide-gather/{s}-{m}x{n}-c{cm}x1/{name}", kernel_gather=False,
                config=GemmConfig(backend="cute", schedule=s, tile_m=m, tile_n=n,
                                  cluster_m=cm, cluster_n=1), **kw)


# Gather-A on tiles past 128 rows or 128 accumulator registers (the rows' indices in shared
# memory), with MOE_GEMM_FUSED_GATHER_WIDE=1; without it the plan gathers (these batches are
# past fused_launch.GATHER_MAX_ROWS).
WIDE_GATHER_CASES = [
    _wide("silu", _P, 128, 192, 2, T=700, S=2100, E=8, K=1032, N=512, gate="silu", bias=True),
    _wide("silu", _C, 256, 192, 2, T=700, S=2100, E=8, K=1032, N=512, gate="silu"),
    _wide("clamped-alternating", _P, 192, 128, 1, T=500, S=1700, E=6, K=520, N=256,
          gate="clamped_swiglu", layout="alternating", w_major="n", bias=True),
    _wide("plain-scale", _P, 128, 160, 1, scale=True),
    _wide("off-tile", _C, 256, 128, 2, T=77, S=203, E=5, K=72, N=256, gate="silu"),
    _wide("long-k", _P, 128, 192, 1, T=512, S=1500, E=6, K=4168, N=384, gate="silu"),
    _wide("many-experts", _P, 128, 192, 2, T=256, S=2048, E=128, K=512, N=384, gate="silu",
          empty=tuple(range(0, 128, 3))),
    _wide("wider-weight", _P, 128, 192, 1, T=600, S=1300, E=6, K=264, N=2304, gate="silu"),
]


@pytest.mark.parametrize("c", GATE_CASES, ids=[c["name"] for c in GATE_CASES])
def test_gates_and_layouts(c):
    run_case(c)


@pytest.mark.parametrize("c", OPTION_CASES, ids=[c["name"] for c in OPTION_CASES])
def test_options(c):
    run_case(c)


@pytest.mark.parametrize("c", EDGE_CASES, ids=[c["name"] for c in EDGE_CASES])
def test_edges(c):
    run_case(c)


@pytest.mark.parametrize("c", FORCED_CASES, ids=[c["name"] for c in FORCED_CASES])
def test_forced_configs(c):
    if c["gather"]:  # (kernel_gather: on tiles the gather keeps)
        x, w, offs, kw = inputs(c)
        assert _gathers_in_kernel(c, x, w, offs, kw)
    run_case(c)


CLAMP_CASE = case("clamp", T=50, S=120, E=3, K=64, N=64, gate="silu", tail=0, empty=())
GRAPH_CASE = case("graph", T=256, S=512, E=8, K=256, N=256, gate="silu", scale=True, tail=0,
                  empty=(2,), out_mode="alloc")


def test_unchecked_indices_are_clamped_never_read_out_of_bounds():
    with case_env(CLAMP_CASE):
        _clamped_in_kernel(CLAMP_CASE)


def _clamped_in_kernel(c: dict) -> None:
    x, w, offs, kw = inputs(c)
    assert _gathers_in_kernel(c, x, w, offs, kw)
    bad = kw["row_index"].clone()
    bad[::7] = 50 + 1000  # past x's rows
    bad[3::11] = -5
    y = moe_gemm.fused_grouped_mm(x, w, offs, config=GemmConfig(backend="cute"),
                                  **{**kw, "row_index": bad})
    torch.cuda.synchronize()
    clamped = bad.clamp(0, 49)
    ref = fused_grouped_mm_ref(x, w, offs, dtype=torch.float32, **{**kw, "row_index": clamped})
    low = fused_grouped_mm_ref(x, w, offs, dtype=BF16, **{**kw, "row_index": clamped})
    check("clamp/indices", y, ref, low)


def test_indices_checked_on_request(monkeypatch):
    # MOE_GEMM_CHECK_OFFS=1 checks row_index values on the GPU too (as the docstring says),
    # not only offs: one past x's rows, or negative, is a ValueError before any launch.
    c = case("checked", T=50, S=120, E=3, K=64, N=64, gate="silu", tail=0, empty=())
    x, w, offs, kw = inputs(c)
    monkeypatch.setenv("MOE_GEMM_CHECK_OFFS", "1")
    for value in (50, -1):
        bad = kw["row_index"].clone()
        bad[17] = value
        with pytest.raises(ValueError, match=r"row_index values must be rows of x in \[0, 50\)"):
            moe_gemm.fused_grouped_mm(x, w, offs, config=GemmConfig(backend="cute"),
                                      **{**kw, "row_index": bad})
    y = moe_gemm.fused_grouped_mm(x, w, offs, config=GemmConfig(backend="cute"), **kw)
    torch.cuda.synchronize()
    ref = fused_grouped_mm_ref(x, w, offs, dtype=torch.float32, **kw)
    check("checked/indices", y, ref, fused_grouped_mm_ref(x, w, offs, dtype=BF16, **kw))


def _plan_choice(c: dict, x, w, offs, kw):
    """(checked arguments, the kernel choice, whether the kernel gathers) of c's launch."""
    from moe_gemm.capability import sm_count
    from moe_gemm.ops.fused_launch import fused_choice
    from moe_gemm.ops.fused_validation import check_fused_mm

    args = check_fused_mm(x, w, offs, **kw)
    with case_env(c):
        return (args, *fused_choice(args, c["config"] or GemmConfig(), sm_count(x.device),
                                    x.device))


def _gathers_in_kernel(c: dict, x, w, offs, kw) -> bool:
    return _plan_choice(c, x, w, offs, kw)[2]


@pytest.mark.parametrize("c", PLAN_GATHER_CASES, ids=[c["name"] for c in PLAN_GATHER_CASES])
def test_gather_by_the_plan_where_the_kernel_gather_caps_the_tile(c):
    x, w, offs, kw = inputs(c)
    assert not _gathers_in_kernel(c, x, w, offs, kw)
    run_case(c)


@pytest.mark.parametrize("c", DECODE_GATHER_CASES, ids=[c["name"] for c in DECODE_GATHER_CASES])
def test_decode_batches_gather_in_the_kernel_by_default(c, monkeypatch):
    from moe_gemm.ops.fused_launch import GATHER_MAX_ROWS, GATHER_WIDE_ENV

    monkeypatch.delenv(GATHER_WIDE_ENV, raising=False)
    x, w, offs, kw = inputs(c)
    assert c["S"] < GATHER_MAX_ROWS and _gathers_in_kernel(c, x, w, offs, kw)
    run_case(c)


def _check_clamped_indices(c: dict, name: str, in_kernel: bool) -> None:
    """c's launch with row indices past x's rows and negative: the rows of the clamped
    indices (where the kernel gathers itself when in_kernel, else the plan)."""
    x, w, offs, kw = inputs(c)
    T = x.shape[0]
    bad = kw["row_index"].clone()
    bad[::5] = T + 777
    bad[2::9] = -3
    kw = {**kw, "row_index": bad}
    assert _gathers_in_kernel(c, x, w, offs, kw) == in_kernel
    y = moe_gemm.fused_grouped_mm(x, w, offs, config=c["config"], **kw)
    torch.cuda.synchronize()
    live = c["S"] - c["tail"]
    clamped = {**kw, "row_index": bad.clamp(0, T - 1)}
    ref = fused_grouped_mm_ref(x, w, offs, dtype=torch.float32, **clamped)
    low = fused_grouped_mm_ref(x, w, offs, dtype=BF16, **clamped)
    check(name, y[:live], ref[:live], low[:live])


def test_plan_gather_clamps_unchecked_indices():
    _check_clamped_indices(PLAN_GATHER_CASES[0], "plan-gather/clamp", in_kernel=False)


def test_repeated_calls_reuse_the_plan_and_follow_new_values():
    c = case("repeat", gate="silu", bias=True, out_mode="alloc")
    x, w, offs, kw = inputs(c)
    cfg = GemmConfig(backend="cute")
    first = moe_gemm.fused_grouped_mm(x, w, offs, config=cfg, **kw)
    x2 = torch.randn_like(x)
    kw["row_index"] = kw["row_index"].flip(0).contiguous()
    second = moe_gemm.fused_grouped_mm(x2, w, offs, config=cfg, **kw)
    torch.cuda.synchronize()
    live = c["S"] - c["tail"]
    ref = fused_grouped_mm_ref(x2, w, offs, dtype=torch.float32, **kw)
    low = fused_grouped_mm_ref(x2, w, offs, dtype=BF16, **kw)
    check("repeat/second-call", second[:live], ref[:live], low[:live])
    record("repeat/differs", not torch.equal(first, second))


def test_cuda_graph_replay_with_new_routing():
    with case_env(GRAPH_CASE):
        _graph_replays(GRAPH_CASE)


def _graph_replays(c: dict) -> None:
    x, w, offs, kw = inputs(c)
    assert _gathers_in_kernel(c, x, w, offs, kw)
    cfg = GemmConfig(backend="cute")
    moe_gemm.fused_grouped_mm(x, w, offs, config=cfg, **kw)  # compile and plan outside
    static = dict(x=x.clone(), offs=offs.clone(), index=kw["row_index"].clone(),
                  weight=kw["row_weight"].clone())
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = moe_gemm.fused_grouped_mm(static["x"], w, static["offs"], gate="silu",
                                      row_index=static["index"], row_weight=static["weight"],
                                      config=cfg)
    gen = torch.Generator().manual_seed(3)
    for replay in range(3):
        counts = torch.bincount(torch.randint(0, 8, (512,), generator=gen), minlength=8)
        new_offs = counts.cumsum(0).to(torch.int32).cuda()
        static["x"].copy_(torch.randn(x.shape, generator=gen).to(BF16))
        static["offs"].copy_(new_offs)
        static["index"].copy_(torch.randint(0, 256, (512,), generator=gen))
        static["weight"].copy_(torch.rand(512, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        args = dict(row_index=static["index"], row_weight=static["weight"], gate="silu")
        ref = fused_grouped_mm_ref(static["x"], w, static["offs"], dtype=torch.float32, **args)
        low = fused_grouped_mm_ref(static["x"], w, static["offs"], dtype=BF16, **args)
        check(f"graph/replay-{replay}", y, ref, low)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "ieee"])
@pytest.mark.parametrize("c", SIGMOID_CASES, ids=[c["name"] for c in SIGMOID_CASES])
def test_sigmoid_gate(c, fast, monkeypatch):
    from moe_gemm.kernels.sm90.constants import acc_regs
    from moe_gemm.ops.fused_launch import FAST_GATE_BIASED_ACC_REGS, FAST_GATE_ENV, fused_key

    monkeypatch.setenv(FAST_GATE_ENV, "1" if fast else "0")
    x, w, offs, kw = inputs(c)
    args, choice, gather = _plan_choice(c, x, w, offs, kw)
    heavy = acc_regs(choice.schedule, choice.tile_m, choice.tile_n) >= FAST_GATE_BIASED_ACC_REGS
    expected = fast and not (c["bias"] and heavy)
    assert fused_key(args, choice, "k" if w.stride(1) == 1 else "n", gather).fast_gate == expected
    run_case(c)


@pytest.mark.parametrize("c", WIDE_GATHER_CASES, ids=[c["name"] for c in WIDE_GATHER_CASES])
def test_wide_gather_keeps_the_tile(c, monkeypatch):
    from moe_gemm.ops.fused_launch import GATHER_MAX_ROWS, GATHER_WIDE_ENV

    x, w, offs, kw = inputs(c)
    monkeypatch.delenv(GATHER_WIDE_ENV, raising=False)
    assert c["S"] >= GATHER_MAX_ROWS and not _gathers_in_kernel(c, x, w, offs, kw)
    monkeypatch.setenv(GATHER_WIDE_ENV, "1")
    assert _gathers_in_kernel(c, x, w, offs, kw)
    run_case(c)


def test_wide_gather_clamps_unchecked_indices(monkeypatch):
    from moe_gemm.ops.fused_launch import GATHER_WIDE_ENV

    monkeypatch.setenv(GATHER_WIDE_ENV, "1")
    _check_clamped_indices(WIDE_GATHER_CASES[0], "wide-gather/clamp", in_kernel=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_torch_backend_on_the_gpu_keeps_a_large_accumulator_for_the_epilogue(dtype):
    # fp16 took torch's grouped_mm there, whose fp16 accumulators (past 65504: inf) reached the
    # row weight that would have scaled them back; the kernel and the CPU gave 160.
    x = torch.full((2, 16), 100.0, dtype=dtype, device="cuda")
    w = torch.full((1, 16, 16), 100.0, dtype=dtype, device="cuda")
    offs = torch.tensor([2], dtype=torch.int32, device="cuda")
    weight = torch.full((2,), 0.001, device="cuda")
    for backend in ("torch", "auto"):
        y = moe_gemm.fused_grouped_mm(x, w, offs, row_weight=weight,
                                      config=GemmConfig(backend=backend))
        assert torch.equal(y.float().cpu(), torch.full((2, 16), 160.0)), (backend, y)
