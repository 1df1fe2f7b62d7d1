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
from moe_gemm.layers.routing import (
    permute_by_expert,
    router_logits_fp32,
    sigmoid_grouped_topk,
    softmax_topk,
)

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,E", [(1, 7168, 256), (333, 7168, 32), (2048, 5120, 160),
                                   (64, 100, 7)])
def test_fp32_router_logits_on_the_gpu_are_the_fp32_sums(dtype, T: int, H: int, E: int) -> None:
    """16-bit operands on the tensor cores with fp32 output: the fp32 GEMM's logits to fp32
    accumulation order (the products are exact), so the same experts as the widened GEMM."""
    x = torch.randn(T, H, device=DEV).to(dtype)
    w = (torch.randn(E, H, device=DEV) * 0.02).to(dtype)
    logits = router_logits_fp32(x, w)
    assert logits.dtype == torch.float32 and logits.shape == (T, E)
    ref = (x.double() @ w.double().t())
    # The classic bound of a sum of H terms in fp32, H * 2^-23 * sum |products| (2^-23: the
    # tensor cores may truncate where IEEE rounds): wrong operands or a lost block of K land
    # orders of magnitude past it.
    bound = H * 2.0**-23 * (x.double().abs() @ w.double().abs().t())
    assert bool(((logits.double() - ref).abs() <= bound).all())
    widened = torch.nn.functional.linear(x.float(), w.float())
    assert bool(((logits.double() - widened.double()).abs() <= 2 * bound).all())
    bias = torch.randn(E, device=DEV) * 0.01
    k = min(8, E)
    groups = 8 if E % 8 == 0 and E // 8 >= 2 else 1
    got = sigmoid_grouped_topk(logits, bias, k, groups, min(4, groups), 2.5, True)
    want = sigmoid_grouped_topk(ref.float(), bias, k, groups, min(4, groups), 2.5, True)
    # The same experts wherever the reference's k-th and (k+1)-th scores are not a near-tie.
    same = (got[1].sort(dim=1).values == want[1].sort(dim=1).values).all(dim=1)
    assert same.float().mean().item() >= 0.99


def test_fp32_router_logits_keep_a_gradient_where_one_is_recorded() -> None:
    """torch.mm's out_dtype form has no derivative: with gradients recorded the widened GEMM
    runs, and the weight gets its gradient."""
    x = torch.randn(8, 64, device=DEV).bfloat16()
    w = torch.randn(4, 64, device=DEV).bfloat16().requires_grad_()
    y = router_logits_fp32(x, w)
    assert y.dtype == torch.float32 and y.grad_fn is not None
    y.sum().backward()
    torch.testing.assert_close(w.grad.float(), x.float().sum(0).expand(4, -1),
                               rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        torch.testing.assert_close(router_logits_fp32(x, w), y.detach(), rtol=1e-5, atol=1e-4)
