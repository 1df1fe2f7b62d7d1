"""The MoE layers' top-k combine: each token's output is the sum of its k routed rows.

    combine_rows(y, rows, weights=None)   out[t] = sum_j weights[t, j] * y[rows[t, j]]

y (S, H) holds the routed rows (expert order), rows (T, k) the row of each of a token's slots.
The k rows are summed in slot order in fp32 and rounded once to y's dtype, as
`F.embedding_bag(rows, y, per_sample_weights=weights, mode="sum")` does, which it replaces.

On an sm90a GPU with the CuTe DSL it is one kernel (kernels/sm90/combine.py: y read once, out
written once); with MOE_GEMM_COMBINE=torch, while torch.compile traces, for shapes the kernel
does not take, and where autograd tracks y or the weights (the kernel has no derivative), it
is embedding_bag. On an H200 (2026-11-29) the kernel took 0.16 ms where embedding_bag took
0.76 ms (Qwen3-30B-A3B at 16384 tokens: 131072 rows of 2048, k=8; the copy
floor 0.15 ms): the fused Qwen3 layer 3.23 -> 2.54 ms at that size, in one process
(docs/measurements.md, 2026-11-29).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from moe_gemm.kernels.sm90.constants import COMBINE_MAX_K
from moe_gemm.ops import launch_resources
from moe_gemm.ops.row_kernels import (
    INDEX_DTYPES,
    KERNEL_DTYPES,
    autograd_tracked,
    check_row_operands,
    forward_dual,
    row_kernel_allowed,
    vector_rows_ok,
)
from moe_gemm.ops.validation import shape_text

COMBINE_ENV = "MOE_GEMM_COMBINE"  # "torch": embedding_bag even where the kernel runs


def combine_rows(y: torch.Tensor, rows: torch.Tensor,
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """(T, H) in y's dtype: out[t] = sum_j weights[t, j] * y[rows[t, j]] (weights 1 when None).

    y: (S, H) floating; rows: (T, k) int64 or int32, values in [0, S) (the caller's own
    permutation); weights: (T, k) floating (y's dtype or float32 for the kernel); all on y's
    device (TypeError or ValueError naming what is expected otherwise). A row index outside
    [0, S) is refused on the CPU (IndexError naming the range; embedding_bag's RuntimeError
    while torch.compile traces or under torch.func transforms; fake tensors have no values to
    check); on a GPU it is not checked (that is a host sync per call) but clamped into range,
    by the kernel and the embedding_bag path alike: a wrong row, never an out-of-bounds read
    or a device assert that ends the process's CUDA context."""
    _check(y, rows, weights)
    if rows.shape[1] == 0:
        # No slots: every token's sum is empty (embedding_bag cannot make bags of no rows
        # from a 2-D input).
        return y.new_zeros(rows.shape[0], y.shape[-1])
    if _kernel_ok(y, rows, weights):
        return _combine_kernel(y, rows, weights)
    if y.device.type != "cpu":
        rows = rows.clamp(0, y.shape[0] - 1)  # (as the kernel does; S > 0, see _check)
    elif not (torch.compiler.is_compiling() or _functorch_wrapped(rows) or is_fake(rows)):
        _check_cpu_rows(rows, y.shape[0])
    if forward_dual(y) or forward_dual(weights):  # (embedding_bag has no forward derivative)
        return _gathered_sum(y, rows, weights)
    if y.dtype in (torch.bfloat16, torch.float16) and (
            y.device.type == "cpu" or (weights is not None and weights.dtype == torch.float32)):
        # The sum in fp32, rounded once, as the kernel: the CPU's 16-bit embedding_bag rounds
        # along the way (bf16: 1 ulp off in ~4% of the elements of 8-slot sums), and fp32
        # weights rounded to y's dtype first would scale each row by another number.
        w32 = None if weights is None else weights.float()
        return F.embedding_bag(rows, y.float(), per_sample_weights=w32, mode="sum").to(y.dtype)
    w = weights if weights is None or weights.dtype == y.dtype else weights.to(y.dtype)
    return F.embedding_bag(rows, y, per_sample_weights=w, mode="sum")


_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _check_cpu_rows(rows: torch.Tensor, S: int) -> None:
    """IndexError naming the range for a CPU row index outside [0, S) (embedding_bag names it
    for the first token's slots only; for the others it asserts `i < index_size`). Not while
    torch.compile traces, under torch.func transforms or on fake tensors (FakeTensorMode),
    which have no values to read (there embedding_bag's own error stands)."""
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= S):
        bad = rows[(rows < 0) | (rows >= S)][0].item()
        raise IndexError(f"combine_rows: rows holds {bad}, outside [0, S) = [0, {S})")


