"""fused_grouped_mm_masked: the masked layout (ops/masked.py) with fused_grouped_mm's bias,
gated activation and row weights in the kernel.

    y = fused_grouped_mm_masked(x, w_gate_up, masked_m, gate="silu")   # (G, M, I)

Expert g's valid row r (r < masked_m[g]) computes, in fp32 and rounded once,

    h = x[g, r] @ w[g] (+ bias[g]);  y[g, r] = act(h_gate) * h_up (* row_weight[g, r])

so an expert-parallel decode step (DeepEP's low-latency dispatch hands over this layout) runs
its gate-up GEMM and activation in one launch that reads and writes the valid rows only: an
activation pass over the whole capacity buffer (G x M x 2I) is gone. Gates and gate layouts
as fused_grouped_mm's. On the GPU the kernel is the MoE (varlen) kernel over x seen as
(G * M, K) with the counts as per-expert row counts (the kernel's row_counts); elsewhere torch.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_gemm.capability import cute_problem
from moe_gemm.config import GemmConfig
from moe_gemm.ops import api
from moe_gemm.ops.aliasing import overlaps_any
from moe_gemm.ops.autograd import inference_only
from moe_gemm.ops.fused_reference import gate_torch, split_gate_up
from moe_gemm.ops.fused_validation import FusedMmArgs, check_fused_mm, check_gate_names
from moe_gemm.ops.masked_launch import rows_mask
from moe_gemm.ops.masked_validation import (
    _check_x_rank,
    check_config_fits,
    check_expected_m,
    check_masked_m,
)
from moe_gemm.ops.signature import PlanCache
from moe_gemm.ops.support import PLAIN_TENSORS
from moe_gemm.ops.validation import (
    _check_writable_out,
    check_dense,
    offs_check_requested,
    shape_text,
)
from moe_gemm.ops.vmap import batched_values, per_entry, per_entry_into

_plans = PlanCache(per_bucket=8, buckets=128)  # buckets: (x.shape, options)


def _clear_plans() -> None:
    _plans.clear()


@dataclasses.dataclass(frozen=True)
class FusedMaskedArgs:
    flat: FusedMmArgs  # x as (G * M, K), row_weight as (G * M,), out as (G * M, N_out) or None
    masked_m: torch.Tensor  # (G,) int32
    expected_m: int
    G: int
    M: int
    out: torch.Tensor | None  # the caller's (G, M, N_out)

    @property
    def N_out(self) -> int:
        return self.flat.N_out


def fused_grouped_mm_masked(
    x: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    gate: str | None = None,
    gate_layout: str = "concat",
    gate_alpha: float = 1.702,
    gate_limit: float = 7.0,
    row_weight: torch.Tensor | None = None,
    expected_m: int | None = None,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """grouped_mm_masked with fused_grouped_mm's bias, gate and row weights in the kernel.

    Args:
        x: [G, M, K] bf16 / fp16 (fp32 on the torch backend): M rows of capacity per expert,
            the first masked_m[g] valid. A packed x (x[g] right after x[g - 1]) is read in
            place; any other layout is copied once.
        w: [G, K, N] expert weights (a gate-up weight with a gate), x's dtype and device.
        masked_m: [G] int32 valid row counts on x's device (0 <= masked_m[g] <= M).
        bias: [G, N] float, added per expert in w's column order; None: no bias.
        gate, gate_layout, gate_alpha, gate_limit: as fused_grouped_mm (the output is
            act(gate) * up, N / 2 columns).
        row_weight: [G, M] float: each valid row's result times its weight.
        expected_m: the typical valid rows per expert, for the kernel choice only; default M.
        out: optional [G, M, N or N / 2] tensor to write into.
        config: a GemmConfig; None = automatic (a pinned tail_split is refused).
        out_dtype: bf16, fp16 or fp32; default out's dtype where out is given, else x's
            dtype (as grouped_mm).

    Returns:
        [G, M, N] or, gated, [G, M, N / 2]. Rows at and past masked_m[g] are never written by
        the Hopper kernel: unspecified in a new output (zeros on the torch backend), kept in
        `out`.

    On CUDA the call never synchronizes with the host (CUDA-graph safe: replay with new
    counts); counts on the GPU are clamped into [0, M] by the kernel and not checked unless
    MOE_GEMM_CHECK_OFFS=1. Inference only on the Hopper kernel, like every moe_gemm kernel.

    Raises:
        TypeError, ValueError: arguments that do not fit (the message names the expectation).
        RuntimeError: backend="cute" forced where the Hopper kernels cannot run.
    """
    if api._traced():
        from moe_gemm.ops import masked_custom_ops

        return masked_custom_ops.fused_grouped_mm_masked(
            x, w, masked_m, bias=bias, gate=gate, gate_layout=gate_layout,
            gate_alpha=gate_alpha, gate_limit=gate_limit, row_weight=row_weight,
            expected_m=expected_m, out=out, config=config, out_dtype=out_dtype)
    return fused_grouped_mm_masked_eager(x, w, masked_m, bias, gate, gate_layout, gate_alpha,
                                         gate_limit, row_weight, expected_m, out, config,
                                         out_dtype)


def fused_grouped_mm_masked_eager(x, w, masked_m, bias, gate, gate_layout, gate_alpha,
                                  gate_limit, row_weight, expected_m, out, config,
                                  out_dtype) -> torch.Tensor:
    """fused_grouped_mm_masked without the tracing check (the registered op's body)."""
    tensors = (x, w, masked_m, bias, row_weight, out)
    present = tuple(t for t in tensors if t is not None)
    options = (gate, gate_layout, gate_alpha, gate_limit, expected_m, bias is None,
               row_weight is None, out is None)
    if type(x) in PLAIN_TENSORS and (config is None or type(config) is GemmConfig) and (
            out is None or (type(out) in PLAIN_TENSORS and not overlaps_any(
                out, tuple(t for t in tensors[:5] if t is not None)))):
        try:
            entry = _plans.find((x.shape, options), (config, out_dtype, api._switches()),
                                present)
        except TypeError:  # (unhashable options: the checks below name what was expected)
            entry = None
        except RuntimeError:  # (a nested x has no sizes: likewise)
            entry = None
        # (the kernel's TMA needs 16-byte aligned operands: a same-strided view one element
        # off goes the detailed way, which picks the torch backend for it)
        if entry is not None and not (x.data_ptr() | w.data_ptr() | (
                0 if out is None else out.data_ptr())) & 15:
            run, link = entry
            if link and torch.is_grad_enabled():
                return inference_only(api.NO_BACKWARD,
                                      lambda: run(x, w, masked_m, bias, row_weight, out),
                                      [t for t in (x, w, bias, row_weight) if t is not None])
            return run(x, w, masked_m, bias, row_weight, out)
    cfg = api._check_config(config, "fused_grouped_mm_masked")
    if api._symbolic(*present):
        from moe_gemm.ops import masked_custom_ops

        return masked_custom_ops.fused_grouped_mm_masked(
            x, w, masked_m, bias=bias, gate=gate, gate_layout=gate_layout,
            gate_alpha=gate_alpha, gate_limit=gate_limit, row_weight=row_weight,
            expected_m=expected_m, out=out, config=config, out_dtype=out_dtype)
    if batched_values(masked_m):  # (vmap with grad: ops/vmap.py)
        from moe_gemm.ops.masked_custom_ops import write_valid_rows

        return per_entry_into(out, out_dtype, lambda dt: per_entry(
            lambda x, w, masked_m, bias, row_weight: fused_grouped_mm_masked_eager(
                x, w, masked_m, bias, gate, gate_layout, gate_alpha, gate_limit, row_weight,
                expected_m, None, config, dt), x, w, masked_m, bias, row_weight),
            lambda out, y: write_valid_rows(out, y, masked_m))
    args = check_fused_masked(x, w, masked_m, bias=bias, gate=gate, gate_layout=gate_layout,
                              gate_alpha=gate_alpha, gate_limit=gate_limit,
                              row_weight=row_weight, expected_m=expected_m, out=out,
                              out_dtype=out_dtype)
    check_config_fits(cfg)
    if out is not None and overlaps_any(out, tuple(t for t in tensors[:5] if t is not None)):
        # Computed into a copy of out (rows past the counts keep their values), then copied.
        y = fused_grouped_mm_masked_eager(x, w, masked_m, bias, gate, gate_layout, gate_alpha,
                                          gate_limit, row_weight, expected_m, out.clone(),
                                          config, out_dtype)
        return out.copy_(y)
    problem = cute_problem(args.flat.x.device) if cfg.backend != "torch" else "torch requested"
    unsupported = None
    if problem is None:
        from moe_gemm.ops.fused_launch import fused_unsupported

        unsupported = fused_unsupported(args.flat)
    grads = [t for t in (x, w, bias, row_weight) if t is not None]
    if args.flat.K == 0 and args.flat.S:
        # No operand to load (the kernel's TMA descriptors cannot have an empty K extent):
        # the torch backend adds the bias, gates and weights the empty sums.
        return fused_masked_torch(args, x)
    if not api._use_cute(cfg, problem, unsupported, "fused_grouped_mm_masked"):
        return fused_masked_torch(args, x)
    from moe_gemm.ops.fused_launch import FusedPlan

    plan = FusedPlan(args.flat, cfg, expected_m=args.expected_m)
    run = _runner(plan, args)
    if plan.cacheable and all(type(t) in PLAIN_TENSORS for t in present) and api._cacheable(
            api._switches()) and not offs_check_requested():
        _plans.add((x.shape, options), (config, out_dtype, api._switches()), present,
                   (run, any(t.requires_grad for t in grads)), out=out)
    return inference_only(api.NO_BACKWARD, lambda: run(x, w, masked_m, bias, row_weight, out),
                          grads)


def _runner(plan, args: FusedMaskedArgs):
    """The launch of a call with this signature: flatten the operands (views where the
    layout allows, as it was when the plan was built), launch, and put the rows in the
    caller's out if they could not be written there directly."""
    G, M, N_out = args.G, args.M, args.N_out
    direct_out = args.out is None or args.flat.out is not None
    masked_m_contiguous = args.masked_m.is_contiguous()

    def run(x, w, masked_m, bias, row_weight, out):
        x2 = x.reshape(G * M, x.shape[2])
        rw = None if row_weight is None else row_weight.reshape(G * M)
        mm = masked_m if masked_m_contiguous else masked_m.contiguous()
        if direct_out:
            out2 = None if out is None else out.view(G * M, N_out)
            y = plan.launch(x2, w, mm, None, rw, bias, out2)
            return out if out is not None else y.view(G, M, N_out)
        y = plan.launch(x2, w, mm, None, rw, bias, None).view(G, M, N_out)
        return out.copy_(torch.where(rows_mask(mm, M), y, out))

    return run


def check_fused_masked(x, w, masked_m, *, bias=None, gate=None, gate_layout="concat",
                       gate_alpha=1.702, gate_limit=7.0, row_weight=None, expected_m=None,
                       out=None, out_dtype=None, concrete: bool = True) -> FusedMaskedArgs:
    """The masked layout's own checks (ranks, counts, row weights, out), then
    fused_grouped_mm's on the flattened views (dtypes, bias, gate and its layout)."""
    for name, t, hint in (("x", x, "(G, M, K)"), ("w", w, "(G, K, N)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {hint}; got {type(t).__name__}")
    for name, t in (("x", x), ("w", w), ("row_weight", row_weight), ("bias", bias),
                    ("out", out)):
        check_dense(name, t)  # (before the reshapes below, which those layouts lack)
    _check_x_rank(x)
    if w.dim() != 3:
        raise ValueError(f"w must be 3-D (G, K, N) (for a (G, N, K) weight pass "
                         f"w.transpose(1, 2)); got shape {shape_text(w)}")
    G, M, K = x.shape
    if w.shape[0] != G or w.shape[1] != K:
        raise ValueError(f"x is (G, M, K) = {shape_text(x)}, so w must be ({G}, {K}, N); got "
                         f"{shape_text(w)}")
    mm = check_masked_m(masked_m, G, M, x.device, concrete=concrete)
    rw = None
    if row_weight is not None:
        if not isinstance(row_weight, torch.Tensor):
            raise TypeError(f"row_weight must be a torch.Tensor ({G}, {M}) or None; got "
                            f"{type(row_weight).__name__}")
        if tuple(row_weight.shape) != (G, M):
            raise ValueError(f"row_weight must be (G, M) = ({G}, {M}): one weight per row; got "
                             f"{shape_text(row_weight)}")
        rw = row_weight.reshape(G * M)
    if bias is not None:
        # (in this op's words: the flattened checks below name the groups E, as grouped_mm's)
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor (G, N) or None; got "
                            f"{type(bias).__name__}")
        if tuple(bias.shape) != (G, w.shape[2]):
            raise ValueError(f"bias must be (G, N) = ({G}, {w.shape[2]}), in w's column order; "
                             f"got {shape_text(bias)}")
    # (before out's shape, which depends on it: a gate that is no gate must be named as such)
    gate_name = check_gate_names(gate, gate_layout)
    flat_out = None
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor (G, M, N_out); got "
                            f"{type(out).__name__}")
        n_out = w.shape[2] if gate_name is None else w.shape[2] // 2
        if tuple(out.shape) != (G, M, n_out):
            raise ValueError(f"out must be (G, M, N{'' if gate_name is None else ' / 2'}) = "
                             f"({G}, {M}, {n_out}); got {shape_text(out)}")
        _check_writable_out("out", out)
        try:
            flat_out = out.view(G * M, out.shape[2])
        except (RuntimeError, ValueError):  # (fake tensors raise ValueError)
            # not one row stride over the problems: written after the launch
            flat_out = None
    flat = check_fused_mm(x.reshape(G * M, K), w, mm, row_weight=rw, bias=bias, gate=gate,
                          gate_layout=gate_layout, gate_alpha=gate_alpha,
                          gate_limit=gate_limit,
                          out=flat_out if flat_out is not None else
                          (None if out is None else out.reshape(G * M, out.shape[2])),
                          out_dtype=out_dtype, concrete=False)
    if out is not None and flat_out is None:
        flat = dataclasses.replace(flat, out=None)
    return FusedMaskedArgs(flat, mm, check_expected_m(expected_m, M), G, M, out)


def fused_masked_torch(args: FusedMaskedArgs, x: torch.Tensor) -> torch.Tensor:
    """The torch backend: every row through the fused epilogue in fp32 (rows past the counts
    zeroed first, so what they hold reaches neither the result nor a gradient), then kept on
    the valid rows (zeros past them in a new output; `out`'s own values there)."""
    f = args.flat
    G, M = args.G, args.M
    valid = rows_mask(args.masked_m, M)
    h = torch.bmm(x.masked_fill(~valid, 0).float(), f.w.float())
    if f.bias is not None:
        h = h + f.bias.float()[:, None, :]
    if f.gate is not None:
        g, u = split_gate_up(h.reshape(G * M, f.N), f.gate_layout)
        h = gate_torch(f.gate, g, u, f.gate_alpha, f.gate_limit).reshape(G, M, f.N_out)
    if f.row_weight is not None:
        # (weights past the counts are not read: a NaN there reaches no gradient)
        h = h * torch.where(valid, f.row_weight.float().reshape(G, M, 1), 1.0)
    y = h.masked_fill(~valid, 0)
    if args.out is None:
        return y.to(f.out_dtype)
    return args.out.copy_(torch.where(valid, y.to(args.out.dtype), args.out))
