"""The fused MoE grouped GEMM: grouped_mm with a token gather, a per-expert bias, a gated
activation and per-row weights inside the kernel.

    y = fused_grouped_mm(x, w, offs, row_index=..., bias=..., gate=..., row_weight=...)

Routed row r of expert e (rows offs[e-1]:offs[e]) computes, in fp32 and rounded once,

    h = x[row_index[r]] @ w[e] (+ bias[e])        (x[r] without row_index)
    y[r] = act(h_gate) * h_up                     with a gate: N / 2 columns
    y[r] *= row_weight[r]                         with row weights

so the MoE layer's two expert GEMMs need no permuted copy of the tokens (gather-A), no
(S, 2I) intermediate and activation pass (the gated epilogue of the gate-up GEMM) and no
separate weighting pass (the row weights in the down GEMM's epilogue); layers/experts.py
builds the fused expert FFN on it. The kernel gathers x's rows itself below 32 routed rows
(decode), where that keeps the tile it would use without the gather and x's rows are whole
16-byte chunks; elsewhere the plan gathers them with one index_select first, the faster way
past decode (ops/fused_launch.GATHER_MAX_ROWS says why), with the same clamping of
unchecked indices.

Gates: "silu" (SwiGLU), "gelu" (GEGLU, erf), "gelu_tanh", "clamped_swiglu" (gpt-oss:
gate clamped to <= limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)),
"clamped_silu" (a swiglu_limit: GLM-5-Next, HY-V4, Step-3.7: the same clamps, then
silu(gate) * up).
Gate layouts of w's N columns: "concat" (gate [0, I), up [I, 2I): transformers, vLLM; on the
GPU w must be K-major, i.e. gate_up_proj (E, 2I, H).transpose(1, 2)) or "interleaved"
(blocks of 8 gate then 8 up columns: any major; `interleave_gate_up` repacks a weight into
it once) or "alternating" (gate at even columns, up at odd: gpt-oss; any major, no repack).

Backends as grouped_mm's: the Hopper kernel where it runs, else (or with backend="torch")
plain torch (ops/fused_reference.py). On CUDA nothing reads a GPU value on the host (CUDA-graph
capturable); under torch.compile the call is one registered op (ops/fused_custom_ops.py).
Inference only, like every moe_gemm kernel.
"""

from __future__ import annotations

import torch

from moe_gemm.capability import cute_problem
from moe_gemm.config import GemmConfig
from moe_gemm.kernels.sm90.constants import GATE_BLOCK

# (fused_custom_ops registers the op, its fake and its FLOP count: at import, so that a
# FlopCounterMode made before the first fused call already counts it)
from moe_gemm.ops import api, fused_custom_ops
from moe_gemm.ops.autograd import inference_only
from moe_gemm.ops.fused_reference import fused_grouped_mm_torch
from moe_gemm.ops.fused_validation import FusedMmArgs, check_fused_mm
from moe_gemm.ops.signature import PlanCache
from moe_gemm.ops.support import PLAIN_TENSORS
from moe_gemm.ops.validation import check_dense
from moe_gemm.ops.vmap import batched_values, per_entry, per_entry_into

__all__ = ["fused_grouped_mm", "interleave_gate_up"]

_plans = PlanCache(per_bucket=8, buckets=256)  # buckets: (x.shape, options)

NO_BACKWARD = api.NO_BACKWARD


def fused_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    *,
    row_index: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    gate: str | None = None,
    gate_layout: str = "concat",
    gate_alpha: float = 1.702,
    gate_limit: float = 7.0,
    row_weight: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """grouped_mm with the MoE layer's gather, bias, gate and row weights fused in.

    Args:
        x: [T, K] bf16 / fp16 (fp32 on the torch backend): the tokens when row_index is
            given, else the routed rows sorted by expert.
        w: [E, K, N] expert weights, same dtype and device.
        offs: [E] int32 cumulative end rows of the S routed rows (S = len(row_index), or T).
        row_index: [S] int32 / int64: routed row r is x[row_index[r]] (gather-A); None: x's
            rows are the routed rows.
        bias: [E, N] float, added per expert in w's column order; None: no bias.
        gate: None, "silu", "gelu", "gelu_tanh", "clamped_swiglu" or "clamped_silu"
            (aliases "swish", "gelu_pytorch_tanh"): the output is act(gate) * up, N / 2
            columns.
        gate_layout: "concat", "interleaved" or "alternating" (see the module docstring).
        gate_alpha, gate_limit: clamped_swiglu's alpha and limit (gpt-oss: 1.702, 7.0);
            clamped_silu's limit (its alpha is unused).
        row_weight: [S] float: each routed row's result times its weight.
        out: optional [S, N or N / 2] to write into; rows >= offs[-1] are then left as they
            are (else zero).
        config: a GemmConfig (backend, tiles, ...); None = automatic.
        out_dtype: output dtype (bf16, fp16, fp32); default out's dtype where out is given,
            else x's dtype (as grouped_mm).

    Returns:
        [S, N] or, gated, [S, N / 2].

    On CUDA the call never synchronizes with the host; offs and row_index values on the GPU
    are not checked (the kernel clamps them: bad values give wrong rows, never out-of-bounds
    accesses) unless MOE_GEMM_CHECK_OFFS=1; on the CPU they are.

    Raises:
        TypeError, ValueError: arguments that do not fit (the message names the expectation).
        RuntimeError: backend="cute" forced where the Hopper kernels cannot run.
    """
    if api._traced():
        return fused_custom_ops.fused_grouped_mm(
            x, w, offs, row_index=row_index, bias=bias, gate=gate, gate_layout=gate_layout,
            gate_alpha=gate_alpha, gate_limit=gate_limit, row_weight=row_weight, out=out,
            config=config, out_dtype=out_dtype)
    return fused_grouped_mm_eager(x, w, offs, row_index, row_weight, bias, gate, gate_layout,
                                  gate_alpha, gate_limit, out, config, out_dtype)


