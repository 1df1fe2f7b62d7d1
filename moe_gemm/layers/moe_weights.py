"""The MoE layer's weights: their init, their FP8 form, their views and their checks.

MoE inherits them from the MoEWeights mixin here: `reset_parameters` (nn.Linear's init per
expert, FP8 experts drawn in float32 and quantized), `quantize_fp8` and the `fp8` granularity,
the no-copy `w_gate_up` / `w_down` views the grouped GEMMs take, the loading rule for FP8 and
16-bit weights, the dtypes `module.to(dtype)` keeps, and the forward's checks of weights
assigned after construction. The mixin reads the attributes MoE's constructor creates
(router_weight, gate_up_proj, down_proj, their *_scale_inv, e_score_correction_bias,
shared_experts, shared_expert_gate, hidden_size, intermediate_size).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_gemm.layers.experts import FLOAT_DTYPES
from moe_gemm.layers.experts_fp8 import (
    FP8_DTYPES,
    check_fp8_experts,
    expert_weight_kind_errors,
    keep_dtypes,
    quantize_experts,
    scale_granularity,
)
from moe_gemm.layers.layer_checks import check_parameters

__all__ = ["MoEWeights"]


def _init_parameters(moe: MoEWeights) -> None:
    """MoE.reset_parameters: nn.Linear's default init per expert, the shared expert's own."""
    H, I = moe.hidden_size, moe.intermediate_size
    nn.init.uniform_(moe.router_weight, -1 / math.sqrt(H), 1 / math.sqrt(H))
    if moe.gate_up_proj_scale_inv is None:
        nn.init.uniform_(moe.gate_up_proj, -1 / math.sqrt(H), 1 / math.sqrt(H))
        nn.init.uniform_(moe.down_proj, -1 / math.sqrt(I), 1 / math.sqrt(I))
    else:
        _init_fp8_experts(moe)
    if moe.e_score_correction_bias is not None:
        moe.e_score_correction_bias.zero_()
    if moe.shared_experts is not None:
        for lin in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj,
                    moe.shared_experts.down_proj):
            lin.reset_parameters()
    if moe.shared_expert_gate is not None:
        moe.shared_expert_gate.reset_parameters()


def _init_fp8_experts(moe: MoEWeights) -> None:
    """The init of FP8 experts: torch draws no FP8 values (nn.init.uniform_ is not implemented
    for them; the meta-device recipe to_empty + reset_parameters needs it), so each expert is
    drawn in float32 and quantized into the layer's own tensors, with its granularity and FP8
    dtype (one expert's float32 copy at a time)."""
    H, I = moe.hidden_size, moe.intermediate_size
    granularity, fp8 = moe.fp8, moe.gate_up_proj.dtype
    for e in range(moe.gate_up_proj.shape[0]):
        gu = torch.empty((1, *moe.gate_up_proj.shape[1:]), device=moe.gate_up_proj.device)
        down = torch.empty((1, *moe.down_proj.shape[1:]), device=moe.down_proj.device)
        nn.init.uniform_(gu, -1 / math.sqrt(H), 1 / math.sqrt(H))
        nn.init.uniform_(down, -1 / math.sqrt(I), 1 / math.sqrt(I))
        q1, s1, q2, s2 = quantize_experts(gu, down, granularity, fp8)
        moe.gate_up_proj[e].copy_(q1[0])
        moe.gate_up_proj_scale_inv[e].copy_(s1[0])
        moe.down_proj[e].copy_(q2[0])
        moe.down_proj_scale_inv[e].copy_(s2[0])



class MoEWeights(nn.Module):
    """MoE's weight handling (MoE inherits it; see the module docstring)."""

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (FP8
        experts drawn in float32 and quantized into the layer's tensors)."""
        _init_parameters(self)

    @property
    def fp8(self) -> str | None:
        """The FP8 experts' scale granularity ("block" or "row"), or None (16-bit experts)."""
        s = self.gate_up_proj_scale_inv
        return None if s is None else scale_granularity(s)

    @torch.no_grad()
    def quantize_fp8(self, granularity: str = "block",
                     dtype: torch.dtype = torch.float8_e4m3fn) -> MoEWeights:
        """Turn the 16-bit expert weights into FP8 in place (the router and the shared expert
        stay as they are) and return the layer. granularity "block": 128x128 weight blocks
        with activations in 1x128 groups (hidden and intermediate sizes multiples of 128);
        "row": a scale per output channel, activations per token. dtype: the FP8 format of
        the weights and of the activations quantized on the fly, torch.float8_e4m3fn or
        torch.float8_e5m2. FP8 experts run the unfused FP8 grouped GEMMs whatever `fused`
        says."""
        if self.fp8 is not None:
            raise ValueError(f"the experts are FP8 already ({self.fp8} scales)")
        q1, s1, q2, s2 = quantize_experts(self.gate_up_proj, self.down_proj, granularity, dtype)
        check_fp8_experts(q1, q2, s1, s2)
        self.gate_up_proj = nn.Parameter(q1, requires_grad=False)
        self.down_proj = nn.Parameter(q2, requires_grad=False)
        self.gate_up_proj_scale_inv = nn.Parameter(s1, requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(s2, requires_grad=False)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # FP8 expert weights into a 16-bit layer or 16-bit ones into an FP8 layer: an error
        # (as torch reports a size mismatch: listed, that parameter left as it was), never a
        # cast copy under the wrong scales.
        wrong = expert_weight_kind_errors(
            {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}, state_dict, prefix)
        for key, message in wrong.items():
            state_dict.pop(key)
            error_msgs.append(message)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        missing_keys[:] = [k for k in missing_keys if k not in wrong]

    def _apply(self, fn, recurse=True):
        # Under module.to(dtype) / .half() these keep their dtypes (experts_fp8.keep_dtypes):
        # FP8 experts and their scales, and the correction bias, which transformers keeps in
        # float32 too (DeepSeek-V3 / GLM-4-MoE's _keep_in_fp32_modules_strict). It only
        # decides the selection, by small differences of sigmoid scores near 1 plus a bias of
        # a similar size, where bf16's spacing is 2^-8 to 2^-7: rounding the bias there
        # changed the chosen experts of 5-16% of the tokens in 64-expert tests.
        keep: tuple[torch.Tensor, ...] = ()
        if self.gate_up_proj_scale_inv is not None:
            keep += (self.gate_up_proj, self.down_proj, self.gate_up_proj_scale_inv,
                     self.down_proj_scale_inv)
        if self.e_score_correction_bias is not None:
            keep += (self.e_score_correction_bias,)
        if keep:
            fn = keep_dtypes(fn, keep)
        return super()._apply(fn, recurse)

    @property
    def w_gate_up(self) -> torch.Tensor:
        """[E, H, 2I] view of gate_up_proj (no copy), the B operand of the first GEMM."""
        return self.gate_up_proj.transpose(1, 2)

    @property
    def w_down(self) -> torch.Tensor:
        """[E, I, H] view of down_proj (no copy), the B operand of the second GEMM."""
        return self.down_proj.transpose(1, 2)

    def _check_parameters(self) -> None:
        """The router and expert weights against one another (layer_checks.check_parameters),
        and FP8 experts' scales against their weights (experts_fp8.check_fp8_experts), for
        tensors assigned after construction; on every forward (~2 us of CPU, ~4 us more with
        FP8 experts). A weight that is not a registered Parameter (a parametrization's, or a
        plain tensor set after `del layer.down_proj`) is read as the forward reads it, by
        attribute (indexing _parameters was a KeyError there)."""
        p = self._parameters
        if not ("gate_up_proj" in p and "down_proj" in p and "router_weight" in p):
            p = {name: getattr(self, name, None)
                 for name in ("gate_up_proj", "down_proj", "router_weight")}
        check_parameters(p, self.hidden_size)
        # (unchecked, a scale of another shape failed with an IndexError inside the GEMM, a
        # None one with an AttributeError, and FP8 weights without scales were told to cast
        # the layer, which would drop the scales' values)
        s1, s2 = self.gate_up_proj_scale_inv, self.down_proj_scale_inv
        if s1 is not None or s2 is not None or p["gate_up_proj"].dtype in FP8_DTYPES:
            check_fp8_experts(p["gate_up_proj"], p["down_proj"], s1, s2)

    def check_weight_dtype(self, layer: str = "MoE") -> None:
        """A layer cast with .double() (16-bit experts in a dtype the kernels do not take): a
        TypeError naming the weights' dtype, rather than one that blames a valid input's."""
        w = self.gate_up_proj
        if self.gate_up_proj_scale_inv is None and w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"the layer's weights are {w.dtype}; {layer} runs in "
                            "torch.bfloat16, torch.float16 or torch.float32: cast the layer "
                            "with .to(dtype)")
