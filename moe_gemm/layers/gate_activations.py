"""Gated activations that read both halves of the gate-up output, not the gate alone.

An MoE layer's `activation` is usually an elementwise function of the gate half, applied as
act(gate) * up. The swiglu_limit models (GLM-5-Next, HY-V4, DeepSeek-V4) also clamp the up
half: silu(min(gate, limit)) * clamp(up, -limit, limit). `ClampedSiLU(limit)` is that gate,
passed where an activation goes (MoE, GatedMLP, moe_experts); `apply_gate` is how every path
applies an activation, so neither kind is ever applied the other's way. On a Hopper GPU the
fused kernel computes it in its epilogue (the "clamped_silu" gate of fused_grouped_mm).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ClampedSiLU", "apply_gate"]


class ClampedSiLU(nn.Module):
    """silu(min(gate, limit)) * clamp(up, -limit, limit): SwiGLU with a swiglu_limit.

    Args:
        limit: the clamp, a finite number > 0 (GLM-5-Next and HY-V4 configs' swiglu_limit,
            DeepSeek-V4's).

    Call it with both halves, `act(gate, up)`; with the gate alone it raises a TypeError (an
    elementwise use would leave the up half unclamped: a wrong answer, not an error).
    """

    def __init__(self, limit: float) -> None:
        super().__init__()
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise TypeError(f"limit must be a float > 0; got {limit!r}")
        if not math.isfinite(limit) or limit <= 0:
            raise ValueError(f"limit must be a finite float > 0; got {limit!r}")
        self.limit = float(limit)

    def forward(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if up is None:
            raise TypeError("ClampedSiLU clamps the up half too: call it as act(gate, up), "
                            "not act(gate) * up")
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def extra_repr(self) -> str:
        return f"limit={self.limit:g}"


def apply_gate(act: Callable[..., torch.Tensor], gate: torch.Tensor,
               up: torch.Tensor) -> torch.Tensor:
    """act's gated output for the two halves: act(gate, up) for a gate of both halves
    (ClampedSiLU), act(gate) * up for an elementwise activation."""
    if isinstance(act, ClampedSiLU):
        return act(gate, up)
    return act(gate) * up
