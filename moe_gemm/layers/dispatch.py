"""Token dispatch and combine for expert parallelism: the interface and the all-to-all default.

Expert parallelism splits the E experts of a layer over the W ranks of a process group: rank r
holds experts [r * E/W, (r + 1) * E/W). After routing, every rank must send each of its tokens
to the ranks that hold one of the token's experts (dispatch), run its own experts on what it
received, and send the partial outputs back, where each token sums the partials of every rank
it visited (combine).

The data model is DeepEP's (deepseek-ai/DeepEP `Buffer.dispatch` / `Buffer.combine`), so its
kernels plug in behind the same interface (docs/DEPLOYING.md shows the adapter):
- a token goes to a rank at most once, whatever the number of its experts there (a top-8 token
  with three experts on one rank crosses the link once, not three times);
- the receiving rank gets, per token, all k slots with the *local* expert id of each slot on
  this rank and -1 for slots whose expert lives elsewhere, and the routing weight of each slot;
  it returns one row per received token: the weighted sum over its local experts;
- combine sums, for every original token, the rows that came back from the ranks it visited.

`AllToAllDispatcher` implements this on `torch.distributed.all_to_all_single` (NCCL on GPUs,
gloo on CPUs). Send counts are exchanged on the device with one all-to-all of W integers; the
variable-size token all-to-all then needs those counts as host lists, which costs one host read
of 2 * W + 1 integers per forward; the same exchange carries each rank's token shape, dtype and
static_splits (7 integers a rank, read with them), so ranks whose tokens cannot travel together
or whose dispatchers disagree on static_splits, or a rank that refused its input (`refuse`),
make every rank raise ValueError instead of aborting gloo or waiting in the token all-to-all.
`static_splits=True` removes that read: every rank sends a fixed T rows to every rank (a token
visits a rank at most once, so T always suffices), padding rows carrying no valid slot, at W
times the link traffic; that path never waits for the host and can be captured in a CUDA graph.
Every rank must then pass the same number of tokens T (pad to it; a rank with no tokens pads
too): a ValueError on the CPU, the caller's to ensure on GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from moe_gemm.layers.routing import check_flag
from moe_gemm.ops.combine import combine_rows

__all__ = ["AllToAllDispatcher", "Dispatched", "Dispatcher", "expert_range"]


def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the experts rank `rank` holds when E experts are split over W ranks.

    Raises:
        ValueError: E not a positive multiple of W, or rank outside [0, W).
    """
    if world_size < 1 or num_experts < 1 or num_experts % world_size:
        raise ValueError(
            f"expert parallelism splits the experts evenly: num_experts={num_experts} must be "
            f"a positive multiple of the group size {world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}); got {rank}")
    per = num_experts // world_size
    return rank * per, (rank + 1) * per


@dataclass
class Dispatched:
    """What one rank received for its local experts.

    Attributes:
        x: [R, H] the received tokens, in the activation dtype.
        local_ids: [R, k] int64 local expert id of each slot on this rank, -1 where the slot's
            expert lives on another rank (and on padding rows).
        weights: [R, k] float32 routing weight of each slot (0 where local_ids is -1).
        num_valid_slots: slots with a local expert, when known on the host without a sync
            (the expert GEMMs then gather only those rows); None = unknown.
        handle: opaque state `combine` needs (layouts, split sizes).
    """

    x: torch.Tensor  # (R, H)
    local_ids: torch.Tensor  # (R, k)
    weights: torch.Tensor  # (R, k)
    num_valid_slots: int | None
    handle: Any


