"""The FP8 ops' torch backend and references: dequantize, then matmul in fp32 (or fp64).

`scaled_grouped_mm_torch` / `scaled_grouped_gemm_torch` run wherever the Hopper kernel cannot
(the CPU, other GPUs, layouts the kernel refuses): each problem's operands are dequantized
(fp8 value x its scale) in fp32 one problem at a time, so memory stays one expert's weight in
fp32, and multiplied with fp32 accumulation. `scaled_grouped_mm_ref` is the same in fp64 for
tests: the exact product of the dequantized operands.

The torch backend is differentiable through the scales. The FP8 operands themselves have no
gradient (torch's scaled matmuls give none either): where one requires grad, the result is
tied to the inputs by a backward that raises saying so (ops/autograd.py), not left to fail
inside torch (no addition for float8 gradients) or to return an unscaled FP8 gradient.

Arguments are checked (ops/scaled_validation.py) before they get here.
"""

from __future__ import annotations

import torch

from moe_gemm.ops.autograd import inference_only
from moe_gemm.ops.reference import expert_spans, tie_to_inputs
from moe_gemm.ops.scaled_validation import (
    SCALE_BLOCK,
    ScaledGemmArgs,
    ScaledMmArgs,
    a_scale_view,
    b_scale_view,
)

FP8_OPERAND_NO_GRAD = (
    "moe_gemm's FP8 ops give no gradient for their FP8 operands (x and w, or a and b): FP8 "
    "values are not differentiable. Pass them with requires_grad=False (e.g. w.detach(), or "
    "nn.Parameter(w, requires_grad=False)); the torch backend differentiates through the "
    "scales."
)


def _fp8_operands_untracked(run, operands, scales):
    """run(), its result tied to the inputs by a raising backward where an FP8 operand
    requires grad (module docstring)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        return inference_only(FP8_OPERAND_NO_GRAD, run, [*operands, *scales])
    return run()


def dequantize_rows(x: torch.Tensor, sa: torch.Tensor, dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
    """x (R, K) fp8 times its A-scale view sa (R, KB): KB = K / 128 blocks or 1 (row-wise)."""
    v = x.to(dtype)
    s = sa.to(dtype)
    if s.shape[-1] == 1:
        return v * s
    R, K = v.shape
    return (v.view(R, K // SCALE_BLOCK, SCALE_BLOCK) * s[:, :, None]).view(R, K)


def dequantize_cols(w: torch.Tensor, sb: torch.Tensor, block: bool,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w (K, N) fp8 times its B-scale view sb (KB, C): 128x128 blocks (block) or (1, N)."""
    v = w.to(dtype)
    s = sb.to(dtype)
    if not block:
        return v * s
    K, N = v.shape
    return v * s.repeat_interleave(SCALE_BLOCK, 0)[:K].repeat_interleave(SCALE_BLOCK, 1)[:, :N]


def _product(x, sa, w, sb, block, dtype):
    return dequantize_rows(x, sa, dtype) @ dequantize_cols(w, sb, block, dtype)


def scaled_grouped_mm_torch(args: ScaledMmArgs, dtype: torch.dtype = torch.float32
                            ) -> torch.Tensor:
    """The torch backend (dtype float32) or the reference (float64) of scaled_grouped_mm.
    Writes into args.out when given (rows past offs[-1] untouched), else returns a new tensor
    (those rows zero)."""
    return _fp8_operands_untracked(lambda: _scaled_mm_torch(args, dtype), (args.x, args.w),
                                   (args.scale_a, args.scale_b))


