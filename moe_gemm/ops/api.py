"""The torch-facing API: grouped_gemm, grouped_mm and GroupedGemmPlan.

Each op validates its arguments (messages name the expected shape and dtype), picks a backend
(`cute` on an sm90a GPU with the CuTe DSL, `torch` elsewhere), and runs. Kernel-specific layout
limits (16-byte aligned rows for TMA, bf16/fp16 inputs) are checked before any compile: with
backend="auto" an input the kernel cannot take falls back to the torch backend with a one-time
warning; with backend="cute" it raises ValueError.

Three ways through an op, cheapest first:
- a repeated call: its tensors match a cached plan's signature (ops/signature.py: types,
  dtypes, devices, sizes, strides, autograd flags) and its config and switches are the plan's,
  so it reads its data pointers and launches (on the CPU-only dev machine, the kernel call
  aside: grouped_mm ~3.7 us, grouped_gemm over 256 problems ~0.6 us per problem, most of it
  the 256 output views, then the signature check and the address read);
- grouped_gemm's scan (ops/support.scan_general): the common case checked and analysed in one
  pass, then the plan of that layout;
- the detailed path: validation that names what is wrong, the backend choice and its one-time
  warnings, outputs that share memory with an operand.
Under torch.compile, make_fx or a fake/functional tensor mode the ops go through their
torch.library registrations instead (ops/custom_ops.py); eager calls never pay that dispatch.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import sys
import warnings
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from moe_gemm.capability import cute_problem
from moe_gemm.config import DEFAULT_CONFIG, GemmConfig
from moe_gemm.env import env_parse, env_reader, env_value
from moe_gemm.ops import custom_ops, tuned
from moe_gemm.ops.aliasing import overlaps_any
from moe_gemm.ops.autograd import inference_only
from moe_gemm.ops.heuristics import (
    FAST_GATE_ENV,
    GATHER_FENCE_ENV,
    GATHER_WIDE_ENV,
    PACKED_PAIRS_ENV,
    PEEK_WAIT_ENV,
    SPLIT_WAYS_ENV,
    SWAP_AB_ENV,
    TAIL_SPLIT_ENV,
    TRIM_A_ENV,
)
from moe_gemm.ops.heuristics_fp8 import (
    HALF_SKIP_ENV,
    PEEK_WAIT_FP8_ENV,
    PROMOTE_LAG_ENV,
    SCALE_AHEAD_ENV,
    SMEM_SCALES_ENV,
)
from moe_gemm.ops.reference import grouped_bmm_torch, grouped_gemm_torch, grouped_mm_torch
from moe_gemm.ops.signature import PlanCache, TensorSignature
from moe_gemm.ops.support import (
    PLAIN_TENSORS,
    analyze_general,
    grouped_bmm_unsupported,
    grouped_mm_unsupported,
    scan_general,
)
from moe_gemm.ops.validation import (
    check_grouped_bmm,
    check_grouped_gemm,
    check_grouped_mm,
    check_out_not_inference,
    check_out_untracked,
    offs_check_requested,
)
from moe_gemm.ops.vmap import (
    batched_values,
    check_out_batched,
    in_vmap,
    per_entry,
    per_entry_into,
    vmap_active,
)

_warned: set[str] = set()
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_PTR = torch.Tensor.data_ptr
_SEQUENCES = (list, tuple)
_PLAIN_SET = frozenset(PLAIN_TENSORS)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_transform_depth = torch._C._functorch.get_dynamic_layer_stack_depth

NO_BACKWARD = (
    "moe_gemm's Hopper (cute) kernels are inference-only: they have no backward. Run under "
    "torch.no_grad() / torch.inference_mode(), or pass GemmConfig(backend='torch') for the "
    "differentiable torch path."
)

# Cached plans, found by their tensors' signatures (ops/signature.py). Entries are
# (plan, link, out_requires_grad): link says an input required grad when the signature was
# taken (the signature includes the flags, so it still does).
_mm_plans = PlanCache(per_bucket=8, buckets=256)  # buckets: (form, x.shape)
_general_plans = PlanCache(per_bucket=4, buckets=64)  # buckets: the problem count
# A grouped_gemm layout gets a signature when grouped_gemm's scan meets it again within this
# many scans (a layout that recurs), at most MAX_SIGNATURES times (other tensor modes).
RECENT_SCANS = 16
MAX_SIGNATURES = 4
_scans = 0

# Switches a cached plan depends on: a change makes the next call miss its plan. (The tuned
# tables' switches too, every one the lookup reads: the heuristics key their own caches on
# them, tuned.state.)
_PLAN_SWITCHES = ("MOE_GEMM_DISABLE_CUTE", "MOE_GEMM_CHECK_OFFS", "MOE_GEMM_L2_HINTS",
                  TAIL_SPLIT_ENV, SPLIT_WAYS_ENV, TRIM_A_ENV, PACKED_PAIRS_ENV, PEEK_WAIT_ENV,
                  PROMOTE_LAG_ENV,
                  SCALE_AHEAD_ENV, SMEM_SCALES_ENV, PEEK_WAIT_FP8_ENV, HALF_SKIP_ENV,
                  GATHER_WIDE_ENV, GATHER_FENCE_ENV,
                  FAST_GATE_ENV, SWAP_AB_ENV, *tuned.SWITCHES)


_switches = env_reader(_PLAN_SWITCHES)  # () -> their values, read at every call


def _cacheable(switches: tuple) -> bool:
    """Plans made while cute is disabled or offs values are checked per call are not kept."""
    return not (env_parse(_PLAN_SWITCHES[0], switches[0])
                or env_parse(_PLAN_SWITCHES[1], switches[1]))


def _traced() -> bool:
    """Whether this call is being traced or run by a tensor mode (torch.compile, make_fx,
    FakeTensorMode, FlopCounterMode...) or torch.vmap: then it goes through the registered
    torch.library op, which the tracer records and the modes see, and whose vmap rule runs
    each batch entry on plain tensors (ops/vmap.py; eager code cannot take a BatchedTensor)."""
    return torch.compiler.is_compiling() or _dispatch_modes() > 0 or (
        _transform_depth() > 0 and in_vmap())  # (one C call when no transform runs)


def _symbolic(*tensors: object) -> bool:
    """Tensors without memory of their own (fake, meta, or functionalized as by torch.func):
    they go through the registered op (its fake implementation, which also serves the meta
    device, or the functionalized call)."""
    if set(map(type, tensors)) <= _PLAIN_SET:  # (one C call each: this sees every operand)
        # Meta: the first operand decides (a meta operand beside real ones is a device
        # mismatch, which validation names); a per-operand check would cost ~80 us on 256
        # problems' 512 tensors.
        return (bool(tensors) and tensors[0].is_meta) or any(
            map(torch._is_functional_tensor, tensors))
    return any(isinstance(t, torch.Tensor) and (t.is_meta or is_fake(t)
                                                or torch._is_functional_tensor(t))
               for t in tensors)


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=_caller_level())


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _caller_level() -> int:
    """warnings.warn's stacklevel of the first frame outside moe_gemm (the user's call)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _check_config(config: object, swap_refused: str | None = None) -> GemmConfig:
    """config as a GemmConfig (None: the default); swap_refused names the operation when it
    cannot run swapped tiles (a ValueError for swap_ab=True, on every backend alike)."""
    if config is None:
        return DEFAULT_CONFIG
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a moe_gemm.GemmConfig or None; got {type(config).__name__}")
    if swap_refused is not None and config.swap_ab:
        raise ValueError(f"swap_ab=True is built for grouped_mm's 2-D x 3-D (MoE) form and "
                         f"fused_grouped_mm without a gate or over concat gate-up weights; "
                         f"{swap_refused} does not take it")
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


