"""moe_gemm as a transformers 5 experts implementation.

transformers' MoE models keep their experts in a module decorated with
`@use_experts_implementation` (fused `gate_up_proj`, `down_proj`, `act_fn` and layout flags);
its forward dispatches on `config._experts_implementation` through
`transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`, an `ExpertsInterface` whose entries are
`fn(self, hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`.
`register()` adds "moe_gemm" there, after which

    model.set_experts_implementation("moe_gemm")
    AutoModelForCausalLM.from_pretrained(..., experts_implementation="moe_gemm")

run every MoE layer's experts on moe_gemm: the model's own router, then our device-side
permutation, two grouped GEMMs and the fused weighted combine.

`moe_gemm_experts_forward` mirrors transformers' "grouped_mm" implementation flag by flag:
is_transposed (weights already (E, H, 2I) / (E, I, H)), has_gate (gate_up_proj and the
module's own `_apply_gate`, so custom gates such as GPT-OSS's clamped, interleaved SwiGLU
work unchanged; else up_proj and act_fn), has_bias (per-expert biases gathered per row),
has_post_expert_norm, and expert-parallel sentinels (ids >= num_experts contribute nothing).
On a Hopper GPU, gates the fused kernel knows (the default act_fn(gate) * up with silu / gelu /
gelu_tanh, GPT-OSS's clamped SwiGLU) run on it (layers/fused_experts.py); set
`experts.moe_gemm_fused = False` on a module to keep it on the unfused path (True forces the
fused ops, their torch backend off the GPU). Like the rest of moe_gemm's MoE path it is
inference-only: a backward through it raises. transformers' FP8 experts (FP8 checkpoints) have
a registry of their own; `register()` adds "moe_gemm" there too (transformers_fp8.py).
"""

from __future__ import annotations

import functools
import math
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

try:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "moe_gemm.integrations.transformers needs transformers >= 5 (with "
        'transformers.integrations.moe.ExpertsInterface): pip install "moe-gemm[transformers]"'
    ) from exc

from moe_gemm.config import GemmConfig
from moe_gemm.integrations.inputs import check_expert_inputs
from moe_gemm.layers.checkpoints import moe_from_tensors
from moe_gemm.layers.experts import FLOAT_DTYPES, Activation, expert_ffn
from moe_gemm.layers.fused_experts import FusedGate, fused_gate_for
from moe_gemm.layers.gate_activations import (
    ClampedSiLU,
    ClampedSwiGLU,
    HalvesGate,
    PostClampedSiLU,
)
from moe_gemm.layers.moe import MoE
from moe_gemm.layers.routing import check_flag
from moe_gemm.ops.validation import shape_text

__all__ = ["NAME", "hf_activation", "is_registered", "moe_from_hf", "moe_gemm_experts_forward",
           "register"]

NAME = "moe_gemm"


