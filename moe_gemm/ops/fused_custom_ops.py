"""fused_grouped_mm registered as torch.library custom ops (the ops/custom_ops.py pattern):
under torch.compile, make_fx or a fake / functional tensor mode ops/fused.py calls these, so
the tracer records one opaque node with a fake implementation for shapes and dtypes, and at
run time the node runs the eager path (cached plans, CUDA-graph safe, the torch backend where
the kernel cannot run). The backward gives eager's gradients where the forward ran torch's
path and raises where it ran the kernel (inference-only, as in eager).

    moe_gemm::_fused_grouped_mm(Tensor x, Tensor w, Tensor offs, Tensor? row_index,
        Tensor? row_weight, Tensor? bias, str gate, str gate_layout, float gate_alpha,
        float gate_limit, str config, ScalarType? out_dtype) -> Tensor
    moe_gemm::_fused_grouped_mm_out(..., Tensor(a!) out, str config,
        ScalarType? out_dtype) -> ()

gate is "" for None; config is custom_ops.encode_config's string.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from moe_gemm.ops.custom_ops import (
    _check_torch_ran,
    _in_graph,
    _pinned_cute,
    _raising_grad,
    check_traced_args,
    decode_config,
    differentiable_out,
    encode_config,
    write_rows,
)
from moe_gemm.ops.fused_validation import check_fused_mm, check_gate_names, gate_float
from moe_gemm.ops.vmap import register_loop_vmap

_ARGS = ("Tensor x, Tensor w, Tensor offs, Tensor? row_index, Tensor? row_weight, "
         "Tensor? bias, str gate, str gate_layout, float gate_alpha, float gate_limit")


def fused_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, *, row_index: Tensor | None = None,
                     bias: Tensor | None = None, gate: str | None = None,
                     gate_layout: str = "concat", gate_alpha: float = 1.702,
                     gate_limit: float = 7.0, row_weight: Tensor | None = None,
                     out: Tensor | None = None, config: Any = None,
                     out_dtype: torch.dtype | None = None) -> Tensor:
    text = encode_config(config)
    check_traced_args({"x": x, "w": w, "offs": offs, "row_index": row_index, "bias": bias,
                       "row_weight": row_weight}, out_dtype,
                      reals={"gate_alpha": gate_alpha, "gate_limit": gate_limit}, out=out)
    check_gate_names(gate, gate_layout)  # (eager's errors; '' is not None there either)
    opts = (gate or "", gate_layout, gate_float("gate_alpha", gate_alpha),
            gate_float("gate_limit", gate_limit))
    if out is None:
        return torch.ops.moe_gemm._fused_grouped_mm(x, w, offs, row_index, row_weight, bias,
                                                    *opts, text, out_dtype)
    if differentiable_out(out, out_dtype, x, w, row_weight, bias):
        y = torch.ops.moe_gemm._fused_grouped_mm(x, w, offs, row_index, row_weight, bias,
                                                 *opts, text, out.dtype)
        return write_rows(out, y, offs)
    torch.ops.moe_gemm._fused_grouped_mm_out(x, w, offs, row_index, row_weight, bias, *opts,
                                             out, text, out_dtype)
    return out


def _eager(x, w, offs, row_index, row_weight, bias, gate, gate_layout, alpha, limit, out,
           config, out_dtype):
    from moe_gemm.ops.fused import fused_grouped_mm_eager

    return fused_grouped_mm_eager(x, w, offs, row_index, row_weight, bias, gate or None,
                                  gate_layout, alpha, limit, out, decode_config(config),
                                  out_dtype)


def _check(x, w, offs, row_index, row_weight, bias, gate, gate_layout, alpha, limit, out,
           out_dtype):
    return check_fused_mm(x, w, offs, row_index=row_index, row_weight=row_weight, bias=bias,
                          gate=gate or None, gate_layout=gate_layout, gate_alpha=alpha,
                          gate_limit=limit, out=out, out_dtype=out_dtype, concrete=False)


@torch.library.custom_op("moe_gemm::_fused_grouped_mm", mutates_args=(),
                         schema=f"({_ARGS}, str config, ScalarType? out_dtype) -> Tensor")
def _fused_grouped_mm(x, w, offs, row_index, row_weight, bias, gate, gate_layout, alpha, limit,
                      config, out_dtype):
    with _in_graph():
        return _eager(x, w, offs, row_index, row_weight, bias, gate, gate_layout, alpha, limit,
                      None, config, out_dtype)


@_fused_grouped_mm.register_fake
def _fused_grouped_mm_fake(x, w, offs, row_index, row_weight, bias, gate, gate_layout, alpha,
                           limit, config, out_dtype):
    args = _check(x, w, offs, row_index, row_weight, bias, gate, gate_layout, alpha, limit,
                  None, out_dtype)
    return x.new_empty((args.S, args.N_out), dtype=args.out_dtype)


@torch.library.custom_op(
    "moe_gemm::_fused_grouped_mm_out", mutates_args=("out",),
    schema=f"({_ARGS}, Tensor(a!) out, str config, ScalarType? out_dtype) -> ()")
def _fused_grouped_mm_out(x, w, offs, row_index, row_weight, bias, gate, gate_layout, alpha,
                          limit, out, config, out_dtype):
    with _in_graph():
        _eager(x, w, offs, row_index, row_weight, bias, gate, gate_layout, alpha, limit, out,
               config, out_dtype)


@_fused_grouped_mm_out.register_fake
def _fused_grouped_mm_out_fake(x, w, offs, row_index, row_weight, bias, gate, gate_layout,
                               alpha, limit, out, config, out_dtype):
    _check(x, w, offs, row_index, row_weight, bias, gate, gate_layout, alpha, limit, out,
           out_dtype)


# The backward: where the forward ran torch's path (backend="torch", off a Hopper GPU, or for
# inputs the kernel does not take), eager autograd's gradients through that path, written out
# (ops/fused_grad.py) in one more registered op that decides at run time, from the saved
# inputs, which path the forward took (as custom_ops.py's `_grad` ops do); where the kernel
# ran it raises: the kernel is inference-only, as in eager.


@torch.library.custom_op(
    "moe_gemm::_fused_grouped_mm_grad", mutates_args=(),
    schema=f"(Tensor grad, {_ARGS}, str config, ScalarType? out_dtype) "
           "-> (Tensor, Tensor, Tensor, Tensor)")
def _fused_grouped_mm_grad(grad, x, w, offs, row_index, row_weight, bias, gate, gate_layout,
                           alpha, limit, config, out_dtype):
    """(d x, d w, d row_weight, d bias); an absent row_weight or bias gets an empty tensor."""
    from moe_gemm.ops.fused import fused_runs_torch
    from moe_gemm.ops.fused_grad import fused_grouped_mm_grads

    args = check_fused_mm(x, w, offs, row_index=row_index, row_weight=row_weight, bias=bias,
                          gate=gate or None, gate_layout=gate_layout, gate_alpha=alpha,
                          gate_limit=limit, out_dtype=out_dtype)
    _check_torch_ran(fused_runs_torch(args, decode_config(config)), "_fused_grouped_mm")
    gx, gw, grw, gbias = fused_grouped_mm_grads(grad, args)
    return (gx, gw, x.new_empty(0) if grw is None else grw,
            x.new_empty(0) if gbias is None else gbias)  # (outputs may not alias each other)


@_fused_grouped_mm_grad.register_fake
def _fused_grouped_mm_grad_fake(grad, x, w, offs, row_index, row_weight, bias, gate,
                                gate_layout, alpha, limit, config, out_dtype):
    return (x.new_empty(x.shape), w.new_empty(w.shape),
            x.new_empty(0) if row_weight is None else row_weight.new_empty(row_weight.shape),
            x.new_empty(0) if bias is None else bias.new_empty(bias.shape))


_GRAD_SLOTS = (0, 1, 4, 5)  # x, w, row_weight, bias among the op's inputs


def _setup(ctx, inputs, output) -> None:
    ctx.metas = tuple(None if inputs[i] is None else (inputs[i].shape, inputs[i].dtype)
                      for i in _GRAD_SLOTS)
    ctx.options = inputs[6:]  # gate, gate_layout, alpha, limit, config, out_dtype
    ctx.kernels_only = _pinned_cute(inputs[10])
    if not ctx.kernels_only:
        ctx.save_for_backward(*inputs[:6])


def _backward(ctx, grad):
    needs = ctx.needs_input_grad
    grads = [None] * 12
    if not ctx.kernels_only:
        got = torch.ops.moe_gemm._fused_grouped_mm_grad(grad, *ctx.saved_tensors, *ctx.options)
        for slot, g, meta in zip(_GRAD_SLOTS, got, ctx.metas):
            if meta is not None and needs[slot]:
                grads[slot] = g
        return tuple(grads)
    for slot, meta in zip(_GRAD_SLOTS, ctx.metas):
        if meta is not None and needs[slot]:
            grads[slot] = _raising_grad(grad, meta, "_fused_grouped_mm")
    return tuple(grads)


_fused_grouped_mm.register_autograd(_backward, setup_context=_setup)


# FlopCounterMode: the rows multiplied (row_index's count where the gather selects them) times
# the weights' K x N, as the plain ops count (ops/custom_ops.py); the gradient op twice that.
def _fused_flops(x_shape, w_shape, offs_shape, row_index_shape) -> int:
    rows = row_index_shape[0] if row_index_shape is not None else x_shape[0]
    return 2 * rows * x_shape[-1] * w_shape[-1]


@register_flop_formula([torch.ops.moe_gemm._fused_grouped_mm,
                        torch.ops.moe_gemm._fused_grouped_mm_out])
def _fused_flop(x_shape, w_shape, offs_shape, row_index_shape, *args, out_shape=None,
                **kwargs) -> int:
    return _fused_flops(x_shape, w_shape, offs_shape, row_index_shape)


@register_flop_formula(torch.ops.moe_gemm._fused_grouped_mm_grad)
def _fused_grad_flop(grad_shape, x_shape, w_shape, offs_shape, row_index_shape, *args,
                     out_shape=None, **kwargs) -> int:
    return 2 * _fused_flops(x_shape, w_shape, offs_shape, row_index_shape)


# torch.vmap: each batch entry through the op, results stacked (ops/vmap.py).
register_loop_vmap(_fused_grouped_mm, _fused_grouped_mm_out, _fused_grouped_mm_grad)
