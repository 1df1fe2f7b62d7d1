"""ops/custom_ops.py on the CPU: the torch.library registrations (opcheck: schema, fake
implementations, autograd registration, AOT dispatch), the config encoding, when the public
ops go through the registered ops (tracing, tensor modes, fake tensors) and when they do not
(eager), and torch.compile(fullgraph=True) of each op against eager."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import opcheck
from torch.utils._python_dispatch import TorchDispatchMode

import moe_gemm
from moe_gemm import GemmConfig, grouped_gemm, grouped_mm
from moe_gemm.ops import api, custom_ops
from moe_gemm.ops.custom_ops import decode_config, encode_config
from moe_gemm.testing import make_grouped_inputs, make_moe_inputs

OPS = torch.ops.moe_gemm


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _moe(seed: int, dtype=torch.float32, T=19, E=4, K=16, N=8):
    return make_moe_inputs(T, E, K, N, dtype, empty_fraction=0.25, generator=_gen(seed))


# ---------------------------------------------------------------------------------------------
# config across the schema


@pytest.mark.parametrize("config", [
    None,
    GemmConfig(),
    GemmConfig(backend="torch"),
    GemmConfig(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=1, cluster_n=2,
               stages=3, visitor="device", sort_by_k=False),
    GemmConfig(schedule="pingpong", tile_m=64, tile_n=256, visitor="host", sort_by_k=True),
])
def test_config_round_trip(config: GemmConfig | None) -> None:
    text = encode_config(config)
    assert isinstance(text, str)
    assert decode_config(text) == config
    assert (text == "") == (config is None)


def test_config_encoding_is_only_the_non_defaults() -> None:
    assert encode_config(GemmConfig()) == "{}"
    assert encode_config(GemmConfig(stages=4)) == "{'stages': 4}"


def test_bad_configs_are_clear_errors() -> None:
    with pytest.raises(TypeError, match="config must be a moe_gemm.GemmConfig or None"):
        encode_config("torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an encoded GemmConfig"):
        decode_config("[1, 2]")
    with pytest.raises(ValueError, match="schedule must be one of"):
        decode_config("{'schedule': 'zigzag'}")


# ---------------------------------------------------------------------------------------------
# opcheck


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_grouped_mm(dtype: torch.dtype) -> None:
    x, w, offs = _moe(1, dtype)
    opcheck(OPS._grouped_mm.default, (x, w, offs, "", None))
    opcheck(OPS._grouped_mm.default, (x, w, offs, "{'backend': 'torch'}", torch.float32))
    x3, w3 = torch.randn(3, 5, 16).to(dtype), torch.randn(3, 16, 8).to(dtype)
    opcheck(OPS._grouped_mm.default, (x3, w3, None, "", None))
    out = torch.full((x.shape[0], 8), 7.0, dtype=dtype)
    opcheck(OPS._grouped_mm_out.default, (x, w, offs, out, "", None))
    opcheck(OPS._grouped_mm_out.default, (x3, w3, None, torch.empty(3, 5, 8, dtype=dtype), "",
                                          None))


def test_opcheck_grouped_mm_with_grad_inputs() -> None:
    # On the CPU the ops run torch's path, whose backward (the AOT test runs one) is real.
    x, w, offs = _moe(2)
    opcheck(OPS._grouped_mm.default, (x.requires_grad_(), w.requires_grad_(), offs, "", None))
    x3, w3 = torch.randn(3, 5, 16), torch.randn(3, 16, 8)
    opcheck(OPS._grouped_mm.default, (x3.requires_grad_(), w3.requires_grad_(), None, "",
                                      torch.bfloat16))
    grad = torch.randn(x.shape[0], w.shape[2])
    opcheck(OPS._grouped_mm_grad.default, (grad, x.detach(), w.detach(), offs, "", None))
    opcheck(OPS._grouped_mm_grad.default, (torch.randn(3, 5, 8), x3.detach(), w3.detach(),
                                           None, "", torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck_grouped_gemm(dtype: torch.dtype) -> None:
    sizes = [(5, 8, 16), (0, 8, 16), (7, 24, 16), (3, 8, 0)]
    a, b = make_grouped_inputs(sizes, dtype, b_layout="mixed", generator=_gen(3))
    opcheck(OPS._grouped_gemm.default, (a, b, "", None))
    opcheck(OPS._grouped_gemm.default, (a, b, "", torch.float32))
    outs = [torch.full((m, n), 3.0, dtype=dtype) for m, n, _ in sizes]
    opcheck(OPS._grouped_gemm_out.default, (a, b, outs, "", None))
    opcheck(OPS._grouped_gemm.default, ([t.requires_grad_() for t in a], b, "", None))
    grads = [torch.randn(m, n, dtype=dtype) for m, n, _ in sizes]
    opcheck(OPS._grouped_gemm_grad.default, (grads, [t.detach() for t in a], b, "", None))


# ---------------------------------------------------------------------------------------------
# when the public ops go through the registered ops


class _SeenOps(TorchDispatchMode):
    """Records the ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_registered_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    routed: list[str] = []
    for name in ("grouped_mm", "grouped_gemm"):
        real = getattr(custom_ops, name)
        monkeypatch.setattr(custom_ops, name,
                            lambda *a, _n=name, _r=real, **k: routed.append(_n) or _r(*a, **k))
    x, w, offs = _moe(4)
    a, b = make_grouped_inputs([(3, 8, 16), (5, 8, 16)], torch.float32, generator=_gen(5))
    y, outs = grouped_mm(x, w, offs), grouped_gemm(a, b)
    assert routed == []
    # Under a tensor mode the same calls are the registered ops, which the mode sees.
    with _SeenOps() as mode:
        y_mode, outs_mode = grouped_mm(x, w, offs), grouped_gemm(a, b)
    assert routed == ["grouped_mm", "grouped_gemm"]
    assert "moe_gemm._grouped_mm.default" in mode.ops
    assert "moe_gemm._grouped_gemm.default" in mode.ops
    torch.testing.assert_close(y_mode, y, rtol=0, atol=0)
    for o, r in zip(outs_mode, outs):
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_fake_tensors_give_shapes_and_dtypes() -> None:
    with FakeTensorMode():
        x, w = torch.empty(37, 64, dtype=torch.bfloat16), torch.empty(6, 64, 24,
                                                                       dtype=torch.bfloat16)
        offs = torch.empty(6, dtype=torch.int32)
        y = grouped_mm(x, w, offs, out_dtype=torch.float32)
        y3 = grouped_mm(torch.empty(4, 5, 64, dtype=torch.bfloat16),
                        torch.empty(4, 64, 24, dtype=torch.bfloat16))
        outs = grouped_gemm([torch.empty(3, 64), torch.empty(0, 64)],
                            [torch.empty(64, 8), torch.empty(64, 16)])
        with pytest.raises(ValueError, match=r"so w must be \(E, 64, N\)"):
            grouped_mm(x, w[:, :32], offs)
        with pytest.raises(ValueError, match=r"problem 1: a\[1\] is \(M, K\)"):
            grouped_gemm([torch.empty(3, 64), torch.empty(2, 8)],
                         [torch.empty(64, 8), torch.empty(64, 16)])
    assert isinstance(y, FakeTensor) and y.shape == (37, 24) and y.dtype == torch.float32
    assert y3.shape == (4, 5, 24) and y3.dtype == torch.bfloat16
    assert [tuple(o.shape) for o in outs] == [(3, 8), (0, 16)]