def grouped_mm_runs_torch(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None,
                          config: GemmConfig | None, out_dtype: torch.dtype | None) -> bool:
    """Whether grouped_mm(x, w, offs) with this config takes torch's path here rather than the
    kernels (the registered op's backward asks: its gradients exist on that path only)."""
    cfg = _check_config(config)
    if cfg.backend == "torch" or cute_problem(x.device) is not None:
        return True
    if offs is None:
        return grouped_bmm_unsupported(check_grouped_bmm(x, w, None, out_dtype), cfg) is not None
    return grouped_mm_unsupported(check_grouped_mm(x, w, offs, None, out_dtype), cfg) is not None


def grouped_gemm_runs_torch(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
                            config: GemmConfig | None, out_dtype: torch.dtype | None) -> bool:
    """grouped_mm_runs_torch for grouped_gemm(a, b)."""
    cfg = _check_config(config)
    if not a or cfg.backend == "torch" or cute_problem(a[0].device) is not None:
        return True
    return isinstance(analyze_general(check_grouped_gemm(a, b, None, out_dtype)), str)


def cached_mm_plan(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None = None, *,
                   config: GemmConfig | None = None, out_dtype: torch.dtype | None = None
                   ) -> object | None:
    """The launch plan (MmPlan / BmmPlan) a grouped_mm call with these arguments would take
    now, or None: for scripts that time a call's parts."""
    bucket = ("bmm", x.shape) if offs is None else ("mm", x.shape)
    entry = _mm_plans.find(bucket, (config, out_dtype, _switches()),
                           (x, w) if offs is None else (x, w, offs))
    return None if entry is None else entry[0]


