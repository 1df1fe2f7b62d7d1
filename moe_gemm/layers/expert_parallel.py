"""Expert-parallel MoE: the experts of one layer split over the ranks of a process group.

    weights, ids = route(x)                        (T, k), every rank routes its own tokens
    recv = dispatcher.dispatch(x, ids, weights)    each token once to each rank it visits
    part = local experts on recv                   (R, H): two grouped GEMMs over E/W experts
    out  = dispatcher.combine(part)                (T, H): partials summed per token
    out += shared experts(x)                       computed while the tokens are in flight

Every rank holds the router (E, H) and the shared experts whole, and E/W routed experts:
rank r holds experts [r * E/W, (r + 1) * E/W) (moe_gemm.layers.dispatch.expert_range). The
result is the single-process `MoE`'s up to the rounding of the per-rank partial sums to the
activation dtype (bit-for-bit the same arithmetic in float32 up to summation order).

Loading: `from_moe` shards an existing layer (slices, optionally copied so the full tensors
can be freed), `from_hf` a transformers block, and `from_state_dict` reads only the local
experts' keys of a checkpoint mapping (with a lazy mapping such as safetensors' `safe_open`,
the other ranks' experts are never read). All three go through MoE's own loaders, so every
checkpoint layout MoE accepts is accepted here; FP8 experts stay FP8 with their scales, and
each rank quantizes the tokens it receives, as MoE's FP8 forward does.

Dispatch and combine are behind the `Dispatcher` interface (moe_gemm.layers.dispatch):
`AllToAllDispatcher` on torch.distributed is the default; DeepEP's kernels plug in instead.
"""

from __future__ import annotations

import contextlib
import struct
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_gemm.config import GemmConfig
from moe_gemm.layers.checkpoints import OWN_NAMES, check_loader_options
from moe_gemm.layers.dispatch import AllToAllDispatcher, Dispatched, Dispatcher, expert_range
from moe_gemm.layers.experts import (
    FLOAT_DTYPES,
    INFERENCE_ONLY_MESSAGE,
    canonical_activation,
    gated,
)
from moe_gemm.layers.experts_fp8 import expert_ffn_fp8, keep_dtypes
from moe_gemm.layers.fused_experts import fused_expert_ffn, fused_gate_for, use_fused
from moe_gemm.layers.moe import MoE, resolve_activation
from moe_gemm.layers.routing import (
    check_correction_bias,
    check_flag,
    check_router_weight,
    permute_by_expert,
    sigmoid_grouped_topk,
    softmax_topk,
)
from moe_gemm.ops.api import grouped_mm
from moe_gemm.ops.autograd import inference_only, needs_link
from moe_gemm.ops.combine import combine_rows
from moe_gemm.ops.custom_ops import mark_inference_only
from moe_gemm.ops.validation import check_dense

__all__ = ["ExpertParallelMoE"]

_ROUTING = ("top_k", "scoring", "renormalize", "n_group", "topk_group", "routed_scaling_factor",
            "router_fp32")
# MoE's options that the local experts take (the rest are the routing's, held by this layer).
_LOCAL_OPTIONS = ("activation", "config", "fused")
# check_replicated's digest: a refused flag, a checking flag, the 3 sizes, the routing
# options, the experts' and the shared expert's activations, expert dtype and shapes, then
# per replicated tensor (router, bias, 3 shared projections, shared gate) its shape and dtype
# and two hashes (_replica_digest). A rank that does not check sends the two flags alone
# (_unchecked_digest).
_DIGEST_SIZE = 2 + 3 + len(_ROUTING) + 4 + 6 * 3


