"""The `out` argument of every public op: which dtype it gives the result, and an output made
under torch.inference_mode given to a call outside it.

out's dtype: with out_dtype=None an `out` sets the result's dtype (an fp32 out takes fp32
results of bf16 operands), on every op alike; the docstrings said "default x's dtype" on most.

An inference out outside inference mode: torch's own in-place writes (the torch backend)
raised its RuntimeError, while the Hopper kernels wrote into the tensor silently. The shared
checks refuse it before the backend is chosen, on both paths alike, and a plan cached for an
inference out inside inference mode does not take a later call outside it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from host_fakes import Recorder

import moe_gemm
from moe_gemm.ops import api, signature
from moe_gemm.testing_fp8 import (
    make_fp8_batched_inputs,
    make_fp8_grouped_inputs,
    make_fp8_moe_inputs,
)

BF16, FP32, I32 = torch.bfloat16, torch.float32, torch.int32
# torch's message, which the checks' own begins with, then naming the argument
INFERENCE = r"^Inplace update to inference tensor outside InferenceMode is not allowed: out"

Run = Callable[[object, object], object]  # run(out, out_dtype) -> the op's result


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF16)


def _counts() -> torch.Tensor:
    return torch.randint(0, 9, (3,), dtype=I32)


def _offs(T: int) -> torch.Tensor:
    cuts = torch.sort(torch.randint(0, T + 1, (2,))).values
    return torch.cat([cuts, torch.tensor([T])]).to(I32)


# Each case: (run, output shapes; a list for the ops that take a list of outputs). Shapes the
# Hopper path takes (bf16 / FP8, 16-byte rows), so that the cute_ops fixture builds plans.

def _mm():
    x, w, offs = _randn(24, 32), _randn(3, 32, 16), _offs(24)
    return lambda out, dt: moe_gemm.grouped_mm(x, w, offs, out=out, out_dtype=dt), (24, 16)


def _bmm():
    x, w = _randn(3, 8, 32), _randn(3, 32, 16)
    return lambda out, dt: moe_gemm.grouped_mm(x, w, out=out, out_dtype=dt), (3, 8, 16)


def _gemm():
    a, b = [_randn(5, 32), _randn(7, 32)], [_randn(32, 16), _randn(32, 16)]
    return lambda out, dt: moe_gemm.grouped_gemm(a, b, out=out, out_dtype=dt), [(5, 16), (7, 16)]


def _plan():
    a, b = [_randn(5, 32), _randn(7, 32)], [_randn(32, 16), _randn(32, 16)]
    return (lambda out, dt: moe_gemm.GroupedGemmPlan(a, b, out=out, out_dtype=dt)(),
            [(5, 16), (7, 16)])


def _masked():
    x, w, mm = _randn(3, 8, 32), _randn(3, 32, 16), _counts()
    return (lambda out, dt: moe_gemm.grouped_mm_masked(x, w, mm, out=out, out_dtype=dt),
            (3, 8, 16))


def _fused():
    x, w = _randn(24, 32), _randn(3, 32, 32).transpose(1, 2)
    offs, index = _offs(24), torch.randperm(24)
    bias, rw = torch.randn(3, 32), torch.rand(24)
    return (lambda out, dt: moe_gemm.fused_grouped_mm(
        x, w, offs, row_index=index, row_weight=rw, bias=bias, gate="silu", out=out,
        out_dtype=dt), (24, 16))


def _fused_masked():
    x, w, mm = _randn(3, 8, 32), _randn(3, 32, 32).transpose(1, 2), _counts()
    bias, rw = torch.randn(3, 32), torch.rand(3, 8)
    return (lambda out, dt: moe_gemm.fused_grouped_mm_masked(
        x, w, mm, bias=bias, row_weight=rw, gate="silu", out=out, out_dtype=dt), (3, 8, 16))


def _seed() -> int:
    return int(torch.randint(1 << 30, ()))


def _scaled():
    x, w, sa, sb, offs = make_fp8_moe_inputs(24, 3, 128, 16, "row", seed=_seed())
    return (lambda out, dt: moe_gemm.scaled_grouped_mm(x, w, sa, sb, offs, out=out,
                                                       out_dtype=dt), (24, 16))


def _scaled_bmm():
    x, w, sa, sb = make_fp8_batched_inputs(3, 8, 128, 16, "row", seed=_seed())
    return (lambda out, dt: moe_gemm.scaled_grouped_mm(x, w, sa, sb, out=out, out_dtype=dt),
            (3, 8, 16))


def _scaled_gemm():
    a, b, sa, sb = make_fp8_grouped_inputs([(5, 16, 128), (7, 16, 128)], "row", seed=_seed())
    return (lambda out, dt: moe_gemm.scaled_grouped_gemm(a, b, sa, sb, out=out, out_dtype=dt),
            [(5, 16), (7, 16)])


def _scaled_masked():
    x, w, sa, sb = make_fp8_batched_inputs(3, 8, 128, 16, "row", seed=_seed())
    mm = _counts()
    return (lambda out, dt: moe_gemm.scaled_grouped_mm_masked(x, w, sa, sb, mm, out=out,
                                                              out_dtype=dt), (3, 8, 16))


CASES = {"grouped_mm 2-D": _mm, "grouped_mm 3-D": _bmm, "grouped_gemm": _gemm,
         "GroupedGemmPlan": _plan, "grouped_mm_masked": _masked,
         "fused_grouped_mm": _fused, "fused_grouped_mm_masked": _fused_masked,
         "scaled_grouped_mm 2-D": _scaled, "scaled_grouped_mm 3-D": _scaled_bmm,
         "scaled_grouped_gemm": _scaled_gemm, "scaled_grouped_mm_masked": _scaled_masked}
# the function whose docstring documents out_dtype (a plan's are grouped_gemm's)
DOCUMENTED = {"GroupedGemmPlan": "grouped_gemm"}


def _outs(shapes, dtype: torch.dtype):
    """Zero-filled outputs (the rows an op leaves alone hold what a new output holds there)."""
    if isinstance(shapes, list):
        return [torch.zeros(s, dtype=dtype) for s in shapes]
    return torch.zeros(shapes, dtype=dtype)


def _listed(res) -> list[torch.Tensor]:
    return list(res) if isinstance(res, (list, tuple)) else [res]


@pytest.mark.parametrize("op", list(CASES))
def test_out_sets_the_result_dtype_as_documented(op: str) -> None:
    run, shapes = CASES[op]()
    out = _outs(shapes, FP32)
    got = run(out, None)
    for g, o in zip(_listed(got), _listed(out), strict=True):
        assert g is o and g.dtype == FP32
    # the fp32 results out_dtype=float32 asks for, not bf16 ones widened into out
    want, narrow = _listed(run(None, FP32)), _listed(run(None, None))
    for g, wnt, nar in zip(_listed(got), want, narrow, strict=True):
        assert nar.dtype == BF16  # (x's dtype; the FP8 ops' default)
        torch.testing.assert_close(g, wnt, rtol=0, atol=0)
    assert any(not torch.equal(g, n.float()) for g, n in zip(_listed(got), narrow)), (
        "an fp32 out received bf16-rounded results")
    # an out_dtype that disagrees with out: a TypeError naming the dtype asked for
    with pytest.raises(TypeError, match=r"out(\[0\])? must have dtype torch\.bfloat16; got "
                                        r"torch\.float32"):
        run(_outs(shapes, FP32), BF16)
    doc = " ".join(inspect.getdoc(getattr(moe_gemm, DOCUMENTED.get(op, op.split()[0]))).split())
    assert "default out's dtype where out is given" in doc, doc


@pytest.mark.parametrize("op", list(CASES))
def test_an_inference_out_outside_inference_mode_is_refused_on_the_torch_path(op: str) -> None:
    run, shapes = CASES[op]()
    with torch.inference_mode():
        out = _outs(shapes, BF16)
        want = run(out, None)  # (written there, as torch allows)
    before = [o.clone() for o in _listed(want)]
    with pytest.raises(RuntimeError, match=INFERENCE):
        run(out, None)
    for o, b in zip(_listed(out), before):
        assert torch.equal(o, b)


@pytest.fixture(params=["TensorGuards", "python"])
def signatures(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan caches' signatures by either comparison (TensorGuards' dispatch keys differ
    inside and outside inference mode; the Python fallback's properties do not)."""
    if request.param == "python":
        monkeypatch.setattr(signature, "guards_usable", lambda: False)
    elif not signature.guards_usable():
        pytest.skip("TensorGuards is not usable with this torch")


