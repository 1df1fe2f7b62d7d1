"""The masked ops: grouped_mm_masked and scaled_grouped_mm_masked.

DeepGEMM's masked layout, the one DeepEP's low-latency dispatch hands over: every expert g has
a fixed capacity of M rows, x[g] is (M, K), and only its first masked_m[g] rows are tokens;
the counts stay on the GPU, so a decode step is one launch that CUDA graphs replay with new
counts. As the other ops (ops/api.py, ops/scaled.py): validate, pick a backend (`cute` on an
sm90a GPU with the CuTe DSL, `torch` elsewhere), run; a repeated call finds its cached plan by
its tensors' signatures and only launches; under torch.compile, make_fx or a fake/functional
tensor mode the ops go through their torch.library registrations (ops/masked_custom_ops.py).
"""

from __future__ import annotations

import dataclasses

import torch

from moe_gemm.capability import cute_problem
from moe_gemm.config import GemmConfig
from moe_gemm.env import env_parse
from moe_gemm.ops import masked_custom_ops
from moe_gemm.ops.aliasing import overlaps_any
from moe_gemm.ops.api import (
    NO_BACKWARD,
    _check_config,
    _switches,
    _symbolic,
    _traced,
    _use_cute,
)
from moe_gemm.ops.autograd import inference_only
from moe_gemm.ops.masked_launch import rows_mask
from moe_gemm.ops.masked_validation import (
    MaskedArgs,
    check_config_fits,
    check_grouped_mm_masked,
    check_scaled_grouped_mm_masked,
)
from moe_gemm.ops.reference import grouped_bmm_torch
from moe_gemm.ops.scaled import NO_BACKWARD as NO_BACKWARD_FP8
from moe_gemm.ops.scaled_reference import scaled_grouped_mm_torch
from moe_gemm.ops.scaled_support import scaled_mm_unsupported
from moe_gemm.ops.signature import PlanCache
from moe_gemm.ops.support import PLAIN_TENSORS, grouped_bmm_unsupported
from moe_gemm.ops.validation import offs_check_requested
from moe_gemm.ops.vmap import batched_values, per_entry, per_entry_into

_PTR = torch.Tensor.data_ptr
_plans = PlanCache(per_bucket=8, buckets=128)  # buckets: (op, x.shape)


def _clear_plans() -> None:
    _plans.clear()


