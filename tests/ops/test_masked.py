"""grouped_mm_masked and scaled_grouped_mm_masked (DeepGEMM's masked layout) on the CPU.

x (G, M, K) @ w (G, K, N) on each problem's first masked_m[g] rows, fp32 accumulation: the
valid rows against an fp64 reference computed here (torch.bmm on those rows only), zeros past
the counts in a new output, a given `out` keeping its values there; every argument check;
autograd of the torch backend; the torch.library registrations (opcheck, fake tensors,
torch.compile(fullgraph=True)); the FP8 variant against scaled_grouped_mm's batched form; and
the Hopper host path (ops/masked_launch.py) with the compiled kernel replaced by an emulator
that computes what the masked kernel computes from the arguments it is given.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp8_fakes import _dequant_a, _dequant_b
from host_fakes import clear_caches, install
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.library import opcheck

import moe_gemm
from moe_gemm import GemmConfig, grouped_mm_masked, scaled_grouped_mm, scaled_grouped_mm_masked
from moe_gemm.ops import launch_info, launch_kernel, masked, masked_custom_ops, masked_launch
from moe_gemm.ops.scaled_reference import scaled_grouped_mm_ref
from moe_gemm.testing import assert_close_to_ref, poison_
from moe_gemm.testing_fp8 import assert_fp8_close, make_fp8_batched_inputs

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [FP32, BF16, FP16]
I32 = torch.int32
TORCH = GemmConfig(backend="torch")
SENTINEL = -12345.0  # exactly representable in bf16, fp16 and fp32
DTYPE_WORDS = r"torch\.bfloat16, torch\.float16 or torch\.float32"
OPS = torch.ops.moe_gemm
# opcheck's schema test compares inputs with torch.allclose, which torch lacks for float8 on
# the CPU; the traced ops' backward raises by design (inference-only), so the AOT test is left
# out where an input requires grad.
FP8_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NO_AOT = ("test_schema", "test_autograd_registration", "test_faketensor")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _counts(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def _inputs(G: int, M: int, N: int, K: int, dtype: torch.dtype, seed: int,
            w_layout: str = "kn") -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random x (G, M, K) and w (G, K, N); w_layout "nk_view" = w_nk.transpose(1, 2)."""
    g = _gen(seed)
    x = torch.randn(G, M, K, generator=g).to(dtype)
    if w_layout == "kn":
        w = torch.randn(G, K, N, generator=g).to(dtype)
    else:
        w = torch.randn(G, N, K, generator=g).to(dtype).transpose(1, 2)
    return x, w