@runtime_checkable
class Dispatcher(Protocol):
    """Moves tokens to the ranks holding their experts and the expert outputs back.

    Implementations must be called by every rank of the group for every forward (they run
    collectives), including ranks with no tokens. Optionally, `refuse(device)` joins a
    dispatch's collectives for a rank whose input is refused, so that the others raise rather
    than wait (ExpertParallelMoE calls it when it has one; AllToAllDispatcher does).

    Attributes:
        rank: this rank's index in the expert-parallel group.
        world_size: the group's size W (rank r holds experts expert_range(E, r, W)).
    """

    rank: int
    world_size: int

    def dispatch(
        self,
        x: torch.Tensor,  # (T, H)
        topk_ids: torch.Tensor,  # (T, k) global expert ids
        topk_weights: torch.Tensor,  # (T, k)
        num_experts: int,
        *,
        during: Callable[[], Any] | None = None,
    ) -> tuple[Dispatched, Any]:
        """Send every token once to each rank holding one of its experts.

        `during` is work to run while the tokens are in flight (e.g. the shared experts); its
        result is returned second.
        """
        ...

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        """[R, H] per-received-token partial outputs -> [T, H] summed per original token."""
        ...


# What each rank tells every receiver before its tokens move, one int64 each: a mismatch
# would make the all-to-all itself fail (gloo aborts the process on a size mismatch, NCCL
# reads garbage or waits), so dispatch raises ValueError on every rank instead. A rank with
# static splits sends T rows to every rank where the others expect their exact counts.
_SIGNATURE = ("static_splits", "tokens", "hidden size", "top_k", "num_experts", "dtype",
              "refused")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def rank_text(group: Any, ranks: list[int]) -> str:
    """Ranks of a process group as messages name them: "[1]", and where the group numbers them
    otherwise than the whole world (a subgroup), their global ranks beside ("[1] (global
    ranks [2])"): a user reading one process's log knows it by its global rank."""
    try:
        glob = [dist.get_global_rank(group, r) for r in ranks] if (
            group is not None and dist.is_initialized()) else ranks
    except (RuntimeError, ValueError):  # (not a group this process belongs to)
        glob = ranks
    return f"{ranks}" if glob == ranks else f"{ranks} (global ranks {glob})"


def _check_senders(sigs: list[list[int]], rank: int, *, same_tokens: bool,
                   group: Any = None) -> None:
    """Raise ValueError (on every rank alike: each sees every sender's signature) when a rank
    refused its input or the ranks' token shapes, dtypes or static_splits differ."""
    refused = [r for r, s in enumerate(sigs) if s[-1]]
    if refused:
        raise ValueError(f"rank(s) {rank_text(group, refused)} refused their input to this "
                         "forward (their own "
                         f"error says why); rank {rank} stops too instead of waiting for them")
    names = ["float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2",
             "another dtype"]
    for i, name in enumerate(_SIGNATURE[:-1]):
        if name == "tokens" and not same_tokens:
            continue  # (token counts may differ unless the splits are static)
        values = [s[i] for s in sigs]
        if len(set(values)) > 1:
            if name == "static_splits":
                values = [bool(v) for v in values]
                hint = "every rank's dispatcher must take the same static_splits"
            elif name == "tokens":
                hint = ("static_splits needs the same token count on every rank (pad the "
                        "tokens to it)")
            else:
                if name == "dtype":
                    values = [names[v] for v in values]
                hint = "every rank must send tokens of one shape and dtype through one layer"
            raise ValueError(f"{hint}; the ranks' {name}: {values}")


@dataclass
class _Handle:
    T: int
    send_rows: int  # rows this rank sent (static: W * T)
    pos_of_pair: torch.Tensor  # (T, W) row of each (token, rank) pair in the send order
    send_splits: list[int] | None  # None: static splits
    recv_splits: list[int] | None


