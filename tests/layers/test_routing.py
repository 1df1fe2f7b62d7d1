"""moe_gemm.routing: the routers against per-token Python references, and the permutation.

The references here are written differently from the vectorised code on purpose (plain loops
over tokens and groups, float64), so a shared mistake cannot pass both.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_gemm.layers.routing import (
    hash_topk,
    permute_by_expert,
    route_tokens,
    router_logits_fp32,
    sigmoid_grouped_topk,
    softmax_grouped_topk,
    softmax_topk,
    sqrtsoftplus_grouped_topk,
)


def _softmax_topk_ref(logits: torch.Tensor, k: int, renormalize: bool) -> list[dict[int, float]]:
    """Per token: {expert: weight} in float64."""
    out = []
    for row in logits.double().tolist():
        m = max(row)
        ex = [math.exp(v - m) for v in row]
        s = sum(ex)
        probs = [v / s for v in ex]
        top = sorted(range(len(row)), key=lambda e: -probs[e])[:k]
        w = {e: probs[e] for e in top}
        if renormalize:
            tot = sum(w.values())
            w = {e: v / tot for e, v in w.items()}
        out.append(w)
    return out


def _score_ref(row: list[float], scoring: str) -> list[float]:
    """One token's float64 scores."""
    if scoring == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) for v in row]
    if scoring == "sqrtsoftplus":
        return [math.sqrt(math.log1p(math.exp(v))) for v in row]
    m = max(row)
    ex = [math.exp(v - m) for v in row]
    return [v / sum(ex) for v in ex]