def masked_ref64(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Independent fp64 reference: torch.bmm on each problem's valid rows, zeros elsewhere."""
    G, M, N = x.shape[0], x.shape[1], w.shape[2]
    y = torch.zeros(G, M, N, dtype=torch.float64)
    for g, c in enumerate(counts):
        if c:
            y[g, :c] = torch.bmm(x[g:g + 1, :c].double(), w[g:g + 1].double())[0]
    return y


def _baseline(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Plain torch in the output's precision: the 2x rule's yardstick (every row)."""
    if out_dtype == x.dtype:
        return torch.bmm(x, w)
    return torch.bmm(x.float(), w.float()).to(out_dtype)


def _valid(t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The valid rows of a (G, M, N) tensor, stacked: (sum(counts), N)."""
    return torch.cat([t.new_empty((0, t.shape[2]))] + [t[g, :c] for g, c in enumerate(counts)])


def _past(t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The rows at and past the counts, stacked."""
    return torch.cat([t.new_empty((0, t.shape[2]))] + [t[g, c:] for g, c in enumerate(counts)])


def check_valid(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, counts: list[int],
                out_dtype: torch.dtype) -> None:
    assert tuple(y.shape) == (x.shape[0], x.shape[1], w.shape[2])
    assert y.dtype == out_dtype and y.device == x.device
    ref = _valid(masked_ref64(x, w, counts), counts)
    assert_close_to_ref(_valid(y, counts), ref, _valid(_baseline(x, w, out_dtype), counts))
    assert_close_to_ref(_valid(y, counts), ref, name="y (table)")


def check_new_output(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, counts: list[int],
                     out_dtype: torch.dtype) -> None:
    """A new output of the torch backend: valid rows right, zeros at and past the counts."""
    check_valid(y, x, w, counts, out_dtype)
    assert not _past(y, counts).any(), "rows past masked_m must be zero in a new output"


# --------------------------------------------------------------------------------------------
# Numerics


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
def test_valid_rows_match_fp64(dtype: torch.dtype, w_layout: str) -> None:
    x, w = _inputs(5, 37, 24, 40, dtype, seed=1, w_layout=w_layout)
    if w_layout == "nk_view":
        assert w.stride(1) == 1  # K-major: the transpose of a (G, N, K) weight
    counts = [0, 1, 37, 20, 36]
    check_new_output(grouped_mm_masked(x, w, _counts(counts)), x, w, counts, dtype)


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(BF16, FP32), (FP16, FP32), (FP32, BF16), (BF16, FP16), (FP32, FP16), (BF16, BF16),
     (FP16, None)],
)
def test_out_dtype(dtype: torch.dtype, out_dtype: torch.dtype | None) -> None:
    x, w = _inputs(4, 33, 19, 70, dtype, seed=2)
    counts = [33, 5, 0, 17]
    y = grouped_mm_masked(x, w, _counts(counts), out_dtype=out_dtype)
    check_new_output(y, x, w, counts, out_dtype or dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_out_keeps_its_rows_past_the_counts(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    x, w = _inputs(4, 17, 11, 23, dtype, seed=3, w_layout="nk_view")
    counts = [17, 0, 9, 1]
    out = torch.full((4, 17, 11), SENTINEL, dtype=out_dtype)
    ptr = out.data_ptr()
    y = grouped_mm_masked(x, w, _counts(counts), out=out)  # out_dtype None: taken from out
    assert y is out, "the returned tensor must be `out`"
    assert out.data_ptr() == ptr
    check_valid(out, x, w, counts, out_dtype)
    assert (_past(out, counts) == SENTINEL).all(), "rows past masked_m were written"


def test_out_poisoned_rows_past_the_counts_stay_nan() -> None:
    x, w = _inputs(3, 12, 8, 16, BF16, seed=4)
    counts = [12, 3, 0]
    out = poison_(torch.empty(3, 12, 8, dtype=FP32))
    assert grouped_mm_masked(x, w, _counts(counts), out=out, out_dtype=FP32) is out
    assert torch.isnan(_past(out, counts)).all()
    assert torch.isfinite(_valid(out, counts)).all()
    check_valid(out, x, w, counts, FP32)


def test_out_strided_view_only_its_valid_rows_written() -> None:
    x, w = _inputs(3, 6, 4, 7, FP32, seed=5)
    counts = [2, 6, 0]
    buf = torch.full((3, 6, 9), SENTINEL)
    out = buf[:, :, 1::2]  # (3, 6, 4), stride 2 along N
    assert grouped_mm_masked(x, w, _counts(counts), out=out) is out
    check_valid(out, x, w, counts, FP32)
    written = torch.zeros(3, 6, 9, dtype=torch.bool)
    for g, c in enumerate(counts):
        written[g, :c, 1::2] = True
    assert (buf[~written] == SENTINEL).all()


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_out_overlapping_x(dtype: torch.dtype) -> None:
    # out is x itself (K == N): the product is of x's values before the call, and the rows
    # past the counts keep x's values.
    x, w = _inputs(3, 9, 12, 12, dtype, seed=6)
    counts = [4, 0, 9]
    x0 = x.clone()
    y = grouped_mm_masked(x, w, _counts(counts), out=x)
    assert y is x
    check_valid(x, x0, w, counts, dtype)
    assert torch.equal(_past(x, counts), _past(x0, counts))
    # A partial overlap: out is x's problems 1..2 seen as problems 0..1 of another call.
    x, w = _inputs(3, 9, 12, 12, dtype, seed=7)
    x0 = x.clone()
    out = x[1:]
    counts = [5, 2]
    assert grouped_mm_masked(x[:2], w[:2], _counts(counts), out=out) is out
    check_valid(out, x0[:2], w[:2], counts, dtype)
    assert torch.equal(_past(x[1:], counts), _past(x0[1:], counts))
    assert torch.equal(x[0], x0[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_counts_zero_and_full_in_one_call(dtype: torch.dtype) -> None:
    M = 21
    x, w = _inputs(6, M, 10, 33, dtype, seed=8)
    counts = [0, M, 0, M, M, 0]
    y = grouped_mm_masked(x, w, _counts(counts))
    check_new_output(y, x, w, counts, dtype)
    # The full problems are the batched product, the empty ones all zero.
    full = moe_gemm.grouped_mm(x[[1, 3, 4]], w[[1, 3, 4]], config=TORCH)
    torch.testing.assert_close(y[[1, 3, 4]], full)
    assert not y[[0, 2, 5]].any()


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize(("G", "M", "N", "K"), [(0, 4, 5, 6), (3, 0, 5, 6), (3, 4, 0, 6),
                                                (0, 0, 0, 0)])
def test_empty_dims(dtype: torch.dtype, G: int, M: int, N: int, K: int) -> None:
    x, w = _inputs(G, M, N, K, dtype, seed=9)
    counts = _counts([min(M, 2)] * G)
    for out_dtype in (None, FP32):
        y = grouped_mm_masked(x, w, counts, out_dtype=out_dtype)
        assert tuple(y.shape) == (G, M, N) and y.numel() == 0
        assert y.dtype == (out_dtype or dtype)
    out = torch.empty(G, M, N, dtype=dtype)
    assert grouped_mm_masked(x, w, counts, out=out) is out


@pytest.mark.parametrize("dtype", DTYPES)
def test_k_zero_valid_rows_are_zeros(dtype: torch.dtype) -> None:
    x, w = _inputs(3, 4, 5, 0, dtype, seed=10)
    counts = [4, 1, 0]
    y = grouped_mm_masked(x, w, _counts(counts))
    assert torch.equal(y, torch.zeros(3, 4, 5, dtype=dtype))
    out = torch.full((3, 4, 5), SENTINEL, dtype=FP32)
    assert grouped_mm_masked(x, w, _counts(counts), out=out) is out
    assert not _valid(out, counts).any()
    assert (_past(out, counts) == SENTINEL).all()


def test_masked_m_strided_view() -> None:
    x, w = _inputs(4, 8, 6, 5, FP32, seed=11)
    base = _counts([3, 99, 8, 99, 0, 99, 5, 99])
    view = base[::2]
    assert not view.is_contiguous()
    counts = [3, 8, 0, 5]
    check_new_output(grouped_mm_masked(x, w, view), x, w, counts, FP32)
    out = torch.full((4, 8, 6), SENTINEL)
    grouped_mm_masked(x, w, view, out=out)
    check_valid(out, x, w, counts, FP32)
    assert (_past(out, counts) == SENTINEL).all()


@pytest.mark.parametrize("expected_m", [None, 1, 3, 8, 1000])
def test_expected_m_is_only_a_hint(expected_m: int | None) -> None:
    x, w = _inputs(3, 8, 6, 16, BF16, seed=12)
    mm = _counts([8, 2, 0])
    assert torch.equal(grouped_mm_masked(x, w, mm, expected_m=expected_m),
                       grouped_mm_masked(x, w, mm))


@pytest.mark.parametrize(
    "config",
    [None, GemmConfig(), TORCH, GemmConfig(schedule="pingpong", tile_m=64, tile_n=128),
     GemmConfig(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=2, cluster_n=1)],
)
def test_configs_agree_on_cpu(config: GemmConfig | None) -> None:
    x, w = _inputs(3, 30, 20, 48, BF16, seed=13)
    mm = _counts([30, 7, 0])
    assert torch.equal(grouped_mm_masked(x, w, mm, config=config),
                       grouped_mm_masked(x, w, mm, config=TORCH))


def test_does_not_modify_inputs() -> None:
    x, w = _inputs(3, 8, 6, 10, BF16, seed=14, w_layout="nk_view")
    mm = _counts([1, 8, 0])
    x0, w0, mm0 = x.clone(), w.clone(), mm.clone()
    grouped_mm_masked(x, w, mm, out_dtype=FP32)
    assert torch.equal(x, x0) and torch.equal(w, w0) and torch.equal(mm, mm0)


def test_nan_rows_past_the_counts_do_not_reach_the_valid_rows() -> None:
    # A masked buffer's rows past the counts are whatever the dispatch left there.
    x, w = _inputs(3, 6, 5, 8, FP32, seed=15)
    counts = [2, 6, 0]
    x_clean = x.clone()
    x[0, 2:] = float("nan")
    x[2] = float("inf")
    y = grouped_mm_masked(x, w, _counts(counts))
    check_new_output(y, x_clean, w, counts, FP32)


def test_public_names() -> None:
    for name in ("grouped_mm_masked", "scaled_grouped_mm_masked"):
        assert name in moe_gemm.__all__ and callable(getattr(moe_gemm, name))
    assert moe_gemm.grouped_mm_masked is masked.grouped_mm_masked
    assert moe_gemm.scaled_grouped_mm_masked is masked.scaled_grouped_mm_masked


# --------------------------------------------------------------------------------------------
# Errors


def _err_inputs(dtype: torch.dtype = FP32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w = _inputs(3, 5, 6, 7, dtype, seed=20)
    return x, w, _counts([0, 5, 2])


@pytest.mark.parametrize("value", [[0, 5, 2], (0, 5, 2), 3, None, "0,5,2"])
def test_masked_m_not_a_tensor(value: object) -> None:
    x, w, _ = _err_inputs()
    with pytest.raises(TypeError, match=rf"masked_m must be a torch\.Tensor \(3,\) of int32 row "
                                        rf"counts; got {type(value).__name__}"):
        grouped_mm_masked(x, w, value)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.uint8, FP32, torch.bool])
def test_masked_m_wrong_dtype(dtype: torch.dtype) -> None:
    x, w, mm = _err_inputs()
    with pytest.raises(TypeError, match=rf"masked_m must be int32 row counts \(3,\); got dtype "
                                        rf"{dtype}"):
        grouped_mm_masked(x, w, mm.to(dtype))


@pytest.mark.parametrize("shape", [(2,), (4,), (1, 3), (3, 1), (), (0,)])
def test_masked_m_wrong_shape(shape: tuple[int, ...]) -> None:
    x, w, _ = _err_inputs()
    with pytest.raises(ValueError, match=r"masked_m must have one row count per problem: "
                                         r"\(3,\); got"):
        grouped_mm_masked(x, w, torch.zeros(shape, dtype=I32))


def test_masked_m_on_another_device() -> None:
    # 'meta' stands in for another device: shapes and dtypes, no data.
    x, w, mm = _err_inputs()
    with pytest.raises(ValueError, match=r"masked_m is on meta but x is on cpu; it must live "
                                         r"with x"):
        grouped_mm_masked(x, w, mm.to("meta"))


@pytest.mark.parametrize(("values", "bad"), [([0, -1, 2], "masked_m\\[1\\]=-1"),
                                             ([0, 1, 6], "masked_m\\[2\\]=6"),
                                             ([-5, 9, 2], "masked_m\\[0\\]=-5"),
                                             ([0, 5, 2**31 - 1], "masked_m\\[2\\]=2147483647")])
def test_masked_m_values_out_of_range(values: list[int], bad: str) -> None:
    x, w, _ = _err_inputs()
    with pytest.raises(ValueError, match=rf"masked_m values must be in \[0, M\] = \[0, 5\] "
                                         rf"\(valid rows of each problem\); got {bad}$"):
        grouped_mm_masked(x, w, _counts(values))
    out = torch.full((3, 5, 6), SENTINEL)
    with pytest.raises(ValueError, match=bad):
        grouped_mm_masked(x, w, _counts(values), out=out)
    assert (out == SENTINEL).all(), "a refused call must not write out"


@pytest.mark.parametrize("value", [1.5, 2.0, "4", torch.tensor(3), [3]])
def test_expected_m_not_an_int(value: object) -> None:
    x, w, mm = _err_inputs()
    with pytest.raises(TypeError, match=rf"expected_m must be an int \(typical valid rows per "
                                        rf"problem\) or None; got {type(value).__name__}"):
        grouped_mm_masked(x, w, mm, expected_m=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [np.int64(4), np.int32(4), np.uint16(4)])
def test_expected_m_numpy_integer(value: object) -> None:
    # numpy's integer scalars are ints to the kernel choice (a count read from an array), in
    # the eager call and the registered op alike; numpy's bool is refused as bool is.
    x, w, mm = _err_inputs()
    want = grouped_mm_masked(x, w, mm, expected_m=4)
    assert torch.equal(grouped_mm_masked(x, w, mm, expected_m=value), want)
    assert torch.equal(masked_custom_ops.grouped_mm_masked(x, w, mm, expected_m=value), want)
    with pytest.raises(TypeError, match=r"expected_m must be an int .*; got bool"):
        grouped_mm_masked(x, w, mm, expected_m=np.bool_(True))


@pytest.mark.parametrize("value", [True, False])
def test_expected_m_bool(value: bool) -> None:
    x, w, mm = _err_inputs()
    with pytest.raises(TypeError, match=r"expected_m must be an int .*; got bool"):
        grouped_mm_masked(x, w, mm, expected_m=value)


@pytest.mark.parametrize("value", [0, -1, -100])
def test_expected_m_below_one(value: int) -> None:
    x, w, mm = _err_inputs()
    with pytest.raises(ValueError, match=rf"expected_m must be >= 1 \(typical valid rows per "
                                         rf"problem\); got {value}$"):
        grouped_mm_masked(x, w, mm, expected_m=value)


def test_expected_m_past_int64_traced_as_eager() -> None:
    # A hint past int64 is capped at M as any other (the op schema's int64 cast refused it
    # under torch.compile with torch's pybind error); one below -2^63 is eager's ValueError.
    x, w, mm = _err_inputs()
    want = grouped_mm_masked(x, w, mm)
    assert torch.equal(grouped_mm_masked(x, w, mm, expected_m=2 ** 70), want)
    assert torch.equal(masked_custom_ops.grouped_mm_masked(x, w, mm, expected_m=2 ** 70), want)
    y = masked_custom_ops.fused_grouped_mm_masked(x, w, mm, expected_m=2 ** 64)
    assert torch.equal(y, moe_gemm.fused_grouped_mm_masked(x, w, mm))
    for call in (grouped_mm_masked, masked_custom_ops.grouped_mm_masked):
        with pytest.raises(ValueError, match=r"expected_m must be >= 1 .*; got -2361"):
            call(x, w, mm, expected_m=-2 ** 71)


@pytest.mark.parametrize("shape", [(5, 7), (1, 3, 5, 7), (7,)])
def test_x_not_3d(shape: tuple[int, ...]) -> None:
    _, w, mm = _err_inputs()
    with pytest.raises(ValueError, match=r"x must be 3-D \(G, M, K\)"):
        grouped_mm_masked(torch.randn(shape), w, mm)


@pytest.mark.parametrize("shape", [(7, 6), (3, 7, 6, 1)])
def test_w_not_3d(shape: tuple[int, ...]) -> None:
    x, _, mm = _err_inputs()
    with pytest.raises(ValueError, match=r"w must be 3-D \(G, K, N\)"):
        grouped_mm_masked(x, torch.randn(shape), mm)


def test_w_mismatched_g() -> None:
    x, w, mm = _err_inputs()
    with pytest.raises(ValueError, match=r"x is \(G, M, K\) = \(3, 5, 7\), so w must be "
                                         r"\(3, 7, N\); got \(2, 7, 6\)"):
        grouped_mm_masked(x, w[:2], mm)


def test_w_mismatched_k() -> None:
    x, _, mm = _err_inputs()
    with pytest.raises(ValueError, match=r"so w must be \(3, 7, N\); got \(3, 6, 7\)"):
        grouped_mm_masked(x, torch.randn(3, 6, 7), mm)  # a (G, N, K) weight, not transposed


def test_operand_dtypes() -> None:
    x, w, mm = _err_inputs()
    with pytest.raises(TypeError, match=r"w has dtype torch\.bfloat16 but x has torch\.float32"):
        grouped_mm_masked(x, w.to(BF16), mm)
    with pytest.raises(TypeError, match=rf"x must be {DTYPE_WORDS}; got torch\.float64"):
        grouped_mm_masked(x.double(), w.double(), mm)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        grouped_mm_masked([[1.0]], w, mm)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(3, 5, 7), (3, 6, 6), (2, 5, 6), (5, 6), (3, 5, 6, 1)])
def test_out_wrong_shape(shape: tuple[int, ...]) -> None:
    x, w, mm = _err_inputs()
    with pytest.raises(ValueError, match=r"out must be \(G, M, N\) = \(3, 5, 6\); got "):
        grouped_mm_masked(x, w, mm, out=torch.empty(shape))


def test_out_wrong_dtype() -> None:
    x, w, mm = _err_inputs(BF16)
    with pytest.raises(TypeError, match=r"out must have dtype torch\.float32; got "
                                        r"torch\.bfloat16"):
        grouped_mm_masked(x, w, mm, out=torch.empty(3, 5, 6, dtype=BF16), out_dtype=FP32)
    for dtype in (torch.float64, torch.int32):
        with pytest.raises(TypeError, match=rf"out must be {DTYPE_WORDS}; got {dtype}"):
            grouped_mm_masked(x, w, mm, out=torch.empty(3, 5, 6, dtype=dtype))
    with pytest.raises(TypeError, match=rf"out_dtype must be {DTYPE_WORDS}; got torch\.int32"):
        grouped_mm_masked(x, w, mm, out_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"out must be a torch\.Tensor \(G, M, N\)"):
        grouped_mm_masked(x, w, mm, out=[[0.0]])  # type: ignore[arg-type]


def test_config_errors() -> None:
    x, w, mm = _err_inputs(BF16)
    with pytest.raises(TypeError, match=r"config must be a moe_gemm\.GemmConfig or None; got "
                                        r"str"):
        grouped_mm_masked(x, w, mm, config="torch")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"backend='cute' cannot run here: tensors are on "
                                           r"cpu"):
        grouped_mm_masked(x, w, mm, config=GemmConfig(backend="cute"))
    # The arguments are checked before the backend is chosen.
    with pytest.raises(ValueError, match=r"masked_m\[1\]=9"):
        grouped_mm_masked(x, w, _counts([0, 9, 0]), config=GemmConfig(backend="cute"))


# --------------------------------------------------------------------------------------------
# Autograd (the torch backend is differentiable)


@pytest.mark.parametrize(("dtype", "out_dtype"), [(FP32, None), (BF16, None), (BF16, FP32)])
def test_autograd_valid_rows_only(dtype: torch.dtype, out_dtype: torch.dtype | None) -> None:
    G, M, N, K = 4, 7, 6, 5
    x, w = _inputs(G, M, N, K, dtype, seed=30)
    counts = [0, 7, 3, 1]
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_mm_masked(xg, wg, _counts(counts), out_dtype=out_dtype)
    r = torch.randn(G, M, N, generator=_gen(31))
    (y.float() * r).sum().backward()
    rx = torch.zeros(G, M, K, dtype=torch.float64)
    rw = torch.zeros(G, K, N, dtype=torch.float64)
    for g, c in enumerate(counts):
        rx[g, :c] = r[g, :c].double() @ w[g].double().t()
        rw[g] = x[g, :c].double().t() @ r[g, :c].double()
    tol = 1e-5 if dtype == FP32 else 3e-2
    assert xg.grad.dtype == dtype and wg.grad.dtype == dtype
    torch.testing.assert_close(xg.grad.double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(wg.grad.double(), rw, rtol=tol, atol=tol)
    assert not _past(xg.grad, counts).any(), "rows past masked_m must get zero gradient"


def test_autograd_w_ignores_what_the_rows_past_the_counts_hold() -> None:
    x, w = _inputs(2, 4, 5, 3, FP32, seed=32)
    counts = [2, 3]
    x[0, 2:] = float("nan")
    x[1, 3:] = float("inf")
    wg = w.clone().requires_grad_()
    grouped_mm_masked(x, wg, _counts(counts)).sum().backward()
    want = torch.stack([x[g, :c].t() @ torch.ones(c, 5) for g, c in enumerate(counts)])
    torch.testing.assert_close(wg.grad, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("granularity", ["block", "row"])
def test_fp8_scale_grads_ignore_what_the_rows_past_the_counts_hold(granularity: str) -> None:
    # As the 16-bit form: NaN rows (and scales) past the counts, as an uninitialised dispatch
    # buffer holds them, reach no gradient of the scales on the torch backend.
    x, w, sa, sb = make_fp8_batched_inputs(2, 4, 128, 8, granularity, seed=33)
    counts = [2, 4]
    x = x.clone()
    x.view(torch.uint8)[0, 2:] = 0x7F  # e4m3fn NaN
    sa = sa.clone()
    sa[0, 2:] = float("nan")
    sag, sbg = sa.clone().requires_grad_(), sb.clone().requires_grad_()
    y = scaled_grouped_mm_masked(x, w, sag, sbg, _counts(counts), out_dtype=FP32)
    y.sum().backward()
    x0, sa0 = x.clone(), sa.clone()
    x0.view(torch.uint8)[0, 2:] = 0
    sa0[0, 2:] = 0
    sar, sbr = sa0.clone().requires_grad_(), sb.clone().requires_grad_()
    scaled_grouped_mm(x0, w, sar, sbr, out_dtype=FP32).sum().backward()
    assert not _past(y, counts).any()
    torch.testing.assert_close(sbg.grad, sbr.grad)
    torch.testing.assert_close(sag.grad, sar.grad)
    assert not sag.grad[0, 2:].any()


# --------------------------------------------------------------------------------------------
# torch.library registrations: opcheck, fake tensors, torch.compile


def test_opcheck_grouped_mm_masked() -> None:
    x, w = _inputs(3, 5, 8, 16, FP32, seed=40)
    mm = _counts([0, 5, 2])
    opcheck(OPS._grouped_mm_masked.default, (x, w, mm, None, "", None))
    xb, wb = x.to(BF16), w.to(BF16)
    opcheck(OPS._grouped_mm_masked.default, (xb, wb, mm, 2, "{'backend': 'torch'}", FP32))
    out = torch.full((3, 5, 8), 7.0, dtype=BF16)
    opcheck(OPS._grouped_mm_masked_out.default, (xb, wb, mm, None, out, "", None))
    opcheck(OPS._grouped_mm_masked.default,
            (x.clone().requires_grad_(), w.clone().requires_grad_(), mm, None, "", None),
            test_utils=NO_AOT)


def test_opcheck_scaled_grouped_mm_masked() -> None:
    x, w, sa, sb = make_fp8_batched_inputs(3, 5, 256, 16, "block", seed=41)
    mm = _counts([0, 5, 2])
    opcheck(OPS._scaled_grouped_mm_masked.default, (x, w, sa, sb, mm, None, "", None),
            test_utils=FP8_UTILS)
    out = torch.full((3, 5, 16), 7.0, dtype=BF16)
    opcheck(OPS._scaled_grouped_mm_masked_out.default, (x, w, sa, sb, mm, None, out, "", None),
            test_utils=FP8_UTILS)
    x, w, sa, sb = make_fp8_batched_inputs(3, 5, 128, 16, "row", seed=42)
    opcheck(OPS._scaled_grouped_mm_masked.default, (x, w, sa, sb, mm, 1, "", FP32),
            test_utils=FP8_UTILS)


def test_fake_tensors_give_shapes_and_dtypes() -> None:
    with FakeTensorMode():
        x = torch.empty(4, 64, 32, dtype=BF16)
        w = torch.empty(4, 24, 32, dtype=BF16).transpose(1, 2)
        mm = torch.empty(4, dtype=I32)
        y = grouped_mm_masked(x, w, mm, out_dtype=FP32)
        y8 = scaled_grouped_mm_masked(torch.empty(4, 64, 256, dtype=torch.float8_e4m3fn),
                                      torch.empty(4, 24, 256,
                                                  dtype=torch.float8_e4m3fn).transpose(1, 2),
                                      torch.empty(4, 64, 2), torch.empty(4, 2, 1), mm)
        with pytest.raises(ValueError, match=r"so w must be \(4, 32, N\)"):
            grouped_mm_masked(x, w[:, :16], mm)
        with pytest.raises(ValueError, match=r"masked_m must have one row count per problem"):
            grouped_mm_masked(x, w, mm[:3])
        with pytest.raises(TypeError, match=r"masked_m must be int32"):
            grouped_mm_masked(x, w, mm.long())
    assert isinstance(y, FakeTensor) and y.shape == (4, 64, 24) and y.dtype == FP32
    assert y8.shape == (4, 64, 24) and y8.dtype == BF16


@pytest.fixture
def dynamo():
    """A fresh torch._dynamo with its counters cleared."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_compile_grouped_mm_masked_fullgraph(dynamo) -> None:
    x, w = _inputs(4, 9, 8, 16, BF16, seed=42, w_layout="nk_view")
    counts = [9, 0, 4, 1]
    mm = _counts(counts)

    def f(x, w, mm, out):
        y = grouped_mm_masked(x, w, mm, expected_m=2)
        grouped_mm_masked(x, w, mm, out=out, config=TORCH)  # the mutating op
        return y * 2, grouped_mm_masked(x, w, mm, out_dtype=FP32)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)
    out_c = torch.full((4, 9, 8), SENTINEL, dtype=BF16)
    out_e = out_c.clone()
    got, want = compiled(x, w, mm, out_c), f(x, w, mm, out_e)
    for g, r in zip((*got, out_c), (*want, out_e)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert (_past(out_c, counts) == SENTINEL).all()
    check_new_output(got[1], x, w, counts, FP32)
    assert dynamo["graph_break"] == {}
    # New counts, same shapes: no recompile, new rows.
    counts2 = [1, 9, 0, 5]
    mm2 = _counts(counts2)
    got2 = compiled(x, w, mm2, out_c)
    torch.testing.assert_close(got2[1], f(x, w, mm2, out_e)[1], rtol=0, atol=0)
    check_new_output(got2[1], x, w, counts2, FP32)
    assert dynamo["stats"]["unique_graphs"] == 1


def test_compile_scaled_grouped_mm_masked_fullgraph(dynamo) -> None:
    x, w, sa, sb = make_fp8_batched_inputs(3, 6, 256, 24, "block", seed=44)
    counts = [6, 0, 2]
    mm = _counts(counts)

    def f(x, w, sa, sb, mm, out):
        scaled_grouped_mm_masked(x, w, sa, sb, mm, out=out)
        return scaled_grouped_mm_masked(x, w, sa, sb, mm, out_dtype=FP32, expected_m=2) + 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)
    out_c = torch.full((3, 6, 24), SENTINEL, dtype=BF16)
    out_e = out_c.clone()
    got, want = compiled(x, w, sa, sb, mm, out_c), f(x, w, sa, sb, mm, out_e)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    assert (_past(out_c, counts) == SENTINEL).all()
    assert dynamo["graph_break"] == {}


@pytest.mark.parametrize("op", ["plain", "scaled", "fused"])
def test_compiled_out_call_keeps_the_raising_backward(dynamo, op: str) -> None:
    # Traced, the masked ops are inference-only: a backward raises. With `out` and an input
    # requiring grad, the call used to run the `_out` op (no autograd), so the result lost its
    # link to the inputs and a backward skipped the call without a word.
    counts = [6, 0, 2]
    mm = _counts(counts)
    if op == "scaled":
        x, w, sa, sb = make_fp8_batched_inputs(3, 6, 256, 24, "block", seed=44)
        grad_in = sa = sa.clone().requires_grad_()

        def f(out):
            return scaled_grouped_mm_masked(x, w, sa, sb, mm, out=out)
    else:
        x = torch.randn(3, 6, 16, requires_grad=True)
        w, grad_in = torch.randn(3, 16, 24 if op == "plain" else 48), x
        run = grouped_mm_masked if op == "plain" else (
            lambda *t, **kw: moe_gemm.fused_grouped_mm_masked(*t, gate="silu", **kw))

        def f(out):
            return run(x, w, mm, out=out)

    out_c = torch.full((3, 6, 24), SENTINEL, dtype=BF16 if op == "scaled" else FP32)
    out_e = out_c.clone()
    y = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)(out_c)
    assert y is out_c and y.requires_grad and grad_in.grad is None
    with torch.no_grad():
        f(out_e)
    torch.testing.assert_close(out_c.detach(), out_e, rtol=0, atol=0)
    assert (_past(out_c.detach(), counts) == SENTINEL).all()
    with pytest.raises(RuntimeError, match="inference-only"):
        y.float().sum().backward()


# --------------------------------------------------------------------------------------------
# FP8: scaled_grouped_mm_masked


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
@pytest.mark.parametrize("out_dtype", [None, FP16, FP32])
def test_fp8_valid_rows_equal_the_batched_form(granularity: str,
                                               out_dtype: torch.dtype | None) -> None:
    x, w, sa, sb = make_fp8_batched_inputs(4, 9, 256, 40, granularity, seed=50)
    counts = [0, 9, 4, 1]
    y = scaled_grouped_mm_masked(x, w, sa, sb, _counts(counts), out_dtype=out_dtype)
    assert y.shape == (4, 9, 40) and y.dtype == (out_dtype or BF16)
    full = scaled_grouped_mm(x, w, sa, sb, out_dtype=out_dtype)
    assert torch.equal(_valid(y, counts), _valid(full, counts))
    assert not _past(y, counts).any()
    assert_fp8_close(_valid(y, counts), _valid(scaled_grouped_mm_ref(x, w, sa, sb), counts))


@pytest.mark.parametrize("granularity", ["block", "row"])
def test_fp8_out_keeps_its_rows_past_the_counts(granularity: str) -> None:
    x, w, sa, sb = make_fp8_batched_inputs(3, 7, 128, 24, granularity, seed=51)
    counts = [7, 2, 0]
    out = torch.full((3, 7, 24), SENTINEL, dtype=FP32)
    assert scaled_grouped_mm_masked(x, w, sa, sb, _counts(counts), out=out) is out
    full = scaled_grouped_mm(x, w, sa, sb, out_dtype=FP32)
    assert torch.equal(_valid(out, counts), _valid(full, counts))
    assert (_past(out, counts) == SENTINEL).all()
    # a strided count view, and counts 0 and M in one call
    base = _counts([0, -1, 7, -1, 7, -1])
    y = scaled_grouped_mm_masked(x, w, sa, sb, base[::2])
    assert not y[0].any() and torch.equal(y[1:], scaled_grouped_mm(x, w, sa, sb)[1:])


def test_fp8_empty_and_k_zero() -> None:
    e4 = torch.float8_e4m3fn
    y = scaled_grouped_mm_masked(torch.zeros(0, 4, 128, dtype=e4), torch.zeros(0, 128, 16,
                                                                                dtype=e4),
                                 torch.ones(0, 4, 1), torch.ones(0, 1, 1), _counts([]))
    assert y.shape == (0, 4, 16)
    x = torch.zeros(2, 4, 0, dtype=e4)
    w = torch.zeros(2, 0, 16, dtype=e4)
    out = torch.full((2, 4, 16), SENTINEL, dtype=BF16)
    got = scaled_grouped_mm_masked(x, w, torch.ones(2, 4), torch.ones(2, 16), _counts([3, 0]),
                                   out=out)
    assert got is out and not out[0, :3].any() and (out[0, 3:] == SENTINEL).all()
    assert (out[1] == SENTINEL).all()


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.__setitem__(4, [0, 9, 4]), TypeError, r"masked_m must be a torch\.Tensor"),
    (lambda a: a.__setitem__(4, a[4].long()), TypeError, r"masked_m must be int32"),
    (lambda a: a.__setitem__(4, a[4][:2]), ValueError, r"one row count per problem: \(3,\)"),
    (lambda a: a.__setitem__(4, a[4].to("meta")), ValueError, r"masked_m is on meta"),
    (lambda a: a.__setitem__(4, _counts([0, 10, 4])), ValueError,
     r"masked_m values must be in \[0, M\] = \[0, 9\].*masked_m\[1\]=10"),
    (lambda a: a.__setitem__(4, _counts([0, 1, -2])), ValueError, r"masked_m\[2\]=-2"),
    (lambda a: a.__setitem__(0, a[0][0]), ValueError, r"x must be 3-D"),
    (lambda a: a.__setitem__(1, a[1][:2]), ValueError, r"so w must be"),
    (lambda a: a.__setitem__(2, a[2][:, :, :1]), ValueError, r"match no granularity"),
    (lambda a: a.__setitem__(0, a[0].float()), TypeError, r"x must be torch\.float8_e4m3fn"),
])
def test_fp8_argument_errors(change, error, match) -> None:
    a = list(make_fp8_batched_inputs(3, 9, 256, 16, "block", seed=52)) + [_counts([0, 9, 4])]
    change(a)
    with pytest.raises(error, match=match):
        scaled_grouped_mm_masked(*a)


