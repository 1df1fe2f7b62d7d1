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
    moe_gemm::_fused_grouped_mm_masked(Tensor x, Tensor w, Tensor masked_m, Tensor? bias,
                                       Tensor? row_weight, str? gate, str gate_layout,
                                       float gate_alpha, float gate_limit, SymInt? expected_m,
                                       str config, ScalarType? out_dtype) -> Tensor
    moe_gemm::_fused_grouped_mm_masked_out(... the same, Tensor(a!) out ...) -> ()

The public functions (ops/masked.py) are the API; they call these only while traced. Traced,
the ops are inference-only (their backward raises when it runs); eager calls on the torch
backend stay differentiable.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from moe_gemm.config import GemmConfig
from moe_gemm.ops.custom_ops import (
    _in_graph,
    _mm_flops,
    _raising_grad,
    check_traced_args,
    decode_config,
    differentiable_out,
    encode_config,
    traced_int,
)
from moe_gemm.ops.fused_validation import check_gate_names, gate_float
from moe_gemm.ops.masked_validation import (
    check_expected_m,
    check_grouped_mm_masked,
    check_scaled_grouped_mm_masked,
)
from moe_gemm.ops.validation import shape_text
from moe_gemm.ops.vmap import register_loop_vmap

_FUSED_ARGS = ("Tensor x, Tensor w, Tensor masked_m, Tensor? bias, Tensor? row_weight, "
               "str? gate, str gate_layout, float gate_alpha, float gate_limit, "
               "SymInt? expected_m")


def _eager() -> Any:
    from moe_gemm.ops import masked  # (masked imports this module)

    return masked


def _expected_m(v: Any) -> int | torch.SymInt | None:
    """expected_m as the op schema takes it (traced_int). An int past int64 (the schema's
    cast refused it with torch's pybind error) is capped there: eager caps every hint at M,
    so the call means the same; a negative one is refused as eager refuses it."""
    v = traced_int("expected_m", v)
    if isinstance(v, int) and not -2 ** 63 <= v < 2 ** 63:
        check_expected_m(v, 1)  # (raises for a negative one)
        v = 2 ** 63 - 1
    return v


def write_valid_rows(out: Tensor, y: Tensor, masked_m: Tensor) -> Tensor:
    """out's first masked_m[g] rows of each problem set to y's, differentiably (the others
    keep their values, as the eager call leaves them). A traced call with `out` whose inputs
    require grad runs the functional op and writes through this: the `_out` ops run under
    no_grad and have no autograd, so through them the result would lose its link to the
    inputs and a backward would skip this call without a word instead of raising."""
    if tuple(out.shape) != tuple(y.shape) or out.device != y.device:
        raise ValueError(f"out must be {shape_text(y)} on {y.device}; got "
                         f"{shape_text(out)} on {out.device}")
    valid = torch.arange(out.shape[1], device=out.device) < masked_m.unsqueeze(1)
    return out.copy_(torch.where(valid.unsqueeze(-1), y, out))


def grouped_mm_masked(x: Tensor, w: Tensor, masked_m: Tensor, *, expected_m: int | None = None,
                      out: Tensor | None = None, config: GemmConfig | None = None,
                      out_dtype: torch.dtype | None = None) -> Tensor:
    text = encode_config(config)
    check_traced_args({"x": x, "w": w, "masked_m": masked_m}, out_dtype, out=out)
    expected_m = _expected_m(expected_m)
    if out is None:
        return torch.ops.moe_gemm._grouped_mm_masked(x, w, masked_m, expected_m, text,
                                                     out_dtype)
    if differentiable_out(out, out_dtype, x, w):
        y = torch.ops.moe_gemm._grouped_mm_masked(x, w, masked_m, expected_m, text, out.dtype)
        return write_valid_rows(out, y, masked_m)
    torch.ops.moe_gemm._grouped_mm_masked_out(x, w, masked_m, expected_m, out, text,
                                              out_dtype)
    return out


def scaled_grouped_mm_masked(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor,
                             masked_m: Tensor, *, expected_m: int | None = None,
                             out: Tensor | None = None, out_dtype: torch.dtype | None = None,
                             config: GemmConfig | None = None) -> Tensor:
    text = encode_config(config)
    check_traced_args({"x": x, "w": w, "scale_a": scale_a, "scale_b": scale_b,
                       "masked_m": masked_m}, out_dtype, out=out)
    expected_m = _expected_m(expected_m)
    if out is None:
        return torch.ops.moe_gemm._scaled_grouped_mm_masked(x, w, scale_a, scale_b, masked_m,
                                                            expected_m, text, out_dtype)
    if differentiable_out(out, out_dtype, x, w, scale_a, scale_b):
        y = torch.ops.moe_gemm._scaled_grouped_mm_masked(x, w, scale_a, scale_b, masked_m,
                                                         expected_m, text, out.dtype)
        return write_valid_rows(out, y, masked_m)
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