def moe_gemm_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers experts forward on moe_gemm (the "moe_gemm" experts implementation).

    Args:
        self: the transformers experts module (MixtralExperts, DeepseekV3Experts, ...).
        hidden_states: [T, H].
        top_k_index: [T, k] expert ids from the model's router.
        top_k_weights: [T, k] routing weights.

    Returns:
        [T, H] in hidden_states' dtype.

    Raises:
        ValueError: a module without the attributes `@use_experts_implementation` sets, with
            weights or biases that do not fit one another, or inputs whose shapes or devices
            do not fit it.
        TypeError: inputs of the wrong dtypes (ids must be integers, weights floating), or
            expert weights other than bf16, fp16 or fp32 or of two dtypes.
    """
    has_gate = getattr(self, "has_gate", True)
    has_bias = getattr(self, "has_bias", False)
    transposed = getattr(self, "is_transposed", False)
    w_in = self.gate_up_proj if has_gate else self.up_proj
    w_out = self.down_proj
    bias_in = bias_out = None
    if has_bias:
        bias_in = self.gate_up_proj_bias if has_gate else self.up_proj_bias
        bias_out = self.down_proj_bias
    _check_weights_once(self, has_gate, transposed, w_in, w_out, bias_in, bias_out)
    if not transposed:
        # (E, N, K) nn.Linear-style storage -> (E, K, N) views; no copy.
        w_in, w_out = w_in.transpose(-2, -1), w_out.transpose(-2, -1)
    check_expert_inputs(hidden_states, top_k_index, top_k_weights, hidden_size=w_in.shape[1],
                        device=w_in.device)
    gate_fn = self._apply_gate if has_gate else self.act_fn
    post_fn = self.post_expert_norm if getattr(self, "has_post_expert_norm", False) else None
    # As transformers' grouped_mm path: the experts run in the weights' dtype (autocast can
    # hand us fp32 activations with bf16 weights).
    x = hidden_states.to(w_in.dtype)
    num_experts = w_in.shape[0]
    ids = top_k_index
    if getattr(self, "num_experts", num_experts) != num_experts:
        raise ValueError(
            f"{type(self).__name__}.num_experts = {self.num_experts} but its weights hold "
            f"{num_experts} experts"
        )
    if ids.dtype not in (torch.int64, torch.int32):
        ids = ids.long()

    # (a bool or None: a string such as "no" would be truthy and force the fused path)
    fused = check_flag("moe_gemm_fused", getattr(self, "moe_gemm_fused", None), none_ok=True)
    y = expert_ffn(x, ids, top_k_weights, w_in, w_out, gate_fn, bias_gate_up=bias_in,
                   bias_down=bias_out, post_fn=post_fn,
                   fused_gate=hf_fused_gate(self) if has_gate else None, fused=fused)
    return y.to(hidden_states.dtype)


# Weight layouts that passed _check_weights. Its outcome depends on the key alone: the
# module's class (named in the messages), its gate (_gate_of: whether gate_up halves), the
# layout flags, and the tensors' shapes, dtypes and devices; it reads no values, strides or
# addresses, so the key holds none (an in-place update or a new tensor of a checked layout
# needs no new check, and a data pointer or version counter would not see an in-place
# resize_). A hit costs 1.0-1.5 us per forward where the check took 3.2-3.6 us (CPU, timeit).
# Layouts are few per model; the bound only keeps a process that makes many from growing it.
_CHECKED_LAYOUTS: dict[tuple[Any, ...], None] = {}
_MAX_CHECKED_LAYOUTS = 1024


def _check_weights_once(experts: nn.Module, has_gate: bool, transposed: bool,
                        w_in: torch.Tensor, w_out: torch.Tensor, bias_in: torch.Tensor | None,
                        bias_out: torch.Tensor | None) -> None:
    """_check_weights, run once per weight layout (w_in, w_out: the module's gate_up_proj
    or up_proj and down_proj as stored)."""
    if w_in.dim() != 3 or w_out.dim() != 3:
        raise ValueError(
            f"{type(experts).__name__}: expected 3-D fused expert weights; got "
            f"{shape_text(w_in)} and {shape_text(w_out)}"
        )
    if torch.compiler.is_compiling():
        # Traced once and guarded on these shapes: no per-call cost to save, and a global
        # dict mutated inside a traced function is a side effect Dynamo must replay.
        _check_weights(experts, has_gate, transposed, bias_in, bias_out)
        return
    cls = type(experts)
    key = (cls, _gate_of(experts), has_gate, transposed,
           w_in.shape, w_in.dtype, w_in.device, w_out.shape, w_out.dtype, w_out.device,
           None if bias_in is None else (bias_in.shape, bias_in.device),
           None if bias_out is None else (bias_out.shape, bias_out.device))
    if key in _CHECKED_LAYOUTS:
        return
    _check_weights(experts, has_gate, transposed, bias_in, bias_out)
    if len(_CHECKED_LAYOUTS) >= _MAX_CHECKED_LAYOUTS:
        _CHECKED_LAYOUTS.clear()
    _CHECKED_LAYOUTS[key] = None


def _check_weights(experts: nn.Module, has_gate: bool, transposed: bool,
                   bias_in: torch.Tensor | None, bias_out: torch.Tensor | None) -> None:
    """The experts module's 3-D weights and biases against one another, named as the module
    stores them (TypeError / ValueError). Unchecked, a down projection to another width gave a
    (T, H') result where transformers' own implementations raise (and a (T, 1) one would
    broadcast into the residual stream), and the other mismatches failed inside the GEMMs or
    the bias gathers with messages about x, w, offs or an index. The intermediate size is
    checked where the gate is known to halve gate_up (transformers' default gate and
    GPT-OSS's); another gate's output width is the module's own business."""
    name = type(experts).__name__
    in_name = "gate_up_proj" if has_gate else "up_proj"
    w_in, w_out = getattr(experts, in_name), experts.down_proj
    for n, w in ((in_name, w_in), ("down_proj", w_out)):
        if w.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}.{n} is {w.dtype}; the moe_gemm experts implementation runs "
                            "bf16, fp16 or fp32 experts (cast the model with .to(dtype))")
    if w_out.dtype != w_in.dtype:
        raise TypeError(f"{name}.down_proj is {w_out.dtype} but {in_name} is {w_in.dtype}; "
                        "they must match")
    if w_out.device != w_in.device:
        raise ValueError(f"{name}.down_proj is on {w_out.device} but {in_name} is on "
                         f"{w_in.device}")
    # E experts, hidden size H, N gate-up (or up) columns; down_proj is (E, I, H) transposed,
    # else (E, H, I).
    E, H, N = (w_in.shape if transposed else (w_in.shape[0], w_in.shape[2], w_in.shape[1]))
    gate = _gate_of(experts)
    halves = has_gate and gate is not None and (
        gate in (_default_apply_gate(), _gpt_oss_apply_gate())
        or _limit_gate_kind(experts, gate) is not None)
    if halves and N % 2:
        layout = "(E, H, 2I)" if transposed else "(E, 2I, H)"
        raise ValueError(f"{name}.{in_name} must be {layout}, gate and up halves; got "
                         f"{shape_text(w_in)}")
    I = N // 2 if halves else None if has_gate else N  # None: whatever the gate makes
    down_E, down_I, down_H = (w_out.shape if transposed
                              else (w_out.shape[0], w_out.shape[2], w_out.shape[1]))
    if (down_E, down_H) != (E, H) or (I is not None and down_I != I):
        i = "I" if I is None else I
        want = f"(E, I, H) = ({E}, {i}, {H})" if transposed else f"(E, H, I) = ({E}, {H}, {i})"
        raise ValueError(f"{name}.down_proj must be {want} to match {in_name} "
                         f"{shape_text(w_in)}; got {shape_text(w_out)}")
    for n, b, form, width in ((f"{in_name}_bias", bias_in, "(E, 2I)" if has_gate else "(E, I)",
                               N), ("down_proj_bias", bias_out, "(E, H)", H)):
        if b is None:
            continue
        if tuple(b.shape) != (E, width):
            raise ValueError(f"{name}.{n} must be {form} = ({E}, {width}); got "
                             f"{shape_text(b)}")
        if b.device != w_in.device:
            raise ValueError(f"{name}.{n} is on {b.device} but {in_name} is on {w_in.device}")