def test_make_fx_records_the_ops() -> None:
    x, w, offs = _moe(6)
    a, b = make_grouped_inputs([(3, 8, 16), (5, 8, 16)], torch.float32, generator=_gen(7))

    def f(x, w, offs, a0, a1, b0, b1):
        return grouped_mm(x, w, offs), *grouped_gemm([a0, a1], [b0, b1])

    gm = make_fx(f, tracing_mode="fake")(x, w, offs, *a, *b)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"moe_gemm._grouped_mm.default", "moe_gemm._grouped_gemm.default"} <= targets
    got = gm(x, w, offs, *a, *b)
    want = f(x, w, offs, *a, *b)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_functionalized_tensors_go_through_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.func.functionalize wraps tensors without a tensor mode: the op must still be the
    # one that runs (a wrapper has no data pointer of its own).
    routed: list[str] = []
    real = custom_ops.grouped_mm
    monkeypatch.setattr(custom_ops, "grouped_mm",
                        lambda *a, **k: routed.append("grouped_mm") or real(*a, **k))
    x, w, offs = _moe(11)

    def f(x, w, offs):
        return grouped_mm(x, w, offs) * 2

    torch.testing.assert_close(torch.func.functionalize(f)(x, w, offs), f(x, w, offs),
                               rtol=0, atol=0)
    assert routed == ["grouped_mm"]


