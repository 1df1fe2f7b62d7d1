"""GPU tests of fused_grouped_mm_masked: the masked layout (x (G, M, K), the first
masked_m[g] rows of each problem valid) through the varlen fused kernel with row counts, with
fused_grouped_mm's bias, gated activation and row weights in its epilogue.

Only the valid rows are compared (rows past the counts of a new output are unspecified): the
kernel against a float64 reference of one problem at a time (fused_grouped_mm_ref on its
valid rows) by the 2x rule (helpers.check), the same computation in bf16 by torch as the
baseline. Cases: every gate in every gate layout with a bias and row weights, I = 128 and 136
(N = 2I), counts on both sides of the 64-row line and of the tile, an empty and a full problem;
both schedules pinned; a DeepSeek-style decode step and a prefill-like shape; a given `out`
(NaN-filled) whose rows past the counts and a margin around it must keep the NaN; an `out`
not viewable as (G * M, N_out); unchecked counts (negative, past M) clamped into [0, M] by
the kernel; CUDA-graph replay with new counts; no host synchronisation.

    python3 scripts/gpu_session.py --paths tests/kernels/test_fused_masked_gpu.py --out $OUT
"""

from __future__ import annotations

import pytest
import torch

from moe_gemm import GemmConfig, fused_grouped_mm_masked
from moe_gemm.ops import launch_info
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref

from .gpu_report import record
from .helpers import SCHEDULES, check, clamped_counts, masked_counts, rows_past, valid_rows

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16, FP32, FP64 = torch.bfloat16, torch.float32, torch.float64
I32 = torch.int32
NAN = float("nan")
GATES = ["silu", "gelu", "gelu_tanh", "clamped_swiglu"]
# A limit the test values reach (|h| ~ 1), so the clamps are exercised.
CLAMP = dict(gate_alpha=1.702, gate_limit=1.0)
# Row counts on both sides of the 64-row line of a 128-row tile and of the tile, an empty and
# a full (M = 200) problem; the second set for a replay with new counts.
COUNTS = [0, 1, 63, 64, 65, 200]
COUNTS_B = [129, 200, 65, 0, 1, 63]
# (gate, gate layout, w's major): the concat layout needs a K-major w (gate_up_proj
# (G, 2I, K).transpose(1, 2)); the others take either.
GATE_CASES = [(None, "concat", "n")] + [
    (g, lay, "k" if lay == "concat" else "n") for g in GATES
    for lay in ("concat", "interleaved", "alternating")
] + [("silu", "interleaved", "k"), ("silu", "alternating", "k")]


def cute(**fields) -> GemmConfig:
    return GemmConfig(backend="cute", **fields)


def make(G, M, K, N, *, gate=None, layout="concat", w_major=None, bias=True, scale=True,
         seed=0, x_scale=0.5):
    """x (G, M, K) bf16, w (G, K, N) bf16 (K-major: the transpose of a (G, N, K) weight) and
    the options as keyword arguments; |h| ~ 1."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w_major = w_major or ("k" if gate is not None and layout == "concat" else "n")
    x = (torch.randn(G, M, K, generator=gen, device=DEV) * x_scale).to(BF16)
    ws = 2.0 / K ** 0.5
    if w_major == "k":
        w = (torch.randn(G, N, K, generator=gen, device=DEV) * ws).to(BF16).transpose(1, 2)
    else:
        w = (torch.randn(G, K, N, generator=gen, device=DEV) * ws).to(BF16)
    kw: dict = {}
    if gate is not None:
        kw.update(gate=gate, gate_layout=layout)
        if gate == "clamped_swiglu":
            kw.update(CLAMP)
    if bias:
        kw["bias"] = torch.randn(G, N, generator=gen, device=DEV) * 0.5
    if scale:
        kw["row_weight"] = torch.rand(G, M, generator=gen, device=DEV)
    return x, w, kw


def _n_out(w, kw) -> int:
    return w.shape[2] // 2 if kw.get("gate") else w.shape[2]


def reference(x, w, rows, kw, dtype) -> torch.Tensor:
    """Each problem's valid rows by fused_grouped_mm_ref on those rows alone, stacked."""
    bias, rw = kw.get("bias"), kw.get("row_weight")
    parts = [torch.zeros(0, _n_out(w, kw), dtype=dtype, device=DEV)]
    for g, n in enumerate(rows):
        if not n:
            continue
        parts.append(fused_grouped_mm_ref(
            x[g, :n], w[g:g + 1], masked_counts([n]), bias=None if bias is None else bias[g:g + 1],
            gate=kw.get("gate"), gate_layout=kw.get("gate_layout", "concat"),
            gate_alpha=kw.get("gate_alpha", 1.702), gate_limit=kw.get("gate_limit", 7.0),
            row_weight=None if rw is None else rw[g, :n], dtype=dtype))
    return torch.cat(parts)


