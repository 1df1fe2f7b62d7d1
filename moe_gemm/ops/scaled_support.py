"""What the FP8 kernel can take, decided from shapes, strides and dtypes alone (pure torch).

On top of the 16-bit kernel's TMA rules (ops/support.py: 16-byte aligned base addresses and
strides): FP8 WGMMA reads both operands K-major, so x is row-major (K contiguous) and w is
column-major in its last two dims (an (E, N, K) weight seen as w.transpose(1, 2), as torch's
_scaled_grouped_mm wants it), and a row of K FP8 values must be a 16-byte multiple. Returns
None when the kernel can run, else a sentence naming the first reason it cannot.
"""

from __future__ import annotations

import torch

from moe_gemm.ops.scaled_validation import ScaledGemmArgs, ScaledMmArgs
from moe_gemm.ops.support import (
    MAX_BATCHED_TILES,
    MAX_DIM,
    MAX_PROBLEMS,
    TMA_ALIGN_BYTES,
    _out_row_problem,
    operand_major,
    tma_problem,
)

_W_MAJOR = ("w must be K-major (column-major in its last two dims) for the FP8 kernel, e.g. "
            "w_nk.transpose(1, 2) of an (E, N, K) weight")


def _k_problem(K: int) -> str | None:
    if K % TMA_ALIGN_BYTES:
        return (f"K={K} FP8 values per row are not a multiple of {TMA_ALIGN_BYTES} bytes, as "
                "TMA needs")
    return None


def scaled_mm_unsupported(args: ScaledMmArgs) -> str | None:
    x, w = args.x, args.w
    K, N, E = args.K, args.N, args.E
    if args.batched:
        G, M = x.shape[0], x.shape[1]
        if G == 0 or M == 0 or N == 0:
            return None
        if G * -(-M // 64) * -(-N // 16) > MAX_BATCHED_TILES:
            return f"{G} problems of {M}x{N} exceed the kernel's {MAX_BATCHED_TILES} tiles"
    else:
        if E > MAX_PROBLEMS:
            return f"{E} experts exceed the kernel's {MAX_PROBLEMS}"
        if args.rows == 0 or E == 0 or N == 0:
            return None
    if max(x.shape[-2], K, N) > MAX_DIM:
        return f"dimensions above {MAX_DIM} exceed the kernel's 32-bit indices"
    if K > 0:
        why = _k_problem(K)
        if why:
            return why
        if operand_major(x) != "row":
            return "x must be row-major (K contiguous) for the FP8 kernel"
        if w.stride(1) != 1 and K > 1:
            return _W_MAJOR
        why = tma_problem("x", x) or tma_problem("w", w)
        if why:
            return why
    out = args.out
    if out is not None:
        if out.stride(-1) != 1 and N > 1:
            return "out must have unit stride along N"
        return tma_problem("out", out)
    return _out_row_problem("out", N, args.out_dtype)


def scaled_gemm_unsupported(args: ScaledGemmArgs) -> str | None:
    if len(args.a) > MAX_PROBLEMS:
        return f"{len(args.a)} problems exceed the kernel's {MAX_PROBLEMS}"
    out_elem = args.out_dtype.itemsize
    for i, (a, b, (M, N, K)) in enumerate(zip(args.a, args.b, args.sizes)):
        if M == 0 or N == 0:
            continue
        if max(M, N, K) > MAX_DIM:
            return f"problem {i}: dimensions above {MAX_DIM} exceed the kernel's indices"
        if args.out is None and (N * out_elem) % TMA_ALIGN_BYTES:
            return _out_row_problem(f"out[{i}]", N, args.out_dtype)
        if K == 0:
            continue
        why = _k_problem(K)
        if why:
            return f"problem {i}: {why}"
        if a.stride(1) != 1 and K > 1:
            return f"a[{i}] must be row-major (K contiguous) for the FP8 kernel"
        if b.stride(0) != 1 and K > 1:
            return (f"b[{i}] must be K-major (column-major, e.g. w_nk.t() of an (N, K) weight) "
                    "for the FP8 kernel")
        why = tma_problem(f"a[{i}]", a) or tma_problem(f"b[{i}]", b)
        if why:
            return why
    if args.out is not None:
        for i, ((M, N, _), o) in enumerate(zip(args.sizes, args.out)):
            if M == 0 or N == 0:
                continue
            if o.stride(1) != 1 and N > 1:
                return f"out[{i}] must have unit stride along N"
            why = tma_problem(f"out[{i}]", o)
            if why:
                return why
    return None


def is_fp8(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
