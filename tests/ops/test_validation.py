"""Every argument check of the public ops: exception type and a message naming what was expected.

The 'meta' device stands in for "another device" on this CPU-only machine: tensors there have
shapes and dtypes but no data, which is all a device check needs.
"""

from __future__ import annotations

import re

import pytest
import torch

from moe_gemm import GemmConfig, grouped_gemm, grouped_mm
from moe_gemm.ops.validation import (
    check_grouped_gemm,
    check_grouped_mm,
    check_offs_values,
    offs_check_requested,
    resolve_out_dtype,
)
from moe_gemm.testing import make_grouped_inputs, make_moe_inputs, poison_

DTYPE_WORDS = r"torch\.bfloat16, torch\.float16 or torch\.float32"


def _gemm_inputs(dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], ...]:
    g = torch.Generator().manual_seed(1)
    return make_grouped_inputs([(5, 4, 16), (3, 6, 8)], dtype, generator=g)


def _mm_inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 16, generator=g).to(dtype)
    w = torch.randn(3, 16, 8, generator=g).to(dtype)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    return x, w, offs


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# grouped_gemm: the sequences themselves


def test_single_tensor_instead_of_list_a() -> None:
    a, b = _gemm_inputs()
    with pytest.raises(TypeError, match=r"a must be a sequence .* of 2-D tensors \(M_i, K_i\); "
                                        r"got a single tensor of shape \(5, 16\)"):
        grouped_gemm(a[0], b)


def test_single_3d_tensor_instead_of_list_suggests_unbind() -> None:
    a, b = _gemm_inputs()
    batch = torch.randn(2, 16, 4)
    with pytest.raises(TypeError, match=r"b must be a sequence .*single tensor of shape "
                                        r"\(2, 16, 4\).*unbind"):
        grouped_gemm(a, batch)


@pytest.mark.parametrize("bad", ["ab", b"ab", 3, None, {"x": 1}])
def test_a_not_a_sequence(bad: object) -> None:
    _, b = _gemm_inputs()
    with pytest.raises(TypeError, match=r"a must be a sequence \(list or tuple\) of 2-D tensors"):
        grouped_gemm(bad, b)  # type: ignore[arg-type]


def test_a_generator_rejected() -> None:
    a, b = _gemm_inputs()
    with pytest.raises(TypeError, match="a must be a sequence"):
        grouped_gemm(iter(a), b)  # type: ignore[arg-type]


def test_tuples_accepted() -> None:
    a, b = _gemm_inputs()
    out = grouped_gemm(tuple(a), tuple(b))
    assert isinstance(out, list) and len(out) == 2


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("item", [3, None, [[1.0]], "t"])
def test_non_tensor_item(which: str, item: object) -> None:
    a, b = _gemm_inputs()
    seq = list(a) if which == "a" else list(b)
    seq[1] = item  # type: ignore[call-overload]
    args = (seq, b) if which == "a" else (a, seq)
    with pytest.raises(TypeError, match=rf"{which}\[1\] must be a torch\.Tensor"):
        grouped_gemm(*args)


@pytest.mark.parametrize("na, nb", [(2, 1), (1, 2), (0, 1), (2, 0)])
def test_count_mismatch(na: int, nb: int) -> None:
    a, b = _gemm_inputs()
    a2 = (a * 2)[:na]
    b2 = (b * 2)[:nb]
    with pytest.raises(ValueError, match=rf"expected one b per a: got len\(a\)={na} and "
                                         rf"len\(b\)={nb}"):
        grouped_gemm(a2, b2)


# --------------------------------------------------------------------------------------------
# grouped_gemm: ranks, K, dtypes, devices


@pytest.mark.parametrize("shape", [(16,), (1, 3, 8), ()])
def test_a_wrong_rank(shape: tuple[int, ...]) -> None:
    a, b = _gemm_inputs()
    a[1] = torch.randn(shape)
    with pytest.raises(ValueError, match=r"a\[1\] must be 2-D \(M_i, K_i\); got shape"):
        grouped_gemm(a, b)


def test_a0_wrong_rank() -> None:
    a, b = _gemm_inputs()
    a[0] = torch.randn(16)
    with pytest.raises(ValueError, match=r"a\[0\] must be 2-D \(M_i, K_i\)"):
        grouped_gemm(a, b)


@pytest.mark.parametrize("shape", [(6,), (1, 8, 6)])
def test_b_wrong_rank(shape: tuple[int, ...]) -> None:
    a, b = _gemm_inputs()
    b[1] = torch.randn(shape)
    with pytest.raises(ValueError, match=r"b\[1\] must be 2-D \(K_i, N_i\); got shape"):
        grouped_gemm(a, b)