def _sigmoid_grouped_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    n_group: int,
    topk_group: int,
    scale: float,
    renormalize: bool,
    scoring: str = "sigmoid",
) -> list[dict[int, float]]:
    E = logits.shape[1]
    per = E // n_group
    b = [0.0] * E if bias is None else bias.double().tolist()
    out = []
    for row in logits.double().tolist():
        scores = _score_ref(row, scoring)
        choice = [s + bb for s, bb in zip(scores, b)]
        groups = []
        for g in range(n_group):
            members = sorted(choice[g * per:(g + 1) * per], reverse=True)
            groups.append((sum(members[:2]) if per >= 2 else members[0], g))
        kept = {g for _, g in sorted(groups, reverse=True)[:topk_group]}
        eligible = [e for e in range(E) if e // per in kept]
        top = sorted(eligible, key=lambda e: -choice[e])[:k]
        w = {e: scores[e] for e in top}
        if renormalize:
            tot = sum(w.values()) + 1e-20
            w = {e: v / tot for e, v in w.items()}
        out.append({e: v * scale for e, v in w.items()})
    return out


def _as_dicts(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [
        dict(zip(i, w)) for i, w in zip(ids.tolist(), weights.double().tolist())
    ]


def _assert_routing_equal(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), f"token {t}: experts {sorted(g)} != {sorted(w)}"
        for e in w:
            assert g[e] == pytest.approx(w[e], rel=1e-6, abs=1e-7), f"token {t} expert {e}"


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T,E,k", [(1, 4, 1), (9, 8, 2), (33, 16, 5), (5, 6, 6)])
def test_softmax_topk_matches_reference(T: int, E: int, k: int, renormalize: bool) -> None:
    logits = torch.randn(T, E) * 2
    weights, ids = softmax_topk(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (T, k)
    _assert_routing_equal(_as_dicts(weights, ids), _softmax_topk_ref(logits, k, renormalize))
    # best expert first, as torch.topk(sorted=True) and transformers
    assert bool((weights[:, :-1] >= weights[:, 1:]).all())
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T), rtol=0, atol=1e-6)


def test_softmax_topk_upcasts_low_precision_logits() -> None:
    logits = (torch.randn(17, 8) * 3).to(torch.bfloat16)
    weights, ids = softmax_topk(logits, 3, True)
    assert weights.dtype == torch.float32
    _assert_routing_equal(_as_dicts(weights, ids), _softmax_topk_ref(logits.float(), 3, True))


@pytest.mark.parametrize(
    "E,k,n_group,topk_group,scale,renormalize,use_bias",
    [
        (8, 2, 1, 1, 1.0, True, False),
        (16, 4, 4, 2, 2.5, True, True),
        (16, 3, 8, 3, 1.0, False, True),
        (32, 8, 8, 4, 2.5, True, True),  # DeepSeek-V3's ratios, scaled down
        (12, 6, 3, 3, 1.5, True, True),  # topk_group == n_group keeps every group
        (6, 6, 1, 1, 1.0, True, True),  # k = E
    ],
)
def test_sigmoid_grouped_topk_matches_reference(
    E: int, k: int, n_group: int, topk_group: int, scale: float, renormalize: bool, use_bias: bool
) -> None:
    T = 23
    logits = torch.randn(T, E) * 2
    bias = torch.randn(E) * 0.5 if use_bias else None
    weights, ids = sigmoid_grouped_topk(logits, bias, k, n_group, topk_group, scale, renormalize)
    assert weights.shape == ids.shape == (T, k)
    assert weights.dtype == torch.float32
    want = _sigmoid_grouped_ref(logits, bias, k, n_group, topk_group, scale, renormalize)
    _assert_routing_equal(_as_dicts(weights, ids), want)
    if use_bias:
        # the bias changes the choice but never the weights' values: weights are the plain
        # sigmoid scores of the chosen experts (before renormalising)
        raw = torch.sigmoid(logits).gather(1, ids)
        if renormalize:
            raw = raw / (raw.sum(-1, keepdim=True) + 1e-20)
        torch.testing.assert_close(weights, raw * scale, rtol=1e-6, atol=1e-7)


def test_sigmoid_bias_changes_selection_only() -> None:
    logits = torch.randn(64, 8)
    bias = torch.zeros(8)
    bias[3] = 10.0  # expert 3 is chosen by everyone, whatever its score
    weights, ids = sigmoid_grouped_topk(logits, bias, 2, renormalize=False)
    assert bool((ids == 3).any(dim=1).all())
    chosen = torch.sigmoid(logits).gather(1, ids)
    torch.testing.assert_close(weights, chosen, rtol=0, atol=0)


def test_group_limit_excludes_groups() -> None:
    # group 0 (experts 0-3) scores highest by far; with topk_group=1 only it is eligible, even
    # for k=4 where expert 7 alone would beat some of its members.
    logits = torch.full((1, 8), -5.0)
    logits[0, :4] = torch.tensor([3.0, 2.9, -4.0, -4.5])
    logits[0, 7] = 2.0
    _, ids = sigmoid_grouped_topk(logits, None, 4, n_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3]
    _, ids = sigmoid_grouped_topk(logits, None, 4, n_group=2, topk_group=2)
    assert 7 in ids[0].tolist()


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        ({"k": 0}, ValueError, r"k \(experts per token\) must be in \[1, E=16\]"),
        ({"k": 17}, ValueError, r"must be in \[1, E=16\]"),
        ({"k": 2.0}, TypeError, "must be an int"),
        ({"n_group": 3}, ValueError, "n_group must be >= 1 and divide E=16"),
        ({"n_group": 4, "topk_group": 5}, ValueError, r"topk_group must be in \[1, n_group=4\]"),
        ({"n_group": 16, "topk_group": 2}, ValueError, "E / n_group must be >= 2"),
        ({"n_group": 4, "topk_group": 1, "k": 5}, ValueError, "cannot be chosen from"),
        ({"bias": torch.zeros(15)}, ValueError, r"bias must be \(E,\) = \(16,\)"),
        ({"bias": [0.0] * 16}, TypeError, "bias must be a torch.Tensor"),
        ({"routed_scaling_factor": "2"}, TypeError, "routed_scaling_factor must be a float"),
        ({"routed_scaling_factor": True}, TypeError, "routed_scaling_factor must be a float"),
        ({"routed_scaling_factor": float("nan")}, ValueError,
         "routed_scaling_factor must be finite; got nan"),
        ({"routed_scaling_factor": float("-inf")}, ValueError, "must be finite"),
        ({"renormalize": "no"}, TypeError, "renormalize must be a bool; got 'no'"),
        ({"n_group": "4"}, TypeError, "n_group must be an int"),
        ({"topk_group": 1.0}, TypeError, "topk_group must be an int"),
        ({"n_group": 0}, ValueError, "n_group must be >= 1"),
        ({"n_group": 4, "topk_group": 0}, ValueError, r"topk_group must be in \[1, n_group=4\]"),
        ({"k": "2"}, TypeError, r"k \(experts per token\) must be an int"),
        ({"bias": torch.zeros(16, dtype=torch.long)}, TypeError, "bias must be a float tensor"),
    ],
)
def test_sigmoid_grouped_topk_rejects_bad_settings(
    kwargs: dict, exc: type[Exception], pattern: str
) -> None:
    args = {"bias": None, "k": 2, "n_group": 1, "topk_group": 1}
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        sigmoid_grouped_topk(torch.randn(3, 16), **args)


