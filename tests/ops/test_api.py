"""grouped_gemm and grouped_mm through the public API, against float64 references.

Backend-selection cases live at the bottom. Numerical cases run on the CPU (the torch backend);
where a CUDA GPU is visible the core ones also run there with backend="torch", which takes the
bmm / torch grouped_mm paths of moe_gemm.ops.reference.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F
from host_fakes import Recorder

import moe_gemm
from moe_gemm import GemmConfig, grouped_gemm, grouped_mm
from moe_gemm.config import CLUSTERS, COOPERATIVE_TILES
from moe_gemm.ops import api as ops_module
from moe_gemm.ops import launch_info
from moe_gemm.testing import (
    assert_close_to_ref,
    make_grouped_inputs,
    make_moe_inputs,
    poison_,
    random_problem_sizes,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TORCH = GemmConfig(backend="torch")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SENTINEL = -12345.0  # exactly representable in bf16, fp16 and fp32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gemm_ref64(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Independent float64 reference (not moe_gemm.reference)."""
    return [ai.cpu().double() @ bi.cpu().double() for ai, bi in zip(a, b)]


def gemm_baseline(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], out_dtype: torch.dtype
) -> list[torch.Tensor]:
    """Plain torch in the output's precision: the 2x rule's yardstick."""
    if out_dtype == a[0].dtype:
        return [ai @ bi for ai, bi in zip(a, b)]
    return [(ai.float() @ bi.float()).to(out_dtype) for ai, bi in zip(a, b)]


