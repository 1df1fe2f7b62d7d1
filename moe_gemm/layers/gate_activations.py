"""Gated activations that read both halves of the gate-up output, not the gate alone.

An MoE layer's `activation` is usually an elementwise function of the gate half, applied as
act(gate) * up. The swiglu_limit models (GLM-5-Next, HY-V4, DeepSeek-V4) also clamp the up
half: silu(min(gate, limit)) * clamp(up, -limit, limit). `ClampedSiLU(limit)` is that gate,
passed where an activation goes (MoE, GatedMLP, moe_experts); `ClampedSwiGLU(limit, alpha)`
is gpt-oss's (MiniMax-M3's over concatenated halves): (clamp(up, -limit, limit) + 1) * g *
sigmoid(alpha * g), g = min(gate, limit); `PostClampedSiLU(limit)` clamps after the
activation (Step-3.7, Bailing-Hybrid): min(silu(gate), limit) * clamp(up, -limit, limit). All
are `HalvesGate`s; `apply_gate` is how every path applies an activation, so neither kind is
ever applied the other's way. On a Hopper GPU the fused kernel computes the first two in its
epilogue (the "clamped_silu" and "clamped_swiglu" gates of fused_grouped_mm); the third runs
as torch ops between the two grouped GEMMs (the unfused path).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ClampedSiLU", "ClampedSwiGLU", "HalvesGate", "PostClampedSiLU", "apply_gate"]


def _limit(limit: object) -> float:
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise TypeError(f"limit must be a float > 0; got {limit!r}")
    if not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"limit must be a finite float > 0; got {limit!r}")
    return float(limit)


class HalvesGate(nn.Module):
    """A gated activation of both halves, called as act(gate, up) (see apply_gate)."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if up is None:
            raise TypeError(f"{type(self).__name__} reads the up half too: call it as "
                            "act(gate, up), not act(gate) * up")
        return self.gated(gate, up)

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ClampedSiLU(HalvesGate):
    """silu(min(gate, limit)) * clamp(up, -limit, limit): SwiGLU with a swiglu_limit.

    Args:
        limit: the clamp, a finite number > 0 (GLM-5-Next and HY-V4 configs' swiglu_limit,
            DeepSeek-V4's).

    Call it with both halves, `act(gate, up)`; with the gate alone it raises a TypeError (an
    elementwise use would leave the up half unclamped: a wrong answer, not an error).
    """

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = _limit(limit)

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def extra_repr(self) -> str:
        return f"limit={self.limit:g}"


class PostClampedSiLU(HalvesGate):
    """min(silu(gate), limit) * clamp(up, -limit, limit): the clamp after the activation
    (Step-3.7's and Bailing-Hybrid's swiglu_limits). The fused kernel has no such gate: a layer
    with it runs its experts unfused (torch ops between the grouped GEMMs).

    Args:
        limit: the clamp, a finite number > 0.

    Call it with both halves, `act(gate, up)`, as ClampedSiLU.
    """

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = _limit(limit)

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)

    def extra_repr(self) -> str:
        return f"limit={self.limit:g}"


class ClampedSwiGLU(HalvesGate):
    """gpt-oss's clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit) (MiniMax-M3's experts and shared expert, over concatenated halves).

    Args:
        limit: the clamp, a finite number > 0 (swiglu_limit; gpt-oss 7.0).
        alpha: the sigmoid's slope, a finite number (swiglu_alpha; gpt-oss 1.702).

    Call it with both halves, `act(gate, up)`, as ClampedSiLU.
    """

    def __init__(self, limit: float, alpha: float = 1.702) -> None:
        super().__init__()
        self.limit = _limit(limit)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"alpha must be a float; got {alpha!r}")
        if not math.isfinite(alpha):
            raise ValueError(f"alpha must be finite; got {alpha!r}")
        self.alpha = float(alpha)

    def gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g = gate.clamp(max=self.limit)
        return (up.clamp(min=-self.limit, max=self.limit) + 1) * (g * torch.sigmoid(self.alpha * g))

    def extra_repr(self) -> str:
        return f"limit={self.limit:g}, alpha={self.alpha:g}"


def apply_gate(act: Callable[..., torch.Tensor], gate: torch.Tensor,
               up: torch.Tensor) -> torch.Tensor:
    """act's gated output for the two halves: act(gate, up) for a gate of both halves
    (ClampedSiLU, ClampedSwiGLU), act(gate) * up for an elementwise activation."""
    if isinstance(act, HalvesGate):
        return act(gate, up)
    return act(gate) * up