def local_expert_ffn(
    x: torch.Tensor,  # (R, H)
    local_ids: torch.Tensor,  # (R, k), -1 = not on this rank
    weights: torch.Tensor,  # (R, k)
    w_gate_up: torch.Tensor,  # (E_local, H, 2I)
    w_down: torch.Tensor,  # (E_local, I, H)
    activation: Any,
    config: GemmConfig | None,
    num_valid_slots: int | None = None,
) -> torch.Tensor:
    """Per received token, the weighted sum of its local experts' FFNs. Returns (R, H).

    Slots of other ranks (-1) sort past every local slot; when their number is known on the
    host, only the valid rows are gathered (a top-8 token received by one of 8 ranks has ~1
    valid slot of 8), otherwise all R * k rows are, and the GEMMs skip the invalid tail.
    """
    R, H = x.shape
    E = w_gate_up.shape[0]
    perm = permute_by_expert(local_ids, E)
    S = perm.token_index.shape[0] if num_valid_slots is None else num_valid_slots
    xs = x.index_select(0, perm.token_index[:S])  # (S, H), rows grouped by local expert
    h = grouped_mm(xs, w_gate_up, perm.offs, config=config)  # (S, 2I)
    gate, up = h.chunk(2, dim=-1)
    a = resolve_activation(activation)(gate) * up
    # y gets one extra zero row, which the slots that are not here gather (with weight 0).
    # With the valid count known every row below S is written (S = offs[-1]); otherwise the
    # rows past offs[-1], which the GEMM leaves alone in `out`, must be zeros too.
    if num_valid_slots is None:
        y = a.new_zeros(S + 1, H)
    else:
        y = a.new_empty(S + 1, H)
        y[S:].zero_()
    grouped_mm(a, w_down, perm.offs, out=y[:S], config=config)  # (S, H)
    rows = perm.row_of_slot.clamp(max=S)
    w = perm.drop_masked(weights).to(y.dtype)
    return combine_rows(y, rows, w)