def test_k_mismatch_names_expected_k() -> None:
    a, b = _gemm_inputs()
    b[1] = torch.randn(7, 6)
    with pytest.raises(ValueError, match=r"problem 1: a\[1\] is \(M, K\) = \(3, 8\), so b\[1\] "
                                         r"must be \(K, N\) = \(8, N\); got \(7, 6\)"):
        grouped_gemm(a, b)


def test_k_mismatch_with_transposed_weight() -> None:
    # The classic mistake: passing an (N, K) nn.Linear weight instead of its .T view.
    a = [torch.randn(5, 16)]
    w = torch.randn(4, 16)  # (N, K)
    with pytest.raises(ValueError, match=r"b\[0\] must be \(K, N\) = \(16, N\); got \(4, 16\)"):
        grouped_gemm(a, [w])
    assert grouped_gemm(a, [w.T])[0].shape == (5, 4)


@pytest.mark.parametrize(
    "which, idx, dtype",
    [("a", 1, torch.float16), ("b", 0, torch.bfloat16), ("b", 1, torch.float16)],
)
def test_mixed_dtypes(which: str, idx: int, dtype: torch.dtype) -> None:
    a, b = _gemm_inputs()
    seq = a if which == "a" else b
    seq[idx] = seq[idx].to(dtype)
    with pytest.raises(TypeError, match=rf"{which}\[{idx}\] has dtype {dtype} but a\[0\] has "
                                        r"torch\.float32; every operand must share one dtype"):
        grouped_gemm(a, b)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int32, torch.int64, torch.int8, torch.bool, torch.complex64]
)
def test_unsupported_dtype(dtype: torch.dtype) -> None:
    a = [torch.ones(2, 3, dtype=dtype)]
    b = [torch.ones(3, 4, dtype=dtype)]
    with pytest.raises(TypeError, match=rf"a\[0\] must be {DTYPE_WORDS}; got {dtype}"):
        grouped_gemm(a, b)


def test_unsupported_dtype_in_later_b() -> None:
    a, b = _gemm_inputs()
    b[1] = b[1].double()
    with pytest.raises(TypeError, match=rf"b\[1\] must be {DTYPE_WORDS}; got torch\.float64"):
        grouped_gemm(a, b)


def test_mixed_devices() -> None:
    a, b = _gemm_inputs()
    b[1] = b[1].to("meta")
    with pytest.raises(ValueError, match=r"b\[1\] is on meta but a\[0\] is on cpu; every "
                                         r"operand must be on one device"):
        grouped_gemm(a, b)


# --------------------------------------------------------------------------------------------
# grouped_gemm: out and out_dtype


def test_out_not_a_sequence() -> None:
    a, b = _gemm_inputs()
    with pytest.raises(TypeError, match=r"out must be a sequence .*\(M_i, N_i\); got a single "
                                        r"tensor"):
        grouped_gemm(a, b, out=torch.empty(5, 4))  # type: ignore[arg-type]


def test_out_count_mismatch() -> None:
    a, b = _gemm_inputs()
    with pytest.raises(ValueError, match=r"expected one out per problem: got len\(out\)=1 for "
                                         r"2 problems"):
        grouped_gemm(a, b, out=[torch.empty(5, 4)])


def test_out_item_not_a_tensor() -> None:
    a, b = _gemm_inputs()
    with pytest.raises(TypeError, match=r"out\[1\] must be a torch\.Tensor \(M_i, N_i\)"):
        grouped_gemm(a, b, out=[torch.empty(5, 4), None])  # type: ignore[list-item]


@pytest.mark.parametrize("shape", [(3, 7), (6, 3), (18,), (1, 3, 6)])
def test_out_shape_mismatch(shape: tuple[int, ...]) -> None:
    a, b = _gemm_inputs()
    with pytest.raises(ValueError, match=r"out\[1\] must be \(M_i, N_i\) = \(3, 6\); got"):
        grouped_gemm(a, b, out=[torch.empty(5, 4), torch.empty(shape)])


def test_out_dtype_mismatch_between_outs() -> None:
    a, b = _gemm_inputs()
    out = [torch.empty(5, 4), torch.empty(3, 6, dtype=torch.bfloat16)]
    with pytest.raises(TypeError, match=r"out\[1\] must have dtype torch\.float32; got "
                                        r"torch\.bfloat16"):
        grouped_gemm(a, b, out=out)


