"""The options a built MoE layer switches by assignment: `activation`, `fused`, `config`,
`router_fp32`, `router_jitter_noise` and the routing options (`top_k`, `scoring`,
`renormalize`, `n_group`, `topk_group`, `routed_scaling_factor`) and `hidden_size`, each
checked when assigned as the constructor checks it; and `num_experts` / `intermediate_size`,
which the expert weights decide.

The MoE class documents them as attributes to set on a built layer; an unchecked assignment
went wrong late and far from its cause (a string such as "no" for `fused` forced the fused
path silently, a string `config` failed deep in the GEMM dispatch, a bad activation name in
the next forward). MoE inherits them from the MoEOptions mixin here, ExpertParallelMoE the
routing options alone from RoutingOptions, which MoEOptions extends; `replace_activation` is
the check of an activation assignment, which the shared expert (moe.GatedMLP) applies too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe_gemm.config import GemmConfig
from moe_gemm.layers.experts import check_gemm_options, resolve_activation
from moe_gemm.layers.routing import (
    check_flag,
    check_int,
    check_jitter_noise,
    check_scaling_factor,
    check_scoring,
    check_token_expert_table,
)

__all__ = ["MoEOptions", "RoutingOptions", "replace_activation"]


def replace_activation(module: nn.Module, value: object) -> None:
    """Before `module.activation = value`: the value checked as the constructors check it (a
    bad name fails here, not in the next forward), and a module activation set before (which
    nn.Module keeps as a child module) removed for a plain one (torch refuses a str over a
    child module: a layer built with nn.GELU() could not be switched to "silu")."""
    resolve_activation(value)
    if not isinstance(value, nn.Module):
        module.__dict__.get("_modules", {}).pop("activation", None)


def _checked_option(name: str, doc: str) -> property:
    """A routing option of MoEOptions: read as stored, checked when assigned."""
    return property(lambda self: self._routing_option(name),
                    lambda self, value: self._set_routing_option(name, value), doc=doc)


class RoutingOptions(nn.Module):
    """The routing options of a layer that routes tokens (MoE, ExpertParallelMoE): top_k,
    scoring, renormalize, n_group, topk_group, routed_scaling_factor, router_fp32,
    router_jitter_noise and hidden_size, each checked when assigned as MoE's constructor
    checks it (TypeError / ValueError, the layer unchanged)."""

    def _top_k_limit(self) -> int | None:
        """E, the bound of an assigned top_k (None: not known yet)."""
        return None

    # (the value of a layer pickled before the option existed: no jitter)
    _router_jitter_noise: float = 0.0

    @property
    def router_jitter_noise(self) -> float:
        """Mixtral's router jitter, applied by the forward in training mode (see MoE);
        0 = off."""
        return self._router_jitter_noise

    @router_jitter_noise.setter
    def router_jitter_noise(self, value: float) -> None:
        self._router_jitter_noise = check_jitter_noise(value)

    @property
    def router_fp32(self) -> bool:
        """The router logits in fp32 (see MoE). None (the default, or assigned) follows the
        scoring: True for sigmoid and sqrtsoftplus, also after `scoring` is assigned; anything
        but a bool or None was silently truthy."""
        d = self.__dict__
        # (a layer pickled before the check kept the plain attribute)
        flag = d["_router_fp32"] if "_router_fp32" in d else d["router_fp32"]
        return self.scoring != "softmax" if flag is None else flag

    @router_fp32.setter
    def router_fp32(self, value: bool | None) -> None:
        self._router_fp32 = check_flag("router_fp32", value, none_ok=True)

    # The routing options, each checked on its own when assigned (a string top_k or a
    # misspelt scoring failed only at the next forward, far from the assignment). How they
    # combine (top_k <= E, groups that divide E, ...) is checked by the forward: assignments
    # made one at a time pass through combinations that are invalid until the last one.
    def _routing_option(self, name: str) -> Any:
        d = self.__dict__
        if "_" + name in d:
            return d["_" + name]
        if name in d:  # (a layer pickled before these were properties)
            return d[name]
        raise AttributeError(name)

    def _set_routing_option(self, name: str, value: object) -> None:
        value = _ROUTING_CHECKS[name](value)
        E = self._top_k_limit()
        if name == "top_k" and E is not None and value > E:
            raise ValueError(f"top_k must be in [1, num_experts={E}]; got {value}")
        self.__dict__["_" + name] = value

    top_k = _checked_option("top_k", "Experts per token, 1 <= top_k <= num_experts.")
    scoring = _checked_option(
        "scoring", 'The router\'s scores: "softmax", "sigmoid" or "sqrtsoftplus".')
    renormalize = _checked_option("renormalize", "Divide the top-k weights by their sum.")
    n_group = _checked_option("n_group",
                              "Expert groups of group-limited routing.")
    topk_group = _checked_option("topk_group", "Groups kept per token by group-limited routing.")
    hidden_size = _checked_option(
        "hidden_size", "H, the tokens' size (the forward checks the weights against it).")
    routed_scaling_factor = _checked_option(
        "routed_scaling_factor", "Multiplies the routed weights; finite.")


class MoEOptions(RoutingOptions):
    """MoE's switchable options (MoE inherits them): checked on every assignment, and the
    activation kept the layer's own, which its shared expert follows."""

    def __setattr__(self, name: str, value: Any) -> None:
        # `activation` is the layer's one activation (transformers' hidden_act, which its
        # shared expert uses too): an assignment is checked as in the constructor and reaches
        # the shared expert, which otherwise kept the constructor's (the layer then ran two
        # activations, and from_moe's shards, built from the attribute, disagreed with it).
        # Here rather than a property: nn.Module.__setattr__ files a module value (an
        # activation module such as transformers' ACT2FN ones) under _modules, bypassing one.
        # The shared expert follows it without registering it (GatedMLP.follow_activation):
        # a module activation is the layer's child alone, its parameters one state_dict key.
        if name == "tid2eid" and value is not None:
            # (a table of other experts or a float one routed out of range, or failed deep
            # inside the indexing; checked here once, never per call)
            E = self._size_of_weights("num_experts")
            check_token_expert_table(value, E if E is not None else 1 << 62)
        if name == "activation":
            replace_activation(self, value)
            shared = self.__dict__.get("_modules", {}).get("shared_experts")
            if shared is not None:
                shared.follow_activation(value)
        super().__setattr__(name, value)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A state_dict saved while the shared expert registered the layer's module activation
        # too holds its parameters a second time, under "shared_experts.activation.": the
        # same values, read as the layer's own "activation." ones (load_state_dict passes a
        # copy of the caller's mapping, for hooks such as this to edit).
        shared = self._modules.get("shared_experts")
        if shared is not None and "activation" not in shared._modules:
            old = prefix + "shared_experts.activation."
            for key in [k for k in state_dict if k.startswith(old)]:
                value = state_dict.pop(key)
                state_dict.setdefault(prefix + "activation." + key[len(old):], value)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def fused(self) -> bool | None:
        """The experts on the fused kernel: None = where it runs, True = always, False =
        never (see MoE)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool | None) -> None:
        check_gemm_options(None, value)
        self._fused = None if value is None else bool(value)

    @property
    def config(self) -> GemmConfig | None:
        """The GemmConfig of the grouped GEMMs (None = automatic)."""
        return self._config

    @config.setter
    def config(self, value: GemmConfig | None) -> None:
        check_gemm_options(value, None)
        self._config = value

    def _top_k_limit(self) -> int | None:
        return self._size_of_weights("num_experts")

    # E and I are the expert weights' sizes: a reassignment that disagrees with them was
    # silently ignored (the forward reads the weights), and one of new weights (assigned, or
    # load_state_dict(assign=True)) left the attributes stale.
    def _size_of_weights(self, name: str) -> int | None:
        """num_experts / intermediate_size as gate_up_proj [E, 2I, H] holds them (None while
        there is none: during construction, or deleted)."""
        w = self.__dict__.get("_parameters", {}).get("gate_up_proj")
        if w is None:  # (deleted, and perhaps a plain tensor set in its place)
            w = self.__dict__.get("gate_up_proj")
        if not (isinstance(w, torch.Tensor) and w.dim() == 3):
            return None
        return int(w.shape[0]) if name == "num_experts" else int(w.shape[1]) // 2

    def _size(self, name: str) -> int:
        size = self._size_of_weights(name)
        if size is not None:
            return size
        d = self.__dict__
        for key in ("_" + name, name):  # (a layer pickled before these were properties: name)
            if key in d:
                return d[key]
        raise AttributeError(name)

    def _set_size(self, name: str, value: object) -> None:
        value = check_int(name, value)
        size = self._size_of_weights(name)
        if size is not None and value != size:
            what = "E" if name == "num_experts" else "I"
            raise ValueError(
                f"{name} is the expert weights' {what} ({size}); got {value!r}: assign "
                "weights of another size (gate_up_proj, down_proj, router_weight) instead")
        self.__dict__["_" + name] = value

    num_experts = property(lambda self: self._size("num_experts"),
                           lambda self, value: self._set_size("num_experts", value),
                           doc="E, the expert weights' first dimension.")
    intermediate_size = property(
        lambda self: self._size("intermediate_size"),
        lambda self, value: self._set_size("intermediate_size", value),
        doc="I, the experts' intermediate size (gate_up_proj holds 2I rows).")


def _positive_int(name: str):
    def check(value: object) -> int:
        value = check_int(name, value)
        if value < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value}")
        return value
    return check


_ROUTING_CHECKS = {
    "hidden_size": _positive_int("hidden_size"),
    "top_k": _positive_int("top_k"),
    "scoring": check_scoring,
    "renormalize": lambda value: check_flag("renormalize", value),
    "n_group": _positive_int("n_group"),
    "topk_group": _positive_int("topk_group"),
    "routed_scaling_factor": check_scaling_factor,
}