def _clear_plans() -> None:
    """Forget every cached plan (tests that fake the launch module)."""
    _mm_plans.clear()
    _general_plans.clear()


# ---------------------------------------------------------------------------------------------
# grouped_gemm


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
        out_dtype: output dtype (bf16, fp16 or fp32); default out's dtype where out is given,
            else the input dtype (an out of another dtype than out_dtype: TypeError).

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
    if _traced():
        return custom_ops.grouped_gemm(a, b, out=out, config=config, out_dtype=out_dtype)
    return grouped_gemm_eager(a, b, out, config, out_dtype)


def grouped_gemm_eager(a, b, out, config, out_dtype) -> list[torch.Tensor]:
    """grouped_gemm without the tracing check (the registered op's implementation)."""
    if out is None and (config is None or (type(config) is GemmConfig
                                           and config.backend != "torch")) and (
            type(a) in _SEQUENCES and type(b) in _SEQUENCES and len(a) == len(b) and a):
        switches = _switches()
        extra = (config, out_dtype, switches)
        ab = (*a, *b)  # (built once: the signature check and the address read both take it)
        entry = _general_plans.find(len(a), extra, ab)
        if entry is not None:
            plan, link, _ = entry
            if not (link and torch.is_grad_enabled()):
                res = plan.launch_operands(ab)
                if res is not None:
                    return res
            elif (ptrs := plan.pointers(a, b)) is not None:
                return inference_only(NO_BACKWARD, lambda: plan.launch_pointers(ptrs), ab)
        res = _scanned_grouped_gemm(a, b, config, out_dtype, extra)
        if res is not None:
            return res
    return _detailed_grouped_gemm(a, b, out, config, out_dtype)


