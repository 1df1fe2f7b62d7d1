"""moe_gemm.reference (the torch backend and the test references) and moe_gemm.testing.

The torch backend functions are called directly here, past validation, for the one behaviour the
public API cannot reach on the CPU: offs values that are never checked on the GPU (decreasing
entries, values outside [0, T]) must be clamped, never read or written out of bounds.
"""

from __future__ import annotations

import pytest
import torch

from moe_gemm.ops.reference import (
    expert_spans,
    grouped_gemm_ref,
    grouped_gemm_torch,
    grouped_mm_ref,
    grouped_mm_torch,
)
from moe_gemm.ops.validation import GroupedGemmArgs, GroupedMmArgs
from moe_gemm.testing import (
    DEFAULT_MAX_CALC_DIFF,
    assert_close_to_ref,
    calc_diff,
    make_grouped_inputs,
    make_moe_inputs,
    poison_,
    random_offs,
    random_problem_sizes,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mm_args(x: torch.Tensor, w: torch.Tensor, offs: list[int], out: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> GroupedMmArgs:
    """Arguments as validation would build them, but with offs values never checked."""
    return GroupedMmArgs(x, w, torch.tensor(offs, dtype=torch.int32), out, x.dtype,
                         out_dtype or (out.dtype if out is not None else x.dtype))


def _rows_ref(x: torch.Tensor, w: torch.Tensor, spans: list[tuple[int, int, int]], T: int,
              N: int) -> torch.Tensor:
    """float64 result with expert e on rows [lo, hi) for each (e, lo, hi) in spans."""
    y = torch.zeros(T, N, dtype=torch.float64)
    for e, lo, hi in spans:
        y[lo:hi] = x[lo:hi].double() @ w[e].double()
    return y


# --------------------------------------------------------------------------------------------
# References


@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_gemm_ref(ref_dtype: torch.dtype, dtype: torch.dtype) -> None:
    sizes = [(3, 5, 7), (0, 2, 3), (4, 0, 2), (2, 3, 0), (1, 1, 1)]
    a, b = make_grouped_inputs(sizes, dtype, b_layout="mixed", generator=_gen(1))
    refs = grouped_gemm_ref(a, b, ref_dtype)
    assert len(refs) == len(sizes)
    for (m, n, k), r, ai, bi in zip(sizes, refs, a, b):
        assert r.shape == (m, n) and r.dtype == ref_dtype
        # Element by element, as a sum of products in float64.
        expect = torch.zeros(m, n, dtype=torch.float64)
        for i in range(m):
            for j in range(n):
                expect[i, j] = sum(float(ai[i, t]) * float(bi[t, j]) for t in range(k))
        torch.testing.assert_close(r.double(), expect, rtol=1e-6, atol=1e-6)


def test_grouped_gemm_ref_default_is_float32() -> None:
    a, b = make_grouped_inputs([(2, 3, 4)], torch.bfloat16, generator=_gen(2))
    assert grouped_gemm_ref(a, b)[0].dtype == torch.float32


@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.float64])
def test_grouped_mm_ref(ref_dtype: torch.dtype) -> None:
    x, w, _ = make_moe_inputs(12, 4, 6, 5, torch.bfloat16, generator=_gen(3))
    offs = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    y = grouped_mm_ref(x, w, offs, ref_dtype)
    assert y.dtype == ref_dtype and y.shape == (12, 5)
    expect = _rows_ref(x, w, [(1, 0, 4), (3, 4, 9)], 12, 5)
    torch.testing.assert_close(y.double(), expect, rtol=1e-6, atol=1e-6)
    assert (y[9:] == 0).all()


def test_grouped_mm_ref_decreasing_entry_is_empty_expert() -> None:
    x, w, _ = make_moe_inputs(10, 3, 4, 3, torch.float32, generator=_gen(4))
    y = grouped_mm_ref(x, w, torch.tensor([6, 2, 8], dtype=torch.int32), torch.float64)
    torch.testing.assert_close(y, _rows_ref(x, w, [(0, 0, 6), (2, 6, 8)], 10, 3))


