"""Inference-only autograd links for the Hopper kernels.

The cute kernels have no backward. Their outputs are fresh tensors, so without a link a
training step would silently get no gradient for the inputs. When autograd could ask for one
(grad mode on and an input requires grad), the result is tied to the inputs through a
Function whose backward raises with a message that says what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as fwad


class InferenceOnly(torch.autograd.Function):
    """Runs a closure and makes any backward through its result(s) raise `message`."""

    @staticmethod
    def forward(ctx: Any, message: str, run: Callable[[], Any], *tensors: torch.Tensor) -> Any:
        ctx.message = message
        out = run()
        return tuple(out) if isinstance(out, list) else out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> None:
        raise RuntimeError(ctx.message)


def needs_link(tensors: Sequence[torch.Tensor | None]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def inference_only(message: str, run: Callable[[], Any], tensors: Sequence[torch.Tensor | None]
                   ) -> Any:
    """run(), linked to the autograd graph (backward raises) only when a backward could be
    asked for; a list result stays a list."""
    if not needs_link(tensors):
        return run()
    live = [t for t in tensors if t is not None]
    out = InferenceOnly.apply(message, run, *live)
    return list(out) if isinstance(out, tuple) else out


def inference_only_composite(message: str, run: Callable[[], Any],
                             tensors: Sequence[torch.Tensor | None]) -> Any:
    """inference_only for a composite of torch ops (the MoE layers, the quantizers), which may
    run under torch.func: there InferenceOnly, which has no functorch rule, failed with torch's
    complaint about a missing setup_context (grad, vjp, jacrev), and under torch.vmap, whose
    BatchedTensors report requires_grad=False, the result went unlinked: a backward ran
    through torch's ops where the layer promises it raises. Under a differentiating transform
    this raises `message` at once (grad(f) would raise it anyway); under vmap alone the
    result gets the traced form's raising backward (custom_ops.mark_inference_only, per
    batch entry). Forward-mode AD (torch.func.jvp, jacfwd, or dual tensors of
    torch.autograd.forward_ad) through a tensor given raises `message` too (before: torch's
    complaint about an op of the composite without a forward-mode rule). One C call more than
    inference_only outside torch.func."""
    if _forward_ad(tensors):
        raise RuntimeError(message)
    if _depth() == 0:
        return inference_only(message, run, tensors)
    if not (torch.is_grad_enabled() and any(t is not None and _requires_grad(t)
                                            for t in tensors)):
        return run()
    from moe_gemm.ops.vmap import in_vmap

    if not in_vmap():
        raise RuntimeError(message)
    from moe_gemm.ops.custom_ops import mark_inference_only

    out = run()
    if isinstance(out, (list, tuple)):
        return type(out)(mark_inference_only(t, message) for t in out)
    return mark_inference_only(out, message)


def _forward_ad(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Whether forward-mode AD differentiates through one of `tensors`: a torch.func jvp
    transform with a tensor it wraps, or a dual tensor of an open forward_ad level."""
    if _depth() > 0 and any(t is not None and _wrapped(t) for t in tensors):
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        if any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters()):
            return True
    if fwad._current_level >= 0:  # (-1 outside any `with forward_ad.dual_level()`)
        return any(t is not None and fwad.unpack_dual(t).tangent is not None for t in tensors)
    return False


_depth = torch._C._functorch.get_dynamic_layer_stack_depth
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrapped = torch._C._functorch.get_unwrapped


def _requires_grad(t: torch.Tensor) -> bool:
    """t, or a tensor its torch.func wrappers wrap, requires grad (vmap's BatchedTensor says
    False where the tensor it batches requires grad)."""
    while True:
        if t.requires_grad:
            return True
        if not _wrapped(t):
            return False
        t = _unwrapped(t)
