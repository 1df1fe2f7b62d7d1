"""replica_check's digest on one process: exact tensor hashes and what the digest covers (the
all-gather and the errors on disagreeing ranks are test_expert_parallel.py's, on gloo)."""

from __future__ import annotations

import pytest
import torch
from test_expert_shards import Rank

from moe_gemm.layers.expert_parallel import ExpertParallelMoE
from moe_gemm.layers.moe import MoE
from moe_gemm.layers.replica_check import (
    DIGEST_SIZE,
    checks_replicas,
    replica_digest,
    tensor_hash,
    unchecked_digest,
)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64])
def test_tensor_hash_is_exact_and_positional(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    t = (torch.rand(3000, generator=g) * 200).to(dtype)
    assert tensor_hash(t) == tensor_hash(t.clone())  # equal bits, equal hashes
    assert tensor_hash(t.view(30, 100)) == tensor_hash(t)  # the shape is compared elsewhere
    changed = t.clone()
    changed[1234] = changed[1234] + 1
    assert tensor_hash(changed) != tensor_hash(t)
    swapped = t.clone()
    swapped[[0, 1]] = t[[1, 0]]
    if t[0] != t[1]:
        # the plain sum agrees, the position-weighted one does not
        assert tensor_hash(swapped)[0] == tensor_hash(t)[0]
        assert tensor_hash(swapped)[1] != tensor_hash(t)[1]
    assert tensor_hash(t[::2]) == tensor_hash(t[::2].contiguous())  # strided views too


def test_tensor_hash_sees_a_difference_past_the_first_chunk() -> None:
    t = torch.zeros((1 << 20) + 7, dtype=torch.float32)
    u = t.clone()
    u[-1] = 1.0
    assert tensor_hash(t) != tensor_hash(u)
    # -0.0 and 0.0 compare equal but are different bits: ranks holding them differ
    v = t.clone()
    v[5] = -0.0
    assert tensor_hash(v) != tensor_hash(t)


def _layer(seed: int = 0, **kw: object) -> ExpertParallelMoE:
    torch.manual_seed(seed)
    full = MoE(16, 8, 4, 2, shared_intermediate_size=8, dtype=torch.float32, **kw)  # type: ignore[arg-type]
    # one rank of one: no group, so the constructor's check does not run
    return ExpertParallelMoE.from_moe(full, dispatcher=Rank(0, 1))


def test_the_digest_has_its_declared_size_and_sees_each_replicated_part() -> None:
    layer = _layer()
    names, values = replica_digest(layer)
    assert values.shape == (DIGEST_SIZE,) and len(names) == DIGEST_SIZE
    assert values[0] == 0 and values[1] == 1  # not refused; checking
    unchecked = unchecked_digest()
    assert unchecked.shape == (DIGEST_SIZE,) and not unchecked.any()
    base = values.clone()

    def changed(mutate) -> set[str]:
        other = _layer()
        mutate(other)
        _, v = replica_digest(other)
        return {names[i] for i in range(DIGEST_SIZE) if v[i] != base[i]}

    with torch.no_grad():
        assert changed(lambda m: m.router_weight[0, 0].add_(1)) == {"router_weight"}
        assert changed(lambda m: m.local.shared_experts.up_proj.weight[1, 2].mul_(2)) == {
            "shared_experts.up_proj"}
    assert changed(lambda m: setattr(m, "top_k", 3)) == {"top_k"}
    assert changed(lambda m: setattr(m.local, "activation", "gelu")) == {"activation",
                                                                        "shared activation"}
    # static splits on some ranks only: every forward's split sizes disagree (gloo aborted)
    assert changed(lambda m: setattr(m.dispatcher, "static_splits", True)) == {"dispatcher"}
    assert changed(lambda m: setattr(m, "dispatcher", _OtherRank(0, 1))) == {"dispatcher"}
    assert changed(lambda m: None) == set()


class _OtherRank(Rank):
    """Another dispatcher class (another rank's DeepEP beside the all-to-all)."""


def test_differences_name_a_subgroups_global_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The ranks within the group alone: with groups [0, 2] and [1, 3], "ranks [0] vs [1]"
    # on global rank 3 named ranks 1 and 3 (a refused rank's message names both already).
    from moe_gemm.layers import dispatch, replica_check

    monkeypatch.setattr(dispatch.dist, "is_initialized", lambda: True)
    sub = object()
    monkeypatch.setattr(dispatch.dist, "get_global_rank", lambda g, r: 2 * r + 1)
    assert replica_check._groups([5, 7, 5], sub) == (
        "[0, 2] (global ranks [1, 5]) vs [1] (global ranks [3])")
    assert replica_check._groups([5, 7, 5]) == "[0, 2] vs [1]"  # (the default group)


def test_one_rank_or_no_group_is_not_checked() -> None:
    assert not checks_replicas(Rank(0, 1))
    assert not checks_replicas(Rank(0, 2))  # no `group` attribute: nothing to gather over
    _layer().check_replicated()  # a no-op here, not an error
