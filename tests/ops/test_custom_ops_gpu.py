"""The registered ops on an sm90 GPU with our kernels: opcheck (schema, fake implementations,
autograd registration, AOT dispatch), torch.compile(fullgraph=True) of each op (inductor)
equal to eager, and a compiled graph captured in a CUDA graph and replayed with new routing.

backend="cute" is forced, so a kernel that could not take an input would raise instead of
silently running the torch backend. MOE_GEMM_TEST_MOE_BACKEND=torch puts the torch backend in
its place (to check the tests themselves where the kernels are not available).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.library import opcheck

from moe_gemm import GemmConfig, grouped_gemm, grouped_mm
from moe_gemm.ops import launch_info
from moe_gemm.ops.custom_ops import encode_config
from moe_gemm.testing import assert_close_to_ref, make_grouped_inputs, make_moe_inputs

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16 = torch.bfloat16
BACKEND = os.environ.get("MOE_GEMM_TEST_MOE_BACKEND", "cute")
CFG = GemmConfig(backend=BACKEND)  # type: ignore[arg-type]
OPS = torch.ops.moe_gemm


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _moe(seed: int, T=300, E=8, K=512, N=256, w_layout="nk_view"):
    return make_moe_inputs(T, E, K, N, BF16, DEVICE, w_layout=w_layout, empty_fraction=0.25,
                           generator=_gen(seed))


@pytest.fixture
def dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def _ran_kernels(fn):
    """fn() and whether it launched one of our kernels on this thread."""
    before = launch_info.last_launch()
    res = fn()
    torch.cuda.synchronize()
    after = launch_info.last_launch()
    return res, after is not None and after is not before


def test_opcheck_on_our_kernels() -> None:
    cfg = encode_config(CFG)
    x, w, offs = _moe(1)
    opcheck(OPS._grouped_mm.default, (x, w, offs, cfg, None))
    opcheck(OPS._grouped_mm.default, (x, w, offs, cfg, torch.float32))
    opcheck(OPS._grouped_mm_out.default, (x, w, offs, torch.zeros(x.shape[0], 256, dtype=BF16,
                                                                  device=DEVICE), cfg, None))
    x3 = torch.randn(4, 64, 512, dtype=BF16, device=DEVICE)
    opcheck(OPS._grouped_mm.default, (x3, w[:4], None, cfg, None))
    sizes = [(64, 256, 512), (0, 256, 512), (130, 128, 256), (7, 64, 128)]
    a, b = make_grouped_inputs(sizes, BF16, DEVICE, b_layout="col", generator=_gen(2))
    opcheck(OPS._grouped_gemm.default, (a, b, cfg, None))
    outs = [torch.zeros(m, n, dtype=BF16, device=DEVICE) for m, n, _ in sizes]
    opcheck(OPS._grouped_gemm_out.default, (a, b, outs, cfg, None))


def test_compiled_ops_equal_eager_and_run_our_kernels(dynamo) -> None:
    x, w, offs = _moe(3)
    sizes = [(64, 256, 512), (0, 256, 512), (130, 128, 256)]
    a, b = make_grouped_inputs(sizes, BF16, DEVICE, b_layout="col", generator=_gen(4))

    def f(x, w, offs, a0, a1, a2, b0, b1, b2):
        y = grouped_mm(x, w, offs, config=CFG)
        y3 = grouped_mm(x[:256].view(4, 64, 512), w[:4], config=CFG)
        outs = grouped_gemm([a0, a1, a2], [b0, b1, b2], config=CFG)
        return y, y3, *outs

    compiled = torch.compile(f, fullgraph=True)
    with torch.no_grad():
        got, ran = _ran_kernels(lambda: compiled(x, w, offs, *a, *b))
        want = f(x, w, offs, *a, *b)
    assert ran or BACKEND == "torch"
    assert dynamo["graph_break"] == {}
    for g, r in zip(got, want):  # the same kernels on the same operands: bitwise equal
        assert torch.equal(g, r)


def test_compiled_plan_call_runs_our_kernels_and_writes_its_outputs(dynamo) -> None:
    import moe_gemm

    sizes = [(64, 256, 512), (0, 256, 512), (130, 128, 256)]
    a, b = make_grouped_inputs(sizes, BF16, DEVICE, b_layout="col", generator=_gen(5))
    plan = moe_gemm.GroupedGemmPlan(a, b, config=CFG)
    eager = [o.clone() for o in plan()]

    def f(x):
        a[0].copy_(x)
        return [o.float() for o in plan()]

    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(64, 512, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(6))
    with torch.no_grad():
        got, ran = _ran_kernels(lambda: compiled(x.to(BF16)))
    assert ran or BACKEND == "torch"
    assert dynamo["graph_break"] == {}
    assert torch.equal(a[0], x.to(BF16))
    for g, o in zip(got, plan.out):
        assert torch.equal(g, o.float())  # the plan's outputs were written
    for o, ai, bi in zip(plan.out, a, b):
        assert_close_to_ref(o, ai.double() @ bi.double(), ai @ bi)
    assert torch.equal(plan.out[2], eager[2])  # an operand not changed: the same result


def test_compiled_grouped_mm_in_a_cuda_graph_with_new_routing(dynamo) -> None:
    T, E = 384, 8
    x, w, offs = _moe(5, T=T, E=E)
    compiled = torch.compile(lambda x, w, offs: torch.relu(grouped_mm(x, w, offs, config=CFG)),
                             fullgraph=True)
    static_x, static_offs = x.clone(), offs.clone()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and warm up outside the capture
                compiled(static_x, w, static_offs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = compiled(static_x, w, static_offs)
        for trial in range(3):
            x2, _, offs2 = _moe(10 + trial, T=T, E=E)
            static_x.copy_(x2)
            static_offs.copy_(offs2)
            graph.replay()
            eager = torch.relu(grouped_mm(x2, w, offs2, config=CFG))
            torch.cuda.synchronize()
            assert torch.equal(static_y, eager), f"replay {trial} differs from eager"
            ref = torch.relu(grouped_mm(x2.float(), w.float(), offs2,
                                        config=GemmConfig(backend="torch")))
            assert_close_to_ref(static_y, ref, name=f"replay {trial}")
    assert dynamo["graph_break"] == {}


@pytest.mark.skipif(BACKEND == "torch", reason="checks which path the kernels' inputs take")
def test_compiled_backward_follows_the_path_the_forward_took(dynamo) -> None:
    """Under torch.compile on a Hopper GPU with the automatic backend: inputs the kernels take
    run them and a backward raises, as in eager; inputs they do not take (x column-major) run
    torch's path, whose compiled gradients match eager autograd's."""
    x, w, offs = _moe(7, w_layout="kn")
    grad = torch.randn(x.shape[0], w.shape[2], generator=_gen(8)).to(BF16).to(DEVICE)
    compiled = torch.compile(lambda x, w: grouped_mm(x, w, offs), fullgraph=True)

    wg = w.clone().requires_grad_()
    (y, ran) = _ran_kernels(lambda: compiled(x, wg))
    assert ran
    with pytest.raises(RuntimeError, match="inference-only"):
        y.backward(grad)

    # (aot_eager: inductor may hand a custom op other strides than its caller's)
    x_cols = x.t().contiguous().t()
    eager_x, eager_w = x_cols.clone().requires_grad_(), w.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "using the torch backend because"
        grouped_mm(eager_x, eager_w, offs).backward(grad)
        traced = torch.compile(lambda x, w: grouped_mm(x, w, offs), fullgraph=True,
                               backend="aot_eager")
        cx, cw = x_cols.clone().requires_grad_(), w.clone().requires_grad_()
        (y, ran) = _ran_kernels(lambda: traced(cx, cw))
        assert not ran
        y.backward(grad)
    # (eager's torch path is torch's own grouped_mm here; the registered gradient op multiplies
    # in fp32: equal up to bf16 rounding)
    for got, want in ((cx.grad, eager_x.grad), (cw.grad, eager_w.grad)):
        assert got is not None and got.dtype == want.dtype and got.shape == want.shape
        err = float((got.float() - want.float()).abs().max())
        assert err <= 1e-2 * float(want.float().abs().max()), err
    assert dynamo["graph_break"] == {}


def test_compiled_fused_backward_follows_the_path_the_forward_took(dynamo) -> None:
    """fused_grouped_mm under torch.compile on a Hopper GPU: the kernel's forward has a raising
    backward, as in eager; with backend="torch" (torch's path on the GPU) the compiled graph's
    gradients of x, w, bias and row weights match eager autograd's."""
    from moe_gemm import fused_grouped_mm

    x, w, offs = _moe(9)
    g = _gen(10)
    S, N = x.shape[0], w.shape[2]
    bias = torch.randn(w.shape[0], N, generator=g).to(BF16).to(DEVICE)
    rw = torch.rand(S, generator=g).to(BF16).to(DEVICE)
    grad = torch.randn(S, N // 2, generator=g).to(BF16).to(DEVICE)

    def fn(config):
        return lambda x, w, b, r: fused_grouped_mm(x, w, offs, bias=b, row_weight=r,
                                                   gate="silu", config=config)

    wg = w.clone().requires_grad_()
    (y, ran) = _ran_kernels(lambda: torch.compile(fn(None), fullgraph=True)(x, wg, bias, rw))
    assert ran
    with pytest.raises(RuntimeError, match="inference-only"):
        y.backward(grad)

    torch_cfg = GemmConfig(backend="torch")
    eager = [t.clone().requires_grad_() for t in (x, w, bias, rw)]
    fn(torch_cfg)(*eager).backward(grad)
    compiled = [t.clone().requires_grad_() for t in (x, w, bias, rw)]
    traced = torch.compile(fn(torch_cfg), fullgraph=True, backend="aot_eager")
    (y, ran) = _ran_kernels(lambda: traced(*compiled))
    assert not ran
    y.backward(grad)
    # (eager's forward is torch's bf16 grouped_mm here, the gradient op's fp32: bf16 rounding)
    for got, want in zip((t.grad for t in compiled), (t.grad for t in eager)):
        assert got is not None and got.dtype == want.dtype and got.shape == want.shape
        err = float((got.float() - want.float()).abs().max())
        assert err <= 2e-2 * float(want.float().abs().max()), err
    assert dynamo["graph_break"] == {}


def test_compiled_out_calls_with_grad_run_our_kernels_as_eager(dynamo) -> None:
    """An `out=` call whose inputs require grad, compiled, on our kernels: the same values as
    eager (rows past offs[-1] keep out's), a result autograd tracks, and the kernels'
    inference-only backward raising as eagerly (never a gradient silently dropped)."""
    from moe_gemm import fused_grouped_mm

    x, w, offs = _moe(11)
    x = torch.cat([x, torch.randn(5, x.shape[1], generator=_gen(14)).to(BF16).to(DEVICE)])
    T, N = x.shape[0], w.shape[2]  # rows T-5.. past offs[-1]
    x3 = torch.randn(4, 64, 512, generator=_gen(12)).to(BF16).to(DEVICE)
    cases = [
        ("grouped_mm", lambda x, w: grouped_mm(
            x, w, offs, config=CFG, out=torch.full((T, N), 3.0, dtype=BF16, device=DEVICE)),
         (x, w)),
        ("grouped_mm 3-D", lambda x, w: grouped_mm(
            x, w[:4], config=CFG, out=torch.zeros(4, 64, N, dtype=BF16, device=DEVICE)),
         (x3, w)),
        ("fused_grouped_mm", lambda x, w: fused_grouped_mm(
            x, w, offs, gate="silu", config=CFG,
            out=torch.full((T, N // 2), 3.0, dtype=BF16, device=DEVICE)), (x, w)),
    ]
    for name, fn, inputs in cases:
        eager_in = [t.clone().requires_grad_() for t in inputs]
        want, ran = _ran_kernels(lambda: fn(*eager_in))
        assert ran or BACKEND == "torch", name
        compiled_in = [t.clone().requires_grad_() for t in inputs]
        got, ran = _ran_kernels(lambda: torch.compile(fn, fullgraph=True)(*compiled_in))
        assert ran or BACKEND == "torch", name
        assert got.requires_grad and want.requires_grad, name
        assert torch.equal(got, want), name
        if name != "grouped_mm 3-D":
            assert (got[T - 5:] == 3.0).all(), name
        if BACKEND != "torch":
            for y in (want, got):
                with pytest.raises(RuntimeError, match="inference-only"):
                    y.float().sum().backward()
    assert dynamo["graph_break"] == {}


def test_compiled_scaled_grouped_gemm_fills_an_fp32_out_as_eager(dynamo) -> None:
    """scaled_grouped_gemm(out=[fp32 ...]) compiled on our FP8 kernels: computed at out's
    dtype as eagerly (not rounded to bf16 first), bitwise equal to the eager call."""
    from moe_gemm import scaled_grouped_gemm
    from moe_gemm.testing_fp8 import make_fp8_grouped_inputs

    sizes = [(70, 256, 512), (0, 128, 256), (9, 128, 384)]
    a, b, sa, sb = make_fp8_grouped_inputs(sizes, "block", device=DEVICE, seed=13)

    def fn(*t):
        n = len(sizes)
        outs = [torch.zeros(m, nn, device=DEVICE) for m, nn, _ in sizes]
        return scaled_grouped_gemm(list(t[:n]), list(t[n:2 * n]), list(t[2 * n:3 * n]),
                                   list(t[3 * n:]), out=outs)

    want = fn(*a, *b, *sa, *sb)
    got = torch.compile(fn, fullgraph=True)(*a, *b, *sa, *sb)
    for g, r in zip(got, want):
        assert g.dtype == torch.float32
        assert torch.equal(g, r)
    assert dynamo["graph_break"] == {}
