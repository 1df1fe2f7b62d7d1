"""The FP8 ops: scaled_grouped_mm and scaled_grouped_gemm, in torch's scaled-matmul vocabulary.

As the 16-bit ops (ops/api.py): validate (messages name the expected shape and dtype), pick a
backend (`cute` on an sm90a GPU with the CuTe DSL, `torch` elsewhere: dequantize and matmul in
fp32), run. A repeated scaled_grouped_mm call finds its cached plan by its tensors'
signatures and only launches; under torch.compile, make_fx or a fake/functional tensor mode
the ops go through their torch.library registrations (ops/custom_ops_fp8.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_gemm.capability import cute_problem
from moe_gemm.config import GemmConfig
from moe_gemm.env import env_parse
from moe_gemm.ops import custom_ops_fp8
from moe_gemm.ops.aliasing import overlaps_any
from moe_gemm.ops.api import _check_config, _switches, _symbolic, _traced, _use_cute
from moe_gemm.ops.autograd import inference_only
from moe_gemm.ops.custom_ops import write_rows
from moe_gemm.ops.scaled_reference import scaled_grouped_gemm_torch, scaled_grouped_mm_torch
from moe_gemm.ops.scaled_support import scaled_gemm_unsupported, scaled_mm_unsupported
from moe_gemm.ops.scaled_validation import (
    check_scaled_grouped_gemm,
    check_scaled_grouped_mm,
    offs_check_requested,
)
from moe_gemm.ops.signature import PlanCache
from moe_gemm.ops.support import PLAIN_TENSORS
from moe_gemm.ops.vmap import batched_values, per_entry, per_entry_into

NO_BACKWARD = (
    "moe_gemm's FP8 kernels are inference-only: they have no backward. Run under "
    "torch.no_grad() / torch.inference_mode(), or pass GemmConfig(backend='torch') for the "
    "differentiable torch path (dequantize and matmul)."
)
_PTR = torch.Tensor.data_ptr
_plans = PlanCache(per_bucket=8, buckets=256)  # buckets: (form, x.shape)


def _clear_plans() -> None:
    _plans.clear()


def scaled_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The FP8 MoE expert GEMM (and batched GEMM): grouped_mm on FP8 operands with scales.

    y = (x * scale_a) @ (w * scale_b) per group, accumulated in fp32, where the scales expand
    over their blocks (torch._scaled_grouped_mm's operand order and scale convention: a scale
    multiplies the FP8 value back to its real value). With offs, rows offs[e-1]:offs[e] of x
    go with w[e]; without, x and w are batches of equal problems.

    Args:
        x: [T, K] tokens sorted by expert (or [G, M, K]); torch.float8_e4m3fn or float8_e5m2.
        w: [E, K, N] expert weights (or [G, K, N]), x's dtype. The Hopper kernel reads it
            K-major (column-major in its last two dims): pass `w_nk.transpose(1, 2)` of an
            [E, N, K] weight, as FP8 checkpoints store them.
        scale_a, scale_b: float32 scales on x's device, one of (ops/scaled_validation.py):
            block-wise (DeepSeek-V3): scale_a [T, K/128] (1x128 groups per token; [G, M, K/128]
            batched), scale_b [E, K/128, ceil(N/128)] (128x128 blocks; K a multiple of 128);
            row-wise: scale_a [T] ([G, M]), scale_b [E, N];
            per-tensor: scale_a [] or [1], scale_b [], [1] or [E].
        offs: [E] int32 cumulative end rows on x's device, or None for the batched form.
        out: optional [T, N] ([G, M, N]) tensor to write into; rows >= offs[-1] untouched.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32; default out's dtype where
            out is given, else bf16 (an out of another dtype than out_dtype: TypeError).
        config: a GemmConfig; None = automatic (moe_gemm.ops.heuristics_fp8).

    Returns:
        y [T, N] (rows >= offs[-1] zero when out is None), or [G, M, N].

    As grouped_mm, a CUDA call never synchronizes with the host (CUDA-graph safe): offs on
    the GPU are clamped into [0, T] by the kernel, never checked unless
    MOE_GEMM_CHECK_OFFS=1. Scale values are never read on the host either: zero, negative or
    non-finite scales give the product they define (NaN and inf propagate), as in torch's
    scaled matmuls. Use moe_gemm.quantize_fp8_per_token_group (activations) and
    quantize_fp8_per_block (weights) to make the operands.

    Gradients: the Hopper kernel has no backward (one raises); the torch backend
    differentiates through the scales, never the FP8 operands (a backward raises when x or w
    requires grad, e.g. an nn.Parameter of FP8 weights left at requires_grad=True).

    Raises:
        TypeError: non-tensors, non-FP8 operands, mismatched dtypes, non-float32 scales,
            offs not int32, an unsupported out_dtype.
        ValueError: ranks, K mismatch, scale shapes that match no granularity, K not a
            multiple of 128 with block scales, offs length or values, devices, out shape.
        RuntimeError: backend="cute" forced where the Hopper kernels cannot run.
    """
    if _traced():
        return custom_ops_fp8.scaled_grouped_mm(x, w, scale_a, scale_b, offs, out=out,
                                                out_dtype=out_dtype, config=config)
    return scaled_grouped_mm_eager(x, w, scale_a, scale_b, offs, out, out_dtype, config)