def fused_grouped_mm_masked(x: Tensor, w: Tensor, masked_m: Tensor, *,
                            bias: Tensor | None = None, gate: str | None = None,
                            gate_layout: str = "concat", gate_alpha: float = 1.702,
                            gate_limit: float = 7.0, row_weight: Tensor | None = None,
                            expected_m: int | None = None, out: Tensor | None = None,
                            config: GemmConfig | None = None,
                            out_dtype: torch.dtype | None = None) -> Tensor:
    text = encode_config(config)
    check_traced_args({"x": x, "w": w, "masked_m": masked_m, "bias": bias,
                       "row_weight": row_weight}, out_dtype,
                      reals={"gate_alpha": gate_alpha, "gate_limit": gate_limit}, out=out)
    expected_m = _expected_m(expected_m)
    check_gate_names(gate, gate_layout)  # (eager's errors, not the op schema's)
    common = (x, w, masked_m, bias, row_weight, gate, gate_layout,
              gate_float("gate_alpha", gate_alpha), gate_float("gate_limit", gate_limit),
              expected_m)
    if out is None:
        return torch.ops.moe_gemm._fused_grouped_mm_masked(*common, text, out_dtype)
    if differentiable_out(out, out_dtype, x, w, bias, row_weight):
        y = torch.ops.moe_gemm._fused_grouped_mm_masked(*common, text, out.dtype)
        return write_valid_rows(out, y, masked_m)
    torch.ops.moe_gemm._fused_grouped_mm_masked_out(*common, out, text, out_dtype)
    return out


def _fused_eager(x, w, masked_m, bias, row_weight, gate, gate_layout, gate_alpha, gate_limit,
                 expected_m, out, config, out_dtype):
    from moe_gemm.ops import fused_masked

    return fused_masked.fused_grouped_mm_masked_eager(
        x, w, masked_m, bias, gate, gate_layout, gate_alpha, gate_limit, row_weight,
        expected_m, out, decode_config(config), out_dtype)


def _fused_check(x, w, masked_m, bias, row_weight, gate, gate_layout, gate_alpha, gate_limit,
                 out, out_dtype):
    from moe_gemm.ops.fused_masked import check_fused_masked

    return check_fused_masked(x, w, masked_m, bias=bias, gate=gate, gate_layout=gate_layout,
                              gate_alpha=gate_alpha, gate_limit=gate_limit,
                              row_weight=row_weight, out=out, out_dtype=out_dtype,
                              concrete=False)


@torch.library.custom_op("moe_gemm::_fused_grouped_mm_masked", mutates_args=(),
                         schema=f"({_FUSED_ARGS}, str config, ScalarType? out_dtype) -> Tensor")
def _fused_grouped_mm_masked(x, w, masked_m, bias, row_weight, gate, gate_layout, gate_alpha,
                             gate_limit, expected_m, config, out_dtype):
    with _in_graph():
        return _fused_eager(x, w, masked_m, bias, row_weight, gate, gate_layout, gate_alpha,
                            gate_limit, expected_m, None, config, out_dtype)


@_fused_grouped_mm_masked.register_fake
def _fused_grouped_mm_masked_fake(x, w, masked_m, bias, row_weight, gate, gate_layout,
                                  gate_alpha, gate_limit, expected_m, config, out_dtype):
    args = _fused_check(x, w, masked_m, bias, row_weight, gate, gate_layout, gate_alpha,
                        gate_limit, None, out_dtype)
    return x.new_empty((args.G, args.M, args.N_out), dtype=args.flat.out_dtype)


@torch.library.custom_op("moe_gemm::_fused_grouped_mm_masked_out", mutates_args=("out",),
                         schema=f"({_FUSED_ARGS}, Tensor(a!) out, str config, "
                                "ScalarType? out_dtype) -> ()")
def _fused_grouped_mm_masked_out(x, w, masked_m, bias, row_weight, gate, gate_layout,
                                 gate_alpha, gate_limit, expected_m, out, config, out_dtype):
    with _in_graph():
        _fused_eager(x, w, masked_m, bias, row_weight, gate, gate_layout, gate_alpha,
                     gate_limit, expected_m, out, config, out_dtype)


@_fused_grouped_mm_masked_out.register_fake
def _fused_grouped_mm_masked_out_fake(x, w, masked_m, bias, row_weight, gate, gate_layout,
                                      gate_alpha, gate_limit, expected_m, out, config,
                                      out_dtype):
    _fused_check(x, w, masked_m, bias, row_weight, gate, gate_layout, gate_alpha, gate_limit,
                 out, out_dtype)


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


def _fused_setup(ctx, inputs, output) -> None:
    # (x, w, masked_m, bias, row_weight, ...): the differentiable ones are x, w, bias and
    # row_weight
    ctx.metas = tuple(None if t is None else (t.shape, t.dtype) for t in inputs[:5])


def _fused_backward(ctx, grad):
    grads = tuple(_raising_grad(grad, m, "_fused_grouped_mm_masked") if need and m is not None
                  and i != 2 else None
                  for i, (m, need) in enumerate(zip(ctx.metas, ctx.needs_input_grad[:5])))
    return (*grads, *([None] * 7))


_fused_grouped_mm_masked.register_autograd(_fused_backward, setup_context=_fused_setup)


# FlopCounterMode: every (G, M) row counts, as the plain ops count rows past offs[-1].
@register_flop_formula([torch.ops.moe_gemm._grouped_mm_masked,
                        torch.ops.moe_gemm._grouped_mm_masked_out,
                        torch.ops.moe_gemm._scaled_grouped_mm_masked,
                        torch.ops.moe_gemm._scaled_grouped_mm_masked_out,
                        torch.ops.moe_gemm._fused_grouped_mm_masked,
                        torch.ops.moe_gemm._fused_grouped_mm_masked_out])
def _masked_flop(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(x_shape, w_shape)


# torch.vmap: each batch entry through the op, results stacked (ops/vmap.py).
register_loop_vmap(_grouped_mm_masked, _grouped_mm_masked_out, _scaled_grouped_mm_masked,
                   _scaled_grouped_mm_masked_out, _fused_grouped_mm_masked,
                   _fused_grouped_mm_masked_out)