def _ran_kernel(before) -> bool:
    """Whether a kernel launch was recorded since `before` (launch_info._local.raw's identity)."""
    return getattr(launch_info._local, "raw", None) is not before


def _tile() -> str:
    c = launch_info.last_launch().choice
    return f"{c.schedule} {c.tile_m}x{c.tile_n} c{c.cluster_m}x{c.cluster_n}"


def check_fused(name, y, x, w, counts, kw, **info):
    """y's valid rows (the counts clamped into [0, M]) against the float64 reference, torch's
    bf16 computation as the 2x rule's baseline."""
    G, M, K = x.shape
    rows = clamped_counts(counts, M)
    ref = reference(x, w, rows, kw, FP64)
    low = reference(x, w, rows, kw, BF16)
    check(name, valid_rows(y, rows), ref, low, G=G, M=M, N=w.shape[2], K=K, **info)


def check_untouched(name, out, counts):
    """The rows at and past each (clamped) count still hold the NaN they were filled with."""
    past = rows_past(out, clamped_counts(counts, out.shape[1]))
    untouched = bool(torch.isnan(past.float()).all())
    record(f"{name}/rows-past-counts-untouched", untouched)
    assert untouched, f"{name}: rows past masked_m were written"


def run(name, x, w, counts, kw, *, config=None, out_mode="given", expected_m=None):
    """fused_grouped_mm_masked into a NaN-filled `out` ("given") or a new output ("alloc"),
    checked on the valid rows (and, given, NaN past them)."""
    G, M = x.shape[0], x.shape[1]
    mm = masked_counts(counts)
    cfg = config or cute()
    n_out = _n_out(w, kw)
    before = getattr(launch_info._local, "raw", None)
    if out_mode == "given":
        out = torch.full((G, M, n_out), NAN, dtype=BF16, device=DEV)
        y = fused_grouped_mm_masked(x, w, mm, expected_m=expected_m, out=out, config=cfg, **kw)
        assert y is out
    else:
        y = fused_grouped_mm_masked(x, w, mm, expected_m=expected_m, config=cfg, **kw)
    torch.cuda.synchronize()
    assert y.shape == (G, M, n_out) and y.dtype == BF16
    assert _ran_kernel(before), f"{name}: the fused kernel did not run"
    check_fused(name, y, x, w, counts, kw, tile=_tile(), out_mode=out_mode)
    if out_mode == "given":
        check_untouched(name, y, counts)
    return mm, y


def _id(case) -> str:
    gate, layout, major = case
    return f"{gate or 'plain'}-{layout}-{major}"


# ---------------------------------------------------------------------------------------------
# Numerics


@pytest.mark.parametrize("inter", [128, 136])
@pytest.mark.parametrize("case", GATE_CASES, ids=[_id(c) for c in GATE_CASES])
def test_gates_and_layouts(case, inter):
    gate, layout, major = case
    x, w, kw = make(6, 200, 136, 2 * inter, gate=gate, layout=layout, w_major=major,
                    seed=inter + len(_id(case)))
    name = f"fused-masked/{_id(case)}/I={inter}"
    run(name, x, w, COUNTS, kw, out_mode="given" if inter == 128 else "alloc")
    c = launch_info.last_launch().choice
    assert c.visitor == "device" and not c.tail_split


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", [("silu", "concat", "k"), ("clamped_swiglu", "alternating", "n"),
                                  (None, "concat", "n")], ids=_id)