def hf_fused_gate(experts: nn.Module) -> FusedGate | None:
    """What the experts module's `_apply_gate` computes, as the fused kernel does it, or None
    (a gate only the module itself can apply: the unfused path runs it).

    transformers' default gate is act_fn(gate) * up over concatenated halves; GPT-OSS's is the
    clamped SwiGLU over alternating columns with the module's alpha and limit; the swiglu_limit
    gates over concatenated halves (_LIMIT_GATES) are the clamped SiLU (DeepSeek-V4, GLM-5-Next,
    HY-V4) or GPT-OSS's clamped SwiGLU (MiniMax-M3). Each is checked by identity (its class's
    _apply_gate), so a subclass or an instance that changes it is not taken for it
    (_gate_of)."""
    gate = _gate_of(experts)
    if gate is None:
        return None
    if gate is _default_apply_gate():
        return fused_gate_for(hf_activation(experts.act_fn), "concat")
    if gate is _gpt_oss_apply_gate():
        return FusedGate("clamped_swiglu", "alternating", float(experts.alpha),
                         float(experts.limit))
    kind = _limit_gate_kind(experts, gate)
    if kind == "clamped_silu":
        limit = _positive_limit(getattr(experts, _LIMIT_GATES[type(experts).__name__][2]))
        act = getattr(experts, "act_fn", None)  # (GLM-5-Next's and HY-V4's call F.silu)
        if limit is None or (act is not None and hf_activation(act) != "silu"):
            return None  # (no clamp, or another activation: the module's own gate runs)
        return FusedGate("clamped_silu", "concat", 0.0, limit)
    if kind == "post_clamped_silu":
        # (no limit on this layer: the module's gate is the plain act_fn(gate) * up)
        return (fused_gate_for(hf_activation(experts.act_fn), "concat")
                if experts.limit is None else None)
    if kind == "clamped_swiglu":
        limit = _positive_limit(experts.swiglu_limit)
        alpha = getattr(experts, "swiglu_alpha", None)
        if limit is None or not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            return None
        return FusedGate("clamped_swiglu", "concat", float(alpha), limit)
    return None


# transformers experts classes whose _apply_gate clamps the gate from above and up into
# [-limit, limit] over concatenated gate | up halves: class name -> (modeling module, kind,
# the limit's attribute). "clamped_silu": act_fn(gate) * up with act_fn SiLU; "clamped_swiglu":
# GPT-OSS's (up + 1) * gate * sigmoid(alpha * gate) with the module's swiglu_alpha.
# "post_clamped_silu": min(act_fn(gate), limit) * clamp(up) (Step-3.7, Bailing-Hybrid; limit
# None on layers without one), which the fused kernel does not compute.
_LIMIT_GATES = {
    "DeepseekV4Experts": ("deepseek_v4", "clamped_silu", "limit"),
    "Glm5NextTextExperts": ("glm5_next", "clamped_silu", "swiglu_limit"),
    "HYV4Experts": ("hy_v4", "clamped_silu", "swiglu_limit"),
    "HYV4VLExperts": ("hy_v4_vl", "clamped_silu", "swiglu_limit"),
    "MiniMaxM3VLExperts": ("minimax_m3_vl", "clamped_swiglu", "swiglu_limit"),
    "Step3p7Experts": ("step3p7", "post_clamped_silu", "limit"),
    "BailingHybridExperts": ("bailing_hybrid", "post_clamped_silu", "limit"),
}