def grouped_mm_masked(
    x: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    expected_m: int | None = None,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y[g, :masked_m[g]] = x[g, :masked_m[g]] @ w[g] for every g, fp32 accumulation: the
    batched GEMM on each problem's first masked_m[g] rows (DeepGEMM's masked layout).

    Args:
        x: [G, M, K]: M rows of capacity per problem (expert), the first masked_m[g] valid;
            bf16, fp16 or fp32.
        w: [G, K, N], x's dtype and device; any layout with one unit stride in the last two
            dims (e.g. `w_nk.transpose(1, 2)` of a [G, N, K] weight).
        masked_m: [G] int32 valid row counts, on x's device (0 <= masked_m[g] <= M).
        expected_m: the typical valid rows per problem, for the kernel choice only (a decode
            step's tokens per expert); default M.
        out: optional [G, M, N] tensor to write into.
        config: a GemmConfig; None = automatic (the MoE form's choice for G experts of
            expected_m rows). Tiles are found on the GPU: visitor and sort_by_k do not apply,
            and a pinned tail_split is refused (ValueError).
        out_dtype: bf16, fp16 or fp32; default out's dtype where out is given, else x's
            dtype (as grouped_mm).

    Returns:
        y [G, M, N]. Rows at and past masked_m[g] are never written by the Hopper kernel: in
        a new output (out=None) their values are unspecified (the torch backend zeroes
        them); in `out` they keep what they held.

    On a CUDA device the call never synchronizes with the host (CUDA-graph safe: replay with
    new counts), so masked_m on the GPU is not checked unless MOE_GEMM_CHECK_OFFS=1; the
    kernel clamps each count into [0, M]. Counts on the CPU are always checked.

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes, masked_m not int32,
            expected_m not an int.
        ValueError: ranks, K or G mismatch, masked_m shape, device or values, out shape,
            expected_m < 1.
        RuntimeError: backend="cute" forced where the Hopper kernels cannot run.
    """
    if _traced():
        return masked_custom_ops.grouped_mm_masked(x, w, masked_m, expected_m=expected_m,
                                                   out=out, config=config, out_dtype=out_dtype)
    return grouped_mm_masked_eager(x, w, masked_m, expected_m, out, config, out_dtype)


def grouped_mm_masked_eager(x, w, masked_m, expected_m, out, config, out_dtype
                            ) -> torch.Tensor:
    """grouped_mm_masked without the tracing check (the registered op's implementation)."""
    if type(x) in PLAIN_TENSORS and (config is None or type(config) is GemmConfig):
        try:
            shape = x.shape
        except RuntimeError:  # a nested tensor has no sizes: the detailed path's checks name it
            return _detailed(x, w, masked_m, expected_m, out, config, out_dtype)
        tensors = (x, w, masked_m) if out is None else (x, w, masked_m, out)
        entry = _plans.find(("bmm", out is None, shape),
                            (config, out_dtype, expected_m, _switches()), tensors)
        if entry is not None and not (_PTR(x) | _PTR(w) | (0 if out is None else _PTR(out))
                                      ) & 15 and not (out is not None
                                                      and overlaps_any(out, (x, w, masked_m))):
            plan, link = entry
            if link and torch.is_grad_enabled():
                return inference_only(NO_BACKWARD, lambda: plan.launch(x, w, masked_m, out), [x, w])
            return plan.launch(x, w, masked_m, out)
    return _detailed(x, w, masked_m, expected_m, out, config, out_dtype)


def _detailed(x, w, masked_m, expected_m, out, config, out_dtype) -> torch.Tensor:
    cfg = _check_config(config, "grouped_mm_masked")
    if _symbolic(*(t for t in (x, w, masked_m, out) if t is not None)):
        return masked_custom_ops.grouped_mm_masked(x, w, masked_m, expected_m=expected_m,
                                                   out=out, config=config, out_dtype=out_dtype)
    if batched_values(masked_m):  # (vmap with grad: ops/vmap.py)
        return per_entry_into(out, out_dtype, lambda dt: per_entry(
            lambda x, w, masked_m: grouped_mm_masked_eager(x, w, masked_m, expected_m, None,
                                                           config, dt), x, w, masked_m),
            lambda out, y: masked_custom_ops.write_valid_rows(out, y, masked_m))
    args = check_grouped_mm_masked(x, w, masked_m, expected_m, out, out_dtype)
    check_config_fits(cfg)
    if out is not None and overlaps_any(out, (x, w, masked_m)):
        # Computed into a copy of out (rows past the counts keep their values), then copied.
        y = grouped_mm_masked_eager(x, w, masked_m, expected_m, out.clone(), config,
                                    args.batch.out_dtype)
        return out.copy_(y)
    problem = cute_problem(args.x.device) if cfg.backend != "torch" else "torch requested"
    unsupported = grouped_bmm_unsupported(args.batch, cfg) if problem is None else None
    if not _use_cute(cfg, problem, unsupported, "grouped_mm_masked"):
        # The rows past the counts are zeroed before the product: whatever they hold (an
        # uninitialised dispatch buffer: NaN, inf) reaches neither the output nor w's gradient.
        xv = args.x.masked_fill(~rows_mask(args.masked_m, args.shape[1]), 0)
        return masked_torch(args, grouped_bmm_torch(dataclasses.replace(args.batch, x=xv,
                                                                         out=None)))
    from moe_gemm.ops.masked_launch import MaskedPlan

    plan = MaskedPlan(args, cfg)
    mm = masked_m if masked_m.is_contiguous() else masked_m.contiguous()
    if mm is masked_m and not (out is not None and out.requires_grad):
        _remember(("bmm", out is None, x.shape), (config, out_dtype, expected_m),
                  (x, w, masked_m) if out is None else (x, w, masked_m, out), plan, config,
                  out)
    return inference_only(NO_BACKWARD, lambda: plan.launch(args.x, args.batch.w, mm, out),
                          [x, w])


def scaled_grouped_mm_masked(
    x: torch.Tensor,
    w: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    expected_m: int | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The FP8 masked GEMM: scaled_grouped_mm's batched form (x [G, M, K], w [G, K, N], FP8)
    on each problem's first masked_m[g] rows, DeepGEMM's m_grouped masked layout.

    Args:
        x, w, scale_a, scale_b: as scaled_grouped_mm's batched form: block-wise scale_a
            [G, M, K/128] and scale_b [G, K/128, ceil(N/128)], row-wise [G, M] and [G, N],
            or per-tensor.
        masked_m, expected_m, out, config: as grouped_mm_masked.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32; default out's dtype where
            out is given, else bf16.

    Returns:
        y [G, M, N]; rows at and past masked_m[g] as in grouped_mm_masked (never written by
        the kernel).

    Raises:
        TypeError / ValueError: as scaled_grouped_mm, plus the masked_m and expected_m checks
        of grouped_mm_masked.
        RuntimeError: backend="cute" forced where the Hopper kernels cannot run.
    """
    if _traced():
        return masked_custom_ops.scaled_grouped_mm_masked(
            x, w, scale_a, scale_b, masked_m, expected_m=expected_m, out=out,
            out_dtype=out_dtype, config=config)
    return scaled_grouped_mm_masked_eager(x, w, scale_a, scale_b, masked_m, expected_m, out,
                                          out_dtype, config)


def scaled_grouped_mm_masked_eager(x, w, scale_a, scale_b, masked_m, expected_m, out,
                                   out_dtype, config) -> torch.Tensor:
    """scaled_grouped_mm_masked without the tracing check (the registered op's body)."""
    if type(x) in PLAIN_TENSORS and out is None and (config is None
                                                     or type(config) is GemmConfig):
        try:
            shape = x.shape
        except RuntimeError:  # a nested tensor has no sizes: the detailed path's checks name it
            return _detailed_fp8(x, w, scale_a, scale_b, masked_m, expected_m, out, out_dtype,
                                 config)
        entry = _plans.find(("fp8", True, shape), (config, out_dtype, expected_m, _switches()),
                            (x, w, scale_a, scale_b, masked_m))
        if entry is not None and not (_PTR(x) | _PTR(w)) & 15:
            plan, link = entry
            inputs = [x, w, scale_a, scale_b]
            if link and torch.is_grad_enabled():
                return inference_only(NO_BACKWARD_FP8,
                                      lambda: plan.launch(x, w, scale_a, scale_b, masked_m,
                                                          None),
                                      inputs)
            return plan.launch(x, w, scale_a, scale_b, masked_m, None)
    return _detailed_fp8(x, w, scale_a, scale_b, masked_m, expected_m, out, out_dtype, config)


def _detailed_fp8(x, w, scale_a, scale_b, masked_m, expected_m, out, out_dtype, config
                  ) -> torch.Tensor:
    cfg = _check_config(config, "scaled_grouped_mm_masked")
    tensors = [t for t in (x, w, scale_a, scale_b, masked_m, out) if t is not None]
    if _symbolic(*tensors):
        return masked_custom_ops.scaled_grouped_mm_masked(
            x, w, scale_a, scale_b, masked_m, expected_m=expected_m, out=out,
            out_dtype=out_dtype, config=config)
    if batched_values(masked_m):  # (vmap with grad: ops/vmap.py)
        return per_entry_into(out, out_dtype, lambda dt: per_entry(
            lambda x, w, sa, sb, masked_m: scaled_grouped_mm_masked_eager(
                x, w, sa, sb, masked_m, expected_m, None, dt, config),
            x, w, scale_a, scale_b, masked_m),
            lambda out, y: masked_custom_ops.write_valid_rows(out, y, masked_m))
    args = check_scaled_grouped_mm_masked(x, w, scale_a, scale_b, masked_m, expected_m, out,
                                          out_dtype)
    check_config_fits(cfg)
    if out is not None and overlaps_any(out, (x, w, scale_a, scale_b, masked_m)):
        y = scaled_grouped_mm_masked_eager(x, w, scale_a, scale_b, masked_m, expected_m,
                                           out.clone(), args.batch.out_dtype, config)
        return out.copy_(y)
    problem = cute_problem(args.x.device) if cfg.backend != "torch" else "torch requested"
    unsupported = scaled_mm_unsupported(args.batch) if problem is None else None
    if not _use_cute(cfg, problem, unsupported, "scaled_grouped_mm_masked"):
        # As grouped_mm_masked: the rows past the counts (and their row or block scales) are
        # zeroed before the product, so what they hold reaches no gradient of the scales.
        valid, b = rows_mask(args.masked_m, args.shape[1]), args.batch
        xv = torch.where(valid, b.x, torch.zeros((), dtype=b.x.dtype, device=b.x.device))
        sa = b.scale_a if b.scale_a.dim() < 2 else torch.where(
            valid if b.scale_a.dim() == 3 else valid[..., 0], b.scale_a, 0.0)
        return masked_torch(args, scaled_grouped_mm_torch(dataclasses.replace(
            b, x=xv, scale_a=sa, out=None)))
    from moe_gemm.ops.masked_launch import Fp8MaskedPlan

    plan = Fp8MaskedPlan(args, cfg)
    mm = masked_m if masked_m.is_contiguous() else masked_m.contiguous()
    if mm is masked_m and out is None:
        _remember(("fp8", True, x.shape), (config, out_dtype, expected_m),
                  (x, w, scale_a, scale_b, masked_m), plan, config)
    return inference_only(NO_BACKWARD_FP8,
                          lambda: plan.launch(args.x, args.batch.w, args.batch.scale_a,
                                       args.batch.scale_b, mm, out),
                          [x, w, scale_a, scale_b])


def masked_torch(args: MaskedArgs, y: torch.Tensor) -> torch.Tensor:
    """The torch backend: y, the whole batched product, kept on the valid rows only (zeros
    past them in a new output; `out`'s own values there). GPU ops only: no host sync."""
    valid = rows_mask(args.masked_m, args.shape[1])
    if args.out is None:
        return y.masked_fill(~valid, 0)
    return args.out.copy_(torch.where(valid, y.to(args.out.dtype), args.out))


def _remember(bucket, extra, tensors, plan, config, out=None) -> None:
    """Keep a plan for calls with this signature (plain tensors, a cached config, switches
    that allow it, not built while capturing a CUDA graph, values not checked per call)."""
    if config is not None and type(config) is not GemmConfig:
        return
    if any(type(t) not in PLAIN_TENSORS for t in tensors) or not plan.cacheable:
        return
    switches = _switches()
    if env_parse("MOE_GEMM_DISABLE_CUTE", switches[0]) or offs_check_requested():
        return
    # Any operand that requires grad, the FP8 form's scales among them (a link decided on x
    # and w alone let the calls that find the plan return results with no refusing backward)
    link = any(t.requires_grad for t in tensors)
    _plans.add(bucket, (*extra, switches), tensors, (plan, link), out=out)