# ---------------------------------------------------------------------------------------------
# torch.compile of the ops


@pytest.fixture
def dynamo():
    """A fresh torch._dynamo with its graph-break counters cleared."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_compile_grouped_mm_fullgraph(dynamo) -> None:
    x, w, offs = _moe(8)
    cfg = GemmConfig(backend="torch")

    def f(x, w, offs, out):
        y = grouped_mm(x, w, offs, config=cfg)
        grouped_mm(x, w, offs, out=out)  # the mutating op
        return y * 2, grouped_mm(x[: 12].view(3, 4, 16), w[:3])

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)
    out_c, out_e = torch.full((x.shape[0], 8), 5.0), torch.full((x.shape[0], 8), 5.0)
    got, want = compiled(x, w, offs, out_c), f(x, w, offs, out_e)
    for g, r in zip((*got, out_c), (*want, out_e)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert dynamo["graph_break"] == {}
    # New offs values, same shapes: no recompile, new rows.
    offs2 = torch.tensor([0, 10, 10, 19], dtype=torch.int32)
    torch.testing.assert_close(compiled(x, w, offs2, out_c)[0], f(x, w, offs2, out_e)[0],
                               rtol=0, atol=0)
    assert dynamo["stats"]["unique_graphs"] == 1


def test_compile_grouped_gemm_fullgraph(dynamo) -> None:
    sizes = [(5, 8, 16), (0, 8, 16), (7, 24, 16)]
    a, b = make_grouped_inputs(sizes, torch.float32, generator=_gen(9))

    def f(a0, a1, a2, b0, b1, b2):
        outs = grouped_gemm([a0, a1, a2], [b0, b1, b2], out_dtype=torch.float16)
        return [o + 1 for o in outs]

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*a, *b)
    want = f(*a, *b)
    assert [o.dtype for o in got] == [torch.float16] * 3
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert dynamo["graph_break"] == {}


def test_compile_a_plan_call_fullgraph(dynamo) -> None:
    # A GroupedGemmPlan called inside a compiled function: the registered op on the plan's
    # tensors, writing its outputs, with new values copied into its operands each call.
    sizes = [(5, 8, 16), (0, 8, 16), (7, 24, 16)]
    a, b = make_grouped_inputs(sizes, torch.float32, generator=_gen(12))
    plan = moe_gemm.GroupedGemmPlan(a, b, config=GemmConfig(backend="torch"))

    def f(x):
        a[0].copy_(x)
        outs = plan()
        return [o * 2 for o in outs]

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for seed in (13, 14):
        x = torch.randn(5, 16, generator=_gen(seed))
        got = compiled(x)
        want = [(ai.double() @ bi.double()).float() * 2 for ai, bi in zip(a, b)]
        assert torch.equal(a[0], x)
        for g, r, o in zip(got, want, plan.out):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(o * 2, g, rtol=0, atol=0)  # the plan's outputs written
    assert dynamo["graph_break"] == {}
    assert dynamo["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("fullgraph", [False, True])
def test_compiled_plan_refuses_an_operand_resized_since_its_build(dynamo, fullgraph) -> None:
    a, b = make_grouped_inputs([(5, 8, 16), (7, 4, 16)], torch.float32, generator=_gen(15))
    plan = moe_gemm.GroupedGemmPlan(a, b, config=GemmConfig(backend="torch"))
    compiled = torch.compile(lambda: plan(), fullgraph=fullgraph, backend="aot_eager")
    compiled()
    a[1].resize_(6, 16)
    # (with fullgraph, torch.compile reports a raise inside the graph as its own error, whose
    # message carries the ValueError's)
    with pytest.raises(Exception, match=r"built for a\[1\] of shape \(7, 16\)") as err:
        compiled()
    assert fullgraph or err.type is ValueError


def test_compiled_plan_with_an_out_that_aliases_an_operand(dynamo) -> None:
    # out[0] is a[0]'s memory: the plan computes into a private tensor, then copies.
    a, b = make_grouped_inputs([(4, 4, 4), (3, 8, 4)], torch.float32, generator=_gen(16))
    want = [(ai.double() @ bi.double()).float() for ai, bi in zip(a, b)]
    out = [a[0], torch.empty(3, 8)]
    plan = moe_gemm.GroupedGemmPlan(a, b, out=out, config=GemmConfig(backend="torch"))
    got = torch.compile(lambda: plan(), fullgraph=True, backend="aot_eager")()
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[0], want[0], rtol=1e-5, atol=1e-5)
    assert dynamo["graph_break"] == {}


def test_compiled_plan_backward_equals_eager(dynamo) -> None:
    sizes = [(5, 8, 16), (7, 24, 16)]
    a, b = make_grouped_inputs(sizes, torch.float32, generator=_gen(17))
    a = [t.requires_grad_() for t in a]
    plan = moe_gemm.GroupedGemmPlan(a, b, config=GemmConfig(backend="torch"))
    r = [torch.randn(m, n, generator=_gen(18 + i)) for i, (m, n, _) in enumerate(sizes)]

    def loss(fn):
        return sum((o * ri).sum() for o, ri in zip(fn(), r))

    want = torch.autograd.grad(loss(plan), a)
    got = torch.autograd.grad(loss(torch.compile(lambda: plan(), fullgraph=True,
                                                 backend="aot_eager")), a)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert dynamo["graph_break"] == {}


def _grads(fn, inputs, seed):
    """fn(*inputs) and the gradients of <fn(*inputs), r> for a fresh random r."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, (list, tuple)) else [out]
    gen = _gen(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    want = [t for t in leaves if t.requires_grad]
    return outs, torch.autograd.grad(loss, want)


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.bfloat16, torch.float32)])
def test_compiled_backward_on_the_torch_path_equals_eager(dynamo, dtype, out_dtype) -> None:
    """On the CPU (and wherever backend="torch" runs) the registered ops are differentiable:
    a compiled graph's gradients are eager autograd's through the torch path, and match an
    fp64 reference; rows past offs[-1] and empty experts get zero gradients."""
    x, w, offs = _moe(21, dtype)
    x3, w3 = torch.randn(3, 5, 16).to(dtype), torch.randn(3, 16, 8).to(dtype)
    sizes = [(5, 8, 16), (0, 8, 16), (7, 24, 16), (3, 8, 0)]
    a, b = make_grouped_inputs(sizes, dtype, b_layout="mixed", generator=_gen(22))

    cases = [
        (lambda x, w: grouped_mm(x, w, offs, out_dtype=out_dtype), (x, w)),
        (lambda x, w: grouped_mm(x, w, out_dtype=out_dtype), (x3, w3)),
        (lambda *t: grouped_gemm(list(t[:4]), list(t[4:]), out_dtype=out_dtype), (*a, *b)),
        (lambda x, w: grouped_mm(x, w, offs, config=GemmConfig(backend="torch")), (x, w)),
    ]
    for i, (fn, inputs) in enumerate(cases):
        outs, grads = _grads(fn, inputs, 30 + i)
        c_outs, c_grads = _grads(torch.compile(fn, fullgraph=True, backend="aot_eager"),
                                 inputs, 30 + i)
        for o, c in zip(outs, c_outs):
            torch.testing.assert_close(c, o, rtol=0, atol=0)
        for g, c in zip(grads, c_grads):
            assert c.dtype == g.dtype
            torch.testing.assert_close(c, g, rtol=0, atol=0)
    assert dynamo["graph_break"] == {}
    # against fp64, the varlen form
    _, (gx, gw) = _grads(cases[0][0], (x, w), 30)
    gen = _gen(30)
    r = torch.randn(x.shape[0], w.shape[2], generator=gen).double()
    end = int(offs[-1])
    rx, rw = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(w.shape, dtype=torch.float64)
    start = 0
    for e, stop in enumerate(offs.tolist()):
        rx[start:stop] = r[start:stop] @ w[e].double().t()
        rw[e] = x[start:stop].double().t() @ r[start:stop]
        start = stop
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gx.double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(gw.double(), rw, rtol=tol, atol=tol)
    assert not gx[end:].any()