def test_schedules_pinned(schedule, case):
    gate, layout, major = case
    cfg = cute(schedule=schedule)
    x, w, kw = make(6, 200, 136, 272, gate=gate, layout=layout, w_major=major, seed=11)
    name = f"fused-masked/{schedule}/{_id(case)}"
    mm, _ = run(name, x, w, COUNTS, kw, config=cfg)
    assert launch_info.last_launch().choice.schedule == schedule
    # New counts in place (the cached plan reads them at launch), a new output.
    mm.copy_(masked_counts(COUNTS_B))
    y = fused_grouped_mm_masked(x, w, mm, config=cfg, **kw)
    torch.cuda.synchronize()
    assert launch_info.last_launch().choice.schedule == schedule
    check_fused(f"{name}/new-counts", y, x, w, COUNTS_B, kw, tile=_tile())


@pytest.mark.parametrize("out_mode", ["given", "alloc"])
def test_decode_deepseek(out_mode):
    """DeepEP low-latency decode, DeepSeek-V3's gate-up on 32 local experts: 128 rows of
    capacity each, 0 to 8 tokens, SwiGLU over concat halves of a K-major weight."""
    G, M, K, N = 32, 128, 7168, 4096
    x, w, kw = make(G, M, K, N, gate="silu", layout="concat", bias=False, scale=False, seed=21)
    run(f"fused-masked/decode/{out_mode}", x, w, [g % 9 for g in range(G)], kw,
        out_mode=out_mode, expected_m=8)


@pytest.mark.parametrize("case", [("silu", "concat", "k"), ("clamped_swiglu", "alternating",
                                                             "n")], ids=_id)
def test_prefill(case):
    gate, layout, major = case
    G, M, K, N = 8, 1024, 1024, 2048
    x, w, kw = make(G, M, K, N, gate=gate, layout=layout, w_major=major, seed=22)
    counts = [1024, 0, 1, 511, 1000, 1024, 129, 768]
    run(f"fused-masked/prefill/{_id(case)}", x, w, counts, kw)


def test_expected_m_is_a_hint():
    G, M, K, N = 16, 256, 2048, 1024
    x, w, kw = make(G, M, K, N, gate="silu", seed=23)
    counts = [g % 5 for g in range(G)]
    run("fused-masked/expected_m=4", x, w, counts, kw, out_mode="alloc", expected_m=4)
    small = launch_info.last_launch().choice
    run("fused-masked/expected_m=None", x, w, counts, kw, out_mode="alloc")
    full = launch_info.last_launch().choice
    record("fused-masked/expected_m/choices", True, small=str(small), full=str(full))


# ---------------------------------------------------------------------------------------------
# out