def test_fp8_expected_m_and_out_errors() -> None:
    x, w, sa, sb = make_fp8_batched_inputs(3, 9, 256, 16, "row", seed=53)
    mm = _counts([0, 9, 4])
    with pytest.raises(TypeError, match=r"expected_m must be an int .*; got bool"):
        scaled_grouped_mm_masked(x, w, sa, sb, mm, expected_m=True)
    with pytest.raises(ValueError, match=r"expected_m must be >= 1 .*; got 0"):
        scaled_grouped_mm_masked(x, w, sa, sb, mm, expected_m=0)
    with pytest.raises(ValueError, match=r"out must be"):
        scaled_grouped_mm_masked(x, w, sa, sb, mm, out=torch.empty(3, 9, 15, dtype=BF16))
    with pytest.raises(TypeError, match=r"out must have dtype"):
        scaled_grouped_mm_masked(x, w, sa, sb, mm, out=torch.empty(3, 9, 16, dtype=FP16),
                                 out_dtype=BF16)
    with pytest.raises(RuntimeError, match=r"backend='cute' cannot run here"):
        scaled_grouped_mm_masked(x, w, sa, sb, mm, config=GemmConfig(backend="cute"))
    assert torch.equal(scaled_grouped_mm_masked(x, w, sa, sb, mm, expected_m=1),
                       scaled_grouped_mm_masked(x, w, sa, sb, mm))


