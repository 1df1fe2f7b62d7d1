"""The FP8 ops on the CPU (the torch backend): numerics against the fp64 product of the
dequantized operands for every granularity and form, edge cases (empty experts, M=1, long K,
out=, rows past offs[-1]), and every argument error."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig, dequantize_fp8, scaled_grouped_gemm, scaled_grouped_mm
from moe_gemm.ops.scaled_reference import scaled_grouped_gemm_ref, scaled_grouped_mm_ref
from moe_gemm.testing import poison_
from moe_gemm.testing_fp8 import (
    GRANULARITIES,
    assert_fp8_close,
    fp8_errors,
    make_fp8_batched_inputs,
    make_fp8_grouped_inputs,
    make_fp8_moe_inputs,
)

E4M3 = torch.float8_e4m3fn



def _independent_ref(x, w, sa, sb, offs, granularity):
    """fp64 reference through dequantize_fp8 (not the ops' own scale views)."""
    T = x.shape[0]
    y = torch.zeros(T, w.shape[2], dtype=torch.float64)
    xd = {"block": lambda: dequantize_fp8(x, sa, "group"),
          "row": lambda: dequantize_fp8(x, sa, "row"),
          "tensor": lambda: dequantize_fp8(x, sa, "tensor")}[granularity]().double()
    start = 0
    for e, end in enumerate(offs.tolist()):
        wn = w[e].transpose(0, 1)  # (N, K)
        if granularity == "block":
            wd = dequantize_fp8(wn, sb[e].transpose(0, 1), "block")
        elif granularity == "row":
            wd = dequantize_fp8(wn, sb[e], "row")
        else:
            wd = dequantize_fp8(wn, sb[e] if sb.dim() else sb, "tensor")
        y[start:end] = xd[start:end] @ wd.double().t()
        start = end
    return y


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_varlen_matches_fp64(granularity, out_dtype):
    x, w, sa, sb, offs = make_fp8_moe_inputs(67, 5, 384, 200, granularity, empty_fraction=0.3,
                                             seed=1)
    y = scaled_grouped_mm(x, w, sa, sb, offs, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (67, 200)
    ref = scaled_grouped_mm_ref(x, w, sa, sb, offs)
    assert_fp8_close(y, ref)
    # The reference itself against one built from dequantize_fp8 independently (which
    # rounds each dequantized value to fp32: ~2^-24 relative).
    torch.testing.assert_close(ref, _independent_ref(x, w, sa, sb, offs, granularity),
                               rtol=1e-5, atol=1e-5)


def test_default_out_dtype_is_bf16_and_rows_past_offs_are_zero():
    x, w, sa, sb, offs = make_fp8_moe_inputs(40, 3, 256, 64, "block", total=30,
                                             seed=2)
    y = scaled_grouped_mm(x, w, sa, sb, offs)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y[30:].float(), torch.zeros(10, 64))
    out = poison_(torch.empty(40, 64, dtype=torch.float32))
    got = scaled_grouped_mm(x, w, sa, sb, offs, out=out)
    assert got is out
    assert torch.isnan(out[30:]).all()  # rows past offs[-1] untouched
    assert_fp8_close(out[:30], scaled_grouped_mm_ref(x, w, sa, sb, offs)[:30])


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_batched_matches_fp64(granularity):
    x, w, sa, sb = make_fp8_batched_inputs(3, 33, 256, 80, granularity, seed=3)
    y = scaled_grouped_mm(x, w, sa, sb, out_dtype=torch.float32)
    assert y.shape == (3, 33, 80)
    ref = scaled_grouped_mm_ref(x, w, sa, sb)
    assert_fp8_close(y, ref)
    # Problem by problem through the varlen form: the same product.
    offs = torch.tensor([33, 66, 99], dtype=torch.int32)
    if granularity == "tensor":
        sa2 = sa
    else:
        sa2 = sa.reshape(99, *sa.shape[2:])
    y2 = scaled_grouped_mm(x.reshape(99, 256), w, sa2, sb, offs, out_dtype=torch.float32)
    torch.testing.assert_close(y2.view(3, 33, 80), y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_grouped_gemm_matches_fp64(granularity):
    sizes = [(5, 64, 256), (0, 32, 128), (17, 200, 384), (1, 16, 128), (9, 48, 0)]
    if granularity == "block":
        sizes[-1] = (9, 48, 128)
    a, b, sa, sb = make_fp8_grouped_inputs(sizes, granularity, seed=4)
    outs = scaled_grouped_gemm(a, b, sa, sb, out_dtype=torch.float32)
    refs = scaled_grouped_gemm_ref(a, b, sa, sb)
    assert len(outs) == len(sizes)
    for o, r, (m, n, _) in zip(outs, refs, sizes):
        assert o.shape == (m, n)
        assert_fp8_close(o, r)
    given = [poison_(torch.empty(m, n, dtype=torch.bfloat16)) for m, n, _ in sizes]
    res = scaled_grouped_gemm(a, b, sa, sb, out=given)
    assert all(r is g for r, g in zip(res, given))
    for o, r in zip(given, refs):
        assert_fp8_close(o, r)
    assert scaled_grouped_gemm([], [], [], []) == []


@pytest.mark.parametrize("K", [7168, 14336])
def test_long_k_accuracy(K):
    x, w, sa, sb, offs = make_fp8_moe_inputs(6, 2, K, 32, "block", seed=5)
    y = scaled_grouped_mm(x, w, sa, sb, offs, out_dtype=torch.float32)
    e = fp8_errors(y, scaled_grouped_mm_ref(x, w, sa, sb, offs))
    assert e["rel"] < 1e-5, e  # fp32 accumulation of the dequantized products


def test_edge_cases():
    # M = 1, every expert but one empty, E = 1, N not a multiple of 128.
    x, w, sa, sb, offs = make_fp8_moe_inputs(1, 4, 128, 24, "block", empty_fraction=0.9,
                                             seed=6)
    assert_fp8_close(scaled_grouped_mm(x, w, sa, sb, offs),
                     scaled_grouped_mm_ref(x, w, sa, sb, offs))
    # E = 0 and T = 0.
    x0 = torch.zeros(5, 128, dtype=E4M3)
    y = scaled_grouped_mm(x0, torch.zeros(0, 128, 16, dtype=E4M3), torch.ones(5, 1),
                          torch.ones(0, 1, 1), torch.zeros(0, dtype=torch.int32))
    assert torch.equal(y.float(), torch.zeros(5, 16))
    y = scaled_grouped_mm(torch.zeros(0, 128, dtype=E4M3), w, torch.ones(0, 1), sb,
                          torch.zeros(4, dtype=torch.int32))
    assert y.shape == (0, 24)
    # A single global B scale with row-wise A scales (the outer product still applies).
    x, w, sa, sb, offs = make_fp8_moe_inputs(9, 2, 128, 16, "row", seed=7)
    y = scaled_grouped_mm(x, w, sa, torch.tensor(0.5), offs, out_dtype=torch.float32)
    ref = scaled_grouped_mm_ref(x, w, sa, torch.tensor(0.5).expand(2), offs)
    assert_fp8_close(y, ref)


def test_backward_through_the_torch_backend():
    x, w, sa, sb, offs = make_fp8_moe_inputs(8, 2, 128, 16, "row", seed=8)
    sa = sa.clone().requires_grad_(True)
    y = scaled_grouped_mm(x, w, sa, sb, offs, out_dtype=torch.float32,
                          config=GemmConfig(backend="torch"))
    y.sum().backward()
    assert sa.grad is not None and sa.grad.shape == sa.shape


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("case", ["no rows routed", "no experts", "out"])
def test_backward_when_no_row_reaches_an_expert(granularity, case):
    """Scales that require grad and no product reaching the result (every expert empty, no
    experts, an expert-parallel rank that received no tokens): the result is still in the
    scales' graph, as grouped_mm's torch path keeps it, so a backward gives zero gradients
    (it raised "element 0 of tensors does not require grad")."""
    x, w, sa, sb, _ = make_fp8_moe_inputs(6, 2, 256, 16, granularity, seed=44)
    offs = torch.zeros(2, dtype=torch.int32)
    if case == "no experts":
        w, offs = w[:0], offs[:0]
        sb = sb[:0] if granularity != "tensor" else sb.reshape(-1)[:0]
    sa = sa.clone().requires_grad_(True)
    sb = sb.clone().requires_grad_(True)
    out = poison_(torch.empty(6, 16)) if case == "out" else None
    y = scaled_grouped_mm(x, w, sa, sb, offs, out=out, out_dtype=torch.float32)
    assert y.requires_grad
    if out is None:
        assert torch.equal(y, torch.zeros(6, 16))
    else:
        assert y is out and torch.isnan(y).all()  # rows past offs[-1] untouched
    y.nan_to_num().sum().backward()
    for s in (sa, sb):
        assert s.grad is not None and torch.equal(s.grad, torch.zeros_like(s))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("form", ["varlen", "batched", "masked"])
def test_vmap_of_grad_gives_per_sample_scale_gradients(granularity, form):
    """vmap(grad(f)) over the scales and the activations (per-sample gradients of the weight
    scales), on torch's path: it failed inside torch (the products were written into a
    preallocated tensor, which cannot take a batched value)."""
    from torch.func import grad, vmap

    B = 3
    if form == "varlen":
        xs, sas = [], []
        for b in range(B):
            x, w, sa, sb, offs = make_fp8_moe_inputs(11, 3, 256, 24, granularity, seed=45 + b,
                                                     empty_fraction=0.3, total=9)
            xs.append(x)
            sas.append(sa)
        offs = torch.tensor([4, 4, 9], dtype=torch.int32)
        run = lambda xi, sai, sbi: scaled_grouped_mm(  # noqa: E731
            xi, w, sai, sbi, offs, out_dtype=torch.float32)
    else:
        xs, sas = [], []
        for b in range(B):
            x, w, sa, sb = make_fp8_batched_inputs(2, 5, 256, 24, granularity, seed=45 + b)
            xs.append(x)
            sas.append(sa)
        counts = torch.tensor([3, 5], dtype=torch.int32)
        if form == "batched":
            run = lambda xi, sai, sbi: scaled_grouped_mm(  # noqa: E731
                xi, w, sai, sbi, out_dtype=torch.float32)
        else:
            run = lambda xi, sai, sbi: moe_gemm.scaled_grouped_mm_masked(  # noqa: E731
                xi, w, sai, sbi, counts, out_dtype=torch.float32)
    gen = torch.Generator().manual_seed(46)
    probe = torch.randn(*run(xs[0], sas[0], sb).shape, generator=gen)

    def loss(sbi, xi, sai):
        return (run(xi, sai, sbi) * probe).sum()

    got_b, got_a = vmap(grad(loss, argnums=(0, 2)), in_dims=(None, 0, 0))(
        sb, torch.stack(xs), torch.stack(sas))
    assert got_b.shape == (B, *sb.shape) and got_a.shape == (B, *sas[0].shape)
    for b in range(B):
        sb_ref = sb.clone().requires_grad_(True)
        sa_ref = sas[b].clone().requires_grad_(True)
        ref = _fp64_product(xs[b], w, sa_ref, sb_ref, granularity,
                            offs if form == "varlen" else None)
        if form == "masked":
            ref = ref * (torch.arange(5)[None, :, None] < counts[:, None, None])
        (ref * probe.double()).sum().backward()
        # (fp32 accumulation of sums with cancellation: compared in norm)
        for got, want in ((got_b[b], sb_ref.grad), (got_a[b], sa_ref.grad)):
            e = fp8_errors(got, want)
            assert e["rel"] < 1e-5, e


def _fp64_product(x, w, sa, sb, granularity, offs=None):
    """The fp64 product of the dequantized operands, differentiable in the scales (the
    scales expanded here, not through the ops' scale views): (T, N) with rows past offs[-1]
    zero, or (G, M, N) with offs None."""
    K, N = x.shape[-1], w.shape[2]

    def deq_a(xr, s):
        if granularity == "block":
            return xr.double() * s.double().repeat_interleave(128, -1)
        return xr.double() * (s.double()[..., None] if granularity == "row" else s.double())

    def deq_b(we, s):
        if granularity == "block":
            s = s.double().repeat_interleave(128, 0)[:K].repeat_interleave(128, 1)[:, :N]
            return we.double() * s
        return we.double() * s.double()

    if offs is None:
        return torch.stack([deq_a(x[g], sa if sa.dim() == 0 else sa[g]) @ deq_b(w[g], sb[g])
                            for g in range(x.shape[0])])
    xd, parts, start = deq_a(x, sa), [], 0
    for e, end in enumerate(offs.tolist()):
        parts.append(xd[start:end] @ deq_b(w[e], sb[e]))
        start = end
    parts.append(xd.new_zeros(x.shape[0] - start, N))
    return torch.cat(parts)


@pytest.mark.parametrize("form", ["varlen", "batched", "general", "masked"])
@pytest.mark.parametrize("operand", [0, 1])
def test_fp8_operands_that_require_grad_raise_at_backward(form, operand):
    """An FP8 operand that requires grad (an nn.Parameter of FP8 weights keeps torch's
    default requires_grad=True): the forward runs and gives the values it gives without;
    a backward raises naming the FP8 operands (it failed inside torch, which has no addition
    for float8 gradients, or returned an unscaled FP8 gradient), in every form."""
    if form == "varlen":
        *ops, sa, sb, offs = make_fp8_moe_inputs(12, 3, 256, 32, "block", seed=40)
        run = lambda a, b: scaled_grouped_mm(a, b, sa, sb, offs)  # noqa: E731
    elif form == "batched":
        *ops, sa, sb = make_fp8_batched_inputs(2, 5, 128, 16, "row", seed=41)
        run = lambda a, b: scaled_grouped_mm(a, b, sa, sb)  # noqa: E731
    elif form == "masked":
        *ops, sa, sb = make_fp8_batched_inputs(2, 5, 128, 16, "block", seed=42)
        counts = torch.tensor([3, 5], dtype=torch.int32)
        run = lambda a, b: moe_gemm.scaled_grouped_mm_masked(a, b, sa, sb, counts)  # noqa: E731
    else:
        a, b, sa, sb = make_fp8_grouped_inputs([(4, 16, 128), (3, 8, 256)], "row", seed=43)
        ops = [a[0], b[0]]
        run = lambda a0, b0: scaled_grouped_gemm([a0, a[1]], [b0, b[1]], sa, sb)[0]  # noqa: E731
    want = run(*ops)
    tracked = list(ops)
    tracked[operand] = torch.nn.Parameter(ops[operand])  # requires_grad=True
    y = run(*tracked)
    assert y.requires_grad and torch.equal(y, want)
    with pytest.raises(RuntimeError, match="no gradient for their FP8 operands"):
        y.float().sum().backward()
    with torch.no_grad():
        assert not run(*tracked).requires_grad


def test_backend_cute_refused_on_cpu():
    x, w, sa, sb, offs = make_fp8_moe_inputs(8, 2, 128, 16, "block", seed=9)
    with pytest.raises(RuntimeError, match="backend='cute' cannot run here"):
        scaled_grouped_mm(x, w, sa, sb, offs, config=GemmConfig(backend="cute"))


# ---------------------------------------------------------------------------------------------
# errors


def _args(granularity="block", T=6, E=2, K=256, N=64):
    return list(make_fp8_moe_inputs(T, E, K, N, granularity, seed=10))


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.__setitem__(0, a[0].float()), TypeError, "x must be torch.float8_e4m3fn"),
    (lambda a: a.__setitem__(1, a[1].to(torch.float8_e5m2)), TypeError, "must match"),
    (lambda a: a.__setitem__(0, "x"), TypeError, "x must be a torch.Tensor"),
    (lambda a: a.__setitem__(2, a[2].double()), TypeError, "scale_a must be float32"),
    (lambda a: a.__setitem__(3, a[3].bfloat16()), TypeError, "scale_b must be float32"),
    (lambda a: a.__setitem__(3, [1.0]), TypeError, "scale_b must be a torch.Tensor"),
    (lambda a: a.__setitem__(4, a[4].long()), TypeError, "offs must be int32"),
    (lambda a: a.__setitem__(4, a[4][:1]), ValueError, "one entry per expert"),
    (lambda a: a.__setitem__(4, torch.tensor([4, 2], dtype=torch.int32)), ValueError,
     "non-decreasing"),
    (lambda a: a.__setitem__(4, torch.tensor([4, 9], dtype=torch.int32)), ValueError,
     "offs\\[-1\\] must be <= T"),
    (lambda a: a.__setitem__(0, a[0][None]), ValueError, "x must be 2-D"),
    (lambda a: a.__setitem__(1, a[1][0]), ValueError, "w must be 3-D"),
    (lambda a: a.__setitem__(1, a[1][:, :128]), ValueError, "so w must be"),
    (lambda a: a.__setitem__(2, a[2][:, :1]), ValueError, "match no granularity"),
    (lambda a: a.__setitem__(3, a[3][:, :, :0]), ValueError, "match no granularity"),
    (lambda a: a.__setitem__(3, a[3].transpose(1, 2)), ValueError, "match no granularity"),
    (lambda a: a.__setitem__(2, torch.ones(6)), ValueError, "match no granularity"),
])
def test_argument_errors(change, error, match):
    a = _args()
    change(a)
    with pytest.raises(error, match=match):
        scaled_grouped_mm(*a)