class AllToAllDispatcher:
    """The default Dispatcher, on torch.distributed all-to-all.

    Args:
        group: the expert-parallel process group (None = the default group).
        static_splits: send T rows to every rank (no host read of the counts, graph
            capturable, W times the traffic) instead of exactly the rows each rank needs.
            Every rank must pass the same T (pad the tokens to it).

    Raises:
        RuntimeError: torch.distributed not initialized.
        ValueError: this process is not a member of `group`.
        TypeError: static_splits not a bool.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, static_splits: bool = False):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "expert parallelism needs torch.distributed initialized "
                "(torch.distributed.init_process_group) before the dispatcher is built"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:  # (get_rank and get_world_size return -1 outside the group)
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the "
                "expert-parallel group: build the dispatcher on the group's ranks only"
            )
        self.world_size = dist.get_world_size(group)
        # (a string such as "no" would be truthy: static splits where they were declined)
        self.static_splits = check_flag("static_splits", static_splits)

    def __repr__(self) -> str:
        return (f"AllToAllDispatcher(rank={self.rank}, world_size={self.world_size}, "
                f"static_splits={self.static_splits})")

    # -- dispatch ------------------------------------------------------------------------

    def dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        num_experts: int,
        *,
        during: Callable[[], Any] | None = None,
    ) -> tuple[Dispatched, Any]:
        W, group = self.world_size, self.group
        T, k = topk_ids.shape
        H = x.shape[1]
        device = x.device
        per = expert_range(num_experts, 0, W)[1]
        ids = topk_ids.long()
        valid = (ids >= 0) & (ids < num_experts)
        dest = torch.where(valid, torch.div(ids, per, rounding_mode="floor"), W)  # (T, k)
        ranks = torch.arange(W, device=device)
        hits = dest.unsqueeze(2) == ranks.view(1, 1, W)  # (T, k, W)
        is_sent = hits.any(dim=1)  # (T, W): token t visits rank r (one row, however many
        slot_counts = hits.sum(dim=(0, 1))  # (W,)   of its experts live there)
        # Send order: rank-major, token-minor; a stable sort of the (rank, token) pairs on the
        # device (no host sync). Pair q = r * T + t; rows past the live ones are never sent.
        key = torch.where(is_sent.t(), ranks.view(W, 1), W).reshape(-1)  # (W*T,)
        sorted_key, pair_order = torch.sort(key, stable=True)
        ends = torch.searchsorted(sorted_key, ranks, right=True)
        send_counts = torch.diff(ends, prepend=ends.new_zeros(1))  # (W,)
        tok = pair_order % max(T, 1)  # token of each send-order row
        pos = torch.empty_like(pair_order).scatter_(
            0, pair_order, torch.arange(W * T, device=device)
        )  # (W*T,) send-order row of each pair
        # Per send row: the k slots' local ids (-1 elsewhere) and weights, packed as float32
        # (ids < 2^24 are exact) so that one all-to-all carries both.
        row_dest = sorted_key.clamp(max=W - 1).unsqueeze(1)  # (W*T, 1)
        here = dest.index_select(0, tok) == row_dest  # (W*T, k)
        local = torch.where(here, ids.index_select(0, tok) - row_dest * per, -1)
        wts = torch.where(here, topk_weights.index_select(0, tok).float(), 0.0)
        meta = torch.cat([local.float(), wts], dim=1)  # (W*T, 2k)
        # Counts on the device: (tokens, slots) each rank sends to each rank, then what the
        # receivers check before any token moves (_SIGNATURE). Filled, not copied from the
        # host, so that a CUDA graph can capture it.
        sig = (int(self.static_splits), T, H, k, num_experts, _dtype_code(x.dtype), 0)
        counts = torch.stack([send_counts, slot_counts,
                              *(send_counts.new_full((W,), v) for v in sig)], dim=1)
        counts_recv = torch.empty_like(counts)  # (W, 2 + len(_SIGNATURE))
        dist.all_to_all_single(counts_recv, counts, group=group)
        if self.static_splits:
            if device.type == "cpu":
                # Every rank sends T rows to every rank, so every rank's T must be the same
                # (else gloo aborts the process). Read where it costs no sync: on a GPU this
                # is the host read static splits avoid, and the caller must ensure it.
                _check_senders(counts_recv[:, 2:].tolist(), self.rank, same_tokens=True,
                               group=group)
            # Row r*T + j of the send buffer is the j-th token sent to rank r; the rest of
            # each block is padding whose slots all say -1 (the receiver computes nothing
            # for them). Rows that are not sent land in a scratch row past the buffer.
            start = ends - send_counts
            rank_of_pair = torch.arange(W * T, device=device) // max(T, 1)
            pos = rank_of_pair * T + (pos - start[rank_of_pair])
            live = sorted_key < W
            dst = torch.where(live, pos.index_select(0, pair_order), W * T)
            send_x = x.new_zeros(W * T + 1, H)
            send_x.index_copy_(0, dst, x.index_select(0, tok))
            send_meta = torch.cat([meta.new_full((W * T + 1, k), -1.0),
                                   meta.new_zeros(W * T + 1, k)], dim=1)
            send_meta.index_copy_(0, dst, meta)
            send_x, send_meta = send_x[: W * T], send_meta[: W * T]
            send_splits = recv_splits = None
            send_rows = recv_rows = W * T
            num_valid = None
        else:
            # The one host read of the forward: 2W + 1 integers for the split sizes and the
            # senders' signatures, checked before the tokens move (a mismatch would abort
            # gloo or hang NCCL in the all-to-all below).
            host = torch.cat([send_counts, counts_recv[:, 0], counts_recv[:, 1].sum()[None],
                              counts_recv[:, 2:].reshape(-1)]).tolist()
            send_splits, recv_splits, num_valid = host[:W], host[W:2 * W], host[2 * W]
            n = len(_SIGNATURE)
            _check_senders([host[2 * W + 1 + r * n:2 * W + 1 + (r + 1) * n] for r in range(W)],
                           self.rank, same_tokens=False, group=group)
            send_rows, recv_rows = sum(send_splits), sum(recv_splits)
            send_x = x.index_select(0, tok[:send_rows])
            send_meta = meta[:send_rows]
        recv_x = x.new_empty(recv_rows, H)
        recv_meta = meta.new_empty(recv_rows, 2 * k)
        works = [
            dist.all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=group,
                                   async_op=True),
            dist.all_to_all_single(recv_meta, send_meta.contiguous(), recv_splits, send_splits,
                                   group=group, async_op=True),
        ]
        extra = during() if during is not None else None
        for work in works:
            work.wait()
        pos_of_pair = torch.where(is_sent, pos.view(W, T).t(), send_rows)  # (T, W)
        handle = _Handle(T, send_rows, pos_of_pair, send_splits, recv_splits)
        dispatched = Dispatched(recv_x, recv_meta[:, :k].long(), recv_meta[:, k:].contiguous(),
                                num_valid, handle)
        return dispatched, extra

    def refuse(self, device: torch.device | str) -> None:
        """Join a forward's first collective (the count exchange of `dispatch`) flagged as
        refused, for a rank whose input cannot be dispatched; the caller then raises its own
        error. The other ranks' `dispatch` raises ValueError instead of waiting for tokens
        that never come (except with static_splits on a GPU, which reads no counts on the
        host: there every rank must pass valid input).
        """
        W = self.world_size
        counts = torch.zeros(W, 2 + len(_SIGNATURE), dtype=torch.int64, device=device)
        counts[:, 1 + len(_SIGNATURE)] = 1  # the status column
        dist.all_to_all_single(torch.empty_like(counts), counts, group=self.group)

    # -- combine -------------------------------------------------------------------------

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        if not isinstance(handle, _Handle):
            raise TypeError("combine takes the handle its own dispatch returned")
        H = y.shape[1]
        back = y.new_empty(handle.send_rows + 1, H)
        back[handle.send_rows:].zero_()  # the row unsent (token, rank) pairs read
        dist.all_to_all_single(back[: handle.send_rows], y.contiguous(), handle.send_splits,
                               handle.recv_splits, group=self.group)
        # Sum over the ranks each token visited: deterministic (no atomics), one read of back.
        return combine_rows(back, handle.pos_of_pair)