def _scanned_grouped_gemm(a, b, config, out_dtype, extra) -> list[torch.Tensor] | None:
    """The common case through scan_general and the plan of its layout (None: not the
    common case, or not on the cute backend)."""
    a0 = a[0]
    if type(a0) not in PLAIN_TENSORS or cute_problem(a0.device) is not None:
        return None
    scan = scan_general(a, b, out_dtype)
    if scan is None:
        return None
    from moe_gemm.ops import general_launch, launch_kernel, launch_resources

    cfg = config or DEFAULT_CONFIG
    shape = general_launch.general_shape(
        scan.sizes, scan.dtype, scan.out_dtype, scan.b_major, cfg,
        launch_kernel.sm_count(scan.device), False, scan.device)
    if launch_resources._fresh():
        plan = general_launch.GeneralPlan(shape, scan.device, scan.a_ld, scan.b_ld)
    else:
        plan = general_launch.general_plan(shape, scan.device, scan.a_ld, scan.b_ld)
        global _scans
        _scans += 1
        recent, plan.last_scan = _scans - plan.last_scan <= RECENT_SCANS, _scans
        if recent and plan.signatures < MAX_SIGNATURES and _cacheable(extra[2]):
            # Seen again soon: worth a signature (~0.6 us per tensor to build), which a
            # layout seen once (routing that changes every call) never pays.
            plan.signatures += 1
            link = any(map(_REQUIRES_GRAD, a)) or any(map(_REQUIRES_GRAD, b))
            _general_plans.add(len(a), extra, (*a, *b), (plan, link, False))
    if torch.is_grad_enabled() and (any(map(_REQUIRES_GRAD, a))
                                    or any(map(_REQUIRES_GRAD, b))):
        return inference_only(NO_BACKWARD, lambda: plan.launch_pointers(scan.ptrs), [*a, *b])
    return plan.launch_pointers(scan.ptrs)


def _detailed_grouped_gemm(a, b, out, config, out_dtype) -> list[torch.Tensor]:
    cfg = _check_config(config, "grouped_gemm")
    if _symbolic(*(a if type(a) in _SEQUENCES else ()), *(b if type(b) in _SEQUENCES else ()),
                 *(out if type(out) in _SEQUENCES else ())):
        return custom_ops.grouped_gemm(a, b, out=out, config=config, out_dtype=out_dtype)
    args = check_grouped_gemm(a, b, out, out_dtype)
    if not args.a:
        return []
    if args.out is not None:
        check_out_batched("grouped_gemm", args.out, (*args.a, *args.b))
    if args.out_aliased:
        # Outputs sharing memory with an operand: computed into fresh tensors, then copied.
        given = args.out
        tmp = list(given)
        for i in args.out_aliased:
            tmp[i] = torch.empty_like(given[i])
        res = grouped_gemm_eager(args.a, args.b, tmp, cfg, args.out_dtype)
        for i in args.out_aliased:
            given[i].copy_(res[i])
        return [given[i] if i in args.out_aliased else r for i, r in enumerate(res)]
    problem = cute_problem(args.device) if cfg.backend != "torch" else "torch requested"
    layout = analyze_general(args) if problem is None else None
    unsupported = layout if isinstance(layout, str) else None
    if _use_cute(cfg, problem, unsupported, "grouped_gemm"):
        from moe_gemm.ops.general_launch import grouped_gemm_cute

        run = lambda: grouped_gemm_cute(args, cfg, layout=layout)  # type: ignore[arg-type]  # noqa: E731
        return inference_only(NO_BACKWARD, run, [*args.a, *args.b])
    return grouped_gemm_torch(args)


# ---------------------------------------------------------------------------------------------
# grouped_mm


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
        out_dtype: output dtype (bf16, fp16 or fp32); default out's dtype where out is given
            (an fp32 out takes fp32 results of bf16 operands), else x's dtype; an out of
            another dtype than out_dtype is a TypeError.

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
    if _traced():
        return custom_ops.grouped_mm(x, w, offs, out=out, config=config, out_dtype=out_dtype)
    return grouped_mm_eager(x, w, offs, out, config, out_dtype)


