"""The MoE layer: router, device-side permutation, two grouped GEMMs and a weighted combine.

    logits = x @ router_weight.T                     (T, E)
    weights, ids = router(logits)                    (T, k) each; softmax or sigmoid routing
    perm = permute_by_expert(ids)                    stable sort on the device, int32 offs
    h = grouped_mm(x[perm.token_index], w_gate_up)   (S, 2I), S = T * k, one launch
    a = act(h[:, :I]) * h[:, I:]                     (S, I), SwiGLU by default
    y = grouped_mm(a, w_down)                        (S, H), one launch
    out[t] = sum_j weights[t, j] * y[row of (t, j)]  (T, H), fp32 accumulation
    out += shared experts (DeepSeek), optionally times sigmoid(x @ g) (Qwen2-MoE)

Why the pieces are chosen as they are:
- Every shape is fixed by T and k (S = T * k routed rows, whatever the routing), so on CUDA the
  forward never waits for the host and can be captured in a CUDA graph, as long as the
  grouped GEMMs run on the cute backend or torch's native bf16 grouped_mm (the torch backend's
  fp32/fp16 loop reads offs on the host).
- Weights live in the layout transformers and vLLM store: gate_up_proj (E, 2I, H) and
  down_proj (E, H, I). The GEMMs take their transposed views (E, H, 2I) and (E, I, H), with no
  copy; that K-major B operand is also the one WGMMA reads natively.
- The combine is one `embedding_bag(mode="sum", per_sample_weights=...)`: a gather by the
  inverse permutation fused with the weighted sum over the k slots, accumulated in fp32 and
  rounded once, deterministic (no atomics) and reading the (S, H) expert output only once.

Inference only: there is no backward. Calling the layer with gradients enabled on inputs or
weights works, but `.backward()` through it raises a RuntimeError.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from moe_gemm.config import GemmConfig
from moe_gemm.layers.routing import permute_by_expert, sigmoid_grouped_topk, softmax_topk
from moe_gemm.ops.api import grouped_mm
from moe_gemm.ops.autograd import inference_only

__all__ = ["MoE", "moe_experts", "moe_forward"]

Scoring = Literal["softmax", "sigmoid"]
Activation = str | Callable[[torch.Tensor], torch.Tensor]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU: silu(gate) * up
    "gelu": F.gelu,  # GEGLU with the exact (erf) GELU
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),  # GEGLU, tanh approximation
}
_ACTIVATION_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

INFERENCE_ONLY_MESSAGE = (
    "moe_gemm's MoE layer is inference-only: it has no backward. Run it under "
    "torch.no_grad() / torch.inference_mode(), or use transformers' 'grouped_mm' experts "
    "implementation for training."
)


# ---------------------------------------------------------------------------------------------
# Inference-only guard


def _inference_only(run: Callable[[], torch.Tensor], *tensors: torch.Tensor | None) -> torch.Tensor:
    """run(), linked to the autograd graph only when a backward could be asked for."""
    return inference_only(INFERENCE_ONLY_MESSAGE, run, tensors)


# ---------------------------------------------------------------------------------------------
# Activations


def resolve_activation(activation: Activation) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise function for a name ("silu", "gelu", "gelu_tanh") or a callable."""
    if isinstance(activation, str):
        name = _ACTIVATION_ALIASES.get(activation, activation)
        if name not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(map(repr, ACTIVATIONS))} or a callable; "
                f"got {activation!r}"
            )
        return ACTIVATIONS[name]
    if callable(activation):
        return activation
    raise TypeError(f"activation must be a str or a callable; got {type(activation).__name__}")


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """(S, 2I) [gate | up] -> (S, I) act(gate) * up, transformers' concatenated layout."""

    def gate_fn(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return act(gate) * up

    return gate_fn


# ---------------------------------------------------------------------------------------------
# The routed experts, given a routing


def _expert_ffn(
    x: torch.Tensor,  # (T, H)
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k)
    w_gate_up: torch.Tensor,  # (E, H, N1)
    w_down: torch.Tensor,  # (E, I, H)
    gate_fn: Callable[[torch.Tensor], torch.Tensor],  # (S, N1) -> (S, I)
    *,
    bias_gate_up: torch.Tensor | None = None,  # (E, N1)
    bias_down: torch.Tensor | None = None,  # (E, H)
    post_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,  # (S, H) -> (S, H)
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Sort, two grouped GEMMs, combine. Arguments are already checked. Returns (T, H)."""
    E = w_gate_up.shape[0]
    perm = permute_by_expert(topk_ids, E)
    xs = x.index_select(0, perm.token_index)  # (S, H), rows grouped by expert
    h = grouped_mm(xs, w_gate_up, perm.offs, config=config)  # (S, N1)
    if bias_gate_up is not None or bias_down is not None:
        # dropped slots sort last with expert id E: clamp so the bias gather stays in bounds
        # (their rows are past offs[-1] and carry weight 0 below).
        expert = perm.sorted_expert.clamp(max=E - 1)
    if bias_gate_up is not None:
        h = h + bias_gate_up.index_select(0, expert).to(h.dtype)
    a = gate_fn(h)  # (S, I)
    y = grouped_mm(a, w_down, perm.offs, config=config)  # (S, H)
    if bias_down is not None:
        y = y + bias_down.index_select(0, expert).to(y.dtype)
    if post_fn is not None:
        y = post_fn(y)
    # Dropped slots (ids outside [0, E)) get weight 0. Their rows of y are finite (grouped_mm
    # leaves rows past offs[-1] zero; a bias or norm keeps them finite), so they add nothing.
    w = torch.where(perm.valid, topk_weights, 0).to(y.dtype)
    return F.embedding_bag(perm.row_of_slot, y, per_sample_weights=w, mode="sum")


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_x(x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor (T, H); got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (T, H); got shape {_shape(x)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be torch.bfloat16, torch.float16 or torch.float32; got {x.dtype}")
    return x


def _check_experts(
    x: object,
    topk_ids: object,
    topk_weights: object,
    w_gate_up: object,
    w_down: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    hints = (
        ("x", x, "(T, H)"),
        ("topk_ids", topk_ids, "(T, k)"),
        ("topk_weights", topk_weights, "(T, k)"),
        ("w_gate_up", w_gate_up, "(E, H, 2I)"),
        ("w_down", w_down, "(E, I, H)"),
    )
    for name, t, hint in hints:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {hint}; got {type(t).__name__}")
    assert isinstance(x, torch.Tensor) and isinstance(topk_ids, torch.Tensor)
    assert isinstance(topk_weights, torch.Tensor) and isinstance(w_gate_up, torch.Tensor)
    assert isinstance(w_down, torch.Tensor)
    _check_x(x)
    T, H = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] != H or w_gate_up.shape[2] % 2:
        raise ValueError(
            f"w_gate_up must be (E, H, 2I) = (E, {H}, 2I) (for transformers' (E, 2I, H) "
            f"gate_up_proj pass gate_up_proj.transpose(1, 2)); got {_shape(w_gate_up)}"
        )
    E, _, two_i = w_gate_up.shape
    if E < 1:
        raise ValueError(f"w_gate_up must hold at least one expert; got {_shape(w_gate_up)}")
    I = two_i // 2
    if w_down.dim() != 3 or tuple(w_down.shape) != (E, I, H):
        raise ValueError(
            f"w_down must be (E, I, H) = ({E}, {I}, {H}) (for transformers' (E, H, I) down_proj "
            f"pass down_proj.transpose(1, 2)); got {_shape(w_down)}"
        )
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but x has {x.dtype}; they must match")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be (T, k) = ({T}, k >= 1); got {_shape(topk_ids)}")
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_ids must be int64 or int32; got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights must match topk_ids {_shape(topk_ids)}; got {_shape(topk_weights)}"
        )
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be a float tensor; got {topk_weights.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return x, topk_ids, topk_weights, w_gate_up, w_down


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    activation: Activation = "silu",
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The routed expert FFN for a given routing (what vLLM's fused_experts computes).

    out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t]), with
    FFN_e(v) = (act(v @ Wg_e) * (v @ Wu_e)) @ Wd_e, as two grouped GEMMs over all experts.
    Inference only (no backward). Never synchronizes with the host on CUDA (see the module
    docstring for the backend condition).

    Args:
        x: [T, H] tokens; bf16, fp16 or fp32.
        topk_ids: [T, k] int64/int32 expert per slot. Ids outside [0, E) are dropped
            (expert-parallel sentinels): they contribute nothing.
        topk_weights: [T, k] float weight per slot (cast to x's dtype for the combine).
        w_gate_up: [E, H, 2I] fused gate then up weights, same dtype and device as x; any
            layout with one unit stride in the last two dims, e.g.
            `gate_up_proj.transpose(1, 2)` of transformers' / vLLM's (E, 2I, H) weight.
        w_down: [E, I, H] down weights, e.g. `down_proj.transpose(1, 2)` of an (E, H, I) one.
        activation: "silu" (SwiGLU, default), "gelu", "gelu_tanh" or a callable applied to
            the gate half.
        config: GemmConfig for both grouped GEMMs; None = automatic.

    Returns:
        [T, H] in x's dtype (fp32 accumulation, one final rounding). T = 0 gives (0, H).

    Raises:
        TypeError: non-tensors or wrong dtypes.
        ValueError: shapes or devices that do not fit.
    """
    x, topk_ids, topk_weights, w_gate_up, w_down = _check_experts(
        x, topk_ids, topk_weights, w_gate_up, w_down
    )
    gate_fn = _gated(resolve_activation(activation))
    return _inference_only(
        lambda: _expert_ffn(x, topk_ids, topk_weights, w_gate_up, w_down, gate_fn, config=config),
        x,
        topk_weights,
        w_gate_up,
        w_down,
    )


# ---------------------------------------------------------------------------------------------
# Routing options shared by the functional form and the module


def _check_routing(
    num_experts: int,
    top_k: int,
    scoring: str,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    renormalize: bool = True,
) -> None:
    for name, value in (("num_experts", num_experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int; got {value!r}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1; got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}]; got {top_k}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid'; got {scoring!r}")
    if scoring == "softmax" and (n_group != 1 or topk_group != 1):
        raise ValueError(
            "group-limited routing (n_group, topk_group) is defined for scoring='sigmoid' "
            f"(DeepSeek-V3); got n_group={n_group}, topk_group={topk_group} with softmax"
        )
    if not isinstance(routed_scaling_factor, (int, float)) or isinstance(
        routed_scaling_factor, bool
    ):
        raise TypeError(f"routed_scaling_factor must be a float; got {routed_scaling_factor!r}")
    if scoring == "softmax" and routed_scaling_factor != 1.0:
        raise ValueError(
            "routed_scaling_factor is defined for scoring='sigmoid' (DeepSeek-V3); got "
            f"{routed_scaling_factor} with softmax (scale the layer's output instead)"
        )
    if not isinstance(renormalize, int):  # a bool (or 0 / 1)
        raise TypeError(f"renormalize must be a bool; got {renormalize!r}")
    if scoring == "sigmoid":
        # Same checks the router runs per call, done once here so bad settings fail early.
        sigmoid_grouped_topk(
            torch.zeros(0, num_experts), None, top_k, n_group, topk_group,
            float(routed_scaling_factor),
        )


def _route(
    x: torch.Tensor,  # (T, H)
    router_weight: torch.Tensor,  # (E, H)
    top_k: int,
    scoring: str,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None,
    router_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if router_fp32:
        logits = F.linear(x.float(), router_weight.float())  # DeepSeek-V3 / GLM-4-MoE
    else:
        logits = F.linear(x.to(router_weight.dtype), router_weight)  # Mixtral / Qwen
    if scoring == "softmax":
        return softmax_topk(logits, top_k, renormalize)
    return sigmoid_grouped_topk(
        logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize
    )


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    *,
    scoring: Scoring = "softmax",
    renormalize: bool = True,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    correction_bias: torch.Tensor | None = None,
    router_fp32: bool | None = None,
    activation: Activation = "silu",
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Functional MoE: route, then the routed experts (no shared experts). Inference only.

    Args:
        x: [T, H] tokens; bf16, fp16 or fp32.
        router_weight: [E, H] router (gate) weight, on x's device.
        w_gate_up: [E, H, 2I] fused gate+up weights (see moe_experts for layouts).
        w_down: [E, I, H] down weights.
        top_k: experts per token.
        scoring: "softmax" (Mixtral, Qwen) or "sigmoid" (DeepSeek-V3).
        renormalize: divide the top-k weights by their sum (Qwen's norm_topk_prob; Mixtral
            always True).
        n_group, topk_group: group-limited routing (sigmoid only).
        routed_scaling_factor: multiplies the weights (sigmoid only, after renormalising).
        correction_bias: [E] selection-only bias (sigmoid only), e.g. DeepSeek-V3's
            e_score_correction_bias.
        router_fp32: compute the router logits in fp32 (DeepSeek) rather than in the weight's
            dtype (Mixtral, Qwen); None = True for sigmoid, False for softmax.
        activation: "silu", "gelu", "gelu_tanh" or a callable.
        config: GemmConfig for the grouped GEMMs.

    Returns:
        [T, H] in x's dtype.

    Raises:
        TypeError, ValueError: arguments that do not fit, with the expected shape.
    """
    x = _check_x(x)
    H = x.shape[1]
    if not isinstance(w_gate_up, torch.Tensor) or w_gate_up.dim() != 3:
        raise ValueError(f"w_gate_up must be a 3-D tensor (E, H, 2I) = (E, {H}, 2I)")
    E = w_gate_up.shape[0]
    if not isinstance(router_weight, torch.Tensor):
        raise TypeError(
            f"router_weight must be a torch.Tensor (E, H); got {type(router_weight).__name__}"
        )
    if tuple(router_weight.shape) != (E, H):
        raise ValueError(f"router_weight must be (E, H) = ({E}, {H}); got {_shape(router_weight)}")
    if router_weight.device != x.device:
        raise ValueError(f"router_weight is on {router_weight.device} but x is on {x.device}")
    _check_routing(E, top_k, scoring, n_group, topk_group, routed_scaling_factor, renormalize)
    if correction_bias is not None and scoring != "sigmoid":
        raise ValueError("correction_bias is used by scoring='sigmoid' only")
    fp32 = scoring == "sigmoid" if router_fp32 is None else bool(router_fp32)
    weights, ids = _route(
        x, router_weight, top_k, scoring, renormalize, n_group, topk_group,
        float(routed_scaling_factor), correction_bias, fp32,
    )
    return moe_experts(x, ids, weights, w_gate_up, w_down, activation=activation, config=config)


# ---------------------------------------------------------------------------------------------
# The module


class GatedMLP(nn.Module):
    """A dense gated FFN, down(act(gate(x)) * up(x)): the shared expert of DeepSeek / Qwen2."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: Activation = "silu",
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype, "bias": False}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.activation = activation
        self._act = resolve_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """A mixture-of-experts FFN layer on moe_gemm's grouped GEMMs. Inference only.

    out = sum over the top-k experts e of weight_e * down_e(act(gate_e(x)) * up_e(x))
          [+ shared experts(x)] [* sigmoid(shared_expert_gate(x)) on the shared part]

    Routers: softmax top-k with or without renormalising (Mixtral; Qwen2/Qwen3-MoE
    norm_topk_prob) or sigmoid scores with a selection-only correction bias, group-limited
    top-k and a routed scaling factor (DeepSeek-V3). Exactly transformers' arithmetic, so
    `MoE.from_hf(block)` reproduces a transformers block's output.

    Inference only: the layer has no backward. Its own parameters are created with
    requires_grad=False; if it runs with gradients enabled on any input it still computes the
    output, but a `.backward()` through it raises a RuntimeError. On CUDA the forward never
    synchronizes with the host and can be captured in a CUDA graph (with the cute backend or
    torch's native bf16 grouped_mm under the torch backend).

    Parameters (transformers' names and layouts; `w_gate_up`/`w_down` are the no-copy
    (E, K, N) views the grouped GEMMs take):
        router_weight: [E, H].
        e_score_correction_bias: [E] float32 buffer (sigmoid routing with correction_bias).
        gate_up_proj: [E, 2I, H], gate rows first, then up rows.
        down_proj: [E, H, I].
        shared_experts: GatedMLP(H, shared_intermediate_size) or None.
        shared_expert_gate: nn.Linear(H, 1, bias=False) or None.

    Args:
        hidden_size: H.
        intermediate_size: I, per expert.
        num_experts: E.
        top_k: experts per token, 1 <= top_k <= E.
        scoring: "softmax" or "sigmoid".
        renormalize: divide the top-k weights by their sum.
        n_group, topk_group: group-limited routing (sigmoid only).
        routed_scaling_factor: multiplies the routed weights (sigmoid only).
        correction_bias: keep an e_score_correction_bias buffer (sigmoid only); None = True
            for sigmoid.
        router_fp32: router logits in fp32 (DeepSeek); None = True for sigmoid, False for
            softmax (Mixtral and Qwen compute them in the weight dtype).
        activation: "silu" (SwiGLU, default), "gelu", "gelu_tanh" or a callable.
        shared_intermediate_size: intermediate size of the always-on shared expert(s)
            (DeepSeek: moe_intermediate_size * n_shared_experts); 0 = none.
        shared_expert_gate: scale the shared expert by sigmoid(Linear(H, 1)(x)) (Qwen2-MoE).
        config: GemmConfig for the grouped GEMMs (e.g. GemmConfig(backend="torch")).
        device, dtype: where and in what dtype to create the parameters.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: Scoring = "softmax",
        renormalize: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        correction_bias: bool | None = None,
        router_fp32: bool | None = None,
        activation: Activation = "silu",
        shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        config: GemmConfig | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("shared_intermediate_size", shared_intermediate_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int; got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be an int >= 0; got {value!r}")
        if hidden_size < 1 or intermediate_size < 1:
            raise ValueError(
                f"hidden_size and intermediate_size must be >= 1; got {hidden_size}, "
                f"{intermediate_size}"
            )
        _check_routing(num_experts, top_k, scoring, n_group, topk_group, routed_scaling_factor,
                       renormalize)
        if correction_bias is None:
            correction_bias = scoring == "sigmoid"
        if correction_bias and scoring != "sigmoid":
            raise ValueError("correction_bias is used by scoring='sigmoid' only")
        if shared_expert_gate and not shared_intermediate_size:
            raise ValueError("shared_expert_gate needs a shared expert (shared_intermediate_size > 0)")
        if config is not None and not isinstance(config, GemmConfig):
            raise TypeError(f"config must be a moe_gemm.GemmConfig or None; got {type(config)}")
        if dtype is not None and dtype not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32; got {dtype}")
        resolve_activation(activation)  # fail early on a bad name
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.scoring = scoring
        self.renormalize = bool(renormalize)
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.router_fp32 = scoring == "sigmoid" if router_fp32 is None else bool(router_fp32)
        self.activation = activation
        self.config = config
        E, H, I = num_experts, hidden_size, intermediate_size
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.router_weight = nn.Parameter(torch.empty(E, H, **kw), requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I, **kw), requires_grad=False)
        bias = torch.zeros(E, device=device, dtype=torch.float32) if correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.shared_experts: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size:
            self.shared_experts = GatedMLP(H, shared_intermediate_size, activation, **kw)
            self.shared_experts.requires_grad_(False)
        if shared_expert_gate:
            self.shared_expert_gate = nn.Linear(H, 1, bias=False, **kw).requires_grad_(False)
        if self.router_weight.device.type != "meta":
            self.reset_parameters()

    # -- weights ---------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        H, I = self.hidden_size, self.intermediate_size
        nn.init.uniform_(self.router_weight, -1 / math.sqrt(H), 1 / math.sqrt(H))
        nn.init.uniform_(self.gate_up_proj, -1 / math.sqrt(H), 1 / math.sqrt(H))
        nn.init.uniform_(self.down_proj, -1 / math.sqrt(I), 1 / math.sqrt(I))
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()
        if self.shared_experts is not None:
            for lin in (self.shared_experts.gate_proj, self.shared_experts.up_proj,
                        self.shared_experts.down_proj):
                lin.reset_parameters()
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.reset_parameters()

    @property
    def w_gate_up(self) -> torch.Tensor:
        """[E, H, 2I] view of gate_up_proj (no copy), the B operand of the first GEMM."""
        return self.gate_up_proj.transpose(1, 2)

    @property
    def w_down(self) -> torch.Tensor:
        """[E, I, H] view of down_proj (no copy), the B operand of the second GEMM."""
        return self.down_proj.transpose(1, 2)

    # -- forward ---------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router only: (weights [T, k] float32, ids [T, k] int64) for x [T, H]."""
        return _route(
            x, self.router_weight, self.top_k, self.scoring, self.renormalize, self.n_group,
            self.topk_group, self.routed_scaling_factor, self.e_score_correction_bias,
            self.router_fp32,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Apply the layer.

        Args:
            hidden_states: [..., H] (e.g. [B, S, H] or [T, H]); bf16, fp16 or fp32 on the
                parameters' device. Other dtypes than the weights' are cast to it for the
                experts, as transformers does, and the result is cast back.

        Returns:
            The same shape and dtype as hidden_states.

        Raises:
            TypeError: not a float tensor.
            ValueError: last dim not H, or on another device than the parameters.
        """
        x = hidden_states
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor (..., H); got {type(x).__name__}")
        H = self.hidden_size
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"hidden_states must be (..., H) = (..., {H}); got {_shape(x)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"hidden_states must be torch.bfloat16, torch.float16 or torch.float32; got {x.dtype}"
            )
        if x.device != self.gate_up_proj.device:
            raise ValueError(
                f"hidden_states is on {x.device} but the layer's weights are on "
                f"{self.gate_up_proj.device}"
            )
        x2 = x.reshape(-1, H)
        weights, ids = self.route(x2)
        xe = x2.to(self.gate_up_proj.dtype)
        gate_fn = _gated(resolve_activation(self.activation))
        w_gate_up, w_down = self.w_gate_up, self.w_down
        y = _inference_only(
            lambda: _expert_ffn(xe, ids, weights, w_gate_up, w_down, gate_fn, config=self.config),
            xe, weights, w_gate_up, w_down,
        )
        y = y.to(x.dtype)
        if self.shared_experts is not None:
            # In the shared expert's own dtype too (the layer may have been cast after
            # loading); the sum is in the caller's dtype.
            xs = x2.to(self.shared_experts.gate_proj.weight.dtype)
            shared = self.shared_experts(xs)
            if self.shared_expert_gate is not None:
                gate = self.shared_expert_gate(xs.to(self.shared_expert_gate.weight.dtype))
                shared = torch.sigmoid(gate) * shared
            y = y + shared.to(x.dtype)
        return y.view(x.shape)

    def extra_repr(self) -> str:
        parts = [
            f"hidden_size={self.hidden_size}",
            f"intermediate_size={self.intermediate_size}",
            f"num_experts={self.num_experts}",
            f"top_k={self.top_k}",
            f"scoring={self.scoring!r}",
            f"renormalize={self.renormalize}",
        ]
        if self.scoring == "sigmoid":
            parts += [
                f"n_group={self.n_group}",
                f"topk_group={self.topk_group}",
                f"routed_scaling_factor={self.routed_scaling_factor}",
            ]
        act = self.activation if isinstance(self.activation, str) else type(self.activation).__name__
        parts.append(f"activation={act!r}")
        return ", ".join(parts)

    # -- loaders ---------------------------------------------------------------------------

    @classmethod
    def from_fused(
        cls,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        router_weight: torch.Tensor,
        top_k: int,
        *,
        transposed: bool = False,
        e_score_correction_bias: torch.Tensor | None = None,
        shared: Mapping[str, torch.Tensor] | None = None,
        **options: Any,
    ) -> MoE:
        """A layer over existing fused expert tensors, sharing their storage (no copy).

        Args:
            gate_up_proj: transformers 5 / vLLM w13 layout [E, 2I, H] (gate rows, then up
                rows); with transposed=True our canonical [E, H, 2I] (GPT-OSS-style
                is_transposed checkpoints).
            down_proj: [E, H, I]; with transposed=True [E, I, H].
            router_weight: [E, H].
            top_k: experts per token.
            transposed: the tensors are already (E, K, N) = x @ w[e].
            e_score_correction_bias: [E] (sigmoid routing); None = zeros.
            shared: shared expert weights {"gate_proj": [Is, H], "up_proj": [Is, H],
                "down_proj": [H, Is]} and optionally "gate": [1, H] (Qwen2-MoE's
                shared_expert_gate).
            **options: the MoE constructor's routing/activation/config keywords.

        Returns:
            The MoE, its parameters aliasing the given tensors.

        Raises:
            TypeError, ValueError: tensors whose shapes, dtypes or devices do not fit.
        """
        for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj),
                        ("router_weight", router_weight)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if transposed:
            gate_up_proj = gate_up_proj.transpose(-2, -1)
            down_proj = down_proj.transpose(-2, -1)
        return cls._from_tensors(
            gate_up_proj, down_proj, router_weight, top_k, e_score_correction_bias, shared, options
        )

    @classmethod
    def from_vllm(
        cls,
        w13_weight: torch.Tensor,
        w2_weight: torch.Tensor,
        router_weight: torch.Tensor,
        top_k: int,
        **options: Any,
    ) -> MoE:
        """A layer over vLLM FusedMoE weights: w13_weight [E, 2I, H] (w1 = gate rows first,
        then w3 = up), w2_weight [E, H, I]. Same as `from_fused`; no copy."""
        return cls.from_fused(w13_weight, w2_weight, router_weight, top_k, **options)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        top_k: int,
        *,
        prefix: str = "",
        strict: bool = True,
        **options: Any,
    ) -> MoE:
        """A layer from one MoE block of a checkpoint, in any of the layouts users have.

        Keys are read under `prefix` (e.g. "model.layers.3.mlp."):
            router: "gate.weight" [E, H]; "gate.e_score_correction_bias" [E] (DeepSeek).
            experts, one of:
              per expert, Mixtral: "experts.{e}.w1.weight" (gate), "w3" (up), "w2" (down);
              per expert, Qwen/DeepSeek: "experts.{e}.gate_proj.weight", "up_proj", "down_proj";
              transformers 5 fused: "experts.gate_up_proj" [E, 2I, H], "experts.down_proj";
              vLLM: "experts.w13_weight" [E, 2I, H], "experts.w2_weight" [E, H, I].
            shared expert: "shared_experts.{gate,up,down}_proj.weight" (DeepSeek) or
              "shared_expert.{...}.weight" and "shared_expert_gate.weight" (Qwen2-MoE).
        Mixtral hub files put the block under "block_sparse_moe." rather than "mlp.".

        Per-expert tensors are stacked (a copy); fused ones are aliased.

        Args:
            state_dict: name -> tensor.
            top_k: experts per token.
            prefix: the block's key prefix.
            strict: raise if a key under the prefix is not used (e.g. an expert bias this
                layer would silently ignore).
            **options: the MoE constructor's routing/activation/config keywords (e.g.
                scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5).

        Returns:
            The MoE.

        Raises:
            KeyError: no router or no experts under the prefix.
            ValueError: inconsistent shapes, missing experts, unused keys with strict=True.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
        keys = {k[len(prefix):]: k for k in state_dict if k.startswith(prefix)}
        used: set[str] = set()

        def take(name: str) -> torch.Tensor | None:
            if name in keys:
                used.add(name)
                return state_dict[keys[name]]
            return None

        router_weight = take("gate.weight")
        if router_weight is None:
            raise KeyError(f"no router weight {prefix + 'gate.weight'!r} in the state dict")
        bias = take("gate.e_score_correction_bias")
        gate_up, down = _experts_from_keys(take, keys, prefix)
        shared: dict[str, torch.Tensor] | None = None
        for base in ("shared_experts.", "shared_expert."):
            parts = {n: take(f"{base}{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")}
            if any(v is not None for v in parts.values()):
                missing = [n for n, v in parts.items() if v is None]
                if missing:
                    raise ValueError(f"shared expert under {prefix + base!r} lacks {missing}")
                shared = {n: v for n, v in parts.items() if v is not None}
        gate = take("shared_expert_gate.weight")
        if gate is not None:
            if shared is None:
                raise ValueError("shared_expert_gate.weight without a shared expert")
            shared["gate"] = gate
        unused = sorted(keys[k] for k in set(keys) - used)
        if strict and unused:
            raise ValueError(
                f"keys under {prefix!r} this layer does not use (biases and norms are not "
                f"supported; pass strict=False to ignore): {unused[:8]}"
            )
        if bias is not None and "scoring" not in options:
            options["scoring"] = "sigmoid"
        return cls._from_tensors(gate_up, down, router_weight, top_k, bias, shared, options)

    @classmethod
    def from_hf(cls, block: nn.Module, *, config: GemmConfig | None = None) -> MoE:
        """Our layer for a transformers 5 MoE block, sharing its weights (no copy).

        Supported blocks: MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock (with its gated shared
        expert), Qwen3MoeSparseMoeBlock, DeepseekV3MoE and Glm4MoeMoE (sigmoid group-limited
        routing, shared experts). The result gives the same outputs as `block` (fp32: within
        float rounding). For other models use `model.set_experts_implementation("moe_gemm")`,
        which keeps the model's own router and runs its experts on moe_gemm.

        Args:
            block: the transformers module (e.g. `model.model.layers[i].mlp`).
            config: GemmConfig for the grouped GEMMs.

        Returns:
            The MoE, its parameters being the block's own Parameter objects.

        Raises:
            ValueError: an unsupported block, or experts with a layout this layer cannot take.
        """
        from moe_gemm.integrations.transformers import moe_from_hf

        return moe_from_hf(cls, block, config)

    @classmethod
    def _from_tensors(
        cls,
        gate_up_proj: torch.Tensor,  # (E, 2I, H), any strides
        down_proj: torch.Tensor,  # (E, H, I)
        router_weight: torch.Tensor,  # (E, H)
        top_k: int,
        bias: torch.Tensor | None,  # (E,)
        shared: Mapping[str, torch.Tensor] | None,
        options: dict[str, Any],
    ) -> MoE:
        if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
            raise ValueError(
                f"gate_up_proj must be (E, 2I, H) (or (E, H, 2I) with transposed=True); got "
                f"{_shape(gate_up_proj)}"
            )
        E, two_i, H = gate_up_proj.shape
        I = two_i // 2
        if tuple(down_proj.shape) != (E, H, I):
            raise ValueError(
                f"down_proj must be (E, H, I) = ({E}, {H}, {I}) to match gate_up_proj "
                f"{_shape(gate_up_proj)} (or (E, I, H) with transposed=True); got {_shape(down_proj)}"
            )
        if tuple(router_weight.shape) != (E, H):
            raise ValueError(f"router_weight must be (E, H) = ({E}, {H}); got {_shape(router_weight)}")
        if gate_up_proj.dtype not in _FLOAT_DTYPES or down_proj.dtype != gate_up_proj.dtype:
            raise TypeError(
                f"expert weights must share one dtype among bf16, fp16, fp32; got "
                f"{gate_up_proj.dtype} and {down_proj.dtype}"
            )
        device = gate_up_proj.device
        for name, t in (("down_proj", down_proj), ("router_weight", router_weight), ("bias", bias)):
            if t is not None and t.device != device:
                raise ValueError(f"{name} is on {t.device} but gate_up_proj is on {device}")
        if bias is not None and tuple(bias.shape) != (E,):
            raise ValueError(f"e_score_correction_bias must be (E,) = ({E},); got {_shape(bias)}")
        shared_size = 0
        if shared is not None:
            unknown = set(shared) - {"gate_proj", "up_proj", "down_proj", "gate"}
            if unknown or not {"gate_proj", "up_proj", "down_proj"} <= set(shared):
                raise ValueError(
                    "shared must hold 'gate_proj', 'up_proj', 'down_proj' (and optionally "
                    f"'gate'); got keys {sorted(shared)}"
                )
            for name, t in shared.items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"shared[{name!r}] must be a torch.Tensor; got "
                                    f"{type(t).__name__}")
            shared_size = shared["gate_proj"].shape[0]
            want = {"gate_proj": (shared_size, H), "up_proj": (shared_size, H),
                    "down_proj": (H, shared_size), "gate": (1, H)}
            for name, t in shared.items():
                if tuple(t.shape) != want[name]:
                    raise ValueError(f"shared[{name!r}] must be {want[name]}; got {_shape(t)}")
                if t.device != device:
                    raise ValueError(f"shared[{name!r}] is on {t.device} but the expert "
                                     f"weights are on {device}")
            mlp_dtypes = {shared[n].dtype for n in ("gate_proj", "up_proj", "down_proj")}
            if len(mlp_dtypes) != 1 or next(iter(mlp_dtypes)) not in _FLOAT_DTYPES:
                raise TypeError("shared gate_proj, up_proj and down_proj must share one dtype "
                                f"among bf16, fp16, fp32; got {sorted(map(str, mlp_dtypes))}")
            if "gate" in shared and shared["gate"].dtype not in _FLOAT_DTYPES:
                raise TypeError(f"shared['gate'] must be bf16, fp16 or fp32; got "
                                f"{shared['gate'].dtype}")
        opts = dict(options)
        if bias is not None:
            opts.setdefault("scoring", "sigmoid")
            if opts.setdefault("correction_bias", True) is False:
                raise ValueError("an e_score_correction_bias was given with correction_bias=False")
        opts.setdefault("correction_bias", None)
        moe = cls(
            H, I, E, top_k,
            shared_intermediate_size=shared_size,
            shared_expert_gate=shared is not None and "gate" in shared,
            device="meta",
            **opts,
        )
        moe.router_weight = _as_param(router_weight)
        moe.gate_up_proj = _as_param(gate_up_proj)
        moe.down_proj = _as_param(down_proj)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias = (
                bias if bias is not None else torch.zeros(E, device=device, dtype=torch.float32)
            )
        if shared is not None:
            assert moe.shared_experts is not None
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(moe.shared_experts, name).weight = _as_param(shared[name])
            if "gate" in shared:
                assert moe.shared_expert_gate is not None
                moe.shared_expert_gate.weight = _as_param(shared["gate"])
        return moe


