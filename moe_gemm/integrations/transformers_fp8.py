"""moe_gemm as an experts implementation of transformers' FP8 models.

A checkpoint quantized with transformers' fine-grained FP8 (DeepSeek-V3, Qwen3 FP8 releases,
GLM FP8, ...) gets `FP8Experts` modules, which dispatch through their own registry,
`transformers.integrations.finegrained_fp8.ALL_FP8_EXPERTS_FUNCTIONS`, not the 16-bit one.
`register()` (moe_gemm.integrations.transformers) adds "moe_gemm" there too, so

    model.set_experts_implementation("moe_gemm")

also runs an FP8 model's experts on moe_gemm: the weights stay FP8 with their decoding scales
(128x128 blocks, or one scale per expert, widened to one per channel), the tokens are
quantized on the fly (1x128 groups, or per token), and the GEMMs are moe_gemm's FP8 grouped
GEMMs (layers/experts_fp8.expert_ffn_fp8). The module's own `_apply_gate` gates the gate/up
GEMM's output, so soft-capped or clamped gates work as the module defines them. On the CPU the
same path runs through the torch backend (transformers' own FP8 experts need a GPU kernel).

What it refuses, with a ValueError naming it: static activation scales (the checkpoint's
calibrated input scales; moe_gemm quantizes each token dynamically), experts without a gate
projection, expert biases, FP4 experts, weight blocks other than 128x128, and hidden or
intermediate sizes that are not multiples of 128 (block scales) or of 16 (per-tensor scales).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_gemm.integrations.inputs import check_expert_inputs
from moe_gemm.layers.experts_fp8 import (
    FP8_DTYPES,
    check_fp8_experts,
    expert_ffn_fp8,
    hf_fp8_scales,
)

__all__ = ["moe_gemm_fp8_experts_forward", "register_fp8"]


def moe_gemm_fp8_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers FP8Experts forward on moe_gemm (the "moe_gemm" FP8 experts implementation).

    Args:
        self: transformers' FP8Experts (gate_up_proj [E, 2I, H] FP8 and its scale_inv,
            down_proj [E, H, I] FP8 and its scale_inv).
        hidden_states: [T, H] in bf16, fp16 or fp32.
        top_k_index: [T, k] expert ids (ids past the experts, expert parallelism's
            sentinels, contribute nothing).
        top_k_weights: [T, k] routing weights.

    Returns:
        [T, H] in hidden_states' dtype.

    Raises:
        ValueError: a module this path cannot run as it is defined (module docstring), or
            inputs whose shapes or devices do not fit it.
        TypeError: inputs of the wrong dtypes (ids must be integers).
    """
    _check_module(self)
    gate_up, down = self.gate_up_proj, self.down_proj
    scales = hf_fp8_scales(self)  # (ValueError for blocks other than 128x128)
    assert scales is not None  # (checked by _check_module)
    s1, s2 = scales
    check_fp8_experts(gate_up, down, s1, s2)
    num_experts = gate_up.shape[0]
    if getattr(self, "num_experts", num_experts) != num_experts:
        raise ValueError(f"{type(self).__name__}.num_experts = {self.num_experts} but its "
                         f"weights hold {num_experts} experts")
    check_expert_inputs(hidden_states, top_k_index, top_k_weights,
                        hidden_size=gate_up.shape[2], device=gate_up.device,
                        token_dtypes=(torch.bfloat16, torch.float16, torch.float32))
    ids = top_k_index
    if ids.dtype not in (torch.int64, torch.int32):
        ids = ids.long()
    y = expert_ffn_fp8(hidden_states, ids, top_k_weights, gate_up, s1, down, s2,
                       self._apply_gate, config=getattr(self, "moe_gemm_config", None))
    return y.to(hidden_states.dtype)


def _check_module(experts: nn.Module) -> None:
    name = type(experts).__name__
    problems = []
    if getattr(experts, "activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme={experts.activation_scheme!r} (moe_gemm quantizes "
                        "the tokens dynamically, per token)")
    gated = getattr(experts, "has_gate", True)
    if not gated:
        problems.append("has_gate=False (no gate projection)")
    if getattr(experts, "has_bias", False):
        problems.append("has_bias=True (expert biases)")
    w = getattr(experts, "gate_up_proj", None)
    if gated and (not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in FP8_DTYPES
                  or getattr(experts, "gate_up_proj_scale_inv", None) is None):
        problems.append("weights that are not FP8 [E, 2I, H] with their scale_inv (FP4 "
                        "experts among them)")
    if problems:
        raise ValueError(f"the moe_gemm FP8 experts implementation cannot run {name} with "
                         f"{'; '.join(problems)}")


def register_fp8() -> bool:
    """Add "moe_gemm" to transformers' FP8 experts registry (idempotent); False when this
    transformers has no fine-grained FP8 integration."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return False
    from moe_gemm.integrations.transformers import NAME

    if FP8ExpertsInterface._global_mapping.get(NAME) is not moe_gemm_fp8_experts_forward:
        FP8ExpertsInterface.register(NAME, moe_gemm_fp8_experts_forward)
    return True