def test_k_not_a_multiple_of_128_for_block_scales():
    x = torch.zeros(4, 200, dtype=E4M3)
    w = torch.zeros(2, 200, 32, dtype=E4M3)
    with pytest.raises(ValueError, match="multiple of 128; got K=200"):
        scaled_grouped_mm(x, w, torch.ones(4, 1), torch.ones(2, 1, 1),
                          torch.tensor([2, 4], dtype=torch.int32))
    # Row-wise scales take any K.
    y = scaled_grouped_mm(x, w, torch.ones(4), torch.ones(2, 32),
                          torch.tensor([2, 4], dtype=torch.int32))
    assert torch.equal(y.float(), torch.zeros(4, 32))


def test_out_and_out_dtype_errors():
    x, w, sa, sb, offs = _args()
    with pytest.raises(TypeError, match="out_dtype must be"):
        scaled_grouped_mm(x, w, sa, sb, offs, out_dtype=torch.int8)
    with pytest.raises(TypeError, match="out_dtype must be a torch.dtype"):
        scaled_grouped_mm(x, w, sa, sb, offs, out_dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out must be"):
        scaled_grouped_mm(x, w, sa, sb, offs, out=torch.empty(6, 63, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out must have dtype"):
        scaled_grouped_mm(x, w, sa, sb, offs, out=torch.empty(6, 64, dtype=torch.float16),
                          out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share memory"):
        scaled_grouped_mm(x, w, sa, sb, offs,
                          out=torch.empty(1, 64, dtype=torch.bfloat16).expand(6, 64))
    # An out of an unsupported dtype (no out_dtype): the message names out, not out_dtype.
    with pytest.raises(TypeError, match="out's dtype must be torch.bfloat16"):
        scaled_grouped_mm(x, w, sa, sb, offs, out=torch.empty(6, 64, dtype=torch.int32))
    with pytest.raises(TypeError, match="out's dtype must be"):
        scaled_grouped_gemm([x], [w[0]], [sa], [sb[0]],
                            out=[torch.empty(6, 64, dtype=torch.float64)])
    with pytest.raises(TypeError, match="config must be a moe_gemm.GemmConfig"):
        scaled_grouped_mm(x, w, sa, sb, offs, config="torch")  # type: ignore[arg-type]


def test_batched_and_list_errors():
    x, w, sa, sb = make_fp8_batched_inputs(2, 4, 128, 32, "row", seed=11)
    with pytest.raises(ValueError, match="x must be 3-D"):
        scaled_grouped_mm(x[0], w, sa, sb)
    with pytest.raises(ValueError, match="match no granularity"):
        scaled_grouped_mm(x, w, sa[:, :3], sb)
    a, b, sa, sb = make_fp8_grouped_inputs([(4, 32, 128), (2, 16, 256)], "block",
                                           seed=12)
    with pytest.raises(ValueError, match="one b, scale_a and scale_b per a"):
        scaled_grouped_gemm(a, b, sa[:1], sb)
    with pytest.raises(ValueError, match="problem 1: .*match no granularity"):
        scaled_grouped_gemm(a, b, [sa[0], sa[1][:, :1]], sb)
    with pytest.raises(ValueError, match="problem 1 has row scales"):
        scaled_grouped_gemm(a, b, [sa[0], torch.ones(2)], [sb[0], torch.ones(16)])
    with pytest.raises(ValueError, match="problem 1 has tensor scales"):
        scaled_grouped_gemm(a, b, [sa[0], torch.ones(())], [sb[0], torch.ones(1)])
    with pytest.raises(TypeError, match="single tensor"):
        scaled_grouped_gemm(a[0], b, sa, sb)
    with pytest.raises(TypeError, match="share one FP8 dtype"):
        scaled_grouped_gemm(a, [b[0], b[1].to(torch.float8_e5m2)], sa, sb)
    with pytest.raises(ValueError, match="must be \\(K, N\\)"):
        scaled_grouped_gemm(a, [b[1], b[0]], sa, sb)


def test_grouped_gemm_mixes_row_wise_and_per_tensor_problems():
    """A 1 x 1 problem's row-wise scales ((1,) and (1,)) read as per-tensor ones; they, and
    true per-tensor problems, run beside row-wise problems in either order."""
    gen = torch.Generator().manual_seed(31)
    qr = moe_gemm.quantize_fp8_per_row
    shapes = [(1, 1, 128), (5, 3, 128), (4, 24, 256)]
    a, b, sa, sb = [], [], [], []
    for i, (m, n, k) in enumerate(shapes):
        ai, sai = qr(torch.randn(m, k, generator=gen))
        bi, sbi = qr(torch.randn(n, k, generator=gen))
        if i == 2:  # per tensor
            sai, sbi = sai.max().reshape(()), sbi.max().reshape(1)
        a.append(ai)
        b.append(bi.t())
        sa.append(sai)
        sb.append(sbi)
    for order in ([0, 1, 2], [1, 0, 2], [2, 0, 1]):
        pick = [(a[i], b[i], sa[i], sb[i]) for i in order]
        args = [list(t) for t in zip(*pick)]
        outs = scaled_grouped_gemm(*args, out_dtype=torch.float32)
        for o, r in zip(outs, scaled_grouped_gemm_ref(*args)):
            assert_fp8_close(o, r)
        for o, (ai, bi, sai, sbi) in zip(outs, pick):
            ref = (ai.double() * sai.double().reshape(-1, 1)) @ (
                bi.double() * sbi.double().reshape(1, -1))
            torch.testing.assert_close(o.double(), ref, rtol=1e-5, atol=1e-5)


def test_grouped_gemm_refuses_outputs_that_overlap():
    a, b, sa, sb = make_fp8_grouped_inputs([(4, 8, 128), (4, 8, 128)], "row", seed=32)
    o = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory"):
        scaled_grouped_gemm(a, b, sa, sb, out=[o, o])
    buf = torch.zeros(15, 8, dtype=torch.bfloat16)
    a, b, sa, sb = make_fp8_grouped_inputs([(5, 8, 128), (15, 8, 128)], "row", seed=33)
    with pytest.raises(ValueError, match="share memory"):
        scaled_grouped_gemm(a, b, sa, sb, out=[buf[:5], buf])
    # disjoint views of one buffer are fine
    res = scaled_grouped_gemm(a[:1] * 2, b[:1] * 2, sa[:1] * 2, sb[:1] * 2,
                              out=[buf[:5], buf[5:10]])
    ref = scaled_grouped_gemm_ref(a[:1], b[:1], sa[:1], sb[:1])[0]
    for r in res:
        assert_fp8_close(r, ref)


def test_public_names():
    for name in ("scaled_grouped_mm", "scaled_grouped_gemm", "quantize_fp8_per_token_group",
                 "quantize_fp8_per_block", "quantize_fp8_per_row", "quantize_fp8_per_tensor",
                 "dequantize_fp8"):
        assert name in moe_gemm.__all__ and callable(getattr(moe_gemm, name))


def test_fnuz_operands_are_named_as_such():
    # (the hint said "quantize it first" of a tensor that already is FP8)
    x = torch.zeros(4, 128).to(torch.float8_e4m3fnuz)
    w = torch.zeros(2, 128, 16).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="got torch.float8_e4m3fnuz .the fnuz encodings"):
        scaled_grouped_mm(x, w, torch.ones(4), torch.ones(2, 16),
                          torch.tensor([2, 4], dtype=torch.int32))