def test_backward_follows_the_path_the_forward_took(monkeypatch) -> None:
    """The registered backward computes gradients where the forward ran torch's path and
    raises where it ran the Hopper kernels, decided as the eager call decides: from the config
    (backend="torch" / "cute"), the device, and at run time from the inputs themselves (an
    input the kernels do not take ran torch's path on a Hopper GPU too)."""
    x, w, offs = _moe(23, torch.bfloat16)
    grad = torch.randn(x.shape[0], w.shape[2]).to(torch.bfloat16)
    a, b = make_grouped_inputs([(5, 8, 16), (3, 16, 16)], torch.bfloat16, generator=_gen(24))
    grads = [torch.randn(5, 8).to(torch.bfloat16), torch.randn(3, 16).to(torch.bfloat16)]
    cute_cfg = encode_config(GemmConfig(backend="cute"))
    torch_cfg = encode_config(GemmConfig(backend="torch"))
    assert custom_ops._pinned_cute(cute_cfg)
    assert not custom_ops._pinned_cute("") and not custom_ops._pinned_cute(torch_cfg)

    def mm_grad(x, config=""):
        return OPS._grouped_mm_grad(grad, x, w, offs, config, None)

    def gemm_grad(a, config=""):
        return OPS._grouped_gemm_grad(grads, a, b, config, None)

    # Here (no Hopper GPU): torch's path, real gradients, equal to eager autograd's.
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    grouped_mm(xg, wg, offs).backward(grad)
    gx, gw = mm_grad(x)
    torch.testing.assert_close(gx, xg.grad, rtol=0, atol=0)
    torch.testing.assert_close(gw, wg.grad, rtol=0, atol=0)
    assert len(gemm_grad(a)) == 4
    # Where the kernels can run: they ran for these inputs, so the gradient ops raise ...
    monkeypatch.setattr(api, "cute_problem", lambda device: None)
    with pytest.raises(RuntimeError, match="inference-only"):
        mm_grad(x)
    with pytest.raises(RuntimeError, match="inference-only"):
        OPS._grouped_mm_grad(torch.randn(3, 5, 8).to(torch.bfloat16),
                             torch.randn(3, 5, 16).to(torch.bfloat16),
                             torch.randn(3, 16, 8).to(torch.bfloat16), None, "", None)
    with pytest.raises(RuntimeError, match="inference-only"):
        gemm_grad(a)
    # ... but not for inputs the kernels do not take (x column-major; a problem's B with no
    # unit stride), nor with backend="torch".
    x_cols = x.t().contiguous().t()
    assert api.grouped_mm_runs_torch(x_cols, w, offs, None, None)
    torch.testing.assert_close(mm_grad(x_cols)[0], gx, rtol=0, atol=0)
    torch.testing.assert_close(mm_grad(x, torch_cfg)[0], gx, rtol=0, atol=0)
    strided = [a[0], a[1]], [b[0], torch.randn(16, 32).to(torch.bfloat16)[:, ::2]]
    assert api.grouped_gemm_runs_torch(*strided, None, None)
    assert len(OPS._grouped_gemm_grad(grads, *strided, "", None)) == 4
    assert api.grouped_gemm_runs_torch(a, b, GemmConfig(backend="torch"), None)

    # backend="cute": the backward raises without looking at the inputs.
    class Ctx:
        needs_input_grad = (True, True, False, False, False)
        kernels_only = True
        metas = ((x.shape, x.dtype), (w.shape, w.dtype))

    with pytest.raises(RuntimeError, match="inference-only"):
        custom_ops._mm_backward(Ctx(), grad)