def fused_grouped_mm_eager(x, w, offs, row_index, row_weight, bias, gate, gate_layout,
                           gate_alpha, gate_limit, out, config, out_dtype) -> torch.Tensor:
    """fused_grouped_mm without the tracing check (the registered op's implementation)."""
    tensors = (x, w, offs, row_index, row_weight, bias, out)
    options = (gate, gate_layout, gate_alpha, gate_limit, row_index is None,
               row_weight is None, bias is None, out is None)
    present = tuple(t for t in tensors if t is not None)
    if type(x) in PLAIN_TENSORS and (config is None or type(config) is GemmConfig) and (
            out is None or not _overlaps(out, x, w, offs, row_index, row_weight, bias)):
        extra = (config, out_dtype, api._switches())
        try:
            entry = _plans.find((x.shape, options), extra, present)
        except TypeError:  # (unhashable options: the checks below name what was expected)
            entry = None
        except RuntimeError:  # (a nested x has no sizes: likewise)
            entry = None
        if entry is not None and not (x.data_ptr() | w.data_ptr() | (
                0 if out is None else out.data_ptr())) & 15:
            plan, link = entry
            run = lambda: plan.launch(x, w, offs, row_index, row_weight, bias, out)  # noqa: E731
            if link and torch.is_grad_enabled():
                return inference_only(NO_BACKWARD, run, _grad_inputs(x, w, row_weight, bias))
            return run()
    cfg = api._check_config(config, None if gate is None or gate_layout == "concat" else (
        f"fused_grouped_mm with the {gate_layout!r} gate layout"))
    if api._symbolic(*present):
        return fused_custom_ops.fused_grouped_mm(
            x, w, offs, row_index=row_index, bias=bias, gate=gate, gate_layout=gate_layout,
            gate_alpha=gate_alpha, gate_limit=gate_limit, row_weight=row_weight, out=out,
            config=config, out_dtype=out_dtype)
    if batched_values(offs, row_index):  # (vmap with grad: ops/vmap.py)
        return per_entry_into(out, out_dtype, lambda dt: per_entry(
            lambda x, w, offs, row_index, row_weight, bias: fused_grouped_mm_eager(
                x, w, offs, row_index, row_weight, bias, gate, gate_layout, gate_alpha,
                gate_limit, None, config, dt), x, w, offs, row_index, row_weight, bias),
            lambda out, y: fused_custom_ops.write_rows(out, y, offs))
    args = check_fused_mm(x, w, offs, row_index=row_index, row_weight=row_weight, bias=bias,
                          gate=gate, gate_layout=gate_layout, gate_alpha=gate_alpha,
                          gate_limit=gate_limit, out=out, out_dtype=out_dtype)
    if out is not None and _out_overlaps(args):
        # As every op here: computed as if the inputs had been cloned, into a copy of out
        # (rows it does not write keep their values), then copied.
        y = fused_grouped_mm_eager(x, w, offs, row_index, row_weight, bias, gate, gate_layout,
                                   gate_alpha, gate_limit, out.clone(), config, out_dtype)
        return out.copy_(y)
    problem, unsupported = _why_not_kernel(args, cfg)
    if args.K == 0 and args.S:
        # No operand to load (the kernel's launch-time TMA descriptors cannot have an empty K
        # extent): the torch backend adds the bias, gates and weights the empty sums.
        return fused_grouped_mm_torch(args)
    if api._use_cute(cfg, problem, unsupported, "fused_grouped_mm"):
        from moe_gemm.ops.fused_launch import FusedPlan

        plan = FusedPlan(args, cfg)
        _remember(x, options, config, out_dtype, present, plan, args)
        return inference_only(
            NO_BACKWARD,
            lambda: plan.launch(args.x, args.w, args.offs, args.row_index, args.row_weight,
                                args.bias, args.out),
            _grad_inputs(x, w, row_weight, bias))
    return fused_grouped_mm_torch(args)


