"""The FP8 ops registered as torch.library custom ops (torch.compile, export, fake tensors),
as ops/custom_ops.py does for the 16-bit ones:

    moe_gemm::_scaled_grouped_mm(Tensor x, Tensor w, Tensor scale_a, Tensor scale_b,
                                 Tensor? offs, str config, ScalarType? out_dtype) -> Tensor
    moe_gemm::_scaled_grouped_mm_out(Tensor x, Tensor w, Tensor scale_a, Tensor scale_b,
                                     Tensor? offs, Tensor(a!) out, str config,
                                     ScalarType? out_dtype) -> ()
    moe_gemm::_scaled_grouped_gemm(Tensor[] a, Tensor[] b, Tensor[] scale_a,
                                   Tensor[] scale_b, str config,
                                   ScalarType? out_dtype) -> Tensor[]
    moe_gemm::_scaled_grouped_gemm_out(Tensor[] a, Tensor[] b, Tensor[] scale_a,
                                       Tensor[] scale_b, Tensor(a!)[] out, str config,
                                       ScalarType? out_dtype) -> ()

The public functions (ops/scaled.py) are the API; they call these only while traced. The
backward raises when it runs (inference-only, as the kernels).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from moe_gemm.config import GemmConfig
from moe_gemm.ops.custom_ops import (
    _gemm_flops,
    _in_graph,
    _mm_flops,
    _raising_grad,
    check_traced_args,
    check_traced_outs,
    decode_config,
    detached,
    differentiable_out,
    encode_config,
    grad_tracked,
    write_rows,
)
from moe_gemm.ops.scaled_validation import (
    check_scaled_grouped_gemm,
    check_scaled_grouped_mm,
    resolve_fp8_out_dtype,
)
from moe_gemm.ops.validation import _as_tensor_list
from moe_gemm.ops.vmap import register_loop_vmap


def _eager() -> Any:
    from moe_gemm.ops import scaled  # (scaled imports this module)

    return scaled


def scaled_grouped_mm(x: Tensor, w: Tensor, scale_a: Tensor, scale_b: Tensor,
                      offs: Tensor | None = None, *, out: Tensor | None = None,
                      out_dtype: torch.dtype | None = None,
                      config: GemmConfig | None = None) -> Tensor:
    text = encode_config(config)
    check_traced_args({"x": x, "w": w, "scale_a": scale_a, "scale_b": scale_b, "offs": offs},
                      out_dtype, out=out)
    if out is None:
        return torch.ops.moe_gemm._scaled_grouped_mm(x, w, scale_a, scale_b, offs, text,
                                                     out_dtype)
    if differentiable_out(out, out_dtype, x, w, scale_a, scale_b):
        # The functional op (whose backward raises when it runs), copied into out: the `_out`
        # op has no autograd, so through it the result would lose its link to the inputs and
        # a backward would skip this call without a word (custom_ops.differentiable_out).
        y = torch.ops.moe_gemm._scaled_grouped_mm(x, w, scale_a, scale_b, offs, text,
                                                  out.dtype)
        return write_rows(out, y, offs)
    torch.ops.moe_gemm._scaled_grouped_mm_out(x, w, scale_a, scale_b, offs, out, text,
                                              out_dtype)
    return out


def scaled_grouped_gemm(a: Any, b: Any, scale_a: Any, scale_b: Any, *, out: Any = None,
                        out_dtype: torch.dtype | None = None,
                        config: GemmConfig | None = None) -> list[Tensor]:
    text = encode_config(config)
    hints = {"a": "(M_i, K_i)", "b": "(K_i, N_i)", "scale_a": "of float32 scales",
             "scale_b": "of float32 scales"}  # (eager's messages, not the schema's)
    lists = [_as_tensor_list(n, s, hints[n], "tensors" if n.startswith("scale") else "2-D tensors")
             for n, s in zip(hints, (a, b, scale_a, scale_b))]
    check_traced_args(out_dtype=out_dtype)
    if out is not None:
        outs = _as_tensor_list("out", out, "(M_i, N_i)")
        check_traced_outs(outs)
        if outs and grad_tracked(*(t for ts in lists for t in ts)):
            # The functional op at out's dtype, copied in (write_rows: differentiable, as the
            # eager call's in-place write), after eager's checks of `out` (its count, shapes,
            # one dtype, out_dtype's).
            torch.ops.moe_gemm._check_scaled_gemm_outs(*map(detached, lists), outs, out_dtype)
            res = torch.ops.moe_gemm._scaled_grouped_gemm(*lists, text, outs[0].dtype)
            return [write_rows(o, r, None, f"out[{i}]")
                    for i, (o, r) in enumerate(zip(outs, res))]
        # The `_out` op: eager's checks when it runs, the overlap of outputs included (a
        # traced call has no memory to compare: copying the functional op's results into
        # outputs that share memory gave a wrong result without a word).
        torch.ops.moe_gemm._scaled_grouped_gemm_out(*lists, outs, text, out_dtype)
        return outs
    return list(torch.ops.moe_gemm._scaled_grouped_gemm(*lists, text, out_dtype))


@torch.library.custom_op(
    "moe_gemm::_scaled_grouped_mm", mutates_args=(),
    schema="(Tensor x, Tensor w, Tensor scale_a, Tensor scale_b, Tensor? offs, str config, "
           "ScalarType? out_dtype) -> Tensor")
def _scaled_grouped_mm(x, w, scale_a, scale_b, offs, config, out_dtype):
    with _in_graph():
        return _eager().scaled_grouped_mm_eager(x, w, scale_a, scale_b, offs, None, out_dtype,
                                                decode_config(config))


@_scaled_grouped_mm.register_fake
def _scaled_grouped_mm_fake(x, w, scale_a, scale_b, offs, config, out_dtype):
    args = check_scaled_grouped_mm(x, w, scale_a, scale_b, offs, None, out_dtype,
                                   concrete=False)
    return x.new_empty((*x.shape[:-1], args.N), dtype=args.out_dtype)


@torch.library.custom_op(
    "moe_gemm::_scaled_grouped_mm_out", mutates_args=("out",),
    schema="(Tensor x, Tensor w, Tensor scale_a, Tensor scale_b, Tensor? offs, Tensor(a!) out, "
           "str config, ScalarType? out_dtype) -> ()")
def _scaled_grouped_mm_out(x, w, scale_a, scale_b, offs, out, config, out_dtype):
    with _in_graph():
        _eager().scaled_grouped_mm_eager(x, w, scale_a, scale_b, offs, out, out_dtype,
                                         decode_config(config))


@_scaled_grouped_mm_out.register_fake
def _scaled_grouped_mm_out_fake(x, w, scale_a, scale_b, offs, out, config, out_dtype):
    check_scaled_grouped_mm(x, w, scale_a, scale_b, offs, out, out_dtype, concrete=False)


@torch.library.custom_op(
    "moe_gemm::_scaled_grouped_gemm", mutates_args=(),
    schema="(Tensor[] a, Tensor[] b, Tensor[] scale_a, Tensor[] scale_b, str config, "
           "ScalarType? out_dtype) -> Tensor[]")
def _scaled_grouped_gemm(a, b, scale_a, scale_b, config, out_dtype):
    # An op's outputs must not share storage: each gets its own allocation here.
    args = check_scaled_grouped_gemm(a, b, scale_a, scale_b, None, out_dtype)
    outs = [torch.empty(m, n, dtype=args.out_dtype, device=args.device)
            for m, n, _ in args.sizes]
    with _in_graph():
        _eager().scaled_grouped_gemm_eager(a, b, scale_a, scale_b, outs, args.out_dtype,
                                           decode_config(config))
    return outs


@_scaled_grouped_gemm.register_fake
def _scaled_grouped_gemm_fake(a, b, scale_a, scale_b, config, out_dtype):
    args = check_scaled_grouped_gemm(a, b, scale_a, scale_b, None, out_dtype, concrete=False)
    odt = resolve_fp8_out_dtype(out_dtype, None)
    return [ai.new_empty((ai.shape[0], bi.shape[1]), dtype=odt)
            for ai, bi in zip(args.a, args.b)]


@torch.library.custom_op(
    "moe_gemm::_scaled_grouped_gemm_out", mutates_args=("out",),
    schema="(Tensor[] a, Tensor[] b, Tensor[] scale_a, Tensor[] scale_b, Tensor(a!)[] out, "
           "str config, ScalarType? out_dtype) -> ()")
def _scaled_grouped_gemm_out(a, b, scale_a, scale_b, out, config, out_dtype):
    with _in_graph():
        _eager().scaled_grouped_gemm_eager(a, b, scale_a, scale_b, out, out_dtype,
                                           decode_config(config))


@_scaled_grouped_gemm_out.register_fake
def _scaled_grouped_gemm_out_fake(a, b, scale_a, scale_b, out, config, out_dtype):
    check_scaled_grouped_gemm(a, b, scale_a, scale_b, out, out_dtype, concrete=False)


@torch.library.custom_op(
    "moe_gemm::_check_scaled_gemm_outs", mutates_args=("out",),
    schema="(Tensor[] a, Tensor[] b, Tensor[] scale_a, Tensor[] scale_b, Tensor(a!)[] out, "
           "ScalarType? out_dtype) -> ()")
def _check_scaled_gemm_outs(a, b, scale_a, scale_b, out, out_dtype):
    """Eager's checks of `out` for a traced call that stays differentiable (as
    custom_ops._check_gemm_outs: at trace time, and on the real tensors when it runs)."""
    check_scaled_grouped_gemm(a, b, scale_a, scale_b, out, out_dtype)


@_check_scaled_gemm_outs.register_fake
def _check_scaled_gemm_outs_fake(a, b, scale_a, scale_b, out, out_dtype):
    check_scaled_grouped_gemm(a, b, scale_a, scale_b, out, out_dtype, concrete=False)


def _mm_setup(ctx, inputs, output) -> None:
    ctx.metas = tuple((t.shape, t.dtype) for t in inputs[:4])


def _mm_backward(ctx, grad):
    grads = tuple(_raising_grad(grad, m, "_scaled_grouped_mm") if need else None
                  for m, need in zip(ctx.metas, ctx.needs_input_grad[:4]))
    return (*grads, None, None, None)


def _gemm_setup(ctx, inputs, output) -> None:
    ctx.metas = tuple([(t.shape, t.dtype) for t in seq] for seq in inputs[:4])


def _gemm_backward(ctx, grads):
    grad = next((g for g in grads if g is not None), None)
    if grad is None:
        return None, None, None, None, None, None
    return (*([_raising_grad(grad, m, "_scaled_grouped_gemm") for m in metas]
              for metas in ctx.metas), None, None)


_scaled_grouped_mm.register_autograd(_mm_backward, setup_context=_mm_setup)
_scaled_grouped_gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)


# FlopCounterMode: counted as the 16-bit ops are (ops/custom_ops.py).
@register_flop_formula([torch.ops.moe_gemm._scaled_grouped_mm,
                        torch.ops.moe_gemm._scaled_grouped_mm_out])
def _scaled_mm_flop(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(x_shape, w_shape)


@register_flop_formula([torch.ops.moe_gemm._scaled_grouped_gemm,
                        torch.ops.moe_gemm._scaled_grouped_gemm_out])
def _scaled_gemm_flop(a_shapes, b_shapes, *args, out_shape=None, **kwargs) -> int:
    return _gemm_flops(a_shapes, b_shapes)


# torch.vmap: each batch entry through the op, results stacked (ops/vmap.py).
register_loop_vmap(_scaled_grouped_mm, _scaled_grouped_mm_out, _scaled_grouped_gemm,
                   _scaled_grouped_gemm_out, _check_scaled_gemm_outs)