# --------------------------------------------------------------------------------------------
# The Hopper host path, the compiled kernel emulated


class MaskedKernelEmulator:
    """Takes exactly the arguments ops/masked_launch.py passes the compiled masked kernel and
    computes what it computes from them: problem p's first clamp(counts[p], 0, M) rows of
    x[p] @ w[p] (fp64, rounded once), nothing else written."""

    def __init__(self, key) -> None:
        self.key = key
        self.calls: list[tuple] = []

    def _rows(self, counts, G, M, num_ctas):
        key = self.key
        assert key.form == "masked" and key.visitor == "device" and not key.tail_split
        assert counts.dtype == I32 and counts.shape == (G,) and counts.is_contiguous()
        assert 1 <= num_ctas <= 132
        return [max(0, min(int(c), M)) for c in counts]

    def __call__(self, x, w, out, meta, meta32, counts, table, workspace, trace, num_problems,
                 num_ctas, swizzle, a_policy, b_policy, pdl, d_base):
        self.calls.append((x, w, out, counts, num_problems, num_ctas))
        assert num_problems == x.shape[0] and x.stride(2) == 1 and out.stride(2) == 1
        assert (w.stride(1) == 1) == (self.key.b_major == "k")
        for g, r in enumerate(self._rows(counts, num_problems, x.shape[1], num_ctas)):
            out[g, :r] = (x[g, :r].double() @ w[g].double()).to(out.dtype)


