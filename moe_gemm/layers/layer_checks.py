"""The MoE layer's checks: constructor arguments, routing options, the forward's input and the
parameters against one another. Host-only (no GPU value is read), raising TypeError or
ValueError that names the argument and what it must be; shared by MoE, its functional form
moe_forward and the expert-parallel layer, so every entry point refuses alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from moe_gemm.layers.experts import FLOAT_DTYPES, check_gemm_options, resolve_activation
from moe_gemm.layers.routing import (
    BIASED_SCORINGS,
    ROUTER_DTYPES,
    check_flag,
    check_int,
    check_jitter_noise,
    check_router_weight,
    check_scaling_factor,
    check_scoring,
    sigmoid_grouped_topk,
    softmax_grouped_topk,
)
from moe_gemm.ops.validation import check_dense, shape_text

__all__ = ["check_hidden_states", "check_layer_args", "check_parameters", "check_routing"]


def check_routing(
    num_experts: int,
    top_k: int,
    scoring: str,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    renormalize: bool = True,
) -> None:
    num_experts, top_k = check_int("num_experts", num_experts), check_int("top_k", top_k)
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1; got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}]; got {top_k}")
    check_scoring(scoring)
    routed_scaling_factor = check_scaling_factor(routed_scaling_factor)
    check_flag("renormalize", renormalize)
    # Same checks the router runs per call, done once here so bad settings fail early.
    if scoring in BIASED_SCORINGS:  # (sqrtsoftplus: the same checks)
        sigmoid_grouped_topk(
            torch.zeros(0, num_experts), None, top_k, n_group, topk_group,
            routed_scaling_factor, renormalize,
        )
    else:
        softmax_grouped_topk(torch.zeros(0, num_experts), top_k, n_group, topk_group,
                             routed_scaling_factor, renormalize)


def check_layer_args(hidden_size, intermediate_size, shared_intermediate_size, num_experts, top_k,
                 scoring, renormalize, n_group, topk_group, routed_scaling_factor,
                 correction_bias, router_fp32, shared_expert_gate, activation, config, fused,
                 dtype, router_jitter_noise, device=None) -> bool:
    """MoE's constructor arguments, checked; returns correction_bias resolved."""
    check_gemm_options(config, fused)
    check_flag("router_fp32", router_fp32, none_ok=True)
    check_jitter_noise(router_jitter_noise)
    for name, value in (
        ("hidden_size", hidden_size),
        ("intermediate_size", intermediate_size),
        ("shared_intermediate_size", shared_intermediate_size),
    ):
        value = check_int(name, value)
        if value < (0 if name == "shared_intermediate_size" else 1):
            raise ValueError(f"{name} must be an int >= "
                             f"{0 if name == 'shared_intermediate_size' else 1}; got {value!r}")
    check_routing(num_experts, top_k, scoring, n_group, topk_group, routed_scaling_factor,
                   renormalize)
    if isinstance(correction_bias, torch.Tensor):
        # (moe_forward's correction_bias is the [E] tensor: here bool() of one raised inside
        # torch, or a one-element zero dropped the buffer)
        raise TypeError("correction_bias must be a bool or None (whether the layer keeps an "
                        "e_score_correction_bias buffer); got a tensor: load its values into "
                        "moe.e_score_correction_bias, or pass them to MoE.from_fused(..., "
                        "e_score_correction_bias=...)")
    # (a string such as "no" would be truthy: the buffer, or a gate of random weights on the
    # shared expert, where declined)
    correction_bias = check_flag("correction_bias", correction_bias, none_ok=True)
    check_flag("shared_expert_gate", shared_expert_gate)
    if correction_bias is None:
        correction_bias = scoring in BIASED_SCORINGS
    if correction_bias and scoring not in BIASED_SCORINGS:
        raise ValueError("correction_bias is used by scoring='sigmoid' or 'sqrtsoftplus' only")
    if shared_expert_gate and not shared_intermediate_size:
        raise ValueError("shared_expert_gate needs a shared expert (shared_intermediate_size > 0)")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32; got {dtype}")
    if dtype is None and torch.get_default_dtype() not in FLOAT_DTYPES:
        # As nn.Linear, dtype=None means torch's default dtype; a float64 one made float64
        # weights that the forward then refused (the grouped GEMMs, both backends, take
        # 16-bit and fp32 operands, and the layer never downcasts the caller's tokens).
        raise TypeError(
            f"MoE makes its parameters in torch's default dtype when dtype=None, which is "
            f"{torch.get_default_dtype()}; the layer runs in torch.bfloat16, torch.float16 or "
            "torch.float32: pass one as dtype= (e.g. MoE(..., dtype=torch.float32))")
    if isinstance(device, str):
        # (torch parses the string only when the first parameter is made: a typo such as
        # "gpu" was torch's RuntimeError from inside the constructor)
        try:
            torch.device(device)
        except RuntimeError:
            raise ValueError(f"device must be a torch.device, a device string such as 'cpu' "
                             f"or 'cuda:0', or an index; got {device!r}") from None
    resolve_activation(activation)  # fail early on a bad name
    return bool(correction_bias)


