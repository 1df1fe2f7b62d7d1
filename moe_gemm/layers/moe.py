"""The MoE layer: router, device-side permutation, two grouped GEMMs and a weighted combine.

    logits = x @ router_weight.T                     (T, E)
    weights, ids = router(logits)                    (T, k) each; softmax or sigmoid routing
    out = expert_ffn(x, ids, weights, ...)           (T, H): layers/experts.py
    out += shared experts (DeepSeek), optionally times sigmoid(x @ g) (Qwen2-MoE)

`moe_forward` is the functional form (route + experts), `MoE` the nn.Module with transformers'
parameter names and layouts; its loaders (from_fused, from_vllm, from_state_dict, from_hf)
come from the MoELoaders mixin in layers/checkpoints.py, from_hf's work is done in
integrations/transformers.py; its switchable options (activation, fused, config,
router_jitter_noise), checked on assignment, from the MoEOptions mixin in
layers/moe_options.py; its weights' init, FP8 form (quantize_fp8), views and checks from the
MoEWeights mixin in layers/moe_weights.py.
The forward has no data-dependent Python control flow and never synchronizes on CUDA:
torch.compile(fullgraph=True) traces it whole, and a CUDA graph captures it.

Inference only: the routed path (the input, the router, the routed experts' weights) has no
backward. Calling the layer with gradients enabled works, but a `.backward()` that reaches that
path raises a RuntimeError; a shared expert and a module activation are plain torch modules,
whose parameters, made trainable, get their gradients.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from moe_gemm.config import GemmConfig
from moe_gemm.layers.checkpoints import MoELoaders
from moe_gemm.layers.experts import (
    Activation,
    canonical_activation,
    check_gemm_options,
    check_tokens,
    expert_ffn,
    gated,
    moe_experts,
    resolve_activation,
)
from moe_gemm.layers.experts_fp8 import (
    expert_ffn_fp8,
)
from moe_gemm.layers.fused_experts import fused_gate_for
from moe_gemm.layers.gate_activations import apply_gate
from moe_gemm.layers.layer_checks import (
    check_hidden_states,
    check_layer_args,
    check_routing,
)
from moe_gemm.layers.moe_options import MoEOptions, replace_activation
from moe_gemm.layers.moe_weights import MoEWeights
from moe_gemm.layers.routing import (
    BIASED_SCORINGS,
    check_correction_bias,
    check_flag,
    check_int,
    check_router_weight,
    check_token_ids,
    route_tokens,
    router_jitter,
)
from moe_gemm.layers.shared_stream import routed_beside_shared, side_stream_wanted
from moe_gemm.ops.validation import check_dense, shape_text

__all__ = ["GatedMLP", "MoE", "moe_experts", "moe_forward"]

Scoring = Literal["softmax", "sigmoid", "sqrtsoftplus"]


# ---------------------------------------------------------------------------------------------
# The functional form


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
    fused: bool | None = None,
) -> torch.Tensor:
    """Functional MoE: route, then the routed experts (no shared experts). Inference only.

    Args:
        x: [T, H] tokens; bf16, fp16 or fp32.
        router_weight: [E, H] router (gate) weight, on x's device.
        w_gate_up: [E, H, 2I] fused gate+up weights (see moe_experts for layouts).
        w_down: [E, I, H] down weights.
        top_k: experts per token.
        scoring: "softmax" (Mixtral, Qwen, Mistral 4), "sigmoid" (DeepSeek-V3) or
            "sqrtsoftplus" (DeepSeek-V4: sqrt(softplus(logits)), routed as sigmoid).
        renormalize: divide the top-k weights by their sum (Qwen's norm_topk_prob; Mixtral
            always True).
        n_group, topk_group: group-limited routing (DeepSeek-V3 with sigmoid scores, Mistral
            4 with softmax scores).
        routed_scaling_factor: multiplies the weights (after renormalising); finite.
        correction_bias: [E] selection-only bias (sigmoid and sqrtsoftplus only), e.g.
            DeepSeek-V3's e_score_correction_bias.
        router_fp32: compute the router logits in fp32 (DeepSeek) rather than in the weight's
            dtype (Mixtral, Qwen); None = True for sigmoid and sqrtsoftplus, False for
            softmax.
        activation: "silu", "gelu", "gelu_tanh" or a callable.
        config: GemmConfig for the grouped GEMMs.
        fused: the fused expert kernel (moe_experts): None = where it runs, True / False.

    Returns:
        [T, H] in x's dtype.

    Raises:
        TypeError, ValueError: arguments that do not fit, with the expected shape.
    """
    x = check_tokens(x)
    H = x.shape[1]
    if not isinstance(w_gate_up, torch.Tensor):
        raise TypeError(
            f"w_gate_up must be a torch.Tensor (E, H, 2I); got {type(w_gate_up).__name__}"
        )
    check_dense("w_gate_up", w_gate_up)
    if w_gate_up.dim() != 3:
        raise ValueError(f"w_gate_up must be a 3-D tensor (E, H, 2I) = (E, {H}, 2I); got "
                         f"{shape_text(w_gate_up)}")
    E = w_gate_up.shape[0]
    check_router_weight(router_weight, E, H)
    if router_weight.device != x.device:
        raise ValueError(f"router_weight is on {router_weight.device} but x is on {x.device}")
    check_routing(E, top_k, scoring, n_group, topk_group, routed_scaling_factor, renormalize)
    if correction_bias is not None and scoring not in BIASED_SCORINGS:
        raise ValueError("correction_bias is used by scoring='sigmoid' or 'sqrtsoftplus' only")
    if correction_bias is not None:  # (routing would name it 'bias' and the logits' device)
        check_correction_bias(correction_bias, E, x.device, "correction_bias", "x is")
    # Before routing, so that a bad option fails before any work (moe_experts checks again).
    check_gemm_options(config, fused)
    router_fp32 = check_flag("router_fp32", router_fp32, none_ok=True)
    fp32 = scoring != "softmax" if router_fp32 is None else router_fp32
    weights, ids = route_tokens(
        x, router_weight, top_k, scoring, renormalize, n_group, topk_group,
        float(routed_scaling_factor), correction_bias, fp32,
    )
    return moe_experts(x, ids, weights, w_gate_up, w_down, activation=activation, config=config,
                       fused=fused)


# ---------------------------------------------------------------------------------------------
# The module


def _activation_name(act: object) -> str:
    """An activation as the reprs name it: a name as it is, a function by its name (its
    type's name is 'function' or 'builtin_function_or_method'), a module or other callable
    by its class."""
    if isinstance(act, str):
        return act
    return getattr(act, "__name__", None) or type(act).__name__


def _routed_experts(moe: MoE, x: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """MoE.forward's routed experts on tokens x [T, H] routed to ids / weights [T, k]."""
    gate_fn = gated(resolve_activation(moe.activation))
    if moe.gate_up_proj_scale_inv is not None:
        # FP8 experts: the activations are quantized on the fly; the GEMMs write x's dtype.
        return expert_ffn_fp8(x, ids, weights, moe.gate_up_proj, moe.gate_up_proj_scale_inv,
                              moe.down_proj, moe.down_proj_scale_inv, gate_fn,
                              config=moe.config, ids_in_range=True)
    return expert_ffn(x.to(moe.gate_up_proj.dtype), ids, weights, moe.w_gate_up, moe.w_down,
                      gate_fn, config=moe.config,
                      fused_gate=fused_gate_for(canonical_activation(moe.activation)),
                      fused=moe.fused, ids_in_range=True)


def shared_expert_output(moe: MoE, x: torch.Tensor) -> torch.Tensor | None:
    """The shared experts of `moe` (times their sigmoid gate, Qwen2-MoE) on tokens x [T, H],
    computed in their own dtype (the layer may have been cast after loading), or None where
    the layer has none."""
    if moe.shared_experts is None:
        return None
    xs = x.to(moe.shared_experts.gate_proj.weight.dtype)
    out = moe.shared_experts(xs)
    if moe.shared_expert_gate is not None:
        out = torch.sigmoid(moe.shared_expert_gate(xs.to(moe.shared_expert_gate.weight.dtype))) * out
    return out


class GatedMLP(nn.Module):
    """A dense gated FFN, down(act(gate(x)) * up(x)): the shared expert of DeepSeek / Qwen2.

    `activation` ("silu", "gelu", "gelu_tanh" or a callable) is an attribute: the forward
    applies its current value (inside MoE it follows the layer's `moe.activation`, which the
    layer registers, not this MLP: see follow_activation).
    """

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

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "activation":
            replace_activation(self, value)
        super().__setattr__(name, value)

    def follow_activation(self, activation: Activation) -> None:
        """Apply `activation`, owned by the layer this MLP belongs to (MoE's shared expert),
        without registering it as a child module here: a module activation with parameters
        (nn.PReLU()) registered by both the layer and this MLP appeared in state_dict()
        twice, under "activation." and "shared_experts.activation.", and a checkpoint of
        the layer was refused by its own loader. Checked as an assignment is."""
        replace_activation(self, activation)
        self._modules.pop("activation", None)  # (a module activation of its own, set before)
        object.__setattr__(self, "activation", activation)  # (nn.Module's would register it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Resolved per call (a dict lookup), not once at construction: a function resolved in
        # __init__ outlived a reassigned `activation`.
        act = resolve_activation(self.activation)
        return self.down_proj(apply_gate(act, self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        # (a followed module activation is not a child here, so the child list omits it)
        return f"activation={_activation_name(self.activation)!r}"


class MoE(MoELoaders, MoEOptions, MoEWeights):
    """A mixture-of-experts FFN layer on moe_gemm's grouped GEMMs. Inference only.

    out = sum over the top-k experts e of weight_e * down_e(act(gate_e(x)) * up_e(x))
          [+ shared experts(x)] [* sigmoid(shared_expert_gate(x)) on the shared part]

    Routers: softmax top-k with or without renormalising (Mixtral; Qwen2/Qwen3-MoE
    norm_topk_prob), group-limited softmax top-k with a routed scaling factor (Mistral 4),
    sigmoid scores with a selection-only correction bias, group-limited top-k and a routed
    scaling factor (DeepSeek-V3), the same over sqrt(softplus) scores (DeepSeek-V4), and hash
    routing by token id (DeepSeek-V4's first layers: `hash_vocab_size`, forward's
    `input_ids`). Exactly transformers' arithmetic, so `MoE.from_hf(block)` reproduces a
    transformers block's output.

    Inference only: the routed path has no backward. The layer's parameters are created with
    requires_grad=False; if it runs with gradients enabled on the input, the router weight or
    the routed experts' weights it still computes the output, but a `.backward()` reaching them
    raises a RuntimeError (torch may have filled other parameters' .grad by then). A shared
    expert and a module activation (`activation=nn.PReLU()`) are plain torch: their
    parameters, made trainable, get gradients as in any module. On CUDA the forward never
    synchronizes with the host and can be captured in a CUDA graph (with the cute backend or
    torch's native bf16 grouped_mm under the torch backend).

    Parameters (transformers 5's layouts, and its names but for the router, which
    transformers calls "gate.weight"; `w_gate_up`/`w_down` are the no-copy (E, K, N) views the
    grouped GEMMs take; `MoE.from_state_dict` reads this layer's state_dict too):
        router_weight: [E, H].
        e_score_correction_bias: [E] float32 buffer (sigmoid or sqrtsoftplus routing with
            correction_bias).
        tid2eid: [hash_vocab_size, top_k] int64 buffer, the hash router's token id -> expert
            ids (transformers' name); None without hash routing. An assigned table is
            checked (integer, 2-D, expert ids in [0, E)).
        gate_up_proj: [E, 2I, H], gate rows first, then up rows.
        down_proj: [E, H, I].
        shared_experts: GatedMLP(H, shared_intermediate_size) or None.
        shared_expert_gate: nn.Linear(H, 1, bias=False) or None.

    Args:
        hidden_size: H.
        intermediate_size: I, per expert.
        num_experts: E. Both attributes read the expert weights' sizes (new weights assigned
            later update them; assigning another value than theirs is a ValueError).
        top_k: experts per token, 1 <= top_k <= E.
        scoring: "softmax", "sigmoid" or "sqrtsoftplus" (DeepSeek-V4).
        renormalize: divide the top-k weights by their sum.
        n_group, topk_group: group-limited routing (either scoring).
        routed_scaling_factor: multiplies the routed weights; finite.
            The routing options (top_k to routed_scaling_factor) and hidden_size are
            attributes: an assignment is checked on its own as the constructor checks it
            (TypeError / ValueError, the layer unchanged), and the forward checks how they
            combine (top_k <= E, groups that fit E and top_k, an e_score_correction_bias
            with softmax scoring: ValueError).
        correction_bias: keep an e_score_correction_bias buffer (sigmoid and sqrtsoftplus
            only); None = True for those.
        hash_vocab_size: V > 0 routes by token id instead of by score (DeepSeek-V4's
            hash layers): a tid2eid buffer [V, top_k] (zeros until loaded) chooses each
            token's experts from its id, the forward's `input_ids`; the scores (`scoring`,
            without bias or groups) weight them, renormalised (+1e-20), times the factor.
            0 (default) = off.
        router_fp32: router logits in fp32 (DeepSeek); None = True for sigmoid and
            sqrtsoftplus, False for softmax (Mixtral and Qwen compute them in the weight
            dtype). An attribute
            (an assignment is checked; None follows the scoring, also one assigned later).
        router_jitter_noise: Mixtral's router jitter (transformers' config.router_jitter_noise,
            which from_hf carries): in training mode (module.train(), torch's default for a
            new module) the forward multiplies its input by uniform noise in
            [1 - router_jitter_noise, 1 + router_jitter_noise] from torch's default
            generator, as transformers does; the jittered tokens feed the router, the routed
            and the shared experts. 0 (default) = off; eval mode never jitters. An attribute.
        activation: "silu" (SwiGLU, default), "gelu", "gelu_tanh", a ClampedSiLU(limit)
            (a swiglu_limit: GLM-5-Next, HY-V4, DeepSeek-V4), a ClampedSwiGLU(limit, alpha)
            (gpt-oss's gate over concatenated halves: MiniMax-M3), a PostClampedSiLU(limit)
            (the clamp after the SiLU: Step-3.7; unfused) or a callable: the routed
            experts' and the shared expert's. An attribute: setting `moe.activation` switches
            both (checked as in the constructor).
        shared_intermediate_size: intermediate size of the always-on shared expert(s)
            (DeepSeek: moe_intermediate_size * n_shared_experts); 0 = none.
        shared_expert_gate: scale the shared expert by sigmoid(Linear(H, 1)(x)) (Qwen2-MoE).
        config: GemmConfig for the grouped GEMMs (e.g. GemmConfig(backend="torch")).
        fused: the experts on the fused kernel (the token gather, gated activation and
            routing weights inside the two GEMMs; layers/fused_experts.py): None (default) =
            on a Hopper GPU with a named activation, a ClampedSiLU or a ClampedSwiGLU, True =
            always (the fused ops' torch backend elsewhere), False = the unfused grouped
            GEMMs; an activation the kernel has no gate for (a callable, a PostClampedSiLU)
            runs unfused whatever it says. An attribute: set
            `moe.fused` to switch a built layer.
        device, dtype: where and in what dtype (bf16, fp16 or fp32) to create the
            parameters; dtype=None is torch's default dtype, refused (TypeError) where that
            is not one of the three (torch.set_default_dtype(torch.float64)); a device
            string torch cannot parse ("gpu") is a ValueError.
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
        router_jitter_noise: float = 0.0,
        activation: Activation = "silu",
        shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        config: GemmConfig | None = None,
        fused: bool | None = None,
        hash_vocab_size: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hash_vocab_size = check_int("hash_vocab_size", hash_vocab_size)
        if hash_vocab_size < 0:
            raise ValueError(f"hash_vocab_size must be an int >= 0; got {hash_vocab_size}")
        correction_bias = check_layer_args(
            hidden_size, intermediate_size, shared_intermediate_size, num_experts, top_k,
            scoring, renormalize, n_group, topk_group, routed_scaling_factor, correction_bias,
            router_fp32, shared_expert_gate, activation, config, fused, dtype,
            router_jitter_noise, device)
        # (Python ints: numpy's integer scalars pass the checks)
        hidden_size, intermediate_size, num_experts = (
            int(hidden_size), int(intermediate_size), int(num_experts))
        shared_intermediate_size = int(shared_intermediate_size)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = int(top_k)
        self.scoring = scoring
        self.renormalize = bool(renormalize)
        self.n_group = int(n_group)
        self.topk_group = int(topk_group)
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.router_fp32 = router_fp32  # (None: the scoring's default; see MoEOptions)
        self.router_jitter_noise = router_jitter_noise
        self.activation = activation
        self.config = config
        self.fused = fused
        E, H, I = num_experts, hidden_size, intermediate_size
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.router_weight = nn.Parameter(torch.empty(E, H, **kw), requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I, **kw), requires_grad=False)
        # FP8 experts (layers/experts_fp8.py): the weights' decoding scales, transformers'
        # FP8Experts names; None while the experts are 16-bit (see quantize_fp8).
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)
        bias = torch.zeros(E, device=device, dtype=torch.float32) if correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        table = (torch.zeros(hash_vocab_size, self.top_k, device=device, dtype=torch.int64)
                 if hash_vocab_size else None)
        self.register_buffer("tid2eid", table)
        self.shared_experts: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size:
            self.shared_experts = GatedMLP(H, shared_intermediate_size, **kw)
            self.shared_experts.requires_grad_(False)
            self.shared_experts.follow_activation(activation)
        if shared_expert_gate:
            self.shared_expert_gate = nn.Linear(H, 1, bias=False, **kw).requires_grad_(False)
        if self.router_weight.device.type != "meta":
            self.reset_parameters()

    # -- forward ---------------------------------------------------------------------------

    def route(self, x: torch.Tensor, input_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router only: (weights [T, k] float32, ids [T, k] int64) for x [T, H], or [..., H]
        flattened to T tokens as transformers' routers do. x as given: the router jitter is
        the forward's (transformers' routers do not jitter either; their blocks do).
        input_ids: the tokens' ids, for a hash-routed layer (see forward).

        Raises:
            TypeError, ValueError: x as forward's hidden_states would raise (checked here,
                else a [B, S, H] input or a wrong H failed in the router with a message
                about logits, or inside F.linear).
        """
        self._check_parameters()
        x = check_hidden_states(x, self.hidden_size, self.router_weight.device)
        return self._route_tokens(x.reshape(-1, self.hidden_size), input_ids)

    def _route_tokens(self, x: torch.Tensor, input_ids: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """route for x [T, H] already checked (the forward's)."""
        table = self._buffers.get("tid2eid")  # (a layer pickled before hash routing has none)
        return route_tokens(
            x, self.router_weight, self.top_k, self.scoring, self.renormalize, self.n_group,
            self.topk_group, self.routed_scaling_factor,
            None if table is not None else self.e_score_correction_bias, self.router_fp32,
            table, input_ids,
        )

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Apply the layer.

        Args:
            hidden_states: [..., H] (e.g. [B, S, H] or [T, H]); bf16, fp16 or fp32 on the
                parameters' device. Other dtypes than the weights' are cast to it for the
                experts, as transformers does, and the result is cast back. In training mode
                with router_jitter_noise > 0, multiplied by the jitter first (not in place).
            input_ids: the token ids of hidden_states (one per token, any shape), needed by
                a hash-routed layer (tid2eid set: DeepSeek-V4's first layers, whose blocks
                take them the same way) and ignored by the others. On a GPU their values are
                not checked (no synchronization): an id outside the table is clamped.

        Returns:
            The same shape and dtype as hidden_states.

        Raises:
            TypeError: not a float tensor.
            ValueError: last dim not H, or on another device than the parameters; the
                layer's router and expert weights not fitting one another.
        """
        self._check_parameters()
        x = check_hidden_states(hidden_states, self.hidden_size, self.gate_up_proj.device)
        self.check_weight_dtype()
        if self.training and self.router_jitter_noise > 0:
            x = router_jitter(x, self.router_jitter_noise)  # (drawn as the input's shape)
        x2 = x.reshape(-1, self.hidden_size)
        if self._buffers.get("tid2eid") is not None:  # (fail before the shared expert runs)
            check_token_ids(input_ids, x2.shape[0], x2.device)

        def routed() -> torch.Tensor:
            weights, ids = self._route_tokens(x2, input_ids)
            return _routed_experts(self, x2, ids, weights).to(x.dtype)

        if self.shared_experts is not None and side_stream_wanted(x2):
            y, shared = routed_beside_shared(x2.device, routed,
                                             lambda: shared_expert_output(self, x2))
        else:
            y, shared = routed(), shared_expert_output(self, x2)
        if shared is not None:
            y = y + shared.to(x.dtype)  # (the sum in the caller's dtype)
        return y.view(x.shape)

    def extra_repr(self) -> str:
        names = ["hidden_size", "intermediate_size", "num_experts", "top_k", "scoring",
                 "renormalize"]
        if self.scoring != "softmax":
            names += ["n_group", "topk_group", "routed_scaling_factor"]
        parts = [f"{n}={getattr(self, n)!r}" for n in names]
        if self.fp8 is not None:
            parts.append(f"fp8={self.fp8!r}")
        if self.router_jitter_noise:
            parts.append(f"router_jitter_noise={self.router_jitter_noise!r}")
        table = self._buffers.get("tid2eid")
        if table is not None:
            parts.append(f"hash_vocab_size={table.shape[0]}")
        return ", ".join([*parts, f"activation={_activation_name(self.activation)!r}"])
