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

Loading (layers/expert_parallel_loaders.py): `from_moe` shards an existing layer (slices,
optionally copied so the full tensors can be freed), `from_hf` a transformers block, and
`from_state_dict` reads only the local experts' keys of a checkpoint mapping (with a lazy
Mapping, e.g. one whose `__getitem__` calls safetensors' `safe_open(...).get_tensor`, the other
ranks' experts are never read; a `safe_open` handle itself is not a Mapping). All three
go through MoE's own loaders, so every checkpoint layout MoE accepts is accepted here; FP8
experts stay FP8 with their scales, and each rank quantizes the tokens it receives, as MoE's
FP8 forward does.

Dispatch and combine are behind the `Dispatcher` interface (moe_gemm.layers.dispatch):
`AllToAllDispatcher` on torch.distributed is the default; DeepEP's kernels plug in instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_gemm.config import GemmConfig
from moe_gemm.layers.dispatch import Dispatched, Dispatcher, expert_range
from moe_gemm.layers.expert_parallel_loaders import ExpertParallelLoaders
from moe_gemm.layers.expert_shards import (
    ROUTING,
    ROUTING_DEFAULTS,
    check_own_shard,
    dispatcher_or_default,
)
from moe_gemm.layers.experts import (
    INFERENCE_ONLY_MESSAGE,
    canonical_activation,
    gated,
)
from moe_gemm.layers.experts_fp8 import expert_ffn_fp8, keep_dtypes
from moe_gemm.layers.fused_experts import fused_expert_ffn, fused_gate_for, use_fused
from moe_gemm.layers.gate_activations import apply_gate
from moe_gemm.layers.layer_checks import check_hidden_states
from moe_gemm.layers.moe import MoE, resolve_activation, shared_expert_output
from moe_gemm.layers.moe_options import RoutingOptions
from moe_gemm.layers.replica_check import agree_on_replicas, refusing
from moe_gemm.layers.routing import (
    check_correction_bias,
    check_flag,
    check_router_weight,
    check_token_expert_table,
    permute_by_expert,
    route_tokens,
    router_jitter,
)
from moe_gemm.ops.api import grouped_mm
from moe_gemm.ops.autograd import inference_only_composite, needs_link
from moe_gemm.ops.combine import combine_rows
from moe_gemm.ops.custom_ops import mark_inference_only
from moe_gemm.ops.token_gather import gather_rows

__all__ = ["ExpertParallelMoE"]


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
    xs = gather_rows(x, perm.token_index[:S])  # (S, H), rows grouped by local expert
    h = grouped_mm(xs, w_gate_up, perm.offs, config=config)  # (S, 2I)
    gate, up = h.chunk(2, dim=-1)
    a = apply_gate(resolve_activation(activation), gate, up)
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


