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
