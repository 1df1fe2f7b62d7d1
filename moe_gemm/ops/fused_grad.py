"""The gradients of the fused MoE grouped GEMM's torch path, written out.

Under torch.compile, fused_grouped_mm is one registered op (ops/fused_custom_ops.py), and
autograd does not run inside a registered op, so its backward cannot differentiate
ops/fused_reference.fused_grouped_mm_torch as eager autograd does; it computes the same
gradients by hand instead: the forward's fp32 accumulators again, then back through the row
weights, the gate (aten's own activation backward ops, the ones eager autograd runs), the bias
and the grouped products, in fp32, each gradient rounded once to its input's dtype. Rows past
offs[-1] never reached the output, so nothing flows back through them; with row_index, the
rows' gradients add up on the tokens they were gathered from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_gemm.kernels.sm90.constants import GATE_BLOCK
from moe_gemm.ops.fused_reference import (
    expert_of_rows,
    gate_torch,
    gather_index,
    split_gate_up,
)
from moe_gemm.ops.fused_validation import FusedMmArgs
from moe_gemm.ops.reference import expert_spans

aten = torch.ops.aten


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor, gate_layout: str) -> torch.Tensor:
    """The inverse of fused_reference.split_gate_up: (S, I) gate and up -> (S, 2I) columns in
    the gate layout's order."""
    S, I = gate.shape
    if gate_layout == "concat":
        return torch.cat([gate, up], dim=1)
    if gate_layout == "alternating":
        return torch.stack([gate, up], dim=2).reshape(S, 2 * I)
    blocks = I // GATE_BLOCK
    return torch.stack([gate.reshape(S, blocks, GATE_BLOCK), up.reshape(S, blocks, GATE_BLOCK)],
                       dim=2).reshape(S, 2 * I)


def gate_backward(kind: str, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float,
                  grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of act(gate) * up (fused_reference.gate_torch) for the gradient `grad`."""
    if kind in ("silu", "gelu", "gelu_tanh"):
        if kind == "silu":
            return aten.silu_backward(grad * up, gate), grad * F.silu(gate)
        approximate = "tanh" if kind == "gelu_tanh" else "none"
        return (aten.gelu_backward(grad * up, gate, approximate=approximate),
                grad * F.gelu(gate, approximate=approximate))
    # clamped_swiglu: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
    # limit); clamped_silu: silu(g) * clamp(up, -limit, limit). A clamp passes the gradient
    # where its input lies within the bounds (inclusive).
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    if kind == "clamped_silu":
        d_g, d_up = aten.silu_backward(grad * u, g), grad * F.silu(g)
        return (torch.where(gate <= limit, d_g, 0.0),
                torch.where((up >= -limit) & (up <= limit), d_up, 0.0))
    s = torch.sigmoid(g * alpha)
    d_glu = grad * (u + 1)
    d_g = d_glu * s + alpha * aten.sigmoid_backward(d_glu * g, s)
    d_up = grad * (g * s)
    return (torch.where(gate <= limit, d_g, 0.0),
            torch.where((up >= -limit) & (up <= limit), d_up, 0.0))


def fused_grouped_mm_grads(grad: torch.Tensor, args: FusedMmArgs
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                      torch.Tensor | None]:
    """(d x, d w, d row_weight or None, d bias or None) of fused_grouped_mm's torch path for
    the output gradient `grad` (S, N_out)."""
    x, w, offs = args.x, args.w, args.offs
    S, E, N = args.S, args.E, args.N
    gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    grw = None if args.row_weight is None else torch.zeros(
        S, dtype=torch.float32, device=x.device)
    gbias = None if args.bias is None else torch.zeros(E, N, dtype=torch.float32,
                                                       device=x.device)
    if S and E and N:
        # (the forward's clamped rows: unchecked values on a GPU never index out of range)
        index = None if args.row_index is None else gather_index(args.row_index.long(),
                                                                 x.shape[0])
        xs = x if index is None else x.index_select(0, index)
        xs32, w32 = xs.float(), w.float()
        expert = expert_of_rows(offs, S)
        live = (expert < E).unsqueeze(1)
        # The forward's accumulators (+ bias), then the epilogue's gradients in reverse.
        h = torch.zeros(S, N, dtype=torch.float32, device=x.device)
        spans = expert_spans(offs, S)
        for e, start, end in spans:
            h[start:end] = xs32[start:end] @ w32[e]
        if args.bias is not None:
            h = h + torch.where(live, args.bias.float().index_select(
                0, expert.clamp(max=max(E - 1, 0))), 0.0)
        d = torch.where(live, grad.float(), 0.0)
        if args.gate is not None:
            gate, up = split_gate_up(h, args.gate_layout)
        if args.row_weight is not None:
            act = h if args.gate is None else gate_torch(args.gate, gate, up, args.gate_alpha,
                                                         args.gate_limit)
            grw = torch.where(live.squeeze(1), (d * act).sum(dim=1), 0.0)
            d = d * args.row_weight.float().unsqueeze(1)
        if args.gate is not None:
            d = merge_gate_up(*gate_backward(args.gate, gate, up, args.gate_alpha,
                                             args.gate_limit, d), args.gate_layout)
        dxs = torch.zeros(S, x.shape[1], dtype=torch.float32, device=x.device)
        for e, start, end in spans:
            dxs[start:end] = d[start:end] @ w32[e].t()
            gw[e] = xs32[start:end].t() @ d[start:end]
            if gbias is not None:
                gbias[e] = d[start:end].sum(dim=0)
        if args.row_index is None:
            gx = dxs
        else:
            gx.index_add_(0, index, dxs)
    return (gx.to(x.dtype), gw.to(w.dtype),
            None if grw is None else grw.to(args.row_weight.dtype),
            None if gbias is None else gbias.to(args.bias.dtype))