class ExpertParallelMoE(ExpertParallelLoaders, RoutingOptions):
    """A MoE layer whose routed experts are split over a process group. Inference only.

    Build it with `from_moe`, `from_hf` or `from_state_dict` (ExpertParallelLoaders: every
    rank of the group calls the same constructor with the same arguments); each rank then
    calls it on its own tokens, all ranks for every forward (it runs collectives), a rank
    with no tokens included.

    The local experts run as `moe`'s would: its activation, `config` and `fused` (set
    `layer.local.activation`, `.fused` or `.config` to switch a built layer; the activation
    reaches its shared expert too, as in MoE). The routing options (top_k, scoring,
    renormalize, n_group, topk_group, routed_scaling_factor, router_fp32,
    router_jitter_noise) are attributes checked on assignment as MoE's are; assign them alike
    on every rank (check_replicated() compares them).

    Args:
        moe: a MoE holding this rank's E/W experts only (any router: it is not used).
        router: the full layer's routing: router_weight [E, H], e_score_correction_bias [E]
            or None, optionally tid2eid [V, top_k] (hash routing by token id, DeepSeek-V4's
            first layers: the forward then takes input_ids), and the routing options (top_k,
            scoring, renormalize, n_group,
            topk_group, routed_scaling_factor, router_fp32, and optionally
            router_jitter_noise: 0 when left out). As in MoE, the router jitter applies to
            each rank's tokens in training mode.
        num_experts: E, all ranks together.
        group: the process group (None = the default group); ignored if `dispatcher` given.
        dispatcher: a Dispatcher (default: AllToAllDispatcher(group)).
        check_replicated: run `check_replicated()` once here (default): ranks whose router,
            correction bias, shared experts, layer options or dispatchers differ raise
            ValueError, every rank alike, instead of routing the same token differently on
            each rank. Every rank must pass the same value; False still costs one
            all-gather of a few dozen integers at construction (no weight is read), which is
            how ranks that disagree on it, or a rank whose arguments are refused, make every
            rank raise.

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
        self.dispatcher: Dispatcher = dispatcher_or_default(dispatcher, group)
        self.rank = self.dispatcher.rank
        self.world_size = self.dispatcher.world_size
        # A rank whose arguments are refused here joins the replica check flagged (the others
        # raise too instead of waiting in it).
        with refusing(self.dispatcher):
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
            table = router.get("tid2eid")
            if table is not None:
                check_token_expert_table(table, num_experts, router.get("top_k"))
                if table.device != rw.device:
                    raise ValueError(f"tid2eid is on {table.device} but router_weight is on "
                                     f"{rw.device}")
                table = table.detach()
            self.register_buffer("tid2eid", table)
            missing = [n for n in ROUTING if n not in router and n not in ROUTING_DEFAULTS]
            if missing:  # (a bare KeyError before)
                raise ValueError(f"router is missing {', '.join(map(repr, missing))}; it holds "
                                 f"router_weight and the routing options {', '.join(ROUTING)}")
            opts = {n: router.get(n, ROUTING_DEFAULTS.get(n)) for n in ROUTING}
            # The routing options are checked by a full-size MoE's own validation (a meta
            # probe: any dtype it takes, whatever torch's default is), the correction bias
            # with them (softmax scoring has none: it was kept and never read), and taken as
            # the probe resolves them: router_fp32=None is True for sigmoid scoring (kept as
            # None it ran the router in the weight's dtype), and 2 and 2.0 are one value on
            # every rank (they hashed apart in check_replicated).
            probe = MoE(moe.hidden_size, 1, num_experts, correction_bias=bias is not None,
                        device="meta", dtype=torch.float32, **opts)
            for name in ROUTING:
                setattr(self, name, getattr(probe, name))
            # (one float on every rank: an int 0 and 0.0 hash apart in check_replicated)
            self.router_jitter_noise = float(self.router_jitter_noise)
        agree_on_replicas(self, bool(check_replicated))

    def _top_k_limit(self) -> int | None:
        return self.__dict__.get("num_experts")  # (E of all ranks)

    def check_replicated(self) -> None:
        """Check that every rank holds the same replicated parts: the router weight, the
        correction bias, the shared experts (and their gate), the routing options, the
        sizes, dtypes and activations of the experts, the dispatcher's class and its
        static_splits. Every rank of the group must call it.

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
        agree_on_replicas(self, True)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Another rank's own state_dict (a restart that remapped ranks) loaded without a word,
        # its experts answering for this rank's expert ids: a ValueError naming whose it is,
        # as from_state_dict refuses it.
        router = state_dict.get(prefix + "router_weight")
        if isinstance(router, torch.Tensor) and router.dim() == 2 and (
                router.shape[0] == self.num_experts):
            check_own_shard(state_dict.get(prefix + "local.router_weight"), router,
                            self.dispatcher)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- forward ---------------------------------------------------------------------------

    def _apply(self, fn, recurse=True):
        # The correction bias keeps its dtype under module.to(dtype), as in MoE._apply (a bf16
        # bias changes the selection).
        if self.e_score_correction_bias is not None:
            fn = keep_dtypes(fn, (self.e_score_correction_bias,))
        return super()._apply(fn, recurse)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, ids [T, k] int64 global expert ids) for x [T, H] or
        [..., H] (flattened, as MoE.route); x checked as forward's input; input_ids: the
        tokens' ids, for a hash-routed layer (see forward)."""
        self._check_weights()
        check_hidden_states(x, self.hidden_size, self.router_weight.device)
        return self._route_tokens(x.reshape(-1, self.hidden_size), input_ids)

    def _route_tokens(self, x: torch.Tensor, input_ids: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """route for x [T, H] already checked (the forward's)."""
        table = self._buffers.get("tid2eid")  # (a layer pickled before hash routing has none)
        return route_tokens(x, self.router_weight, self.top_k, self.scoring, self.renormalize,
                            self.n_group, self.topk_group, self.routed_scaling_factor,
                            None if table is not None else self.e_score_correction_bias,
                            self.router_fp32, table, input_ids)

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
        return shared_expert_output(self.local, x)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """This rank's tokens [..., H] -> [..., H]; every rank of the group must call it.
        input_ids: this rank's token ids (one per token, any shape), needed where the layer
        routes by token id (tid2eid set: DeepSeek-V4's first layers) and ignored otherwise,
        taken as MoE and transformers' DeepSeek-V4 blocks take them. On a GPU their values
        are not checked (an id outside the table is clamped), as in MoE.

        Inference only, as MoE: where autograd could ask for a gradient (grad mode on and the
        input or a parameter requires grad) the result is linked so that a backward raises
        RuntimeError (a detached result let a training step run on, the layer's gradient
        silently missing).
        """
        linked = [t for t in (hidden_states, *self.parameters()) if isinstance(t, torch.Tensor)]
        if torch.compiler.is_compiling():
            y = self._forward(hidden_states, input_ids)
            if not needs_link(linked):
                return y
            # Traced: y comes out of no_grad, so it is tied to the input first (a select that
            # keeps y's values), then given the raising backward.
            y = torch.where(torch.zeros((), dtype=torch.bool, device=y.device), hidden_states, y)
            return mark_inference_only(y, INFERENCE_ONLY_MESSAGE)
        return inference_only_composite(INFERENCE_ONLY_MESSAGE,
                                        lambda: self._forward(hidden_states, input_ids),
                                        linked)

    @torch.no_grad()
    def _forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None
                 ) -> torch.Tensor:
        try:
            self._check_weights()
            check_hidden_states(hidden_states, self.hidden_size, self.router_weight.device)
            # (a cast layer: refused on every rank before any collective, as MoE refuses it)
            self.local.check_weight_dtype("ExpertParallelMoE")
            x = hidden_states
            if self.training and self.router_jitter_noise > 0:
                x = router_jitter(x, self.router_jitter_noise)  # (as MoE: this rank's tokens)
            x2 = x.reshape(-1, self.hidden_size)
            # (routing options reassigned on one rank into a combination the routing refuses,
            # e.g. n_group > 1 under softmax, are refused here: the others waited in the
            # dispatch; so are a hash-routed layer's missing or bad input_ids)
            weights, ids = self._route_tokens(x2, input_ids)
        except (TypeError, ValueError):
            # The other ranks are already on their way into the dispatch's collectives: join
            # its first one flagged as refused, so that they raise too instead of waiting for
            # this rank's tokens (a dispatcher without `refuse` leaves them waiting).
            refuse = getattr(self.dispatcher, "refuse", None)
            if callable(refuse):
                refuse(self.router_weight.device)
            raise

        def shared() -> torch.Tensor | Exception | None:
            # A failure of this rank's shared experts (weights replaced on it alone) is raised
            # after the combine: the other ranks waited there for this rank's expert outputs.
            try:
                return self.shared(x2)
            except Exception as e:  # noqa: BLE001 - raised below
                return e

        # Tokens travel in the experts' dtype; FP8 experts take them in the caller's (they are
        # quantized per token after the dispatch, as in MoE's FP8 forward), which must then be
        # the same on every rank (AllToAllDispatcher raises ValueError otherwise).
        xe = x2 if self.local.fp8 is not None else x2.to(self.local.gate_up_proj.dtype)
        d, shared_y = self.dispatcher.dispatch(xe, ids, weights, self.num_experts,
                                               during=shared)
        y = self.dispatcher.combine(self.experts(d), d.handle).to(x.dtype)
        if isinstance(shared_y, Exception):
            raise shared_y
        if shared_y is not None:
            y = y + shared_y.to(x.dtype)
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

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, local_experts=[{self.expert_start}, "
                f"{self.expert_start + self.local.num_experts}), top_k={self.top_k}, "
                f"scoring={self.scoring!r}, rank={self.rank}/{self.world_size}")
