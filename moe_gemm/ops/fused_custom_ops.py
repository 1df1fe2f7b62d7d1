"""fused_grouped_mm registered as torch.library custom ops (the ops/custom_ops.py pattern):
under torch.compile, make_fx or a fake / functional tensor mode ops/fused.py calls these, so
the tracer records one opaque node with a fake implementation for shapes and dtypes, and at
run time the node runs the eager path (cached plans, CUDA-graph safe, the torch backend where
the kernel cannot run). Inference only: the registered backward raises when it runs.

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

from moe_gemm.ops.custom_ops import _in_graph, _raising_grad, decode_config, encode_config
from moe_gemm.ops.fused_validation import check_fused_mm

_ARGS = ("Tensor x, Tensor w, Tensor offs, Tensor? row_index, Tensor? row_weight, "
         "Tensor? bias, str gate, str gate_layout, float gate_alpha, float gate_limit")


def fused_grouped_mm(x: Tensor, w: Tensor, offs: Tensor, *, row_index: Tensor | None = None,
                     bias: Tensor | None = None, gate: str | None = None,
                     gate_layout: str = "concat", gate_alpha: float = 1.702,
                     gate_limit: float = 7.0, row_weight: Tensor | None = None,
                     out: Tensor | None = None, config: Any = None,
                     out_dtype: torch.dtype | None = None) -> Tensor:
    text = encode_config(config)
    opts = (gate or "", gate_layout, float(gate_alpha), float(gate_limit))
    if out is None:
        return torch.ops.moe_gemm._fused_grouped_mm(x, w, offs, row_index, row_weight, bias,
                                                    *opts, text, out_dtype)
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


def _setup(ctx, inputs, output) -> None:
    ctx.metas = tuple(None if t is None else (t.shape, t.dtype)
                      for t in (inputs[0], inputs[1], inputs[4], inputs[5]))


def _backward(ctx, grad):
    needs = ctx.needs_input_grad
    grads = [None] * 12
    for slot, meta in zip((0, 1, 4, 5), ctx.metas):
        if meta is not None and needs[slot]:
            grads[slot] = _raising_grad(grad, meta, "_fused_grouped_mm")
    return tuple(grads)


_fused_grouped_mm.register_autograd(_backward, setup_context=_setup)
