"""GroupedGemmPlan: grouped_gemm prepared once, recomputed from the tensors' current values."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig, GroupedGemmPlan
from moe_gemm.testing import assert_close_to_ref


def _problems(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [(5, 24, 16), (0, 8, 16), (130, 8, 72), (1, 40, 0), (33, 16, 8)]
    a = [torch.randn(m, k, generator=g).to(dtype) for m, _, k in sizes]
    b = [torch.randn(k, n, generator=g).to(dtype) for _, n, k in sizes]
    return a, b


def _check_all(outs, a, b):
    for o, ai, bi in zip(outs, a, b):
        ref = ai.double() @ bi.double()
        low = ai @ bi if ai.shape[1] else torch.zeros_like(ref).to(ai.dtype)
        assert_close_to_ref(o, ref, low)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_plan_recomputes_from_current_values(dtype) -> None:
    a, b = _problems(dtype)
    plan = GroupedGemmPlan(a, b)
    first = [o.clone() for o in plan()]
    _check_all(first, a, b)
    g = torch.Generator().manual_seed(9)
    for t in (*a, *b):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    second = plan()
    assert all(o is p for o, p in zip(second, plan.out))  # the same buffers every call
    _check_all(second, a, b)
    assert not all(torch.equal(x, y) for x, y in zip(first, second) if x.numel())


def test_plan_matches_grouped_gemm_and_honours_out_and_dtype() -> None:
    a, b = _problems()
    outs = [torch.full((ai.shape[0], bi.shape[1]), float("nan")) for ai, bi in zip(a, b)]
    plan = GroupedGemmPlan(a, b, out=outs)
    res = plan()
    assert all(r is o for r, o in zip(res, outs))
    want = moe_gemm.grouped_gemm(a, b, out_dtype=torch.float32)
    for r, w in zip(res, want):
        torch.testing.assert_close(r, w)
    plan16 = GroupedGemmPlan(a, b, out_dtype=torch.float16)
    assert all(o.dtype == torch.float16 for o in plan16())


def test_plan_errors_and_empty() -> None:
    a, b = _problems()
    with pytest.raises(ValueError, match=r"problem 0: a\[0\] is \(M, K\)"):
        GroupedGemmPlan([a[0]], [b[2]])
    with pytest.raises(TypeError, match="config must be a moe_gemm.GemmConfig"):
        GroupedGemmPlan(a, b, config="torch")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="backend='cute' cannot run here"):
        GroupedGemmPlan(a, b, config=GemmConfig(backend="cute"))
    assert GroupedGemmPlan([], [])() == []


def test_plan_backward_raises_on_the_cute_path_only() -> None:
    # On this CPU machine the plan runs the torch backend, which is differentiable.
    a, b = _problems(torch.float32)
    b = [t.requires_grad_() for t in b]
    outs = GroupedGemmPlan(a, b)()
    assert GroupedGemmPlan(a, b).backend == "torch"
    assert all(o.numel() == 0 or o.requires_grad for o in outs)


# ---------------------------------------------------------------------------------------------
# A call checks that the tensors it was given still have the build's shapes, strides, dtypes
# and devices (a plan is bound to them: the kernel reads the build's sizes and addresses, and
# the torch backend broadcast a shrunk operand into its output, a wrong answer, no error).
# (torch refuses an in-place move to another device: `.data =` needs the same tensor type.)


def _shrink_rows(t):
    t.resize_(1, t.shape[1])


def _other_dtype(t):
    t.data = t.double()


def _wider(t):
    t.resize_(t.shape[0], t.shape[1] + 8)


def _k_major(t):
    t.set_(t.t().contiguous().t())  # the same shape and values, other strides


CHANGES = [("a", 0, _shrink_rows, r"a\[0\] of shape \(5, 16\) \(strides \(16, 1\)\), "
            r"torch\.bfloat16 on cpu; it is now of shape \(1, 16\)"),
           ("a", 2, _other_dtype, r"a\[2\] of .*torch\.bfloat16 on cpu; it is now .*torch\.float64"),
           ("b", 0, _wider, r"b\[0\] of shape \(16, 24\) .* now of shape \(16, 32\)"),
           ("b", 2, _k_major, r"b\[2\] of shape \(72, 8\) \(strides \(8, 1\)\).* it is now of "
            r"shape \(72, 8\) \(strides \(1, 72\)\)"),
           ("out", 4, _shrink_rows, r"out\[4\] of shape \(33, 16\) .* now of shape \(1, 16\)")]


def _plan_with_out(a, b):
    out = [torch.zeros(ai.shape[0], bi.shape[1], dtype=ai.dtype) for ai, bi in zip(a, b)]
    return GroupedGemmPlan(a, b, out=out), out


@pytest.mark.parametrize("which,i,change,message", CHANGES,
                         ids=[f"{w}{i}-{c.__name__}" for w, i, c, _ in CHANGES])
def test_a_call_refuses_tensors_changed_since_the_build(which, i, change, message) -> None:
    a, b = _problems(seed=11)
    plan, out = _plan_with_out(a, b)
    assert plan.backend == "torch"
    _check_all(plan(), a, b)
    change({"a": a, "b": b, "out": out}[which][i])
    with pytest.raises(ValueError, match=r"^GroupedGemmPlan was built for " + message):
        plan()


def test_a_call_refuses_its_own_outputs_changed_since_the_build() -> None:
    # The outputs a plan allocated are handed out by every call: one resized (a new
    # allocation) would otherwise be written at its old address on the Hopper path.
    a, b = _problems(seed=15)
    plan = GroupedGemmPlan(a, b)
    plan()[2].resize_(200, 8)
    with pytest.raises(ValueError, match=r"^GroupedGemmPlan was built for out\[2\] of shape "
                       r"\(130, 8\) .* now of shape \(200, 8\)"):
        plan()


def test_a_call_with_grad_refuses_its_own_output_made_to_require_grad() -> None:
    a, b = _problems(torch.float32, seed=17)
    plan = GroupedGemmPlan(a, b)
    plan.out[0].requires_grad_()
    with pytest.raises(ValueError, match=r"out\[0\]"):
        plan()
    with torch.no_grad():
        _check_all(plan(), a, b)


def _resize_a4(plan, a):
    a[4].resize_(40, 8)  # more rows: a new allocation, which the launch's addresses miss


def _resize_own_out0(plan, a):
    plan.out[0].resize_(64, 24)  # the plan's own output: the launch would write the old address


@pytest.mark.parametrize("given_out,change,message", [
    (True, _resize_a4, r"built for a\[4\] of shape \(33, 8\)"),
    (False, _resize_own_out0, r"built for out\[0\] of shape \(5, 24\)"),
], ids=["operand", "own-output"])
def test_the_hopper_path_refuses_them_before_its_launch(kernel, monkeypatch, given_out, change,
                                                        message) -> None:
    from moe_gemm.ops import api

    monkeypatch.setattr(api, "cute_problem", lambda device=None: None)
    a, b = _problems(seed=12)
    plan = _plan_with_out(a, b)[0] if given_out else GroupedGemmPlan(a, b)
    assert plan.backend == "cute"
    plan()
    assert len(kernel.calls) == 1
    change(plan, a)
    with pytest.raises(ValueError, match=message):
        plan()
    assert len(kernel.calls) == 1


def test_autograd_flags_may_change_between_calls() -> None:
    # requires_grad_ after the build changes the signature, not the plan: the call goes on
    # (differentiable on the torch backend) and later calls take the fast check again.
    a, b = _problems(torch.float32, seed=13)
    plan = GroupedGemmPlan(a, b)
    plan()
    b[0].requires_grad_()
    outs = plan()
    assert outs[0].requires_grad
    outs[0].sum().backward()
    ref = a[0].double().sum(0, keepdim=True).T.expand(-1, b[0].shape[1])
    torch.testing.assert_close(b[0].grad.double(), ref)
    g = torch.Generator().manual_seed(14)
    for t in a:
        t.copy_(torch.randn(t.shape, generator=g))
    _check_all(plan(), a, [t.detach() for t in b])


def test_the_hopper_path_follows_autograd_flags_changed_between_calls(kernel,
                                                                      monkeypatch) -> None:
    # The plan keeps whether an operand requires grad beside its signature (which holds the
    # flags): a flag changed after the build fails the signature once, and each call after it
    # links its results to autograd (backward raising) exactly while an operand requires grad.
    from moe_gemm.ops import api

    monkeypatch.setattr(api, "cute_problem", lambda device=None: None)
    a, b = _problems(seed=16)
    plan = GroupedGemmPlan(a, b)
    assert plan.backend == "cute"
    assert not any(o.requires_grad for o in plan())
    b[2].requires_grad_()
    for _ in range(2):
        outs = plan()
        assert all(o.requires_grad for o in outs)
        with pytest.raises(RuntimeError, match="backward"):
            outs[0].sum().backward()
    with torch.no_grad():
        assert not any(o.requires_grad for o in plan())
    b[2].requires_grad_(False)
    assert not any(o.requires_grad for o in plan())
    assert len(kernel.calls) == 5


def _compiled(plan):
    return torch.compile(lambda: plan(), fullgraph=True, backend="aot_eager")


def _flop_counted(plan):
    from torch.utils.flop_counter import FlopCounterMode

    def call():
        with FlopCounterMode(display=False):
            return plan()
    return call


@pytest.mark.parametrize("wrap", [_compiled, _flop_counted], ids=["compiled", "tensor_mode"])
def test_traced_calls_with_grad_operands_can_be_repeated(wrap) -> None:
    # Every call is differentiable, as eager calls are: the traced call's results are fresh
    # tensors and the plan's outputs take their values without joining the graph (written by
    # the registered op, they required grad and the second call refused them).
    import torch._dynamo

    torch._dynamo.reset()
    a, b = _problems(torch.float32, seed=15)
    b = [t.requires_grad_() for t in b]
    plan = GroupedGemmPlan(a, b, config=GemmConfig(backend="torch"))
    call = wrap(plan)
    for step in (1, 2, 3):
        outs = call()
        assert not any(o.requires_grad for o in plan.out)
        for o, r in zip(plan.out, outs):
            torch.testing.assert_close(o, r.detach(), rtol=0, atol=0)
        _check_all(plan.out, a, [t.detach() for t in b])
        sum(o.sum() for o in outs).backward()
        want = a[0].double().sum(0, keepdim=True).T.expand(-1, b[0].shape[1]) * step
        torch.testing.assert_close(b[0].grad.double(), want)
    torch._dynamo.reset()


def test_a_plan_built_under_inference_mode_serves_calls_outside_it() -> None:
    # Its own outputs (and the private ones of an aliased out) are normal tensors: built as
    # inference tensors, a call outside inference mode could not write them.
    a, b = _problems(torch.float32, seed=3)
    with torch.inference_mode():
        plan = GroupedGemmPlan(a, b)
        aliased = GroupedGemmPlan(a[:1], b[:1], out=[b[0][:a[0].shape[0]]])
        _check_all(plan(), a, b)
    assert not any(o.is_inference() for o in plan.out)
    for t in (*a, *b):
        t.mul_(-1.5)
    _check_all(plan(), a, b)  # outside inference mode, on the new values
    with torch.inference_mode():
        _check_all(plan(), a, b)
    want = a[0].double() @ b[0].double()  # (read before the call overwrites b[0]'s rows)
    got = aliased()[0]
    assert got is aliased.out[0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["torch", "cute"])
def test_a_given_out_that_requires_grad_is_refused_at_calls_with_grad(path, request,
                                                                       monkeypatch) -> None:
    # An out that requires grad is refused by the build (grad on) and by grouped_gemm; one
    # flagged after the build, or taken by a build under no_grad, raised torch's leaf error
    # from inside the torch backend's write (and the kernel would write it unnoticed).
    if path == "cute":
        from moe_gemm.ops import api

        kernel = request.getfixturevalue("kernel")
        monkeypatch.setattr(api, "cute_problem", lambda device=None: None)
    a, b = _problems(seed=17)
    plan, out = _plan_with_out(a, b)
    assert plan.backend == path
    plan()
    out[2].requires_grad_()
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^out\[2\] requires grad"):
            plan()
    with torch.no_grad():
        plan()  # (a write outside autograd, as grouped_gemm's under no_grad)
    out[2].requires_grad_(False)
    res = plan()
    if path == "torch":  # (the recorder computes nothing)
        _check_all(res, a, b)
    with torch.no_grad():
        built = GroupedGemmPlan(a, b, out=[o.detach().requires_grad_() for o in out])
        built()
    with pytest.raises(ValueError, match=r"^out\[0\] requires grad"):
        built()
    if path == "cute":
        assert len(kernel.calls) == 4


@pytest.mark.parametrize("wrap", [_compiled, _flop_counted], ids=["compiled", "tensor_mode"])
def test_a_traced_call_refuses_a_given_out_that_requires_grad(wrap) -> None:
    # With an operand that requires grad the traced call wrote the plan's outputs under
    # no_grad, a given out that requires grad among them, without a word.
    import torch._dynamo

    torch._dynamo.reset()
    a, b = _problems(torch.float32, seed=18)
    b[0].requires_grad_()
    plan, out = _plan_with_out(a, b)
    out[1].requires_grad_()
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported)) as err:
        wrap(plan)()
    cause = err.value if isinstance(err.value, ValueError) else err.value.__cause__
    assert "out[1] requires grad" in str(cause)
    torch._dynamo.reset()