def test_out_margin_stays_nan():
    """out inside a NaN buffer (a problem before and after it, 8 columns either side): only
    out's valid rows are written."""
    G, M, K, N = 6, 200, 136, 256
    x, w, kw = make(G, M, K, N, gate="gelu", layout="interleaved", seed=31)
    n_out = N // 2
    buf = torch.full((G + 2, M, n_out + 16), NAN, dtype=BF16, device=DEV)
    out = buf[1:G + 1, :, 8:8 + n_out]
    out.view(G * M, n_out)  # viewable: the kernel writes it directly
    y = fused_grouped_mm_masked(x, w, masked_counts(COUNTS), out=out, config=cute(), **kw)
    torch.cuda.synchronize()
    assert y is out
    check_fused("fused-masked/out-margin", out, x, w, COUNTS, kw, tile=_tile())
    check_untouched("fused-masked/out-margin", out, COUNTS)
    margin = torch.ones(buf.shape, dtype=torch.bool, device=DEV)
    margin[1:G + 1, :, 8:8 + n_out] = False
    intact = bool(torch.isnan(buf[margin].float()).all())
    record("fused-masked/out-margin/margin-untouched", intact)
    assert intact, "elements of out's buffer outside out were written"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_out_not_viewable(schedule):
    """out whose problems are not one row stride apart (rows 1..M of a taller buffer): the
    result is copied into its valid rows after the launch; rows past the counts and the
    buffer's other rows keep their NaN."""
    G, M, K, N = 6, 200, 136, 272
    x, w, kw = make(G, M, K, N, gate="clamped_swiglu", layout="alternating", seed=32)
    n_out = N // 2
    buf = torch.full((G, M + 2, n_out), NAN, dtype=BF16, device=DEV)
    out = buf[:, 1:M + 1]
    with pytest.raises(RuntimeError):
        out.view(G * M, n_out)
    cfg = cute(schedule=schedule)
    name = f"fused-masked/out-not-viewable/{schedule}"
    for trial, counts in enumerate((COUNTS, COUNTS_B)):  # the second call: the cached plan
        buf.fill_(NAN)
        assert fused_grouped_mm_masked(x, w, masked_counts(counts), out=out, config=cfg, **kw) is out
        torch.cuda.synchronize()
        check_fused(f"{name}/{trial}", out, x, w, counts, kw, tile=_tile())
        check_untouched(f"{name}/{trial}", out, counts)
        intact = bool(torch.isnan(buf[:, 0].float()).all()
                      and torch.isnan(buf[:, M + 1].float()).all())
        record(f"{name}/{trial}/margin-untouched", intact)
        assert intact


# ---------------------------------------------------------------------------------------------
# Counts on the GPU are not checked; the kernel clamps them