def test_out_dtype_disagrees_with_out_dtype_argument() -> None:
    a, b = _gemm_inputs()
    out = [torch.empty(5, 4), torch.empty(3, 6)]
    with pytest.raises(TypeError, match=r"out\[0\] must have dtype torch\.bfloat16; got "
                                        r"torch\.float32"):
        grouped_gemm(a, b, out=out, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_out_unsupported_dtype(dtype: torch.dtype) -> None:
    a, b = _gemm_inputs()
    out = [torch.empty(5, 4, dtype=dtype), torch.empty(3, 6, dtype=dtype)]
    with pytest.raises(TypeError, match=rf"out\[0\] must be {DTYPE_WORDS}; got {dtype}"):
        grouped_gemm(a, b, out=out)


def test_out_on_other_device() -> None:
    a, b = _gemm_inputs()
    out = [torch.empty(5, 4), torch.empty(3, 6, device="meta")]
    with pytest.raises(ValueError, match=r"out\[1\] is on meta but the operands are on cpu"):
        grouped_gemm(a, b, out=out)


def test_bad_out_leaves_earlier_outs_untouched() -> None:
    # Validation runs before any compute: a bad out[1] must not leave out[0] half written.
    a, b = _gemm_inputs()
    good = poison_(torch.empty(5, 4))
    with pytest.raises(ValueError):
        grouped_gemm(a, b, out=[good, torch.empty(3, 7)])
    assert torch.isnan(good).all()


@pytest.mark.parametrize("bad", [torch.int32, torch.float64, torch.complex64])
def test_out_dtype_argument_unsupported(bad: torch.dtype) -> None:
    a, b = _gemm_inputs()
    with pytest.raises(TypeError, match=rf"out_dtype must be {DTYPE_WORDS}; got {bad}"):
        grouped_gemm(a, b, out_dtype=bad)


@pytest.mark.parametrize("bad", ["float32", "bf16", 1, float])
def test_out_dtype_argument_not_a_dtype(bad: object) -> None:
    a, b = _gemm_inputs()
    with pytest.raises(TypeError, match=r"out_dtype must be a torch\.dtype or None"):
        grouped_gemm(a, b, out_dtype=bad)  # type: ignore[arg-type]


def test_empty_problem_list_still_checks_out_dtype() -> None:
    with pytest.raises(TypeError, match="out_dtype must be"):
        grouped_gemm([], [], out_dtype=torch.int32)


def test_empty_problem_list_rejects_nonempty_out() -> None:
    with pytest.raises(ValueError, match=r"expected one out per problem: got len\(out\)=1"):
        grouped_gemm([], [], out=[torch.empty(2, 2)])


def test_empty_problem_list_rejects_single_tensor_out() -> None:
    with pytest.raises(TypeError, match="out must be a sequence"):
        grouped_gemm([], [], out=torch.empty(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("config", ["torch", {"backend": "torch"}, 1])
def test_bad_config_type_gemm(config: object) -> None:
    a, b = _gemm_inputs()
    with pytest.raises(TypeError, match=r"config must be a moe_gemm\.GemmConfig or None; got"):
        grouped_gemm(a, b, config=config)  # type: ignore[arg-type]


def test_keyword_only_arguments() -> None:
    a, b = _gemm_inputs()
    with pytest.raises(TypeError):
        grouped_gemm(a, b, None)  # type: ignore[misc]
    x, w, offs = _mm_inputs()
    with pytest.raises(TypeError):
        grouped_mm(x, w, offs, None)  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# grouped_mm


@pytest.mark.parametrize("which", ["x", "w", "offs"])
def test_mm_non_tensor(which: str) -> None:
    args = dict(zip(("x", "w", "offs"), _mm_inputs()))
    args[which] = args[which].tolist()  # type: ignore[assignment]
    hint = {"x": r"\(T, K\)", "w": r"\(E, K, N\)", "offs": r"\(E,\)"}[which]
    with pytest.raises(TypeError, match=rf"{which} must be a torch\.Tensor {hint}; got list"):
        grouped_mm(args["x"], args["w"], args["offs"])


@pytest.mark.parametrize("shape", [(16,), (1, 10, 16)])
def test_mm_x_wrong_rank(shape: tuple[int, ...]) -> None:
    _, w, offs = _mm_inputs()
    with pytest.raises(ValueError, match=r"x must be 2-D \(T, K\) when offs is given; got shape"):
        grouped_mm(torch.randn(shape), w, offs)


@pytest.mark.parametrize("shape", [(16, 8), (1, 3, 16, 8)])
def test_mm_w_wrong_rank_hints_transpose(shape: tuple[int, ...]) -> None:
    x, _, offs = _mm_inputs()
    with pytest.raises(ValueError, match=r"w must be 3-D \(E, K, N\) \(for an \(E, N, K\) weight "
                                         r"pass w\.transpose\(1, 2\)\)"):
        grouped_mm(x, torch.randn(shape), offs)


def test_mm_k_mismatch() -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(ValueError, match=r"x is \(T, K\) = \(10, 16\), so w must be "
                                         r"\(E, 16, N\); got \(3, 8, 8\)"):
        grouped_mm(x, w[:, :8], offs)


def test_mm_untransposed_weight_rejected() -> None:
    # (E, N, K) passed where (E, K, N) is expected, with N != K: caught by the K check.
    x, _, offs = _mm_inputs()
    w_nk = torch.randn(3, 8, 16)
    with pytest.raises(ValueError, match=r"so w must be \(E, 16, N\); got \(3, 8, 16\)"):
        grouped_mm(x, w_nk, offs)
    assert grouped_mm(x, w_nk.transpose(1, 2), offs).shape == (10, 8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_mm_unsupported_x_dtype(dtype: torch.dtype) -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(TypeError, match=rf"x must be {DTYPE_WORDS}; got {dtype}"):
        grouped_mm(x.to(dtype), w.to(dtype), offs)


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float64])
def test_mm_x_w_dtype_mismatch(wdtype: torch.dtype) -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(TypeError, match=rf"w has dtype {wdtype} but x has torch\.float32; "
                                        "they must match"):
        grouped_mm(x, w.to(wdtype), offs)


def test_mm_w_on_other_device() -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(ValueError, match=r"w is on meta but x is on cpu; they must be on one "
                                         "device"):
        grouped_mm(x, w.to("meta"), offs)


def test_mm_offs_on_other_device() -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(ValueError, match=r"offs is on meta but x is on cpu; offs must live "
                                         "with x"):
        grouped_mm(x, w, offs.to("meta"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.float32, torch.uint8])
def test_mm_offs_not_int32(dtype: torch.dtype) -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(TypeError, match=rf"offs must be int32 cumulative end rows \(E,\); got "
                                        rf"dtype {dtype}"):
        grouped_mm(x, w, offs.to(dtype))


@pytest.mark.parametrize("offs", [_i32([[2, 2, 7]]), torch.tensor(7, dtype=torch.int32)])
def test_mm_offs_wrong_rank(offs: torch.Tensor) -> None:
    x, w, _ = _mm_inputs()
    with pytest.raises(ValueError, match=r"offs must be 1-D \(E,\) = \(3,\); got shape"):
        grouped_mm(x, w, offs)


@pytest.mark.parametrize("offs", [[2, 7], [2, 2, 7, 10], []])
def test_mm_offs_wrong_length(offs: list[int]) -> None:
    x, w, _ = _mm_inputs()
    with pytest.raises(ValueError, match=r"offs must have one entry per expert: \(3,\)"):
        grouped_mm(x, w, _i32(offs))


@pytest.mark.parametrize(
    "offs, i", [([3, 2, 7], 0), ([2, 7, 5], 1), ([0, 10, 0], 1), ([5, 5, 4], 1)]
)
def test_mm_offs_decreasing(offs: list[int], i: int) -> None:
    x, w, _ = _mm_inputs()
    msg = (rf"offs must be non-decreasing \(cumulative end rows\); got offs\[{i}\]={offs[i]} > "
           rf"offs\[{i + 1}\]={offs[i + 1]}")
    with pytest.raises(ValueError, match=msg):
        grouped_mm(x, w, _i32(offs))


@pytest.mark.parametrize("offs", [[-1, 2, 7], [-5, -5, -5]])
def test_mm_offs_negative(offs: list[int]) -> None:
    x, w, _ = _mm_inputs()
    with pytest.raises(ValueError, match=rf"offs must be >= 0 .*got offs\[0\]={offs[0]}"):
        grouped_mm(x, w, _i32(offs))


@pytest.mark.parametrize("offs", [[2, 2, 11], [11, 11, 11], [0, 0, 2**31 - 1]])
def test_mm_offs_past_t(offs: list[int]) -> None:
    x, w, _ = _mm_inputs()
    with pytest.raises(ValueError, match=rf"offs\[-1\] must be <= T = 10 \(rows of x\); got "
                                         rf"{offs[-1]}"):
        grouped_mm(x, w, _i32(offs))


def test_mm_bad_offs_leaves_out_untouched() -> None:
    x, w, _ = _mm_inputs()
    out = poison_(torch.empty(10, 8))
    with pytest.raises(ValueError):
        grouped_mm(x, w, _i32([2, 1, 7]), out=out)
    assert torch.isnan(out).all()


def test_mm_out_not_a_tensor() -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(TypeError, match=r"out must be a torch\.Tensor \(T, N\); got list"):
        grouped_mm(x, w, offs, out=[torch.empty(10, 8)])  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(10, 9), (9, 8), (80,), (1, 10, 8), (8, 10)])
