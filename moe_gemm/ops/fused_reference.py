"""The fused MoE grouped GEMM in plain torch: the torch backend and the tests' reference.

- `fused_grouped_mm_torch`: what `backend="auto"` runs where the Hopper kernels cannot (CPU,
  other GPUs), for arguments checked by ops/fused_validation.py. The grouped GEMM is the torch
  backend's (ops/reference.py); bias, activation and row weights follow in fp32 and the result
  is rounded once, as in the kernel's epilogue. (bf16 on a CUDA GPU where torch's own
  grouped_mm runs: its accumulators come back rounded to bf16, which keeps the call free of
  host syncs and costs a second rounding; fp16 takes the fp32 accumulators there, since an
  fp16 one past 65504 would be inf before a bias or row weight could bring it back.)
- `fused_grouped_mm_ref`: float32 / float64, a loop over experts, as plain as possible.

Semantics (both, and the kernel): with row_index, routed row r is x[row_index[r]]; rows of
expert e are offs[e-1]:offs[e]; per row, h = x_r @ w[e] (+ bias[e]), then the gate
(act(gate) * up over the gate layout's pairs) and the row weight. Rows past offs[-1] are zero
(or, with `out`, left untouched): no bias and no weight reaches them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_gemm.kernels.sm90.constants import GATE_BLOCK
from moe_gemm.ops.fused_validation import FusedMmArgs
from moe_gemm.ops.reference import _grouped_mm_native_ok, grouped_mm_torch, tie_to_inputs
from moe_gemm.ops.validation import GroupedMmArgs


def split_gate_up(h: torch.Tensor, gate_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, N) accumulator columns -> (gate, up), each (S, N / 2), in output column order."""
    if gate_layout == "concat":
        gate, up = h.chunk(2, dim=-1)
        return gate, up
    if gate_layout == "alternating":
        return h[:, 0::2], h[:, 1::2]
    S, N = h.shape
    pairs = h.reshape(S, N // (2 * GATE_BLOCK), 2, GATE_BLOCK)
    return pairs[:, :, 0].reshape(S, N // 2), pairs[:, :, 1].reshape(S, N // 2)


def gate_torch(kind: str, gate: torch.Tensor, up: torch.Tensor, alpha: float,
               limit: float) -> torch.Tensor:
    """act(gate) * up as transformers computes it (clamped_swiglu: gpt-oss's; clamped_silu:
    GLM-5-Next's, HY-V4's and Step-3.7's, a swiglu_limit)."""
    if kind == "silu":
        return F.silu(gate) * up
    if kind == "gelu":
        return F.gelu(gate) * up
    if kind == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    if kind == "clamped_silu":
        return F.silu(gate) * up
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gather_index(row_index: torch.Tensor, T: int) -> torch.Tensor:
    """row_index clamped into x's rows [0, T) as the kernel's gather clamps it: values on a GPU
    are not checked (no host sync), and an index_select out of range there faults the CUDA
    context where the docstring promises wrong rows at worst (checked values pass as they
    are)."""
    return row_index.clamp(0, max(T - 1, 0))


def expert_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) int64 expert of each routed row; E for rows past the last end (on the device).
    The ends as the kernels read them: offs clamped into [0, rows], a decreasing entry an
    empty expert (the running maximum), as the GEMM's spans (reference.fitted_ends)."""
    r = torch.arange(rows, device=offs.device, dtype=torch.int32)
    if offs.numel() == 0:
        return torch.zeros(rows, dtype=torch.int64, device=offs.device)
    ends = offs.to(torch.int32).clamp(0, rows).cummax(0).values  # (contiguous, sorted)
    return torch.searchsorted(ends, r, right=True)


def _epilogue(args: FusedMmArgs, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(result in fp32, live rows (S, 1)) from the accumulators h (S, N)."""
    E = args.E
    expert = expert_of_rows(args.offs, args.S)
    live = (expert < E).unsqueeze(1)
    h = h.float()
    if args.bias is not None:
        b = args.bias.float().index_select(0, expert.clamp(max=max(E - 1, 0)))
        h = h + torch.where(live, b, 0.0)
    if args.gate is not None:
        gate, up = split_gate_up(h, args.gate_layout)
        h = gate_torch(args.gate, gate, up, args.gate_alpha, args.gate_limit)
    if args.row_weight is not None:
        h = h * torch.where(live, args.row_weight.float().unsqueeze(1), 1.0)
    return torch.where(live, h, 0.0), live


def fused_grouped_mm_torch(args: FusedMmArgs) -> torch.Tensor:
    """The torch backend (see the module docstring)."""
    x, S = args.x, args.S
    out = args.out
    if S == 0 or args.E == 0 or args.N_out == 0:
        y = out if out is not None else torch.zeros(S, args.N_out, dtype=args.out_dtype,
                                                    device=x.device)
        return tie_to_inputs(y, x, args.w, args.bias, args.row_weight)
    xs = x if args.row_index is None else x.index_select(
        0, gather_index(args.row_index, x.shape[0]))
    # fp32 accumulators where the per-expert loop runs; torch's native bf16 grouped_mm on CUDA
    # (sync-free) returns bf16. Not fp16's: its range ends at 65504 (module docstring).
    mm = GroupedMmArgs(xs, args.w, args.offs, None, args.dtype, torch.float32)
    if args.dtype == torch.bfloat16 and xs.device.type == "cuda" and _grouped_mm_native_ok(
            GroupedMmArgs(xs, args.w, args.offs, None, args.dtype, args.dtype)):
        mm = GroupedMmArgs(xs, args.w, args.offs, None, args.dtype, args.dtype)
    y, live = _epilogue(args, grouped_mm_torch(mm))
    if out is None:
        return y.to(args.out_dtype)
    return out.copy_(torch.where(live, y.to(out.dtype), out))


def fused_grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *,
                         row_index: torch.Tensor | None = None,
                         row_weight: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, gate: str | None = None,
                         gate_layout: str = "concat", gate_alpha: float = 1.702,
                         gate_limit: float = 7.0,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(S, N or N / 2) in `dtype` (float32 or float64): the loop over experts, on x's device."""
    xs = x if row_index is None else x[row_index.long()]
    S, N = xs.shape[0], w.shape[2]
    h = torch.zeros(S, N, dtype=dtype, device=x.device)
    live = torch.zeros(S, 1, dtype=torch.bool, device=x.device)
    start = 0
    for e, end in enumerate(offs.to("cpu", torch.int64).tolist()):
        if end > start:
            h[start:end] = xs[start:end].to(dtype) @ w[e].to(dtype)
            if bias is not None:
                h[start:end] += bias[e].to(dtype)
            live[start:end] = True
        start = max(start, end)
    if gate is not None:
        g, u = split_gate_up(h, gate_layout)
        h = gate_torch(gate, g, u, gate_alpha, gate_limit)
    if row_weight is not None:
        h = h * torch.where(live, row_weight.to(dtype).unsqueeze(1), 1.0)
    return torch.where(live, h, 0.0)