def _limit_gate_kind(experts: nn.Module, gate: Any) -> str | None:
    """The kind of a swiglu_limit gate (_LIMIT_GATES) where `gate` is its class's own
    _apply_gate, else None. The class is looked up in sys.modules (never imported here: an
    experts module of a model exists only once its modeling module is loaded)."""
    entry = _LIMIT_GATES.get(type(experts).__name__)
    if entry is None:
        return None
    module = sys.modules.get(f"transformers.models.{entry[0]}.modeling_{entry[0]}")
    cls = getattr(module, type(experts).__name__, None)
    return entry[1] if gate is getattr(cls, "_apply_gate", None) else None


def _positive_limit(value: object) -> float | None:
    """A clamp limit as the fused kernel takes it (a finite float > 0), else None: no clamp
    (None) or a value the module's own gate handles (the unfused path runs it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value > 0 else None


def _gate_of(experts: nn.Module) -> Any:
    """The function `experts._apply_gate` runs, looked up on the module as transformers'
    forwards call it, or None where that is not a method of the module. A gate set on one
    module (`experts._apply_gate = types.MethodType(fn, experts)`) overrides its class's: read
    from the class, the fused path ran the class's default gate in its place, silently."""
    gate = getattr(experts, "_apply_gate", None)
    if isinstance(gate, types.MethodType) and gate.__self__ is experts:
        return gate.__func__
    return None


# transformers' own gate functions, looked up without mutating any state of this module:
# torch.compile traces the experts forward through these lookups, so a cache filled inside the
# first trace (a dict here before; Dynamo ignores an lru_cache wrapper and re-runs its body)
# left a guard on the cache's contents that failed on the next call: a model compiled before
# any eager call was compiled twice (and failed under torch.compiler.set_stance(
# "fail_on_recompile")). The default gate's module is imported at the top of this file already.
try:
    from transformers.integrations.moe import _default_apply_gate as _DEFAULT_GATE
except ImportError:  # a transformers without this function
    _DEFAULT_GATE = None

_GPT_OSS_MODULE = "transformers.models.gpt_oss.modeling_gpt_oss"


def _default_apply_gate() -> Any:
    return _DEFAULT_GATE


def _gpt_oss_apply_gate() -> Any:
    # Read from sys.modules, never imported here (an import of ~0.6 s, which the first trace
    # ran): a GPT-OSS experts module exists only once its modeling module is loaded, so where
    # it is not, no module's gate can be GPT-OSS's.
    cls = getattr(sys.modules.get(_GPT_OSS_MODULE), "GptOssExperts", None)
    return getattr(cls, "_apply_gate", None)


def register() -> None:
    """Add "moe_gemm" to transformers' ExpertsInterface, and to its FP8 experts registry where
    this transformers has one (integrations/transformers_fp8.py) (idempotent; global for the
    process)."""
    from moe_gemm.integrations import register_fp8_lazily

    if ExpertsInterface._global_mapping.get(NAME) is not moe_gemm_experts_forward:
        ExpertsInterface.register(NAME, moe_gemm_experts_forward)
    register_fp8_lazily()


def is_registered() -> bool:
    """Whether "moe_gemm" currently resolves to moe_gemm's experts forward."""
    return NAME in ALL_EXPERTS_FUNCTIONS and ALL_EXPERTS_FUNCTIONS[NAME] is moe_gemm_experts_forward


# ---------------------------------------------------------------------------------------------
# MoE.from_hf

