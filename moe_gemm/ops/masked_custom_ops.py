"""The masked ops registered as torch.library custom ops (torch.compile, export, fake tensors),
as ops/custom_ops.py does for grouped_mm:

    moe_gemm::_grouped_mm_masked(Tensor x, Tensor w, Tensor masked_m, SymInt? expected_m,
                                 str config, ScalarType? out_dtype) -> Tensor
    moe_gemm::_grouped_mm_masked_out(Tensor x, Tensor w, Tensor masked_m, SymInt? expected_m,
                                     Tensor(a!) out, str config, ScalarType? out_dtype) -> ()
    moe_gemm::_scaled_grouped_mm_masked(Tensor x, Tensor w, Tensor scale_a, Tensor scale_b,
                                        Tensor masked_m, SymInt? expected_m, str config,
                                        ScalarType? out_dtype) -> Tensor
    moe_gemm::_scaled_grouped_mm_masked_out(... the same, Tensor(a!) out ...) -> ()

The public functions (ops/masked.py) are the API; they call these only while traced. Traced,
the ops are inference-only (their backward raises when it runs); eager calls on the torch
backend stay differentiable.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moe_gemm.config import GemmConfig
from moe_gemm.ops.custom_ops import _in_graph, _raising_grad, decode_config, encode_config
from moe_gemm.ops.masked_validation import (
    check_grouped_mm_masked,
    check_scaled_grouped_mm_masked,
)


def _eager() -> Any:
    from moe_gemm.ops import masked  # (masked imports this module)

    return masked


def grouped_mm_masked(x: Tensor, w: Tensor, masked_m: Tensor, *, expected_m: int | None = None,
                      out: Tensor | None = None, config: GemmConfig | None = None,
                      out_dtype: torch.dtype | None = None) -> Tensor:
    text = encode_config(config)
    if out is None:
        return torch.ops.moe_gemm._grouped_mm_masked(x, w, masked_m, expected_m, text,
                                                     out_dtype)
    torch.ops.moe_gemm._grouped_mm_masked_out(x, w, masked_m, expected_m, out, text,
                                              out_dtype)
    return out


def scaled_grouped_mm_masked(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor,
                             masked_m: Tensor, *, expected_m: int | None = None,
                             out: Tensor | None = None, out_dtype: torch.dtype | None = None,
                             config: GemmConfig | None = None) -> Tensor:
    text = encode_config(config)
    if out is None:
        return torch.ops.moe_gemm._scaled_grouped_mm_masked(x, w, scale_a, scale_b, masked_m,
                                                            expected_m, text, out_dtype)
    torch.ops.moe_gemm._scaled_grouped_mm_masked_out(x, w, scale_a, scale_b, masked_m,
                                                     expected_m, out, text, out_dtype)
    return out


@torch.library.custom_op(
    "moe_gemm::_grouped_mm_masked", mutates_args=(),
    schema="(Tensor x, Tensor w, Tensor masked_m, SymInt? expected_m, str config, "
           "ScalarType? out_dtype) -> Tensor")
def _grouped_mm_masked(x, w, masked_m, expected_m, config, out_dtype):
    with _in_graph():
        return _eager().grouped_mm_masked_eager(x, w, masked_m, expected_m, None,
                                                decode_config(config), out_dtype)


@_grouped_mm_masked.register_fake
def _grouped_mm_masked_fake(x, w, masked_m, expected_m, config, out_dtype):
    args = check_grouped_mm_masked(x, w, masked_m, None, None, out_dtype, concrete=False)
    return x.new_empty(args.shape, dtype=args.batch.out_dtype)


@torch.library.custom_op(
    "moe_gemm::_grouped_mm_masked_out", mutates_args=("out",),
    schema="(Tensor x, Tensor w, Tensor masked_m, SymInt? expected_m, Tensor(a!) out, "
           "str config, ScalarType? out_dtype) -> ()")
def _grouped_mm_masked_out(x, w, masked_m, expected_m, out, config, out_dtype):
    with _in_graph():
        _eager().grouped_mm_masked_eager(x, w, masked_m, expected_m, out,
                                         decode_config(config), out_dtype)


@_grouped_mm_masked_out.register_fake
def _grouped_mm_masked_out_fake(x, w, masked_m, expected_m, out, config, out_dtype):
    check_grouped_mm_masked(x, w, masked_m, None, out, out_dtype, concrete=False)


@torch.library.custom_op(
    "moe_gemm::_scaled_grouped_mm_masked", mutates_args=(),
    schema="(Tensor x, Tensor w, Tensor scale_a, Tensor scale_b, Tensor masked_m, "
           "SymInt? expected_m, str config, ScalarType? out_dtype) -> Tensor")
def _scaled_grouped_mm_masked(x, w, scale_a, scale_b, masked_m, expected_m, config, out_dtype):
    with _in_graph():
        return _eager().scaled_grouped_mm_masked_eager(x, w, scale_a, scale_b, masked_m,
                                                       expected_m, None, out_dtype,
                                                       decode_config(config))


@_scaled_grouped_mm_masked.register_fake
def _scaled_grouped_mm_masked_fake(x, w, scale_a, scale_b, masked_m, expected_m, config,
                                   out_dtype):
    args = check_scaled_grouped_mm_masked(x, w, scale_a, scale_b, masked_m, None, None,
                                          out_dtype, concrete=False)
    return x.new_empty(args.shape, dtype=args.batch.out_dtype)


@torch.library.custom_op(
    "moe_gemm::_scaled_grouped_mm_masked_out", mutates_args=("out",),
    schema="(Tensor x, Tensor w, Tensor scale_a, Tensor scale_b, Tensor masked_m, "
           "SymInt? expected_m, Tensor(a!) out, str config, ScalarType? out_dtype) -> ()")
def _scaled_grouped_mm_masked_out(x, w, scale_a, scale_b, masked_m, expected_m, out, config,
                                  out_dtype):
    with _in_graph():
        _eager().scaled_grouped_mm_masked_eager(x, w, scale_a, scale_b, masked_m, expected_m,
                                                out, out_dtype, decode_config(config))


@_scaled_grouped_mm_masked_out.register_fake
def _scaled_grouped_mm_masked_out_fake(x, w, scale_a, scale_b, masked_m, expected_m, out,
                                       config, out_dtype):
    check_scaled_grouped_mm_masked(x, w, scale_a, scale_b, masked_m, None, out, out_dtype,
                                   concrete=False)


def _setup(n: int):
    def setup(ctx, inputs, output) -> None:
        ctx.metas = tuple((t.shape, t.dtype) for t in inputs[:n])
    return setup


def _backward(n: int, op: str, rest: int):
    def backward(ctx, grad):
        grads = tuple(_raising_grad(grad, m, op) if need else None
                      for m, need in zip(ctx.metas, ctx.needs_input_grad[:n]))
        return (*grads, *([None] * rest))
    return backward


_grouped_mm_masked.register_autograd(_backward(2, "_grouped_mm_masked", 4),
                                     setup_context=_setup(2))
_scaled_grouped_mm_masked.register_autograd(_backward(4, "_scaled_grouped_mm_masked", 4),
                                            setup_context=_setup(4))