def test_out_is_differentiable_when_traced_as_in_eager(dynamo) -> None:
    """An `out=` call whose inputs require grad: the eager result is differentiable (written
    in place); compiled, it must be too (the functional op, copied into out: rows past
    offs[-1] keep out's values), never a result with the gradient silently dropped."""
    x, w, _ = _moe(41)
    offs = torch.tensor([3, 3, 10, 15], dtype=torch.int32)  # rows 15-18 past the end
    x3, w3 = torch.randn(3, 5, 16), torch.randn(3, 16, 8)
    sizes = [(5, 8, 16), (0, 8, 16), (7, 24, 16)]
    a, b = make_grouped_inputs(sizes, torch.float32, generator=_gen(42))
    T = x.shape[0]
    cases = [
        (lambda x, w: grouped_mm(x, w, offs, out=torch.full((T, 8), 3.0)), (x, w)),
        (lambda x, w: grouped_mm(x, w, out=torch.zeros(3, 5, 8)), (x3, w3)),
        (lambda *t: grouped_gemm(list(t[:3]), list(t[3:]),
                                 out=[torch.zeros(m, n) for m, n, _ in sizes]), (*a, *b)),
        (lambda x, w: moe_gemm.fused_grouped_mm(x, w, offs, gate="silu",
                                                out=torch.full((T, 4), 3.0)), (x, w)),
    ]
    for i, (fn, inputs) in enumerate(cases):
        outs, grads = _grads(fn, inputs, 50 + i)
        c_outs, c_grads = _grads(torch.compile(fn, fullgraph=True, backend="aot_eager"),
                                 inputs, 50 + i)
        assert all(c.requires_grad for c in c_outs)
        for o, c in zip(outs, c_outs):
            torch.testing.assert_close(c, o, rtol=0, atol=0)
        for g, c in zip(grads, c_grads):
            torch.testing.assert_close(c, g, rtol=1e-6, atol=1e-6)
    y = torch.compile(cases[0][0], fullgraph=True, backend="aot_eager")(x, w)
    assert (y[15:] == 3.0).all()  # rows past offs[-1] kept
    assert dynamo["graph_break"] == {}