class ExpertParallelMoE(nn.Module):
    """A MoE layer whose routed experts are split over a process group. Inference only.

    Build it with `from_moe`, `from_hf` or `from_state_dict` (every rank of the group calls
    the same constructor with the same arguments); each rank then calls it on its own tokens,
    all ranks for every forward (it runs collectives), a rank with no tokens included.

    The local experts run as `moe`'s would: its activation, `config` and `fused` (set
    `layer.local.activation`, `.fused` or `.config` to switch a built layer; the activation
    reaches its shared expert too, as in MoE).

    Args:
        moe: a MoE holding this rank's E/W experts only (any router: it is not used).
        router: the full layer's routing: router_weight [E, H], e_score_correction_bias [E]
            or None, and the routing options (top_k, scoring, renormalize, n_group,
            topk_group, routed_scaling_factor, router_fp32).
        num_experts: E, all ranks together.
        group: the process group (None = the default group); ignored if `dispatcher` given.
        dispatcher: a Dispatcher (default: AllToAllDispatcher(group)).
        check_replicated: run `check_replicated()` once here (default): ranks whose router,
            correction bias, shared experts or layer options differ raise ValueError, every
            rank alike, instead of routing the same token differently on each rank. Every
            rank must pass the same value; False still costs one all-gather of a few dozen
            integers at construction (no weight is read), which is how ranks that disagree
            on it, or a rank whose arguments are refused, make every rank raise.

    Raises:
        ValueError: the replicated parts differ between the ranks (check_replicated), the
            ranks pass different check_replicated values, or another rank's constructor
            refused its arguments.
        TypeError: a dispatcher that is not a Dispatcher, check_replicated (or from_moe's
            copy) not a bool.
    """

    def __init__(
        self,
        moe: MoE,
        router: Mapping[str, Any],
        num_experts: int,
        *,
        group: dist.ProcessGroup | None = None,
        dispatcher: Dispatcher | None = None,
        check_replicated: bool = True,
    ) -> None:
        super().__init__()
        self.dispatcher: Dispatcher = _dispatcher_or_default(dispatcher, group)
        self.rank = self.dispatcher.rank
        self.world_size = self.dispatcher.world_size
        # A rank whose arguments are refused here joins the replica check flagged (the others
        # raise too instead of waiting in it).
        with _refusing(self.dispatcher):
            # (a string such as "no" would be truthy: the check run where it was declined)
            check_replicated = check_flag("check_replicated", check_replicated)
            if not isinstance(moe, MoE):
                raise TypeError(f"moe must be a moe_gemm MoE; got {type(moe).__name__}")
            start, end = expert_range(num_experts, self.rank, self.world_size)
            if moe.num_experts != end - start:
                raise ValueError(
                    f"rank {self.rank} of {self.world_size} holds {end - start} of "
                    f"{num_experts} experts; the local MoE has {moe.num_experts}"
                )
            self.num_experts = num_experts
            self.expert_start = start
            self.hidden_size = moe.hidden_size
            self.intermediate_size = moe.intermediate_size
            self.local = moe
            # The router's tensors get MoE's loader checks: here, not inside the first forward.
            rw = check_router_weight(router["router_weight"], num_experts, moe.hidden_size)
            bias = router.get("e_score_correction_bias")
            if bias is not None:
                check_correction_bias(bias, num_experts, rw.device, "e_score_correction_bias",
                                      "router_weight is")
            self.router_weight = nn.Parameter(rw.detach(), requires_grad=False)
            self.register_buffer("e_score_correction_bias", bias)
            for name in _ROUTING:
                setattr(self, name, router[name])
            # the routing options are checked by a full-size MoE's own validation
            MoE(moe.hidden_size, 1, num_experts, self.top_k, scoring=self.scoring,
                renormalize=self.renormalize, n_group=self.n_group, topk_group=self.topk_group,
                routed_scaling_factor=self.routed_scaling_factor, router_fp32=self.router_fp32,
                device="meta")
        self._agree_on_replicas(bool(check_replicated))

    def check_replicated(self) -> None:
        """Check that every rank holds the same replicated parts: the router weight, the
        correction bias, the shared experts (and their gate), the routing options, the
        sizes, dtypes and activations of the experts. Every rank of the group must call it.

        Each rank hashes its copies exactly (the bits of every element, position-weighted,
        in integer arithmetic, so summation order cannot matter) and one all-gather of a few
        dozen integers compares them: a cost of one read of the replicated weights, paid
        once at construction by default. Ranks that disagree would otherwise route the same
        token to different experts or add different shared outputs, silently.

        Needs the group: the dispatcher's `group` attribute (AllToAllDispatcher has one;
        None = the default group); a dispatcher without one, or a group of one rank, is not
        checked.

        Raises:
            ValueError: on every rank alike, naming what differs and the ranks' values, or
                the ranks whose constructor refused its arguments.
        """
        self._agree_on_replicas(True)

    def _agree_on_replicas(self, check: bool) -> None:
        """The constructor's replica check, or with check=False its flags alone: the
        all-gather runs on every rank either way, so that a rank that checks never waits for
        one that does not (the group's timeout), and a disagreement is a ValueError on all."""
        if not _checks_replicas(self.dispatcher):
            return
        names, mine = _replica_digest(self) if check else ([], _unchecked_digest())
        table = _gather_digests(self.dispatcher, mine)  # (W, _DIGEST_SIZE)
        refused = [r for r in range(self.world_size) if table[r, 0]]
        if refused:
            raise ValueError(
                f"ExpertParallelMoE: rank(s) {refused} could not build the layer (their own "
                f"error says why); rank {self.rank} stops too instead of waiting for them")
        checking = table[:, 1].tolist()
        if len(set(checking)) > 1:
            on = [r for r, c in enumerate(checking) if c]
            off = [r for r, c in enumerate(checking) if not c]
            raise ValueError(
                "ExpertParallelMoE: the ranks disagree on check_replicated (True on ranks "
                f"{on}, False on ranks {off}); every rank must pass the same value")
        if not check:
            return
        differ: dict[str, str] = {}
        for i, name in enumerate(names):
            if name not in differ and bool((table[:, i] != table[0, i]).any()):
                # (most values are hashes: say which ranks agree with which)
                differ[name] = _groups(table[:, i].tolist())
        if differ:
            what = "; ".join(f"{name} (ranks {ranks})" for name, ranks in
                             list(differ.items())[:4])
            raise ValueError(
                "ExpertParallelMoE: the replicated parts differ between the ranks (each rank "
                f"must build the layer from the same full weights and options): {what}")

    # -- constructors ----------------------------------------------------------------------

    @classmethod
    def from_moe(
        cls,
        moe: MoE,
        *,
        group: dist.ProcessGroup | None = None,
        dispatcher: Dispatcher | None = None,
        copy: bool = True,
        check_replicated: bool = True,
    ) -> ExpertParallelMoE:
        """This rank's shard of a whole MoE layer: its routing options, activation, shared
        experts, `config` and `fused` come along.

        Args:
            moe: the full layer (every rank passes an equal one).
            group, dispatcher, check_replicated: see the class.
            copy: copy the local experts (so the full tensors can be freed); False keeps
                views into `moe`'s storage.
        """
        dispatcher = _dispatcher_or_default(dispatcher, group)
        with _refusing(dispatcher):
            local = _local_moe(moe, dispatcher, check_flag("copy", copy))
        return cls(local, _router_of(moe), moe.num_experts, dispatcher=dispatcher,
                   check_replicated=check_replicated)

    @classmethod
    def from_hf(
        cls,
        block: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        dispatcher: Dispatcher | None = None,
        config: GemmConfig | None = None,
        copy: bool = True,
        check_replicated: bool = True,
    ) -> ExpertParallelMoE:
        """This rank's shard of a transformers MoE block (the blocks `MoE.from_hf` takes)."""
        dispatcher = _dispatcher_or_default(dispatcher, group)
        with _refusing(dispatcher):
            moe = MoE.from_hf(block, config=config)
        return cls.from_moe(moe, dispatcher=dispatcher, copy=copy,
                            check_replicated=check_replicated)

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        top_k: int,
        *,
        prefix: str = "",
        strict: bool = True,
        group: dist.ProcessGroup | None = None,
        dispatcher: Dispatcher | None = None,
        check_replicated: bool = True,
        **options: Any,
    ) -> ExpertParallelMoE:
        """This rank's shard of one MoE block of a checkpoint; reads only the local experts.

        Accepts every layout `MoE.from_state_dict` does. Per-expert keys
        ("experts.{e}.w1.weight", "experts.{e}.gate_proj.weight", ...) of other ranks' experts
        are never read; fused ones ("experts.gate_up_proj" [E, 2I, H], vLLM's "w13_weight")
        are sliced to the local experts (read lazily by a mapping whose tensors are lazy).

        Args:
            state_dict: name -> tensor (any Mapping; only the needed keys are indexed).
            top_k, prefix, strict, **options: as `MoE.from_state_dict` (routing options).
            group, dispatcher, check_replicated: see the class.
        """
        dispatcher = _dispatcher_or_default(dispatcher, group)
        # A rank whose checkpoint or options are refused joins the replica check flagged.
        with _refusing(dispatcher):
            if not isinstance(state_dict, Mapping):
                raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
            if prefix + "gate.weight" not in state_dict and prefix + "router_weight" in state_dict:
                # MoE's own state_dict, which MoE.from_state_dict reads too: its names read as
                # the checkpoint names of the same tensors (lazily, as the rest).
                state_dict = _Renamed(state_dict, prefix, OWN_NAMES)
            router_key = prefix + "gate.weight"
            if router_key not in state_dict:
                raise KeyError(f"no router weight {router_key!r} in the state dict")
            router_weight = state_dict[router_key]
            E = router_weight.shape[0]
            start, end = expert_range(E, dispatcher.rank, dispatcher.world_size)
            local_sd = _LocalShard(state_dict, prefix, start, end, E)
            bias = local_sd.full_bias
            check_loader_options(options)  # (the probe below would take a dtype and ignore it)
            routing = {k: v for k, v in options.items() if k not in _LOCAL_OPTIONS}
            if bias is not None:
                routing.setdefault("scoring", "sigmoid")
            # The local MoE sees the local experts and the local rows of the router (never used:
            # routing is over all E experts), so MoE's loader validates and stacks them.
            local_opts = {k: options[k] for k in _LOCAL_OPTIONS if k in options}
            local = MoE.from_state_dict(local_sd, 1, prefix=prefix, strict=strict, **local_opts)
            # A full-size MoE on the meta device checks the routing options and fills defaults.
            probe = MoE(router_weight.shape[1], 1, E, top_k, device="meta", **routing)
            router = _router_of(probe)
            router["router_weight"] = router_weight
            if probe.e_score_correction_bias is None:
                if bias is not None:
                    raise ValueError("the checkpoint has an e_score_correction_bias but the "
                                     "routing options say correction_bias=False")
            elif bias is None:
                router["e_score_correction_bias"] = torch.zeros(E, device=router_weight.device)
            else:
                router["e_score_correction_bias"] = bias
        return cls(local, router, E, dispatcher=dispatcher, check_replicated=check_replicated)

    # -- forward ---------------------------------------------------------------------------

    def _apply(self, fn, recurse=True):
        # The correction bias keeps its dtype under module.to(dtype), as in MoE._apply (a bf16
        # bias changes the selection).
        if self.e_score_correction_bias is not None:
            fn = keep_dtypes(fn, (self.e_score_correction_bias,))
        return super()._apply(fn, recurse)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, ids [T, k] int64 global expert ids) for x [T, H] or
        [..., H] (flattened, as MoE.route); x checked as forward's input."""
        self._check_weights()
        self._check_input(x)
        return self._route_tokens(x.reshape(-1, self.hidden_size))

    def _route_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """route for x [T, H] already checked (the forward's)."""
        if self.router_fp32:
            logits = F.linear(x.float(), self.router_weight.float())
        else:
            logits = F.linear(x.to(self.router_weight.dtype), self.router_weight)
        if self.scoring == "softmax":
            return softmax_topk(logits, self.top_k, self.renormalize)
        return sigmoid_grouped_topk(
            logits, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
            self.routed_scaling_factor, self.renormalize,
        )

    def experts(self, d: Dispatched) -> torch.Tensor:
        """This rank's experts on what it received: [R, H] partial outputs."""
        m = self.local
        if m.fp8 is not None:
            # FP8 experts quantize the received tokens on the fly, as MoE's FP8 forward does,
            # and compute the valid slots alone where their count is known (other ranks'
            # slots, -1, are most of them under top-8 over 8 ranks).
            return expert_ffn_fp8(d.x, d.local_ids, d.weights, m.gate_up_proj,
                                  m.gate_up_proj_scale_inv, m.down_proj, m.down_proj_scale_inv,
                                  gated(resolve_activation(m.activation)), config=m.config,
                                  num_valid_slots=d.num_valid_slots)
        x = d.x.to(m.gate_up_proj.dtype)
        # The fused kernel when asked for (fused=True), on the valid slots alone where their
        # count is known (num_valid_slots), as the unfused path: other ranks' -1 slots are most
        # of the R x top_k received ones under top-8 over 8 ranks. Unlike MoE, None keeps the
        # unfused path here: the fused kernels are not timed in this regime on GPUs yet.
        gate = fused_gate_for(canonical_activation(m.activation))
        if use_fused(m.fused is True, gate, x, m.w_gate_up, m.w_down, m.config):
            return fused_expert_ffn(x, d.local_ids, d.weights, m.w_gate_up, m.w_down, gate,
                                    config=m.config, num_valid_slots=d.num_valid_slots)
        return local_expert_ffn(x, d.local_ids, d.weights, m.w_gate_up, m.w_down,
                                m.activation, m.config, d.num_valid_slots)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts on this rank's own tokens [T, H], or None without any."""
        m = self.local
        if m.shared_experts is None:
            return None
        xs = x.to(m.shared_experts.gate_proj.weight.dtype)
        out = m.shared_experts(xs)
        if m.shared_expert_gate is not None:
            out = torch.sigmoid(m.shared_expert_gate(xs.to(m.shared_expert_gate.weight.dtype))) * out
        return out

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's tokens [..., H] -> [..., H]; every rank of the group must call it.

        Inference only, as MoE: where autograd could ask for a gradient (grad mode on and the
        input or a parameter requires grad) the result is linked so that a backward raises
        RuntimeError (a detached result let a training step run on, the layer's gradient
        silently missing).
        """
        linked = [t for t in (hidden_states, *self.parameters()) if isinstance(t, torch.Tensor)]
        if torch.compiler.is_compiling():
            y = self._forward(hidden_states)
            if not needs_link(linked):
                return y
            # Traced: y comes out of no_grad, so it is tied to the input first (a select that
            # keeps y's values), then given the raising backward.
            y = torch.where(torch.zeros((), dtype=torch.bool, device=y.device), hidden_states, y)
            return mark_inference_only(y, INFERENCE_ONLY_MESSAGE)
        return inference_only(INFERENCE_ONLY_MESSAGE, lambda: self._forward(hidden_states),
                              linked)

    @torch.no_grad()
    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        try:
            self._check_weights()
            self._check_input(hidden_states)
            # (a cast layer: refused on every rank before any collective, as MoE refuses it)
            self.local.check_weight_dtype("ExpertParallelMoE")
        except (TypeError, ValueError):
            # The other ranks are already on their way into the dispatch's collectives: join
            # its first one flagged as refused, so that they raise too instead of waiting for
            # this rank's tokens (a dispatcher without `refuse` leaves them waiting).
            refuse = getattr(self.dispatcher, "refuse", None)
            if callable(refuse):
                refuse(self.router_weight.device)
            raise
        x = hidden_states
        x2 = x.reshape(-1, self.hidden_size)
        weights, ids = self._route_tokens(x2)
        # Tokens travel in the experts' dtype; FP8 experts take them in the caller's (they are
        # quantized per token after the dispatch, as in MoE's FP8 forward), which must then be
        # the same on every rank (AllToAllDispatcher raises ValueError otherwise).
        xe = x2 if self.local.fp8 is not None else x2.to(self.local.gate_up_proj.dtype)
        d, shared = self.dispatcher.dispatch(xe, ids, weights, self.num_experts,
                                             during=lambda: self.shared(x2))
        y = self.dispatcher.combine(self.experts(d), d.handle).to(x.dtype)
        if shared is not None:
            y = y + shared.to(x.dtype)
        return y.view(x.shape)

    def _check_weights(self) -> None:
        """The router and the local experts as MoE.forward checks its own, for weights assigned
        after construction: a router of another E routed tokens to experts no rank holds
        (their slots silently dropped), one of another H failed inside F.linear."""
        check_router_weight(self.router_weight, self.num_experts, self.hidden_size)
        if self.router_weight.device != self.local.gate_up_proj.device:
            raise ValueError(f"the layer's router_weight is on {self.router_weight.device} but "
                             f"its expert weights are on {self.local.gate_up_proj.device}")
        self.local._check_parameters()

    def _check_input(self, x: object) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor (..., H); got "
                            f"{type(x).__name__}")
        check_dense("hidden_states", x)
        H = self.hidden_size
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"hidden_states must be (..., H) = (..., {H}); got "
                             f"{tuple(x.shape)}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"hidden_states must be torch.bfloat16, torch.float16 or "
                            f"torch.float32; got {x.dtype}")
        if x.device != self.router_weight.device:
            raise ValueError(f"hidden_states is on {x.device} but the layer's weights are on "
                             f"{self.router_weight.device}")

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, local_experts=[{self.expert_start}, "
                f"{self.expert_start + self.local.num_experts}), top_k={self.top_k}, "
                f"scoring={self.scoring!r}, rank={self.rank}/{self.world_size}")


def _dispatcher_or_default(dispatcher: object, group: dist.ProcessGroup | None) -> Dispatcher:
    """The constructors' `dispatcher`, or the default AllToAllDispatcher(group) for None. One
    that is not a Dispatcher is a TypeError here, before from_moe reads its `rank` (an
    AttributeError about the object) or a falsy one is silently replaced by the default."""
    if dispatcher is None:
        return AllToAllDispatcher(group)
    if not isinstance(dispatcher, Dispatcher):
        raise TypeError("dispatcher must be a Dispatcher (rank, world_size, dispatch(...) and "
                        f"combine(...)) or None; got {type(dispatcher).__name__}")
    return dispatcher


def _local_moe(moe: MoE, dispatcher: Dispatcher, copy: bool) -> MoE:
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
    if moe.shared_experts is not None:
        # The shared expert follows moe.activation, unless its own was set apart: as it is.
        local.shared_experts.activation = moe.shared_experts.activation
    return local


def _checks_replicas(dispatcher: Dispatcher) -> bool:
    """Whether check_replicated can run: a group (the dispatcher's `group` attribute) of more
    than one rank, torch.distributed initialized."""
    return (dispatcher.world_size > 1 and hasattr(dispatcher, "group")
            and dist.is_available() and dist.is_initialized())


def _gather_digests(dispatcher: Dispatcher, mine: torch.Tensor) -> torch.Tensor:
    """check_replicated's all-gather: every rank's digest, (W, len(digest)) on the CPU."""
    group = dispatcher.group  # type: ignore[attr-defined]
    # The collective's tensor where the group's backend takes it: NCCL only CUDA tensors
    # (a layer built on the CPU and moved later), gloo the CPU.
    if dist.get_backend(group) == "nccl":
        if mine.device.type != "cuda":
            mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        mine = mine.cpu()
    gathered = [torch.empty_like(mine) for _ in range(dispatcher.world_size)]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered).cpu()


@contextlib.contextmanager
def _refusing(dispatcher: Dispatcher) -> Iterator[None]:
    """Construction before the replica check: a rank whose arguments are refused (its own
    TypeError, ValueError or KeyError, e.g. a bad top_k or a missing checkpoint key) joins the
    check's all-gather with a digest flagged as refused, so that the other ranks raise
    ValueError too instead of waiting in it until the group's timeout (the all-gather runs
    whatever check_replicated says, so the others would wait there too, or in their first
    forward for a rank that has no layer)."""
    try:
        yield
    except (TypeError, ValueError, KeyError):
        if _checks_replicas(dispatcher):
            flagged = torch.zeros(_DIGEST_SIZE, dtype=torch.int64)
            flagged[0] = 1
            _gather_digests(dispatcher, flagged)
        raise


_P = 2 ** 31 - 1  # the hashes' modulus: products of two residues stay below 2^62


def _tensor_hash(t: torch.Tensor) -> tuple[int, int]:
    """Two exact hashes of a tensor's bits: their sum and a position-weighted sum, mod _P,
    in int64 arithmetic (order-independent, so equal on every rank for equal tensors)."""
    flat = t.detach().contiguous().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(width)
    plain = weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    step = 1 << 20  # elements per chunk: a few int64 temporaries of 8 MiB
    for i in range(0, bits.numel(), step):
        v = bits[i:i + step].to(torch.int64)
        if width is torch.int64:
            v = (v & 0xFFFFFFFF) * 31 + ((v >> 32) & 0xFFFFFFFF)
        v = v % _P
        pos = torch.arange(i, i + v.numel(), device=t.device, dtype=torch.int64) % (_P - 1) + 1
        plain = (plain + v.sum()) % _P
        weighted = (weighted + (v * pos % _P).sum()) % _P
    return int(plain), int(weighted)


def _replica_digest(layer: ExpertParallelMoE) -> tuple[list[str], torch.Tensor]:
    """(names, int64 values) of what every rank must hold alike (check_replicated)."""
    m = layer.local
    names: list[str] = []
    values: list[int] = []

    def add(name: str, value: object) -> None:
        names.append(name)
        if isinstance(value, float):
            value = struct.unpack("<q", struct.pack("<d", value))[0]  # exact bits
        elif not isinstance(value, int):
            value = zlib.crc32(repr(value).encode())
        values.append(int(value))

    add("refused", 0)  # (1 only in the digest of a rank whose constructor refused: _refusing)
    add("check_replicated", 1)  # (0 in the digest of a rank that does not check)
    for name in ("num_experts", "hidden_size", "intermediate_size", *_ROUTING):
        add(name, getattr(layer, name))
    add("activation", _activation_key(m.activation))
    add("shared activation", None if m.shared_experts is None else _activation_key(
        m.shared_experts.activation))
    add("expert dtype", m.gate_up_proj.dtype)
    add("local experts' shapes", tuple(m.gate_up_proj.shape) + tuple(m.down_proj.shape))
    tensors: dict[str, torch.Tensor | None] = {
        "router_weight": layer.router_weight,
        "e_score_correction_bias": layer.e_score_correction_bias,
    }
    shared = m.shared_experts
    for part in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"shared_experts.{part}"] = None if shared is None else getattr(
            shared, part).weight
    tensors["shared_expert_gate"] = None if m.shared_expert_gate is None else (
        m.shared_expert_gate.weight)
    for name, t in tensors.items():
        add(f"{name} shape and dtype", None if t is None else (tuple(t.shape), t.dtype))
        h = (-1, -1) if t is None else _tensor_hash(t)
        add(name, h[0])
        add(name, h[1])
    assert len(values) == _DIGEST_SIZE
    return names, torch.tensor(values, dtype=torch.int64, device=layer.router_weight.device)


def _activation_key(act: object) -> object:
    """What the digest compares of an activation: its name, or a callable's qualified name."""
    return act if isinstance(act, str) else getattr(act, "__qualname__", act)


