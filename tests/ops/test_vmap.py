"""ops/vmap.py on the CPU: torch.vmap over the public ops' tensor arguments runs each batch
entry through the registered op and stacks the results (float64 references); vmap(grad(f))
keeps the eager path and gives per-sample gradients, through per_entry where offs, masked_m or
row_index is batched; an unbatched `out` and a GroupedGemmPlan inside vmap are refused with a
message naming what to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import moe_gemm
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref
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


# ---------------------------------------------------------------------------------------------
# vmap with grad over batched offs, masked_m and row_index: the eager path read them on the
# host (torch's "data-dependent" vmap error); each entry now runs on plain tensors, its
# backward by the eager op run again under autograd (ops/vmap.per_entry).


def _sorted_offs(g: torch.Generator, rows: int) -> torch.Tensor:
    return torch.sort(torch.randint(0, rows + 1, (E,), generator=g)).values.to(torch.int32)


def _per_sample(ref, argnums, *batched):
    """Each entry's gradients of sum(ref(...)^2 * probe) w.r.t. argnums, in float64 (ref on
    float64 leaves), stacked; batched: (tensor, batched?) pairs."""
    B_ = next(t.shape[0] for t, b in batched if b)
    per = []
    for i in range(B_):
        args = [(t[i] if b else t) for t, b in batched]
        leaves = [a.double().requires_grad_() if j in argnums else a
                  for j, a in enumerate(args)]
        y, probe = ref(*leaves)
        per.append(torch.autograd.grad((y.square() * probe).sum(),
                                       [leaves[j] for j in argnums]))
    return [torch.stack(parts) for parts in zip(*per)]


def _check_grads(got, want, what: str) -> None:
    for i, (gi, wi) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(gi.double(), wi, atol=2e-4, rtol=2e-4,
                                   msg=lambda m, i=i: f"{what}, argument {i}: {m}")


@pytest.mark.parametrize("seed", [6, 7])
def test_vmap_of_grad_with_batched_offs(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w, xs = torch.randn(E, K, N, generator=g), torch.randn(B, T, K, generator=g)
    offss = torch.stack([_sorted_offs(g, T) for _ in range(B)])
    probe = torch.randn(T, N, generator=g, dtype=torch.float64)

    def loss(wi, xi, oi):
        return (moe_gemm.grouped_mm(xi, wi, oi).square() * probe.float()).sum()

    got = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, 0, 0))(w, xs, offss)
    want = _per_sample(lambda wi, xi, oi: (grouped_mm_ref(xi, wi, oi, torch.float64), probe),
                       (0, 1), (w, False), (xs, True), (offss, True))
    _check_grads(got, want, "vmap(grad)")
    # grad(vmap(f)) and jacrev: the same per-entry backward, summed / per output entry
    g_w = grad(lambda wi: vmap(loss, in_dims=(None, 0, 0))(wi, xs, offss).sum())(w)
    torch.testing.assert_close(g_w.double(), want[0].sum(0), atol=1e-3, rtol=2e-4)
    jac = vmap(torch.func.jacrev(loss), in_dims=(None, 0, 0))(w, xs, offss)
    _check_grads([jac], want[:1], "jacrev")


def test_vmap_of_grad_with_batched_row_index_offs_and_masked_m() -> None:
    g = torch.Generator().manual_seed(8)
    S, M = 11, 5
    xs, wf = torch.randn(B, T, K, generator=g), torch.randn(E, K, 2 * N, generator=g) / 4
    bias, rw = torch.randn(E, 2 * N, generator=g), torch.rand(B, S, generator=g)
    ris = torch.randint(0, T, (B, S), generator=g)
    offss = torch.stack([_sorted_offs(g, S) for _ in range(B)])
    probe = torch.randn(S, N, generator=g, dtype=torch.float64)

    def fused(xi, wi, bi, rwi, oi, ri):
        y = moe_gemm.fused_grouped_mm(xi, wi, oi, row_index=ri, bias=bi, row_weight=rwi,
                                      gate="silu")
        return (y.square() * probe.float()).sum()

    got = vmap(grad(fused, argnums=(0, 1, 2, 3)), in_dims=(0, None, None, 0, 0, 0))(
        xs, wf, bias, rw, offss, ris)
    want = _per_sample(
        lambda xi, wi, bi, rwi, oi, ri: (fused_grouped_mm_ref(
            xi, wi, oi, row_index=ri, bias=bi, row_weight=rwi, gate="silu",
            dtype=torch.float64), probe),
        (0, 1, 2, 3), (xs, True), (wf, False), (bias, False), (rw, True), (offss, True),
        (ris, True))
    _check_grads(got, want, "fused_grouped_mm")

    # the masked forms: each entry's counts (0 and M among them)
    xm, wm = torch.randn(B, E, M, K, generator=g), torch.randn(E, K, 2 * N, generator=g) / 4
    counts = torch.randint(0, M + 1, (B, E), generator=g, dtype=torch.int32)
    counts[0, 0], counts[1, 1] = 0, M
    rwm = torch.rand(B, E, M, generator=g)
    probe_m = torch.randn(E, M, N, generator=g, dtype=torch.float64)

    def masked_ref(xi, wi, mi, bi=None, rwi=None):
        h = xi.double() @ wi.double()
        valid = (torch.arange(M)[None, :] < mi[:, None])[..., None]
        if bi is None:
            return torch.where(valid, h, 0.0)
        h = h + bi.double()[:, None, :]
        y = F.silu(h[..., :N]) * h[..., N:] * rwi.double()[..., None]
        return torch.where(valid, y, 0.0)

    def plain(xi, wi, mi):
        return (moe_gemm.grouped_mm_masked(xi, wi, mi).square() * probe_m.float()).sum()

    got = vmap(grad(plain, argnums=(0, 1)), in_dims=(0, None, 0))(xm, wm[..., :N], counts)
    want = _per_sample(lambda xi, wi, mi: (masked_ref(xi, wi, mi), probe_m), (0, 1),
                       (xm, True), (wm[..., :N], False), (counts, True))
    _check_grads(got, want, "grouped_mm_masked")

    def gated(xi, wi, bi, rwi, mi):
        y = moe_gemm.fused_grouped_mm_masked(xi, wi, mi, bias=bi, row_weight=rwi, gate="silu")
        return (y.square() * probe_m.float()).sum()

    got = vmap(grad(gated, argnums=(0, 1, 2, 3)), in_dims=(0, None, None, 0, 0))(
        xm, wm, bias, rwm, counts)
    want = _per_sample(lambda xi, wi, bi, rwi, mi: (masked_ref(xi, wi, mi, bi, rwi), probe_m),
                       (0, 1, 2, 3), (xm, True), (wm, False), (bias, False), (rwm, True),
                       (counts, True))
    _check_grads(got, want, "fused_grouped_mm_masked")


def test_vmap_of_grad_of_fp8_scales_with_batched_offs_and_counts() -> None:
    # FP8: differentiable through the scales (row-wise here), per entry.
    from moe_gemm.testing_fp8 import make_fp8_batched_inputs, make_fp8_moe_inputs

    x, w, sa, sb, _ = make_fp8_moe_inputs(T, E, 128, 16, "row", seed=9)
    g = torch.Generator().manual_seed(9)
    offss = torch.stack([_sorted_offs(g, T) for _ in range(B)])
    sas = sa * (1 + torch.rand(B, T, generator=g))
    probe = torch.randn(T, 16, generator=g, dtype=torch.float64)

    def ref(sai, sbi, oi):
        y = torch.zeros(T, 16, dtype=torch.float64)
        start = 0
        for e, end in enumerate(oi.tolist()):
            if end > start:
                y[start:end] = ((x[start:end].double() * sai[start:end, None])
                                @ (w[e].double() * sbi[e][None, :]))
            start = max(start, end)
        return y, probe

    def loss(sai, sbi, oi):
        y = moe_gemm.scaled_grouped_mm(x, w, sai, sbi, oi, out_dtype=torch.float32)
        return (y.square() * probe.float()).sum()

    got = vmap(grad(loss, argnums=(0, 1)), in_dims=(0, None, 0))(sas, sb, offss)
    want = _per_sample(ref, (0, 1), (sas, True), (sb, False), (offss, True))
    _check_grads(got, want, "scaled_grouped_mm")

    xm, wm, sam, sbm = make_fp8_batched_inputs(E, 5, 128, 16, "row", seed=10)
    counts = torch.randint(0, 6, (B, E), generator=g, dtype=torch.int32)
    probe_m = torch.randn(E, 5, 16, generator=g, dtype=torch.float64)

    def ref_m(sbi, mi):
        y = (xm.double() * sam[..., None]) @ (wm.double() * sbi[:, None, :])
        return torch.where((torch.arange(5)[None, :] < mi[:, None])[..., None], y, 0.0), probe_m

    def loss_m(sbi, mi):
        y = moe_gemm.scaled_grouped_mm_masked(xm, wm, sam, sbi, mi, out_dtype=torch.float32)
        return (y.square() * probe_m.float()).sum()

    got = vmap(grad(loss_m), in_dims=(None, 0))(sbm, counts)
    want = _per_sample(ref_m, (0,), (sbm, False), (counts, True))
    _check_grads([got], want, "scaled_grouped_mm_masked")


def test_grad_with_out_and_vmap_of_grad_with_out() -> None:
    # An `out` under grad (torch.func's wrappers have no storage): the aliasing check raised
    # "Cannot access storage of TensorWrapper", with or without vmap. Rows the op does not
    # write keep out's values, which reach no gradient.
    g = torch.Generator().manual_seed(11)
    w, xs = torch.randn(E, K, N, generator=g), torch.randn(B, T, K, generator=g)
    offs = torch.tensor([3, 3, 7, T - 2], dtype=torch.int32)
    offss = torch.stack([_sorted_offs(g, T) for _ in range(B)])
    probe = torch.randn(T, N, generator=g, dtype=torch.float64)

    def loss(wi, xi, oi, out):
        return (moe_gemm.grouped_mm(xi, wi, oi, out=out).square() * probe.float()).sum()

    ref = lambda wi, xi, oi: (grouped_mm_ref(xi, wi, oi, torch.float64), probe)  # noqa: E731
    got = grad(loss)(w, xs[0], offs, torch.zeros(T, N))
    want = _per_sample(ref, (0,), (w, False), (xs[:1], True), (offs, False))
    _check_grads([got[None]], want, "grad, out")
    for oi, what in ((offs, "offs unbatched"), (offss, "offs batched")):
        dims = (None, 0, None if oi is offs else 0, 0)
        got = vmap(grad(loss), in_dims=dims)(w, xs, oi, torch.zeros(B, T, N))
        want = _per_sample(ref, (0,), (w, False), (xs, True), (oi, oi is offss))
        _check_grads([got], want, f"vmap(grad), out, {what}")
    # the masked form writes each entry's valid rows into a batched out
    xm, counts = torch.randn(B, E, 5, K, generator=g), torch.randint(0, 6, (B, E),
                                                                     dtype=torch.int32)
    out = torch.full((B, E, 5, N), 7.0)

    def masked(xi, mi, oi):
        y = moe_gemm.grouped_mm_masked(xi, w, mi, out=oi)
        return y.sum(), y

    got, y = vmap(grad(masked, has_aux=True))(xm, counts, out)
    valid = (torch.arange(5)[None, None, :] < counts[..., None])[..., None]
    torch.testing.assert_close(y.double(), torch.where(valid, xm.double() @ w.double(), 7.0),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.double(), torch.where(valid, w.double().sum(-1)[:, None, :]
                                                         .expand(B, E, 5, K), 0.0),
                               atol=1e-4, rtol=1e-4)


def test_vmap_of_grad_with_batched_offs_refuses_what_it_cannot_do() -> None:
    g = torch.Generator().manual_seed(12)
    w, xs = torch.randn(E, K, N, generator=g), torch.randn(B, T, K, generator=g)
    offss = torch.stack([_sorted_offs(g, T) for _ in range(B)])

    def loss(wi, xi, oi):
        return moe_gemm.grouped_mm(xi, wi, oi).square().sum()

    with pytest.raises(NotImplementedError, match=r"^Forward-mode AD \(jvp, jacfwd\) of "
                                                  r"moe_gemm's ops under torch\.vmap with "
                                                  r"batched offs, masked_m or row_index"):
        vmap(torch.func.jacfwd(loss), in_dims=(None, 0, 0))(w, xs, offss)
    with pytest.raises(NotImplementedError, match=r"^A second derivative of moe_gemm's ops"):
        vmap(grad(lambda wi, xi, oi: grad(loss)(wi, xi, oi).sum()), in_dims=(None, 0, 0))(
            w, xs, offss)
    # each entry is checked as an eager call is: a bad value names itself
    bad = offss.clone()
    bad[1, 0] = -1
    with pytest.raises(ValueError, match=r"offs must be >= 0 .*offs\[0\]=-1"):
        vmap(grad(loss), in_dims=(None, 0, 0))(w, xs, bad)
    # an empty batch: empty gradients
    assert vmap(grad(loss), in_dims=(None, 0, 0))(w, xs[:0], offss[:0]).shape == (0, E, K, N)


def test_vmap_of_grad_refuses_an_unbatched_out_as_vmap_does() -> None:
    # With grad the ops keep the eager path, whose write of a batched result into an
    # unbatched `out` raised torch's RuntimeError ("vmap: inplace arithmetic ... not
    # possible"); the message is now vmap's own, for each form.
    g = torch.Generator().manual_seed(13)
    w, xs = torch.randn(E, K, N, generator=g), torch.randn(B, T, K, generator=g)
    offs = torch.tensor([3, 3, 7, T - 2], dtype=torch.int32)
    offss = torch.stack([_sorted_offs(g, T) for _ in range(B)])
    msg = r"^grouped_mm under torch\.vmap: `out` is written in place and must be batched"
    for oi, dims in ((offs, (None, 0, None)), (offss, (None, 0, 0))):
        with pytest.raises(ValueError, match=msg):
            vmap(grad(lambda wi, xi, o: moe_gemm.grouped_mm(
                xi, wi, o, out=torch.zeros(T, N)).sum()), in_dims=dims)(w, xs, oi)
    with pytest.raises(ValueError, match=msg):
        vmap(grad(lambda wi, xi: moe_gemm.grouped_mm(xi, wi, out=torch.zeros(2, 5, N)).sum()),
             in_dims=(None, 0))(w[:2], xs[:, :10].reshape(B, 2, 5, K))
    with pytest.raises(ValueError, match=r"^grouped_gemm under torch\.vmap: `out` is written"):
        vmap(grad(lambda bi, ai: moe_gemm.grouped_gemm(
            [ai], [bi], out=[torch.zeros(T, N)])[0].sum()), in_dims=(None, 0))(w[0], xs)
    # a batched out is written, an unbatched one beside unbatched inputs too
    outs = torch.full((B, T, N), 7.0)
    got = vmap(grad(lambda wi, xi, o: moe_gemm.grouped_mm(xi, wi, offs, out=o).sum()),
               in_dims=(None, 0, 0))(w, xs, outs)
    assert got.shape == (B, E, K, N)
    got = vmap(grad(lambda wi, o: moe_gemm.grouped_mm(xs[0], wi, offs, out=torch.zeros(T, N))
                    .sum() + o.sum()), in_dims=(None, 0))(w, outs)
    assert got.shape == (B, E, K, N)
