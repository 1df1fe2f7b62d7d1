"""The routers and the permutation on the GPU, where torch takes other kernels than on the CPU
(the expert sort on its narrowest key dtype among them). Same references as test_routing.py
(float64 loops)."""

from __future__ import annotations

import pytest
import torch
from test_routing import (
    _as_dicts,
    _assert_routing_equal,
    _check_permutation,
    _sigmoid_grouped_ref,
    _softmax_topk_ref,
)

from moe_gemm.layers import routing
from moe_gemm.layers.routing import permute_by_expert, sigmoid_grouped_topk, softmax_topk

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.mark.parametrize("E,k", [(8, 2), (60, 4), (128, 8), (256, 8), (384, 8),
                                 (1024, 16), (2048, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_on_the_gpu_matches_reference(E: int, k: int, renormalize: bool) -> None:
    T = 37
    logits = torch.randn(T, E, device=DEV, dtype=torch.bfloat16) * 3
    weights, ids = softmax_topk(logits, k, renormalize)
    assert weights.shape == ids.shape == (T, k) and ids.dtype == torch.int64
    assert weights.is_contiguous() and ids.is_contiguous()
    _assert_routing_equal(_as_dicts(weights.cpu(), ids.cpu()),
                          _softmax_topk_ref(logits.float().cpu(), k, renormalize))
    assert bool((weights[:, :-1] >= weights[:, 1:]).all())  # best first


@pytest.mark.parametrize("E,k,n_group,topk_group", [(256, 8, 8, 4), (64, 6, 8, 3), (32, 4, 1, 1),
                                                    (2048, 8, 16, 4)])
def test_sigmoid_grouped_topk_on_the_gpu_matches_reference(E, k, n_group, topk_group) -> None:
    T = 29
    logits = torch.randn(T, E, device=DEV) * 2
    bias = torch.randn(E, device=DEV) * 0.3
    weights, ids = sigmoid_grouped_topk(logits, bias, k, n_group, topk_group, 2.5, True)
    want = _sigmoid_grouped_ref(logits.cpu(), bias.cpu(), k, n_group, topk_group, 2.5, True)
    _assert_routing_equal(_as_dicts(weights.cpu(), ids.cpu()), want)


@pytest.mark.parametrize("T,k,E", [(300, 8, 128), (64, 4, 255), (64, 4, 256), (50, 3, 40000),
                                   (1, 1, 1), (0, 2, 4)])
def test_permutation_on_the_gpu(T: int, k: int, E: int) -> None:
    ids = torch.randint(-1, E + 2, (T, k), device=DEV)  # with dropped slots on both sides
    _check_permutation(ids, E)
    p = permute_by_expert(ids, E)
    assert p.sorted_expert.dtype == routing._sort_key_dtype(E)
    cpu = permute_by_expert(ids.cpu(), E)  # the same permutation (a stable sort is unique)
    assert torch.equal(p.slot_order.cpu(), cpu.slot_order)
    assert torch.equal(p.offs.cpu(), cpu.offs)