def grouped_mm_eager(x, w, offs, out, config, out_dtype) -> torch.Tensor:
    """grouped_mm without the tracing check (the registered op's implementation)."""
    if type(x) in PLAIN_TENSORS and (config is None or type(config) is GemmConfig):
        try:
            shape = x.shape
        except RuntimeError:  # a nested tensor has no sizes: the detailed path's checks name it
            return _detailed_grouped_mm(x, w, offs, out, config, out_dtype)
        extra = (config, out_dtype, _switches())
        if out is None:
            if offs is None:
                entry = _mm_plans.find(("bmm", shape), extra, (x, w))
                if entry is not None and not (_PTR(x) | _PTR(w)) & 15:
                    plan = entry[0]
                    if entry[1] and torch.is_grad_enabled():
                        return inference_only(NO_BACKWARD, lambda: plan.launch(x, w, None), [x, w])
                    return plan.launch(x, w, None)
            else:
                entry = _mm_plans.find(("mm", shape), extra, (x, w, offs))
                if entry is not None and not (_PTR(x) | _PTR(w)) & 15:
                    plan = entry[0]
                    if entry[1] and torch.is_grad_enabled():
                        return inference_only(NO_BACKWARD, lambda: plan.launch(x, w, offs, None),
                                              [x, w])
                    return plan.launch(x, w, offs, None)
        elif type(out) in PLAIN_TENSORS and not overlaps_any(out, (x, w, offs)):
            if offs is None:
                entry = _mm_plans.find(("bmm_out", shape), extra, (x, w, out))
            else:
                entry = _mm_plans.find(("mm_out", shape), extra, (x, w, offs, out))
            if entry is not None and not (_PTR(x) | _PTR(w) | _PTR(out)) & 15 and not (
                    entry[2] and torch.is_grad_enabled()):
                plan = entry[0]
                run = ((lambda: plan.launch(x, w, out)) if offs is None
                       else (lambda: plan.launch(x, w, offs, out)))
                if entry[1] and torch.is_grad_enabled():
                    return inference_only(NO_BACKWARD, run, [x, w])
                return run()
    return _detailed_grouped_mm(x, w, offs, out, config, out_dtype)


def _detailed_grouped_mm(x, w, offs, out, config, out_dtype) -> torch.Tensor:
    cfg = _check_config(config)
    if _symbolic(*(t for t in (x, w, offs, out) if t is not None)):
        return custom_ops.grouped_mm(x, w, offs, out=out, config=config, out_dtype=out_dtype)
    if out is not None:
        check_out_batched("grouped_mm", out, (x, w, offs))
    if offs is not None and batched_values(offs):  # (vmap with grad: ops/vmap.py)
        return per_entry_into(out, out_dtype, lambda dt: per_entry(
            lambda x, w, offs: grouped_mm_eager(x, w, offs, None, config, dt), x, w, offs),
            lambda out, y: custom_ops.write_rows(out, y, offs))
    if out is not None and type(out) in PLAIN_TENSORS and overlaps_any(out, (x, w, offs)):
        # Computed into a copy of out (rows past offs[-1] keep their values), then copied.
        if offs is None:
            check_grouped_bmm(x, w, out, out_dtype)
        else:
            check_grouped_mm(x, w, offs, out, out_dtype)
        y = grouped_mm_eager(x, w, offs, out.clone(), config, out_dtype)
        return out.copy_(y)
    if offs is None:
        return _detailed_grouped_bmm(x, w, out, cfg, config, out_dtype)
    args = check_grouped_mm(x, w, offs, out, out_dtype)
    problem = cute_problem(args.x.device) if cfg.backend != "torch" else "torch requested"
    unsupported = grouped_mm_unsupported(args, cfg) if problem is None else None
    if _use_cute(cfg, problem, unsupported, "grouped_mm"):
        from moe_gemm.ops.mm_launch import MmPlan

        plan = MmPlan(args, cfg)
        offs_c = args.offs if args.offs.is_contiguous() else args.offs.contiguous()
        if offs_c is args.offs:
            bucket = ("mm", x.shape) if out is None else ("mm_out", x.shape)
            tensors = (x, w, offs) if out is None else (x, w, offs, out)
            _remember(bucket, config, out_dtype, tensors, plan, out)
        return inference_only(NO_BACKWARD, lambda: plan.launch(args.x, args.w, offs_c, args.out),
                              [args.x, args.w])
    return grouped_mm_torch(args)


