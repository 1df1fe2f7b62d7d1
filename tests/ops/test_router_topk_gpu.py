"""GPU tests of the softmax router kernel (kernels/sm90/router_topk.py through
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
    monkeypatch.setenv(router_topk.ROUTER_ENV, "kernel")  # (opt-in until these tests have run)


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
    (1, 1, FP32, True), (8, 2, BF16, True), (33, 33, FP32, False), (60, 4, BF16, False),
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