def scaled_grouped_mm_eager(x, w, scale_a, scale_b, offs, out, out_dtype, config
                            ) -> torch.Tensor:
    """scaled_grouped_mm without the tracing check (the registered op's implementation)."""
    if type(x) in PLAIN_TENSORS and out is None and (config is None
                                                     or type(config) is GemmConfig):
        try:
            shape = x.shape
        except RuntimeError:  # a nested tensor has no sizes: the detailed path's checks name it
            return _detailed(x, w, scale_a, scale_b, offs, out, out_dtype, config)
        extra = (config, out_dtype, _switches())
        if offs is None:
            entry = _plans.find(("bmm", shape), extra, (x, w, scale_a, scale_b))
        else:
            entry = _plans.find(("mm", shape), extra, (x, w, scale_a, scale_b, offs))
        if entry is not None and not (_PTR(x) | _PTR(w)) & 15:
            plan, link = entry
            run = ((lambda: plan.launch(x, w, scale_a, scale_b, None)) if offs is None
                   else (lambda: plan.launch(x, w, scale_a, scale_b, offs, None)))
            if link and torch.is_grad_enabled():
                return inference_only(NO_BACKWARD, run, [x, w, scale_a, scale_b])
            return run()
    return _detailed(x, w, scale_a, scale_b, offs, out, out_dtype, config)


def _detailed(x, w, scale_a, scale_b, offs, out, out_dtype, config) -> torch.Tensor:
    cfg = _check_config(config, "scaled_grouped_mm")
    tensors = [t for t in (x, w, scale_a, scale_b, offs, out) if t is not None]
    if _symbolic(*tensors):
        return custom_ops_fp8.scaled_grouped_mm(x, w, scale_a, scale_b, offs, out=out,
                                                out_dtype=out_dtype, config=config)
    if offs is not None and batched_values(offs):  # (vmap with grad: ops/vmap.py)
        return per_entry_into(out, out_dtype, lambda dt: per_entry(
            lambda x, w, sa, sb, offs: scaled_grouped_mm_eager(x, w, sa, sb, offs, None, dt,
                                                               config),
            x, w, scale_a, scale_b, offs),
            lambda out, y: write_rows(out, y, offs))
    args = check_scaled_grouped_mm(x, w, scale_a, scale_b, offs, out, out_dtype)
    if out is not None and overlaps_any(out, (x, w, scale_a, scale_b, offs)):
        # Computed into a copy of out (rows past offs[-1] keep their values), then copied.
        y = scaled_grouped_mm_eager(x, w, scale_a, scale_b, offs, out.clone(), args.out_dtype,
                                    config)
        return out.copy_(y)
    problem = cute_problem(args.x.device) if cfg.backend != "torch" else "torch requested"
    unsupported = scaled_mm_unsupported(args) if problem is None else None
    if not _use_cute(cfg, problem, unsupported, "scaled_grouped_mm"):
        return scaled_grouped_mm_torch(args)
    from moe_gemm.ops.scaled_launch import Fp8BmmPlan, Fp8MmPlan

    inputs = [args.x, args.w, args.scale_a, args.scale_b]
    if args.batched:
        plan = Fp8BmmPlan(args, cfg)
        _remember(("bmm", x.shape), config, out_dtype, (x, w, scale_a, scale_b), plan, out)
        return inference_only(NO_BACKWARD, lambda: plan.launch(x, w, scale_a, scale_b, args.out),
                              inputs)
    plan = Fp8MmPlan(args, cfg)
    offs_c = offs if offs.is_contiguous() else offs.contiguous()
    if offs_c is offs:
        _remember(("mm", x.shape), config, out_dtype, (x, w, scale_a, scale_b, offs), plan, out)
    return inference_only(NO_BACKWARD, lambda: plan.launch(x, w, scale_a, scale_b, offs_c,
                                                      args.out),
                          inputs)