# transformers 5 block class -> router kind, each checked against the transformers 5 source
# (router arithmetic and the block's forward) and covered by tests/layers/test_moe_hf.py. The
# softmax blocks route as Mixtral (softmax over the experts, top-k, renormalized where the
# router has norm_topk_prob, always where it has none) and may carry Qwen2-MoE's
# sigmoid-gated shared expert ("softmax_fp32": its router computes the logits in float32);
# the sigmoid ones as DeepSeek-V3 (group-limited top-k of biased sigmoid scores,
# routed_scaling_factor) with or without shared experts; "sigmoid_flat" (MiniMax-M2): biased
# sigmoid top-k over all experts, renormalized, logits in the weight's dtype, the correction
# bias a buffer of the block; "softmax_grouped" (Mistral 4): DeepSeek-V3's group-limited
# top-k and routed_scaling_factor over softmax scores, without a bias, logits in the
# weight's dtype ("softmax_grouped_fp32", Mistral Large 4: in float32, always renormalized);
# "scored" (DeepSeek-V4): the router's score function (sqrt(softplus) or sigmoid), a biased
# top-k over all experts, always renormalized (+1e-20), scaled, logits in the weight's dtype,
# or, in its first layers, hash routing by token id (the router's tid2eid); "sigmoid_scaled"
# (MiniMax-M3): MiniMax-M2's router with the bias on the router and the block's
# routed_scaling_factor.
HF_BLOCKS = {
    "MixtralSparseMoeBlock": "softmax",
    "MiniMaxSparseMoeBlock": "softmax",
    "OlmoeSparseMoeBlock": "softmax",
    "FlexOlmoSparseMoeBlock": "softmax",
    "Qwen2MoeSparseMoeBlock": "softmax",
    "Qwen3MoeSparseMoeBlock": "softmax",
    "Qwen3NextSparseMoeBlock": "softmax",
    "Qwen3_5MoeSparseMoeBlock": "softmax",
    "Qwen3VLMoeTextSparseMoeBlock": "softmax",
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": "softmax",
    "Qwen3OmniMoeTalkerTextSparseMoeBlock": "softmax",
    "Qwen4ExpTextSparseMoeBlock": "softmax",
    "MellumSparseMoeBlock": "softmax",
    "LaraMiniSparseMoeBlock": "softmax_fp32",
    "DeepseekV3MoE": "sigmoid",
    "DeepseekV32MoE": "sigmoid",
    "MiMoV2FlashMoE": "sigmoid",
    "KimiLinearMoE": "sigmoid",
    "Dots1MoE": "sigmoid",
    "Dots3NoteTextMoE": "sigmoid",
    "Glm4MoeMoE": "sigmoid",
    "Glm4MoeLiteMoE": "sigmoid",
    "Glm4vMoeTextMoE": "sigmoid",
    "GlmMoeDsaMoE": "sigmoid",
    "SolarOpenMoE": "sigmoid",
    "MiniCPM5MoeMoE": "sigmoid",  # (its router disables autocast: fp32 logits, as ours)
    "MiniMaxM2SparseMoeBlock": "sigmoid_flat",
    "Mistral4MoE": "softmax_grouped",
    "MistralLarge4TextMoE": "softmax_grouped_fp32",
    # (DeepSeek-V3's router; experts with a swiglu_limit: activation=ClampedSiLU(limit))
    "Glm5NextTextMoE": "sigmoid",
    "HYV4MoE": "sigmoid",
    "HYV4VLMoE": "sigmoid",
    # (DeepSeek-V4's routers; experts and shared expert with a swiglu_limit)
    "DeepseekV4SparseMoeBlock": "scored",
    # (experts and shared expert with gpt-oss's clamped SwiGLU: activation=ClampedSwiGLU)
    "MiniMaxM3VLSparseMoeBlock": "sigmoid_scaled",
    # (experts and shared expert clamping after the activation: activation=PostClampedSiLU,
    # unfused; a layer without a limit: the plain SwiGLU)
    "Step3p7SparseMoeBlock": "sigmoid_scaled",
    "BailingHybridMoE": "sigmoid",
}

# DeepSeek-V4's router score functions (transformers' ACT2FN[config.scoring_func] classes)
# -> our scoring.
_SCORE_FNS = {"SqrtSoftplusActivation": "sqrtsoftplus", "Sigmoid": "sigmoid"}