class Fp8MaskedKernelEmulator(MaskedKernelEmulator):
    """The FP8 masked kernel: the same rows, the operands dequantized by their scale views."""

    def __call__(self, x, w, out, sfa, sfb, smeta, meta, meta32, counts, table, workspace,
                 trace, num_problems, num_ctas, swizzle, a_policy, b_policy, pdl, d_base):
        self.calls.append((x, w, out, counts, num_problems, num_ctas))
        block = self.key.scale_mode == "block"
        assert sfa.shape[:2] == x.shape[:2] and sfb.shape[0] == num_problems
        for g, r in enumerate(self._rows(counts, num_problems, x.shape[1], num_ctas)):
            out[g, :r] = (_dequant_a(x[g, :r], sfa[g, :r], block)
                          @ _dequant_b(w[g], sfb[g], block)).to(out.dtype)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> list[MaskedKernelEmulator]:
    """The masked ops on the Hopper path with CPU tensors: each compile makes an emulator."""
    made: list[MaskedKernelEmulator] = []

    def compiled(key):
        emu = (Fp8MaskedKernelEmulator if hasattr(key, "scale_mode") else
               MaskedKernelEmulator)(key)
        made.append(emu)
        return emu

    clear_caches()
    install(monkeypatch, None)
    monkeypatch.setattr(launch_kernel, "_compiled", compiled)
    monkeypatch.setattr(masked_launch, "_kernel", compiled)
    monkeypatch.setattr(masked, "cute_problem", lambda device=None: None)
    masked._clear_plans()
    yield made
    masked._clear_plans()
    clear_caches()