_BAD_TYPES = {
    "offs-list": lambda x, w, offs: grouped_mm(x, w, [2, 4]),
    "out_dtype-str": lambda x, w, offs: grouped_mm(x, w, offs, out_dtype="float32"),
    "gate_alpha-str": lambda x, w, offs: moe_gemm.fused_grouped_mm(x, w, offs, gate="silu",
                                                                   gate_alpha="1.7"),
    "bias-list": lambda x, w, offs: moe_gemm.fused_grouped_mm(x, w, offs, bias=[1.0, 2.0]),
    "expected_m-bool": lambda x, w, offs: moe_gemm.grouped_mm_masked(
        torch.randn(2, 4, 8), w, offs, expected_m=True),
    "a-None": lambda x, w, offs: grouped_gemm([x, None], [w[0], w[1]]),
    "gate-int": lambda x, w, offs: moe_gemm.fused_grouped_mm(x, w, offs, gate=1),
    "gate-int-masked": lambda x, w, offs: moe_gemm.fused_grouped_mm_masked(
        torch.randn(2, 4, 8), w, offs, gate=1),
}


@pytest.mark.parametrize("case", list(_BAD_TYPES))
def test_traced_calls_refuse_bad_argument_types_as_eager(case) -> None:
    # Traced, the op's schema would refuse these with torch's message, or coerce them (a
    # str gate_alpha through float(), a bool expected_m as an int).
    from torch.utils.flop_counter import FlopCounterMode

    args = torch.randn(4, 8), torch.randn(2, 8, 16), torch.tensor([2, 4], dtype=torch.int32)
    name = case.split("-")[0]
    with pytest.raises(TypeError, match=name):
        _BAD_TYPES[case](*args)
    with FlopCounterMode(display=False), pytest.raises(TypeError, match=name):
        _BAD_TYPES[case](*args)


def test_traced_calls_refuse_an_unknown_gate_layout_as_eager() -> None:
    # (a non-str would meet the op schema's RuntimeError)
    from torch.utils.flop_counter import FlopCounterMode

    x, w, offs = torch.randn(4, 8), torch.randn(2, 8, 16), torch.tensor([2, 4], dtype=torch.int32)
    calls = (lambda: moe_gemm.fused_grouped_mm(x, w, offs, gate="silu", gate_layout=1),
             lambda: moe_gemm.fused_grouped_mm_masked(torch.randn(2, 4, 8), w, offs,
                                                      gate="silu", gate_layout=1))
    for call in calls:
        with pytest.raises(ValueError, match="gate_layout must be one of"):
            call()
        with FlopCounterMode(display=False), pytest.raises(ValueError,
                                                           match="gate_layout must be one of"):
            call()


