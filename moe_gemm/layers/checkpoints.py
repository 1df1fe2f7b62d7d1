"""Loaders: an MoE layer over weights that already exist, in the layouts users have.

Fused tensors (transformers 5, vLLM, GPT-OSS-style transposed), one block of a checkpoint's
state dict (per-expert Mixtral / Qwen / DeepSeek keys, fused keys, shared experts), and the
common end of every loader, `moe_from_tensors`, which checks the tensors against each other and
makes them the layer's parameters without a copy. The MoE class exposes these as its from_*
classmethods (the MoELoaders mixin here); transformers blocks (MoE.from_hf) go through
integrations/transformers.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moe_gemm.layers.experts import FLOAT_DTYPES
from moe_gemm.layers.experts_fp8 import (
    FP8_DTYPES,
    SCALE_BLOCK,
    check_fp8_experts,
    decoding_scale,
    dequantize_weight,
    per_channel,
    row_scale,
)
from moe_gemm.layers.routing import (
    check_correction_bias,
    check_flag,
    check_int,
    check_router_weight,
    check_token_expert_table,
)
from moe_gemm.ops.validation import check_dense, shape_text

if TYPE_CHECKING:
    from moe_gemm.config import GemmConfig
    from moe_gemm.layers.moe import MoE

__all__ = ["MoELoaders", "check_loader_options", "moe_from_fused", "moe_from_state_dict",
           "moe_from_tensors"]


class MoELoaders:
    """MoE's checkpoint constructors (MoE inherits them): each builds a `cls` layer through
    the loader functions below, or integrations/transformers.py for from_hf."""

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
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
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
            scales: for FP8 expert weights, their float32 decoding scales as a pair of
                tensors (gate_up, down): 128x128 blocks [E, 2I/128, H/128] and
                [E, H/128, I/128] (transformers' gate_up_proj_scale_inv /
                down_proj_scale_inv), or per channel [E, 2I] and [E, H]; in the orientation
                of the weights as given.
            **options: the MoE constructor's routing/activation/config keywords.

        Returns:
            The MoE, its parameters aliasing the given tensors.

        Raises:
            TypeError, ValueError: tensors whose shapes, dtypes or devices do not fit (a
                non-float router_weight or e_score_correction_bias, scales not a pair of
                tensors).
        """
        return moe_from_fused(
            cls, gate_up_proj, down_proj, router_weight, top_k, transposed=transposed,
            e_score_correction_bias=e_score_correction_bias, shared=shared, scales=scales,
            **options,
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

        Per-expert keys (Mixtral's w1/w3/w2, Qwen/DeepSeek's gate/up/down_proj) are stacked (a
        copy); fused ones (transformers 5, vLLM, and this layer's own state_dict) are aliased;
        routers, correction biases and shared experts come along (the key table:
        layers/checkpoints.moe_from_state_dict). The routing options are not in a state dict:
        pass them as **options.

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
            TypeError: a value under the prefix that is not a tensor.
            ValueError: inconsistent shapes or dtypes, missing experts, both
                "shared_experts." and "shared_expert." keys, unused keys with strict=True.
        """
        return moe_from_state_dict(cls, state_dict, top_k, prefix=prefix, strict=strict,
                                   **options)

    @classmethod
    def from_hf(cls, block: nn.Module, *, config: GemmConfig | None = None) -> MoE:
        """Our layer for a transformers 5 MoE block, sharing its weights (no copy).

        Supported blocks: those of moe_gemm.integrations.transformers.HF_BLOCKS (the list, with
        each model's router and gate, is in docs/USAGE.md): Mixtral's, the Qwen-MoE family's,
        OLMoE's and the other softmax routers, with or without a gated shared expert;
        DeepSeek-V3's and the other group-limited sigmoid routers; MiniMax-M2/M3's and
        Step-3.7's biased sigmoid top-k; Mistral 4's group-limited softmax; DeepSeek-V4's
        sqrt(softplus) and hash routers (a hash-routed layer takes input_ids=, as the block);
        the swiglu_limit experts as ClampedSiLU, ClampedSwiGLU or PostClampedSiLU
        activations, a shared expert's own clamp set apart where it differs. The
        result gives the same outputs as `block` (fp32: within
        float rounding): it takes the block's training / eval mode, and Mixtral's router
        jitter (config.router_jitter_noise) comes along as router_jitter_noise; an activation
        without one of our names is the experts' own act_fn module (shared with the block,
        registered once in the layer). For other models use
        `model.set_experts_implementation("moe_gemm")`, which keeps the model's own router and
        runs its experts on moe_gemm.

        Args:
            block: the transformers module (e.g. `model.model.layers[i].mlp`).
            config: GemmConfig for the grouped GEMMs.

        Returns:
            The MoE, its parameters being the block's own Parameter objects (but an FP8
            shared expert's, transformers' FP8Linear: dequantized, as from_state_dict does).

        Raises:
            ValueError: an unsupported block, or experts with a layout this layer cannot take.
        """
        from moe_gemm.integrations.transformers import moe_from_hf

        return moe_from_hf(cls, block, config)


def moe_from_fused(
    cls: type[MoE],
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    *,
    transposed: bool = False,
    e_score_correction_bias: torch.Tensor | None = None,
    shared: Mapping[str, torch.Tensor] | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    **options: Any,
) -> MoE:
    """MoE.from_fused (see there): a `cls` layer over fused expert tensors, no copy."""
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj),
                    ("router_weight", router_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    scales = _check_scales(scales)
    if check_flag("transposed", transposed):
        gate_up_proj = gate_up_proj.transpose(-2, -1)
        down_proj = down_proj.transpose(-2, -1)
        if scales is not None and scales[0].dim() == 3:  # block scales follow their weights
            scales = (scales[0].transpose(-2, -1), scales[1].transpose(-2, -1))
    return moe_from_tensors(
        cls, gate_up_proj, down_proj, router_weight, top_k, e_score_correction_bias, shared,
        options, scales=scales,
    )


# MoE's own parameter and buffer names -> the checkpoint names moe_from_state_dict reads (the
# shared expert's "shared_experts." / "shared_expert_gate." names are the same in both).
OWN_NAMES = {"router_weight": "gate.weight",
             "e_score_correction_bias": "gate.e_score_correction_bias",
             "tid2eid": "gate.tid2eid",
             "gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj",
             "gate_up_proj_scale_inv": "experts.gate_up_proj_scale_inv",
             "down_proj_scale_inv": "experts.down_proj_scale_inv"}


def moe_from_state_dict(
    cls: type[MoE],
    state_dict: Mapping[str, torch.Tensor],
    top_k: int,
    *,
    prefix: str = "",
    strict: bool = True,
    experts: tuple[int, int] | None = None,
    **options: Any,
) -> MoE:
    """MoE.from_state_dict (see there for the arguments): a `cls` layer from one MoE block of
    a checkpoint.

    experts: [start, end), the checkpoint's numbers of the per-expert keys to load (an
    expert-parallel rank's share, whose view of the checkpoint holds only those); None: all,
    numbered from 0.

    Keys are read under `prefix` (e.g. "model.layers.3.mlp."):
        router: "gate.weight" [E, H]; "gate.e_score_correction_bias" [E] (DeepSeek);
          "gate.tid2eid" [V, top_k] (DeepSeek-V4's hash layers: the layer routes by token
          id, see MoE's hash_vocab_size; pass its scoring, "sqrtsoftplus").
        experts, one of:
          per expert, Mixtral: "experts.{e}.w1.weight" (gate), "w3" (up), "w2" (down);
          per expert, Qwen/DeepSeek: "experts.{e}.gate_proj.weight", "up_proj", "down_proj";
          transformers 5 fused: "experts.gate_up_proj" [E, 2I, H], "experts.down_proj";
          vLLM: "experts.w13_weight" [E, 2I, H], "experts.w2_weight" [E, H, I].
        shared expert: "shared_experts.{gate,up,down}_proj.weight" (DeepSeek) or
          "shared_expert.{...}.weight" and "shared_expert_gate.weight" (Qwen2-MoE).
    Mixtral hub files put the block under "block_sparse_moe." rather than "mlp.". This layer's
    own state_dict (MoE.state_dict(): "router_weight", "gate_up_proj", ...) is read too, with
    a module activation's parameters ("activation.weight" of nn.PReLU()), which are loaded
    into the module passed as activation= (aliased, as the fused weights).
    FP8 checkpoints: each FP8 weight comes with its decoding scale, "<name>.weight_scale_inv"
    (DeepSeek-V3, Kimi-K2, Qwen3-FP8: 128x128 blocks) or "<name>.weight_scale" (compressed-
    tensors: per channel or per tensor; Quark: blocks); the fused forms use
    "experts.gate_up_proj_scale_inv" / "experts.down_proj_scale_inv" (transformers 5: blocks,
    or [E, c, 1] per-tensor scales of c equal row chunks) or
    "experts.w13_weight_scale[_inv]" / "experts.w2_weight_scale[_inv]" (vLLM; per-tensor
    ones per shard as [E, 2], the gate's and the up's, are read as row chunks). Scales are
    float32 or a float dtype widened to it (bf16, fp16, UE8M0); other dtypes are refused. The routed
    experts stay FP8; static "input_scale"s are read and not used (activations are quantized
    per token on the fly); an FP8 shared expert is dequantized to bf16 (it is one dense MLP).

    Per-expert tensors are stacked (a copy); fused ones are aliased.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
    strict = check_flag("strict", strict)  # ("no" would be truthy: strict where declined)
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str (e.g. 'model.layers.3.mlp.', or '' for none); "
                        f"got {type(prefix).__name__}")
    keys = {k[len(prefix):]: k for k in state_dict if k.startswith(prefix)}
    given = {}  # checkpoint name -> the name this state_dict spells it with (messages)
    if "router_weight" in keys and "gate.weight" not in keys:
        # This layer's own state_dict (MoE.state_dict()): its names read as the checkpoint
        # names of the same tensors (the experts are transformers 5's fused layout).
        keys = {OWN_NAMES.get(k, k): full for k, full in keys.items()}
        given = {ckpt: own for own, ckpt in OWN_NAMES.items()}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor | None:
        if name in keys:
            used.add(name)
            value = state_dict[keys[name]]
            if not isinstance(value, torch.Tensor):  # (the code below reads .dtype, .shape)
                raise TypeError(f"state_dict[{keys[name]!r}] must be a torch.Tensor; got "
                                f"{type(value).__name__}")
            return value
        return None

    router_weight = take("gate.weight")
    if router_weight is None:
        raise KeyError(f"no router weight {prefix + 'gate.weight'!r} in the state dict")
    bias = take("gate.e_score_correction_bias")
    hash_table = take("gate.tid2eid")
    gate_up, down, scales = _experts_from_keys(
        take, keys, prefix, lambda name: keys.get(name, prefix + given.get(name, name)), experts)
    shared: dict[str, torch.Tensor] | None = None
    bases = [b for b in ("shared_experts.", "shared_expert.") if any(k.startswith(b)
                                                                      for k in keys)]
    if len(bases) > 1:  # one layer has one shared MLP: taking either would drop the other
        raise ValueError(f"both {prefix + bases[0]!r} (DeepSeek) and {prefix + bases[1]!r} "
                         "(Qwen2-MoE) keys are present; a block has one shared expert")
    for base in bases:
        parts = {n: _dense_weight(take, f"{base}{n}") for n in ("gate_proj", "up_proj",
                                                                 "down_proj")}
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
    act_state = _activation_state(take, keys, prefix, options, strict)
    unused = sorted(keys[k] for k in set(keys) - used)
    if strict and unused:
        raise ValueError(
            f"keys under {prefix!r} this layer does not use (biases and norms are not "
            f"supported; pass strict=False to ignore): {unused[:8]}"
        )
    if bias is not None and "scoring" not in options:
        options["scoring"] = "sigmoid"
    moe = moe_from_tensors(cls, gate_up, down, router_weight, top_k, bias, shared, options,
                           scales=scales, hash_table=hash_table)
    if act_state:
        _load_activation(moe.activation, act_state, prefix, strict)
    return moe


# A module activation's parameters and buffers in the layer's own state_dict, and where a
# layer saved while its shared expert registered the activation as well kept them a second
# time (the same values).
_ACTIVATION_KEYS = ("activation.", "shared_experts.activation.")


def _activation_state(take: Callable[[str], torch.Tensor | None], keys: Mapping[str, str],
                      prefix: str, options: Mapping[str, Any], strict: bool
                      ) -> dict[str, torch.Tensor]:
    """The "activation.*" entries (name within the activation module -> tensor), taken; {}
    where there are none, or where strict=False and the activation asked for is not a module
    (its keys then stay unused, as other keys this layer does not read)."""
    found = sorted(k for k in keys if k.startswith(_ACTIVATION_KEYS))
    if not found:
        return {}
    if not isinstance(options.get("activation"), nn.Module):
        if strict:
            raise ValueError(
                f"{[keys[k] for k in found][:8]} are a module activation's state (a layer "
                "built with, e.g., activation=torch.nn.PReLU()): pass such a module as "
                "activation= to load it into, or strict=False to ignore them")
        return {}
    state: dict[str, torch.Tensor] = {}
    for k in found:  # ("activation." sorts first: its values win over the duplicates')
        value = take(k)
        assert value is not None
        state.setdefault(k.split("activation.", 1)[1], value)
    return state


def _load_activation(act: nn.Module, state: Mapping[str, torch.Tensor], prefix: str,
                     strict: bool) -> None:
    """A module activation's state, loaded into it: its tensors become the state dict's (no
    copy, as the loaders alias the fused weights, and on their device)."""
    try:
        act.load_state_dict(state, strict=strict, assign=True)
    except RuntimeError as exc:  # (torch's message lists the keys or shapes that differ)
        raise ValueError(f"the activation module {type(act).__name__} does not take the "
                         f"state under {prefix + 'activation.'!r}: {exc}") from exc


def moe_from_tensors(
    cls: type[MoE],
    gate_up_proj: torch.Tensor,  # (E, 2I, H), any strides
    down_proj: torch.Tensor,  # (E, H, I)
    router_weight: torch.Tensor,  # (E, H)
    top_k: int,
    bias: torch.Tensor | None,  # (E,)
    shared: Mapping[str, torch.Tensor] | None,
    options: Mapping[str, Any],
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    hash_table: torch.Tensor | None = None,
) -> MoE:
    """A `cls` layer whose parameters are these tensors (aliased, or the Parameters
    themselves), after checking that they fit together: what every loader ends with.

    Args:
        gate_up_proj: [E, 2I, H] (transformers / vLLM layout), any strides.
        down_proj: [E, H, I].
        router_weight: [E, H].
        top_k: experts per token.
        bias: [E] e_score_correction_bias (selects sigmoid routing), or None.
        shared: {"gate_proj", "up_proj", "down_proj"[, "gate"]} shared expert weights, or
            None.
        options: the MoE constructor's routing/activation/config keywords.
        scales: FP8 experts' decoding scales (gate_up, down): 128x128 blocks
            [E, 2I/128, H/128] and [E, H/128, I/128], or per channel [E, 2I] and [E, H]
            (layers/experts_fp8.py); None for 16-bit experts.
        hash_table: [V, top_k] token id -> expert ids of a hash router (DeepSeek-V4), the
            layer's tid2eid (aliased); None: routing by score.

    Raises:
        TypeError, ValueError: tensors whose shapes, dtypes or devices do not fit.
    """
    check_loader_options(options)
    # The grouped GEMMs take dense experts only: a sparse one was accepted here and refused by
    # the first forward as an operand `w` the caller never passed, a nested one failed when
    # its shape was read below (torch's internal RuntimeError).
    check_dense("gate_up_proj", gate_up_proj)
    check_dense("down_proj", down_proj)
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
        raise ValueError(
            f"gate_up_proj must be (E, 2I, H) (or (E, H, 2I) with transposed=True); got "
            f"{shape_text(gate_up_proj)}"
        )
    E, two_i, H = gate_up_proj.shape
    I = two_i // 2
    if tuple(down_proj.shape) != (E, H, I):
        raise ValueError(
            f"down_proj must be (E, H, I) = ({E}, {H}, {I}) to match gate_up_proj "
            f"{shape_text(gate_up_proj)} (or (E, I, H) with transposed=True); got "
            f"{shape_text(down_proj)}"
        )
    check_router_weight(router_weight, E, H)
    if gate_up_proj.dtype in FP8_DTYPES or scales is not None:
        check_fp8_experts(gate_up_proj, down_proj, *(scales or (None, None)))
    elif gate_up_proj.dtype not in FLOAT_DTYPES or down_proj.dtype != gate_up_proj.dtype:
        raise TypeError(
            f"expert weights must be bf16, fp16 or fp32, both of one dtype (or FP8 with "
            f"scales); got gate_up_proj {gate_up_proj.dtype} and down_proj {down_proj.dtype}"
        )
    device = gate_up_proj.device
    for name, t in (("down_proj", down_proj), ("router_weight", router_weight)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but gate_up_proj is on {device}")
    if bias is not None:
        check_correction_bias(bias, E, device, "e_score_correction_bias", "gate_up_proj is")
    shared_size = 0
    if shared is not None:
        if not isinstance(shared, Mapping):  # (a str's set() is its letters)
            raise TypeError(f"shared must be a mapping of names to tensors ({{'gate_proj': ..., "
                            f"'up_proj': ..., 'down_proj': ...}}) or None; got "
                            f"{type(shared).__name__}")
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
            if t.is_nested:  # (no shape to read below; a sparse one works in F.linear)
                check_dense(f"shared[{name!r}]", t)
        shared_size = shared["gate_proj"].shape[0]
        want = {"gate_proj": (shared_size, H), "up_proj": (shared_size, H),
                "down_proj": (H, shared_size), "gate": (1, H)}
        for name, t in shared.items():
            if tuple(t.shape) != want[name]:
                raise ValueError(f"shared[{name!r}] must be {want[name]}; got {shape_text(t)}")
            if t.device != device:
                raise ValueError(f"shared[{name!r}] is on {t.device} but the expert "
                                 f"weights are on {device}")
        mlp_dtypes = {shared[n].dtype for n in ("gate_proj", "up_proj", "down_proj")}
        if len(mlp_dtypes) != 1 or next(iter(mlp_dtypes)) not in FLOAT_DTYPES:
            raise TypeError("shared gate_proj, up_proj and down_proj must share one dtype "
                            f"among bf16, fp16, fp32; got {sorted(map(str, mlp_dtypes))}")
        if "gate" in shared and shared["gate"].dtype not in FLOAT_DTYPES:
            raise TypeError(f"shared['gate'] must be bf16, fp16 or fp32; got "
                            f"{shared['gate'].dtype}")
        if shared_size == 0:
            # A zero-width shared expert (DeepSeek-V3's n_shared_experts=0, Qwen2-MoE's
            # shared_expert_intermediate_size=0: transformers still builds the MLP) adds
            # exactly zero, gated or not: the layer has none.
            shared = None
    opts = dict(options)
    if hash_table is not None:
        if "hash_vocab_size" in opts:
            raise TypeError("hash_vocab_size is not a loader option: the given tid2eid table "
                            "decides it")
        check_token_expert_table(hash_table, E, check_int("top_k", top_k))
        if hash_table.device != device:
            raise ValueError(f"tid2eid is on {hash_table.device} but gate_up_proj is on "
                             f"{device}")
        opts["hash_vocab_size"] = hash_table.shape[0]
        if bias is None:  # (a hash router has no bias: none kept unless asked for)
            opts.setdefault("correction_bias", False)
    if bias is not None:
        opts.setdefault("scoring", "sigmoid")
        if opts.setdefault("correction_bias", True) is False:
            raise ValueError("an e_score_correction_bias was given with correction_bias=False")
    opts.setdefault("correction_bias", None)
    # Every parameter made on the meta device here is replaced by the given tensors below: a
    # dtype the constructor takes is named for them, whatever torch's default dtype is.
    moe = cls(
        H, I, E, top_k,
        shared_intermediate_size=shared_size,
        shared_expert_gate=shared is not None and "gate" in shared,
        device="meta",
        dtype=torch.float32,
        **opts,
    )
    moe.router_weight = _as_param(router_weight)
    moe.gate_up_proj = _as_param(gate_up_proj)
    moe.down_proj = _as_param(down_proj)
    if scales is not None:
        moe.gate_up_proj_scale_inv = _as_param(scales[0])
        moe.down_proj_scale_inv = _as_param(scales[1])
    if moe.e_score_correction_bias is not None:
        if bias is None:
            bias = torch.zeros(E, device=device, dtype=torch.float32)
        elif isinstance(bias, nn.Parameter) or bias.requires_grad:
            # A bias kept as a Parameter (Ernie-4.5-MoE, Laguna; a state_dict(keep_vars=True)
            # of them) would be filed under the layer's parameters, not its buffers (in an
            # optimizer over moe.parameters(), trained by requires_grad_()): an alias of its
            # values (in-place updates still show) is kept as the buffer instead.
            bias = bias.detach()
        moe.e_score_correction_bias = bias
    if hash_table is not None:
        moe.tid2eid = hash_table.detach()
    if shared is not None:
        assert moe.shared_experts is not None
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(moe.shared_experts, name).weight = _as_param(shared[name])
        if "gate" in shared:
            assert moe.shared_expert_gate is not None
            moe.shared_expert_gate.weight = _as_param(shared["gate"])
    return moe


# Constructor arguments the loaded tensors decide. The loaders alias the tensors, so a dtype
# or device asked for would be silently ignored (the layer keeps the tensors' own), and the
# sizes would clash with them.
_TENSOR_OPTIONS = {
    "dtype": "cast the layer after loading, e.g. moe.to(torch.bfloat16)",
    "device": "move the layer after loading, e.g. moe.to('cuda')",
    "hidden_size": "it is the weights' H",
    "intermediate_size": "it is the weights' I",
    "num_experts": "it is the weights' E",
    "shared_intermediate_size": "pass the shared expert's weights (shared=...)",
    "shared_expert_gate": "pass the gate's weight with the shared expert (shared['gate'])",
}


def check_loader_options(options: Mapping[str, Any]) -> None:
    """The loaders' **options are the MoE constructor's routing / activation / GEMM keywords;
    the ones the given tensors decide are a TypeError naming what to do instead."""
    for name, hint in _TENSOR_OPTIONS.items():
        if name in options:
            raise TypeError(f"{name} is not a loader option: the given tensors decide it (they "
                            f"are used as they are, not copied); {hint}")


def _check_scales(scales: object) -> tuple[torch.Tensor, torch.Tensor] | None:
    """from_fused's `scales`: None or a (gate_up_scale, down_scale) pair of tensors (their
    shapes and dtypes are check_fp8_experts' part). Anything else would fail inside the
    transposition or the FP8 check with an unrelated message."""
    if scales is None:
        return None
    want = "scales must be None or a pair of tensors (gate_up_scale, down_scale)"
    if not isinstance(scales, (tuple, list)):
        raise TypeError(f"{want}; got {type(scales).__name__}")
    if len(scales) != 2:
        raise ValueError(f"{want}; got {len(scales)} item(s)")
    for name, t in zip(("gate_up", "down"), scales):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{want}: FP8 expert weights need their {name} scale as a float32 "
                            f"tensor; got {type(t).__name__}")
    return scales[0], scales[1]


def _as_param(t: torch.Tensor) -> nn.Parameter:
    """The tensor itself if it is a Parameter (shared with its owner), else a frozen alias."""
    if isinstance(t, nn.Parameter):
        return t
    return nn.Parameter(t.detach(), requires_grad=False)


_SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


def _dense_weight(take: Callable[[str], torch.Tensor | None], base: str
                  ) -> torch.Tensor | None:
    """"<base>.weight", dequantized to bf16 when it is FP8 (its scale next to it)."""
    w = take(f"{base}.weight")
    if w is None:
        return None
    scale = next((s for s in (take(f"{base}.{n}") for n in _SCALE_SUFFIXES) if s is not None),
                 None)
    if w.dtype not in FP8_DTYPES:
        if scale is not None:  # (refused as for the routed experts: it would be ignored)
            raise ValueError(f"{base} has a weight scale but its weight is {w.dtype}, not FP8")
        return w
    if scale is None:
        raise ValueError(f"FP8 weight {base}.weight has no weight_scale_inv / weight_scale")
    take(f"{base}.input_scale")
    return dequantize_weight(w, scale, torch.bfloat16)


def _proj_scale(take: Callable[[str], torch.Tensor | None], base: str, w: torch.Tensor
                ) -> tuple[str, torch.Tensor] | None:
    """(granularity, scale) of the FP8 projection weight w [N, K] at `base`: its 128x128
    block scale [N/128, K/128], or a per-channel / per-tensor one as [N]; None if w is not
    FP8."""
    scale = next((s for s in (take(f"{base}.{n}") for n in _SCALE_SUFFIXES) if s is not None),
                 None)
    take(f"{base}.input_scale")  # static activation scales: activations are quantized per token
    if w.dtype not in FP8_DTYPES:
        if scale is not None:
            raise ValueError(f"{base} has a weight scale but its weight is {w.dtype}, not FP8")
        return None
    if scale is None:
        raise ValueError(f"FP8 weight {base}.weight has no weight_scale_inv / weight_scale")
    if scale.device != w.device:  # (else the gate and up scales' concatenation fails in torch)
        raise ValueError(f"{base}: weight scale is on {scale.device} but its weight is on "
                         f"{w.device}")
    N, K = w.shape
    if scale.numel() == 1 or tuple(scale.shape) in ((N,), (N, 1)):
        return "row", row_scale(scale, N, f"{base} weight scale")
    if tuple(scale.shape) == (-(-N // SCALE_BLOCK), -(-K // SCALE_BLOCK)):
        return "block", decoding_scale(f"{base} weight scale", scale)
    raise ValueError(f"{base}: weight scale {shape_text(scale)} is neither 128x128 blocks "
                     f"({-(-N // SCALE_BLOCK)}, {-(-K // SCALE_BLOCK)}) nor per channel ({N},) "
                     f"for weight {shape_text(w)}")


def _fused_scales(take: Callable[[str], torch.Tensor | None], names: tuple[tuple[str, ...], ...],
                  gate_up: torch.Tensor, down: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused FP8 experts' scales (first present name of each group), as the layer keeps
    them (_fused_scale)."""
    found = [next(((n, t) for n, t in ((n, take(n)) for n in group) if t is not None), None)
             for group in names]
    if found == [None, None] and gate_up.dtype not in FP8_DTYPES:
        return None
    if found[0] is None or found[1] is None:
        raise ValueError(f"FP8 fused experts need both scales {names[0][0]!r} and "
                         f"{names[1][0]!r}")
    # Block scales need H and I multiples of 128 (check_fp8_experts). Where they are not, an
    # [E, c, 1] scale that also has the block shape (ceil(N/128) == c, K <= 128: a small
    # expert's per-tensor chunks, e.g. gate_up [E, 2, 1] for 64 < I < 128) can only be the c
    # row chunks, whose rows differ from 128-row blocks there: read as blocks it was refused
    # as "128x128 block-scaled experts", which from_hf loads (block_size None).
    chunks = (gate_up.dim() == 3 and down.dim() == 3
              and bool(gate_up.shape[2] % SCALE_BLOCK or down.shape[2] % SCALE_BLOCK))
    return (_fused_scale(found[0][1], gate_up, found[0][0], chunks),
            _fused_scale(found[1][1], down, found[1][0], chunks))


def _fused_scale(s: torch.Tensor, w: torch.Tensor, name: str, chunks: bool = False
                 ) -> torch.Tensor:
    """A fused scale as the layer keeps it: 128x128 blocks [E, N/128, K/128], or [E, N] for
    one scale per channel, per expert, for all, or per expert for each of c equal row chunks
    ([E, c, 1]: transformers' FP8Experts without blocks, e.g. a scale for the gate half and
    one for the up half; [E, c]: vLLM's w13_weight_scale [E, 2]). chunks: an [E, c, 1] scale
    that fits both is read as row chunks rather than blocks (_fused_scales)."""
    if w.dim() != 3:
        raise ValueError(f"fused expert weights must be 3-D (E, N, K); got {shape_text(w)}")
    E, N, K = w.shape
    s = decoding_scale(name, s)
    as_chunks = (chunks and s.dim() == 3 and s.shape[2] == 1 and s.shape[1] > 0
                 and N % s.shape[1] == 0)
    if s.dim() == 3 and tuple(s.shape) == (E, -(-N // SCALE_BLOCK), -(-K // SCALE_BLOCK)) and (
            s.shape[1] != N or N == 1) and not as_chunks:
        return s
    if s.numel() == 1:
        return s.reshape(()).expand(E, N).contiguous()
    if s.numel() == E:
        return s.reshape(E, 1).expand(E, N).contiguous()
    if s.numel() == E * N and s.shape[0] == E:
        return s.reshape(E, N)
    if s.dim() == 3 and s.shape[0] == E and s.shape[2] == 1 and 0 < s.shape[1] <= N and (
            N % s.shape[1] == 0):
        return per_channel(s, w, name)
    if s.dim() == 2 and s.shape[0] == E and 0 < s.shape[1] < N and N % s.shape[1] == 0:
        # [E, c]: the same chunks written 2-D, as vLLM's per-tensor FP8 MoE checkpoints keep
        # w13_weight_scale [E, 2] (the gate shard's scale and the up shard's)
        return per_channel(s.unsqueeze(-1), w, name)
    raise ValueError(f"fused expert scale {name} {shape_text(s)} fits no granularity of weight "
                     f"{shape_text(w)}")


def _check_expert(t: Mapping[str, torch.Tensor], names: Mapping[str, str],
                  order: tuple[str, str, str], ref: tuple[str, torch.Tensor]) -> None:
    """One expert's gate, up and down weights (per-expert checkpoint keys) against expert 0's
    gate weight `ref` (key, tensor): stacking them needs one shape, one dtype and one device,
    which torch.stack reports as a bare RuntimeError and torch.cat not at all (it promotes
    mixed dtypes)."""
    ref_key, ref_w = ref
    if ref_w.dim() != 2:
        raise ValueError(f"{ref_key} must be 2-D (I, H); got {shape_text(ref_w)}")
    I, H = ref_w.shape
    gate_n, up_n, down_n = order
    want = {gate_n: (I, H), up_n: (I, H), down_n: (H, I)}
    for n in order:
        w = t[n]
        if tuple(w.shape) != want[n]:
            raise ValueError(f"inconsistent shapes: {names[n]} is {shape_text(w)}, expected "
                             f"{want[n]} to match {ref_key} {shape_text(ref_w)}")
        if w.dtype != ref_w.dtype:
            raise ValueError(f"inconsistent dtypes: {names[n]} is {w.dtype} but {ref_key} is "
                             f"{ref_w.dtype}; the experts' weights must share one dtype")
        if w.device != ref_w.device:  # (a partly moved checkpoint: torch.cat's RuntimeError)
            raise ValueError(f"inconsistent devices: {names[n]} is on {w.device} but {ref_key} "
                             f"is on {ref_w.device}; the experts' weights must share one device")


def _experts_from_keys(
    take: Callable[[str], torch.Tensor | None], keys: Mapping[str, str], prefix: str,
    shown: Callable[[str], str], span: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(gate_up (E, 2I, H), down (E, H, I), FP8 scales or None) from fused or per-expert
    checkpoint keys (`shown`: a checkpoint name as the state_dict spells it, for messages;
    `span`: the [start, end) numbers the per-expert keys must have, None for 0..E-1)."""
    for gu_name, d_name, gu_scale, d_scale in (
            ("experts.gate_up_proj", "experts.down_proj", ("experts.gate_up_proj_scale_inv",),
             ("experts.down_proj_scale_inv",)),
            ("experts.w13_weight", "experts.w2_weight",
             ("experts.w13_weight_scale_inv", "experts.w13_weight_scale"),
             ("experts.w2_weight_scale_inv", "experts.w2_weight_scale"))):
        gate_up, down = take(gu_name), take(d_name)
        if gate_up is not None or down is not None:
            if gate_up is None or down is None:
                raise ValueError(f"{shown(gu_name)!r} and {shown(d_name)!r} go together")
            return gate_up, down, _fused_scales(take, (gu_scale, d_scale), gate_up, down)
    for gate_n, up_n, down_n in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        # (an expert is known by any of its three weights: one without its gate weight is
        # refused naming that key, not as unused up / down keys or a router of other size)
        ids = sorted(
            {int(k.split(".")[1]) for k in keys
             if k.startswith("experts.") and k.split(".")[1].isdigit()
             and k.split(".")[2:3] in ([gate_n], [up_n], [down_n])}
        )
        if not ids:
            continue
        if span is None and ids != list(range(len(ids))):
            raise ValueError(f"experts under {prefix!r} must be numbered 0..E-1; got {ids}")
        if span is not None and ids != list(range(*span)):
            raise ValueError(f"experts under {prefix!r} must be numbered {span[0]}..{span[1] - 1} "
                             f"(this rank's share); got {ids}")
        gate_up_list, down_list, s_gate_up, s_down = [], [], [], []
        kinds: set[str | None] = set()
        ref: tuple[str, torch.Tensor] | None = None  # expert 0's gate weight
        for e in ids:
            t, sc, names = {}, {}, {}
            for n in (gate_n, up_n, down_n):
                key = f"experts.{e}.{n}.weight"
                v = take(key)
                if v is None:
                    key = f"experts.{e}.{n}"
                    v = take(key)
                if v is None:
                    raise ValueError(f"expert {e} has no {prefix}experts.{e}.{n}.weight")
                t[n], names[n] = v, prefix + key
            ref = ref or (names[gate_n], t[gate_n])
            _check_expert(t, names, (gate_n, up_n, down_n), ref)
            for n in (gate_n, up_n, down_n):
                found = _proj_scale(take, f"experts.{e}.{n}", t[n])
                kinds.add(found[0] if found else None)
                sc[n] = found[1] if found else None
            if len(kinds) > 1:  # (before the gate and up scales are concatenated)
                raise ValueError(f"experts under {prefix!r} mix weight formats "
                                 f"({sorted(map(str, kinds))}, expert {e}); one FP8 "
                                 "granularity for all")
            gate_up_list.append(torch.cat([t[gate_n], t[up_n]], dim=0))
            down_list.append(t[down_n])
            s_gate_up.append(None if sc[gate_n] is None else
                             torch.cat([sc[gate_n], sc[up_n]], dim=0))
            s_down.append(sc[down_n])
        scales = None
        if kinds == {"block"}:
            inter = t[gate_n].shape[0]
            if inter % SCALE_BLOCK:
                raise ValueError(
                    f"block-scaled experts need an intermediate size that is a multiple of "
                    f"{SCALE_BLOCK} (gate and up blocks are concatenated); got {inter}")
        if kinds & {"block", "row"}:
            scales = (torch.stack(s_gate_up), torch.stack(s_down))
        return torch.stack(gate_up_list), torch.stack(down_list), scales
    raise KeyError(
        f"no expert weights under {prefix!r}: expected experts.{{e}}.w1/w3/w2, "
        "experts.{e}.gate_proj/up_proj/down_proj, experts.gate_up_proj/down_proj or "
        "experts.w13_weight/w2_weight"
    )