def _remember(bucket, config, out_dtype, tensors, plan, out) -> None:
    """Keep a plan for calls with this signature (no out, plain tensors, a cached config,
    switches that allow it, not built while capturing a CUDA graph)."""
    if out is not None or (config is not None and type(config) is not GemmConfig):
        return
    if any(type(t) not in PLAIN_TENSORS for t in tensors) or not plan.cacheable:
        return
    switches = _switches()
    if env_parse("MOE_GEMM_DISABLE_CUTE", switches[0]) or offs_check_requested():
        return
    link = any(t.requires_grad for t in tensors)
    _plans.add(bucket, (config, out_dtype, switches), tensors, (plan, link))


def scaled_grouped_gemm(
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    scale_a: Sequence[torch.Tensor],
    scale_b: Sequence[torch.Tensor],
    *,
    out: Sequence[torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
) -> list[torch.Tensor]:
    """Many independent FP8 GEMMs in one launch: D_i = (A_i * scale_a[i]) @ (B_i * scale_b[i]).

    Args:
        a: G tensors [M_i, K_i], float8_e4m3fn or float8_e5m2, one dtype and device.
        b: G tensors [K_i, N_i], the same dtype; the kernel reads them K-major (`w.t()` of an
            [N_i, K_i] weight).
        scale_a, scale_b: G float32 scales each, block scales for all problems or none:
            block [M_i, K_i/128] and [K_i/128, ceil(N_i/128)] (K_i a multiple of 128);
            row-wise [M_i] and [N_i]; per-tensor [] (or [1]) and [] (or [1]) (row-wise and
            per-tensor problems mix).
        out: optional G tensors [M_i, N_i] to write into.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32; default out's dtype where
            out is given, else bf16.
        config: a GemmConfig; None = automatic.

    Returns:
        The G results [M_i, N_i]. Empty problems are normal; K_i = 0 gives zeros.

    Raises:
        TypeError / ValueError as scaled_grouped_mm, naming the problem; RuntimeError when
        backend="cute" is forced where the kernels cannot run.
    """
    if _traced():
        return custom_ops_fp8.scaled_grouped_gemm(a, b, scale_a, scale_b, out=out,
                                                  out_dtype=out_dtype, config=config)
    return scaled_grouped_gemm_eager(a, b, scale_a, scale_b, out, out_dtype, config)


def scaled_grouped_gemm_eager(a, b, scale_a, scale_b, out, out_dtype, config
                              ) -> list[torch.Tensor]:
    cfg = _check_config(config, "scaled_grouped_gemm")
    seqs = [s for s in (a, b, scale_a, scale_b, out) if isinstance(s, (list, tuple))]
    if _symbolic(*(t for s in seqs for t in s)):
        return custom_ops_fp8.scaled_grouped_gemm(a, b, scale_a, scale_b, out=out,
                                                  out_dtype=out_dtype, config=config)
    args = check_scaled_grouped_gemm(a, b, scale_a, scale_b, out, out_dtype)
    if not args.a:
        return []
    problem = cute_problem(args.device) if cfg.backend != "torch" else "torch requested"
    unsupported = scaled_gemm_unsupported(args) if problem is None else None
    if not _use_cute(cfg, problem, unsupported, "scaled_grouped_gemm"):
        return scaled_grouped_gemm_torch(args)
    from moe_gemm.ops.scaled_launch import Fp8GeneralLaunch, new_outputs

    if args.out is None:
        outs = new_outputs(args.sizes, args.out_dtype, args.device)
        aliased: list[int] = []
    else:
        outs = list(args.out)
        # Outputs sharing memory with an operand: computed into fresh tensors, then copied.
        operands = [*args.a, *args.b, *args.scale_a, *args.scale_b]
        aliased = [i for i, o in enumerate(outs) if overlaps_any(o, operands)]
        for i in aliased:
            outs[i] = torch.empty_like(outs[i])
    launch = Fp8GeneralLaunch(args, cfg)
    res = inference_only(NO_BACKWARD, lambda: launch.launch(outs),
                         [*args.a, *args.b, *args.scale_a, *args.scale_b])
    for i in aliased:
        args.out[i].copy_(res[i])
        res[i] = args.out[i]
    return res