def test_traced_out_checks_as_eager() -> None:
    """Under any tensor mode (the traced path), an `out` autograd tracks is refused, as
    eagerly, for every op that takes `out`; a differentiable call checks out's dtype and shape."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w, offs = _moe(43)
    tracked = torch.zeros(x.shape[0], 8, requires_grad=True)
    calls = [
        lambda: grouped_mm(x, w, offs, out=tracked),
        lambda: moe_gemm.fused_grouped_mm(x, w, offs, out=tracked),
        lambda: moe_gemm.grouped_mm_masked(torch.randn(2, 4, 16), torch.randn(2, 16, 8),
                                           torch.tensor([4, 1], dtype=torch.int32),
                                           out=torch.zeros(2, 4, 8, requires_grad=True)),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="out requires grad"):
            call()  # eager
        with FlopCounterMode(display=False), pytest.raises(ValueError, match="out requires grad"):
            call()  # traced
    xg = x.clone().requires_grad_()
    with FlopCounterMode(display=False):
        with pytest.raises(TypeError, match="out_dtype"):  # (TypeError: as eager)
            grouped_mm(xg, w, offs, out=torch.zeros(x.shape[0], 8), out_dtype=torch.float16)
        with pytest.raises(ValueError, match=r"out must be \(19, 8\)"):
            grouped_mm(xg, w, offs, out=torch.zeros(x.shape[0] + 1, 8))
        with pytest.raises(ValueError, match="one out per problem"):
            grouped_gemm([xg[:3], xg[3:5]], [w[0], w[1]], out=[torch.zeros(3, 8)])
        with pytest.raises(TypeError, match=r"out\[1\] must have dtype torch.float32"):
            grouped_gemm([xg[:3], xg[3:5]], [w[0], w[1]],
                         out=[torch.zeros(3, 8), torch.zeros(2, 8, dtype=torch.float64)])


def test_traced_out_dtype_mismatch_is_a_type_error_as_eager() -> None:
    """out of one dtype and out_dtype of another: the TypeError the eager call raises (the
    documented error for mismatched dtypes), also on a differentiable traced call."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w, offs = _moe(44)
    xg = x.clone().requires_grad_()
    out = torch.zeros(x.shape[0], 8)
    calls = [
        lambda: grouped_mm(xg, w, offs, out=out, out_dtype=torch.bfloat16),
        lambda: grouped_gemm([xg[:3]], [w[0]], out=[out[:3]], out_dtype=torch.bfloat16),
        lambda: moe_gemm.fused_grouped_mm(xg, w, offs, out=out, out_dtype=torch.bfloat16),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="must have dtype torch.bfloat16"):
            call()  # eager
        with FlopCounterMode(display=False), pytest.raises(TypeError,
                                                           match="must have dtype torch.bfloat16"):
            call()  # traced


@pytest.mark.parametrize("offs", [[5, 2, 8, 11], [-3, 4, 4, 30], [6, 6, 1, 9]],
                         ids=["decreasing", "out_of_range", "decreasing_late"])
def test_traced_backward_reads_unchecked_offs_as_the_forward(offs, monkeypatch) -> None:
    """offs values on the GPU are not checked: the forward clamps them into [0, T] and takes a
    decreasing entry as an empty expert. The registered op's backward must give each expert
    the rows the forward gave it (the CPU's check turned off, as on the GPU)."""
    from torch.utils.flop_counter import FlopCounterMode

    from moe_gemm.ops import validation

    monkeypatch.setattr(validation, "check_offs_values", lambda offs, T: None)
    x, w, _ = _moe(45, T=12, E=4)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    r = torch.randn(12, 8, generator=_gen(46))

    def grads(traced):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        with FlopCounterMode(display=False) if traced else contextlib.nullcontext():
            y = grouped_mm(xl, wl, offs_t)
        return (y,) + torch.autograd.grad((y * r).sum(), (xl, wl))

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_inference_only_mark() -> None:
    """The traced MoE layers' mark: a copy of y whose backward raises the given message."""
    opcheck(OPS._inference_only.default, (torch.randn(4, 3), "msg"))
    y = torch.randn(4, 3, requires_grad=True)
    z = custom_ops.mark_inference_only(y, "no training here")
    torch.testing.assert_close(z, y, rtol=0, atol=0)
    assert z.data_ptr() != y.data_ptr()
    with pytest.raises(RuntimeError, match="no training here"):
        z.sum().backward()