BAD_COUNTS = [[-3, 135, 2**31 - 1, -2**31, 7, 130], [-1, -1, -1, -1, -1, -1],
              [131, 1000, 130, 0, 2**30, 64]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_unchecked_counts_are_clamped(schedule):
    G, M, K, N = 6, 130, 128, 256
    cfg = cute(schedule=schedule)
    x, w, kw = make(G, M, K, N, gate="silu", layout="concat", seed=41)
    n_out = N // 2
    mm = masked_counts(BAD_COUNTS[0])
    buf = torch.full((G + 2, M, n_out), NAN, dtype=BF16, device=DEV)
    out = buf[1:G + 1]
    tall = torch.full((G, M + 2, n_out), NAN, dtype=BF16, device=DEV)
    out_nv = tall[:, 1:M + 1]  # not viewable: copied in after the launch
    for i, counts in enumerate(BAD_COUNTS):
        name = f"fused-masked/clamped/{schedule}/{i}"
        mm.copy_(masked_counts(counts))
        buf.fill_(NAN)
        tall.fill_(NAN)
        assert fused_grouped_mm_masked(x, w, mm, out=out, config=cfg, **kw) is out
        assert fused_grouped_mm_masked(x, w, mm, out=out_nv, config=cfg, **kw) is out_nv
        torch.cuda.synchronize()
        for tag, o in (("out", out), ("out-not-viewable", out_nv)):
            check_fused(f"{name}/{tag}", o, x, w, counts, kw, given=counts)
            check_untouched(f"{name}/{tag}", o, counts)
        intact = bool(torch.isnan(buf[0].float()).all() and torch.isnan(buf[G + 1].float()).all()
                      and torch.isnan(tall[:, 0].float()).all()
                      and torch.isnan(tall[:, M + 1].float()).all())
        record(f"{name}/outside-out-untouched", intact)
        assert intact, f"counts {counts} wrote outside out"
        y = fused_grouped_mm_masked(x, w, mm, config=cfg, **kw)
        torch.cuda.synchronize()
        check_fused(f"{name}/alloc", y, x, w, counts, kw)


def test_counts_checked_on_request(monkeypatch):
    x, w, kw = make(3, 64, 64, 128, gate="silu", seed=42)
    monkeypatch.setenv("MOE_GEMM_CHECK_OFFS", "1")
    with pytest.raises(ValueError, match=r"masked_m\[1\]=65"):
        fused_grouped_mm_masked(x, w, masked_counts([0, 65, 3]), config=cute(), **kw)
    with pytest.raises(ValueError, match=r"masked_m\[0\]=-1"):
        fused_grouped_mm_masked(x, w, masked_counts([-1, 0, 3]), config=cute(), **kw)
    y = fused_grouped_mm_masked(x, w, masked_counts([64, 0, 3]), config=cute(), **kw)
    torch.cuda.synchronize()
    check_fused("fused-masked/checked-on-request", y, x, w, [64, 0, 3], kw)


# ---------------------------------------------------------------------------------------------
# CUDA graphs and host synchronisation


def test_no_host_sync():
    G, M, K, N = 8, 128, 256, 512
    x, w, kw = make(G, M, K, N, gate="silu", seed=51)
    mm = masked_counts([0, 1, 5, 128, 64, 3, 2, 77])
    out = torch.full((G, M, N // 2), NAN, dtype=BF16, device=DEV)
    tall = torch.full((G, M + 1, N // 2), NAN, dtype=BF16, device=DEV)
    out_nv = tall[:, :M]
    cfg = cute()
    for o in (None, out, out_nv):  # compile + plans outside the check
        fused_grouped_mm_masked(x, w, mm, out=o, config=cfg, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        y = fused_grouped_mm_masked(x, w, mm, config=cfg, **kw)
        fused_grouped_mm_masked(x, w, mm, out=out, config=cfg, **kw)
        fused_grouped_mm_masked(x, w, mm, out=out_nv, config=cfg, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record("fused-masked/no-host-sync", True)
    torch.cuda.synchronize()
    counts = mm.tolist()
    for tag, t in (("alloc", y), ("out", out), ("out-not-viewable", out_nv)):
        check_fused(f"fused-masked/no-host-sync/{tag}", t, x, w, counts, kw)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cuda_graph_replay_with_new_counts(schedule):
    """One capture of a new-output call, an out= call and a call into an out not viewable as
    rows; each replay reads the counts, x and row weights written in place since, including
    counts the kernel must clamp. The graph's outputs are kept alive with it."""
    G, M, K, N = 8, 256, 384, 512
    cfg = cute(schedule=schedule)
    x, w, kw = make(G, M, K, N, gate="silu", layout="concat", seed=61)
    n_out = N // 2
    mm = masked_counts([256, 0, 1, 64, 65, 129, 200, 7])
    out = torch.full((G, M, n_out), NAN, dtype=BF16, device=DEV)
    tall = torch.full((G, M + 2, n_out), NAN, dtype=BF16, device=DEV)
    out_nv = tall[:, 1:M + 1]
    for o in (None, out, out_nv):  # compile + plans outside the capture
        fused_grouped_mm_masked(x, w, mm, out=o, config=cfg, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_grouped_mm_masked(x, w, mm, config=cfg, **kw)
        fused_grouped_mm_masked(x, w, mm, out=out, config=cfg, **kw)
        fused_grouped_mm_masked(x, w, mm, out=out_nv, config=cfg, **kw)
    gen = torch.Generator().manual_seed(62)
    trials = [torch.randint(0, M + 1, (G,), generator=gen).tolist() for _ in range(2)]
    trials += [[0] * G, [M] * G, [-5, M + 9, 3, 0, 2**31 - 1, 128, -2**31, 255]]
    xgen = torch.Generator(device=DEV).manual_seed(63)
    for trial, counts in enumerate(trials):
        mm.copy_(torch.tensor(counts, dtype=I32))
        x.copy_((torch.randn(x.shape, generator=xgen, device=DEV) * 0.5).to(BF16))
        kw["row_weight"].copy_(torch.rand(G, M, generator=xgen, device=DEV))
        out.fill_(NAN)
        tall.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        name = f"fused-masked/cuda-graph/{schedule}/replay{trial}"
        check_fused(name, y, x, w, counts, kw, given=counts)
        for tag, o in (("out", out), ("out-not-viewable", out_nv)):
            check_fused(f"{name}/{tag}", o, x, w, counts, kw, given=counts)
            check_untouched(f"{name}/{tag}", o, counts)
    del graph
