"""The MoE layers' token gather: the routed rows, each a copy of its token's row of x.

    gather_rows(x, rows)   out[r] = x[rows[r]]     (S, H), S = len(rows)

The result is always a new contiguous (S, H) tensor (never a view of x). On an sm90a GPU with
the CuTe DSL it is one kernel (kernels/sm90/token_gather.py: out written once, x read through
L2); with MOE_GEMM_TOKEN_GATHER=torch, while torch.compile traces, under a torch.func
transform or a TorchDispatchMode (FakeTensorMode, make_fx, FlopCounterMode), for a tensor
subclass, for an x that autograd differentiates through (it requires grad with grad enabled,
or is a forward-mode dual tensor), and for layouts and sizes the kernel does not take
(ops/row_kernels.py: rows of 16-byte vectors, at most 33,553,920 values wide, under 2^31 rows)
it is index_select. FP8 rows take the kernel as pairs of values in 16-bit words (their bits
copied, never computed on), and index_select on bytes elsewhere. On an H200 the kernel took 0.196 ms where index_select took 0.256 ms
(Qwen3-30B-A3B at 16384 tokens: 131072 routed rows of 2048), 1.22-1.37x faster at 16384 tokens
on four models' shapes (docs/measurements.md, 2026-12-04).
"""

from __future__ import annotations

import functools

import torch

from moe_gemm.ops.row_kernels import (
    INDEX_DTYPES,
    KERNEL_DTYPES,
    MAX_ROWS,
    autograd_tracked,
    check_row_operands,
    plain_tensor,
    row_kernel_allowed,
    vector_rows_ok,
)

TOKEN_GATHER_ENV = "MOE_GEMM_TOKEN_GATHER"  # "torch": index_select even where the kernel runs


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(S, H) in x's dtype: out[r] = x[rows[r]].

    x: (T, H) dense floating (fp8 included); rows: (S,) dense int64 or int32 (any strides,
    expanded too), values in [0, T), on x's device (TypeError or ValueError naming what is
    expected otherwise). The result is a new contiguous tensor; autograd tracks it where x
    requires grad with grad enabled, and forward-mode AD where x is a dual tensor. A row index
    outside [0, T) is refused on the CPU (index_select's IndexError; a RuntimeError from the
    compiled code under torch.compile); on a GPU it is not checked (that is a host sync per
    call) but clamped into range, by the kernel and the index_select path alike: a wrong row,
    never an out-of-bounds read or a device assert that ends the process's CUDA context."""
    _check(x, rows)
    if autograd_tracked(x):
        return _index_select(x, rows)  # (the kernel has no derivative)
    return gather_untracked(x, rows)


def gather_untracked(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """gather_rows for checked arguments whose result autograd does not track (the fused
    kernels' plans, below their own backward)."""
    # 1-byte values, FP8's, move as pairs in 16-bit words: copied, never computed on. (Not
    # while torch.compile traces: the kernel is off then, and storage_offset breaks its graph.)
    src = x
    if x.element_size() == 1 and not torch.compiler.is_compiling():
        src = _as_words(x)
    if src is not None and _kernel_ok(src, rows):
        out = _gather_kernel(src, rows)
        return out if src is x else out.view(x.dtype)
    return _index_select(x, rows)


def _index_select(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """torch's gather (rows clamped as the kernel clamps them). 1-byte values move as bytes:
    torch has no derivative for FP8 rows (index_select's backward under torch.func raised
    "scatter_gather not implemented for Float8_e4m3fn"), and they are only moved here."""
    rows = _clamped(x, rows)
    if x.element_size() == 1 and x.is_floating_point():
        return x.view(torch.uint8).index_select(0, rows).view(x.dtype)
    return x.index_select(0, rows)


def _as_words(x: torch.Tensor) -> torch.Tensor | None:
    """x's 1-byte values seen as 16-bit words (bf16, two values each), or None where its
    rows cannot be (an odd width, row stride or offset)."""
    if x.shape[1] % 2 or x.stride(1) != 1 or x.stride(0) % 2 or x.storage_offset() % 2:
        return None
    return x.view(torch.bfloat16)


def _clamped(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """rows clamped into [0, T) on a GPU, as the kernel clamps them (T > 0 wherever rows has
    values, see _check); as given on the CPU, where index_select names a bad one."""
    if x.device.type != "cpu" and rows.numel():
        last = x.shape[0] - 1
        if last > torch.iinfo(rows.dtype).max:  # (int32 rows of an x of 2^31 rows or more:
            return rows.clamp(min=0)  # every value is at most T - 1, which int32 cannot hold)
        return rows.clamp(0, last)
    return rows


def _check(x: torch.Tensor, rows: torch.Tensor) -> None:
    """The dtypes, shapes and devices gather_rows takes, from metadata only (no host sync)."""
    if not (isinstance(x, torch.Tensor) and isinstance(rows, torch.Tensor)):
        raise TypeError(f"gather_rows: x and rows must be torch.Tensors; got "
                        f"{type(x).__name__}, {type(rows).__name__}")
    check_row_operands("gather_rows", "x", x, "(T, H)", rows, "(S,)", 1)
    if x.shape[0] == 0 and rows.numel():
        raise ValueError(f"gather_rows: x has no rows for the {rows.numel()} indices of rows "
                         f"(each must be in [0, T), T = 0)")


def _kernel_ok(x: torch.Tensor, rows: torch.Tensor) -> bool:
    return row_kernel_allowed(x, TOKEN_GATHER_ENV) and _layout_ok(x, rows)


def _layout_ok(x: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors, dtype, shape, strides and alignment: plain
    tensors, 16-byte vectors (H contiguous, rows 16-byte aligned), something to copy, and
    sizes within the kernel's Int32 indices and launch grid (ops/row_kernels.py)."""
    return (x.dtype in KERNEL_DTYPES and x.shape[1] > 0 and 0 < rows.shape[0] <= MAX_ROWS
            and plain_tensor(rows) and vector_rows_ok(x))


@functools.lru_cache(maxsize=8)
def _kernel(dtype: torch.dtype, index_dtype: torch.dtype):
    from moe_gemm.kernels.sm90.token_gather import GatherCompileKey, compile_gather
    from moe_gemm.ops import kernel_cache as cache

    key = GatherCompileKey(KERNEL_DTYPES[dtype], INDEX_DTYPES[index_dtype])
    return cache.get_or_compile(key, key.name, lambda: compile_gather(key))


def _gather_kernel(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    _kernel(x.dtype, rows.dtype)(x, rows, out)
    return out