@pytest.mark.parametrize("op", list(CASES))
def test_an_inference_out_outside_inference_mode_is_refused_on_the_hopper_path(
        cute_ops: Recorder, signatures: None, op: str) -> None:
    # The kernels (the recorder here) wrote into the inference tensor silently.
    run, shapes = CASES[op]()
    with torch.inference_mode():
        out = _outs(shapes, BF16)
    with pytest.raises(RuntimeError, match=INFERENCE):
        run(out, None)
    assert cute_ops.calls == []
    with torch.inference_mode():  # twice: the second call takes the cached plan, if any
        run(out, None)
        run(out, None)
    calls = len(cute_ops.calls)
    assert calls == 2
    # A plan built for the inference out inside inference mode does not take this call.
    with pytest.raises(RuntimeError, match=INFERENCE):
        run(out, None)
    assert len(cute_ops.calls) == calls
    # A normal out, outside inference mode: written (twice, the second from the cache).
    normal = _outs(shapes, BF16)
    run(normal, None)
    run(normal, None)
    assert len(cute_ops.calls) == calls + 2


def test_a_plan_of_an_inference_out_is_refused_outside_inference_mode(
        cute_ops: Recorder, signatures: None) -> None:
    # A GroupedGemmPlan built in inference mode with outputs made there, then called outside:
    # it replayed its launch into them.
    a, b = [_randn(5, 32), _randn(7, 32)], [_randn(32, 16), _randn(32, 16)]
    with torch.inference_mode():
        out = [torch.zeros(5, 16, dtype=BF16), torch.zeros(7, 16, dtype=BF16)]
        plan = moe_gemm.GroupedGemmPlan(a, b, out=out)
        plan()
        plan()
    assert len(cute_ops.calls) == 2
    for _ in range(2):  # (the refusal leaves the plan as it was)
        with pytest.raises(RuntimeError, match=INFERENCE + r"\[0\]"):
            plan()
    assert len(cute_ops.calls) == 2
    with torch.inference_mode():
        plan()
    assert len(cute_ops.calls) == 3
    # Its own outputs, allocated as normal tensors even under inference mode, are fine.
    with torch.inference_mode():
        own = moe_gemm.GroupedGemmPlan(a, b)
    own()
    assert len(cute_ops.calls) == 4
    api._clear_plans()
