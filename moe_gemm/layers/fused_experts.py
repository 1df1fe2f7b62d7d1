"""The routed experts on the fused kernel: two launches and a combine, no other pass over the
routed rows.

    perm = permute_by_expert(ids)                                  as the unfused path
    a = fused_grouped_mm(x, w_gate_up, offs, row_index=token,      (S, I): gather-A, bias,
                         gate=act, bias=b1)                        gated epilogue
    y = fused_grouped_mm(a, w_down, offs, bias=b2,                 (S, H): bias and the
                         row_weight=weights in row order)          routing weight per row
    out[t] = sum_j y[row of (t, j)]                                (T, H) combine_rows

against the unfused path (layers/experts.py) this drops the permuted copy of x (S x H written
and read where the kernel gathers: below 32 routed rows; elsewhere one index_select makes
it, the faster way past decode), the (S, 2I) gate-up output and the activation pass over
it (written, read, (S, I) written again), and the weight multiply of the combine.

The combine: each routed row is scaled in the down GEMM's epilogue (fp32, before its one
rounding) and the k rows of a token are then summed by one deterministic gather-reduce
(ops/combine.combine_rows, fp32 accumulation): the same bytes as an atomic scatter-add of the
rows into an fp32 buffer (every row is read or written once either way), without its zeroed
(T, H) fp32 buffer and final cast, and with results that do not depend on the order atomics
land in.

Routing is exactly the unfused path's (the same permutation, dropped expert-parallel slots
contribute nothing), so the two paths agree to rounding; the unfused one stays the reference
and the torch backend's path. Inference only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_gemm.config import GemmConfig
from moe_gemm.env import env_value
from moe_gemm.layers.gate_activations import ClampedSiLU, ClampedSwiGLU
from moe_gemm.layers.routing import permute_by_expert
from moe_gemm.ops.combine import combine_rows
from moe_gemm.ops.fused import fused_grouped_mm
from moe_gemm.ops.token_gather import gather_rows

__all__ = ["FUSED_ENV", "GATHER_ENV", "FusedGate", "fused_expert_ffn", "fused_gate_for",
           "use_fused"]

# MOE_GEMM_FUSED=0 keeps the MoE layers on the unfused path where they would fuse (read when
# a layer decides, i.e. per forward; a compiled graph keeps the decision it was traced with).
# MOE_GEMM_FUSED_GATHER=0 keeps the fused path but gathers the tokens with index_select
# instead of inside the kernel (the gather-A loader off).
FUSED_ENV = "MOE_GEMM_FUSED"
GATHER_ENV = "MOE_GEMM_FUSED_GATHER"
_NAMED_GATES = ("silu", "gelu", "gelu_tanh")
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FusedGate:
    """The gated activation as the fused kernel computes it: gate (kernels/sm90/constants
    GATES), the weight's gate layout ("concat", "interleaved" or "alternating") and
    clamped_swiglu's alpha and limit."""

    gate: str
    layout: str = "concat"
    alpha: float = 1.702
    limit: float = 7.0


def fused_gate_for(activation: object, layout: str = "concat") -> FusedGate | None:
    """The FusedGate of a named activation ("silu", "gelu", "gelu_tanh"), a ClampedSiLU or a
    ClampedSwiGLU, None for others (a callable: only the unfused path can apply it)."""
    if isinstance(activation, str) and activation in _NAMED_GATES:
        return FusedGate(activation, layout)
    if isinstance(activation, ClampedSiLU):
        return FusedGate("clamped_silu", layout, 0.0, activation.limit)
    if isinstance(activation, ClampedSwiGLU):
        return FusedGate("clamped_swiglu", layout, activation.alpha, activation.limit)
    return None


@torch.compiler.assume_constant_result
def _gather_in_kernel() -> bool:
    return bool(env_value(GATHER_ENV))


@torch.compiler.assume_constant_result
def _kernel_ready(device: str) -> bool:
    """Whether the fused kernel can run on `device` (a constant under torch.compile)."""
    from moe_gemm.capability import cute_problem

    return bool(env_value(FUSED_ENV)) and cute_problem(torch.device(device)) is None