# --------------------------------------------------------------------------------------------
# The torch backend, past validation


@pytest.mark.parametrize(
    "offs, spans",
    [
        ([3, 1, 6], [(0, 0, 3), (2, 3, 6)]),  # decreasing entry: expert 1 is empty
        ([-4, 5, 7], [(1, 0, 5), (2, 5, 7)]),  # negative: clamped to 0
        ([3, 50, 60], [(0, 0, 3), (1, 3, 10)]),  # past T: clamped, no out-of-bounds write
        ([8, 2, 2], [(0, 0, 8)]),  # later entries below an earlier one: all empty
    ],
)
def test_grouped_mm_torch_clamps_unchecked_offs(offs: list[int],
                                                spans: list[tuple[int, int, int]]) -> None:
    x, w, _ = make_moe_inputs(10, 3, 8, 4, torch.float32, generator=_gen(5))
    expect = _rows_ref(x, w, spans, 10, 4)
    y = grouped_mm_torch(_mm_args(x, w, offs))
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-5)
    # With out: covered rows written, the rest untouched (NaN stays NaN).
    out = poison_(torch.empty(10, 4))
    grouped_mm_torch(_mm_args(x, w, offs, out=out))
    covered = torch.zeros(10, dtype=torch.bool)
    for _, lo, hi in spans:
        covered[lo:hi] = True
    assert torch.isnan(out[~covered]).all()
    torch.testing.assert_close(out[covered].double(), expect[covered], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_grouped_mm_torch_out_dtype(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    x, w, offs = make_moe_inputs(30, 4, 16, 8, dtype, "cpu", "nk_view", total=25,
                                 generator=_gen(6))
    args = GroupedMmArgs(x, w, offs, None, dtype, out_dtype)
    y = grouped_mm_torch(args)
    assert y.dtype == out_dtype
    assert_close_to_ref(y, grouped_mm_ref(x, w, offs, torch.float64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_grouped_gemm_torch_out_dtype(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    sizes = [(4, 6, 8), (1, 3, 5), (0, 2, 2)]
    a, b = make_grouped_inputs(sizes, dtype, b_layout="col", generator=_gen(7))
    args = GroupedGemmArgs(a, b, None, dtype, out_dtype, torch.device("cpu"))
    outs = grouped_gemm_torch(args)
    for o, r in zip(outs, grouped_gemm_ref(a, b, torch.float64)):
        assert o.dtype == out_dtype
        assert_close_to_ref(o, r)


# --------------------------------------------------------------------------------------------
# moe_gemm.testing: calc_diff


def test_calc_diff_values() -> None:
    x = torch.randn(64, 64, generator=_gen(8))
    assert calc_diff(x, x) == 0.0
    assert calc_diff(x, -x) == pytest.approx(2.0)
    assert calc_diff(x, 2 * x) == pytest.approx(1 - 4 / 5)
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert calc_diff(torch.zeros(0), torch.zeros(0)) == 0.0
    bf = calc_diff(x.bfloat16(), x)
    assert 0 < bf < DEFAULT_MAX_CALC_DIFF
    assert calc_diff(x.half(), x) < bf  # fp16 keeps 3 more mantissa bits


def test_calc_diff_is_computed_in_float64() -> None:
    # Differences below fp32 resolution of the sums still show in float64.
    x = torch.ones(1000, dtype=torch.float32)
    y = x.clone()
    y[0] = 1 + 2**-20
    assert calc_diff(x, y) > 0


def test_calc_diff_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="equal shapes"):
        calc_diff(torch.zeros(2, 3), torch.zeros(3, 2))


def test_calc_diff_nan_propagates() -> None:
    x = torch.randn(10)
    y = x.clone()
    y[3] = float("nan")
    assert calc_diff(x, y) != calc_diff(x, y)  # NaN


# --------------------------------------------------------------------------------------------
# moe_gemm.testing: assert_close_to_ref


def test_assert_close_passes_rounding_error() -> None:
    ref = torch.randn(50, 40, generator=_gen(9), dtype=torch.float64)
    for dt in DTYPES:
        out = ref.to(dt)
        assert_close_to_ref(out, ref)  # table fallback
        assert_close_to_ref(out, ref, ref.to(dt))  # 2x rule


def test_assert_close_two_x_rule_bound() -> None:
    ref = torch.zeros(4, dtype=torch.float64)
    baseline = torch.tensor([0.0, 0.01, 0.0, 0.0])
    assert_close_to_ref(torch.tensor([0.0, 0.0, 0.02, 0.0]), ref, baseline, atol=0.0,
                        max_calc_diff=None)
    with pytest.raises(AssertionError, match=r"> 2 \* max\|baseline - ref\| \+ atol"):
        assert_close_to_ref(torch.tensor([0.0, 0.0, 0.0201, 0.0]), ref, baseline, atol=0.0,
                            max_calc_diff=None)
    # atol adds slack on top of twice the baseline error.
    assert_close_to_ref(torch.tensor([0.0, 0.0, 0.0201, 0.0]), ref, baseline, atol=1e-3,
                        max_calc_diff=None)


def test_assert_close_catches_a_single_bad_element() -> None:
    ref = torch.randn(64, 64, generator=_gen(10), dtype=torch.float64)
    out = ref.to(torch.bfloat16)
    out[17, 3] += 0.5
    with pytest.raises(AssertionError, match=r"index \(17, 3\)"):
        assert_close_to_ref(out, ref, ref.to(torch.bfloat16))
    with pytest.raises(AssertionError, match=r"index \(17, 3\)"):
        assert_close_to_ref(out, ref)


def test_assert_close_catches_unwritten_poison() -> None:
    ref = torch.randn(8, 8, generator=_gen(11), dtype=torch.float64)
    out = ref.float()
    out[5, 6] = float("nan")
    with pytest.raises(AssertionError, match=r"non-finite .*index \(5, 6\)"):
        assert_close_to_ref(out, ref, ref.float())


def test_assert_close_matching_nonfinite_is_fine() -> None:
    ref = torch.tensor([1.0, float("nan"), float("inf"), -2.0], dtype=torch.float64)
    assert_close_to_ref(ref.float(), ref, ref.float())
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_to_ref(torch.tensor([1.0, float("nan"), -float("inf"), -2.0]), ref)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_to_ref(torch.tensor([1.0, 0.0, float("inf"), -2.0]), ref)


def test_assert_close_calc_diff_guard() -> None:
    # Every element within the loose table tolerance, but systematically off: calc_diff sees it.
    ref = torch.randn(100, generator=_gen(12), dtype=torch.float64)
    out = (ref * 1.009).to(torch.float32)
    with pytest.raises(AssertionError, match="calc_diff"):
        assert_close_to_ref(out, ref, atol=1e-2)
    assert_close_to_ref(out, ref, atol=1e-2, max_calc_diff=None)


def test_assert_close_shapes_and_empty() -> None:
    with pytest.raises(AssertionError, match="shape"):
        assert_close_to_ref(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(AssertionError, match="baseline has shape"):
        assert_close_to_ref(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))
    assert_close_to_ref(torch.zeros(0, 5), torch.zeros(0, 5))
    assert_close_to_ref(torch.zeros(4, 0), torch.zeros(4, 0), torch.zeros(4, 0))


def test_assert_close_table_uses_output_dtype() -> None:
    ref = torch.full((4,), 100.0, dtype=torch.float64)
    # 0.5 off at 100: inside bf16's 1e-2 relative tolerance, outside fp32's 1e-4.
    assert_close_to_ref((ref + 0.5).to(torch.bfloat16), ref, max_calc_diff=None)
    with pytest.raises(AssertionError):
        assert_close_to_ref((ref + 0.5).float(), ref, max_calc_diff=None)


# --------------------------------------------------------------------------------------------
# moe_gemm.testing: generators


def test_poison() -> None:
    t = poison_(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert torch.isnan(t).all()
    i = poison_(torch.zeros(3, dtype=torch.int32))
    assert (i == torch.iinfo(torch.int32).max).all()
    assert poison_(torch.zeros(2, dtype=torch.bool)).all()


def test_random_problem_sizes() -> None:
    sizes = random_problem_sizes(200, m_range=(0, 50), n_range=(1, 40), k_range=(3, 30),
                                 empty_fraction=0.25, align_n=8, align_k=4, generator=_gen(13))
    assert len(sizes) == 200
    assert all(0 <= m <= 50 and n % 8 == 0 and 8 <= n <= 40 and k % 4 == 0 and 4 <= k <= 32
               for m, n, k in sizes)
    empties = sum(m == 0 for m, _, _ in sizes)
    assert 25 <= empties <= 90
    assert len({s for s in sizes}) > 100  # actually random
    again = random_problem_sizes(200, m_range=(0, 50), n_range=(1, 40), k_range=(3, 30),
                                 empty_fraction=0.25, align_n=8, align_k=4, generator=_gen(13))
    assert again == sizes  # reproducible from the generator
    assert random_problem_sizes(0) == []
    with pytest.raises(ValueError):
        random_problem_sizes(3, empty_fraction=1.5)


@pytest.mark.parametrize("empty_fraction", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("skew", [0.0, 3.0])
def test_random_offs(empty_fraction: float, skew: float) -> None:
    g = _gen(14)
    for T, E in [(1000, 16), (7, 3), (1, 1), (500, 64)]:
        offs = random_offs(T, E, empty_fraction, g, skew=skew)
        assert offs.dtype == torch.int32 and offs.shape == (E,)
        counts = torch.diff(offs, prepend=torch.zeros(1, dtype=torch.int32))
        assert (counts >= 0).all() and int(offs[-1]) == T
        if empty_fraction == 0.0 and T >= 100 * E and skew == 0.0:
            assert (counts > 0).all()
    big = random_offs(6400, 64, 0.5, _gen(15))
    counts = torch.diff(big, prepend=torch.zeros(1, dtype=torch.int32))
    assert 10 <= int((counts == 0).sum()) <= 54


def test_random_offs_skew_concentrates_rows() -> None:
    flat = random_offs(10000, 32, 0.0, _gen(16), skew=0.0)
    steep = random_offs(10000, 32, 0.0, _gen(16), skew=2.0)
    top = lambda o: int(torch.diff(o, prepend=torch.zeros(1, dtype=torch.int32)).max())
    assert top(steep) > 3 * top(flat)


def test_random_offs_total_and_edges() -> None:
    offs = random_offs(100, 5, 0.0, _gen(17), total=60)
    assert int(offs[-1]) == 60
    assert torch.equal(random_offs(0, 4), torch.zeros(4, dtype=torch.int32))
    assert random_offs(0, 0).shape == (0,)
    assert torch.equal(random_offs(9, 3, 1.0, total=0), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError):
        random_offs(10, 3, total=11)
    with pytest.raises(ValueError):
        random_offs(10, 0)
    with pytest.raises(ValueError):
        random_offs(10, 3, 1.0)  # every expert empty but 10 rows to place


def test_make_grouped_inputs_layouts() -> None:
    sizes = [(3, 5, 7), (2, 4, 6), (4, 3, 2)]
    a, b = make_grouped_inputs(sizes, torch.float16, b_layout="col", generator=_gen(18))
    assert [tuple(t.shape) for t in a] == [(3, 7), (2, 6), (4, 2)]
    assert [tuple(t.shape) for t in b] == [(7, 5), (6, 4), (2, 3)]
    assert all(t.dtype == torch.float16 for t in a + b)
    assert all(t.stride() == (1, t.shape[0]) for t in b)  # w.T of a contiguous (N, K)
    _, b_mixed = make_grouped_inputs(sizes, torch.float32, b_layout="mixed", generator=_gen(18))
    assert [t.is_contiguous() for t in b_mixed] == [True, False, True]
    a2, _ = make_grouped_inputs(sizes, torch.float16, b_layout="col", generator=_gen(18))
    assert all(torch.equal(x, y) for x, y in zip(a, a2))
    assert all(t.abs().sum() > 0 for t in a)
    with pytest.raises(ValueError, match="b_layout"):
        make_grouped_inputs(sizes, torch.float32, b_layout="diag")


def test_make_moe_inputs_layouts() -> None:
    x, w, offs = make_moe_inputs(40, 5, 16, 24, torch.bfloat16, w_layout="nk_view",
                                 generator=_gen(19))
    assert x.shape == (40, 16) and w.shape == (5, 16, 24) and offs.shape == (5,)
    assert w.stride() == (24 * 16, 1, 16)
    assert int(offs[-1]) == 40 and offs.dtype == torch.int32
    _, w_kn, _ = make_moe_inputs(40, 5, 16, 24, torch.bfloat16, w_layout="kn",
                                 generator=_gen(19))
    assert w_kn.is_contiguous()
    with pytest.raises(ValueError, match="w_layout"):
        make_moe_inputs(4, 2, 4, 4, torch.float32, w_layout="nk")


def test_expert_spans_clamp_and_skip_empty_and_decreasing_entries():
    offs = torch.tensor([3, 3, 10, 7, 12, 40], dtype=torch.int32)
    # rows 0-2 expert 0; expert 1 empty; 3-9 expert 2; 7 < 10: expert 3 empty; 10-11 expert
    # 4; 40 clamped to 15 rows: 12-14 expert 5
    assert expert_spans(offs, 15) == [(0, 0, 3), (2, 3, 10), (4, 10, 12), (5, 12, 15)]
    assert expert_spans(torch.tensor([-4, 2], dtype=torch.int32), 5) == [(1, 0, 2)]
    assert expert_spans(torch.zeros(0, dtype=torch.int32), 5) == []


class _UnwrittenRows(torch.autograd.Function):
    """x as it is, whose gradient's rows past offs[-1] come back NaN: what torch's grouped_mm
    backward leaves there (its result's rows past offs[-1] are never written; on torch 2.13's
    CPU loop, the one fp16/fp32 run on CUDA too, stray values or NaN in 8 of 9 backwards)."""

    @staticmethod
    def forward(ctx, x, offs):
        ctx.end = int(offs[-1])
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[ctx.end:] = float("nan")
        return grad, None


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"),
                    reason="torch without grouped_mm")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_out", [False, True])
def test_torch_grouped_mm_path_gives_rows_past_offs_zero_gradients(monkeypatch, dtype,
                                                                   with_out) -> None:
    # The CUDA path through torch's grouped_mm, taken here on the CPU (same op, same backward).
    from moe_gemm.ops import reference

    real = reference.F.grouped_mm
    monkeypatch.setattr(reference, "_grouped_mm_native_ok", lambda args: True)
    monkeypatch.setattr(reference.F, "grouped_mm", lambda x, w, offs=None, out_dtype=None: real(
        _UnwrittenRows.apply(x, offs), w, offs=offs, out_dtype=out_dtype))
    x, w, _ = make_moe_inputs(40, 4, 24, 16, dtype, generator=_gen(9))
    offs = torch.tensor([10, 10, 25, 31], dtype=torch.int32)  # an empty expert, rows 31.. none
    x, w = x.requires_grad_(), w.requires_grad_()
    out = torch.zeros(40, 16, dtype=dtype) if with_out else None
    y = grouped_mm_torch(GroupedMmArgs(x, w, offs, out, dtype, dtype))
    g = torch.randn(40, 16, generator=_gen(10)).to(dtype)
    y.backward(g)
    assert torch.equal(x.grad[31:], torch.zeros_like(x.grad[31:]))
    x_ref, w_ref = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    grouped_mm_ref(x_ref, w_ref, offs, torch.float64).backward(g.double())
    assert_close_to_ref(x.grad[:31], x_ref.grad[:31])
    assert_close_to_ref(w.grad, w_ref.grad)


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"),
                    reason="torch without grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("ends", [[10, 10, 25, 31], [10, 8, 25, 50], [-3, 12, 40, 40]])
def test_torch_grouped_mm_host_offs_path(monkeypatch, dtype, with_out, ends) -> None:
    # fp16 / fp32 through torch's grouped_mm (its CUDA path is a host loop, taken here on the
    # CPU): offs read once on the host; valid ones reach torch as the caller's own tensor,
    # others clamped as the kernels read them (a decreasing entry an empty expert, entries
    # within [0, T]); rows past the last expert zero, or untouched in `out`.
    from moe_gemm.ops import reference

    real = reference.F.grouped_mm
    seen = []

    def spy(x, w, offs=None, out_dtype=None):
        seen.append(offs)
        return real(x, w, offs=offs, out_dtype=out_dtype)

    monkeypatch.setattr(reference, "_grouped_mm_native_ok", lambda args: True)
    monkeypatch.setattr(reference.F, "grouped_mm", spy)
    x, w, _ = make_moe_inputs(40, 4, 24, 16, dtype, generator=_gen(11))
    offs = torch.tensor(ends, dtype=torch.int32)
    out = torch.full((40, 16), 7.0, dtype=dtype) if with_out else None
    y = grouped_mm_torch(GroupedMmArgs(x, w, offs, out, dtype, dtype))
    fitted, start = [], 0
    for end in ends:
        start = min(max(end, start), 40)
        fitted.append(start)
    assert len(seen) == 1
    if fitted == ends:
        assert seen[0] is offs
    else:
        assert seen[0].tolist() == fitted
    ref = torch.zeros(40, 16, dtype=torch.float64)
    start = 0
    for e, end in enumerate(fitted):
        ref[start:end] = x[start:end].double() @ w[e].double()
        start = end
    last = fitted[-1]
    assert_close_to_ref(y[:last], ref[:last])
    if with_out:
        assert y is out
        assert torch.equal(out[last:], torch.full_like(out[last:], 7.0))
    else:
        assert torch.equal(y[last:], torch.zeros_like(y[last:]))


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"),
                    reason="torch without grouped_mm")
@pytest.mark.parametrize("with_out", [False, True])
def test_torch_grouped_mm_host_offs_path_falls_back_to_the_loop(monkeypatch, with_out):
    # A torch whose grouped_mm refuses the dtype: the host loop gives the same result.
    from moe_gemm.ops import reference

    def refuses(*args, **kwargs):
        raise RuntimeError("grouped_mm: this dtype is not supported")

    monkeypatch.setattr(reference, "_grouped_mm_native_ok", lambda args: True)
    monkeypatch.setattr(reference.F, "grouped_mm", refuses)
    x, w, _ = make_moe_inputs(40, 4, 24, 16, torch.float32, generator=_gen(12))
    offs = torch.tensor([10, 8, 25, 31], dtype=torch.int32)
    out = torch.full((40, 16), 7.0) if with_out else None
    y = grouped_mm_torch(GroupedMmArgs(x, w, offs, out, torch.float32, torch.float32))
    ref = torch.zeros(40, 16, dtype=torch.float64)
    for e, (start, end) in enumerate([(0, 10), (10, 10), (10, 25), (25, 31)]):
        ref[start:end] = x[start:end].double() @ w[e].double()
    assert_close_to_ref(y[:31], ref[:31])
    tail = torch.full((9, 16), 7.0) if with_out else torch.zeros(9, 16)
    assert torch.equal(y[31:], tail)