def test_mm_out_wrong_shape(shape: tuple[int, ...]) -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(ValueError, match=r"out must be \(T, N\) = \(10, 8\); got"):
        grouped_mm(x, w, offs, out=torch.empty(shape))


def test_mm_out_dtype_mismatch() -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(TypeError, match=r"out must have dtype torch\.bfloat16; got "
                                        r"torch\.float32"):
        grouped_mm(x, w, offs, out=torch.empty(10, 8), out_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_mm_out_unsupported_dtype(dtype: torch.dtype) -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(TypeError, match=rf"out must be {DTYPE_WORDS}; got {dtype}"):
        grouped_mm(x, w, offs, out=torch.empty(10, 8, dtype=dtype))


def test_mm_out_on_other_device() -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(ValueError, match="out is on meta but x is on cpu"):
        grouped_mm(x, w, offs, out=torch.empty(10, 8, device="meta"))


@pytest.mark.parametrize("bad", [torch.int8, "float32"])
def test_mm_out_dtype_argument(bad: object) -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(TypeError, match="out_dtype must be"):
        grouped_mm(x, w, offs, out_dtype=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("config", ["cute", GemmConfig, object()])
def test_bad_config_type_mm(config: object) -> None:
    x, w, offs = _mm_inputs()
    with pytest.raises(TypeError, match=r"config must be a moe_gemm\.GemmConfig or None"):
        grouped_mm(x, w, offs, config=config)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The helpers directly


def test_check_offs_values_accepts_valid() -> None:
    check_offs_values(_i32([0, 0, 3, 3, 10]), 10)
    check_offs_values(_i32([]), 0)
    check_offs_values(_i32([0, 0]), 0)
    check_offs_values(_i32([4, 4]), 10)  # offs[-1] < T: tail rows are allowed


def test_check_offs_values_reports_the_first_decrease() -> None:
    with pytest.raises(ValueError, match=re.escape("got offs[2]=6 > offs[3]=5")):
        check_offs_values(_i32([1, 2, 6, 5, 4]), 10)


def test_resolve_out_dtype() -> None:
    assert resolve_out_dtype(torch.bfloat16, None) == torch.bfloat16
    assert resolve_out_dtype(torch.bfloat16, torch.float32) == torch.float32
    with pytest.raises(TypeError):
        resolve_out_dtype(torch.bfloat16, torch.float64)


def test_offs_check_requested_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_GEMM_CHECK_OFFS", raising=False)
    assert not offs_check_requested()
    monkeypatch.setenv("MOE_GEMM_CHECK_OFFS", "0")
    assert not offs_check_requested()
    monkeypatch.setenv("MOE_GEMM_CHECK_OFFS", "1")
    assert offs_check_requested()


def test_check_grouped_gemm_result_fields() -> None:
    a, b = _gemm_inputs(torch.bfloat16)
    args = check_grouped_gemm(a, b, None, torch.float32)
    assert args.sizes == [(5, 4, 16), (3, 6, 8)]  # (M, N, K)
    assert (args.dtype, args.out_dtype, args.device) == (torch.bfloat16, torch.float32,
                                                          torch.device("cpu"))
    assert args.out is None
    out = [torch.empty(5, 4, dtype=torch.float16), torch.empty(3, 6, dtype=torch.float16)]
    assert check_grouped_gemm(a, b, out, None).out_dtype == torch.float16


def test_check_grouped_mm_result_fields() -> None:
    g = torch.Generator().manual_seed(3)
    x, w, offs = make_moe_inputs(12, 4, 16, 24, torch.float16, w_layout="nk_view", generator=g)
    args = check_grouped_mm(x, w, offs, None, None)
    assert (args.T, args.K, args.E, args.N) == (12, 16, 4, 24)
    assert args.dtype == args.out_dtype == torch.float16