def _gathered_sum(y: torch.Tensor, rows: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """The sum from differentiable pieces (forward mode; embedding_bag has no forward
    derivative): the k rows gathered, weighted and summed in fp32, rounded once to y's dtype
    (fp64 stays fp64)."""
    if y.dtype == torch.float64:
        part = y.index_select(0, rows.reshape(-1)).view(*rows.shape, y.shape[1])
        return (part if w is None else part * w.to(y.dtype).unsqueeze(-1)).sum(1)
    T, k = rows.shape
    part = y.index_select(0, rows.reshape(-1)).view(T, k, y.shape[1]).float()
    if w is not None:
        part = part * w.float().unsqueeze(-1)
    return part.sum(1).to(y.dtype)


def _check(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
    """The dtypes, shapes and devices combine_rows takes, from metadata only (no host sync).
    Unchecked, a CPU `rows` beside a GPU `y` reached the kernel as a host pointer, and a 1-D
    or float `rows` failed inside embedding_bag with a message about its own arguments."""
    if not (isinstance(y, torch.Tensor) and isinstance(rows, torch.Tensor)
            and (weights is None or isinstance(weights, torch.Tensor))):
        got = ", ".join(type(t).__name__ for t in (y, rows, weights))
        raise TypeError(f"combine_rows: y, rows and weights must be torch.Tensors (weights may "
                        f"be None); got {got}")
    check_row_operands("combine_rows", "y", y, "(S, H)", rows, "(T, k)", 2)
    if weights is not None:
        if not weights.is_floating_point():
            raise TypeError(f"combine_rows: weights must be a floating tensor; got "
                            f"{weights.dtype}")
        if weights.shape != rows.shape:
            raise ValueError(f"combine_rows: weights must have rows' shape "
                             f"{shape_text(rows)}; got {shape_text(weights)}")
        if weights.device != y.device:
            raise ValueError(f"combine_rows: weights must be on y's device {y.device}; got "
                             f"{weights.device}")
    if y.shape[0] == 0 and rows.numel():
        raise ValueError(f"combine_rows: y has no rows for the {rows.numel()} indices of rows "
                         f"(each must be in [0, S), S = 0)")


def _kernel_ok(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None) -> bool:
    # (autograd through y or the weights: embedding_bag, which has the derivatives)
    return (row_kernel_allowed(y, COMBINE_ENV) and not autograd_tracked(y)
            and not autograd_tracked(weights) and _layout_ok(y, rows, weights))


def _layout_ok(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor | None) -> bool:
    """Whether the kernel takes these dtypes, shapes, strides and alignment."""
    if y.dtype not in KERNEL_DTYPES or rows.dtype not in INDEX_DTYPES:
        return False
    if y.dim() != 2 or rows.dim() != 2 or not 1 <= rows.shape[1] <= COMBINE_MAX_K:
        return False
    if weights is not None and (weights.shape != rows.shape
                                or weights.dtype not in (y.dtype, torch.float32)):
        return False
    return vector_rows_ok(y)


@functools.lru_cache(maxsize=32)
def _kernel(dtype: torch.dtype, index_dtype: torch.dtype, k: int, weighted: bool):
    from moe_gemm.kernels.sm90.combine import CombineCompileKey, compile_combine
    from moe_gemm.ops import kernel_cache as cache

    key = CombineCompileKey(KERNEL_DTYPES[dtype], INDEX_DTYPES[index_dtype], k, weighted)
    return cache.get_or_compile(key, key.name, lambda: compile_combine(key))


def _combine_kernel(y: torch.Tensor, rows: torch.Tensor,
                    weights: torch.Tensor | None) -> torch.Tensor:
    T, k = rows.shape
    out = torch.empty(T, y.shape[1], dtype=y.dtype, device=y.device)
    if T and y.shape[1]:
        if weights is None:
            w = launch_resources._small("combine_w", y.device, torch.float32, (1, 1))
        else:  # (a weight in y's dtype widens exactly, as embedding_bag multiplies it)
            w = weights.float()
        _kernel(y.dtype, rows.dtype, k, weights is not None)(y, rows, w, out)
    return out
