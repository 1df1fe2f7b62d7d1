"""torch.vmap over the public ops on an sm90 GPU: each batch entry runs the same kernel an
eager call runs (bit for bit equal to the per-entry loop, which the Hopper kernels compute),
within the 2x rule of an fp64 reference; vmap(grad) gives per-sample gradients on the GPU.
(tests/ops/test_vmap.py checks the same rules on the CPU's torch backend.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import moe_gemm
from moe_gemm.ops.reference import grouped_mm_ref
from moe_gemm.testing import assert_close_to_ref, make_moe_inputs

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16 = torch.bfloat16
B, T, E, K, N = 3, 300, 8, 512, 256


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_vmap_grouped_mm_runs_each_entry_as_eager() -> None:
    x, w, offs = make_moe_inputs(T, E, K, N, BF16, DEVICE, w_layout="nk_view",
                                 empty_fraction=0.25, generator=_gen(1))
    xs = torch.randn(B, T, K, generator=_gen(2)).to(BF16).to(DEVICE)
    y = vmap(lambda xi: moe_gemm.grouped_mm(xi, w, offs))(xs)
    rows = int(offs[-1])
    for xi, yi in zip(xs, y):
        assert torch.equal(yi[:rows], moe_gemm.grouped_mm(xi, w, offs)[:rows])
        ref = grouped_mm_ref(xi, w, offs, torch.float64)
        assert_close_to_ref(yi[:rows], ref[:rows], grouped_mm_ref(xi, w, offs, BF16)[:rows])
    # the weights and the offsets mapped together
    ws = torch.randn(B, E, K, N, generator=_gen(3)).to(BF16).to(DEVICE)
    offss = torch.stack([offs, torch.full_like(offs, int(offs[-1])), offs])  # all in one
    y2 = vmap(lambda wi, oi: moe_gemm.grouped_mm(x, wi, oi))(ws, offss)
    for wi, oi, yi in zip(ws, offss, y2):
        r = int(oi[-1])
        assert torch.equal(yi[:r], moe_gemm.grouped_mm(x, wi, oi)[:r])


def test_vmap_fused_and_grouped_gemm_on_the_gpu() -> None:
    x, _, offs = make_moe_inputs(T, E, K, N, BF16, DEVICE, empty_fraction=0.25,
                                 generator=_gen(4))
    wf = (torch.randn(E, K, 2 * N, generator=_gen(5)) / K ** 0.5).to(BF16).to(DEVICE)
    ri = torch.randint(0, T, (T,), generator=_gen(6)).to(DEVICE)
    xs = torch.randn(B, T, K, generator=_gen(7)).to(BF16).to(DEVICE)
    y = vmap(lambda xi: moe_gemm.fused_grouped_mm(xi, wf, offs, row_index=ri, gate="silu"))(xs)
    rows = int(offs[-1])
    for xi, yi in zip(xs, y):
        eager = moe_gemm.fused_grouped_mm(xi, wf, offs, row_index=ri, gate="silu")
        assert torch.equal(yi[:rows], eager[:rows])
        h = grouped_mm_ref(xi[ri], wf, offs, torch.float64)
        ref = F.silu(h[:, :N]) * h[:, N:]
        assert_close_to_ref(yi[:rows], ref[:rows], atol=2e-2)
    a = [torch.randn(B, m, K, generator=_gen(8 + m)).to(BF16).to(DEVICE) for m in (3, 0, 129)]
    b = [torch.randn(K, N, generator=_gen(20 + i)).to(BF16).to(DEVICE) for i in range(3)]
    ys = vmap(lambda *ai: moe_gemm.grouped_gemm(list(ai), b))(*a)
    for j in range(B):
        eager = moe_gemm.grouped_gemm([ai[j] for ai in a], b)
        for yi, ei in zip(ys, eager):
            assert torch.equal(yi[j], ei)


def test_vmap_of_grad_on_the_gpu() -> None:
    x, w, offs = make_moe_inputs(T, E, K, N, BF16, DEVICE, empty_fraction=0.25,
                                 generator=_gen(9))
    xs = torch.randn(B, T, K, generator=_gen(10)).to(BF16).to(DEVICE)

    def loss(wi, xi):
        return moe_gemm.grouped_mm(xi, wi, offs).float().square().sum()

    got = vmap(grad(loss), in_dims=(None, 0))(w, xs)
    assert got.shape == (B, *w.shape)
    for gi, xi in zip(got, xs):
        wr = w.double().requires_grad_()
        grouped_mm_ref(xi, wr, offs, torch.float64).square().sum().backward()
        # bf16 gradients of a bf16 product: relative to the gradient's scale
        err = (gi.double() - wr.grad).abs().max() / wr.grad.abs().max()
        assert err < 3e-2, float(err)