def _scaled_mm_torch(args: ScaledMmArgs, dtype: torch.dtype) -> torch.Tensor:
    x, w = args.x, args.w
    block = args.granularity == "block"
    odt = args.out_dtype if dtype == torch.float32 else dtype
    scales = (args.scale_a, args.scale_b)
    # New results are built out of place (the problems' products stacked or concatenated):
    # writing them into a preallocated tensor fails under torch.func transforms that wrap a
    # scale or an operand (vmap(grad(f)): a batched product cannot be written into an
    # unbatched tensor). Where no product reaches the result (no problems, no routed rows),
    # tie_to_inputs keeps it in the scales' graph, as grouped_mm's torch path does.
    if args.batched:
        G, M, N = x.shape[0], x.shape[1], args.N
        sa = a_scale_view(args.scale_a, args.granularity, (G,), M)
        sb = b_scale_view(args.scale_b, args.granularity, (G,), N)
        if G:
            y = torch.stack([_product(x[g], sa[g], w[g], sb[g], block, dtype).to(odt)
                             for g in range(G)])
        else:
            y = tie_to_inputs(torch.empty(0, M, N, dtype=odt, device=x.device), *scales)
        return y if args.out is None else args.out.copy_(y)
    T, E, N = x.shape[0], args.E, args.N
    sa = a_scale_view(args.scale_a, args.granularity, (), T)
    sb = b_scale_view(args.scale_b, args.granularity, (E,), N)
    # The sizes are needed on the host: one device-to-host copy of offs (a synchronisation
    # on CUDA; this is the fallback).
    spans = expert_spans(args.offs, T) if E else []
    if args.out is not None and dtype == torch.float32:
        for e, start, end in spans:
            args.out[start:end] = _product(x[start:end], sa[start:end], w[e], sb[e], block,
                                           dtype).to(args.out.dtype)
        return tie_to_inputs(args.out, *scales)
    tail = T - (spans[-1][2] if spans else 0)
    parts = [_product(x[start:end], sa[start:end], w[e], sb[e], block, dtype).to(odt)
             for e, start, end in spans]
    parts.append(torch.zeros(tail, N, dtype=odt, device=x.device))
    return tie_to_inputs(torch.cat(parts) if len(parts) > 1 else parts[0], *scales)


def scaled_grouped_gemm_torch(args: ScaledGemmArgs, dtype: torch.dtype = torch.float32
                              ) -> list[torch.Tensor]:
    """The torch backend (float32) or the reference (float64) of scaled_grouped_gemm."""
    return _fp8_operands_untracked(lambda: _scaled_gemm_torch(args, dtype),
                                   (*args.a, *args.b), (*args.scale_a, *args.scale_b))


def _scaled_gemm_torch(args: ScaledGemmArgs, dtype: torch.dtype) -> list[torch.Tensor]:
    block = args.granularity == "block"
    odt = args.out_dtype if dtype == torch.float32 else dtype
    res = []
    for ai, bi, sai, sbi, (M, N, _) in zip(args.a, args.b, args.scale_a, args.scale_b,
                                           args.sizes):
        sa = a_scale_view(sai, args.granularity, (), M)
        sb = b_scale_view(sbi, args.granularity, (), N)
        res.append(_product(ai, sa, bi, sb, block, dtype).to(odt))
    if args.out is None or dtype != torch.float32:
        return res
    for o, r in zip(args.out, res):
        o.copy_(r)
    return list(args.out)


def scaled_grouped_mm_ref(x, w, scale_a, scale_b, offs=None, dtype=torch.float64):
    """The exact (fp64) product of the dequantized operands, for tests: (T, N) with rows past
    offs[-1] zero, or (G, M, N) batched."""
    from moe_gemm.ops.scaled_validation import check_scaled_grouped_mm

    return scaled_grouped_mm_torch(
        check_scaled_grouped_mm(x, w, scale_a, scale_b, offs, None, None), dtype)


def scaled_grouped_gemm_ref(a, b, scale_a, scale_b, dtype=torch.float64):
    from moe_gemm.ops.scaled_validation import check_scaled_grouped_gemm

    return scaled_grouped_gemm_torch(
        check_scaled_grouped_gemm(a, b, scale_a, scale_b, None, None), dtype)