def _detailed_grouped_bmm(x, w, out, cfg, config, out_dtype) -> torch.Tensor:
    _check_config(config, "grouped_mm's 3-D x 3-D form")
    args = check_grouped_bmm(x, w, out, out_dtype)
    problem = cute_problem(args.x.device) if cfg.backend != "torch" else "torch requested"
    unsupported = grouped_bmm_unsupported(args, cfg) if problem is None else None
    if _use_cute(cfg, problem, unsupported, "grouped_mm"):
        from moe_gemm.ops.mm_launch import BmmPlan

        plan = BmmPlan(args, cfg)
        bucket = ("bmm", x.shape) if out is None else ("bmm_out", x.shape)
        _remember(bucket, config, out_dtype, (x, w) if out is None else (x, w, out), plan, out)
        return inference_only(NO_BACKWARD, lambda: plan.launch(args.x, args.w, args.out),
                              [args.x, args.w])
    return grouped_bmm_torch(args)


def _remember(bucket, config, out_dtype, tensors, plan, out) -> None:
    """Keep a plan for calls with this signature (plain tensors, a cached config, switches
    that allow it, and not built while capturing a CUDA graph)."""
    if config is not None and type(config) is not GemmConfig:
        return
    if any(type(t) not in PLAIN_TENSORS for t in tensors) or not getattr(plan, "cacheable",
                                                                          True):
        return
    switches = _switches()
    if not _cacheable(switches) or offs_check_requested():
        return
    x, w = tensors[0], tensors[1]
    link = x.requires_grad or w.requires_grad
    _mm_plans.add(bucket, (config, out_dtype, switches), tensors,
                  (plan, link, out is not None and out.requires_grad), out=out)


# ---------------------------------------------------------------------------------------------
# GroupedGemmPlan


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


