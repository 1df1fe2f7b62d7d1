"""Loading an expert-parallel layer: this rank's experts of a whole layer or of a checkpoint.

`local_moe` cuts this rank's experts out of a whole MoE (the shared experts whole);
`shard_of_state_dict` reads a checkpoint mapping through `LocalShard`, a view that hides other
ranks' experts and slices fused expert tensors to the local ones, so that MoE's own loaders
validate and stack them (under the checkpoint's own expert numbers, which their messages name)
and other ranks' experts are never indexed (with a lazy Mapping, e.g. one over safetensors'
`safe_open(...).get_tensor`, never read). `router_of` is the routing a layer of all E experts
needs beside them (moe_gemm.layers.expert_parallel).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from moe_gemm.layers.checkpoints import OWN_NAMES, check_loader_options, moe_from_state_dict
from moe_gemm.layers.dispatch import AllToAllDispatcher, Dispatcher, expert_range
from moe_gemm.layers.moe import MoE
from moe_gemm.ops.validation import shape_text

# The routing options an expert-parallel layer holds itself (every rank alike).
ROUTING = ("top_k", "scoring", "renormalize", "n_group", "topk_group", "routed_scaling_factor",
           "router_fp32", "router_jitter_noise")
# Routing options a `router` mapping may leave out (made before they existed), with the value
# that keeps the routing as it was.
ROUTING_DEFAULTS = {"router_jitter_noise": 0.0}
# MoE's options that the local experts take (the rest are the routing's).
LOCAL_OPTIONS = ("activation", "config", "fused")


def dispatcher_or_default(dispatcher: object, group: dist.ProcessGroup | None) -> Dispatcher:
    """The constructors' `dispatcher`, or the default AllToAllDispatcher(group) for None. One
    that is not a Dispatcher is a TypeError here, before from_moe reads its `rank` (an
    AttributeError about the object) or a falsy one is silently replaced by the default."""
    if dispatcher is None:
        return AllToAllDispatcher(group)
    if not isinstance(dispatcher, Dispatcher):
        raise TypeError("dispatcher must be a Dispatcher (rank, world_size, dispatch(...) and "
                        f"combine(...)) or None; got {type(dispatcher).__name__}")
    return dispatcher


def local_moe(moe: MoE, dispatcher: Dispatcher, copy: bool) -> MoE:
    """from_moe's local layer: this rank's experts of `moe`, the shared experts whole."""
    if not isinstance(moe, MoE):
        raise TypeError(f"moe must be a moe_gemm MoE; got {type(moe).__name__}")
    start, end = expert_range(moe.num_experts, dispatcher.rank, dispatcher.world_size)

    def take(t: torch.Tensor) -> torch.Tensor:
        part = t[start:end]
        return part.clone() if copy else part

    # FP8 experts keep their decoding scales (blocks or rows, expert-major like the weights)
    scales = None
    if moe.fp8 is not None:
        scales = (take(moe.gate_up_proj_scale_inv), take(moe.down_proj_scale_inv))
    shared = None
    if moe.shared_experts is not None:
        shared = {n: getattr(moe.shared_experts, n).weight
                  for n in ("gate_proj", "up_proj", "down_proj")}
        if moe.shared_expert_gate is not None:
            shared["gate"] = moe.shared_expert_gate.weight
    local = MoE.from_fused(
        take(moe.gate_up_proj), take(moe.down_proj), take(moe.router_weight), 1,
        shared=shared, scales=scales, activation=moe.activation, config=moe.config,
        fused=moe.fused,
    )
    if moe.shared_experts is not None and moe.shared_experts.activation is not moe.activation:
        # The shared expert follows moe.activation (local's does too, registered once), unless
        # its own was set apart: as it is.
        local.shared_experts.activation = moe.shared_experts.activation
    return local


def router_of(moe: MoE) -> dict[str, Any]:
    """The routing of `moe` as ExpertParallelMoE takes it: its router tensors and options."""
    out: dict[str, Any] = {name: getattr(moe, name) for name in ROUTING}
    out["router_weight"] = moe.router_weight
    out["e_score_correction_bias"] = moe.e_score_correction_bias
    table = moe._buffers.get("tid2eid")  # (hash routing by token id: DeepSeek-V4)
    if table is not None:
        out["tid2eid"] = table
    return out


def check_own_shard(local_rows: torch.Tensor | None, router_weight: torch.Tensor,
                    dispatcher: Dispatcher) -> None:
    """An ExpertParallelMoE's own state_dict holds one rank's experts, and its local layer's
    router rows are that rank's rows of the full router: rows that are not this rank's mean
    another rank's file (a restart that remapped ranks), whose experts would answer for the
    wrong expert ids, silently. A ValueError naming the rank whose rows they are."""
    rank, world = dispatcher.rank, dispatcher.world_size
    E = router_weight.shape[0]
    start, end = expert_range(E, rank, world)
    if (not isinstance(local_rows, torch.Tensor) or local_rows.shape != (end - start,
                                                                        *router_weight.shape[1:])
            or "meta" in (local_rows.device.type, router_weight.device.type)):
        return  # (a count that differs is refused by the caller, naming the counts)
    rows = local_rows.to(router_weight.device)
    if torch.equal(rows, router_weight[start:end]):
        return
    whose = "no rank's"
    for r in range(world):
        s, e = expert_range(E, r, world)
        if e - s == end - start and torch.equal(rows, router_weight[s:e]):
            whose = f"rank {r}'s"
            break
    raise ValueError(f"this state dict holds {whose} experts of the {world}-rank "
                     f"ExpertParallelMoE that saved it (its router rows say so); rank {rank} "
                     "must load its own rank's state_dict")


def shard_of_state_dict(state_dict: Mapping[str, torch.Tensor], top_k: int, prefix: str,
                        strict: bool, dispatcher: Dispatcher, options: dict[str, Any]
                        ) -> tuple[MoE, dict[str, Any], int]:
    """(local MoE, router, E) of this rank's shard of one MoE block of a checkpoint
    (ExpertParallelMoE.from_state_dict's arguments)."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
    if not isinstance(prefix, str):  # (as MoE.from_state_dict; else `prefix + "..."` fails)
        raise TypeError(f"prefix must be a str (e.g. 'model.layers.3.mlp.', or '' for none); "
                        f"got {type(prefix).__name__}")
    local_sd: Mapping[str, torch.Tensor]
    span: tuple[int, int] | None = None  # the checkpoint's numbers of the local experts
    if is_expert_parallel_state(state_dict, prefix):
        # An ExpertParallelMoE's own state_dict: the full router beside this rank's experts
        # (already local, under "local."), which are read whole.
        router_weight = _router(state_dict, prefix + "router_weight")
        bias = state_dict.get(prefix + "e_score_correction_bias")
        table = state_dict.get(prefix + "tid2eid")
        E = router_weight.shape[0]
        start, end = expert_range(E, dispatcher.rank, dispatcher.world_size)
        check_own_shard(state_dict.get(prefix + "local.router_weight"), router_weight,
                        dispatcher)
        local_sd = Renamed(state_dict, prefix, {}, strip=prefix + "local.")
        unused = sorted(k for k in state_dict if k.startswith(prefix)
                        and not k.startswith(prefix + "local.")
                        and k[len(prefix):] not in ("router_weight", "e_score_correction_bias",
                                                    "tid2eid"))
        if strict and unused:  # (the local layer's loader checks the "local." keys)
            raise ValueError(
                f"keys under {prefix!r} this layer does not use (pass strict=False to "
                f"ignore): {unused[:8]}")
    else:
        if prefix + "gate.weight" not in state_dict and prefix + "router_weight" in state_dict:
            # MoE's own state_dict, which MoE.from_state_dict reads too: its names read as
            # the checkpoint names of the same tensors (lazily, as the rest).
            state_dict = Renamed(state_dict, prefix, OWN_NAMES)
        router_key = prefix + "gate.weight"
        if router_key not in state_dict:
            raise KeyError(f"no router weight {router_key!r} in the state dict")
        router_weight = _router(state_dict, router_key)
        E = router_weight.shape[0]
        start, end = expert_range(E, dispatcher.rank, dispatcher.world_size)
        local_sd = LocalShard(state_dict, prefix, start, end, E)
        local_sd.check_experts(router_key, router_weight)
        span = (start, end)
        bias, table = local_sd.full_bias, local_sd.full_table
    check_loader_options(options)  # (the probe below would take a dtype and ignore it)
    routing = {k: v for k, v in options.items() if k not in LOCAL_OPTIONS}
    if "hash_vocab_size" in routing:
        raise TypeError("hash_vocab_size is not a loader option: the checkpoint's tid2eid "
                        "table decides it")
    if table is not None and bias is None:  # (a hash router has no bias: none kept)
        routing.setdefault("correction_bias", False)
    if bias is not None:
        routing.setdefault("scoring", "sigmoid")
    # The local MoE sees the local experts and the local rows of the router (never used:
    # routing is over all E experts), so MoE's loader validates and stacks them.
    local_opts = {k: options[k] for k in LOCAL_OPTIONS if k in options}
    local = moe_from_state_dict(MoE, local_sd, 1, prefix=prefix, strict=strict, experts=span,
                                **local_opts)
    if local.num_experts != end - start:
        # (only an ExpertParallelMoE's own state_dict gets here: LocalShard slices the rest)
        raise ValueError(
            f"the state dict holds {local.num_experts} of {E} experts (one rank's share of the "
            f"ExpertParallelMoE that saved it); rank {dispatcher.rank} of "
            f"{dispatcher.world_size} holds {end - start}: load each rank's own state_dict "
            "in a group of the size that saved it")
    # A full-size MoE on the meta device checks the routing options and fills defaults.
    probe = MoE(router_weight.shape[1], 1, E, top_k, device="meta", dtype=torch.float32,
                **routing)
    router = router_of(probe)
    router["router_weight"] = router_weight
    if table is not None:  # (checked against E and top_k by the layer's constructor)
        router["tid2eid"] = table
    if probe.e_score_correction_bias is None:
        if bias is not None:
            raise ValueError("the checkpoint has an e_score_correction_bias but the "
                             "routing options say correction_bias=False")
    elif bias is None:
        router["e_score_correction_bias"] = torch.zeros(E, device=router_weight.device)
    else:
        router["e_score_correction_bias"] = bias
    return local, router, E


def is_expert_parallel_state(sd: Mapping[str, torch.Tensor], prefix: str) -> bool:
    """Whether `sd` holds an ExpertParallelMoE's own state_dict under `prefix` (its router
    beside its local layer's "local." keys; no checkpoint or MoE names one "local.")."""
    local = prefix + "local."
    return prefix + "router_weight" in sd and any(k.startswith(local) for k in sd)


class Renamed(Mapping[str, torch.Tensor]):
    """A checkpoint mapping with the keys prefix + name renamed prefix + names[name]; the
    tensors are indexed only when read. With `strip`, only the keys under strip are kept, as
    prefix + the rest (the local layer's keys of an ExpertParallelMoE's state_dict)."""

    def __init__(self, sd: Mapping[str, torch.Tensor], prefix: str, names: Mapping[str, str],
                 strip: str | None = None):
        self.sd = sd
        if strip is not None:
            self.keys_map = {prefix + key[len(strip):]: key for key in sd
                             if key.startswith(strip)}
            return
        self.keys_map = {prefix + names.get(key[len(prefix):], key[len(prefix):])
                         if key.startswith(prefix) else key: key for key in sd}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.sd[self.keys_map[key]]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.keys_map)

    def __len__(self) -> int:
        return len(self.keys_map)


