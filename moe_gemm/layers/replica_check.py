"""Every rank of an expert-parallel layer holding the same replicated parts, checked.

Each rank hashes its router, correction bias, shared experts and layer options exactly (the
bits of every element, position-weighted, in integer arithmetic, so summation order cannot
matter) into a digest of a few dozen integers, and one all-gather compares them: ranks that
disagree would otherwise route the same token to different experts or add different shared
outputs, silently. The same all-gather carries two flags, so that a rank whose constructor
refused its arguments, or ranks that disagree on checking at all, make every rank raise
instead of waiting in a collective until the group's timeout.
"""

from __future__ import annotations

import contextlib
import re
import struct
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moe_gemm.layers.dispatch import Dispatcher, rank_text
from moe_gemm.layers.expert_shards import ROUTING

if TYPE_CHECKING:
    from moe_gemm.layers.expert_parallel import ExpertParallelMoE

# The digest: a refused flag, a checking flag, the 3 sizes, the routing options, the experts'
# and the shared expert's activations, expert dtype and shapes, the dispatcher's class and
# static_splits, then per replicated tensor (router, bias, 3 shared projections, shared gate)
# its shape and dtype and two hashes (replica_digest). A rank that does not check sends the
# two flags alone (unchecked_digest).
DIGEST_SIZE = 2 + 3 + len(ROUTING) + 5 + 7 * 3


def agree_on_replicas(layer: ExpertParallelMoE, check: bool) -> None:
    """The replica check of `layer` (check=True), or its flags alone: the all-gather runs on
    every rank either way, so that a rank that checks never waits for one that does not (the
    group's timeout), and a disagreement is a ValueError on all."""
    if not checks_replicas(layer.dispatcher):
        return
    names, mine = replica_digest(layer) if check else ([], unchecked_digest())
    table = gather_digests(layer.dispatcher, mine)  # (W, DIGEST_SIZE)
    group = layer.dispatcher.group  # type: ignore[attr-defined]  (messages name its ranks)
    refused = [r for r in range(layer.world_size) if table[r, 0]]
    if refused:
        raise ValueError(
            f"ExpertParallelMoE: rank(s) {rank_text(group, refused)} could "
            f"not build the layer (their own error says why); rank {layer.rank} stops too "
            "instead of waiting for them")
    checking = table[:, 1].tolist()
    if len(set(checking)) > 1:
        on = [r for r, c in enumerate(checking) if c]
        off = [r for r, c in enumerate(checking) if not c]
        raise ValueError(
            "ExpertParallelMoE: the ranks disagree on check_replicated (True on ranks "
            f"{rank_text(group, on)}, False on ranks {rank_text(group, off)}); every rank "
            "must pass the same value")
    if not check:
        return
    differ: dict[str, str] = {}
    for i, name in enumerate(names):
        if name not in differ and bool((table[:, i] != table[0, i]).any()):
            # (most values are hashes: say which ranks agree with which)
            differ[name] = _groups(table[:, i].tolist(), group)
    if differ:
        what = "; ".join(f"{name} (ranks {ranks})" for name, ranks in list(differ.items())[:4])
        raise ValueError(
            "ExpertParallelMoE: the replicated parts differ between the ranks (each rank "
            f"must build the layer from the same full weights and options): {what}")


def checks_replicas(dispatcher: Dispatcher) -> bool:
    """Whether check_replicated can run: a group (the dispatcher's `group` attribute) of more
    than one rank, torch.distributed initialized."""
    return (dispatcher.world_size > 1 and hasattr(dispatcher, "group")
            and dist.is_available() and dist.is_initialized())


def gather_digests(dispatcher: Dispatcher, mine: torch.Tensor) -> torch.Tensor:
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
def refusing(dispatcher: Dispatcher) -> Iterator[None]:
    """Construction before the replica check: a rank whose construction fails (its own
    TypeError, ValueError or KeyError, e.g. a bad top_k or a missing checkpoint key, or any
    other error, such as a lazy checkpoint mapping's missing or corrupt file on this rank's
    disk) joins the check's all-gather with a digest flagged as refused, so that the other
    ranks raise ValueError too instead of waiting in it until the group's timeout (the
    all-gather runs whatever check_replicated says, so the others would wait there too, or in
    their first forward for a rank that has no layer). The rank's own error is raised as it
    was."""
    try:
        yield
    except Exception:
        if checks_replicas(dispatcher):
            flagged = torch.zeros(DIGEST_SIZE, dtype=torch.int64)
            flagged[0] = 1
            gather_digests(dispatcher, flagged)
        raise