class GroupedGemmPlan:
    """grouped_gemm prepared once for a fixed set of tensors, for loops that call it again and
    again on new values (serving with static buffers, benchmarks, CUDA graphs).

    The constructor does all the per-problem host work of grouped_gemm (checks, layout
    analysis, kernel choice, output allocation, metadata upload); each call checks that the
    tensors it was given still have their shapes, strides, dtypes and devices (one C-level
    signature check, ~60 ns a tensor on the CPU-only dev machine) and launches the kernel. A
    call computes D_i = A_i @ B_i from the tensors' values at that moment (update them in
    place, e.g. with `copy_`), writes into `out` and returns it. Do not resize the tensors or
    change their storage after building the plan; build a new plan instead (a call whose
    a, b or out no longer match raises ValueError naming the tensor, on either backend;
    storage moved under an unchanged shape is not detected); the outputs a plan allocated
    itself (`plan.out`) are held to this too. On the torch backend with an
    operand that requires grad, a call returns new tensors tied to the autograd graph (their
    values also written into `out`), so that every call can be backpropagated; on the Hopper
    path it returns views of `out` whose backward raises (the kernels are inference-only),
    and `out` itself stays out of the autograd graph.

    Args: as grouped_gemm (a, b, out, config, out_dtype). `out`, when None, is allocated once
    and reused by every call: copy results you want to keep before the next call.

    On the GPU the plan's first call records its launch as a CUDA graph and later calls replay
    it (one graph launch instead of a kernel call of 16 arguments: 8.6 against 11.4 us of CPU
    per call on an H200 host); a call inside the caller's own capture launches directly, and
    a capture that fails leaves direct launches. MOE_GEMM_PLAN_GRAPH=0 when the plan is built
    turns the recording off. Called inside torch.compile (fullgraph too), a tensor mode or
    torch.vmap, a call runs the registered grouped_gemm op on the plan's tensors (which the
    tracer records) and writes the same outputs.
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
        cfg = _check_config(config, "GroupedGemmPlan")
        self._config = config
        if vmap_active():
            # A plan keeps its operands and writes preallocated outputs, which a vmapped
            # (per-entry) operand cannot be; grouped_gemm is the vmappable form.
            raise ValueError("GroupedGemmPlan cannot be built inside torch.vmap (it keeps "
                             "fixed tensors and preallocated outputs); call "
                             "moe_gemm.grouped_gemm inside the vmapped function instead")
        args = check_grouped_gemm(a, b, out, out_dtype)
        given_out = tuple(args.out or ())
        # The plan's own tensors are normal ones even when it is built under
        # torch.inference_mode: inference tensors could not be written by a call made
        # outside it (torch refuses the in-place update; the kernel would not notice).
        with torch.inference_mode(False):
            if args.out is None:  # allocated once: every call writes the same tensors
                args = dataclasses.replace(args, out=[
                    torch.empty(m, n, dtype=args.out_dtype, device=args.device)
                    for m, n, _ in args.sizes])
            self.out: list[torch.Tensor] = list(args.out or [])
            # Outputs sharing memory with an operand: the plan writes private tensors and
            # each call copies them into the given ones (ops/aliasing.py).
            self._copy_back = [(self.out[i], torch.empty_like(self.out[i]))
                               for i in args.out_aliased]
        if self._copy_back:
            private = list(self.out)
            for i, (_, tmp) in zip(args.out_aliased, self._copy_back):
                private[i] = tmp
            args = dataclasses.replace(args, out=private, out_aliased=())
        self.args = args
        self._launch = None
        self._operands = (*args.a, *args.b)
        # The operands and the outputs (given, or allocated here and handed out by every
        # call), compared with the build's at every call: the kernel reads the build's sizes
        # and addresses (an output resized or given other storage since would be written at
        # its old address), and the torch backend would broadcast a shrunk operand into its
        # output. One signature check; the detailed comparison only when it fails.
        self._bound = (*self._operands, *self.out)
        self._built_for = [_layout(t) for t in self._bound]
        # Given outputs made under torch.inference_mode: the signature agrees only inside it,
        # so that a call outside it reaches _check_bound, which refuses the write as torch does.
        self._inference_out = tuple((f"out[{i}]", o) for i, o in enumerate(given_out)
                                    if o.is_inference())
        self._signature = TensorSignature(self._bound, inference_mode=bool(
            self._inference_out)) if self._bound else None
        # Outputs that require grad (given ones a build under no_grad accepts, or the plan's
        # own after requires_grad_): a call with grad enabled refuses them in _check_bound, as
        # grouped_gemm does (the torch backend's in-place write raised torch's leaf error, the
        # kernel's would go unnoticed).
        self._named_out = tuple((f"out[{i}]", o) for i, o in enumerate(self.out))
        self._tracked_out = any(map(_REQUIRES_GRAD, self.out))
        # Whether an operand requires grad: the signature holds the autograd flags, so a call
        # it accepts has these (a change fails it, and _check_bound reads them again).
        self._grad_operands = any(map(_REQUIRES_GRAD, self._operands))
        self.backend = "torch"
        if not args.a:
            return
        problem = cute_problem(args.device) if cfg.backend != "torch" else "torch requested"
        layout = analyze_general(args) if problem is None else None
        unsupported = layout if isinstance(layout, str) else None
        if _use_cute(cfg, problem, unsupported, "GroupedGemmPlan"):
            from moe_gemm.ops.general_launch import PLAN_GRAPH_ENV, GeneralLaunch

            self._launch = GeneralLaunch(args, cfg, layout=layout,  # type: ignore[arg-type]
                                         persistent=True, replay=bool(env_value(PLAN_GRAPH_ENV)))
        self.backend = "cute" if self._launch is not None else "torch"

    def __call__(self) -> list[torch.Tensor]:
        if _traced():
            return self._traced_call()
        if (self._signature is not None and not self._signature.check(*self._bound)) or (
                self._tracked_out and torch.is_grad_enabled()):
            self._check_bound()
        launch = self._launch
        grad = self._grad_operands and torch.is_grad_enabled()
        if launch is None and grad:
            return self._differentiable_call()
        if launch is None:  # the torch backend
            return self._copied_back(grouped_gemm_torch(self.args) if self.args.a else [])
        res = self._copied_back(launch.launch())
        if grad:
            # Views of the outputs carry the link (backward raises), as the torch backend's
            # fresh results do; the outputs themselves stay out of the autograd graph, so a
            # later call without grad returns them unlinked.
            res = inference_only(NO_BACKWARD, lambda: [o.view_as(o) for o in res],
                                 self._operands)
        return res

    def _traced_call(self) -> list[torch.Tensor]:
        """A call under torch.compile (or a tensor mode, or inside torch.vmap): the registered
        op on the plan's tensors, which the tracer records, writing the plan's outputs. The
        plan's signature check and launch are host code a tracer cannot follow; the build's
        layouts are compared here in Python instead (the tracer reads them once and guards
        them, so a tensor resized later is refused when the graph is traced again)."""
        for t, want in zip(self._bound, self._built_for):
            if _layout(t) != want:
                self._check_bound()
        for name, o in self._named_out:  # (as the eager call: written under no_grad below)
            check_out_untracked(name, o)
        args = self.args
        if not args.a:
            return list(self.out)
        if torch.is_grad_enabled() and any(t.requires_grad for t in self._operands):
            # As the eager call: fresh results, their values copied into the plan's outputs
            # (written by the op, the outputs would join this call's graph, and the next
            # call would refuse them as outputs that require grad).
            return self._written_to_outputs(custom_ops.grouped_gemm(
                list(args.a), list(args.b), config=self._config, out_dtype=args.out_dtype))
        res = custom_ops.grouped_gemm(list(args.a), list(args.b), out=list(args.out or ()),
                                      config=self._config, out_dtype=args.out_dtype)
        return self._copied_back(res)

    def _copied_back(self, res: list[torch.Tensor]) -> list[torch.Tensor]:
        """A call's results, with the outputs that alias an operand copied from the private
        tensors the call wrote (then the given outputs are the results)."""
        if not self._copy_back:
            return res
        for given, tmp in self._copy_back:
            given.copy_(tmp)
        return list(self.out)

    def _check_bound(self) -> None:
        """The plan's tensors fail its signature: a ValueError naming the first whose shape,
        strides, dtype or device changed since the build (resize_, set_, `.data =`: the torch
        backend would broadcast a shrunk operand into its output, the kernel would run on the
        build's sizes and addresses); torch's RuntimeError for a given output made under
        torch.inference_mode when the call is outside it; a ValueError for a given output
        that requires grad while grad is enabled. Where only the operands' autograd flags
        changed (requires_grad_ between calls, which a call handles), the signature takes the
        new ones."""
        G = len(self.args.a)
        for i, (t, want) in enumerate(zip(self._bound, self._built_for)):
            got = _layout(t)
            if got != want:
                name = ("a", "b", "out")[i // G] + f"[{i % G}]"
                raise ValueError(
                    f"GroupedGemmPlan was built for {name} of shape {want[0]} (strides "
                    f"{want[1]}), {want[2]} on {want[3]}; it is now of shape {got[0]} (strides "
                    f"{got[1]}), {got[2]} on {got[3]}: build a new plan for other tensors "
                    f"(or copy_ new values into these)")
        for name, o in self._inference_out:
            check_out_not_inference(name, o)
        for name, o in self._named_out:
            check_out_untracked(name, o)
        self._tracked_out = any(o.requires_grad for _, o in self._named_out)
        self._signature = TensorSignature(self._bound, inference_mode=bool(self._inference_out))
        self._grad_operands = any(map(_REQUIRES_GRAD, self._operands))

    def _differentiable_call(self) -> list[torch.Tensor]:
        """The torch backend with an operand that requires grad: fresh results tied to this
        call's operands, their values also written into the plan's outputs. (Copying the
        graph into the reused outputs would chain each call's history onto the previous
        call's, whose buffers its backward has freed: a second step could not backward.)"""
        return self._written_to_outputs(
            grouped_gemm_torch(dataclasses.replace(self.args, out=None)))

    def _written_to_outputs(self, res: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fresh results of a call whose operands require grad, their values also written
        into the plan's outputs (and the aliased ones copied back) outside the graph."""
        with torch.no_grad():
            for o, r in zip(self.args.out or (), res):
                o.copy_(r)
            for given, tmp in self._copy_back:
                given.copy_(tmp)
        return res