def _unchecked_digest() -> torch.Tensor:
    """The digest of a rank built with check_replicated=False: neither flag set, nothing
    hashed (the size of _replica_digest's: every rank gives the all-gather the same size)."""
    return torch.zeros(_DIGEST_SIZE, dtype=torch.int64)


def _groups(values: list[int]) -> str:
    """Ranks grouped by equal value: '[0, 2] vs [1]'."""
    by: dict[int, list[int]] = {}
    for rank, v in enumerate(values):
        by.setdefault(v, []).append(rank)
    return " vs ".join(str(ranks) for ranks in by.values())


def _router_of(moe: MoE) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(moe, name) for name in _ROUTING}
    out["router_weight"] = moe.router_weight
    out["e_score_correction_bias"] = moe.e_score_correction_bias
    return out


class _Renamed(Mapping[str, torch.Tensor]):
    """A checkpoint mapping with the keys prefix + name renamed prefix + names[name]; the
    tensors are indexed only when read."""

    def __init__(self, sd: Mapping[str, torch.Tensor], prefix: str, names: Mapping[str, str]):
        self.sd = sd
        self.keys_map = {prefix + names.get(key[len(prefix):], key[len(prefix):])
                         if key.startswith(prefix) else key: key for key in sd}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.sd[self.keys_map[key]]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.keys_map)

    def __len__(self) -> int:
        return len(self.keys_map)