_P = 2 ** 31 - 1  # the hashes' modulus: products of two residues stay below 2^62


def tensor_hash(t: torch.Tensor) -> tuple[int, int]:
    """Two exact hashes of a tensor's bits: their sum and a position-weighted sum, mod _P,
    in int64 arithmetic (order-independent, so equal on every rank for equal tensors)."""
    if t.is_meta:
        # A layer built on the meta device (to be materialized and loaded later, as MoE's
        # to_empty recipe) has no values to hash: its shape and dtype are still compared, and
        # check_replicated() after the load compares the values. Hashing read a meta tensor
        # (a RuntimeError from .item(), on every rank, so the layer could not be built there).
        return -2, -2
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


def replica_digest(layer: ExpertParallelMoE) -> tuple[list[str], torch.Tensor]:
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

    add("refused", 0)  # (1 only in the digest of a rank whose constructor refused: refusing)
    add("check_replicated", 1)  # (0 in the digest of a rank that does not check)
    for name in ("num_experts", "hidden_size", "intermediate_size", *ROUTING):
        add(name, getattr(layer, name))
    add("activation", _activation_key(m.activation))
    add("shared activation", None if m.shared_experts is None else _activation_key(
        m.shared_experts.activation))
    add("expert dtype", m.gate_up_proj.dtype)
    add("local experts' shapes", tuple(m.gate_up_proj.shape) + tuple(m.down_proj.shape))
    # (ranks whose dispatchers differ, static splits on some ranks only, disagree on every
    # forward's split sizes: gloo aborted the processes, NCCL waits)
    d = layer.dispatcher
    add("dispatcher", (f"{type(d).__module__}.{type(d).__qualname__}",
                       getattr(d, "static_splits", None)))
    tensors: dict[str, torch.Tensor | None] = {
        "router_weight": layer.router_weight,
        "e_score_correction_bias": layer.e_score_correction_bias,
        "tid2eid": layer._buffers.get("tid2eid"),
    }
    shared = m.shared_experts
    for part in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"shared_experts.{part}"] = None if shared is None else getattr(
            shared, part).weight
    tensors["shared_expert_gate"] = None if m.shared_expert_gate is None else (
        m.shared_expert_gate.weight)
    for name, t in tensors.items():
        add(f"{name} shape and dtype", None if t is None else (tuple(t.shape), t.dtype))
        h = (-1, -1) if t is None else tensor_hash(t)
        add(name, h[0])
        add(name, h[1])
    assert len(values) == DIGEST_SIZE
    # (a meta-device layer's digest on the CPU: a meta tensor cannot be gathered)
    device = layer.router_weight.device
    return names, torch.tensor(values, dtype=torch.int64,
                               device="cpu" if device.type == "meta" else device)


def _activation_key(act: object) -> object:
    """What the digest compares of an activation: its name, a function's qualified name, or
    another callable's repr without the memory addresses that default reprs hold
    ("<function silu at 0x7f...>" inside a functools.partial, "<Act object at 0x...>" of a
    callable instance): those differ between processes, and every rank saw the same
    activation as different ones (a ValueError on every rank at construction)."""
    if isinstance(act, str):
        return act
    name = getattr(act, "__qualname__", None)
    if isinstance(name, str):
        return name
    key = _ADDRESS.sub("", repr(act))
    if isinstance(act, torch.nn.Module):
        # A module activation's parameters and buffers (nn.PReLU's weight) are replicated
        # like the router: its repr alone let ranks with different values pass the check.
        return key, [(n, tensor_hash(t)) for n, t in act.state_dict().items()]
    return key


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def unchecked_digest() -> torch.Tensor:
    """The digest of a rank built with check_replicated=False: neither flag set, nothing
    hashed (the size of _replica_digest's: every rank gives the all-gather the same size)."""
    return torch.zeros(DIGEST_SIZE, dtype=torch.int64)


def _groups(values: list[int], group: object = None) -> str:
    """Ranks grouped by equal value: '[0, 2] vs [1]' (in a subgroup with the global ranks
    beside, as rank_text names them)."""
    by: dict[int, list[int]] = {}
    for rank, v in enumerate(values):
        by.setdefault(v, []).append(rank)
    return " vs ".join(rank_text(group, ranks) for ranks in by.values())