def test_flop_counter_counts_the_registered_ops() -> None:
    """FlopCounterMode sees the registered ops (the public ops take them under any tensor
    mode): 2 x rows x K x N forward, twice that for the gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w, offs = _moe(24)
    T, K, N = x.shape[0], x.shape[1], w.shape[2]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with FlopCounterMode(display=False) as counter:
        y = grouped_mm(xg, wg, offs)
    assert counter.get_total_flops() == 2 * T * K * N
    with FlopCounterMode(display=False) as counter:
        grouped_mm(xg, wg, offs, config=GemmConfig(backend="torch")).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * T * K * N
    assert xg.grad is not None and wg.grad is not None
    torch.testing.assert_close(y, grouped_mm(x, w, offs), rtol=0, atol=0)
    sizes = [(5, 8, 16), (0, 8, 16), (7, 24, 16)]
    a, b = make_grouped_inputs(sizes, torch.float32, generator=_gen(25))
    with FlopCounterMode(display=False) as counter:
        grouped_gemm(a, b)
    assert counter.get_total_flops() == sum(2 * m * n * k for m, n, k in sizes)
    # The fused op (the gathered rows), the masked ops (every (G, M) row) and the FP8 ops.
    index = torch.randint(0, T, (23,), generator=_gen(26))
    offs23 = torch.tensor([5, 5, 17, 23], dtype=torch.int32)
    xg.grad = wg.grad = None
    with FlopCounterMode(display=False) as counter:
        moe_gemm.fused_grouped_mm(xg, wg, offs23, row_index=index, gate="silu").sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 23 * K * N
    xm = torch.randn(4, 6, K)
    counts = torch.tensor([6, 0, 2, 1], dtype=torch.int32)
    with FlopCounterMode(display=False) as counter:
        moe_gemm.grouped_mm_masked(xm, w, counts)
        moe_gemm.fused_grouped_mm_masked(xm, w, counts, gate="silu")
    assert counter.get_total_flops() == 2 * 2 * 4 * 6 * K * N
    from moe_gemm.testing_fp8 import make_fp8_grouped_inputs, make_fp8_moe_inputs

    xq, wq, sa, sb, offq = make_fp8_moe_inputs(19, 4, 256, 24, "block", seed=27)
    fa, fb, fsa, fsb = make_fp8_grouped_inputs([(4, 16, 128), (3, 32, 128)], "row", seed=28)
    with FlopCounterMode(display=False) as counter:
        moe_gemm.scaled_grouped_mm(xq, wq, sa, sb, offq)
        moe_gemm.scaled_grouped_gemm(fa, fb, fsa, fsb)
    assert counter.get_total_flops() == 2 * 19 * 256 * 24 + 2 * (4 * 16 + 3 * 32) * 128


def test_flop_counter_counts_a_first_use_inside_it() -> None:
    """`import moe_gemm` loads the ops at the first use of a public name; a FlopCounterMode
    entered before that (it copies torch's formula registry when made) still counts them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch, moe_gemm\n"
        "from torch.utils.flop_counter import FlopCounterMode\n"
        "x, w = torch.randn(6, 8), torch.randn(2, 8, 4)\n"
        "offs = torch.tensor([2, 6], dtype=torch.int32)\n"
        "with FlopCounterMode(display=False) as counter:\n"
        "    moe_gemm.grouped_mm(x, w, offs)\n"
        "print(counter.get_total_flops())\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == str(2 * 6 * 8 * 4)


def test_public_names_unchanged() -> None:
    for name in ("grouped_gemm", "grouped_mm", "GroupedGemmPlan", "GemmConfig", "MoE",
                 "moe_experts", "moe_forward", "permute_by_expert", "softmax_topk",
                 "sigmoid_grouped_topk", "ExpertPermutation"):
        assert hasattr(moe_gemm, name), name
    assert moe_gemm.grouped_mm is api.grouped_mm and moe_gemm.grouped_gemm is api.grouped_gemm


def test_a_wrapper_refusal_under_fullgraph_carries_our_message_as_its_cause() -> None:
    """docs/USAGE.md: an argument the Python function refuses before any op runs stops a
    fullgraph trace with torch's Unsupported, our error as its cause; without fullgraph, our
    error itself. A required tensor argument is not offered None in the message."""
    import torch._dynamo

    x, w, offs = _moe(45)

    def bad_gate(x):
        return moe_gemm.fused_grouped_mm(x, w, offs, gate="relu")

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(bad_gate, fullgraph=True, backend="eager")(x)
    assert "gate must be one of" in str(info.value.__cause__)
    with pytest.raises(ValueError, match="gate must be one of"):
        torch.compile(bad_gate, backend="eager")(x)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False), pytest.raises(
            TypeError, match="^x must be a torch.Tensor; got list"):
        grouped_mm([x], w, offs)
