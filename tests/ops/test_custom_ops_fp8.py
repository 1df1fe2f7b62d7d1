"""ops/custom_ops_fp8.py on the CPU: the FP8 ops' torch.library registrations (opcheck), fake
tensors, make_fx and torch.compile(fullgraph=True) against eager, the raising backward."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck

from moe_gemm import GemmConfig, scaled_grouped_gemm, scaled_grouped_mm
from moe_gemm.testing_fp8 import (
    make_fp8_batched_inputs,
    make_fp8_grouped_inputs,
    make_fp8_moe_inputs,
)

OPS = torch.ops.moe_gemm
# opcheck's schema test compares inputs before and after with torch.allclose, which torch
# does not implement for float8 on the CPU: the other tests run. (A backward through the ops
# raises by design, so the AOT test is also left out where an input requires grad.)
UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NO_AOT = ("test_autograd_registration", "test_faketensor")



@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_opcheck_scaled_grouped_mm(granularity):
    x, w, sa, sb, offs = make_fp8_moe_inputs(19, 4, 256, 24, granularity, empty_fraction=0.25,
                                             seed=1)
    opcheck(OPS._scaled_grouped_mm.default, (x, w, sa, sb, offs, "", None), test_utils=UTILS)
    opcheck(OPS._scaled_grouped_mm.default, (x, w, sa, sb, offs, "{'backend': 'torch'}",
                                             torch.float32), test_utils=UTILS)
    out = torch.full((19, 24), 7.0, dtype=torch.bfloat16)
    opcheck(OPS._scaled_grouped_mm_out.default, (x, w, sa, sb, offs, out, "", None),
            test_utils=UTILS)
    x3, w3, sa3, sb3 = make_fp8_batched_inputs(2, 5, 128, 16, granularity, seed=2)
    opcheck(OPS._scaled_grouped_mm.default, (x3, w3, sa3, sb3, None, "", torch.float16),
            test_utils=UTILS)
    opcheck(OPS._scaled_grouped_mm.default,
            (x, w, sa.clone().requires_grad_(), sb, offs, "", None), test_utils=NO_AOT)


def test_opcheck_scaled_grouped_gemm():
    a, b, sa, sb = make_fp8_grouped_inputs([(5, 16, 128), (0, 16, 128), (3, 32, 256)],
                                           "block", seed=3)
    opcheck(OPS._scaled_grouped_gemm.default, (a, b, sa, sb, "", None), test_utils=UTILS)
    opcheck(OPS._scaled_grouped_gemm.default, (a, b, sa, sb, "", torch.float32),
            test_utils=UTILS)


def test_fake_tensors_give_shapes_and_dtypes():
    with FakeTensorMode():
        x = torch.empty(37, 256, dtype=torch.float8_e4m3fn)
        w = torch.empty(6, 24, 256, dtype=torch.float8_e4m3fn).transpose(1, 2)
        sa, sb = torch.empty(37, 2), torch.empty(6, 2, 1)
        offs = torch.empty(6, dtype=torch.int32)
        y = scaled_grouped_mm(x, w, sa, sb, offs, out_dtype=torch.float32)
        with pytest.raises(ValueError, match="match no granularity"):
            scaled_grouped_mm(x, w, sa[:, :1], sb, offs)
        outs = scaled_grouped_gemm([x[:3]], [w[0]], [sa[:3]], [sb[0]])
    assert isinstance(y, FakeTensor) and y.shape == (37, 24) and y.dtype == torch.float32
    assert outs[0].shape == (3, 24) and outs[0].dtype == torch.bfloat16


def test_traced_scaled_grouped_gemm_checks_and_fills_out_as_eager():
    """Under a tensor mode (the traced path) scaled_grouped_gemm(out=...) computes at out's
    dtype, as eagerly (an fp32 out is not rounded to bf16 first), and refuses what eager
    refuses: a count, shape or dtype of `out` that does not fit; on fake tensors the op's
    own checks run (mismatched lists)."""
    from torch.utils.flop_counter import FlopCounterMode

    a, b, sa, sb = make_fp8_grouped_inputs([(4, 16, 128), (3, 32, 128)], "row", seed=6)
    want = scaled_grouped_gemm(a, b, sa, sb, out=[torch.zeros(4, 16), torch.zeros(3, 32)])
    with FlopCounterMode(display=False):
        got = scaled_grouped_gemm(a, b, sa, sb, out=[torch.zeros(4, 16), torch.zeros(3, 32)])
        for bad, err, pattern in (
                ([torch.zeros(4, 16)], ValueError, "one out per problem"),
                ([torch.zeros(1, 16), torch.zeros(3, 32)], ValueError, r"out\[0\] must be"),
                ([torch.zeros(4, 16), torch.zeros(3, 32, dtype=torch.float16)], TypeError,
                 r"out\[1\] must have dtype torch.float32"),
                ([torch.zeros(4, 16), None], TypeError, r"out\[1\] must be a torch.Tensor")):
            with pytest.raises(err, match=pattern):
                scaled_grouped_gemm(a, b, sa, sb, out=bad)
    for g, r in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    with FakeTensorMode(), pytest.raises(ValueError, match="one b, scale_a and scale_b per a"):
        x = torch.empty(4, 128, dtype=torch.float8_e4m3fn)
        OPS._scaled_grouped_gemm(
            [x, x], [torch.empty(128, 16, dtype=torch.float8_e4m3fn)], [torch.empty(4)],
            [torch.empty(16)], "", None)


def test_traced_scaled_grouped_gemm_refuses_argument_types_as_eager():
    """A None problem operand or scale, or an out_dtype that is not a dtype: eager's
    TypeError under a tensor mode too (not the schema's RuntimeError, and an int out_dtype is
    not read as a ScalarType code)."""
    from torch.utils.flop_counter import FlopCounterMode

    a, b, sa, sb = make_fp8_grouped_inputs([(4, 16, 128)], "row", seed=7)
    cases = ((([None], b, sa, sb), {}, r"a\[0\] must be a torch.Tensor"),
             ((a, b, [None], sb), {}, r"scale_a\[0\] must be a torch.Tensor"),
             ((a, b, sa, sb), {"out_dtype": "bf16"}, "out_dtype must be a torch.dtype"),
             ((a, b, sa, sb), {"out_dtype": 5}, "out_dtype must be a torch.dtype"))
    for args, kwargs, pattern in cases:
        with pytest.raises(TypeError, match=pattern):
            scaled_grouped_gemm(*args, **kwargs)
        with FlopCounterMode(display=False), pytest.raises(TypeError, match=pattern):
            scaled_grouped_gemm(*args, **kwargs)


def test_make_fx_and_compile_match_eager():
    import torch._dynamo

    x, w, sa, sb, offs = make_fp8_moe_inputs(23, 3, 256, 40, "block", seed=4)
    a, b, sa2, sb2 = make_fp8_grouped_inputs([(4, 32, 128), (2, 16, 128)], "row",
                                             seed=5)
    cfg = GemmConfig(backend="torch")

    def f(x, w, sa, sb, offs, a0, a1, b0, b1, s0, s1, t0, t1):
        y = scaled_grouped_mm(x, w, sa, sb, offs, config=cfg)
        outs = scaled_grouped_gemm([a0, a1], [b0, b1], [s0, s1], [t0, t1])
        return y.float() * 2, *outs

    args = (x, w, sa, sb, offs, *a, *b, *sa2, *sb2)
    gm = make_fx(f, tracing_mode="fake")(*args)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"moe_gemm._scaled_grouped_mm.default",
            "moe_gemm._scaled_grouped_gemm.default"} <= targets
    want = f(*args)
    for g, r in zip(gm(*args), want):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        got = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)(*args)
        assert torch._dynamo.utils.counters["graph_break"] == {}
    finally:
        torch._dynamo.reset()
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_compiled_backward_raises():
    import torch._dynamo

    x, w, sa, sb, offs = make_fp8_moe_inputs(8, 2, 128, 16, "row", seed=6)
    sa = sa.clone().requires_grad_()
    torch._dynamo.reset()
    try:
        y = torch.compile(lambda *t: scaled_grouped_mm(*t).float().sum(), fullgraph=True,
                          backend="aot_eager")(x, w, sa, sb, offs)
    finally:
        torch._dynamo.reset()
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="inference-only"):
        y.backward()


def test_compiled_backward_with_out_raises_too():
    # With `out`, a compiled call whose scales require grad used to run the `_out` op (no
    # autograd): the result lost its link and a backward skipped the call without a word.
    import torch._dynamo

    x, w, sa, sb, offs = make_fp8_moe_inputs(8, 2, 128, 16, "row", seed=6)
    sa = sa.clone().requires_grad_()
    out = torch.full((8, 16), 5.0, dtype=torch.bfloat16)
    torch._dynamo.reset()
    try:
        y = torch.compile(lambda *t: scaled_grouped_mm(*t, out=out), fullgraph=True,
                          backend="aot_eager")(x, w, sa, sb, offs)
    finally:
        torch._dynamo.reset()
    assert y is out and y.requires_grad
    with torch.no_grad():
        want = scaled_grouped_mm(x, w, sa, sb, offs, out=torch.full_like(out, 5.0))
    torch.testing.assert_close(y.detach(), want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="inference-only"):
        y.float().sum().backward()


def test_compiled_scaled_grouped_gemm_refuses_outputs_that_share_memory():
    """Compiled scaled_grouped_gemm(out=) with two outputs over one buffer: eager's
    ValueError (it copied the results into them: a wrong out[0] without a word); separate
    outputs are written and returned as eagerly. (Separate functions and a reset between:
    torch 2.13 replays a graph traced for aliased list inputs for separate ones, and
    inductor's on-disk cache does the same across processes; our op's checks then refuse the
    views it is handed.)"""
    import torch._dynamo

    a, b, sa, sb = make_fp8_grouped_inputs([(5, 16, 128), (3, 16, 128)], "block", seed=11)
    want = scaled_grouped_gemm(a, b, sa, sb)

    def separate(outs):
        return scaled_grouped_gemm(a, b, sa, sb, out=outs)

    def aliased(outs):
        return scaled_grouped_gemm(a, b, sa, sb, out=outs)

    big = torch.zeros(5, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share memory"):
        scaled_grouped_gemm(a, b, sa, sb, out=[big, big[2:5]])
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="share memory"):
        torch.compile(aliased, fullgraph=True, backend="aot_eager")([big, big[2:5]])
    torch._dynamo.reset()
    outs = [torch.full((5, 16), float("nan"), dtype=torch.bfloat16),
            torch.full((3, 16), float("nan"), dtype=torch.bfloat16)]
    got = torch.compile(separate, fullgraph=True, backend="aot_eager")(outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_fake_implementations_never_read_an_address():
    """The fake implementations run on fake tensors, whose address a CUDA one refuses to give
    (RuntimeError; a CPU one warns and says 0): the list ops' checks of `out` skip the memory
    comparison there (it runs when the graph runs, on real tensors). Warnings as errors stand
    in for the CUDA refusal on this CPU."""
    import warnings

    a, b, sa, sb = make_fp8_grouped_inputs([(5, 16, 128), (0, 16, 128), (3, 32, 128)], "row",
                                           seed=12)
    with FakeTensorMode() as mode:
        fa, fb, fsa, fsb = ([mode.from_tensor(t) for t in ts] for ts in (a, b, sa, sb))
        outs = [torch.empty(5, 16, dtype=torch.float32), torch.empty(0, 16, dtype=torch.float32),
                torch.empty(3, 32, dtype=torch.float32)]
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*data pointer of FakeTensor.*")
            OPS._scaled_grouped_gemm_out(fa, fb, fsa, fsb, outs, "", None)
            OPS._check_scaled_gemm_outs(fa, fb, fsa, fsb, outs, None)
            res = OPS._scaled_grouped_gemm(fa, fb, fsa, fsb, "", torch.float32)
            assert [tuple(r.shape) for r in res] == [(5, 16), (0, 16), (3, 32)]
            OPS._grouped_gemm_out([t.to(torch.bfloat16) for t in fa],
                                  [t.to(torch.bfloat16) for t in fb], outs, "", None)
            OPS._check_gemm_outs([t.to(torch.bfloat16) for t in fa],
                                 [t.to(torch.bfloat16) for t in fb], outs, None)