def _router(state_dict: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    """The router weight at `key`: a 2-D tensor (E, H), whose rows decide E and the ranks'
    shares (so it is checked before they are cut: anything else failed on .shape, an
    AttributeError, or sliced a 1-D tensor's values as experts)."""
    router = state_dict[key]
    if not isinstance(router, torch.Tensor):
        raise TypeError(f"state_dict[{key!r}] must be a torch.Tensor; got "
                        f"{type(router).__name__}")
    if router.dim() != 2:
        raise ValueError(f"router weight {key!r} must be 2-D (E, H); got {shape_text(router)}")
    return router


class LocalShard(Mapping[str, torch.Tensor]):
    """The view of a checkpoint mapping that one rank loads: the local experts' keys as they
    are (the checkpoint's numbers), fused expert tensors and the router sliced to the local
    rows; other keys as they are. Keys of other ranks' experts are hidden and their tensors
    never indexed."""

    # FP8 scales of fused experts: per expert (sliced like the weights) or one value for all
    # (a per-tensor scale, kept whole).
    _FUSED_SCALES = ("experts.gate_up_proj_scale_inv", "experts.down_proj_scale_inv",
                     "experts.w13_weight_scale_inv", "experts.w13_weight_scale",
                     "experts.w2_weight_scale_inv", "experts.w2_weight_scale")

    def __init__(self, sd: Mapping[str, torch.Tensor], prefix: str, start: int, end: int,
                 num_experts: int):
        self.sd, self.prefix, self.start, self.end = sd, prefix, start, end
        self.num_experts = num_experts
        # Every per-expert key's expert number, this rank's or not (check_experts)
        self.expert_keys: dict[int, str] = {}
        self.keys_map: dict[str, str | tuple[str, int, int]] = {}
        self.scale_keys: set[str] = set()
        sliced = ("gate.weight", "experts.gate_up_proj", "experts.down_proj",
                  "experts.w13_weight", "experts.w2_weight")
        self.full_bias: torch.Tensor | None = None
        # A hash router's token -> expert table (every rank routes with all of it): kept out
        # of the local layer, whose experts are E / W of them.
        self.full_table: torch.Tensor | None = None
        self.bias_key = prefix + "gate.e_score_correction_bias"
        for key in sd:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            parts = rest.split(".")
            if rest == "gate.e_score_correction_bias":
                self.full_bias = sd[key]
                self.keys_map[key] = (key, start, end)
            elif rest == "gate.tid2eid":
                self.full_table = sd[key]
            elif rest in sliced:
                self.keys_map[key] = (key, start, end)
            elif rest in self._FUSED_SCALES:
                self.keys_map[key] = (key, start, end)
                self.scale_keys.add(key)
            elif parts[0] == "experts" and len(parts) > 2 and parts[1].isdigit():
                e = int(parts[1])
                self.expert_keys.setdefault(e, key)
                if start <= e < end:
                    self.keys_map[key] = key
            else:
                self.keys_map[key] = key

    def check_experts(self, router_key: str, router: torch.Tensor) -> None:
        """Per-expert keys must number the router's E experts: keys of an expert past E (no
        rank holds it) or a local expert without keys are a ValueError naming them (the
        first were silently left out, and the second refused with the local layer's sizes
        instead of the experts' numbers)."""
        if not self.expert_keys:
            return  # fused experts (checked against E when sliced)
        beyond = sorted(e for e in self.expert_keys if e >= self.num_experts)
        if beyond:
            raise ValueError(
                f"{self.expert_keys[beyond[0]]!r} is expert {beyond[0]} but the router "
                f"{router_key!r} {shape_text(router)} has {self.num_experts} experts (experts "
                f"{beyond[:8]} are past it); the checkpoint's experts and router disagree")
        missing = [e for e in range(self.start, self.end) if e not in self.expert_keys]
        if missing:
            raise ValueError(
                f"experts {missing[:8]} of the router's {self.num_experts} have no weights "
                f"under {self.prefix + 'experts.'!r} (this rank holds experts "
                f"[{self.start}, {self.end}))")

    def __getitem__(self, key: str) -> torch.Tensor:
        src = self.keys_map[key]
        if isinstance(src, tuple):
            name, a, b = src
            t = self.sd[name]
            if name in self.scale_keys and (t.dim() == 0 or t.shape[0] != self.num_experts):
                return t  # one scale for every expert
            if not isinstance(t, torch.Tensor):  # (MoE's loader names it; a slice would not)
                return t
            if t.dim() == 0 or t.shape[0] != self.num_experts or (
                    name == self.bias_key and t.dim() != 1):
                # A slice of another count of experts is this rank's rows of the wrong tensor
                # (MoE refuses it whole; the ranks' slices would pass unnoticed, or be refused
                # with the local sizes).
                want = (f"be ({self.num_experts},), one value per expert of the router"
                        if name == self.bias_key else
                        f"hold the router's {self.num_experts} experts in its first dimension")
                raise ValueError(f"{name!r} {shape_text(t)} must {want}")
            return t[a:b]
        return self.sd[src]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.keys_map)

    def __len__(self) -> int:
        return len(self.keys_map)
