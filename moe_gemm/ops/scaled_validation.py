"""Argument checks for the FP8 ops (scaled_grouped_mm, scaled_grouped_gemm), with messages that
name what was expected, and the scale layouts both backends share.

Scales follow torch's scaled matmuls (torch._scaled_mm, torch._scaled_grouped_mm): fp32
"decoding" factors, so that the dequantized operand is fp8_value * scale, with the operand's
own orientation (w is (E, K, N), so its block scales are (E, K/128, ceil(N/128))). Three
granularities, told apart by the scale shapes alone:

    granularity  scale_a (x (T, K) / (G, M, K))   scale_b (w (E|G, K, N))
    "block"      (T, K/128) / (G, M, K/128)       (E, K/128, ceil(N/128))  1x128 and 128x128
    "row"        (T,) / (G, M)                    (E, N)                   per token, channel
    "tensor"     () or (1,)                       (), (1,) or (E,)         per tensor (expert)

Row-wise and per-tensor scales mix ("row" then): per-token scale_a with per-tensor (or per
expert) scale_b, as dynamically quantized activations against per-tensor weights are.
grouped_gemm's lists take the same per problem without the expert dimension, and row-wise and
per-tensor problems mix there too: a_i (M_i, K_i) with (M_i, K_i/128) / (M_i,) / ();
b_i (K_i, N_i) with (K_i/128, ceil(N_i/128)) / (N_i,) / (). Block scales need K a multiple of
128 (DeepSeek-V3's recipe; the blocks tile K exactly).

Like validation.py, nothing here reads a CUDA tensor's values (offs on the CPU excepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_gemm.ops.aliasing import outputs_aliasing_inputs
from moe_gemm.ops.validation import (
    _as_tensor_list,
    _check_writable_out,
    check_batched_operands,
    check_dense,
    check_offs_values,
    check_out,
    check_varlen_operands,
    offs_check_requested,
    shape_text,
)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_BLOCK = 128
GRANULARITIES = ("block", "row", "tensor")
_FP8_NAMES = "torch.float8_e4m3fn or torch.float8_e5m2"
_OUT_NAMES = "torch.bfloat16, torch.float16 or torch.float32"


@dataclass(frozen=True)
class ScaledMmArgs:
    """Checked scaled_grouped_mm arguments. offs None: the batched form (x (G, M, K))."""

    x: torch.Tensor
    w: torch.Tensor  # (E|G, K, N)
    scale_a: torch.Tensor
    scale_b: torch.Tensor
    offs: torch.Tensor | None
    out: torch.Tensor | None
    granularity: str  # "block" | "row" | "tensor"
    dtype: torch.dtype
    out_dtype: torch.dtype

    @property
    def batched(self) -> bool:
        return self.offs is None

    @property
    def E(self) -> int:  # experts (varlen) or problems (batched)
        return self.w.shape[0]

    @property
    def K(self) -> int:
        return self.x.shape[-1]

    @property
    def N(self) -> int:
        return self.w.shape[2]

    @property
    def rows(self) -> int:  # T (varlen) or M (batched)
        return self.x.shape[-2]


@dataclass(frozen=True)
class ScaledGemmArgs:
    a: list[torch.Tensor]  # each (M_i, K_i)
    b: list[torch.Tensor]  # each (K_i, N_i)
    scale_a: list[torch.Tensor]
    scale_b: list[torch.Tensor]
    out: list[torch.Tensor] | None
    granularity: str
    dtype: torch.dtype
    out_dtype: torch.dtype
    device: torch.device
    sizes: list[tuple[int, int, int]]  # (M_i, N_i, K_i)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def resolve_fp8_out_dtype(out_dtype: object, out: object) -> torch.dtype:
    """The output dtype: out_dtype, else out's dtype, else bf16 (torch's scaled mm default)."""
    name = "out_dtype"
    if out_dtype is None:
        if not isinstance(out, torch.Tensor):
            return torch.bfloat16
        name, out_dtype = "out's dtype", out.dtype
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None; got {out_dtype!r}")
    if out_dtype not in FP8_OUT_DTYPES:
        raise TypeError(f"{name} must be {_OUT_NAMES}; got {out_dtype}")
    return out_dtype


def _check_fp8(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FP8_DTYPES:
        fnuz = t.dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
        hint = (" (the fnuz encodings, AMD's, are not taken: convert to the OCP formats)"
                if fnuz else " (quantize it first, e.g. moe_gemm.quantize_fp8_per_token_group)"
                if t.is_floating_point() else "")
        raise TypeError(f"{name} must be {_FP8_NAMES}; got {t.dtype}{hint}")


def _is_single(s: torch.Tensor) -> bool:
    return s.dim() <= 1 and s.numel() == 1


def granularity_of(sa: torch.Tensor, sb: torch.Tensor, lead: tuple[int, ...], rows: int, K: int,
                   N: int, a_lead: tuple[int, ...] = ()) -> str:
    """The granularity the scale shapes name (module docstring), or ValueError listing the
    expected shapes. lead: w's leading dims ((E,), (G,) or ()); a_lead: x's ((G,) batched)."""
    sa_shape, sb_shape = tuple(sa.shape), tuple(sb.shape)
    kb = K // SCALE_BLOCK
    if sb.dim() == len(lead) + 2:
        if K % SCALE_BLOCK:
            raise ValueError(f"block scales (scale_b of shape {shape_text(sb)}) need K to be a "
                             f"multiple of {SCALE_BLOCK}; got K={K}")
        want_a, want_b = (*a_lead, rows, kb), (*lead, kb, _ceil(N, SCALE_BLOCK))
        if sa_shape == want_a and sb_shape == want_b:
            return "block"
    else:
        a_rows = sa_shape == (*a_lead, rows)
        b_cols = sb.dim() == len(lead) + 1 and sb_shape == (*lead, N)
        b_one = _is_single(sb) or bool(lead and sb_shape == lead)
        if (a_rows or _is_single(sa)) and (b_cols or b_one):
            return "tensor" if _is_single(sa) and b_one else "row"
    a_rows = _dims((*a_lead, rows))
    raise ValueError(
        "scale shapes match no granularity: expected block scales scale_a "
        f"{_dims((*a_lead, rows, 'K/128'))} and scale_b {_dims((*lead, 'K/128', 'ceil(N/128)'))}"
        f" (K={K}, N={N}), row-wise scale_a {a_rows} and scale_b {_dims((*lead, N))}, or "
        f"per-tensor scale_a () and scale_b ()"
        + (f" or {_dims(lead)}" if lead else "")
        + f"; got scale_a {shape_text(sa)} and scale_b {shape_text(sb)}")


def _dims(dims: tuple) -> str:
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


def _check_scale(name: str, s: object, device: torch.device) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of float32 scales; got "
                        f"{type(s).__name__}")
    check_dense(name, s)
    if s.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (decoding scales: value = fp8 * scale); got "
                        f"{s.dtype}")
    if s.device != device:
        raise ValueError(f"{name} is on {s.device} but the operands are on {device}")
    return s


def check_scaled_grouped_mm(x: object, w: object, scale_a: object, scale_b: object,
                            offs: object, out: object, out_dtype: object, *,
                            concrete: bool = True) -> ScaledMmArgs:
    """concrete=False (fake tensors): skip the check that reads offs values."""
    batched = offs is None
    if batched:
        check_batched_operands(x, w, dense=(("out", out),), check_x_dtype=_check_fp8)
    else:
        check_varlen_operands(x, w, offs, dense=(("out", out),), check_x_dtype=_check_fp8,
                              offs_hint="(E,) or None")
    assert isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)
    K, N = x.shape[-1], w.shape[2]
    rows, a_lead = (x.shape[1], (x.shape[0],)) if batched else (x.shape[0], ())
    sa = _check_scale("scale_a", scale_a, x.device)
    sb = _check_scale("scale_b", scale_b, x.device)
    granularity = granularity_of(sa, sb, (w.shape[0],), rows, K, N, a_lead)
    if not batched and concrete and (offs.device.type == "cpu" or offs_check_requested()):
        check_offs_values(offs, rows)
    odt = check_out(out, (*x.shape[:-1], N), "(G, M, N)" if batched else "(T, N)",
                    resolve_fp8_out_dtype(out_dtype, out), x.device)
    return ScaledMmArgs(x, w, sa, sb, offs, out, granularity, x.dtype, odt)


def check_scaled_grouped_gemm(a: object, b: object, scale_a: object, scale_b: object,
                              out: object, out_dtype: object, *, concrete: bool = True
                              ) -> ScaledGemmArgs:
    """concrete=False (fake tensors: no memory, and a CUDA one raises when its address is
    read): skip the check that compares the outputs' memory."""
    a_list = _as_tensor_list("a", a, "(M_i, K_i)")
    b_list = _as_tensor_list("b", b, "(K_i, N_i)")
    sa_list = _as_tensor_list("scale_a", scale_a, "of float32 scales", "tensors")
    sb_list = _as_tensor_list("scale_b", scale_b, "of float32 scales", "tensors")
    G = len(a_list)
    if not len(b_list) == len(sa_list) == len(sb_list) == G:
        raise ValueError(f"expected one b, scale_a and scale_b per a: got len(a)={G}, "
                         f"len(b)={len(b_list)}, len(scale_a)={len(sa_list)}, "
                         f"len(scale_b)={len(sb_list)}")
    odt = resolve_fp8_out_dtype(out_dtype, out[0] if isinstance(out, (list, tuple)) and out
                                else None)
    if not G:
        # (as grouped_gemm: an out list that does not fit is an error also for no problems)
        if out is not None and (n_out := len(_as_tensor_list("out", out, "(M_i, N_i)"))):
            raise ValueError(f"expected one out per problem: got len(out)={n_out} for 0 "
                             "problems")
        return ScaledGemmArgs([], [], [], [], [] if out is not None else None, "tensor",
                              torch.float8_e4m3fn, odt, torch.device("cpu"), [])
    dtype, device = a_list[0].dtype, a_list[0].device
    for i, (ai, bi) in enumerate(zip(a_list, b_list)):
        check_dense(f"a[{i}]", ai)
        check_dense(f"b[{i}]", bi)
    _check_fp8("a[0]", a_list[0])
    sizes = []
    granularity = None
    for i, (ai, bi, sai, sbi) in enumerate(zip(a_list, b_list, sa_list, sb_list)):
        if ai.dim() != 2 or bi.dim() != 2:
            bad, t = (f"a[{i}]", ai) if ai.dim() != 2 else (f"b[{i}]", bi)
            raise ValueError(f"{bad} must be 2-D; got shape {shape_text(t)}")
        for name, t in ((f"a[{i}]", ai), (f"b[{i}]", bi)):
            if t.dtype != dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but a[0] has {dtype}; every "
                                "operand must share one FP8 dtype")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but a[0] is on {device}")
        if ai.shape[1] != bi.shape[0]:
            raise ValueError(f"problem {i}: a[{i}] is (M, K) = {shape_text(ai)}, so b[{i}] must be "
                             f"(K, N) = ({ai.shape[1]}, N); got {shape_text(bi)}")
        M, K = ai.shape
        N = bi.shape[1]
        sai = _check_scale(f"scale_a[{i}]", sai, device)
        sbi = _check_scale(f"scale_b[{i}]", sbi, device)
        try:
            g = granularity_of(sai, sbi, (), M, K, N)
        except ValueError as exc:
            raise ValueError(f"problem {i}: {exc}") from None
        if granularity is None:
            granularity = g
        elif {g, granularity} == {"row", "tensor"}:
            # Per-tensor scales are row-wise ones with a single value (the kernel runs both
            # as one mode): they mix. A 1 x 1 problem's row-wise scales read as per-tensor.
            granularity = "row"
        elif g != granularity:
            raise ValueError(f"problem {i} has {g} scales but an earlier problem has "
                             f"{granularity}; every problem must use one granularity (block, "
                             "or row-wise / per-tensor)")
        sizes.append((M, N, K))
    out_list = None
    if out is not None:
        out_list = _as_tensor_list("out", out, "(M_i, N_i)")
        if len(out_list) != G:
            raise ValueError(f"expected one out per problem: got len(out)={len(out_list)} for "
                             f"{G} problems")
        for i, (oi, (m, n, _)) in enumerate(zip(out_list, sizes)):
            check_dense(f"out[{i}]", oi)
            if tuple(oi.shape) != (m, n):
                raise ValueError(f"out[{i}] must be (M_i, N_i) = ({m}, {n}); got {shape_text(oi)}")
            if oi.dtype != odt:
                raise TypeError(f"out[{i}] must have dtype {odt}; got {oi.dtype}")
            if oi.device != device:
                raise ValueError(f"out[{i}] is on {oi.device} but the operands are on {device}")
            _check_writable_out(f"out[{i}]", oi)
        if concrete and not torch.compiler.is_compiling():  # (traced: no memory to compare)
            # Outputs overlapping each other: ValueError naming them. (One overlapping an
            # operand is computed into a temporary by the op, as in grouped_gemm.)
            outputs_aliasing_inputs(out_list, [])
    return ScaledGemmArgs(a_list, b_list, sa_list, sb_list, out_list, granularity, dtype, odt,
                          device, sizes)


# ---------------------------------------------------------------------------------------------
# Scale views both backends read: A scales as (..., rows, KB) and B scales as (..., KB, C), with
# KB = K / 128 and C = ceil(N / 128) for block scales, KB = 1 and C = N otherwise (views; a
# single value is expanded with stride 0).


def a_scale_view(sa: torch.Tensor, granularity: str, lead: tuple[int, ...], rows: int
                 ) -> torch.Tensor:
    if granularity == "block":
        return sa
    if _is_single(sa):
        return sa.reshape(()).expand(*lead, rows, 1)
    return sa.unsqueeze(-1)


def b_scale_view(sb: torch.Tensor, granularity: str, lead: tuple[int, ...], N: int
                 ) -> torch.Tensor:
    if granularity == "block":
        return sb
    if sb.dim() == len(lead) + 1 and tuple(sb.shape) == (*lead, N):
        return sb.unsqueeze(-2)
    if _is_single(sb):
        return sb.reshape(()).expand(*lead, 1, N)
    return sb.reshape(*lead, 1, 1).expand(*lead, 1, N)