def _softmax_grouped_ref(logits: torch.Tensor, k: int, n_group: int, topk_group: int,
                         scale: float, renormalize: bool) -> list[dict[int, float]]:
    """Mistral 4's router per token in float64: softmax, group score = sum of the group's two
    best, the topk_group best groups eligible, the k best of them, renormalised (+1e-20),
    scaled."""
    E = logits.shape[1]
    per = E // n_group
    out = []
    for row in logits.double().tolist():
        m = max(row)
        ex = [math.exp(v - m) for v in row]
        probs = [v / sum(ex) for v in ex]
        groups = sorted(((sum(sorted(probs[g * per:(g + 1) * per], reverse=True)[:2]), g)
                         for g in range(n_group)), reverse=True)
        kept = {g for _, g in groups[:topk_group]}
        top = sorted((e for e in range(E) if e // per in kept), key=lambda e: -probs[e])[:k]
        w = {e: probs[e] for e in top}
        if renormalize:
            tot = sum(w.values()) + 1e-20
            w = {e: v / tot for e, v in w.items()}
        out.append({e: v * scale for e, v in w.items()})
    return out


@pytest.mark.parametrize(
    "E,k,n_group,topk_group,scale,renormalize",
    [
        (16, 4, 4, 2, 2.5, True),
        (16, 3, 8, 3, 1.0, False),
        (32, 8, 8, 4, 1.5, True),
        (12, 6, 3, 3, 1.5, True),  # topk_group == n_group keeps every group
        (8, 2, 1, 1, 0.5, False),  # one group: softmax_topk times the factor
        (6, 6, 1, 1, 1.0, True),  # k = E
    ],
)
def test_softmax_grouped_topk_matches_reference(E, k, n_group, topk_group, scale,
                                                renormalize) -> None:
    T = 23
    logits = torch.randn(T, E) * 2
    weights, ids = softmax_grouped_topk(logits, k, n_group, topk_group, scale, renormalize)
    assert weights.shape == ids.shape == (T, k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    want = _softmax_grouped_ref(logits, k, n_group, topk_group, scale, renormalize)
    _assert_routing_equal(_as_dicts(weights, ids), want)
    # route_tokens takes the same path for softmax scoring with these options
    x, w = torch.randn(T, 8), torch.randn(E, 8)
    got = route_tokens(x, w, k, "softmax", renormalize, n_group, topk_group, scale, None, False)
    want = _softmax_grouped_ref(x @ w.t(), k, n_group, topk_group, scale, renormalize)
    _assert_routing_equal(_as_dicts(*got), want)


def test_softmax_group_limit_excludes_groups() -> None:
    # group 0 (experts 0-3) has the two best scores; with topk_group=1 only it is eligible,
    # even for k=4 where expert 7 alone beats two of its members.
    logits = torch.full((1, 8), -5.0)
    logits[0, :4] = torch.tensor([3.0, 2.9, -4.0, -4.5])
    logits[0, 7] = 2.0
    _, ids = softmax_grouped_topk(logits, 4, n_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3]
    _, ids = softmax_grouped_topk(logits, 4, n_group=2, topk_group=2)
    assert 7 in ids[0].tolist()


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        ({"k": 0}, ValueError, r"k \(experts per token\) must be in \[1, E=16\]"),
        ({"k": 17}, ValueError, r"must be in \[1, E=16\]"),
        ({"n_group": 3}, ValueError, "n_group must be >= 1 and divide E=16"),
        ({"n_group": 4, "topk_group": 5}, ValueError, r"topk_group must be in \[1, n_group=4\]"),
        ({"n_group": 16, "topk_group": 2}, ValueError, "E / n_group must be >= 2"),
        ({"n_group": 4, "topk_group": 1, "k": 5}, ValueError, "cannot be chosen from"),
        ({"routed_scaling_factor": "2"}, TypeError, "routed_scaling_factor must be a float"),
        ({"routed_scaling_factor": float("nan")}, ValueError, "must be finite; got nan"),
        ({"renormalize": "no"}, TypeError, "renormalize must be a bool; got 'no'"),
        ({"n_group": 4.0}, TypeError, "n_group must be an int"),
        ({"n_group": 4, "topk_group": 0}, ValueError, r"topk_group must be in \[1, n_group=4\]"),
    ],
)
def test_softmax_grouped_topk_rejects_bad_settings(kwargs, exc, pattern) -> None:
    args = {"k": 2, "n_group": 1, "topk_group": 1}
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        softmax_grouped_topk(torch.randn(3, 16), **args)


def test_softmax_routing_refuses_a_correction_bias() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with pytest.raises(ValueError, match="correction bias.*scoring='sigmoid' or 'sqrtsoftplus' only"):
        route_tokens(x, w, 2, "softmax", True, 2, 1, 1.0, torch.zeros(8), False)


@pytest.mark.parametrize(
    "logits,exc,pattern",
    [
        (torch.randn(3, 4, 2), ValueError, r"logits must be 2-D \(T, E\)"),
        (torch.randint(0, 3, (3, 4)), TypeError, "floating-point"),
        ([[1.0, 2.0]], TypeError, "logits must be a torch.Tensor"),
    ],
)
def test_routers_reject_bad_logits(logits: object, exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        softmax_topk(logits, 1)  # type: ignore[arg-type]
    with pytest.raises(exc, match=pattern):
        sigmoid_grouped_topk(logits, None, 1)  # type: ignore[arg-type]
    with pytest.raises(exc, match=pattern):
        softmax_grouped_topk(logits, 1, 2, 1)  # type: ignore[arg-type]


def test_routers_handle_zero_tokens() -> None:
    w, i = softmax_topk(torch.randn(0, 8), 2)
    assert w.shape == i.shape == (0, 2)
    w, i = sigmoid_grouped_topk(torch.randn(0, 8), torch.zeros(8), 2, 4, 2)
    assert w.shape == i.shape == (0, 2)
    w, i = softmax_grouped_topk(torch.randn(0, 8), 2, 4, 2, 2.5)
    assert w.shape == i.shape == (0, 2)


# ---------------------------------------------------------------------------------------------
# permute_by_expert


def _check_permutation(ids: torch.Tensor, E: int) -> None:
    T, k = ids.shape
    p = permute_by_expert(ids, E)
    S = T * k
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < E)
    counts = torch.bincount(flat[valid], minlength=E)
    assert p.offs.dtype == torch.int32 and p.offs.shape == (E,)
    assert p.offs.tolist() == torch.cumsum(counts, 0).tolist()
    assert p.counts().tolist() == counts.tolist()
    assert p.valid.shape == (T, k) and p.valid.reshape(-1).tolist() == valid.tolist()
    assert sorted(p.slot_order.tolist()) == list(range(S))  # a permutation
    # rows are grouped by expert, dropped slots last, each group in (token, slot) order
    assert p.sorted_expert.tolist() == flat.where(valid, E)[p.slot_order].tolist()
    assert p.sorted_expert.tolist() == sorted(p.sorted_expert.tolist())
    start = 0
    bounds = p.offs.tolist() + [S]
    for end in bounds:
        group = p.slot_order[start:end].tolist()
        assert group == sorted(group), "stable sort keeps slots of one expert in order"
        start = end
    assert p.token_index.tolist() == [s // k for s in p.slot_order.tolist()]
    # row_of_slot inverts slot_order
    assert p.row_of_slot.shape == (T, k)
    assert p.slot_order[p.row_of_slot.reshape(-1)].tolist() == list(range(S))


@pytest.mark.parametrize(
    "T,k,E", [(1, 1, 1), (1, 4, 4), (7, 2, 8), (64, 8, 16), (100, 3, 257), (0, 2, 4)]
)
def test_permutation_random(T: int, k: int, E: int) -> None:
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    _check_permutation(ids.long(), E)


@pytest.mark.parametrize("T,k,E", [(1, 1, 1), (7, 2, 8), (64, 8, 16), (100, 3, 257), (0, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_permutation_of_ids_in_range_is_the_same(T: int, k: int, E: int, dtype) -> None:
    # A router's own ids: the mask of dropped slots is skipped, nothing else changes.
    g = torch.Generator().manual_seed(T * 1000 + E)
    ids = (torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T
           else torch.zeros(0, k)).to(dtype)
    checked, trusted = permute_by_expert(ids, E), permute_by_expert(ids, E, ids_in_range=True)
    assert not checked.all_valid and trusted.all_valid
    for name in ("token_index", "slot_order", "row_of_slot", "sorted_expert", "offs", "valid"):
        a, b = getattr(checked, name), getattr(trusted, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    w = torch.rand(T, k, generator=g)
    assert trusted.drop_masked(w) is w and torch.equal(checked.drop_masked(w), w)


def test_permutation_skewed_with_empty_experts() -> None:
    ids = torch.tensor([[5, 2], [5, 1], [2, 5], [5, 2]])  # experts 0, 3, 4, 6, 7 get nothing
    _check_permutation(ids, 8)
    p = permute_by_expert(ids, 8)
    assert p.offs.tolist() == [0, 1, 4, 4, 4, 8, 8, 8]


def test_permutation_drops_out_of_range_ids() -> None:
    # expert-parallel sentinels (>= E) and -1 padding belong to no local expert
    ids = torch.tensor([[0, 4], [-1, 1], [3, 9]], dtype=torch.int32)
    _check_permutation(ids, 4)
    p = permute_by_expert(ids, 4)
    assert p.offs.tolist() == [1, 2, 2, 3]
    assert p.valid.tolist() == [[True, False], [False, True], [True, False]]
    w = torch.full((3, 2), 0.5)
    assert p.drop_masked(w).tolist() == [[0.5, 0.0], [0.0, 0.5], [0.5, 0.0]]
    assert p.sorted_expert[-3:].tolist() == [4, 4, 4]


def test_permutation_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"topk_ids must be 2-D \(T, k\)"):
        permute_by_expert(torch.zeros(4, dtype=torch.long), 4)
    with pytest.raises(TypeError, match="integer tensor"):
        permute_by_expert(torch.zeros(2, 2), 4)
    with pytest.raises(TypeError, match="topk_ids must be a torch.Tensor"):
        permute_by_expert([[0, 1]], 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_experts must be an int >= 1"):
        permute_by_expert(torch.zeros(2, 2, dtype=torch.long), 0)
    # a wrong type is a TypeError, as for the other routing arguments (was a ValueError)
    for bad in (4.0, True, "4"):
        with pytest.raises(TypeError, match="num_experts must be an int >= 1"):
            permute_by_expert(torch.zeros(2, 2, dtype=torch.long), bad)  # type: ignore[arg-type]


def test_permutation_refuses_sparse_and_nested_ids() -> None:
    # A sparse topk_ids failed inside torch's reshape (RuntimeError), a nested one when its
    # shape was read: a TypeError naming the argument, as every other op's dense check.
    ids = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(TypeError, match=r"topk_ids must be a dense \(strided\) tensor; got "
                                        r"layout torch.sparse_coo"):
        permute_by_expert(ids.to_sparse(), 4)
    nested = torch.nested.nested_tensor([ids[0], ids[1, :1]], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"topk_ids must be a dense \(strided\) tensor; got "
                                        r"a nested tensor"):
        permute_by_expert(nested, 4)


def test_permutation_ids_in_range_must_be_a_bool() -> None:
    # "no" was truthy: the out-of-range ids vouched for, every slot marked valid (and
    # all_valid='no'), the wrong results the flag's docstring warns of.
    ids = torch.tensor([[0, -1], [3, 1], [4, 2]])
    with pytest.raises(TypeError, match="ids_in_range must be a bool; got 'no'"):
        permute_by_expert(ids, 4, ids_in_range="no")  # type: ignore[arg-type]
    p = permute_by_expert(ids, 4, ids_in_range=0)  # type: ignore[arg-type]
    assert p.valid.tolist() == [[True, False], [True, True], [False, True]]
    assert p.all_valid is False


def test_router_scalars_that_stay_valid() -> None:
    logits = torch.randn(5, 8)
    w_int, i_int = sigmoid_grouped_topk(logits, None, 2, 1, 1, 2)  # an int factor is a float
    w, i = sigmoid_grouped_topk(logits, None, 2, 1, 1, 2.0)
    torch.testing.assert_close(w_int, w, rtol=0, atol=0)
    assert torch.equal(i_int, i)
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        softmax_topk(logits, 2, "yes")  # type: ignore[arg-type]
    torch.testing.assert_close(softmax_topk(logits, 2, 0)[0], softmax_topk(logits, 2, False)[0])


@pytest.mark.parametrize("E,dtype", [(1, torch.uint8), (255, torch.uint8), (256, torch.int16),
                                     (32767, torch.int16), (32768, torch.int32)])
def test_sort_key_is_the_narrowest_dtype_holding_the_dropped_id(E: int, dtype) -> None:
    from moe_gemm.layers.routing import _sort_key_dtype

    assert _sort_key_dtype(E) == dtype
    assert torch.iinfo(dtype).max >= E  # E itself is the key of a dropped slot


def test_permutation_with_many_experts_uses_a_wider_key() -> None:
    ids = torch.randint(-1, 40002, (40, 3))
    _check_permutation(ids, 40000)
    _check_permutation(torch.randint(0, 300, (40, 3)), 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp32_router_logits_off_the_gpu_are_the_fp32_gemm(dtype: torch.dtype) -> None:
    x = torch.randn(37, 96).to(dtype)
    w = torch.randn(12, 96).to(dtype)
    logits = router_logits_fp32(x, w)
    assert logits.dtype == torch.float32 and logits.shape == (37, 12)
    assert torch.equal(logits, torch.nn.functional.linear(x.float(), w.float()))
    ref = x.double() @ w.double().t()  # bf16 / fp16 products are exact: only the sums round
    assert torch.allclose(logits.double(), ref, rtol=1e-5, atol=1e-4)


def test_fp32_router_logits_of_mixed_dtypes_widen_both() -> None:
    x = torch.randn(5, 16).to(torch.bfloat16)
    w = torch.randn(4, 16)  # an fp32 router weight: its products are not exact in bf16
    assert torch.equal(router_logits_fp32(x, w), torch.nn.functional.linear(x.float(), w))


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_non_finite_factor_set_later_is_refused_when_compiled_too(dynamic):
    # (eager refused it at the forward; compiled, every output turned NaN without a word.
    # The assignment itself is refused now, so the compiled layer keeps its factor; a value
    # that reaches the router another way, here the layer's stored option, is refused by the
    # traced check.)
    import torch._dynamo

    from moe_gemm import MoE

    m = MoE(32, 24, 8, 2, scoring="sigmoid", routed_scaling_factor=2.5,
            dtype=torch.float32).eval()
    x = torch.randn(5, 32)
    torch._dynamo.reset()
    f = torch.compile(m, fullgraph=True, dynamic=dynamic, backend="eager")
    with torch.no_grad():
        y = m(x)
        torch.testing.assert_close(f(x), y)
        with pytest.raises(ValueError, match="routed_scaling_factor must be finite"):
            m.routed_scaling_factor = float("nan")
        torch.testing.assert_close(f(x), y)
        m.__dict__["_routed_scaling_factor"] = float("nan")
        with pytest.raises(torch._dynamo.exc.Unsupported) as info:
            f(x)
    assert "routed_scaling_factor must be finite" in str(info.value.__cause__)


def test_routers_take_numpy_integer_arguments() -> None:
    """k, n_group, topk_group and num_experts from numpy give the results of Python ints."""
    np = pytest.importorskip("numpy")
    logits = torch.randn(6, 8)
    for got, want in zip(softmax_topk(logits, np.int64(2)), softmax_topk(logits, 2)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = sigmoid_grouped_topk(logits, None, np.int64(2), np.int64(4), np.int32(2))
    want = sigmoid_grouped_topk(logits, None, 2, 4, 2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    ids = torch.randint(0, 3, (4, 2))
    a, b = permute_by_expert(ids, np.int64(3)), permute_by_expert(ids, 3)
    torch.testing.assert_close(a.offs, b.offs, rtol=0, atol=0)
    with pytest.raises(TypeError, match="must be an int"):
        softmax_topk(logits, 2.0)


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4's routers: sqrt(softplus) scores, and hash routing by token id


@pytest.mark.parametrize(
    "E,k,n_group,topk_group,scale,renormalize,use_bias",
    [
        (8, 2, 1, 1, 1.5, True, True),  # DeepSeek-V4: no groups, a bias, factor 1.5
        (16, 6, 1, 1, 1.0, True, False),
        (16, 4, 4, 2, 2.5, True, True),
        (12, 3, 3, 1, 1.0, False, True),
        (6, 6, 1, 1, 1.0, True, True),  # k = E
    ],
)
def test_sqrtsoftplus_grouped_topk_matches_reference(E, k, n_group, topk_group, scale,
                                                     renormalize, use_bias) -> None:
    T = 29
    logits = torch.randn(T, E) * 3  # (softplus's both regimes: exp(v) small and large)
    bias = torch.randn(E) * 0.5 if use_bias else None
    weights, ids = sqrtsoftplus_grouped_topk(logits, bias, k, n_group, topk_group, scale,
                                             renormalize)
    assert weights.shape == ids.shape == (T, k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    want = _sigmoid_grouped_ref(logits, bias, k, n_group, topk_group, scale, renormalize,
                                scoring="sqrtsoftplus")
    _assert_routing_equal(_as_dicts(weights, ids), want)
    # through route_tokens too (the layer's path), logits from a router weight
    x, w = torch.randn(T, 24), torch.randn(E, 24) * 0.3
    got = route_tokens(x, w, k, "sqrtsoftplus", renormalize, n_group, topk_group, scale, bias,
                       True)
    want = _sigmoid_grouped_ref(x.double() @ w.double().T, bias, k, n_group, topk_group, scale,
                                renormalize, scoring="sqrtsoftplus")
    _assert_routing_equal(_as_dicts(*got), want)


def test_sqrtsoftplus_grouped_topk_rejects_bad_settings() -> None:
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="divide E=8"):
        sqrtsoftplus_grouped_topk(logits, None, 2, n_group=3)
    with pytest.raises(ValueError, match="bias"):
        sqrtsoftplus_grouped_topk(logits, torch.zeros(7), 2)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        sqrtsoftplus_grouped_topk(logits, None, 2, routed_scaling_factor=float("nan"))
    with pytest.raises(ValueError, match=r"k \(experts per token\) must be in \[1, E=8\]"):
        sqrtsoftplus_grouped_topk(logits, None, 9)


def _hash_ref(logits, table, token_ids, scoring, scale, renormalize):
    out = []
    for row, t in zip(logits.double().tolist(), token_ids.reshape(-1).tolist()):
        scores = _score_ref(row, scoring)
        chosen = table[t].tolist()
        w = [scores[e] for e in chosen]
        if renormalize:
            tot = sum(w) + 1e-20
            w = [v / tot for v in w]
        out.append([(e, v * scale) for e, v in zip(chosen, w)])
    return out


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("renormalize,scale", [(True, 1.5), (False, 1.0)])
def test_hash_topk_matches_reference(scoring: str, renormalize: bool, scale: float) -> None:
    T, E, k, V = 31, 8, 3, 50
    logits = torch.randn(T, E) * 2
    table = torch.randint(0, E, (V, k))
    table[7] = torch.tensor([2, 2, 5])  # a row naming one expert twice (zeros-initialised
    token_ids = torch.randint(0, V, (T,))  # tables do; each slot is its own route)
    token_ids[0] = 7
    weights, ids = hash_topk(logits, table, token_ids.view(1, T), scoring, scale, renormalize)
    assert weights.shape == ids.shape == (T, k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    want = _hash_ref(logits, table, token_ids, scoring, scale, renormalize)
    # the slots are the table's, in its order
    assert ids.tolist() == [[e for e, _ in row] for row in want]
    ref = torch.tensor([[v for _, v in row] for row in want], dtype=torch.float64)
    torch.testing.assert_close(weights.double(), ref, rtol=1e-6, atol=1e-7)
    # table entries of another integer dtype route the same
    w2, i2 = hash_topk(logits, table.to(torch.int32), token_ids, scoring, scale, renormalize)
    assert torch.equal(i2, ids) and torch.equal(w2, weights)


def test_hash_topk_handles_zero_tokens() -> None:
    weights, ids = hash_topk(torch.randn(0, 8), torch.randint(0, 8, (10, 2)),
                             torch.zeros(0, dtype=torch.int64))
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize(
    "table,token_ids,exc,pattern",
    [
        (torch.randint(0, 8, (10, 2)).float(), torch.zeros(4, dtype=torch.int64), TypeError,
         "expert ids"),
        ([[0, 1]], torch.zeros(4, dtype=torch.int64), TypeError, "tid2eid must be an integer"),
        (torch.randint(0, 8, (10,)), torch.zeros(4, dtype=torch.int64), ValueError, "2-D"),
        (torch.randint(0, 8, (10, 2)) + 8, torch.zeros(4, dtype=torch.int64), ValueError,
         r"must be in \[0, num_experts=8\)"),
        (torch.randint(0, 8, (10, 2)) - 8, torch.zeros(4, dtype=torch.int64), ValueError,
         r"must be in \[0, num_experts=8\)"),
        (torch.randint(0, 8, (10, 2)), None, ValueError, "pass input_ids"),
        (torch.randint(0, 8, (10, 2)), torch.zeros(3, dtype=torch.int64), ValueError,
         r"one id per token \(4\)"),
        (torch.randint(0, 8, (10, 2)), torch.zeros(4), TypeError, "integer tensor"),
        (torch.randint(0, 8, (10, 2)), [0, 1, 2, 3], TypeError, "input_ids must be"),
        (torch.randint(0, 8, (10, 2)), torch.tensor([0, 1, 10, 2]), ValueError,
         r"token ids in \[0, 10\)"),
        (torch.randint(0, 8, (10, 2)), torch.tensor([0, -1, 3, 2]), ValueError,
         r"token ids in \[0, 10\)"),
    ],
)
def test_hash_topk_rejects_bad_input(table, token_ids, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        hash_topk(torch.randn(4, 8), table, token_ids)


def test_hash_topk_rejects_bad_options() -> None:
    table, tok = torch.randint(0, 8, (10, 2)), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="scoring must be"):
        hash_topk(torch.randn(4, 8), table, tok, "relu")
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        hash_topk(torch.randn(4, 8), table, tok, routed_scaling_factor=float("inf"))
    with pytest.raises(TypeError, match="renormalize"):
        hash_topk(torch.randn(4, 8), table, tok, renormalize="yes")


def test_route_tokens_by_hash_needs_a_table_of_top_k_columns() -> None:
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    tok = torch.arange(4)
    table = torch.randint(0, 8, (10, 3))
    weights, ids = route_tokens(x, w, 3, "sqrtsoftplus", True, 1, 1, 1.0, torch.randn(8), False,
                                table, tok)
    assert torch.equal(ids, table[tok])  # (the bias and the scores choose nothing)
    with pytest.raises(ValueError, match=r"tid2eid must be \[vocab, top_k=2\]"):
        route_tokens(x, w, 2, "sqrtsoftplus", True, 1, 1, 1.0, None, False, table, tok)
    with pytest.raises(ValueError, match="pass input_ids"):
        route_tokens(x, w, 3, "sqrtsoftplus", True, 1, 1, 1.0, None, False, table, None)


def test_fp32_router_logits_stay_fp32_under_autocast() -> None:
    # (MiniCPM5's router disables autocast for its fp32 logits; under CPU autocast the fp32
    # GEMM ran in bf16: logits rounded, near ties routed to other experts)
    x, w = torch.randn(64, 96), torch.randn(32, 96)
    want = x.double() @ w.double().T
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router_logits_fp32(x, w)
        weights, ids = route_tokens(x, w, 4, "sigmoid", True, 1, 1, 1.0, None, True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    _assert_routing_equal(_as_dicts(weights, ids),
                          _sigmoid_grouped_ref(want, None, 4, 1, 1, 1.0, True))
