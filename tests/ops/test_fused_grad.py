"""moe_gemm.ops.fused_grad on the CPU: the gate layouts' merge undoes their split, each gate's
hand-written backward equals autograd's in float64, and the whole gradient equals eager
autograd through fused_grouped_mm's torch path (edge cases: an empty expert, rows past
offs[-1], a token gathered twice)."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.ops.fused_grad import fused_grouped_mm_grads, gate_backward, merge_gate_up
from moe_gemm.ops.fused_reference import fused_grouped_mm_torch, gate_torch, split_gate_up
from moe_gemm.ops.fused_validation import check_fused_mm

GATES = ["silu", "gelu", "gelu_tanh", "clamped_swiglu", "clamped_silu"]


@pytest.mark.parametrize("layout", ["concat", "interleaved", "alternating"])
def test_merge_undoes_split(layout):
    h = torch.randn(5, 64, dtype=torch.float64)
    gate, up = split_gate_up(h, layout)
    assert torch.equal(merge_gate_up(gate, up, layout), h)


@pytest.mark.parametrize("kind", GATES)
def test_gate_backward_equals_autograd_in_float64(kind):
    g = torch.Generator().manual_seed(len(kind))
    # values on both sides of the clamps (limit 1.5), none exactly on them
    gate = (torch.randn(7, 24, generator=g, dtype=torch.float64) * 2).requires_grad_()
    up = (torch.randn(7, 24, generator=g, dtype=torch.float64) * 2).requires_grad_()
    grad = torch.randn(7, 24, generator=g, dtype=torch.float64)
    gate_torch(kind, gate, up, 1.702, 1.5).backward(grad)
    d_gate, d_up = gate_backward(kind, gate.detach(), up.detach(), 1.702, 1.5, grad)
    torch.testing.assert_close(d_gate, gate.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_up, up.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate", [None, *GATES])
def test_whole_gradient_equals_eager_autograd(gate):
    g = torch.Generator().manual_seed(5)
    T, K, E, N = 6, 24, 4, 32
    x = torch.randn(T, K, generator=g)
    w = torch.randn(E, K, N, generator=g) / 4
    index = torch.tensor([0, 3, 3, 5, 1, 0, 2, 4, 4, 5])  # tokens gathered twice
    offs = torch.tensor([2, 2, 7, 8], dtype=torch.int32)  # an empty expert; 2 rows past the end
    bias = torch.randn(E, N, generator=g)
    rw = torch.rand(10, generator=g)
    leaves = [t.clone().requires_grad_() for t in (x, w, bias, rw)]
    args = check_fused_mm(leaves[0], leaves[1], offs, row_index=index, bias=leaves[2],
                          row_weight=leaves[3], gate=gate, gate_limit=1.0)
    y = fused_grouped_mm_torch(args)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    plain = check_fused_mm(x, w, offs, row_index=index, bias=bias, row_weight=rw, gate=gate,
                           gate_limit=1.0)
    got = fused_grouped_mm_grads(dy, plain)
    gx, gw, gbias, grw = (leaf.grad for leaf in leaves)
    for mine, want in zip(got, (gx, gw, grw, gbias)):  # (d x, d w, d row_weight, d bias)
        torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6)
    assert not got[2][8:].any() and not got[3][1].any()  # past offs[-1]; the empty expert


def test_no_rows_give_zero_gradients():
    x, w = torch.randn(3, 16), torch.randn(2, 16, 8)
    offs = torch.zeros(2, dtype=torch.int32)
    args = check_fused_mm(x, w, offs, bias=torch.randn(2, 8), row_weight=torch.rand(3))
    gx, gw, grw, gb = fused_grouped_mm_grads(torch.randn(3, 8), args)
    assert not gx.any() and not gw.any() and not grw.any() and not gb.any()
    assert gx.shape == x.shape and gw.shape == w.shape and gb.shape == (2, 8)


def test_unchecked_row_index_is_clamped_as_in_the_forward():
    # The compiled backward on a GPU sees row_index values nobody checked: they must be
    # clamped into x's rows as the forward clamps them (gathered from and added back to the
    # first or last token), never read or written out of range.
    g = torch.Generator().manual_seed(9)
    T, K, E, N = 5, 16, 3, 32
    x, w = torch.randn(T, K, generator=g), torch.randn(E, K, N, generator=g) / 4
    index = torch.tensor([0, T, 2, -7, 4, T + 50, 1])
    offs = torch.tensor([2, 5, 7], dtype=torch.int32)
    rw = torch.rand(7, generator=g)
    dy = torch.randn(7, N // 2, generator=g)
    bad = check_fused_mm(x, w, offs, row_index=index, row_weight=rw, gate="silu",
                         concrete=False)
    clamped = check_fused_mm(x, w, offs, row_index=index.clamp(0, T - 1), row_weight=rw,
                             gate="silu")
    for got, want in zip(fused_grouped_mm_grads(dy, bad), fused_grouped_mm_grads(dy, clamped)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