def moe_from_hf(cls: type[MoE], block: nn.Module, config: GemmConfig | None) -> MoE:
    """The body of `MoE.from_hf` (see there): our layer sharing a transformers block's weights
    (FP8 experts stay FP8, with their scales)."""
    from moe_gemm.layers.experts_fp8 import hf_fp8_scales

    register()  # from_hf users also get the experts implementation
    kind = HF_BLOCKS.get(type(block).__name__)
    if kind is None:
        raise ValueError(
            f"MoE.from_hf does not know {type(block).__name__}; supported: "
            f"{', '.join(sorted(HF_BLOCKS))}. For other transformers models use "
            'model.set_experts_implementation("moe_gemm").'
        )
    _check_hf_block(block, kind)
    router, experts = block.gate, block.experts
    _check_fused_gated(experts)
    opts: dict[str, Any] = {"activation": _experts_activation(experts), "config": config}
    bias = hash_table = None
    if kind == "scored":
        opts.update(scoring=_scoring_of(router), renormalize=True,
                    routed_scaling_factor=float(router.routed_scaling_factor), router_fp32=False)
        if getattr(block, "is_hash", False):
            hash_table = router.tid2eid
        else:
            bias = router.e_score_correction_bias
    elif kind == "sigmoid_scaled":
        opts.update(scoring="sigmoid", renormalize=True, router_fp32=False,
                    routed_scaling_factor=float(block.routed_scaling_factor))
        bias = router.e_score_correction_bias
    elif kind == "sigmoid_flat":
        opts.update(scoring="sigmoid", renormalize=True, router_fp32=False)
        bias = block.e_score_correction_bias
    elif kind == "sigmoid":
        opts.update(
            scoring="sigmoid",
            renormalize=bool(router.norm_topk_prob),
            n_group=int(router.num_group),
            topk_group=int(router.topk_group),
            routed_scaling_factor=float(router.routed_scaling_factor),
            router_fp32=True,
        )
        bias = router.e_score_correction_bias
    elif kind in ("softmax_grouped", "softmax_grouped_fp32"):
        opts.update(
            scoring="softmax",
            renormalize=bool(getattr(router, "norm_topk_prob", True)),
            n_group=int(router.num_group),
            topk_group=int(router.topk_group),
            routed_scaling_factor=float(router.routed_scaling_factor),
            router_fp32=kind == "softmax_grouped_fp32",
        )
    else:
        # Mixtral always renormalises; Qwen2/Qwen3-MoE iff norm_topk_prob. "softmax_fp32":
        # a router that computes its logits in float32 (LaraMini), the others in the weight's
        # dtype.
        opts.update(scoring="softmax", renormalize=bool(getattr(router, "norm_topk_prob", True)),
                    router_fp32=True if kind == "softmax_fp32" else None)
    # Mixtral's block keeps config.router_jitter_noise as `jitter_noise` (the others have none)
    opts["router_jitter_noise"] = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    shared = None
    mlp = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    shared_act = None
    if mlp is not None:
        shared_act = _mlp_activation(mlp)
        if not _same_activation(shared_act, opts["activation"]) and not isinstance(
                opts["activation"], HalvesGate) and not isinstance(shared_act, HalvesGate):
            # (clamping models set the shared expert's clamp apart: HY-V4 has none there,
            # Step-3.7 and Bailing-Hybrid their own limit per layer)
            raise ValueError("MoE.from_hf needs the shared expert to use the experts' activation")
        dtype = _dense_dtype(block, router.weight.dtype)
        if type(mlp).__name__ in _CONCAT_MLPS:
            # (one gate_up_proj Linear, gate rows first: its two halves, as views)
            w = _dense_hf_weight(mlp.gate_up_proj, dtype)
            half = w.shape[0] // 2
            shared = {"gate_proj": w[:half], "up_proj": w[half:],
                      "down_proj": _dense_hf_weight(mlp.down_proj, dtype)}
        else:
            shared = {n: _dense_hf_weight(getattr(mlp, n), dtype)
                      for n in ("gate_proj", "up_proj", "down_proj")}
        gate = getattr(block, "shared_expert_gate", None)
        if gate is not None:
            shared["gate"] = _dense_hf_weight(gate, dtype)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if getattr(experts, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    # transformers' FP8Experts (FP8 checkpoints): the experts stay FP8 with their scales.
    scales = hf_fp8_scales(experts)
    moe = moe_from_tensors(cls, gate_up, down, router.weight, int(router.top_k), bias, shared,
                           opts, scales=scales, hash_table=hash_table)
    if shared_act is not None and not _same_activation(shared_act, opts["activation"]):
        # (HY-V4: clamped routed experts, a plain SwiGLU shared expert)
        moe.shared_experts.activation = shared_act
    # In the block's mode (a new module is in training mode): a layer made from an eval-mode
    # block does not jitter its router's input, one from a training-mode block does, as the
    # block would.
    return moe.train(block.training)


# What from_hf reads of a block's router, beyond its (E, H) weight, per router kind.
_ROUTER_ATTRS = {
    "softmax": ("top_k",),
    "softmax_fp32": ("top_k",),
    "sigmoid_flat": ("top_k",),
    "softmax_grouped": ("top_k", "num_group", "topk_group", "routed_scaling_factor"),
    "softmax_grouped_fp32": ("top_k", "num_group", "topk_group", "routed_scaling_factor"),
    "sigmoid": ("top_k", "norm_topk_prob", "num_group", "topk_group", "routed_scaling_factor",
                "e_score_correction_bias"),
    "scored": ("top_k", "score_fn", "routed_scaling_factor"),
    "sigmoid_scaled": ("top_k", "e_score_correction_bias"),
}


def _scoring_of(router: nn.Module) -> str:
    """Our scoring for a DeepSeek-V4 router's score function."""
    fn = type(getattr(router, "score_fn", None)).__name__
    if fn not in _SCORE_FNS:
        raise ValueError(f"MoE.from_hf takes DeepSeek-V4 routers scoring with "
                         f"{' or '.join(sorted(_SCORE_FNS))}; this one has {fn}")
    return _SCORE_FNS[fn]


def _check_hf_block(block: nn.Module, kind: str) -> None:
    """The block is laid out as transformers 5's class of its name: fused 3-D experts
    (`@use_experts_implementation`) and a top-k router module. A class of the same name from
    elsewhere (a checkpoint's remote code, trust_remote_code=True, keeps DeepSeek-V3's experts
    in an nn.ModuleList of MLPs and its router in an MoEGate) failed with an AttributeError from
    deep inside ('ModuleList' object has no attribute 'act_fn')."""
    name = type(block).__name__
    problems = []
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module):
        problems.append("no experts module")
    else:
        for attr in ("gate_up_proj", "down_proj"):
            w = getattr(experts, attr, None)
            if not isinstance(w, torch.Tensor) or w.dim() != 3:
                problems.append(f"no 3-D experts.{attr} ({type(experts).__name__})")
        if not hasattr(experts, "act_fn") and type(experts).__name__ not in _LIMIT_GATES:
            problems.append(f"no experts.act_fn ({type(experts).__name__})")
    router = getattr(block, "gate", None)
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        problems.append("no 2-D gate.weight (the router)")
    missing = [a for a in _ROUTER_ATTRS[kind] if router is not None and not hasattr(router, a)]
    if router is not None and missing:
        problems.append(f"a router ({type(router).__name__}) without {', '.join(missing)}")
    if kind == "sigmoid_flat" and not isinstance(getattr(block, "e_score_correction_bias", None),
                                                 torch.Tensor):
        problems.append("no e_score_correction_bias")
    if kind == "scored" and router is not None:
        table = "tid2eid" if getattr(block, "is_hash", False) else "e_score_correction_bias"
        if not isinstance(getattr(router, table, None), torch.Tensor):
            problems.append(f"a router ({type(router).__name__}) without {table}")
    if kind == "sigmoid_scaled" and not isinstance(
            getattr(block, "routed_scaling_factor", None), (int, float)):
        problems.append("no routed_scaling_factor")
    if problems:
        raise ValueError(
            f"MoE.from_hf takes transformers 5's {name} (fused 3-D experts, a top-k router); "
            f"this {name} (from {type(block).__module__}) has {'; '.join(problems)}. Load the "
            "model with transformers' own class (without trust_remote_code), or build the "
            "layer with MoE.from_state_dict"
        )