@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("out_dtype", [None, FP32])
def test_host_path_valid_rows(emulated, w_layout: str, out_dtype: torch.dtype | None) -> None:
    x, w = _inputs(5, 40, 32, 24, BF16, seed=60, w_layout=w_layout)
    counts = [0, 1, 40, 17, 39]
    y = grouped_mm_masked(x, w, _counts(counts), out_dtype=out_dtype)
    assert len(emulated) == 1 and len(emulated[0].calls) == 1
    key = emulated[0].key
    assert key.form == "masked" and key.b_major == ("k" if w_layout == "nk_view" else "n")
    check_valid(y, x, w, counts, out_dtype or BF16)  # rows past the counts: unspecified
    out = torch.full((5, 40, 32), SENTINEL, dtype=out_dtype or BF16)
    assert grouped_mm_masked(x, w, _counts(counts), out=out) is out
    check_valid(out, x, w, counts, out_dtype or BF16)
    assert (_past(out, counts) == SENTINEL).all()


def test_host_path_plan_is_cached_and_reads_new_counts(emulated) -> None:
    x, w = _inputs(4, 64, 48, 32, BF16, seed=61)
    mm = _counts([64, 0, 3, 40])
    grouped_mm_masked(x, w, mm)
    counts = [1, 64, 0, 33]
    mm.copy_(_counts(counts))  # in place, as a CUDA graph's replay sees them
    out = torch.full((4, 64, 48), SENTINEL, dtype=BF16)
    grouped_mm_masked(x, w, mm, out=out)
    y = grouped_mm_masked(x, w, mm)
    # One plan per output mode (a new output or `out`), both of one kernel; the third call
    # found the first's plan.
    assert len(emulated) == 2 and emulated[0].key == emulated[1].key
    calls = emulated[0].calls
    assert len(calls) == 2 and calls[-1][3] is mm  # the counts are the kernel's `offs`
    check_valid(y, x, w, counts, BF16)
    check_valid(out, x, w, counts, BF16)
    assert (_past(out, counts) == SENTINEL).all()


