"""ops/router_topk on the CPU: what the kernel takes, and the plumbing from
layers/routing.softmax_topk through it (the kernel stood in for by a torch emulator)."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.layers import routing
from moe_gemm.ops import launch_resources, router_topk


def test_what_the_kernel_takes(monkeypatch):
    monkeypatch.delenv(router_topk.ROUTER_ENV)  # the default: the kernel where it runs
    assert router_topk._takes(torch.randn(5, 128), 8)
    monkeypatch.setenv(router_topk.ROUTER_ENV, "kernel")
    x = torch.randn(5, 128)
    takes = router_topk._takes
    assert takes(x, 8) and takes(x.half(), 32) and takes(x.bfloat16(), 1)
    assert takes(torch.randn(5, 1024), 32) and takes(torch.randn(3, 1), 1)
    assert not takes(x.double(), 8)  # fp64 logits: torch
    assert not takes(torch.randn(5, 1025), 8)  # beyond 32 values a lane
    assert not takes(x, 33)  # one slot a lane
    assert not takes(torch.randn(5, 4), 5)
    assert not takes(torch.randn(128, 5).t(), 2)  # strided along E
    assert takes(torch.randn(5, 200)[:, :128], 8)  # a row stride is fine
    assert not takes(torch.randn(2, 3, 8), 2)
    with torch.no_grad():
        assert takes(x.requires_grad_(), 8)
    assert not takes(x.requires_grad_(), 8)  # the kernel has no backward
    monkeypatch.setenv(router_topk.ROUTER_ENV, "torch")
    assert not takes(torch.randn(5, 128), 8)
    assert router_topk.softmax_topk(torch.randn(5, 128), 8, True) is None  # (CPU anyway)


class _Emulator:
    """The kernel's contract in torch: fills (weights, ids) from the logits."""

    def __init__(self, k, renormalize):
        self.k, self.renormalize, self.calls = k, renormalize, 0

    def __call__(self, logits, weights, ids):
        self.calls += 1
        p = torch.softmax(logits.double(), -1)
        order = torch.sort(-p, dim=-1, stable=True).indices[:, :self.k]
        w = p.gather(1, order)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True)
        weights.copy_(w)
        ids.copy_(order)


@pytest.fixture(autouse=True)
def _switch(monkeypatch):
    monkeypatch.setenv(router_topk.ROUTER_ENV, "kernel")


@pytest.fixture
def kernel(monkeypatch):
    made = {}
    monkeypatch.setattr(router_topk, "_kernel_ok", lambda logits, k: router_topk._takes(logits, k))
    monkeypatch.setattr(router_topk, "_kernel", lambda dtype, E, k, renormalize: made.setdefault(
        (dtype, E, k, renormalize), _Emulator(k, renormalize)))
    return made


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_takes_the_kernel_result(kernel, renormalize):
    logits = torch.randn(9, 60)  # (fp32: no ties, whose order torch.topk leaves open)
    weights, ids = routing.softmax_topk(logits, 4, renormalize)
    (key, emu), = kernel.items()
    assert key == (torch.float32, 60, 4, renormalize) and emu.calls == 1
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (9, 4)
    want_w, want_i = torch.topk(torch.softmax(logits.float(), -1), 4)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_i)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def test_no_tokens_no_launch(kernel):
    weights, ids = routing.softmax_topk(torch.randn(0, 16), 2)
    assert weights.shape == ids.shape == (0, 2)
    assert not any(e.calls for e in kernel.values())


def test_logits_needing_a_gradient_take_torch(kernel):
    logits = torch.randn(4, 16, requires_grad=True)
    weights, _ = routing.softmax_topk(logits, 2)
    weights.sum().backward()
    assert logits.grad is not None and not kernel


class _GroupEmulator:
    """The sigmoid router kernel's contract, by the torch path (MOE_GEMM_ROUTER=torch)."""

    def __init__(self, key):
        self.key, self.calls = key, []

    def __call__(self, logits, bias, weights, ids, scale):
        _, E, k, n_group, topk_group, renormalize, has_bias = self.key
        self.calls.append((bias, scale))
        import os

        os.environ[router_topk.ROUTER_ENV] = "torch"
        try:
            w, i = routing.sigmoid_grouped_topk(logits, bias if has_bias else None, k, n_group,
                                                topk_group, scale, renormalize)
        finally:
            os.environ[router_topk.ROUTER_ENV] = "kernel"
        weights.copy_(w)
        ids.copy_(i)


@pytest.fixture
def group_kernel(monkeypatch):
    made = {}
    monkeypatch.setattr(router_topk, "_kernel_ok", lambda logits, k: router_topk._takes(logits, k))
    monkeypatch.setattr(router_topk, "_group_kernel", lambda *key: made.setdefault(
        key, _GroupEmulator(key)))
    monkeypatch.setattr(launch_resources, "_capturing", lambda: False)  # (a CPU run)
    return made


@pytest.mark.parametrize("use_bias", [True, False])
def test_sigmoid_grouped_topk_takes_the_kernel_result(group_kernel, use_bias, monkeypatch):
    logits = torch.randn(11, 64)
    bias = torch.randn(64, dtype=torch.float64) * 0.1 if use_bias else None
    weights, ids = routing.sigmoid_grouped_topk(logits, bias, 6, 8, 3, 2.5, True)
    (key, emu), = group_kernel.items()
    assert key == (torch.float32, 64, 6, 8, 3, True, use_bias)
    (b, scale), = emu.calls
    assert scale == 2.5 and isinstance(scale, float)
    if use_bias:  # the bias in float32, contiguous
        assert b.dtype == torch.float32 and torch.equal(b, bias.float())
    else:
        assert b.shape == (1,)  # a placeholder the kernel does not read
    assert weights.shape == ids.shape == (11, 6) and weights.dtype == torch.float32
    # What the kernel wrote is what the caller gets: the torch path's routing, neither scaled
    # again nor reordered.
    monkeypatch.setenv(router_topk.ROUTER_ENV, "torch")
    want_w, want_i = routing.sigmoid_grouped_topk(logits, bias, 6, 8, 3, 2.5, True)
    assert torch.equal(ids, want_i)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    assert len(emu.calls) == 1  # (the reference call took torch, not the kernel)


def test_sigmoid_grouped_topk_falls_back(group_kernel, monkeypatch):
    logits = torch.randn(4, 64)
    bias = torch.zeros(64, requires_grad=True)
    routing.sigmoid_grouped_topk(logits, bias, 2, 8, 3)  # a bias needing a gradient: torch
    assert not group_kernel
    assert router_topk.sigmoid_grouped_topk(torch.randn(4, 66), None, 2, 33, 33, 1.0,
                                            True) is None  # more groups than bits
    monkeypatch.setenv(router_topk.ROUTER_ENV, "torch")
    routing.sigmoid_grouped_topk(logits, None, 2, 8, 3)
    assert not group_kernel
