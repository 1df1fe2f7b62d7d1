"""The torch-facing API: grouped_gemm and grouped_mm.

Each op validates its arguments (messages name the expected shape and dtype), picks a backend
(`cute` on an sm90a GPU with the CuTe DSL, `torch` elsewhere), and runs. Kernel-specific layout
limits (16-byte aligned rows for TMA, bf16/fp16 inputs) are checked before any compile: with
backend="auto" an input the kernel cannot take falls back to the torch backend with a one-time
warning; with backend="cute" it raises ValueError.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Sequence

import torch

from moe_gemm.capability import cute_problem
from moe_gemm.config import DEFAULT_CONFIG, GemmConfig
from moe_gemm.env import env_get
from moe_gemm.ops.aliasing import overlaps_any
from moe_gemm.ops.autograd import inference_only
from moe_gemm.ops.heuristics import TAIL_SPLIT_ENV
from moe_gemm.ops.reference import grouped_bmm_torch, grouped_gemm_torch, grouped_mm_torch
from moe_gemm.ops.support import (
    analyze_general,
    fast_general,
    grouped_bmm_unsupported,
    grouped_mm_unsupported,
)
from moe_gemm.ops.validation import check_grouped_bmm, check_grouped_gemm, check_grouped_mm

_warned: set[str] = set()
_REQUIRES_GRAD = operator.attrgetter("requires_grad")

NO_BACKWARD = (
    "moe_gemm's Hopper (cute) kernels are inference-only: they have no backward. Run under "
    "torch.no_grad() / torch.inference_mode(), or pass GemmConfig(backend='torch') for the "
    "differentiable torch path."
)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _check_config(config: object) -> GemmConfig:
    if config is None:
        return DEFAULT_CONFIG
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a moe_gemm.GemmConfig or None; got {type(config).__name__}")
    return config


def _use_cute(config: GemmConfig, problem: str | None, unsupported: str | None, op: str) -> bool:
    """problem: why the cute backend cannot run here (capability.cute_problem), or None."""
    if config.backend == "torch":
        return False
    if config.backend == "cute":
        if problem is not None:
            raise RuntimeError(f"backend='cute' cannot run here: {problem}")
        if unsupported is not None:
            raise ValueError(f"backend='cute' cannot take this input: {unsupported}")
        return True
    if problem is not None:
        return False
    if unsupported is not None:
        _warn_once(f"moe_gemm.{op}: using the torch backend because {unsupported}")
        return False
    return True


def grouped_gemm(
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    *,
    out: Sequence[torch.Tensor] | None = None,
    config: GemmConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Many independent GEMMs in one launch: D_i = A_i @ B_i.

    Args:
        a: G tensors, a[i] of shape [M_i, K_i], all bf16, fp16 or fp32 on one device.
        b: G tensors, b[i] of shape [K_i, N_i], same dtype and device; any layout with one
            unit stride (row-major, or `w.T` of an [N_i, K_i] weight).
        out: optional G tensors [M_i, N_i] to write into (their dtype sets the output dtype).
        config: a GemmConfig; None = choose everything automatically.
        out_dtype: output dtype (bf16, fp16 or fp32); default the input dtype.

    Any M_i, N_i, K_i >= 0 is valid: an M_i = 0 problem yields an empty [0, N_i] result and
    costs nothing; K_i = 0 yields zeros. Accumulation is fp32.

    Returns:
        The G results D_i [M_i, N_i] (the `out` tensors when given).

    Raises:
        TypeError: a non-tensor, a single tensor instead of a sequence, or an unsupported or
            mixed dtype.
        ValueError: counts, ranks, inner dimensions, devices or `out` shapes that do not fit.
        RuntimeError: backend="cute" forced where the Hopper kernels cannot run.
    """
    if out is None and (config is None or (type(config) is GemmConfig
                                           and config.backend != "torch")):
        # The common case, checked and analysed in one pass (ops/support.fast_general); anything
        # else takes the detailed path below, which raises or falls back with the exact reason.
        fast = fast_general(a, b, out_dtype)
        if fast is not None and cute_problem(fast[0].device) is None:
            from moe_gemm.ops.launch import grouped_gemm_cute

            args, lay = fast
            run = lambda: grouped_gemm_cute(args, config or DEFAULT_CONFIG, layout=lay)  # noqa: E731
            if torch.is_grad_enabled() and (any(map(_REQUIRES_GRAD, args.a))
                                            or any(map(_REQUIRES_GRAD, args.b))):
                return inference_only(NO_BACKWARD, run, [*args.a, *args.b])
            return run()
    cfg = _check_config(config)
    args = check_grouped_gemm(a, b, out, out_dtype)
    if not args.a:
        return []
    if args.out_aliased:
        # Outputs sharing memory with an operand: computed into fresh tensors, then copied.
        given = args.out
        tmp = list(given)
        for i in args.out_aliased:
            tmp[i] = torch.empty_like(given[i])
        res = grouped_gemm(args.a, args.b, out=tmp, config=cfg, out_dtype=args.out_dtype)
        for i in args.out_aliased:
            given[i].copy_(res[i])
        return [given[i] if i in args.out_aliased else r for i, r in enumerate(res)]
    problem = cute_problem(args.device) if cfg.backend != "torch" else "torch requested"
    layout = analyze_general(args) if problem is None else None
    unsupported = layout if isinstance(layout, str) else None
    if _use_cute(cfg, problem, unsupported, "grouped_gemm"):
        from moe_gemm.ops.launch import grouped_gemm_cute

        run = lambda: grouped_gemm_cute(args, cfg, layout=layout)  # type: ignore[arg-type]  # noqa: E731
        return inference_only(NO_BACKWARD, run, [*args.a, *args.b])
    return grouped_gemm_torch(args)


def grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The MoE expert GEMM and the batched GEMM: torch.nn.functional.grouped_mm's 2D x 3D
    form (with offs) and its 3D x 3D form (offs=None).

    With offs: rows offs[e-1]:offs[e] of x (offs[-1] taken as 0) are multiplied by w[e].
    Without: y[g] = x[g] @ w[g] for every g (torch.bmm's semantics, fp32 accumulation); on
    the GPU this is one launch whose host cost does not grow with G.

    Args:
        x: [T, K] tokens sorted by expert, or [G, M, K] (batched); bf16, fp16 or fp32.
        w: [E, K, N] expert weights (or [G, K, N]), same dtype and device; any layout with one
            unit stride in the last two dims, e.g. `w_t.transpose(1, 2)` of an [E, N, K]
            weight.
        offs: [E] int32 cumulative end rows, on x's device; non-decreasing, offs[-1] <= T.
            Experts with no rows are normal. None (the default) selects the batched form.
        out: optional [T, N] ([G, M, N] batched) tensor to write into; with offs, rows >=
            offs[-1] are left untouched.
        config: a GemmConfig; None = automatic. (The batched form finds tiles by division:
            visitor and sort_by_k have no effect on it.)
        out_dtype: output dtype (bf16, fp16 or fp32); default x's dtype.

    Returns:
        y [T, N] (when `out` is None, rows >= offs[-1] are zero), or [G, M, N] batched.

    On a CUDA device the call never synchronizes with the host (it can be captured in a CUDA
    graph and replayed with new offs), so offs values on the GPU are not checked unless
    MOE_GEMM_CHECK_OFFS=1 is set; the kernel clamps them into [0, T] and treats a decreasing
    entry as an empty expert, so bad values can give wrong rows but never write out of bounds.
    offs on the CPU are always checked.

    Raises:
        TypeError: non-tensors, unsupported or mismatched dtypes, offs not int32.
        ValueError: ranks, K mismatch, offs length or values, devices or `out` shape.
        RuntimeError: backend="cute" forced where the Hopper kernels cannot run.
    """
    if out is not None and _out_shares_memory(out, x, w, offs):
        # Computed into a copy of out (rows past offs[-1] keep their values), then copied.
        _check_config(config)
        if offs is None:
            check_grouped_bmm(x, w, out, out_dtype)
        else:
            check_grouped_mm(x, w, offs, out, out_dtype)
        y = grouped_mm(x, w, offs, out=out.clone(), config=config, out_dtype=out_dtype)
        return out.copy_(y)
    if offs is None:
        return _grouped_bmm(x, w, out, config, out_dtype)
    key = _mm_plan_key(x, w, offs, out, config, out_dtype)
    plan = _mm_plans.get(key) if key is not None else None
    if plan is not None:
        if (x.requires_grad or w.requires_grad) and torch.is_grad_enabled():
            return inference_only(NO_BACKWARD, lambda: plan(x, w, offs, out), [x, w])
        return plan(x, w, offs, out)
    cfg = _check_config(config)
    args = check_grouped_mm(x, w, offs, out, out_dtype)
    problem = cute_problem(args.x.device) if cfg.backend != "torch" else "torch requested"
    unsupported = grouped_mm_unsupported(args, cfg) if problem is None else None
    if _use_cute(cfg, problem, unsupported, "grouped_mm"):
        from moe_gemm.ops.launch import MmPlan

        plan = MmPlan(args, cfg)
        if key is not None and args.offs.is_contiguous():
            if len(_mm_plans) >= _MAX_PLANS:
                _mm_plans.clear()
            _mm_plans[key] = plan
        offs_c = args.offs if args.offs.is_contiguous() else args.offs.contiguous()
        return inference_only(NO_BACKWARD, lambda: plan(args.x, args.w, offs_c, args.out),
                              [args.x, args.w])
    return grouped_mm_torch(args)


def _out_shares_memory(out, *inputs) -> bool:
    if type(out) not in _PLAIN or torch.compiler.is_compiling():
        return False  # validation names a non-tensor; under tracing there is no memory
    return overlaps_any(out, inputs)


def _grouped_bmm(x, w, out, config, out_dtype) -> torch.Tensor:
    key = _bmm_plan_key(x, w, out, config, out_dtype)
    plan = _mm_plans.get(key) if key is not None else None
    if plan is not None:
        if (x.requires_grad or w.requires_grad) and torch.is_grad_enabled():
            return inference_only(NO_BACKWARD, lambda: plan(x, w, out), [x, w])
        return plan(x, w, out)
    cfg = _check_config(config)
    args = check_grouped_bmm(x, w, out, out_dtype)
    problem = cute_problem(args.x.device) if cfg.backend != "torch" else "torch requested"
    unsupported = grouped_bmm_unsupported(args, cfg) if problem is None else None
    if _use_cute(cfg, problem, unsupported, "grouped_mm"):
        from moe_gemm.ops.launch import BmmPlan

        plan = BmmPlan(args, cfg)
        if key is not None:
            if len(_mm_plans) >= _MAX_PLANS:
                _mm_plans.clear()
            _mm_plans[key] = plan
        return inference_only(NO_BACKWARD, lambda: plan(args.x, args.w, args.out),
                              [args.x, args.w])
    return grouped_bmm_torch(args)


# grouped_mm launch plans of validated cute calls, keyed by everything validation and the
# kernel choice depend on (shapes, strides, dtypes, devices, 16-byte alignment, config): a
# repeated call skips validation and heuristics. offs values are never part of it (on the GPU
# they are not read on the host at all).
_mm_plans: dict[tuple, object] = {}
_MAX_PLANS = 256


# Plain tensors: a subclass (FakeTensor, DTensor, ...) may not own plain memory.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _mm_plan_key(x, w, offs, out, config, out_dtype) -> tuple | None:
    if type(x) not in _PLAIN or type(w) not in _PLAIN or type(offs) not in _PLAIN or (
            not x.is_cuda or x.is_neg() or w.is_neg()):
        return None
    if out is not None and type(out) not in _PLAIN:
        return None
    if config is not None and type(config) is not GemmConfig:
        return None  # the slow path says what is wrong with it
    if env_get("MOE_GEMM_CHECK_OFFS") or env_get("MOE_GEMM_DISABLE_CUTE"):
        return None
    # Switches the kernel choice reads: a change makes a new plan.
    hints = (env_get("MOE_GEMM_L2_HINTS"), env_get(TAIL_SPLIT_ENV))
    ptrs = x.data_ptr() | w.data_ptr()
    out_key = None
    if out is not None:
        out_key = (out.shape, out.stride(), out.dtype, out.device, out.requires_grad)
        ptrs |= out.data_ptr()
    return (x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device,
            offs.shape, offs.stride(), offs.dtype, offs.device, out_key, out_dtype, config,
            ptrs & 15, hints)


def _bmm_plan_key(x, w, out, config, out_dtype) -> tuple | None:
    if type(x) not in _PLAIN or type(w) not in _PLAIN or not x.is_cuda or (
            x.is_neg() or w.is_neg()):
        return None
    if out is not None and type(out) not in _PLAIN:
        return None
    if config is not None and type(config) is not GemmConfig:
        return None
    if env_get("MOE_GEMM_DISABLE_CUTE"):
        return None
    ptrs = x.data_ptr() | w.data_ptr()
    out_key = None
    if out is not None:
        out_key = (out.shape, out.stride(), out.dtype, out.device, out.requires_grad)
        ptrs |= out.data_ptr()
    return ("bmm", x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype,
            w.device, out_key, out_dtype, config, ptrs & 15, env_get("MOE_GEMM_L2_HINTS"))


class GroupedGemmPlan:
    """grouped_gemm prepared once for a fixed set of tensors, for loops that call it again and
    again on new values (serving with static buffers, benchmarks, CUDA graphs).

    The constructor does all the per-problem host work of grouped_gemm (checks, layout
    analysis, kernel choice, output allocation, metadata upload); each call only launches the
    kernel, so its host cost does not grow with the number of problems. A call computes
    D_i = A_i @ B_i from the tensors' values at that moment (update them in place, e.g. with
    `copy_`), writes into `out` and returns it. Do not resize the tensors or change their
    storage after building the plan; build a new plan instead.

    Args: as grouped_gemm (a, b, out, config, out_dtype). `out`, when None, is allocated once
    and reused by every call: copy results you want to keep before the next call.
    """

    def __init__(
        self,
        a: Sequence[torch.Tensor],
        b: Sequence[torch.Tensor],
        *,
        out: Sequence[torch.Tensor] | None = None,
        config: GemmConfig | None = None,
        out_dtype: torch.dtype | None = None,
    ):
        cfg = _check_config(config)
        args = check_grouped_gemm(a, b, out, out_dtype)
        if args.out is None:  # allocated once: every call writes the same tensors
            args = dataclasses.replace(args, out=[
                torch.empty(m, n, dtype=args.out_dtype, device=args.device)
                for m, n, _ in args.sizes])
        self.out: list[torch.Tensor] = list(args.out or [])
        # Outputs sharing memory with an operand: the plan writes private tensors and each
        # call copies them into the given ones (moe_gemm/aliasing.py).
        self._copy_back = [(self.out[i], torch.empty_like(self.out[i]))
                           for i in args.out_aliased]
        if self._copy_back:
            private = list(self.out)
            for i, (_, tmp) in zip(args.out_aliased, self._copy_back):
                private[i] = tmp
            args = dataclasses.replace(args, out=private, out_aliased=())
        self.args = args
        self._launch = None
        self.backend = "torch"
        if not args.a:
            return
        problem = cute_problem(args.device) if cfg.backend != "torch" else "torch requested"
        layout = analyze_general(args) if problem is None else None
        unsupported = layout if isinstance(layout, str) else None
        if _use_cute(cfg, problem, unsupported, "GroupedGemmPlan"):
            from moe_gemm.ops.launch import GeneralLaunch

            self._launch = GeneralLaunch(args, cfg, layout=layout, persistent=True)  # type: ignore[arg-type]
        self.backend = "cute" if self._launch is not None else "torch"

    def __call__(self) -> list[torch.Tensor]:
        args = self.args
        if not args.a:
            return []
        if self._launch is None:  # the torch backend: differentiable like grouped_gemm's
            res = grouped_gemm_torch(args)
        elif torch.is_grad_enabled():
            res = inference_only(NO_BACKWARD, self._launch.launch, [*args.a, *args.b])
        else:
            res = self._launch.launch()
        if not self._copy_back:
            return res
        for given, tmp in self._copy_back:
            given.copy_(tmp)
        return list(self.out)
