"""Argument checks of the fused MoE grouped GEMM (ops/fused.py), with messages that name the
expected shape and dtype; the checked arguments as one FusedMmArgs."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from moe_gemm.kernels.sm90.constants import CLAMPED_GATES, GATE_BLOCK, GATE_LAYOUTS, GATES
from moe_gemm.ops.validation import (
    check_offs_values,
    check_out,
    check_varlen_operands,
    offs_check_requested,
    resolve_out_dtype,
    shape_text,
)

GATE_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class FusedMmArgs:
    x: torch.Tensor  # (T, K): the tokens (row_index given) or the routed rows
    w: torch.Tensor  # (E, K, N)
    offs: torch.Tensor  # (E,) int32 over the routed rows
    row_index: torch.Tensor | None  # (S,) int32 / int64
    row_weight: torch.Tensor | None  # (S,) float
    bias: torch.Tensor | None  # (E, N) float
    gate: str | None
    gate_layout: str
    gate_alpha: float
    gate_limit: float
    out: torch.Tensor | None  # (S, N_out)
    dtype: torch.dtype
    out_dtype: torch.dtype

    @property
    def S(self) -> int:
        """Routed rows (out's rows)."""
        return self.x.shape[0] if self.row_index is None else self.row_index.shape[0]

    @property
    def K(self) -> int:
        return self.x.shape[1]

    @property
    def E(self) -> int:
        return self.w.shape[0]

    @property
    def N(self) -> int:
        """w's columns (the accumulator columns)."""
        return self.w.shape[2]

    @property
    def N_out(self) -> int:
        return self.N // 2 if self.gate else self.N


def resolve_gate(gate: object) -> str | None:
    if gate is None:
        return None
    if not isinstance(gate, str):
        raise TypeError(f"gate must be a str or None; got {type(gate).__name__}")
    name = GATE_ALIASES.get(gate, gate)
    if name not in GATES:
        raise ValueError(f"gate must be one of {', '.join(map(repr, GATES))} or None; "
                         f"got {gate!r}")
    return name


def check_gate_names(gate: object, gate_layout: object) -> str | None:
    """The gate's canonical name, after the checks of gate and gate_layout (also asked by the
    traced wrappers, whose op schemas would refuse a non-str with torch's own message)."""
    gate_name = resolve_gate(gate)
    if gate_layout not in GATE_LAYOUTS:
        raise ValueError(f"gate_layout must be one of {GATE_LAYOUTS}; got {gate_layout!r}")
    return gate_name


def gate_float(name: str, value: object) -> float:
    """float(value) of a gate constant; an int past float's range is a ValueError, as every
    other non-finite value (float() raised OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite; got an int past float's range") from None


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float; got {value!r}")
    v = gate_float(name, value)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite; got {value!r}")
    return v


def check_fused_mm(
    x: object, w: object, offs: object, *, row_index: object = None, row_weight: object = None,
    bias: object = None, gate: object = None, gate_layout: object = "concat",
    gate_alpha: object = 1.702, gate_limit: object = 7.0, out: object = None,
    out_dtype: torch.dtype | None = None, concrete: bool = True,
) -> FusedMmArgs:
    """concrete=False (fake tensors): skip the check that reads offs values."""
    check_varlen_operands(x, w, offs, batched_form=False, dense=(
        ("row_index", row_index), ("row_weight", row_weight), ("bias", bias), ("out", out)))
    assert isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)
    assert isinstance(offs, torch.Tensor)
    device = x.device
    T = x.shape[0]
    E, _, N = w.shape
    S = T
    if row_index is not None:
        if not isinstance(row_index, torch.Tensor):
            raise TypeError(f"row_index must be a torch.Tensor (S,) or None; got "
                            f"{type(row_index).__name__}")
        if row_index.dim() != 1:
            raise ValueError(f"row_index must be 1-D (S,); got shape {shape_text(row_index)}")
        if row_index.dtype not in _INDEX_DTYPES:
            raise TypeError(f"row_index must be int32 or int64; got {row_index.dtype}")
        if row_index.device != device:
            raise ValueError(f"row_index is on {row_index.device} but x is on {device}")
        S = row_index.shape[0]
        if S and not T:
            raise ValueError(f"row_index selects {S} rows of x, but x has no rows")
        if concrete and S and (row_index.device.type == "cpu" or offs_check_requested()):
            lo, hi = int(row_index.min()), int(row_index.max())
            if lo < 0 or hi >= T:
                raise ValueError(f"row_index values must be rows of x in [0, {T}); got "
                                 f"[{lo}, {hi}]")
    gate_name = check_gate_names(gate, gate_layout)
    alpha = _check_float("gate_alpha", gate_alpha)
    limit = _check_float("gate_limit", gate_limit)
    if gate_name is not None:
        if N % 2:
            raise ValueError(f"a gated w holds gate and up columns: N must be even; got "
                             f"{shape_text(w)}")
        if gate_layout == "interleaved" and N % (2 * GATE_BLOCK):
            raise ValueError(f"the interleaved gate layout alternates blocks of {GATE_BLOCK} "
                             f"gate and up columns: N must be a multiple of {2 * GATE_BLOCK}; "
                             f"got {shape_text(w)}")
        if gate_name in CLAMPED_GATES and limit <= 0:
            raise ValueError(f"gate_limit must be > 0 for {gate_name}; got {limit}")
    if row_weight is not None:
        if not isinstance(row_weight, torch.Tensor):
            raise TypeError(f"row_weight must be a torch.Tensor (S,) or None; got "
                            f"{type(row_weight).__name__}")
        if tuple(row_weight.shape) != (S,):
            raise ValueError(f"row_weight must be (S,) = ({S},), one weight per routed row; "
                             f"got {shape_text(row_weight)}")
        if not row_weight.dtype.is_floating_point:
            raise TypeError(f"row_weight must be a float tensor; got {row_weight.dtype}")
        if row_weight.device != device:
            raise ValueError(f"row_weight is on {row_weight.device} but x is on {device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor (E, N) or None; got "
                            f"{type(bias).__name__}")
        if tuple(bias.shape) != (E, N):
            raise ValueError(f"bias must be (E, N) = ({E}, {N}), in w's column order; got "
                             f"{shape_text(bias)}")
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias must be a float tensor; got {bias.dtype}")
        if bias.device != device:
            raise ValueError(f"bias is on {bias.device} but x is on {device}")
    if concrete and (offs.device.type == "cpu" or offs_check_requested()):
        try:
            check_offs_values(offs, S)
        except ValueError as exc:  # (offs count the routed rows: S, not x's rows under a gather)
            raise ValueError(str(exc).replace(f"T = {S} (rows of x)",
                                              f"S = {S} (routed rows)")) from None
    n_out = N // 2 if gate_name else N
    odt = check_out(out, (S, n_out), f"(S, {'N / 2' if gate_name else 'N'})",
                    resolve_out_dtype(x.dtype, out_dtype), device,
                    dtype_from_out=out_dtype is None)
    return FusedMmArgs(x, w, offs, row_index, row_weight, bias, gate_name, gate_layout, alpha,
                       limit, out, x.dtype, odt)
