"""The weight quantizer and the block/group dequantizer as torch.library custom ops, which
torch.compile keeps opaque (ops/quantize.py calls them only while traced):

    moe_gemm::_quantize_fp8_per_block(Tensor w, int block_size, ScalarType dtype)
        -> (Tensor q, Tensor scale)
    moe_gemm::_dequantize_fp8(Tensor q, Tensor scale, str granularity, int block_size)
        -> Tensor
    moe_gemm::_dequantize_fp8_scale_grad(Tensor grad, Tensor q, Tensor scale,
                                         str granularity, int block_size) -> Tensor

Why opaque: both spread one value over a block whose last piece is partial (a K of 300 in
128-column blocks). Inductor (torch 2.13, CPU) folds such a "repeat, then cut at K" view into
loop bounds that stop at the last whole block: the compiled quantizer returned NaN and
unwritten memory for the columns past 256, the dequantizer left them unwritten, and the same
happened with a padded view or an index gather in place of the repeat. Run as ops, the values
are eager's, bit for bit, whatever the compiler does with the surrounding graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moe_gemm.ops.custom_ops import raise_in_backward
from moe_gemm.ops.vmap import register_loop_vmap


def _eager() -> Any:
    from moe_gemm.ops import quantize  # (quantize imports this module)

    return quantize


@torch.library.custom_op(
    "moe_gemm::_quantize_fp8_per_block", mutates_args=(),
    schema="(Tensor w, int block_size, ScalarType dtype) -> (Tensor, Tensor)")
def _quantize_fp8_per_block(w, block_size, dtype):
    return _eager().per_block_values(w, block_size, dtype)


@_quantize_fp8_per_block.register_fake
def _quantize_fp8_per_block_fake(w, block_size, dtype):
    N, K = w.shape[-2:]
    blocks = (-(-N // block_size), -(-K // block_size))
    return (w.new_empty(w.shape, dtype=dtype),
            w.new_empty((*w.shape[:-2], *blocks), dtype=torch.float32))


@torch.library.custom_op(
    "moe_gemm::_dequantize_fp8", mutates_args=(),
    schema="(Tensor q, Tensor scale, str granularity, int block_size) -> Tensor")
def _dequantize_fp8(q, scale, granularity, block_size):
    return _eager().dequantized_values(q, scale, granularity, block_size)


@_dequantize_fp8.register_fake
def _dequantize_fp8_fake(q, scale, granularity, block_size):
    return q.new_empty(q.shape, dtype=torch.float32)


@torch.library.custom_op(
    "moe_gemm::_dequantize_fp8_scale_grad", mutates_args=(),
    schema="(Tensor grad, Tensor q, Tensor scale, str granularity, int block_size) -> Tensor")
def _dequantize_fp8_scale_grad(grad, q, scale, granularity, block_size):
    """d(q * expanded scale) / d scale: grad * q summed over each scale's block (the padded
    part of a partial block adds zeros), in scale's dtype."""
    covered = _eager()._covered
    gq = grad.float() * q.float()
    if granularity == "group":
        K = gq.shape[-1]
        bk = covered(block_size, K)
        kb = -(-K // bk)
        padded = torch.nn.functional.pad(gq, (0, kb * bk - K))
        g = padded.view(*gq.shape[:-1], kb, bk).sum(dim=-1)
    else:
        N, K = gq.shape[-2:]
        bn, bk = covered(block_size, N), covered(block_size, K)
        nb, kb = -(-N // bn), -(-K // bk)
        padded = torch.nn.functional.pad(gq, (0, kb * bk - K, 0, nb * bn - N))
        g = padded.view(*gq.shape[:-2], nb, bn, kb, bk).sum(dim=(-3, -1))
    return g.to(scale.dtype).reshape(scale.shape)


@_dequantize_fp8_scale_grad.register_fake
def _dequantize_fp8_scale_grad_fake(grad, q, scale, granularity, block_size):
    return torch.empty_like(scale)


def _quantize_setup(ctx, inputs, output) -> None:
    ctx.meta = (inputs[0].shape, inputs[0].dtype)


def _quantize_backward(ctx, grad_q, grad_scale):
    """Raises when it runs, as eager's quantizers do (ops/quantize.NO_BACKWARD)."""
    grad = grad_scale if grad_scale is not None else grad_q
    return raise_in_backward(grad, ctx.meta, _eager().NO_BACKWARD), None, None


_quantize_fp8_per_block.register_autograd(_quantize_backward, setup_context=_quantize_setup)


def _dequantize_setup(ctx, inputs, output) -> None:
    q, scale, granularity, block_size = inputs
    ctx.granularity, ctx.block_size = granularity, block_size
    ctx.save_for_backward(q, scale)


def _dequantize_backward(ctx, grad):
    q, scale = ctx.saved_tensors
    g = None
    if ctx.needs_input_grad[1]:
        g = torch.ops.moe_gemm._dequantize_fp8_scale_grad(grad, q, scale, ctx.granularity,
                                                          ctx.block_size)
    return None, g, None, None


_dequantize_fp8.register_autograd(_dequantize_backward, setup_context=_dequantize_setup)

# torch.vmap: each batch entry through the op, results stacked (ops/vmap.py).
register_loop_vmap(_quantize_fp8_per_block, _dequantize_fp8, _dequantize_fp8_scale_grad)


def quantize_per_block(w: Tensor, block_size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return torch.ops.moe_gemm._quantize_fp8_per_block(w, block_size, dtype)


def dequantize(q: Tensor, scale: Tensor, granularity: str, block_size: int) -> Tensor:
    return torch.ops.moe_gemm._dequantize_fp8(q, scale, granularity, block_size)
