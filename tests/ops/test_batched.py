"""grouped_mm's 3D x 3D (batched) form on the CPU: numerics, every argument check, and the
host-side pieces the sm90 path builds on (grouped_bmm_unsupported, tma_view, choose_batched,
the compile key's name).

Without offs, x (G, M, K) @ w (G, K, N) -> (G, M, N), torch.bmm's semantics with fp32
accumulation. On this machine it runs the torch backend (moe_gemm.ops.reference.grouped_bmm_torch).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings
from collections.abc import Iterator

import pytest
import torch

from moe_gemm import GemmConfig, grouped_mm
from moe_gemm.config import COOPERATIVE_TILES, PINGPONG_TILES
from moe_gemm.ops import api as ops_module
from moe_gemm.ops import heuristics
from moe_gemm.ops.heuristics import choose_batched
from moe_gemm.ops.reference import grouped_bmm_torch
from moe_gemm.ops.signature import PlanCache
from moe_gemm.ops.support import grouped_bmm_unsupported, tma_view
from moe_gemm.ops.validation import GroupedBmmArgs, check_grouped_bmm
from moe_gemm.testing import assert_close_to_ref, poison_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BF16 = torch.bfloat16
TORCH = GemmConfig(backend="torch")
SENTINEL = -12345.0  # exactly representable in bf16, fp16 and fp32
DTYPE_WORDS = r"torch\.bfloat16, torch\.float16 or torch\.float32"
NUM_SMS = 132


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def _inputs(G: int, M: int, N: int, K: int, dtype: torch.dtype, seed: int,
            w_layout: str = "kn") -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random x (G, M, K) and w (G, K, N); w_layout "nk_view" = w_t.transpose(1, 2)."""
    g = _gen(seed)
    x = _randn((G, M, K), dtype, g)
    if w_layout == "kn":
        w = _randn((G, K, N), dtype, g)
    else:
        w = _randn((G, N, K), dtype, g).transpose(1, 2)
    return x, w


def bmm_ref64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Independent float64 reference, one problem at a time (not moe_gemm.reference)."""
    G, M, N = x.shape[0], x.shape[1], w.shape[2]
    y = torch.zeros(G, M, N, dtype=torch.float64)
    for g in range(G):
        y[g] = x[g].double() @ w[g].double()
    return y


def bmm_baseline(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Plain torch in the output's precision: the 2x rule's yardstick."""
    if out_dtype == x.dtype:
        return torch.bmm(x, w)
    return torch.bmm(x.float(), w.float()).to(out_dtype)