def _dense_dtype(block: nn.Module, router_dtype: torch.dtype) -> torch.dtype:
    """The dtype an FP8 shared expert is dequantized into: the router's where it is 16-bit,
    else the dtype the model was loaded in (the block's config.dtype), else the router's.
    transformers keeps the router of DeepSeek-V3, GLM-4.5 and dots.llm1 in fp32 whatever the
    model's dtype (_keep_in_fp32_modules_strict), the very models whose FP8 checkpoints
    quantize the shared expert: taken from the router, a bf16 model's shared expert was
    dequantized into fp32, twice the memory of from_state_dict's bf16 copy and fp32 GEMMs."""
    if router_dtype in (torch.bfloat16, torch.float16):
        return router_dtype
    loaded = getattr(getattr(block, "config", None), "dtype", None)
    if isinstance(loaded, str):  # (a config read from JSON may still hold the name)
        loaded = getattr(torch, loaded, None)
    return loaded if loaded in FLOAT_DTYPES else router_dtype


def _dense_hf_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A shared-expert projection's weight: its own Parameter, or, for transformers' FP8Linear
    (an FP8 checkpoint quantizes the shared expert too: DeepSeek-V3's, GLM's), the FP8 weight
    dequantized with its weight_scale_inv (128x128 blocks or per tensor) into `dtype`
    (_dense_dtype, where that is 16/32-bit, else bf16), a copy, as from_state_dict keeps a
    checkpoint's FP8 shared expert: it is one dense MLP."""
    from moe_gemm.layers.experts_fp8 import FP8_DTYPES, decoding_scale, dequantize_weight

    w = linear.weight
    scale = getattr(linear, "weight_scale_inv", None)
    if w.dtype not in FP8_DTYPES or scale is None:
        return w
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        dtype = torch.bfloat16
    return dequantize_weight(w.detach(), decoding_scale("weight_scale_inv", scale.detach()),
                             dtype)


def _check_fused_gated(experts: nn.Module) -> None:
    """MoE holds concatenated, gated, bias-free experts with the default gate: reject others."""
    from moe_gemm.layers.experts_fp8 import hf_fp8_gate_is_default, hf_fp8_scales

    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a transformers without the helper
        _default_apply_gate = None
    problems = []
    if not getattr(experts, "has_gate", True):
        problems.append("has_gate=False (no gate projection)")
    if getattr(experts, "has_bias", False):
        problems.append("has_bias=True (expert biases)")
    if getattr(experts, "has_post_expert_norm", False):
        problems.append("has_post_expert_norm=True")
    if not getattr(experts, "is_concatenated", True):
        problems.append("is_concatenated=False (interleaved gate/up)")
    gate = _gate_of(experts) if hasattr(experts, "_apply_gate") else _default_apply_gate
    if gate is not _default_apply_gate and _limit_gate_kind(experts, gate) is None:
        # (FP8Experts' own gate is the default one where no soft cap or limit is set)
        fp8_default = (gate is getattr(type(experts), "_apply_gate", None)
                       and hf_fp8_scales(experts) is not None and hf_fp8_gate_is_default(experts))
        if not fp8_default:
            problems.append("a custom _apply_gate")
    if problems:
        raise ValueError(
            f"MoE.from_hf cannot take {type(experts).__name__} with {', '.join(problems)}; "
            'use model.set_experts_implementation("moe_gemm") for such models'
        )


