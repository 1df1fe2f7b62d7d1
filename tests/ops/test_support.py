"""moe_gemm.kernels.support: what the sm90 kernels can take, from shapes, strides and dtypes.

Each rejection must come with a sentence naming the reason (16-byte TMA rules, 16-bit inputs),
and every layout the kernels do take (row-major A, row- or column-major B) must pass.
"""

from __future__ import annotations

import pytest
import torch

from moe_gemm import GemmConfig
from moe_gemm.ops import support
from moe_gemm.ops.support import (
    grouped_gemm_unsupported,
    grouped_mm_unsupported,
    operand_major,
    tma_problem,
)
from moe_gemm.ops.validation import check_grouped_gemm, check_grouped_mm
from moe_gemm.testing import make_grouped_inputs, make_moe_inputs

BF16 = torch.bfloat16


def _gemm(sizes: list[tuple[int, int, int]], dtype: torch.dtype = BF16, b_layout: str = "row",
          out_dtype: torch.dtype | None = None) -> str | None:
    a, b = make_grouped_inputs(sizes, dtype, b_layout=b_layout)
    return grouped_gemm_unsupported(check_grouped_gemm(a, b, None, out_dtype))


def _mm(T: int, E: int, K: int, N: int, dtype: torch.dtype = BF16, w_layout: str = "kn",
        out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> str | None:
    x, w, offs = make_moe_inputs(T, E, K, N, dtype, w_layout=w_layout)
    return grouped_mm_unsupported(check_grouped_mm(x, w, offs, out, out_dtype), GemmConfig())


def _offset_by_one(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor whose data starts one element into its storage (2 or 4 bytes)."""
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + 1).to(dtype)[1:].view(shape)


# --------------------------------------------------------------------------------------------
# Pieces


def test_operand_major() -> None:
    assert operand_major(torch.empty(4, 8)) == "row"
    assert operand_major(torch.empty(8, 4).T) == "col"
    assert operand_major(torch.empty(3, 4, 8)) == "row"
    assert operand_major(torch.empty(3, 8, 4).transpose(1, 2)) == "col"
    assert operand_major(torch.empty(4, 16)[:, ::2]) is None
    assert operand_major(torch.empty(16, 16)[::2, ::2]) is None
    assert operand_major(torch.empty(4, 1)) == "row"  # a size-1 dim has no meaningful stride


def test_tma_problem_accepts_aligned() -> None:
    assert tma_problem("a", torch.empty(5, 64, dtype=BF16)) is None
    assert tma_problem("b", torch.empty(24, 64, dtype=BF16).T) is None  # column-major
    assert tma_problem("w", torch.empty(3, 16, 24, dtype=BF16)) is None
    assert tma_problem("w", torch.empty(3, 24, 16, dtype=BF16).transpose(1, 2)) is None
    assert tma_problem("o", torch.empty(7, 12, dtype=torch.float32)) is None  # 48-byte rows
    assert tma_problem("e", torch.empty(0, 3, dtype=BF16)) is None  # nothing to load


def test_tma_problem_rejects_unaligned_row_stride() -> None:
    why = tma_problem("a[0]", torch.empty(5, 12, dtype=BF16))
    assert why is not None
    assert "a[0] stride 12 (dim 0) is not a multiple of 8 elements (16 bytes)" in why
    why32 = tma_problem("x", torch.empty(5, 6, dtype=torch.float32))
    assert why32 is not None and "multiple of 4 elements (16 bytes)" in why32


def test_tma_problem_rejects_misaligned_pointer() -> None:
    t = _offset_by_one((4, 64), BF16)
    assert t.data_ptr() % 16 != 0
    assert tma_problem("a[0]", t) == "a[0]'s data pointer is not 16-byte aligned"


def test_tma_problem_rejects_no_unit_stride() -> None:
    why = tma_problem("b[0]", torch.empty(16, 32, dtype=BF16)[:, ::2])
    assert why is not None and "b[0] has no unit-stride dimension among its last two" in why


def test_tma_problem_checks_batch_stride() -> None:
    # (E, K, N) slices of a padded buffer whose expert stride is 8 + 1 elements off.
    buf = torch.empty(3 * (16 * 8 + 1), dtype=BF16)
    w = buf.as_strided((3, 16, 8), (16 * 8 + 1, 8, 1))
    why = tma_problem("w", w)
    assert why is not None and "(dim 0)" in why and "16 bytes" in why


# --------------------------------------------------------------------------------------------
# grouped_gemm


@pytest.mark.parametrize("b_layout", ["row", "col", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_aligned_is_supported(b_layout: str, dtype: torch.dtype) -> None:
    sizes = [(128, 512, 7168), (1, 64, 64), (77, 24, 40), (0, 8, 8)]
    assert _gemm(sizes, dtype, b_layout) is None
    assert _gemm(sizes, dtype, b_layout, out_dtype=torch.float32) is None


def test_gemm_fp32_inputs_rejected() -> None:
    why = _gemm([(8, 8, 8)], torch.float32)
    assert why == "the kernels take bf16 or fp16 inputs, not torch.float32"


def test_gemm_k_not_multiple_of_8_bf16() -> None:
    why = _gemm([(8, 64, 64), (8, 64, 12)], BF16)
    assert why is not None and "a[1]" in why and "16 bytes" in why


def test_gemm_k_not_multiple_of_8_in_column_major_b() -> None:
    # a (M, K=12) has 24-byte rows; with M = 1 there is no row stride, so the message is about
    # b = w.T, whose column stride is K.
    why = _gemm([(1, 64, 12)], BF16, b_layout="col")
    assert why is not None and "b[0]" in why and "16 bytes" in why


def test_gemm_misaligned_data_pointer() -> None:
    a = [_offset_by_one((4, 64), BF16)]
    b = [torch.randn(64, 32).to(BF16)]
    why = grouped_gemm_unsupported(check_grouped_gemm(a, b, None, None))
    assert why == "a[0]'s data pointer is not 16-byte aligned"


def test_gemm_column_major_a_rejected() -> None:
    a = [torch.randn(64, 16).to(BF16).T]  # (16, 64) with unit stride along M
    b = [torch.randn(64, 32).to(BF16)]
    why = grouped_gemm_unsupported(check_grouped_gemm(a, b, None, None))
    assert why == "a[0] must be row-major (K contiguous) for the kernel"


def test_gemm_out_rows_not_16_bytes() -> None:
    why = _gemm([(8, 12, 64)], BF16, b_layout="col")  # N = 12 bf16: 24-byte output rows
    assert why is not None
    assert "out[0] rows of 12 torch.bfloat16 elements are not a multiple of 16 bytes" in why


def test_gemm_n_multiple_of_4_with_fp32_out_is_fine() -> None:
    assert _gemm([(8, 12, 64)], BF16, b_layout="col", out_dtype=torch.float32) is None
    why = _gemm([(8, 10, 64)], BF16, b_layout="col", out_dtype=torch.float32)
    assert why is not None and "out[0] rows of 10 torch.float32" in why


def test_gemm_empty_problems_are_never_a_reason() -> None:
    # M = 0 or N = 0: no tiles, the kernel never touches the operands.
    assert _gemm([(0, 12, 12), (8, 64, 64)], BF16) is None
    assert _gemm([(8, 0, 12), (8, 64, 64)], BF16) is None
    # K = 0: operands are not loaded, but the zeros still need a storable output.
    assert _gemm([(8, 64, 0)], BF16) is None
    why = _gemm([(8, 12, 0)], BF16)
    assert why is not None and "out[0] rows of 12" in why


def test_gemm_given_out_layouts() -> None:
    a, b = make_grouped_inputs([(8, 16, 64)], BF16, b_layout="col")
    ok = [torch.empty(8, 16, dtype=BF16)]
    assert grouped_gemm_unsupported(check_grouped_gemm(a, b, ok, None)) is None
    padded = [torch.empty(8, 24, dtype=BF16)[:, :16]]  # 48-byte row stride: fine
    assert grouped_gemm_unsupported(check_grouped_gemm(a, b, padded, None)) is None
    col = [torch.empty(16, 8, dtype=BF16).T]
    why = grouped_gemm_unsupported(check_grouped_gemm(a, b, col, None))
    assert why == "out[0] must have unit stride along N"
    odd = [torch.empty(8, 20, dtype=BF16)[:, :16]]  # 40-byte row stride
    why = grouped_gemm_unsupported(check_grouped_gemm(a, b, odd, None))
    assert why is not None and "out[0] stride 20 (dim 0)" in why
    shifted = [_offset_by_one((8, 16), BF16)]
    why = grouped_gemm_unsupported(check_grouped_gemm(a, b, shifted, None))
    assert why == "out[0]'s data pointer is not 16-byte aligned"


def test_gemm_too_many_problems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "MAX_PROBLEMS", 3)
    why = _gemm([(8, 64, 64)] * 4, BF16)
    assert why == "4 problems exceed the kernel's 3"
    assert _gemm([(8, 64, 64)] * 3, BF16) is None


def test_dtype_problem_for_output() -> None:
    assert support._dtype_problem(BF16, torch.float64) == (
        "the kernels write bf16, fp16 or fp32, not torch.float64"
    )
    assert support._dtype_problem(torch.float16, torch.float32) is None


# --------------------------------------------------------------------------------------------
# grouped_mm


@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mm_aligned_is_supported(w_layout: str, dtype: torch.dtype) -> None:
    assert _mm(40, 4, 64, 32, dtype, w_layout) is None
    assert _mm(40, 4, 64, 32, dtype, w_layout, out_dtype=torch.float32) is None


def test_mm_fp32_rejected() -> None:
    assert _mm(8, 2, 16, 16, torch.float32) == (
        "the kernels take bf16 or fp16 inputs, not torch.float32"
    )


def test_mm_k_not_multiple_of_8() -> None:
    why = _mm(8, 2, 12, 16)
    assert why is not None and why.startswith("x stride 12") and "16 bytes" in why


def test_mm_n_not_multiple_of_8() -> None:
    why = _mm(8, 2, 16, 12, w_layout="kn")  # w (E, K, N=12) row-major: 24-byte rows of w
    assert why is not None and why.startswith("w stride 12")
    why = _mm(8, 2, 16, 12, w_layout="nk_view")  # w itself fine, output rows are not
    assert why == ("out rows of 12 torch.bfloat16 elements are not a multiple of 16 bytes, as "
                   "the TMA store needs")
    assert _mm(8, 2, 16, 12, w_layout="nk_view", out_dtype=torch.float32) is None


def test_mm_column_major_x_rejected() -> None:
    x = torch.randn(64, 8).to(BF16).T  # (8, 64), unit stride along T
    w = torch.randn(2, 64, 16).to(BF16)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    why = grouped_mm_unsupported(check_grouped_mm(x, w, offs, None, None), GemmConfig())
    assert why == "x must be row-major (K contiguous) for the kernel"


def test_mm_misaligned_pointers() -> None:
    x = _offset_by_one((8, 64), BF16)
    w = torch.randn(2, 64, 16).to(BF16)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    why = grouped_mm_unsupported(check_grouped_mm(x, w, offs, None, None), GemmConfig())
    assert why == "x's data pointer is not 16-byte aligned"
    x = torch.randn(8, 64).to(BF16)
    w = _offset_by_one((2, 64, 16), BF16)
    why = grouped_mm_unsupported(check_grouped_mm(x, w, offs, None, None), GemmConfig())
    assert why == "w's data pointer is not 16-byte aligned"


def test_mm_given_out() -> None:
    x, w, offs = make_moe_inputs(8, 2, 64, 16, BF16)
    args = lambda out: check_grouped_mm(x, w, offs, out, None)  # noqa: E731
    assert grouped_mm_unsupported(args(torch.empty(8, 16, dtype=BF16)), GemmConfig()) is None
    why = grouped_mm_unsupported(args(torch.empty(16, 8, dtype=BF16).T), GemmConfig())
    assert why == "out must have unit stride along N"
    why = grouped_mm_unsupported(args(_offset_by_one((8, 16), BF16)), GemmConfig())
    assert why == "out's data pointer is not 16-byte aligned"


def test_mm_degenerate_shapes_are_never_a_reason() -> None:
    # No rows, no experts or no columns: nothing for the kernel to load or store.
    assert _mm(0, 2, 12, 12) is None
    x = torch.randn(5, 12).to(BF16)
    w = torch.randn(0, 12, 12).to(BF16)
    args = check_grouped_mm(x, w, torch.zeros(0, dtype=torch.int32), None, None)
    assert grouped_mm_unsupported(args, GemmConfig()) is None
    assert _mm(8, 2, 12, 0) is None


def test_mm_too_many_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "MAX_PROBLEMS", 3)
    assert _mm(8, 4, 64, 16) == "4 experts exceed the kernel's 3"
