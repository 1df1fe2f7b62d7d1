"""Edge cases of the public ops on the torch backend that a caller can hit on the CPU: results
that compute nothing (no experts, no rows, no row routed to any expert) still belong to
autograd's graph, FP8 lists of zero problems still check `out`, and sparse or mkldnn
operands are named in a TypeError. Fresh random data, fp64 references."""

from __future__ import annotations

import re

import pytest
import torch

from moe_gemm import (
    GroupedGemmPlan,
    fused_grouped_mm,
    fused_grouped_mm_masked,
    grouped_gemm,
    grouped_mm,
    grouped_mm_masked,
    quantize_fp8_per_row,
    quantize_fp8_per_token_group,
    scaled_grouped_gemm,
    scaled_grouped_mm,
)
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref
from moe_gemm.ops.reference import grouped_mm_ref
from moe_gemm.testing import assert_close_to_ref, poison_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


# (T, E, offs): every case computes no product at all.
NOTHING_ROUTED = [(7, 3, [0, 0, 0]), (7, 0, []), (0, 3, [0, 0, 0])]


@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize(("T", "E", "offs"), NOTHING_ROUTED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mm_with_nothing_routed_is_differentiable(dtype, T, E, offs, with_out) -> None:
    # An expert-parallel rank that received no tokens: the backward must give its experts
    # zero gradients, as it does when some rows are routed (and as the compiled op does).
    g = torch.Generator().manual_seed(11)
    x, w = _leaves(torch.randn(T, 16, generator=g).to(dtype),
                   torch.randn(E, 16, 8, generator=g).to(dtype))
    out = poison_(torch.empty(T, 8, dtype=dtype)) if with_out else None
    y = grouped_mm(x, w, _i32(offs), out=out)
    assert y.requires_grad
    if with_out:
        assert y is out and bool(torch.isnan(y).all())  # rows past offs[-1]: untouched
    else:
        assert_close_to_ref(y, grouped_mm_ref(x.detach(), w.detach(), _i32(offs), torch.float64))
    torch.nan_to_num(y).sum().backward()
    for t in (x, w):
        assert t.grad is not None and t.grad.dtype == dtype and not t.grad.any()


@pytest.mark.parametrize(("T", "E", "offs"), NOTHING_ROUTED)
def test_fused_grouped_mm_with_nothing_routed_is_differentiable(T, E, offs) -> None:
    g = torch.Generator().manual_seed(12)
    x, w, bias, row_weight = _leaves(
        torch.randn(T, 16, generator=g), torch.randn(E, 16, 32, generator=g),
        torch.randn(E, 32, generator=g), torch.rand(T, generator=g))
    y = fused_grouped_mm(x, w, _i32(offs), bias=bias, gate="silu", row_weight=row_weight)
    ref = fused_grouped_mm_ref(x.detach(), w.detach(), _i32(offs), bias=bias.detach(),
                               gate="silu", row_weight=row_weight.detach(),
                               dtype=torch.float64)
    assert_close_to_ref(y, ref)
    assert y.requires_grad
    y.sum().backward()
    for t in (x, w, bias, row_weight):
        assert t.grad is not None and not t.grad.any()


def test_fused_grouped_mm_with_no_routed_rows_under_a_gather_is_differentiable() -> None:
    g = torch.Generator().manual_seed(13)
    x, w = _leaves(torch.randn(5, 16, generator=g), torch.randn(2, 16, 8, generator=g))
    y = fused_grouped_mm(x, w, _i32([0, 0]), row_index=torch.zeros(0, dtype=torch.int64))
    assert y.shape == (0, 8) and y.requires_grad
    y.sum().backward()
    assert x.grad is not None and w.grad is not None
    assert not x.grad.any() and not w.grad.any()


def test_grouped_mm_with_nothing_routed_stays_out_of_the_graph_without_grad() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(2, 8, 3, requires_grad=True)
    with torch.no_grad():
        assert not grouped_mm(x, w, _i32([0, 0])).requires_grad
    assert not grouped_mm(x.detach(), w.detach(), _i32([0, 0])).requires_grad


def test_scaled_grouped_gemm_of_no_problems_checks_out() -> None:
    # As grouped_gemm: an `out` list must hold one tensor per problem, also for none.
    assert scaled_grouped_gemm([], [], [], [], out=[]) == []
    with pytest.raises(ValueError, match=re.escape("expected one out per problem: got "
                                                   "len(out)=1 for 0 problems")):
        scaled_grouped_gemm([], [], [], [], out=[torch.empty(2, 3, dtype=torch.bfloat16)])
    with pytest.raises(TypeError, match="out must be a sequence"):
        scaled_grouped_gemm([], [], [], [], out=torch.empty(2, 3))


def _sparse(t: torch.Tensor) -> torch.Tensor:
    return t.to_sparse()


def _dense_cases() -> list[tuple[str, object]]:
    g = torch.Generator().manual_seed(15)
    x, w = torch.randn(6, 8, generator=g), torch.randn(2, 8, 4, generator=g)
    offs, counts = _i32([3, 6]), _i32([1, 3])
    xq = torch.randn(6, 128, generator=g).to(torch.float8_e4m3fn)
    wq = torch.randn(2, 128, 4, generator=g).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(6, generator=g), torch.rand(2, 4, generator=g)
    return [
        ("x", lambda: grouped_mm(_sparse(x), w, offs)),
        ("x", lambda: grouped_mm(x.to_mkldnn(), w, offs)),
        ("w", lambda: grouped_mm(x, _sparse(w), offs)),
        ("offs", lambda: grouped_mm(x, w, _sparse(offs))),
        ("x", lambda: grouped_mm(_sparse(x.view(2, 3, 8)), w)),
        ("a[0]", lambda: grouped_gemm([_sparse(x)], [w[0]])),
        ("b[0]", lambda: grouped_gemm([x], [_sparse(w[0])])),
        ("out[0]", lambda: grouped_gemm([x], [w[0]], out=[_sparse(torch.zeros(6, 4))])),
        ("a[0]", lambda: GroupedGemmPlan([_sparse(x)], [w[0]])),
        ("masked_m", lambda: grouped_mm_masked(x.view(2, 3, 8), w, _sparse(counts))),
        ("out", lambda: grouped_mm_masked(x.view(2, 3, 8), w, counts,
                                          out=_sparse(torch.zeros(2, 3, 4)))),
        ("bias", lambda: fused_grouped_mm(x, w, offs, bias=_sparse(torch.zeros(2, 4)))),
        ("row_weight", lambda: fused_grouped_mm(x, w, offs, row_weight=_sparse(torch.ones(6)))),
        ("row_index", lambda: fused_grouped_mm(x, w, offs, row_index=_sparse(torch.arange(6)))),
        ("scale_a", lambda: scaled_grouped_mm(xq, wq, _sparse(sa), sb, offs)),
        ("out", lambda: scaled_grouped_mm(xq, wq, sa, sb, offs,
                                          out=_sparse(torch.zeros(6, 4, dtype=torch.bfloat16)))),
        ("scale_b[0]", lambda: scaled_grouped_gemm([xq], [wq[0]], [sa], [_sparse(sb[0])])),
    ]


@pytest.mark.parametrize("case", range(len(_dense_cases())))
def test_non_strided_operands_are_named(case) -> None:
    # Both backends slice rows and read strides: a sparse or mkldnn operand must be refused
    # up front, not fail inside torch with NotImplementedError.
    name, call = _dense_cases()[case]
    with pytest.raises(TypeError, match=re.escape(f"{name} must be a dense (strided) tensor")):
        call()


def test_sparse_out_and_inputs_are_named_before_any_fast_path() -> None:
    # The out= fast paths compare storages before validation: a sparse out must still get
    # the layout error, and so must the fused-masked reshapes and the quantizers.
    x, w = torch.randn(6, 8), torch.randn(2, 8, 4)
    dense = re.escape("must be a dense (strided) tensor")
    with pytest.raises(TypeError, match="out " + dense):
        grouped_mm(x, w, _i32([3, 6]), out=_sparse(torch.zeros(6, 4)))
    with pytest.raises(TypeError, match="out " + dense):
        grouped_mm(x.view(2, 3, 8), w, out=_sparse(torch.zeros(2, 3, 4)))
    with pytest.raises(TypeError, match="out " + dense):
        fused_grouped_mm(x, w, _i32([3, 6]), out=_sparse(torch.zeros(6, 4)))
    counts = _i32([2, 3])
    with pytest.raises(TypeError, match="x " + dense):
        fused_grouped_mm_masked(_sparse(x.view(2, 3, 8)), w, counts)
    with pytest.raises(TypeError, match="row_weight " + dense):
        fused_grouped_mm_masked(x.view(2, 3, 8), w, counts, row_weight=_sparse(torch.ones(2, 3)))
    with pytest.raises(TypeError, match="out " + dense):
        fused_grouped_mm_masked(x.view(2, 3, 8), w, counts, out=_sparse(torch.zeros(2, 3, 4)))
    for quantize in (quantize_fp8_per_token_group, quantize_fp8_per_row):
        with pytest.raises(TypeError, match=dense):
            quantize(_sparse(torch.randn(4, 128)))


def test_plan_on_the_torch_backend_trains_over_several_steps() -> None:
    g = torch.Generator().manual_seed(14)
    a = [torch.randn(m, 16, generator=g) for m in (3, 5)]
    b = _leaves(*(torch.randn(16, 4, generator=g) for _ in a))
    plan = GroupedGemmPlan(a, b)
    for _ in range(3):
        for ai in a:  # new values in place, as a plan's user does between calls
            ai.copy_(torch.randn(ai.shape, generator=g))
        for t in b:
            t.grad = None
        d = plan()
        for di, oi, ai, bi in zip(d, plan.out, a, b):
            assert_close_to_ref(di, ai.double() @ bi.double())
            assert torch.equal(oi, di)  # the values also land in the plan's outputs
        sum(di.sum() for di in d).backward()
        for ai, bi in zip(a, b):  # d/dB sum(A @ B) = A^T @ ones
            ref = ai.double().t() @ torch.ones(ai.shape[0], 4, dtype=torch.float64)
            assert_close_to_ref(bi.grad, ref)