class _LocalShard(Mapping[str, torch.Tensor]):
    """The view of a checkpoint mapping that one rank loads: local experts renumbered from 0,
    fused expert tensors and the router sliced to the local rows; other keys as they are.
    Keys of other ranks' experts are hidden and their tensors never indexed."""

    # FP8 scales of fused experts: per expert (sliced like the weights) or one value for all
    # (a per-tensor scale, kept whole).
    _FUSED_SCALES = ("experts.gate_up_proj_scale_inv", "experts.down_proj_scale_inv",
                     "experts.w13_weight_scale_inv", "experts.w13_weight_scale",
                     "experts.w2_weight_scale_inv", "experts.w2_weight_scale")

    def __init__(self, sd: Mapping[str, torch.Tensor], prefix: str, start: int, end: int,
                 num_experts: int):
        self.sd, self.prefix, self.start, self.end = sd, prefix, start, end
        self.num_experts = num_experts
        self.keys_map: dict[str, str | tuple[str, int, int]] = {}
        self.scale_keys: set[str] = set()
        sliced = ("gate.weight", "experts.gate_up_proj", "experts.down_proj",
                  "experts.w13_weight", "experts.w2_weight")
        self.full_bias: torch.Tensor | None = None
        for key in sd:
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            parts = rest.split(".")
            if rest == "gate.e_score_correction_bias":
                self.full_bias = sd[key]
                self.keys_map[key] = (key, start, end)
            elif rest in sliced:
                self.keys_map[key] = (key, start, end)
            elif rest in self._FUSED_SCALES:
                self.keys_map[key] = (key, start, end)
                self.scale_keys.add(key)
            elif parts[0] == "experts" and len(parts) > 2 and parts[1].isdigit():
                e = int(parts[1])
                if start <= e < end:
                    local = ".".join([prefix + "experts", str(e - start), *parts[2:]])
                    self.keys_map[local] = key
            else:
                self.keys_map[key] = key

    def __getitem__(self, key: str) -> torch.Tensor:
        src = self.keys_map[key]
        if isinstance(src, tuple):
            name, a, b = src
            t = self.sd[name]
            if name in self.scale_keys and (t.dim() == 0 or t.shape[0] != self.num_experts):
                return t  # one scale for every expert
            return t[a:b]
        return self.sd[src]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.keys_map)

    def __len__(self) -> int:
        return len(self.keys_map)
