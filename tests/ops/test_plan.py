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