def check_bmm(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> None:
    assert tuple(y.shape) == (x.shape[0], x.shape[1], w.shape[2])
    assert y.dtype == out_dtype and y.device == x.device
    ref = bmm_ref64(x, w)
    assert_close_to_ref(y, ref, bmm_baseline(x, w, out_dtype))
    assert_close_to_ref(y, ref, name="y (table)")


# --------------------------------------------------------------------------------------------
# Numerics


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
def test_bmm_basic(dtype: torch.dtype, w_layout: str) -> None:
    x, w = _inputs(5, 37, 24, 40, dtype, seed=100, w_layout=w_layout)
    check_bmm(grouped_mm(x, w), x, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_offs_keyword_none_is_batched(dtype: torch.dtype) -> None:
    x, w = _inputs(3, 9, 8, 16, dtype, seed=101)
    check_bmm(grouped_mm(x, w, None), x, w, dtype)
    check_bmm(grouped_mm(x, w, offs=None), x, w, dtype)


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
     (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)],
)
def test_bmm_out_dtype(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    x, w = _inputs(4, 33, 19, 70, dtype, seed=102)
    check_bmm(grouped_mm(x, w, out_dtype=out_dtype), x, w, out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_bmm_out_written_in_place(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    x, w = _inputs(3, 17, 11, 23, dtype, seed=103, w_layout="nk_view")
    out = poison_(torch.empty(3, 17, 11, dtype=out_dtype))
    ptr = out.data_ptr()
    y = grouped_mm(x, w, out=out)  # out_dtype None: taken from out
    assert y is out, "the returned tensor must be `out`"
    assert out.data_ptr() == ptr
    check_bmm(out, x, w, out_dtype)


def test_bmm_out_and_out_dtype_agreeing() -> None:
    x, w = _inputs(2, 6, 8, 5, torch.float16, seed=104)
    out = torch.empty(2, 6, 8)
    assert grouped_mm(x, w, out=out, out_dtype=torch.float32) is out
    check_bmm(out, x, w, torch.float32)


def test_bmm_out_strided_views_only_their_elements_written() -> None:
    x, w = _inputs(3, 5, 4, 7, torch.float32, seed=105)
    buf = torch.full((3, 5, 9), SENTINEL)
    out = buf[:, :, 1::2]  # (3, 5, 4), stride 2 along N
    grouped_mm(x, w, out=out)
    check_bmm(out, x, w, torch.float32)
    mask = torch.ones_like(buf, dtype=torch.bool)
    mask[:, :, 1::2] = False
    assert (buf[mask] == SENTINEL).all()
    # A transposed out: (G, N, M) storage viewed as (G, M, N).
    out_t = poison_(torch.empty(3, 4, 5)).transpose(1, 2)
    assert grouped_mm(x, w, out=out_t) is out_t
    check_bmm(out_t, x, w, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_strided_inputs(dtype: torch.dtype) -> None:
    g = _gen(106)
    G, M, N, K = 4, 13, 10, 21
    x_step = _randn((G, 2 * M, K + 3), dtype, g)[:, ::2, 2:K + 2]  # rows stepped, offset cols
    x_kstep = _randn((G, M, 2 * K), dtype, g)[:, :, ::2]  # stride 2 along K
    x_col = _randn((G, K, M), dtype, g).transpose(1, 2)  # unit stride along M
    x_batch = _randn((2 * G, M, K), dtype, g)[::2]  # gaps between problems
    w_t = _randn((G, N, K), dtype, g).transpose(1, 2)
    w_gap = _randn((G, K + 5, N + 2), dtype, g)[:, 3:K + 3, 1:N + 1]
    for x in (x_step, x_kstep, x_col, x_batch):
        assert x.shape == (G, M, K)
        for w in (w_t, w_gap):
            assert w.shape == (G, K, N)
            check_bmm(grouped_mm(x, w), x, w, dtype)


def test_bmm_expanded_weight() -> None:
    # One weight shared by every problem via expand (batch stride 0).
    g = _gen(107)
    x = torch.randn(6, 7, 12, generator=g)
    w = torch.randn(12, 9, generator=g).expand(6, 12, 9)
    assert w.stride(0) == 0
    check_bmm(grouped_mm(x, w), x, w, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("G", "M", "N", "K"),
    [(1, 1, 1, 1), (1, 77, 45, 123), (3, 1, 257, 3), (2, 130, 70, 200), (5, 65, 1, 129),
     (2, 1, 31, 1000), (7, 3, 129, 65), (1, 129, 193, 64)],
)
def test_bmm_odd_sizes(dtype: torch.dtype, G: int, M: int, N: int, K: int) -> None:
    # Sizes that are multiples of neither 64 nor 128, M = 1, N = 1, K = 1 and G = 1.
    x, w = _inputs(G, M, N, K, dtype, seed=108, w_layout="nk_view" if K % 2 else "kn")
    check_bmm(grouped_mm(x, w), x, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("G", "M", "N", "K"), [(0, 4, 5, 6), (3, 0, 5, 6), (3, 4, 0, 6),
                                                (0, 0, 0, 0), (2, 0, 0, 3)])
def test_bmm_empty(dtype: torch.dtype, G: int, M: int, N: int, K: int) -> None:
    x, w = _inputs(G, M, N, K, dtype, seed=109)
    for out_dtype in (None, torch.float32):
        y = grouped_mm(x, w, out_dtype=out_dtype)
        assert tuple(y.shape) == (G, M, N) and y.numel() == 0
        assert y.dtype == (out_dtype or dtype)
    out = torch.empty(G, M, N, dtype=dtype)
    assert grouped_mm(x, w, out=out) is out


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_k_zero_gives_zeros(dtype: torch.dtype) -> None:
    x, w = _inputs(3, 4, 5, 0, dtype, seed=110)
    y = grouped_mm(x, w)
    assert torch.equal(y, torch.zeros(3, 4, 5, dtype=dtype))
    out = poison_(torch.empty(3, 4, 5, dtype=torch.float32))
    assert grouped_mm(x, w, out=out) is out
    assert torch.equal(out, torch.zeros(3, 4, 5))  # every poisoned element overwritten


def test_bmm_fp32_accumulation_for_low_precision() -> None:
    # K = 4096 ones times alternating +-1 plus a small tail: an fp16/bf16 accumulator would
    # lose the tail; fp32 accumulation gets it exactly (then one rounding to the output).
    K = 4096
    col = torch.empty(K)
    col[0::2], col[1::2] = 1.0, -1.0
    col[:8] += 2.0**-6  # 8 * 2^-6 = 0.125 survives only with a wide accumulator
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.ones(2, 1, K, dtype=dtype)
        w = col.to(dtype)[None, :, None].expand(2, K, 1).contiguous()
        exact = float(x[0].double() @ w[0].double())
        assert exact == pytest.approx(0.125)
        y32 = grouped_mm(x, w, out_dtype=torch.float32)
        assert y32.flatten().tolist() == pytest.approx([exact, exact], abs=1e-6)
        assert grouped_mm(x, w).float().flatten().tolist() == pytest.approx([exact] * 2,
                                                                           abs=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_matches_torch_bmm_and_offs_form(dtype: torch.dtype) -> None:
    x, w = _inputs(4, 24, 16, 40, dtype, seed=111)
    y = grouped_mm(x, w, out_dtype=torch.float32)
    torch.testing.assert_close(y, torch.bmm(x.float(), w.float()), rtol=1e-5, atol=1e-5)
    # The same problems through the MoE form: rows g*M:(g+1)*M of x against w[g].
    G, M = x.shape[0], x.shape[1]
    offs = torch.arange(1, G + 1, dtype=torch.int32) * M
    y2 = grouped_mm(x.reshape(G * M, -1), w, offs, out_dtype=torch.float32)
    torch.testing.assert_close(y.reshape(G * M, -1), y2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "config",
    [None, GemmConfig(), TORCH, GemmConfig(schedule="pingpong", visitor="host", sort_by_k=True,
                                           tile_m=128, tile_n=128, stages=4),
     GemmConfig(schedule="cooperative", tile_m=COOPERATIVE_TILES[-1][0],
                tile_n=COOPERATIVE_TILES[-1][1])],
)
def test_bmm_configs_agree_on_cpu(config: GemmConfig | None) -> None:
    x, w = _inputs(3, 30, 20, 50, BF16, seed=112)
    assert torch.equal(grouped_mm(x, w, config=config), grouped_mm(x, w, config=TORCH))


def test_bmm_does_not_modify_inputs() -> None:
    x, w = _inputs(3, 8, 6, 10, BF16, seed=113, w_layout="nk_view")
    x0, w0 = x.clone(), w.clone()
    grouped_mm(x, w, out_dtype=torch.float32)
    assert torch.equal(x, x0) and torch.equal(w, w0)


def test_bmm_results_are_fresh_tensors() -> None:
    x, w = _inputs(2, 4, 4, 4, torch.float32, seed=114)
    y = grouped_mm(x, w)
    assert y.data_ptr() not in (x.data_ptr(), w.data_ptr())
    y.fill_(0)
    check_bmm(grouped_mm(x, w), x, w, torch.float32)


def test_reference_grouped_bmm_torch_directly() -> None:
    x, w = _inputs(3, 9, 7, 11, torch.float16, seed=115)
    args = check_grouped_bmm(x, w, None, torch.float32)
    assert isinstance(args, GroupedBmmArgs)
    assert (args.G, args.M, args.N, args.K) == (3, 9, 7, 11)
    assert args.dtype == torch.float16 and args.out_dtype == torch.float32
    check_bmm(grouped_bmm_torch(args), x, w, torch.float32)


# --------------------------------------------------------------------------------------------
# Errors


def _bmm_inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return _inputs(3, 5, 6, 7, dtype, seed=120)


def test_x_2d_without_offs() -> None:
    x, w = _bmm_inputs()
    with pytest.raises(ValueError, match=r"x must be 3-D \(G, M, K\) when offs is None; got shape "
                                         r"\(5, 7\) \(2-D x \(T, K\) is the MoE form: pass offs\)"):
        grouped_mm(x[0], w)


@pytest.mark.parametrize("shape", [(7,), (1, 3, 5, 7), ()])
def test_x_other_rank_without_offs(shape: tuple[int, ...]) -> None:
    _, w = _bmm_inputs()
    with pytest.raises(ValueError, match=r"x must be 3-D \(G, M, K\) when offs is None; got shape"
                                         r" \([0-9, ]*\)$"):
        grouped_mm(torch.randn(shape), w)


def test_x_3d_with_offs() -> None:
    x, w = _bmm_inputs()
    offs = torch.tensor([1, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"x must be 2-D \(T, K\) when offs is given; got shape "
                                         r"\(3, 5, 7\) \(3-D x \(G, M, K\) is the batched form: "
                                         r"pass offs=None\)"):
        grouped_mm(x, w, offs)


def test_x_4d_with_offs_has_no_batched_hint() -> None:
    _, w = _bmm_inputs()
    offs = torch.tensor([1, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"when offs is given; got shape \(1, 3, 5, 7\)$"):
        grouped_mm(torch.randn(1, 3, 5, 7), w, offs)


@pytest.mark.parametrize("shape", [(7, 6), (3, 7, 6, 1), (7,)])
def test_w_wrong_rank(shape: tuple[int, ...]) -> None:
    x, _ = _bmm_inputs()
    with pytest.raises(ValueError, match=r"w must be 3-D \(G, K, N\) \(for a \(G, N, K\) weight "
                                         r"pass w\.transpose\(1, 2\)\); got shape"):
        grouped_mm(x, torch.randn(shape))


def test_g_mismatch() -> None:
    x, w = _bmm_inputs()
    with pytest.raises(ValueError, match=r"x is \(G, M, K\) = \(3, 5, 7\), so w must be "
                                         r"\(3, 7, N\); got \(2, 7, 6\)"):
        grouped_mm(x, w[:2])


def test_k_mismatch() -> None:
    x, _ = _bmm_inputs()
    with pytest.raises(ValueError, match=r"x is \(G, M, K\) = \(3, 5, 7\), so w must be "
                                         r"\(3, 7, N\); got \(3, 6, 7\)"):
        # An (G, N, K) weight passed without the transpose.
        grouped_mm(x, torch.randn(3, 6, 7))


def test_dtype_mismatch() -> None:
    x, w = _bmm_inputs()
    with pytest.raises(TypeError, match=r"w has dtype torch\.bfloat16 but x has torch\.float32; "
                                        r"they must match"):
        grouped_mm(x, w.to(BF16))
    with pytest.raises(TypeError, match=r"w has dtype torch\.float64 but x has torch\.float16"):
        grouped_mm(x.half(), w.double())


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.int8, torch.bool,
                                   torch.complex64])
def test_unsupported_dtype(dtype: torch.dtype) -> None:
    x, w = _bmm_inputs()
    with pytest.raises(TypeError, match=rf"x must be {DTYPE_WORDS}; got {dtype}"):
        grouped_mm(x.to(dtype), w.to(dtype))


@pytest.mark.parametrize(("x_bad", "w_bad"), [(True, False), (False, True)])
@pytest.mark.parametrize("value", [None, [[1.0]], 3, "x"])
def test_non_tensor_operands(x_bad: bool, w_bad: bool, value: object) -> None:
    x, w = _bmm_inputs()
    name, hint = ("x", r"\(G, M, K\)") if x_bad else ("w", r"\(G, K, N\)")
    with pytest.raises(TypeError, match=rf"{name} must be a torch\.Tensor {hint}; got "
                                        rf"{type(value).__name__}"):
        grouped_mm(value if x_bad else x, value if w_bad else w)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(3, 5, 7), (3, 6, 5), (2, 5, 6), (5, 6), (3, 5, 6, 1)])
def test_out_wrong_shape(shape: tuple[int, ...]) -> None:
    x, w = _bmm_inputs()
    with pytest.raises(ValueError, match=r"out must be \(G, M, N\) = \(3, 5, 6\); got "):
        grouped_mm(x, w, out=torch.empty(shape))


def test_out_dtype_disagrees_with_out() -> None:
    x, w = _bmm_inputs(BF16)
    out = torch.empty(3, 5, 6, dtype=BF16)
    with pytest.raises(TypeError, match=r"out must have dtype torch\.float32; got torch\.bfloat16"):
        grouped_mm(x, w, out=out, out_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_out_unsupported_dtype(dtype: torch.dtype) -> None:
    x, w = _bmm_inputs()
    with pytest.raises(TypeError, match=rf"out must be {DTYPE_WORDS}; got {dtype}"):
        grouped_mm(x, w, out=torch.empty(3, 5, 6, dtype=dtype))


@pytest.mark.parametrize("out", [[[0.0]], (torch.empty(3, 5, 6),), 1.5])
def test_out_not_a_tensor(out: object) -> None:
    x, w = _bmm_inputs()
    with pytest.raises(TypeError, match=rf"out must be a torch\.Tensor \(G, M, N\); got "
                                        rf"{type(out).__name__}"):
        grouped_mm(x, w, out=out)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("out_dtype", "pattern"),
    [(torch.float64, rf"out_dtype must be {DTYPE_WORDS}; got torch\.float64"),
     (torch.int32, rf"out_dtype must be {DTYPE_WORDS}; got torch\.int32"),
     ("bfloat16", r"out_dtype must be a torch\.dtype or None; got 'bfloat16'"),
     (float, r"out_dtype must be a torch\.dtype or None; got <class 'float'>")],
)
def test_bad_out_dtype(out_dtype: object, pattern: str) -> None:
    x, w = _bmm_inputs()
    with pytest.raises(TypeError, match=pattern):
        grouped_mm(x, w, out_dtype=out_dtype)  # type: ignore[arg-type]


def test_other_device_operands() -> None:
    # 'meta' stands in for another device: shapes and dtypes, no data.
    x, w = _bmm_inputs()
    with pytest.raises(ValueError, match=r"w is on meta but x is on cpu; they must be on one "
                                         r"device"):
        grouped_mm(x, w.to("meta"))
    with pytest.raises(ValueError, match=r"out is on meta but x is on cpu"):
        grouped_mm(x, w, out=torch.empty(3, 5, 6, device="meta"))


@pytest.mark.parametrize("config", [{}, "torch", GemmConfig().as_dict()])
def test_config_wrong_type(config: object) -> None:
    x, w = _bmm_inputs()
    with pytest.raises(TypeError, match=rf"config must be a moe_gemm\.GemmConfig or None; got "
                                        rf"{type(config).__name__}"):
        grouped_mm(x, w, config=config)  # type: ignore[arg-type]


def test_cute_backend_on_cpu_raises_runtime_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_GEMM_DISABLE_CUTE", raising=False)
    x, w = _bmm_inputs(BF16)
    with pytest.raises(RuntimeError, match=r"backend='cute' cannot run here: tensors are on cpu"):
        grouped_mm(x, w, config=GemmConfig(backend="cute"))


def test_validation_comes_before_backend_choice() -> None:
    x, w = _bmm_inputs(BF16)
    with pytest.raises(ValueError, match=r"so w must be \(3, 7, N\)"):
        grouped_mm(x, w[:, :3], config=GemmConfig(backend="cute"))


def test_auto_backend_on_cpu_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops_module, "_warned", set())
    x, w = _inputs(2, 5, 3, 7, BF16, seed=121)  # K = 7: misaligned for TMA, irrelevant on CPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_bmm(grouped_mm(x, w), x, w, BF16)


# --------------------------------------------------------------------------------------------
# Backend dispatch, with the cute backend faked (the real kernels need an H100)


@pytest.fixture
def fake_hopper(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Capability says yes and a fake host module records the BmmPlans that ops builds."""
    calls: list[object] = []
    fake = types.ModuleType("moe_gemm.ops.mm_launch")

    class BmmPlan:
        def __init__(self, args: object, cfg: object) -> None:
            calls.append((args, cfg))

        def launch(self, *_: object) -> str:
            return "cute-bmm"

    fake.BmmPlan = BmmPlan  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "moe_gemm.ops.mm_launch", fake)
    monkeypatch.setattr(ops_module, "cute_problem", lambda device=None: None)
    monkeypatch.setattr(ops_module, "_warned", set())
    monkeypatch.setattr(ops_module, "_mm_plans", PlanCache())  # the fake plans stay here
    return calls


def test_dispatch_to_cute_when_it_can_run(fake_hopper: list[object]) -> None:
    x, w = _inputs(4, 64, 128, 256, BF16, seed=122, w_layout="nk_view")
    cfg = GemmConfig(schedule="pingpong")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert grouped_mm(x, w, config=cfg) == "cute-bmm"
    (args, got_cfg), = fake_hopper
    assert got_cfg is cfg
    assert isinstance(args, GroupedBmmArgs) and (args.G, args.M, args.N, args.K) == (4, 64, 128,
                                                                                     256)
    # backend="torch" never dispatches.
    check_bmm(grouped_mm(x, w, config=TORCH), x, w, BF16)
    assert len(fake_hopper) == 1


def test_auto_falls_back_with_one_warning(fake_hopper: list[object]) -> None:
    x, w = _inputs(2, 8, 8, 8, torch.float32, seed=123)
    with pytest.warns(RuntimeWarning, match=r"moe_gemm\.grouped_mm: using the torch backend "
                                            r"because the kernels take bf16 or fp16 inputs"):
        y = grouped_mm(x, w)
    check_bmm(y, x, w, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grouped_mm(x, w)  # the same reason warns only once
    assert fake_hopper == []


def test_auto_falls_back_for_misaligned_bmm(fake_hopper: list[object]) -> None:
    x, w = _inputs(2, 8, 16, 7, BF16, seed=124)  # K = 7
    with pytest.warns(RuntimeWarning, match="16 bytes"):
        y = grouped_mm(x, w)
    check_bmm(y, x, w, BF16)
    assert fake_hopper == []


def test_forced_cute_rejects_unsupported_input(fake_hopper: list[object]) -> None:
    x, w = _inputs(2, 8, 16, 7, BF16, seed=125)
    with pytest.raises(ValueError, match=r"backend='cute' cannot take this input: x stride 7 "
                                         r"\(dim 1\) is not a multiple of 8 elements"):
        grouped_mm(x, w, config=GemmConfig(backend="cute"))
    x, w = _inputs(2, 8, 12, 16, BF16, seed=126, w_layout="nk_view")  # N = 12: out rows 24 B
    with pytest.raises(ValueError, match=r"backend='cute' cannot take this input: out rows of "
                                         r"12 torch\.bfloat16 elements"):
        grouped_mm(x, w, config=GemmConfig(backend="cute"))
    assert fake_hopper == []


# --------------------------------------------------------------------------------------------
# grouped_bmm_unsupported


def _unsupported(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> str | None:
    return grouped_bmm_unsupported(check_grouped_bmm(x, w, out, out_dtype), GemmConfig())


@pytest.mark.parametrize("w_layout", ["kn", "nk_view"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.float16])
def test_unsupported_accepts_good_layouts(w_layout: str, out_dtype: torch.dtype | None) -> None:
    x, w = _inputs(4, 64, 256, 128, BF16, seed=130, w_layout=w_layout)
    assert _unsupported(x, w, out_dtype=out_dtype) is None
    odt = out_dtype or BF16
    assert _unsupported(x, w, torch.empty(4, 64, 256, dtype=odt), out_dtype) is None


def test_unsupported_accepts_fp16_and_odd_m() -> None:
    x, w = _inputs(3, 37, 8, 16, torch.float16, seed=131)
    assert _unsupported(x, w) is None


def test_unsupported_accepts_size_one_dims_with_odd_strides() -> None:
    # A (G, 1, K) slice keeps K's row stride on its size-1 dim: never used to address memory.
    base = torch.randn(4, 16, 12).to(BF16)
    x = base[:, 0:1, :]
    assert x.stride() == (192, 12, 1)
    w = torch.randn(4, 12, 16).to(BF16)
    assert _unsupported(x, w) is None


def test_unsupported_fp32_inputs() -> None:
    x, w = _inputs(2, 64, 64, 64, torch.float32, seed=132)
    assert _unsupported(x, w) == "the kernels take bf16 or fp16 inputs, not torch.float32"


def test_unsupported_x_not_k_contiguous() -> None:
    x = torch.randn(2, 64, 64).to(BF16).transpose(1, 2)
    w = torch.randn(2, 64, 64).to(BF16)
    assert _unsupported(x, w) == "x must be row-major (K contiguous) for the kernel"


@pytest.mark.parametrize(
    ("G", "M", "N", "K", "w_layout", "expected"),
    [(2, 8, 16, 7, "kn",
      "x stride 7 (dim 1) is not a multiple of 8 elements (16 bytes), as TMA needs"),
     (2, 8, 12, 16, "kn",
      "w stride 12 (dim 1) is not a multiple of 8 elements (16 bytes), as TMA needs")],
)
def test_unsupported_misaligned_strides(G: int, M: int, N: int, K: int, w_layout: str,
                                        expected: str) -> None:
    x, w = _inputs(G, M, N, K, BF16, seed=133, w_layout=w_layout)
    assert _unsupported(x, w) == expected


def test_unsupported_misaligned_data_pointer() -> None:
    n = 2 * 64 * 64
    x = torch.randn(n + 1).to(BF16)[1:].view(2, 64, 64)
    w = torch.randn(2, 64, 64).to(BF16)
    assert _unsupported(x, w) == "x's data pointer is not 16-byte aligned"


def test_unsupported_out_without_unit_stride_along_n() -> None:
    x, w = _inputs(2, 64, 64, 64, BF16, seed=134)
    out = torch.empty(2, 64, 64, dtype=BF16).transpose(1, 2)
    assert _unsupported(x, w, out) == "out must have unit stride along N"


def test_unsupported_out_rows_not_16_byte_multiples() -> None:
    # w = (G, N, K).transpose(1, 2) with N = 12: w is TMA-able, bf16 rows of 24 bytes are not.
    x, w = _inputs(2, 8, 12, 16, BF16, seed=135, w_layout="nk_view")
    assert _unsupported(x, w) == ("out rows of 12 torch.bfloat16 elements are not a multiple of "
                                  "16 bytes, as the TMA store needs")
    # The same N written as fp32 is 48 bytes a row: fine.
    assert _unsupported(x, w, out_dtype=torch.float32) is None


def test_unsupported_given_out_with_misaligned_row_stride() -> None:
    x, w = _inputs(2, 8, 12, 16, BF16, seed=136, w_layout="nk_view")
    reason = _unsupported(x, w, torch.empty(2, 8, 12, dtype=BF16))
    assert reason == "out stride 12 (dim 1) is not a multiple of 8 elements (16 bytes), as TMA needs"
    # A padded out buffer (row stride 16) is fine.
    padded = torch.empty(2, 8, 16, dtype=BF16)[:, :, :12]
    assert _unsupported(x, w, padded) is None


@pytest.mark.parametrize(("G", "M", "N", "K"), [(0, 64, 12, 7), (4, 0, 12, 7), (4, 3, 0, 7),
                                                (0, 0, 0, 0)])
def test_unsupported_empty_problems(G: int, M: int, N: int, K: int) -> None:
    x, w = _inputs(G, M, N, K, BF16, seed=137)
    assert _unsupported(x, w) is None


def test_unsupported_k_zero_skips_operand_checks() -> None:
    x, w = _inputs(4, 3, 16, 0, BF16, seed=138)
    assert _unsupported(x, w) is None
    x, w = _inputs(4, 3, 12, 0, BF16, seed=139)  # but the output rows still matter
    assert _unsupported(x, w).startswith("out rows of 12 torch.bfloat16")  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------
# tma_view


def test_tma_view_fixes_size_one_dim_stride() -> None:
    base = torch.randn(4, 16, 12).to(BF16)
    t = base[:, 0:1, :]  # (4, 1, 12), strides (192, 12, 1): 12 elements = 24 bytes
    v = tma_view(t, 2)
    assert v is not t
    assert v.shape == t.shape
    assert v.stride(2) == 1
    elem = v.element_size()
    assert all((s * elem) % 16 == 0 for d, s in enumerate(v.stride()) if d != 2), v.stride()
    assert v.stride(0) == t.stride(0)  # only the size-1 dim changes
    assert v.data_ptr() == t.data_ptr()
    assert torch.equal(v, t)


def test_tma_view_fixes_size_one_unit_dim() -> None:
    # The unit dim has size 1 but a stride other than 1: it becomes 1.
    t = torch.randn(128).to(BF16).as_strided((2, 8, 1), (64, 8, 3))
    v = tma_view(t, 2)
    assert v.stride() == (64, 8, 1)
    assert v.data_ptr() == t.data_ptr() and torch.equal(v, t)


def test_tma_view_every_dim_size_one() -> None:
    t = torch.randn(5).to(BF16)[2:3].view(1, 1, 1).as_strided((1, 1, 1), (3, 5, 7))
    v = tma_view(t, 2)
    assert v.stride(2) == 1
    assert all(s % 8 == 0 for s in v.stride()[:2]), v.stride()
    assert v.data_ptr() == t.data_ptr() and torch.equal(v, t)


def test_tma_view_col_major_weight() -> None:
    # A (1, K, N) weight with K contiguous (unit dim 1) and an odd batch stride.
    w = torch.randn(1, 16, 24).to(BF16).transpose(1, 2)  # (1, 24, 16), strides (384, 1, 24)
    w = w.as_strided(w.shape, (5, 1, 24))
    v = tma_view(w, 1)
    assert v.stride(1) == 1 and v.stride(2) == 24 and v.stride(0) % 8 == 0 and v.stride(0) > 0
    assert v.data_ptr() == w.data_ptr() and torch.equal(v, w)


@pytest.mark.parametrize(
    "make",
    [lambda: torch.randn(4, 16, 32).to(BF16),
     lambda: torch.randn(4, 32, 16).to(BF16).transpose(1, 2),
     lambda: torch.randn(4, 16, 32).to(BF16)[:, 0:1, :],  # size-1 stride 32: aligned already
     lambda: torch.randn(4, 3, 5).to(BF16),  # misaligned, but no size-1 dim: not tma_view's job
     lambda: torch.empty(0, 3, 8, dtype=BF16)],
)
def test_tma_view_returns_same_object_when_nothing_to_fix(make: object) -> None:
    t = make()  # type: ignore[operator]
    unit = 2 if t.stride(-1) == 1 else 1
    assert tma_view(t, unit) is t


def test_tma_view_fp32_alignment_is_four_elements() -> None:
    base = torch.randn(3, 4, 6)
    t = base[:, 1:2, :]  # stride 6 floats = 24 bytes on the size-1 dim
    v = tma_view(t, 2)
    assert v.stride(1) % 4 == 0 and v.stride(0) == 24
    assert torch.equal(v, t)
    assert tma_view(torch.randn(3, 1, 8), 2).stride() == (8, 8, 1)


# --------------------------------------------------------------------------------------------
# choose_batched


@pytest.fixture
def no_l2_hints(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("MOE_GEMM_L2_HINTS", raising=False)
    heuristics._choose_batched.cache_clear()
    yield
    heuristics._choose_batched.cache_clear()


@pytest.mark.parametrize("M,want", [
    (4096, ("cooperative", 128, 256, 3, False)),
    # fewer tiles than half the grid (grid_fit.fill_grid): 128x128 tiles, split over K
    # by the kernel where they leave half the grid idle
    (512, ("cooperative", 128, 128, None, True)),
    # rows of at most 64: ping-pong's 64-row tile, narrowed (64 tiles of 128x64 would be
    # split in two only, which loses to it)
    (64, ("pingpong", 64, 128, None, False)),
    (1, ("pingpong", 64, 128, None, False)),
])
def test_choose_batched_long_k_wide_n(no_l2_hints: None, M: int, want: tuple,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
    c = choose_batched(GemmConfig(), 8, M, 512, 7168, NUM_SMS)
    assert (c.schedule, c.tile_m, c.tile_n, c.stages, c.tail_split) == want
    assert c.visitor == "device" and c.sort_by_k is False
    assert c.l2_hints is False and c.a_policy == 0 and c.b_policy == 0


def test_choose_batched_short_k(no_l2_hints: None) -> None:
    c = choose_batched(GemmConfig(), 8, 512, 768, 128, NUM_SMS)
    assert (c.schedule, c.tile_m, c.tile_n, c.stages) == ("pingpong", 128, 192, None)
    # Few rows per problem: ping-pong's 64-row tile.
    c = choose_batched(GemmConfig(), 8, 32, 768, 128, NUM_SMS)
    assert (c.schedule, c.tile_m, c.tile_n) == ("pingpong", 64, 256)


def test_choose_batched_narrow_n(no_l2_hints: None) -> None:
    c = choose_batched(GemmConfig(), 32, 512, 128, 7168, NUM_SMS)
    assert (c.schedule, c.tile_m, c.tile_n, c.stages) == ("cooperative", 128, 128, None)
    # Short K but N < 192 stays cooperative.
    c = choose_batched(GemmConfig(), 8, 512, 128, 128, NUM_SMS)
    assert (c.schedule, c.tile_m, c.tile_n) == ("cooperative", 128, 128)


def test_choose_batched_stage_rule_boundary(no_l2_hints: None) -> None:
    # 3 stages from 64 k-tiles (K = 4096) up; fewer leaves the default (a grid's worth of
    # tiles: fewer would be narrowed, see test_heuristics).
    assert choose_batched(GemmConfig(), 64, 256, 512, 4096, NUM_SMS).stages == 3
    assert choose_batched(GemmConfig(), 64, 256, 512, 4032, NUM_SMS).stages is None


@pytest.mark.parametrize(
    ("config", "expected"),
    [(GemmConfig(schedule="pingpong"), ("pingpong", 128, 192, None)),
     (GemmConfig(schedule="cooperative", tile_m=128, tile_n=64), ("cooperative", 128, 64, None)),
     (GemmConfig(tile_m=128, tile_n=192), ("cooperative", 128, 192, None)),
     (GemmConfig(stages=5), ("cooperative", 128, 256, 5)),
     (GemmConfig(schedule="pingpong", tile_m=64, tile_n=128, stages=2),
      ("pingpong", 64, 128, 2))],
)
def test_choose_batched_config_overrides(no_l2_hints: None, config: GemmConfig,
                                         expected: tuple) -> None:
    c = choose_batched(config, 64, 512, 512, 7168, NUM_SMS)
    assert (c.schedule, c.tile_m, c.tile_n, c.stages) == expected


@pytest.mark.parametrize("visitor", ["auto", "device", "host"])
@pytest.mark.parametrize("sort_by_k", [None, True, False])
def test_choose_batched_visitor_and_sort_fixed(no_l2_hints: None, visitor: str,
                                               sort_by_k: bool | None) -> None:
    cfg = GemmConfig(visitor=visitor, sort_by_k=sort_by_k)  # type: ignore[arg-type]
    for K in (64, 7168):
        c = choose_batched(cfg, 8, 256, 512, K, NUM_SMS)
        assert c.visitor == "device" and c.sort_by_k is False


def test_choose_batched_tile_picks_the_schedule_that_builds_it(no_l2_hints: None) -> None:
    # 64x256 is a ping-pong tile; long K alone would pick cooperative. With schedule="auto"
    # the given tile decides; with the schedule named, the mismatch is an error.
    assert (64, 256) in PINGPONG_TILES and (64, 256) not in COOPERATIVE_TILES
    c = choose_batched(GemmConfig(tile_m=64, tile_n=256), 8, 512, 512, 7168, NUM_SMS)
    assert (c.schedule, c.tile_m, c.tile_n) == ("pingpong", 64, 256)
    with pytest.raises(ValueError, match=r"tile 64x256 is not built for schedule 'cooperative'"):
        choose_batched(GemmConfig(schedule="cooperative", tile_m=64, tile_n=256), 8, 512, 512,
                       7168, NUM_SMS)


def test_choose_batched_l2_hints_from_env(no_l2_hints: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_GEMM_L2_HINTS", "first,last")
    c = choose_batched(GemmConfig(), 8, 512, 512, 7168, NUM_SMS)
    assert c.l2_hints is True
    assert (c.a_policy, c.b_policy) == (0x12F0000000000000, 0x14F0000000000000)


def test_choose_batched_sees_l2_hints_changed_after_first_call(
    no_l2_hints: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert choose_batched(GemmConfig(), 8, 512, 512, 7168, NUM_SMS).l2_hints is False
    monkeypatch.setenv("MOE_GEMM_L2_HINTS", "first,last")
    assert choose_batched(GemmConfig(), 8, 512, 512, 7168, NUM_SMS).l2_hints is True


# --------------------------------------------------------------------------------------------
# CompileKey names


@pytest.fixture(scope="module")
def compile_key_cls() -> type:
    pytest.importorskip("cutlass")
    from moe_gemm.kernels.sm90.compile import CompileKey

    return CompileKey


def test_compile_key_batched_name(compile_key_cls: type) -> None:
    key = compile_key_cls("batched", "bfloat16", "float32", "k", "cooperative", "device", 128,
                          256, 3)
    name = key.name()
    assert "batched" in name.split("_")
    assert name == "batched_bfloat16_float32_k_cooperative_device_128_256_s3"
    assert key.epi_n == 32 and "epi" not in name


def test_compile_key_epi_n_in_name(compile_key_cls: type) -> None:
    key = compile_key_cls("batched", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                          256)
    wide = dataclasses.replace(key, epi_n=64)
    assert "epi64" in wide.name().split("_") and "epi" not in key.name()
    assert wide.name() == key.name() + "_epi64"
    assert wide != key
    # Every flag in its place: stages, trace, l2 hints, then the epilogue width.
    full = dataclasses.replace(key, stages=4, trace=True, l2_hints=True, epi_n=16)
    assert full.name().endswith("_s4_trace_l2hints_epi16")
    # The forms never share a name.
    names = {dataclasses.replace(key, form=f).name() for f in ("general", "varlen", "batched")}
    assert len(names) == 3