def test_host_path_strided_counts_are_copied(emulated) -> None:
    x, w = _inputs(3, 16, 16, 16, BF16, seed=62)
    base = _counts([16, -7, 0, -7, 9, -7])
    y = grouped_mm_masked(x, w, base[::2])
    passed = emulated[0].calls[-1][3]
    assert passed.is_contiguous() and torch.equal(passed, base[::2])
    check_valid(y, x, w, [16, 0, 9], BF16)


def test_host_path_out_overlapping_x(emulated) -> None:
    x, w = _inputs(3, 16, 16, 16, BF16, seed=63)
    x0 = x.clone()
    counts = [5, 16, 0]
    assert grouped_mm_masked(x, w, _counts(counts), out=x) is x
    check_valid(x, x0, w, counts, BF16)
    assert torch.equal(_past(x, counts), _past(x0, counts))


def test_host_path_kernel_choice(emulated) -> None:
    x, w = _inputs(4, 512, 256, 64, BF16, seed=64)
    mm = _counts([8, 0, 512, 3])
    grouped_mm_masked(x, w, mm, expected_m=8)
    small = launch_info.last_launch().choice
    grouped_mm_masked(x, w, mm)
    full = launch_info.last_launch().choice
    for c in (small, full):
        assert c.visitor == "device" and not c.tail_split
    # the choice plans for expected_m rows; the grid covers every problem full
    assert small.tile_m <= full.tile_m and (small.schedule, small.tile_m) == ("pingpong", 64)
    # visitor, sort_by_k do not apply; a pinned tail split is refused
    grouped_mm_masked(x, w, mm, config=GemmConfig(visitor="host", sort_by_k=True))
    assert emulated[-1].key.visitor == "device"
    with pytest.raises(ValueError, match=r"the masked form has no tail split"):
        grouped_mm_masked(x, w, mm, config=GemmConfig(tail_split=True))
    pinned = GemmConfig(schedule="cooperative", tile_m=128, tile_n=128, cluster_m=2, cluster_n=1)
    y = grouped_mm_masked(x, w, mm, config=pinned)
    key = emulated[-1].key
    assert (key.schedule, key.tile_m, key.tile_n, key.cluster_m) == ("cooperative", 128, 128, 2)
    check_valid(y, x, w, mm.tolist(), BF16)


