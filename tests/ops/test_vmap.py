"""ops/vmap.py on the CPU: torch.vmap over the public ops' tensor arguments runs each batch
entry through the registered op and stacks the results (float64 references); vmap(grad(f))
keeps the eager path and gives per-sample gradients; an unbatched `out` and a GroupedGemmPlan
inside vmap are refused with a message naming what to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import moe_gemm
from moe_gemm.ops.reference import grouped_mm_ref
from moe_gemm.testing import make_moe_inputs, poison_, random_offs

B, T, E, K, N = 3, 13, 4, 16, 8


def _batch(seed: int):
    """B tokens batches for one weight, plus B weights and B offs (fresh per seed)."""
    g = torch.Generator().manual_seed(seed)
    x, w, offs = make_moe_inputs(T, E, K, N, torch.float32, empty_fraction=0.25, total=T - 2,
                                 generator=g)
    xs = torch.randn(B, T, K, generator=g)
    ws = torch.randn(B, E, K, N, generator=g)
    offss = torch.stack([random_offs(T, E, empty_fraction=0.25, generator=g)
                         for _ in range(B)])
    return x, w, offs, xs, ws, offss


@pytest.mark.parametrize("seed", [0, 1])
def test_vmap_grouped_mm_over_x_w_and_offs(seed: int) -> None:
    x, w, offs, xs, ws, offss = _batch(seed)
    y = vmap(lambda xi: moe_gemm.grouped_mm(xi, w, offs))(xs)
    ref = torch.stack([grouped_mm_ref(xi, w, offs, torch.float64) for xi in xs])
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-4)
    # x batched along dim 1, the result along dim 1
    y1 = vmap(lambda xi: moe_gemm.grouped_mm(xi, w, offs), in_dims=1, out_dims=1)(
        xs.transpose(0, 1))
    torch.testing.assert_close(y1.transpose(0, 1).double(), ref, atol=1e-4, rtol=1e-4)
    # the weights and the offsets batched together
    y2 = vmap(lambda wi, oi: moe_gemm.grouped_mm(x, wi, oi))(ws, offss)
    ref2 = torch.stack([grouped_mm_ref(x, wi, oi, torch.float64) for wi, oi in zip(ws, offss)])
    torch.testing.assert_close(y2.double(), ref2, atol=1e-4, rtol=1e-4)


def test_vmap_batched_form_grouped_gemm_and_nested() -> None:
    x, w, offs, xs, *_ = _batch(2)
    xb = torch.randn(B, 2, 5, K)
    wb = torch.randn(2, K, N)
    yb = vmap(lambda xi: moe_gemm.grouped_mm(xi, wb))(xb)
    torch.testing.assert_close(yb.double(), xb.double() @ wb.double(), atol=1e-4, rtol=1e-4)
    a = [torch.randn(B, m, K) for m in (3, 0, 5)]
    b = [torch.randn(K, N) for _ in a]
    ys = vmap(lambda *ai: moe_gemm.grouped_gemm(list(ai), b))(*a)
    for yi, ai, bi in zip(ys, a, b):
        torch.testing.assert_close(yi.double(), ai.double() @ bi.double(), atol=1e-4,
                                   rtol=1e-4)
    # nested vmap: (2, B) batches
    yn = vmap(vmap(lambda xi: moe_gemm.grouped_mm(xi, w, offs)))(torch.stack([xs, -xs]))
    ref = torch.stack([grouped_mm_ref(xi, w, offs, torch.float64) for xi in xs])
    torch.testing.assert_close(yn.double(), torch.stack([ref, -ref]), atol=1e-4, rtol=1e-4)
    # a mapped dimension of size 0 gives an empty batch, as for torch's ops
    assert vmap(lambda xi: moe_gemm.grouped_mm(xi, w, offs))(xs[:0]).shape == (0, T, N)


def test_vmap_fused_and_masked() -> None:
    x, w, offs, xs, *_ = _batch(3)
    wf = torch.randn(E, K, 2 * N)
    rows = int(offs[-1])
    ri = torch.randint(0, T, (T,))
    y = vmap(lambda xi: moe_gemm.fused_grouped_mm(xi, wf, offs, row_index=ri, gate="silu"))(xs)
    for yi, xi in zip(y, xs):
        h = grouped_mm_ref(xi[ri], wf, offs, torch.float64)
        ref = F.silu(h[:, :N]) * h[:, N:]
        torch.testing.assert_close(yi[:rows].double(), ref[:rows], atol=1e-4, rtol=1e-4)
    xm = torch.randn(B, E, 5, K)
    counts = torch.tensor([1, 0, 5, 3], dtype=torch.int32)
    ym = vmap(lambda xi: moe_gemm.grouped_mm_masked(xi, w, counts))(xm)
    valid = (torch.arange(5)[None, :] < counts[:, None])[None, ..., None]
    torch.testing.assert_close(torch.where(valid, ym, 0).double(),
                               torch.where(valid, xm.double() @ w.double(), 0),
                               atol=1e-4, rtol=1e-4)


def test_vmap_out_batched_and_unbatched() -> None:
    x, w, offs, xs, *_ = _batch(4)
    out = poison_(torch.empty(B, T, N))
    vmap(lambda xi, oi: moe_gemm.grouped_mm(xi, w, offs, out=oi))(xs, out)
    rows = int(offs[-1])
    ref = torch.stack([grouped_mm_ref(xi, w, offs, torch.float64) for xi in xs])
    torch.testing.assert_close(out[:, :rows].double(), ref[:, :rows], atol=1e-4, rtol=1e-4)
    assert out[:, rows:].isnan().all()  # rows past offs[-1] untouched, as in eager
    with pytest.raises(ValueError, match="`out` is written in place and must be batched"):
        vmap(lambda xi: moe_gemm.grouped_mm(xi, w, offs, out=torch.zeros(T, N)))(xs)


def test_vmap_of_grad_gives_per_sample_gradients() -> None:
    x, w, offs, xs, *_ = _batch(5)

    def loss(wi, xi):
        return moe_gemm.grouped_mm(xi, wi, offs).square().sum()

    got = vmap(grad(loss), in_dims=(None, 0))(w, xs)
    for gi, xi in zip(got, xs):
        wr = w.double().requires_grad_()
        grouped_mm_ref(xi, wr, offs, torch.float64).square().sum().backward()
        torch.testing.assert_close(gi.double(), wr.grad, atol=1e-3, rtol=1e-4)


def test_grouped_gemm_plan_inside_vmap_is_refused() -> None:
    b = torch.randn(K, N)
    with pytest.raises(ValueError, match="GroupedGemmPlan cannot be built inside torch.vmap"):
        vmap(lambda ai: moe_gemm.GroupedGemmPlan([ai], [b])()[0])(torch.randn(B, 3, K))