def _as_param(t: torch.Tensor) -> nn.Parameter:
    """The tensor itself if it is a Parameter (shared with its owner), else a frozen alias."""
    if isinstance(t, nn.Parameter):
        return t
    return nn.Parameter(t.detach(), requires_grad=False)


def _experts_from_keys(
    take: Callable[[str], torch.Tensor | None], keys: Mapping[str, str], prefix: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up (E, 2I, H), down (E, H, I)) from fused or per-expert checkpoint keys."""
    for gu_name, d_name in (("experts.gate_up_proj", "experts.down_proj"),
                            ("experts.w13_weight", "experts.w2_weight")):
        gate_up, down = take(gu_name), take(d_name)
        if gate_up is not None or down is not None:
            if gate_up is None or down is None:
                raise ValueError(f"{prefix + gu_name!r} and {prefix + d_name!r} go together")
            return gate_up, down
    for gate_n, up_n, down_n in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        ids = sorted(
            {int(k.split(".")[1]) for k in keys
             if k.startswith("experts.") and k.split(".")[1].isdigit()
             and k.split(".")[2:3] == [gate_n]}
        )
        if not ids:
            continue
        if ids != list(range(len(ids))):
            raise ValueError(f"experts under {prefix!r} must be numbered 0..E-1; got {ids}")
        gate_up_list, down_list = [], []
        for e in ids:
            t = {}
            for n in (gate_n, up_n, down_n):
                v = take(f"experts.{e}.{n}.weight")
                if v is None:
                    v = take(f"experts.{e}.{n}")
                if v is None:
                    raise ValueError(f"expert {e} has no {prefix}experts.{e}.{n}.weight")
                t[n] = v
            gate_up_list.append(torch.cat([t[gate_n], t[up_n]], dim=0))
            down_list.append(t[down_n])
        return torch.stack(gate_up_list), torch.stack(down_list)
    raise KeyError(
        f"no expert weights under {prefix!r}: expected experts.{{e}}.w1/w3/w2, "
        "experts.{e}.gate_proj/up_proj/down_proj, experts.gate_up_proj/down_proj or "
        "experts.w13_weight/w2_weight"
    )