def mm_ref64(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """float64 (T, N): expert e's rows are x[offs[e-1]:offs[e]] @ w[e]; tail rows zero."""
    T, N = x.shape[0], w.shape[2]
    y = torch.zeros(T, N, dtype=torch.float64)
    bounds = [0] + offs.cpu().tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        for r in range(lo, hi):  # row by row: as plain as it gets
            y[r] = x[r].cpu().double() @ w[e].cpu().double()
    return y


def mm_baseline(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    y = torch.zeros(x.shape[0], w.shape[2], dtype=out_dtype, device=x.device)
    bounds = [0] + offs.cpu().tolist()
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            y[lo:hi] = gemm_baseline([x[lo:hi]], [w[e]], out_dtype)[0]
    return y


def check_gemm(outs: list[torch.Tensor], a: Sequence[torch.Tensor],
               b: Sequence[torch.Tensor], out_dtype: torch.dtype) -> None:
    assert isinstance(outs, list) and len(outs) == len(a)
    refs = gemm_ref64(a, b)
    bases = gemm_baseline(a, b, out_dtype) if len(a) else []
    for i, (o, r, base) in enumerate(zip(outs, refs, bases)):
        assert o.dtype == out_dtype, f"problem {i}: dtype {o.dtype}, expected {out_dtype}"
        assert o.device == a[i].device
        assert_close_to_ref(o, r, base, name=f"out[{i}]")
        assert_close_to_ref(o, r, name=f"out[{i}] (table)")


# --------------------------------------------------------------------------------------------
# grouped_gemm

# Sizes (M, N, K) chosen to be multiples of nothing, plus every kind of empty problem.
ODD_SIZES = [(1, 1, 1), (7, 13, 29), (0, 5, 9), (33, 0, 17), (12, 9, 0), (130, 70, 200),
             (1, 257, 3), (65, 1, 129), (0, 0, 0), (3, 4, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_gemm_odd_sizes(device: str, dtype: torch.dtype, out_dtype: torch.dtype | None) -> None:
    a, b = make_grouped_inputs(ODD_SIZES, dtype, device, b_layout="mixed", generator=_gen(10))
    cfg = TORCH if device == "cuda" else None
    outs = grouped_gemm(a, b, out_dtype=out_dtype, config=cfg)
    check_gemm(outs, a, b, out_dtype or dtype)
    for (m, n, _), o in zip(ODD_SIZES, outs):
        assert o.shape == (m, n)


@pytest.mark.parametrize("b_layout", ["row", "col", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_b_layouts(b_layout: str, dtype: torch.dtype) -> None:
    sizes = random_problem_sizes(6, m_range=(1, 90), n_range=(1, 90), k_range=(1, 90),
                                 generator=_gen(11))
    a, b = make_grouped_inputs(sizes, dtype, b_layout=b_layout, generator=_gen(12))
    if b_layout == "col":
        assert all(bi.stride(0) == 1 for bi in b if bi.shape[1] > 1 and bi.shape[0] > 1)
    check_gemm(grouped_gemm(a, b), a, b, dtype)


def test_gemm_weight_transpose_view_matches_linear() -> None:
    # b = w.T of an nn.Linear-style (N, K) weight: the result is F.linear's.
    g = _gen(13)
    a = [torch.randn(9, 24, generator=g), torch.randn(4, 40, generator=g)]
    w = [torch.randn(17, 24, generator=g), torch.randn(5, 40, generator=g)]
    outs = grouped_gemm(a, [wi.T for wi in w])
    for o, ai, wi in zip(outs, a, w):
        torch.testing.assert_close(o, F.linear(ai, wi), rtol=1e-5, atol=1e-5)


def test_gemm_non_contiguous_a() -> None:
    g = _gen(14)
    a_col = torch.randn(20, 33, generator=g).T  # (33, 20), unit stride along M
    a_step = torch.randn(16, 50, generator=g)[:, ::2]  # (16, 25), stride 2 along K
    b = [torch.randn(20, 7, generator=g), torch.randn(25, 3, generator=g)]
    check_gemm(grouped_gemm([a_col, a_step], b), [a_col, a_step], b, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_empty_problems(dtype: torch.dtype) -> None:
    sizes = [(0, 8, 16), (6, 8, 0), (6, 0, 16), (0, 0, 0), (5, 3, 2)]
    a, b = make_grouped_inputs(sizes, dtype, generator=_gen(15))
    outs = grouped_gemm(a, b)
    assert [tuple(o.shape) for o in outs] == [(0, 8), (6, 8), (6, 0), (0, 0), (5, 3)]
    assert torch.equal(outs[1], torch.zeros(6, 8, dtype=dtype))  # K = 0: exact zeros
    check_gemm(outs, a, b, dtype)


def test_gemm_k0_overwrites_out_with_zeros() -> None:
    a, b = make_grouped_inputs([(4, 5, 0), (3, 2, 7)], torch.bfloat16, generator=_gen(16))
    out = [poison_(torch.empty(4, 5, dtype=torch.bfloat16)),
           poison_(torch.empty(3, 2, dtype=torch.bfloat16))]
    grouped_gemm(a, b, out=out)
    assert torch.equal(out[0], torch.zeros(4, 5, dtype=torch.bfloat16))
    check_gemm(out, a, b, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_m_equals_one(dtype: torch.dtype) -> None:
    sizes = [(1, n, k) for n, k in [(1, 1), (31, 17), (256, 512), (5, 1000)]]
    a, b = make_grouped_inputs(sizes, dtype, b_layout="col", generator=_gen(17))
    check_gemm(grouped_gemm(a, b), a, b, dtype)


def test_gemm_empty_list() -> None:
    assert grouped_gemm([], []) == []
    assert grouped_gemm((), ()) == []
    assert grouped_gemm([], [], out=[]) == []
    assert grouped_gemm([], [], config=GemmConfig(backend="cute")) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_single_problem(dtype: torch.dtype) -> None:
    a, b = make_grouped_inputs([(77, 45, 123)], dtype, generator=_gen(18))
    outs = grouped_gemm(a, b)
    assert len(outs) == 1
    check_gemm(outs, a, b, dtype)


def test_gemm_300_problems() -> None:
    sizes = random_problem_sizes(300, m_range=(0, 24), n_range=(1, 24), k_range=(0, 24),
                                 empty_fraction=0.1, generator=_gen(19))
    assert sum(m == 0 for m, _, _ in sizes) > 0
    a, b = make_grouped_inputs(sizes, torch.bfloat16, b_layout="mixed", generator=_gen(20))
    outs = grouped_gemm(a, b)
    assert len(outs) == 300
    check_gemm(outs, a, b, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_uniform_sizes(device: str, dtype: torch.dtype) -> None:
    # Same (M, N, K) everywhere: on CUDA the torch backend batches these through bmm.
    a, b = make_grouped_inputs([(40, 24, 56)] * 5, dtype, device, b_layout="mixed",
                               generator=_gen(21))
    for out_dtype in (None, torch.float32):
        outs = grouped_gemm(a, b, out_dtype=out_dtype, config=TORCH)
        check_gemm(outs, a, b, out_dtype or dtype)
        # The results are independent tensors, not views into one another.
        outs[0].fill_(0)
        assert outs[1].abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemm_out_written_in_place(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    sizes = [(5, 7, 9), (0, 3, 4), (11, 1, 6), (2, 8, 0)]
    a, b = make_grouped_inputs(sizes, dtype, b_layout="col", generator=_gen(22))
    out = [poison_(torch.empty(m, n, dtype=out_dtype)) for m, n, _ in sizes]
    ptrs = [o.data_ptr() for o in out]
    res = grouped_gemm(a, b, out=out)
    assert isinstance(res, list) and len(res) == len(out)
    assert all(r is o for r, o in zip(res, out)), "the returned tensors must be the out tensors"
    assert [o.data_ptr() for o in out] == ptrs
    check_gemm(out, a, b, out_dtype)


def test_gemm_out_as_tuple_and_out_dtype_agreeing() -> None:
    a, b = make_grouped_inputs([(3, 4, 5), (6, 2, 3)], torch.float16, generator=_gen(23))
    out = (torch.empty(3, 4), torch.empty(6, 2))
    res = grouped_gemm(a, b, out=out, out_dtype=torch.float32)
    assert res[0] is out[0] and res[1] is out[1]
    check_gemm(list(out), a, b, torch.float32)


def test_gemm_out_strided_views_only_their_elements_written() -> None:
    # out[i] as views into bigger buffers: elements outside the views keep the sentinel.
    a, b = make_grouped_inputs([(6, 5, 8), (4, 9, 3)], torch.float32, generator=_gen(24))
    buf0 = torch.full((6, 12), SENTINEL)
    buf1 = torch.full((9, 4), SENTINEL)
    out = [buf0[:, ::2][:, :5], buf1.T]  # a column-stepped view and a transposed view
    grouped_gemm(a, b, out=out)
    check_gemm(out, a, b, torch.float32)
    mask0 = torch.ones_like(buf0, dtype=torch.bool)
    mask0[:, 0:10:2] = False
    assert (buf0[mask0] == SENTINEL).all()


def test_gemm_does_not_modify_inputs() -> None:
    a, b = make_grouped_inputs([(8, 6, 10), (3, 2, 1)], torch.bfloat16, generator=_gen(25))
    a0, b0 = [t.clone() for t in a], [t.clone() for t in b]
    grouped_gemm(a, b, out_dtype=torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a, a0))
    assert all(torch.equal(x, y) for x, y in zip(b, b0))


def test_gemm_fp32_accumulation_for_low_precision() -> None:
    # K = 4096 ones times alternating +-1 plus a small tail: an fp16/bf16 accumulator would
    # lose the tail; fp32 accumulation gets it exactly (then one rounding to the output).
    K = 4096
    a = torch.ones(1, K, dtype=torch.bfloat16)
    col = torch.empty(K)
    col[0::2], col[1::2] = 1.0, -1.0
    col[:8] += 2.0**-6  # 8 * 2^-6 = 0.125 survives only with a wide accumulator
    b = col.to(torch.bfloat16)[:, None]
    exact = float(a.double() @ b.double())
    assert exact == pytest.approx(0.125)
    out = grouped_gemm([a], [b], out_dtype=torch.float32)[0]
    assert float(out) == pytest.approx(exact, abs=1e-6)
    assert float(grouped_gemm([a], [b])[0]) == pytest.approx(exact, abs=1e-3)


@pytest.mark.parametrize(
    "config",
    [None, GemmConfig(), TORCH, GemmConfig(schedule="pingpong", visitor="host", sort_by_k=True,
                                           tile_m=128, tile_n=128, stages=4),
     GemmConfig(schedule="cooperative", tile_m=COOPERATIVE_TILES[-1][0],
                tile_n=COOPERATIVE_TILES[-1][1], cluster_m=CLUSTERS[-1][0],
                cluster_n=CLUSTERS[-1][1])],
)
def test_gemm_configs_agree_on_cpu(config: GemmConfig | None) -> None:
    a, b = make_grouped_inputs(ODD_SIZES, torch.bfloat16, generator=_gen(26))
    expected = grouped_gemm(a, b, config=TORCH)
    got = grouped_gemm(a, b, config=config)
    assert all(torch.equal(x, y) for x, y in zip(got, expected))


# --------------------------------------------------------------------------------------------
# grouped_mm


def check_mm(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
             out_dtype: torch.dtype) -> None:
    assert y.shape == (x.shape[0], w.shape[2])
    assert y.dtype == out_dtype and y.device == x.device
    ref = mm_ref64(x, w, offs)
    assert_close_to_ref(y, ref, mm_baseline(x, w, offs, out_dtype))
    assert_close_to_ref(y, ref, name="y (table)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
def test_mm_basic(device: str, dtype: torch.dtype, w_layout: str) -> None:
    x, w, offs = make_moe_inputs(97, 6, 40, 24, dtype, device, w_layout, generator=_gen(30))
    cfg = TORCH if device == "cuda" else None
    check_mm(grouped_mm(x, w, offs, config=cfg), x, w, offs, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mm_out_dtype(device: str, dtype: torch.dtype, out_dtype: torch.dtype,
                     request: pytest.FixtureRequest) -> None:
    x, w, offs = make_moe_inputs(50, 4, 32, 16, dtype, device, "nk_view", total=41,
                                 generator=_gen(31))
    cfg = TORCH if device == "cuda" else None
    y = grouped_mm(x, w, offs, out_dtype=out_dtype, config=cfg)
    check_mm(y, x, w, offs, out_dtype)
    assert (y[41:] == 0).all()


@pytest.mark.parametrize(
    "offs",
    [
        [0, 10, 25, 40],  # first expert empty
        [10, 10, 25, 40],  # a middle expert empty
        [10, 25, 40, 40],  # last expert empty
        [0, 0, 40, 40],  # only one expert has rows
        [0, 17, 17, 40],  # first and middle empty
        [40, 40, 40, 40],  # everything in the first expert
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_empty_experts(offs: list[int], dtype: torch.dtype) -> None:
    x, w, _ = make_moe_inputs(40, 4, 24, 12, dtype, generator=_gen(32))
    o = torch.tensor(offs, dtype=torch.int32)
    check_mm(grouped_mm(x, w, o), x, w, o, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_tail_rows_zero_without_out(device: str, dtype: torch.dtype) -> None:
    x, w, _ = make_moe_inputs(30, 3, 16, 8, dtype, device, generator=_gen(33))
    offs = torch.tensor([5, 5, 19], dtype=torch.int32, device=device)
    y = grouped_mm(x, w, offs, config=TORCH)
    assert torch.equal(y[19:].cpu(), torch.zeros(11, 8, dtype=dtype))
    check_mm(y, x, w, offs, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_mm_tail_rows_untouched_with_out(device: str, dtype: torch.dtype,
                                         out_dtype: torch.dtype | None,
                                         request: pytest.FixtureRequest) -> None:
    x, w, _ = make_moe_inputs(30, 3, 16, 8, dtype, device, "nk_view", generator=_gen(34))
    offs = torch.tensor([0, 12, 19], dtype=torch.int32, device=device)
    odt = out_dtype or dtype
    out = torch.full((30, 8), SENTINEL, dtype=odt, device=device)
    res = grouped_mm(x, w, offs, out=out, out_dtype=out_dtype, config=TORCH)
    assert res is out
    assert (out[19:] == SENTINEL).all(), "rows past offs[-1] must be left untouched"
    ref = mm_ref64(x, w, offs)
    assert_close_to_ref(out[:19], ref[:19], mm_baseline(x, w, offs, odt)[:19])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_out_fully_written_when_offs_end_at_t(dtype: torch.dtype) -> None:
    x, w, offs = make_moe_inputs(64, 5, 24, 40, dtype, "cpu", "nk_view", empty_fraction=0.4,
                                 generator=_gen(35))
    assert int(offs[-1]) == 64
    out = poison_(torch.empty(64, 40, dtype=dtype))
    res = grouped_mm(x, w, offs, out=out)
    assert res is out
    check_mm(out, x, w, offs, dtype)  # any row left unwritten is NaN and fails here


def test_mm_out_strided_view() -> None:
    x, w, offs = make_moe_inputs(20, 3, 8, 6, torch.float32, total=15, generator=_gen(36))
    buf = torch.full((6, 20), SENTINEL)
    out = buf.T  # (20, 6), unit stride along T
    grouped_mm(x, w, offs, out=out)
    assert_close_to_ref(out[:15], mm_ref64(x, w, offs)[:15])
    assert (out[15:] == SENTINEL).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_single_expert(dtype: torch.dtype) -> None:
    x, w, _ = make_moe_inputs(33, 1, 20, 9, dtype, generator=_gen(37))
    for end in (33, 20, 0):
        offs = torch.tensor([end], dtype=torch.int32)
        y = grouped_mm(x, w, offs)
        check_mm(y, x, w, offs, dtype)
        assert (y[end:] == 0).all()
    offs = torch.tensor([33], dtype=torch.int32)
    torch.testing.assert_close(grouped_mm(x, w, offs).double(), (x.double() @ w[0].double()),
                               atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_zero_tokens(dtype: torch.dtype) -> None:
    x, w, _ = make_moe_inputs(0, 4, 16, 8, dtype, generator=_gen(38))
    offs = torch.zeros(4, dtype=torch.int32)
    y = grouped_mm(x, w, offs)
    assert y.shape == (0, 8) and y.dtype == dtype
    out = torch.empty(0, 8, dtype=dtype)
    assert grouped_mm(x, w, offs, out=out) is out
    assert grouped_mm(x, w, offs, out_dtype=torch.float32).dtype == torch.float32


def test_mm_zero_experts() -> None:
    x = torch.randn(7, 16)
    w = torch.randn(0, 16, 8)
    offs = torch.zeros(0, dtype=torch.int32)
    y = grouped_mm(x, w, offs)
    assert y.shape == (7, 8) and torch.equal(y, torch.zeros(7, 8))
    out = torch.full((7, 8), SENTINEL)
    assert grouped_mm(x, w, offs, out=out) is out
    assert (out == SENTINEL).all()


def test_mm_all_experts_empty() -> None:
    x, w, _ = make_moe_inputs(12, 3, 8, 4, torch.bfloat16, generator=_gen(39))
    offs = torch.zeros(3, dtype=torch.int32)
    assert torch.equal(grouped_mm(x, w, offs), torch.zeros(12, 4, dtype=torch.bfloat16))
    out = torch.full((12, 4), SENTINEL, dtype=torch.bfloat16)
    grouped_mm(x, w, offs, out=out)
    assert (out == SENTINEL).all()


def test_mm_k_zero_and_n_zero() -> None:
    x = torch.randn(10, 0)
    w = torch.randn(3, 0, 5)
    offs = torch.tensor([3, 3, 8], dtype=torch.int32)
    out = poison_(torch.empty(10, 5))
    grouped_mm(x, w, offs, out=out)
    assert torch.equal(out[:8], torch.zeros(8, 5)), "K = 0: the covered rows are exact zeros"
    assert torch.isnan(out[8:]).all(), "tail rows untouched"
    assert torch.equal(grouped_mm(x, w, offs), torch.zeros(10, 5))
    y = grouped_mm(torch.randn(10, 4), torch.randn(3, 4, 0), offs)
    assert y.shape == (10, 0)


def test_mm_non_contiguous_x() -> None:
    g = _gen(40)
    x = torch.randn(24, 60, generator=g)[:, ::3]  # (24, 20), stride 3 along K
    x_col = torch.randn(20, 24, generator=g).T  # (24, 20), unit stride along T
    w = torch.randn(3, 20, 7, generator=g)
    offs = torch.tensor([4, 15, 22], dtype=torch.int32)
    for xx in (x, x_col):
        check_mm(grouped_mm(xx, w, offs), xx, w, offs, torch.float32)


def test_mm_w_with_batch_stride_gaps() -> None:
    # w as a slice of a bigger buffer: (E, K, N) with padded strides in every dim.
    g = _gen(41)
    big = torch.randn(6, 20, 30, generator=g)
    w = big[::2, 2:18, 5:25]  # (3, 16, 20)
    x = torch.randn(15, 16, generator=g)
    offs = torch.tensor([5, 9, 15], dtype=torch.int32)
    check_mm(grouped_mm(x, w, offs), x, w, offs, torch.float32)


def test_mm_does_not_modify_inputs() -> None:
    x, w, offs = make_moe_inputs(20, 3, 8, 6, torch.bfloat16, total=17, generator=_gen(42))
    x0, w0, offs0 = x.clone(), w.clone(), offs.clone()
    grouped_mm(x, w, offs, out_dtype=torch.float32)
    assert torch.equal(x, x0) and torch.equal(w, w0) and torch.equal(offs, offs0)


@pytest.mark.parametrize("case", range(24))
def test_mm_random_routing(case: int) -> None:
    g = _gen(100 + case)
    dtype = DTYPES[case % 3]
    T = int(torch.randint(1, 200, (1,), generator=g))
    E = int(torch.randint(1, 20, (1,), generator=g))
    K = int(torch.randint(1, 70, (1,), generator=g))
    N = int(torch.randint(1, 70, (1,), generator=g))
    total = T if case % 4 else int(torch.randint(0, T + 1, (1,), generator=g))
    x, w, offs = make_moe_inputs(T, E, K, N, dtype, "cpu", ("kn", "nk_view")[case % 2],
                                 skew=float(case % 5), empty_fraction=0.3 * (case % 3),
                                 total=total, generator=g)
    assert int(offs[-1]) == total
    y = grouped_mm(x, w, offs)
    check_mm(y, x, w, offs, dtype)
    assert (y[total:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
def test_mm_matches_torch_grouped_mm(dtype: torch.dtype, w_layout: str) -> None:
    if not hasattr(F, "grouped_mm"):
        pytest.skip("torch.nn.functional.grouped_mm is not in this torch")
    for seed in range(3):
        x, w, offs = make_moe_inputs(100, 5, 72, 40, dtype, "cpu", w_layout,
                                     empty_fraction=0.3, total=90 - 20 * seed,
                                     generator=_gen(50 + seed))
        end = int(offs[-1])
        ours = grouped_mm(x, w, offs)
        theirs = F.grouped_mm(x, w, offs=offs)
        # torch leaves rows past offs[-1] unspecified; ours are zero.
        assert (ours[end:] == 0).all()
        # fp16: torch's CPU kernel rounds differently by up to one output ulp.
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
        torch.testing.assert_close(ours[:end], theirs[:end], rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------
# Backend selection


def test_public_api_surface() -> None:
    assert set(moe_gemm.__all__) >= {"GemmConfig", "grouped_gemm", "grouped_mm", "__version__"}
    assert isinstance(moe_gemm.__version__, str) and moe_gemm.__version__.count(".") >= 1


def test_cute_backend_on_cpu_raises_runtime_error() -> None:
    a, b = make_grouped_inputs([(8, 8, 8)], torch.bfloat16, generator=_gen(60))
    x, w, offs = make_moe_inputs(8, 2, 8, 8, torch.bfloat16, generator=_gen(61))
    cfg = GemmConfig(backend="cute")
    with pytest.raises(RuntimeError, match=r"backend='cute' cannot run here: tensors are on cpu"):
        grouped_gemm(a, b, config=cfg)
    with pytest.raises(RuntimeError, match=r"backend='cute' cannot run here: tensors are on cpu"):
        grouped_mm(x, w, offs, config=cfg)


def test_validation_comes_before_backend_choice() -> None:
    # A bad argument gets its ValueError even when the backend could not run anyway.
    a, b = make_grouped_inputs([(8, 8, 8)], torch.bfloat16, generator=_gen(62))
    with pytest.raises(ValueError, match="expected one b per a"):
        grouped_gemm(a, b + b, config=GemmConfig(backend="cute"))


def test_auto_backend_on_cpu_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops_module, "_warned", set())  # an earlier warn-once must not hide one
    a, b = make_grouped_inputs([(5, 3, 9), (2, 7, 4)], torch.float32, generator=_gen(63))
    x, w, offs = make_moe_inputs(9, 2, 5, 3, torch.float16, generator=_gen(64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_gemm(grouped_gemm(a, b), a, b, torch.float32)
        check_mm(grouped_mm(x, w, offs), x, w, offs, torch.float16)


@pytest.fixture
def fake_hopper(kernel: Recorder, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Pretend the cute backend can run: capability says yes and the host path runs on the
    CPU with a recorder in place of the compiled kernel (the real kernels need an H100)."""
    monkeypatch.setattr(ops_module, "cute_problem", lambda device=None: None)
    monkeypatch.setattr(ops_module, "_warned", set())
    return kernel


def test_dispatch_to_cute_when_it_can_run(fake_hopper: Recorder) -> None:
    a, b = make_grouped_inputs([(8, 16, 32)], torch.bfloat16, b_layout="col",
                               generator=_gen(65))
    x, w, offs = make_moe_inputs(16, 2, 32, 16, torch.bfloat16, w_layout="nk_view",
                                 generator=_gen(66))
    cfg = GemmConfig(schedule="pingpong")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = grouped_gemm(a, b, config=cfg)
        assert len(fake_hopper.calls) == 1 and [o.shape for o in outs] == [(8, 16)]
        assert launch_info.last_launch().choice.schedule == "pingpong"
        y = grouped_mm(x, w, offs)
    assert len(fake_hopper.calls) == 2 and y.shape == (16, 16) and y.dtype == torch.bfloat16
    info = launch_info.last_launch()
    assert info.num_problems == 3  # two experts and the rows past offs[-1] (zeroed)
    assert fake_hopper.calls[-1][0] is x and fake_hopper.calls[-1][5] is offs
    # backend="torch" never dispatches, even where cute could run.
    check_gemm(grouped_gemm(a, b, config=TORCH), a, b, torch.bfloat16)
    assert len(fake_hopper.calls) == 2


def test_auto_falls_back_with_one_warning(fake_hopper: Recorder) -> None:
    # fp32 inputs: the kernels take bf16/fp16 only, so auto warns once and uses torch.
    a, b = make_grouped_inputs([(5, 8, 8)], torch.float32, generator=_gen(67))
    with pytest.warns(RuntimeWarning, match="using the torch backend because the kernels take "
                                            "bf16 or fp16 inputs") as record:
        outs = grouped_gemm(a, b)
    assert record[0].filename == __file__  # the warning points at the caller's line
    check_gemm(outs, a, b, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grouped_gemm(a, b)  # the same reason warns only once
    assert fake_hopper.calls == []


def test_auto_falls_back_for_misaligned_mm(fake_hopper: Recorder) -> None:
    x, w, offs = make_moe_inputs(12, 2, 12, 8, torch.bfloat16, generator=_gen(68))  # K = 12
    with pytest.warns(RuntimeWarning, match="16 bytes"):
        y = grouped_mm(x, w, offs)
    check_mm(y, x, w, offs, torch.bfloat16)
    assert fake_hopper.calls == []


def test_forced_cute_rejects_unsupported_input(fake_hopper: Recorder) -> None:
    a, b = make_grouped_inputs([(5, 8, 8)], torch.float32, generator=_gen(69))
    with pytest.raises(ValueError, match=r"backend='cute' cannot take this input: the kernels "
                                         r"take bf16 or fp16 inputs, not torch\.float32"):
        grouped_gemm(a, b, config=GemmConfig(backend="cute"))
    # N = 12 with an (E, N, K) weight: the operands are TMA-able, the bf16 output rows are not.
    x, w, offs = make_moe_inputs(12, 2, 16, 12, torch.bfloat16, w_layout="nk_view",
                                 generator=_gen(70))
    with pytest.raises(ValueError, match=r"backend='cute' cannot take this input: out rows of "
                                         r"12 torch\.bfloat16 elements"):
        grouped_mm(x, w, offs, config=GemmConfig(backend="cute"))


def test_swap_ab_runs_grouped_mm_and_every_other_op_refuses_it() -> None:
    """swap_ab=True is grouped_mm's 2-D x 3-D option and fused_grouped_mm's (no gate, or
    concat gate-up weights): there it gives the reference result on any backend (the torch
    backend computes the same product); every other op refuses it with a ValueError naming
    itself, on the CPU as on a GPU."""
    g = torch.Generator().manual_seed(0)
    swap = GemmConfig(swap_ab=True)
    x = torch.randn(40, 32, generator=g)
    w = torch.randn(3, 32, 24, generator=g)
    offs = torch.tensor([10, 10, 33], dtype=torch.int32)
    y = grouped_mm(x, w, offs, config=swap)
    assert torch.equal(y, grouped_mm(x, w, offs))
    from moe_gemm.ops.fused import fused_grouped_mm
    from moe_gemm.ops.fused_masked import fused_grouped_mm_masked
    from moe_gemm.ops.masked import grouped_mm_masked, scaled_grouped_mm_masked
    from moe_gemm.ops.scaled import scaled_grouped_gemm, scaled_grouped_mm

    f8 = torch.float8_e4m3fn
    x8, w8 = x.to(f8), w.to(f8)
    sa, sb = torch.ones(40), torch.ones(3, 24)
    calls = {
        "grouped_mm's 3-D x 3-D form": lambda: grouped_mm(x.view(2, 20, 32), w[:2],
                                                          config=swap),
        "grouped_gemm": lambda: grouped_gemm([x], [w[0]], config=swap),
        "GroupedGemmPlan": lambda: moe_gemm.GroupedGemmPlan([x], [w[0]], config=swap),
        "grouped_mm_masked": lambda: grouped_mm_masked(
            x.view(2, 20, 32), w[:2], torch.tensor([3, 20], dtype=torch.int32), config=swap),
        "scaled_grouped_mm": lambda: scaled_grouped_mm(x8, w8, sa, sb, offs, config=swap),
        "scaled_grouped_gemm": lambda: scaled_grouped_gemm([x8], [w8[0]], [sa], [sb[0]],
                                                           config=swap),
        "scaled_grouped_mm_masked": lambda: scaled_grouped_mm_masked(
            x8.view(2, 20, 32), w8[:2], sa.view(2, 20), sb[:2],
            torch.tensor([3, 20], dtype=torch.int32), config=swap),
        "fused_grouped_mm with the 'interleaved' gate layout": lambda: fused_grouped_mm(
            x, w, offs, gate="silu", gate_layout="interleaved", config=swap),
        "fused_grouped_mm with the 'alternating' gate layout": lambda: fused_grouped_mm(
            x, w, offs, gate="silu", gate_layout="alternating", config=swap),
        "fused_grouped_mm_masked": lambda: fused_grouped_mm_masked(
            x.view(2, 20, 32), w[:2], torch.tensor([3, 20], dtype=torch.int32), config=swap),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"swap_ab=True .*; {re.escape(name)} does not "
                                             "take it"):
            call()
    # fused_grouped_mm takes it without a gate and over concat gate-up weights: the
    # same result as without it (the torch backend here).
    for kw in (dict(gate="silu"), dict(row_weight=torch.rand(40, generator=g))):
        y = fused_grouped_mm(x, w, offs, config=swap, **kw)
        assert torch.allclose(y, fused_grouped_mm(x, w, offs, **kw))