def use_fused(fused: bool | None, spec: FusedGate | None, x: torch.Tensor,
              w_gate_up: torch.Tensor, w_down: torch.Tensor, config: GemmConfig | None,
              post_fn: object = None) -> bool:
    """Whether the experts take the fused path.

    fused: None = where the Hopper kernel runs and the operands fit it (decided from dtypes,
    shapes and strides only, so a compiled graph decides once); True = always (the fused ops'
    torch backend off the GPU); False = never. A callable activation or a post-expert norm
    (between the down GEMM and the weights) always takes the unfused path."""
    if spec is None or post_fn is not None or fused is False:
        return False
    if fused:
        return True
    if config is not None and config.backend == "torch":
        return False
    if x.device.type != "cuda" or x.dtype not in _KERNEL_DTYPES:
        return False
    H, I = w_down.shape[2], w_down.shape[1]
    if H % 8 or I % 8:  # 16-byte rows of x, of the gated output and of y (TMA)
        return False
    if spec.layout == "concat" and w_gate_up.stride(1) != 1:  # K-major gate-up weight
        return False
    if spec.layout == "interleaved" and w_gate_up.shape[2] % 16:
        return False
    return _kernel_ready(str(x.device))


def fused_expert_ffn(
    x: torch.Tensor,  # (T, H)
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k)
    w_gate_up: torch.Tensor,  # (E, H, 2I)
    w_down: torch.Tensor,  # (E, I, H)
    spec: FusedGate,
    *,
    bias_gate_up: torch.Tensor | None = None,  # (E, 2I)
    bias_down: torch.Tensor | None = None,  # (E, H)
    config: GemmConfig | None = None,
    ids_in_range: bool = False,
    num_valid_slots: int | None = None,
) -> torch.Tensor:
    """The routed experts on the fused kernel, for checked arguments (see the module
    docstring; ids_in_range as layers/experts.expert_ffn). Returns (T, H) in x's dtype.

    num_valid_slots: the number of slots whose id is in [0, E), when the caller knows it on
    the host without a sync (expert parallelism's dispatch: Dispatched.num_valid_slots); only
    those rows are then gathered and computed, as expert_parallel.local_expert_ffn does
    (a top-8 token received by one of 8 ranks has ~1 valid slot of 8). It must be exact.
    None: every slot gets a row, the dropped ones past offs[-1].
    """
    if config is not None and config.swap_ab and spec.layout != "concat":
        # The fused kernels run swapped tiles over concat gate-up weights only
        # (fused_grouped_mm refuses the pin for the other layouts): the rules decide.
        config = config.replace(swap_ab=None)
    E = w_gate_up.shape[0]
    perm = permute_by_expert(topk_ids, E, ids_in_range=ids_in_range)
    # The valid slots sort first: rows [0, S) are theirs (offs[-1] = S).
    S = perm.token_index.shape[0] if num_valid_slots is None else num_valid_slots
    token_index = perm.token_index[:S]
    # Each routed row's weight, in row order (dropped slots: 0; their rows are past offs[-1]
    # and the kernels store zeros there without reading it).
    weight = perm.drop_masked(topk_weights).reshape(-1).float().index_select(
        0, perm.slot_order[:S])
    if _gather_in_kernel():
        xs, index = x, token_index.to(torch.int32)
    else:
        xs, index = gather_rows(x, token_index), None
    a = fused_grouped_mm(xs, w_gate_up, perm.offs, row_index=index, bias=bias_gate_up,
                         gate=spec.gate, gate_layout=spec.layout, gate_alpha=spec.alpha,
                         gate_limit=spec.limit, config=config)
    if num_valid_slots is None:
        y = fused_grouped_mm(a, w_down, perm.offs, bias=bias_down, row_weight=weight,
                             config=config)
        return combine_rows(y, perm.row_of_slot)
    # One zero row past the S computed ones, which the dropped slots gather (the combine is
    # unweighted: their rows must be zeros, not just carry weight 0).
    y = a.new_empty(S + 1, w_down.shape[2])
    y[S:].zero_()
    fused_grouped_mm(a, w_down, perm.offs, bias=bias_down, row_weight=weight, out=y[:S],
                     config=config)
    return combine_rows(y, perm.row_of_slot.clamp(max=S))
