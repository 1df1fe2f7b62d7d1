"""GPU tests of the router kernels (kernels/sm90/router_topk.py through
ops/router_topk.py and layers/routing.softmax_topk) against a float64 reference: every E
class (a partial last lane group, one and 32 values a lane), k up to 32, the three logit
dtypes, strided rows, ties, -inf and NaN logits, no tokens, CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.layers import routing
from moe_gemm.ops import router_topk

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.fixture(autouse=True)
def _kernel_on(monkeypatch):
    monkeypatch.delenv(router_topk.ROUTER_ENV, raising=False)  # the default: the kernel


def _reference(logits: torch.Tensor, k: int, renormalize: bool):
    """float64 softmax; the k largest, ties to the lower id."""
    p = torch.softmax(logits.double(), -1)
    ids = torch.sort(-p, dim=-1, stable=True).indices[:, :k]
    w = p.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def _run(logits, k, renormalize):
    assert router_topk._kernel_ok(logits, k), "the kernel did not take the case"
    return routing.softmax_topk(logits, k, renormalize)


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("E,k,dtype,renormalize", [
    (1, 1, FP32, True), (8, 2, BF16, True), (33, 32, FP32, False), (60, 4, BF16, False),
    (128, 8, BF16, True), (128, 8, FP32, False), (256, 8, BF16, True), (384, 6, FP32, True),
    (1000, 32, BF16, False), (1024, 8, BF16, True)])
def test_matches_reference(E, k, dtype, renormalize):
    torch.manual_seed(E * 31 + k)
    for T in (1, 37, 4099):
        logits = (torch.randn(T, E, device=DEV) * 3).to(dtype)
        w, ids = _run(logits, k, renormalize)
        assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (T, k)
        want_w, want_ids = _reference(logits, k, renormalize)
        assert torch.equal(ids, want_ids), T
        torch.testing.assert_close(w.double(), want_w, rtol=1e-6, atol=1e-7)


def test_fp16_strided_rows_and_agreement_with_torch(monkeypatch):
    wide = torch.randn(300, 200, device=DEV, dtype=torch.float16)
    logits = wide[:, 7:135]  # row stride 200, unit stride along E
    w, ids = _run(logits, 8, True)
    want_w, want_ids = _reference(logits, 8, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w.double(), want_w, rtol=1e-6, atol=1e-7)
    monkeypatch.setenv(router_topk.ROUTER_ENV, "torch")
    tw, tids = routing.softmax_topk(logits, 8, True)
    assert torch.equal(torch.sort(tids, -1).values, torch.sort(ids, -1).values)


def test_ties_go_to_the_lower_expert():
    logits = torch.zeros(6, 64, device=DEV)
    logits[:, 40] = 1.0
    w, ids = _run(logits, 4, False)
    assert ids.tolist() == [[40, 0, 1, 2]] * 6
    assert torch.allclose(w[:, 1], w[:, 2]) and bool((w[:, 0] > w[:, 1]).all())


def test_masked_and_nan_logits():
    logits = torch.randn(4, 48, device=DEV)
    logits[:, 10:40] = float("-inf")  # masked experts: never chosen while others remain
    w, ids = _run(logits, 8, True)
    assert not ((ids >= 10) & (ids < 40)).any()
    torch.testing.assert_close(w.double(), _reference(logits, 8, True)[0], rtol=1e-6,
                               atol=1e-7)
    bad = torch.randn(3, 48, device=DEV)
    bad[1, 5] = float("nan")
    w, ids = _run(bad, 4, True)
    assert ids[1, 0].item() == 5  # NaN ranks first, as in torch.topk
    assert torch.isnan(w[1]).all()  # and the row's weights are NaN, as torch's softmax gives
    assert torch.isfinite(w[[0, 2]]).all()
    assert bool(((ids >= 0) & (ids < 48)).all())


def test_no_tokens_and_graph_replay():
    w, ids = _run(torch.randn(0, 128, device=DEV), 8, True)
    assert w.shape == ids.shape == (0, 8)
    logits = torch.randn(512, 128, device=DEV, dtype=torch.bfloat16)
    routing.softmax_topk(logits, 8, True)  # compile and warm outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w, ids = routing.softmax_topk(logits, 8, True)
    logits.copy_(torch.randn_like(logits))
    g.replay()
    torch.cuda.synchronize()
    want_w, want_ids = _reference(logits, 8, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w.double(), want_w, rtol=1e-6, atol=1e-7)


def _group_reference(logits, bias, k, n_group, topk_group, scale, renormalize):
    """float64, as transformers (group score: the sum of the two best biased scores), ties to
    the lower id; ids best first by the biased score."""
    s = torch.sigmoid(logits.double())
    c = s if bias is None else s + bias.double()
    T, E = c.shape
    if n_group > 1 and topk_group < n_group:
        top2 = torch.sort(-c.view(T, n_group, E // n_group), dim=-1, stable=True).values[..., :2]
        group = -top2.sum(-1)
        keep = torch.sort(-group, dim=-1, stable=True).indices[:, :topk_group]
        mask = torch.zeros(T, n_group, dtype=torch.bool, device=c.device)
        mask.scatter_(1, keep, True)
        c = c.masked_fill(~mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = torch.sort(-c, dim=-1, stable=True).indices[:, :k]
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


@pytest.mark.parametrize("E,k,n_group,topk_group,dtype,use_bias,renormalize", [
    (256, 8, 8, 4, FP32, True, True),  # DeepSeek-V3 / Kimi-K2's ratios
    (256, 8, 8, 4, BF16, True, False),
    (160, 8, 1, 1, FP32, True, True),  # GLM-4.5-like: no groups
    (64, 6, 8, 3, BF16, False, True),
    (96, 4, 3, 2, FP32, True, True),  # 32 experts a group: one value index a group
    (384, 8, 1, 1, BF16, True, True),
    (1024, 32, 32, 31, FP32, True, True),
])
def test_sigmoid_grouped_topk_matches_reference(E, k, n_group, topk_group, dtype, use_bias,
                                                renormalize):
    torch.manual_seed(E + 7 * k + n_group)
    for T in (1, 33, 2051):
        logits = (torch.randn(T, E, device=DEV) * 2).to(dtype)
        bias = torch.randn(E, device=DEV) * 0.3 if use_bias else None
        assert router_topk._kernel_ok(logits, k)
        w, ids = routing.sigmoid_grouped_topk(logits, bias, k, n_group, topk_group, 2.5,
                                              renormalize)
        want_w, want_ids = _group_reference(logits, bias, k, n_group, topk_group, 2.5,
                                            renormalize)
        assert torch.equal(ids, want_ids), T
        torch.testing.assert_close(w.double(), want_w, rtol=1e-6, atol=1e-7)


def test_sigmoid_router_agrees_with_torch_and_replays_in_a_graph(monkeypatch):
    logits = torch.randn(700, 256, device=DEV, dtype=BF16)
    bias = torch.randn(256, device=DEV) * 0.1
    w, ids = routing.sigmoid_grouped_topk(logits, bias, 8, 8, 4, 2.5)
    monkeypatch.setenv(router_topk.ROUTER_ENV, "torch")
    tw, tids = routing.sigmoid_grouped_topk(logits, bias, 8, 8, 4, 2.5)
    assert torch.equal(torch.sort(ids, -1).values, torch.sort(tids, -1).values)
    order = torch.argsort(ids, -1)
    torch.testing.assert_close(w.gather(1, order), tw.gather(1, torch.argsort(tids, -1)),
                               rtol=1e-6, atol=1e-7)
    monkeypatch.setenv(router_topk.ROUTER_ENV, "kernel")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gw, gids = routing.sigmoid_grouped_topk(logits, bias, 8, 8, 4, 2.5)
    logits.copy_(torch.randn_like(logits))
    g.replay()
    torch.cuda.synchronize()
    want_w, want_ids = _group_reference(logits, bias, 8, 8, 4, 2.5, True)
    assert torch.equal(gids, want_ids)
    torch.testing.assert_close(gw.double(), want_w, rtol=1e-6, atol=1e-7)
