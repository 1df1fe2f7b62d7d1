"""moe_gemm.autograd.inference_only: results of the kernels are tied to their inputs so that
a backward raises a clear error instead of silently producing no gradient."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.ops.api import NO_BACKWARD
from moe_gemm.ops.autograd import inference_only


def test_no_link_without_grad() -> None:
    x = torch.randn(3, 4)
    y = inference_only(NO_BACKWARD, lambda: x * 2, [x])
    assert y.grad_fn is None
    xg = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        assert inference_only(NO_BACKWARD, lambda: xg.detach() * 2, [xg]).grad_fn is None


def test_backward_raises_with_the_message() -> None:
    w = torch.randn(4, 5, requires_grad=True)
    x = torch.randn(3, 4)
    y = inference_only(NO_BACKWARD, lambda: x @ w.detach(), [x, w])
    assert y.requires_grad and torch.equal(y, x @ w.detach())
    with pytest.raises(RuntimeError, match=r"inference-only: they have no backward.*"
                                           r"backend='torch'"):
        y.sum().backward()


def test_list_results_and_preallocated_outputs() -> None:
    w = torch.randn(4, 5, requires_grad=True)
    outs = [torch.empty(2, 5), torch.empty(3, 5)]

    def run() -> list[torch.Tensor]:
        for o, m in zip(outs, (2, 3)):
            o.copy_(torch.ones(m, 4) @ w.detach())
        return outs

    res = inference_only(NO_BACKWARD, run, [w])
    assert isinstance(res, list) and len(res) == 2
    assert all(torch.equal(r, o) for r, o in zip(res, outs))
    with pytest.raises(RuntimeError, match="inference-only"):
        (res[0].sum() + res[1].sum()).backward()