def check_hidden_states(x: object, H: int, device: torch.device) -> torch.Tensor:
    """MoE.forward's input: a float (..., H) tensor on the layer's device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor (..., H); got {type(x).__name__}")
    check_dense("hidden_states", x)
    if x.dim() < 1 or x.shape[-1] != H:
        raise ValueError(f"hidden_states must be (..., H) = (..., {H}); got {shape_text(x)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"hidden_states must be torch.bfloat16, torch.float16 or torch.float32; got {x.dtype}"
        )
    if x.device != device:
        raise ValueError(f"hidden_states is on {x.device} but the layer's weights are on {device}")
    return x


def check_parameters(p: Mapping[str, Any], H: int) -> None:
    """The router and expert weights against one another, as the loaders check them, for
            weights assigned after construction (`moe.router_weight = nn.Parameter(...)`): a
            router of another E routed tokens to experts that do not exist (their slots silently
            dropped) or never to some, one on the meta device gave garbage routing, one of
            another H failed inside F.linear, and experts of two E failed with a message about
            the grouped GEMM's offs, which the caller never passed; experts of two dtypes or
            devices (a load_state_dict(..., assign=True) of a mixed checkpoint, a functional_call)
            failed with one that blamed the caller's valid input. Host-only checks, the passing
            case first: it runs on every forward (~2 us of CPU)."""
    gu, down, rw = p["gate_up_proj"], p["down_proj"], p["router_weight"]
    if isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and isinstance(
            rw, torch.Tensor) and gu.dim() == 3:
        E, I2 = gu.shape[0], gu.shape[1]
        if (gu.shape[2] == H and not I2 % 2 and down.shape == (E, H, I2 // 2)
                and down.dtype == gu.dtype and down.device == gu.device
                and rw.shape == (E, H) and rw.device == gu.device and rw.dtype in ROUTER_DTYPES):
            return
    for name, t in (("gate_up_proj", gu), ("down_proj", down)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"the layer's {name} must be a tensor; got {type(t).__name__}")
    if gu.dim() != 3 or gu.shape[1] % 2 or gu.shape[2] != H:
        raise ValueError(f"the layer's gate_up_proj must be (E, 2I, H) = (E, 2I, {H}); got "
                         f"{shape_text(gu)}")
    E, I = gu.shape[0], gu.shape[1] // 2
    if tuple(down.shape) != (E, H, I):
        raise ValueError(f"the layer's down_proj must be (E, H, I) = ({E}, {H}, {I}) to "
                         f"match gate_up_proj {shape_text(gu)}; got {shape_text(down)}")
    if down.dtype != gu.dtype:
        raise TypeError(f"the layer's down_proj is {down.dtype} but its gate_up_proj is "
                        f"{gu.dtype}; the expert weights must share one dtype (cast the "
                        "layer with .to(dtype))")
    if down.device != gu.device:
        raise ValueError(f"the layer's down_proj is on {down.device} but its gate_up_proj "
                         f"is on {gu.device}")
    check_router_weight(rw, E, H)
    if rw.device != gu.device:
        raise ValueError(f"the layer's router_weight is on {rw.device} but its expert "
                         f"weights are on {gu.device}")