def test_host_path_k_zero_and_empty(emulated) -> None:
    x, w = _inputs(3, 8, 16, 0, BF16, seed=65)
    out = torch.full((3, 8, 16), SENTINEL, dtype=BF16)
    grouped_mm_masked(x, w, _counts([8, 2, 0]), out=out)
    assert not out[0].any() and not out[1, :2].any()
    assert (out[1, 2:] == SENTINEL).all() and (out[2] == SENTINEL).all()
    x, w = _inputs(0, 8, 16, 16, BF16, seed=66)
    assert grouped_mm_masked(x, w, _counts([])).shape == (0, 8, 16)
    assert emulated == [], "nothing to launch"


@pytest.mark.parametrize("granularity", ["block", "row", "tensor"])
def test_host_path_fp8(emulated, granularity: str) -> None:
    x, w, sa, sb = make_fp8_batched_inputs(4, 20, 256, 48, granularity, seed=67)
    counts = [0, 20, 7, 1]
    mm = _counts(counts)
    ref = _valid(scaled_grouped_mm_ref(x, w, sa, sb), counts)
    y = scaled_grouped_mm_masked(x, w, sa, sb, mm, expected_m=4)
    key = emulated[0].key
    assert key.form == "masked" and key.scale_mode == ("block" if granularity == "block"
                                                        else "outer")
    assert_fp8_close(_valid(y, counts), ref)
    out = torch.full((4, 20, 48), SENTINEL, dtype=FP32)
    assert scaled_grouped_mm_masked(x, w, sa, sb, mm, out=out) is out
    assert_fp8_close(_valid(out, counts), ref)
    assert (_past(out, counts) == SENTINEL).all()
    with pytest.raises(ValueError, match=r"the masked form has no tail split"):
        scaled_grouped_mm_masked(x, w, sa, sb, mm, config=GemmConfig(tail_split=True))



@pytest.mark.parametrize("which", ["scale_a", "scale_b"])
def test_host_path_fp8_cached_plan_keeps_the_scales_backward_refusal(emulated,
                                                                     which: str) -> None:
    # Only the scales require grad: the kernel has no backward, so every call's result must
    # refuse one, the calls that find the cached plan as the first (which built it) does.
    x, w, sa, sb = make_fp8_batched_inputs(3, 12, 256, 32, "block", seed=68)
    scales = {"scale_a": sa, "scale_b": sb}
    scales[which] = scales[which].clone().requires_grad_()
    mm = _counts([12, 0, 5])
    for _ in range(3):
        y = scaled_grouped_mm_masked(x, w, scales["scale_a"], scales["scale_b"], mm)
        assert y.requires_grad
        with pytest.raises(RuntimeError, match="inference-only"):
            y.float().sum().backward()
    assert len(emulated) == 1 and len(emulated[0].calls) == 3  # one plan, found again


def test_the_masked_form_reports_no_trimmed_a_loads(emulated, monkeypatch) -> None:
    # Trimmed A loads are the varlen form's (the masked kernel loads one box per problem):
    # with them forced on, the launch's recorded choice must not claim them.
    from moe_gemm.ops.heuristics import TRIM_A_ENV
    from moe_gemm.ops.launch_info import last_launch

    monkeypatch.setenv(TRIM_A_ENV, "1")
    x, w = _inputs(3, 40, 32, 24, BF16, seed=61, w_layout="kn")
    grouped_mm_masked(x, w, torch.tensor([5, 0, 40], dtype=I32))
    assert emulated and not emulated[-1].key.trim_a
    assert last_launch().choice.trim_a is False
