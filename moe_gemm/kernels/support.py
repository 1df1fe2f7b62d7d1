"""What the sm90 kernels can take, decided from shapes, strides and dtypes alone.

Pure torch (no CuTe import), so `backend="auto"` can decide on any machine. The rules come
from the hardware: TMA descriptors need a 16-byte aligned base address and 16-byte multiples
for every stride but the unit one; WGMMA takes 16-bit inputs from shared memory (bf16, fp16).
Returns None when the kernel can run, else a sentence naming the first reason it cannot.
"""

from __future__ import annotations

import torch

from ..config import GemmConfig
from ..validation import GroupedGemmArgs, GroupedMmArgs

KERNEL_IN_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TMA_ALIGN_BYTES = 16
# Per-problem TMA descriptors live in a (G, 3, 128 B) workspace and the device visitor scans
# problem sizes 32 at a time; 65,535 keeps every index comfortably in Int32 arithmetic.
MAX_PROBLEMS = 65535


def operand_major(t: torch.Tensor) -> str | None:
    """'row' if the last dim has unit stride, 'col' if the one before it does, else None."""
    if t.shape[-1] <= 1 or t.stride(-1) == 1:
        return "row"
    if t.shape[-2] <= 1 or t.stride(-2) == 1:
        return "col"
    return None


def tma_problem(name: str, t: torch.Tensor) -> str | None:
    """Why `t` (2-D or 3-D) cannot be a TMA operand, or None."""
    if t.numel() == 0:
        return None
    elem = t.element_size()
    if t.data_ptr() % TMA_ALIGN_BYTES:
        return f"{name}'s data pointer is not {TMA_ALIGN_BYTES}-byte aligned"
    major = operand_major(t)
    if major is None:
        return f"{name} has no unit-stride dimension among its last two (strides {t.stride()})"
    unit_dim = t.dim() - 1 if major == "row" else t.dim() - 2
    for d in range(t.dim()):
        if d == unit_dim or t.shape[d] == 1:
            continue
        if (t.stride(d) * elem) % TMA_ALIGN_BYTES:
            return (
                f"{name} stride {t.stride(d)} (dim {d}) is not a multiple of "
                f"{TMA_ALIGN_BYTES // elem} elements ({TMA_ALIGN_BYTES} bytes), as TMA needs"
            )
    return None


def _dtype_problem(dtype: torch.dtype, out_dtype: torch.dtype) -> str | None:
    if dtype not in KERNEL_IN_DTYPES:
        return f"the kernels take bf16 or fp16 inputs, not {dtype}"
    if out_dtype not in KERNEL_OUT_DTYPES:
        return f"the kernels write bf16, fp16 or fp32, not {out_dtype}"
    return None


def _out_row_problem(name: str, n: int, out_dtype: torch.dtype) -> str | None:
    elem = torch.empty((), dtype=out_dtype).element_size()
    if (n * elem) % TMA_ALIGN_BYTES:
        return (
            f"{name} rows of {n} {out_dtype} elements are not a multiple of {TMA_ALIGN_BYTES} "
            "bytes, as the TMA store needs"
        )
    return None


def grouped_gemm_unsupported(args: GroupedGemmArgs) -> str | None:
    why = _dtype_problem(args.dtype, args.out_dtype)
    if why:
        return why
    if len(args.a) > MAX_PROBLEMS:
        return f"{len(args.a)} problems exceed the kernel's {MAX_PROBLEMS}"
    for i, (a, b) in enumerate(zip(args.a, args.b)):
        M, K = a.shape
        N = b.shape[1]
        if M == 0 or N == 0:
            continue  # no tiles: never touched by the kernel
        if K > 0:
            why = tma_problem(f"a[{i}]", a) or tma_problem(f"b[{i}]", b)
            if why:
                return why
            if operand_major(a) != "row":
                return f"a[{i}] must be row-major (K contiguous) for the kernel"
        if args.out is not None:
            o = args.out[i]
            if o.stride(-1) != 1 and N > 1:
                return f"out[{i}] must have unit stride along N"
            why = tma_problem(f"out[{i}]", o)
        else:
            why = _out_row_problem(f"out[{i}]", N, args.out_dtype)
        if why:
            return why
    return None


def grouped_mm_unsupported(args: GroupedMmArgs, config: GemmConfig) -> str | None:
    why = _dtype_problem(args.dtype, args.out_dtype)
    if why:
        return why
    if args.E > MAX_PROBLEMS:
        return f"{args.E} experts exceed the kernel's {MAX_PROBLEMS}"
    if args.T == 0 or args.E == 0 or args.N == 0:
        return None
    if args.K > 0:
        why = tma_problem("x", args.x) or tma_problem("w", args.w)
        if why:
            return why
        if operand_major(args.x) != "row":
            return "x must be row-major (K contiguous) for the kernel"
    if args.out is not None:
        if args.out.stride(-1) != 1 and args.N > 1:
            return "out must have unit stride along N"
        return tma_problem("out", args.out)
    return _out_row_problem("out", args.N, args.out_dtype)