def _why_not_kernel(args: FusedMmArgs, cfg: GemmConfig) -> tuple[str | None, str | None]:
    """(why the Hopper kernels cannot run here or were not asked for, why the kernel cannot
    take these checked arguments): both None where fused_grouped_mm runs the kernel."""
    problem = cute_problem(args.x.device) if cfg.backend != "torch" else "torch requested"
    if problem is not None:
        return problem, None
    from moe_gemm.ops.fused_launch import fused_unsupported

    return None, fused_unsupported(args)


def fused_runs_torch(args: FusedMmArgs, config: GemmConfig | None) -> bool:
    """Whether fused_grouped_mm of these checked arguments takes torch's path here rather than
    the kernel (the registered op's backward asks: its gradients exist on that path only)."""
    return any(_why_not_kernel(args, api._check_config(config)))


def _grad_inputs(x, w, row_weight, bias) -> list[torch.Tensor]:
    return [t for t in (x, w, row_weight, bias) if t is not None]


def _out_overlaps(args: FusedMmArgs) -> bool:
    return _overlaps(args.out, args.x, args.w, args.offs, args.row_index, args.row_weight,
                     args.bias)


def _overlaps(out, *inputs) -> bool:
    from moe_gemm.ops.aliasing import overlaps_any

    return type(out) in PLAIN_TENSORS and overlaps_any(
        out, tuple(t for t in inputs if t is not None))


def _remember(x, options, config, out_dtype, present, plan, args: FusedMmArgs) -> None:
    if not plan.cacheable or any(type(t) not in PLAIN_TENSORS for t in present):
        return
    switches = api._switches()
    if not api._cacheable(switches):
        return
    from moe_gemm.ops.validation import offs_check_requested

    if offs_check_requested():
        return
    link = any(t.requires_grad for t in _grad_inputs(args.x, args.w, args.row_weight,
                                                      args.bias))
    _plans.add((x.shape, options), (config, out_dtype, switches), present, (plan, link),
               out=args.out)


def _clear_plans() -> None:
    _plans.clear()


def interleave_gate_up(w: torch.Tensor, source: str = "concat") -> torch.Tensor:
    """A gate-up weight (or bias) repacked into the interleaved gate layout, as a new tensor.

    Args:
        w: [..., N]: the gate and up columns along the last dimension (an (E, K, N) weight
            or an (E, N) bias).
        source: "concat" (gate [0, N/2), up [N/2, N)) or "alternating" (gate at even
            columns, up at odd: gpt-oss).

    Returns:
        [..., N] with blocks of 8 gate columns then the 8 matching up columns, in w's memory
        order (an (E, K, N) weight keeps its major: K-major in, K-major out).

    Raises:
        TypeError: w not a (dense) tensor.
        ValueError: a 0-d w, N not a multiple of 16 or an unknown source.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError("w must be a tensor [..., N]")
    check_dense("w", w)
    if w.dim() < 1:
        # (a tensor all the same: the rank is what does not fit, as for every op's shapes)
        raise ValueError("w must have at least one dimension [..., N] (the gate and up "
                         "columns); got a 0-d tensor")
    if source not in ("concat", "alternating"):
        raise ValueError(f"source must be 'concat' or 'alternating'; got {source!r}")
    N = w.shape[-1]
    if N % (2 * GATE_BLOCK):
        raise ValueError(f"the interleaved layout pairs blocks of {GATE_BLOCK} columns: N must "
                         f"be a multiple of {2 * GATE_BLOCK}; got {N}")
    I = N // 2
    if source == "concat":
        gate, up = w[..., :I], w[..., I:]
    else:
        gate, up = w[..., 0::2], w[..., 1::2]
    lead = w.shape[:-1]
    blocks = torch.stack([gate.reshape(*lead, I // GATE_BLOCK, GATE_BLOCK),
                          up.reshape(*lead, I // GATE_BLOCK, GATE_BLOCK)], dim=-2)
    packed = blocks.reshape(*lead, N)
    if w.dim() == 3 and w.stride(1) == 1 and w.shape[1] > 1:
        # K-major in (a transposed (E, N, K) weight): keep K contiguous.
        return packed.transpose(1, 2).contiguous().transpose(1, 2)
    return packed.contiguous()