def _experts_activation(experts: nn.Module) -> Activation:
    """The routed experts' activation: ClampedSiLU(limit) for a swiglu_limit gate of
    _LIMIT_GATES (its limit checked), else the experts' act_fn as hf_activation names it."""
    gate = _gate_of(experts)
    kind = None if gate is None else _limit_gate_kind(experts, gate)
    if kind == "post_clamped_silu":
        return _post_clamped(experts)
    if kind is not None:
        spec = hf_fused_gate(experts)
        if spec is None:
            name = type(experts).__name__
            raise ValueError(f"MoE.from_hf takes {name}'s clamped gate with a finite "
                             f"swiglu_limit > 0 (and a SiLU, or a swiglu_alpha); this {name} "
                             f"has limit {getattr(experts, _LIMIT_GATES[name][2], None)!r}")
        if kind == "clamped_swiglu":
            return ClampedSwiGLU(spec.limit, spec.alpha)
        return ClampedSiLU(spec.limit)
    return hf_activation(experts.act_fn)


# Shared-expert MLP classes whose forward clamps as ClampedSiLU: class -> the limit attribute.
_CLAMPED_MLPS = {"Glm5NextTextMLP": "swiglu_limit", "DeepseekV4MLP": "limit"}
# ... and those computing gpt-oss's clamped SwiGLU over one gate_up_proj Linear (gate rows
# first), with their swiglu_limit and swiglu_alpha (no act_fn).
_CONCAT_MLPS = {"MiniMaxM3VLDenseMLP"}
# ... and those clamping after the activation (Step-3.7's, Bailing-Hybrid's), limit None where
# the layer has none.
_POST_CLAMPED_MLPS = {"Step3p7MLP", "BailingHybridMLP"}


def _post_clamped(module: nn.Module) -> Activation:
    """PostClampedSiLU(limit) of a module clamping after its SiLU, its act_fn where its
    limit is None."""
    act, limit = hf_activation(module.act_fn), module.limit
    if limit is None:
        return act
    checked = _positive_limit(limit)
    if checked is None or act != "silu":
        raise ValueError(f"MoE.from_hf takes {type(module).__name__}'s clamp after a SiLU with "
                         f"a finite limit > 0 (or none); got {limit!r} after {act!r}")
    return PostClampedSiLU(checked)


def _mlp_activation(mlp: nn.Module) -> Activation:
    """A shared expert's activation: ClampedSiLU for a clamping MLP class (its act_fn a SiLU),
    ClampedSwiGLU for a _CONCAT_MLPS one, else its act_fn as hf_activation names it."""
    if type(mlp).__name__ in _POST_CLAMPED_MLPS:
        return _post_clamped(mlp)
    if type(mlp).__name__ in _CONCAT_MLPS:
        limit, alpha = _positive_limit(getattr(mlp, "swiglu_limit", None)), getattr(
            mlp, "swiglu_alpha", None)
        if limit is None or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"MoE.from_hf takes {type(mlp).__name__}'s clamped SwiGLU with a "
                             f"finite swiglu_limit > 0 and a swiglu_alpha; got "
                             f"{getattr(mlp, 'swiglu_limit', None)!r}, {alpha!r}")
        return ClampedSwiGLU(limit, float(alpha))
    attr = _CLAMPED_MLPS.get(type(mlp).__name__)
    act = hf_activation(mlp.act_fn)
    if attr is None:
        return act
    limit = _positive_limit(getattr(mlp, attr, None))
    if limit is None or act != "silu":
        raise ValueError(f"MoE.from_hf takes {type(mlp).__name__}'s clamped SwiGLU with a "
                         f"SiLU and a finite {attr} > 0; got {getattr(mlp, attr, None)!r}")
    return ClampedSiLU(limit)


def _same_activation(a: Activation, b: Activation) -> bool:
    """Whether two activations (our names, or callables such as transformers' ACT2FN modules,
    which are a new instance per lookup: a block's experts and shared expert never share one)
    compute the same function: one name, one object, or parameter-free modules of one class
    with equal attributes."""
    if a is b or (isinstance(a, str) and a == b):
        return True
    if isinstance(a, str) or isinstance(b, str) or type(a) is not type(b):
        return False
    if not isinstance(a, nn.Module) or any(True for _ in a.parameters()) or any(
            True for _ in a.buffers()):
        return False

    def public(m: nn.Module) -> dict[str, Any]:
        return {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}

    return public(a) == public(b)


def hf_activation(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> Activation:
    """Our activation name for a transformers / torch activation module, else the module."""
    name = type(act_fn).__name__
    inner = getattr(act_fn, "act", None)
    if name in ("SiLUActivation", "SiLU"):
        return "silu"
    if name == "GELUActivation" and inner is F.gelu:
        return "gelu"
    if (
        name == "GELUTanh"
        and isinstance(inner, functools.partial)
        and inner.func is F.gelu
        and inner.keywords == {"approximate": "tanh"}
    ):
        return "gelu_tanh"
    if isinstance(act_fn, nn.GELU):
        return "gelu" if act_fn.approximate == "none" else "gelu_tanh"
    return act_fn


# `import moe_gemm` asked for the registration (moe_gemm.integrations.register_transformers_
# lazily). When this module is what first imports transformers' MoE module, the import hook
# fires inside the import above and cannot import this half-made module: register now.
register()
