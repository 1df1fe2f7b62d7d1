"""The torch backend: both ops in plain torch, on the CPU and on any CUDA GPU.

Two kinds of function live here:
- `grouped_gemm_torch` / `grouped_mm_torch`: the production fallback that `backend="auto"`
  uses wherever the Hopper kernels cannot run. fp32 accumulation, output in the requested
  dtype; bmm for uniform groups on CUDA, torch's grouped_mm where it applies, a loop otherwise.
- `grouped_gemm_ref` / `grouped_mm_ref`: float32 (or float64) references for tests, as simple
  as possible so that they are obviously right.

Both assume arguments already checked by `moe_gemm.validation`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_gemm.ops.validation import GroupedBmmArgs, GroupedGemmArgs, GroupedMmArgs

_HAS_GROUPED_MM = hasattr(F, "grouped_mm")


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b with fp32 accumulation, result in out_dtype."""
    if a.device.type == "cuda":
        # cuBLAS accumulates bf16/fp16 products in fp32; fp32 inputs stay fp32 (no TF32 here
        # unless the user turned it on globally).
        if out_dtype == a.dtype:
            return torch.mm(a, b)
        if a.dtype != torch.float32 and out_dtype == torch.float32:
            try:
                return torch.mm(a, b, out_dtype=torch.float32)
            except (RuntimeError, TypeError):
                pass
        return torch.mm(a.float(), b.float()).to(out_dtype)
    # CPU: compute in fp32 explicitly so every dtype gets fp32 accumulation.
    if a.dtype == torch.float32:
        r = torch.mm(a, b)
    else:
        r = torch.mm(a.float(), b.float())
    return r if out_dtype == torch.float32 else r.to(out_dtype)


def grouped_gemm_torch(args: GroupedGemmArgs) -> list[torch.Tensor]:
    """D_i = A_i @ B_i for every problem, written into args.out when given."""
    a, b, odt = args.a, args.b, args.out_dtype
    sizes = args.sizes
    uniform = len(a) > 1 and all(s == sizes[0] for s in sizes) and min(sizes[0]) > 0
    if uniform and args.device.type == "cuda" and odt == args.dtype:
        d = torch.bmm(torch.stack(a), torch.stack(b))
        results = list(d.unbind(0))
    else:
        results = [_mm(ai, bi, odt) for ai, bi in zip(a, b)]
    if args.out is None:
        return results
    for o, r in zip(args.out, results):
        o.copy_(r)
    return list(args.out)


_functorch_depth = torch._C._functorch.get_dynamic_layer_stack_depth


# torch's grouped_mm on CUDA: CUTLASS kernels for bf16 (sm90/sm100), else its own loop of
# mm_out over offs read on the host, in C++. That loop beats ours in Python: fp32, E=16,
# 2048 rows, N=K=1024 on an H200 (2026-12-01, `moe-gemm bench --suite off-grid`, calls back
# to back, each waiting for its host read of offs): 526 us a call against 805 (torch's
# grouped_mm alone 385: the offsets' clamp and the tail's zeros add small launches).
_NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _grouped_mm_native_ok(args: GroupedMmArgs) -> bool:
    """torch's own grouped_mm: CUDA, sm80+, 16-byte aligned strides, output in the inputs'
    dtype."""
    if not _HAS_GROUPED_MM or args.x.device.type != "cuda" or args.dtype not in _NATIVE_DTYPES:
        return False
    if args.out_dtype != args.dtype:
        # torch's CUDA grouped_mm requires out dtype == input dtype (it rejects bf16 -> fp32).
        return False
    if torch.cuda.get_device_capability(args.x.device) < (8, 0):
        return False
    if _functorch_depth() > 0:
        # grad / jvp (vmap(grad(f)) too): wrapped tensors have no data pointer to check; the
        # loop below differentiates through torch.mm.
        return False

    def aligned(t: torch.Tensor, elem: int) -> bool:
        # One unit stride and the other a 16-byte multiple; torch rejects a 0 stride (an
        # expanded dim), which the loop below handles like any other view.
        s, n = t.stride()[-2:], t.shape[-2:]
        per = 16 // elem
        return ((s[-1] == 1 and s[-2] % per == 0 and (s[-2] > 0 or n[-2] <= 1))
                or (s[-2] == 1 and s[-1] % per == 0 and (s[-1] > 0 or n[-1] <= 1)))

    elem = args.x.element_size()
    return (aligned(args.x, elem) and aligned(args.w, elem)
            and args.x.data_ptr() % 16 == 0 and args.w.data_ptr() % 16 == 0)


def expert_spans(offs: torch.Tensor, rows: int) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every non-empty expert, read from offs on the host (a
    synchronisation on CUDA: the torch backend's loops), clamped into [0, rows] as the kernels
    read them: a decreasing entry (unchecked on the GPU) is an empty expert."""
    spans, start = [], 0
    for e, end in enumerate(fitted_ends(host_offsets(offs), rows)):
        if end > start:
            spans.append((e, start, end))
        start = end
    return spans


def host_offsets(offs: torch.Tensor) -> list[int]:
    """offs as Python ints (a synchronisation on CUDA)."""
    return offs.detach().to("cpu", torch.int64).tolist()


def fitted_ends(ends: list[int], rows: int) -> list[int]:
    """Each expert's end row as the kernels read offs: within [its start, rows], so that a
    decreasing entry is an empty expert."""
    fitted, start = [], 0
    for end in ends:
        start = min(max(end, start), rows)
        fitted.append(start)
    return fitted


def tie_to_inputs(y: torch.Tensor, *inputs: torch.Tensor | None) -> torch.Tensor:
    """y, made part of the autograd graph of `inputs` when one of them requires grad and
    nothing computed from them reached y (no experts, no rows, or no row routed to any
    expert): a zero built from their empty slices is written into an empty slice of y, so
    y's values stay as they are and the backward gives the inputs zero gradients, as
    torch.mm of empty operands does. Without it the result would not require grad: a
    backward through it alone (an expert-parallel rank that received no tokens) fails, and
    the experts' .grad stays None instead of zeros."""
    live = [t for t in inputs if t is not None and t.requires_grad]
    if y.requires_grad or not live or not torch.is_grad_enabled():
        return y
    # (empty sums: exactly 0, never NaN; a 0-d input, such as a per-tensor FP8 scale, has no
    # dimension to narrow: seen as (1,))
    zero = sum((t if t.dim() else t.unsqueeze(0)).narrow(0, 0, 0).sum() for t in live)
    y[:0] = zero.to(y.dtype)
    return y


def grouped_mm_torch(args: GroupedMmArgs) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]; rows past offs[-1] are zero (or untouched in out)."""
    x, w, offs = args.x, args.w, args.offs
    T, N = args.T, args.N
    if args.E == 0 or T == 0:
        y = args.out if args.out is not None else torch.zeros(T, N, dtype=args.out_dtype,
                                                              device=x.device)
        return tie_to_inputs(y, x, w)
    if _grouped_mm_native_ok(args):
        if args.dtype != torch.bfloat16 and not (x.requires_grad and torch.is_grad_enabled()):
            return _grouped_mm_host_offs(args)
        # bf16: no host sync, torch's kernel reads offs on the GPU; fp16 / fp32 with x's
        # gradient run torch's own loop (it reads offs on the host). The offsets as the
        # kernels read them (clamped into [0, T], a decreasing entry an empty expert), on the
        # GPU: torch would start the next expert at the lower value.
        offs = offs.clamp(0, T).cummax(0).values
        tail = torch.arange(T, device=x.device) >= offs[-1]
        x_in = x
        if x.requires_grad and torch.is_grad_enabled():
            # torch's backward leaves the rows of x's gradient past offs[-1] unwritten (its
            # grouped_mm output, from torch.empty: on torch 2.13's loop, which fp16/fp32 run
            # on CUDA too, NaN or stray values in 8 of 9 backwards); the loop's slices give
            # them zeros. A view of x (its strides, checked above) whose backward zeroes them.
            x_in = _ZeroGradRows.apply(x, tail)
        try:
            y = F.grouped_mm(x_in, w, offs=offs, out_dtype=args.out_dtype)
        except torch.OutOfMemoryError:
            raise  # (the loop below would allocate as much again)
        except RuntimeError:
            if args.dtype == torch.bfloat16:
                raise
            return _grouped_mm_loop(args)  # a torch without that dtype in its grouped_mm
        if args.out is not None:
            args.out.copy_(torch.where(tail[:, None], args.out, y))
            return args.out
        return y.masked_fill_(tail[:, None], 0)
    return _grouped_mm_loop(args)


def _grouped_mm_host_offs(args: GroupedMmArgs) -> torch.Tensor:
    """torch's grouped_mm for the dtypes whose CUDA path is a loop that reads offs on the
    host (fp16, fp32): offs are read here once instead, so that torch gets the caller's own
    tensor where it is already valid (non-decreasing, within [0, T]) and the rows past the
    last expert are known on the host: no clamp, scan or mask kernels around its loop (the
    off-grid suite's fp32 row, E=16 x 2048 rows x 1024 x 1024 on an H200, 2026-12-01: 775 ->
    536 us a call, torch's own grouped_mm 455 and 386 in the same two runs)."""
    x, w, offs, T = args.x, args.w, args.offs, args.T
    given = host_offsets(offs)
    ends = fitted_ends(given, T)
    if ends != given:
        offs = torch.tensor(ends, dtype=offs.dtype).to(x.device, non_blocking=True)
    last = ends[-1]
    try:
        y = F.grouped_mm(x, w, offs=offs, out_dtype=args.out_dtype)
    except torch.OutOfMemoryError:
        raise  # (the loop below would allocate as much again)
    except RuntimeError:
        return _grouped_mm_loop(args)  # a torch without this dtype in its grouped_mm
    if args.out is not None:
        args.out[:last].copy_(y[:last])
        return tie_to_inputs(args.out, x, w)
    y[last:].zero_()
    return tie_to_inputs(y, x, w)


class _ZeroGradRows(torch.autograd.Function):
    """x as it is; its gradient's `rows` (a (T,) bool mask) zero."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        return grad.masked_fill(rows[:, None], 0), None


def _grouped_mm_loop(args: GroupedMmArgs) -> torch.Tensor:
    """grouped_mm_torch as a loop over the experts (offs read on the host)."""
    x, w, offs = args.x, args.w, args.offs
    T, N = args.T, args.N
    spans = expert_spans(offs, T)
    if args.out is not None:
        for e, start, end in spans:
            args.out[start:end] = _mm(x[start:end], w[e], args.out_dtype)
        return tie_to_inputs(args.out, x, w)
    # A new result is built out of place (the experts' products, then the zero tail):
    # writing them into a zeros tensor fails under torch.func transforms that wrap x or w
    # (vmap(grad(f)): a batched product cannot be written into an unbatched tensor).
    tail = T - (spans[-1][2] if spans else 0)
    parts = [_mm(x[start:end], w[e], args.out_dtype) for e, start, end in spans]
    parts.append(x.new_zeros(tail, N, dtype=args.out_dtype))
    return tie_to_inputs(torch.cat(parts) if len(parts) > 1 else parts[0], x, w)


def grouped_bmm_torch(args: GroupedBmmArgs) -> torch.Tensor:
    """out[g] = x[g] @ w[g] with fp32 accumulation (cuBLAS bmm on CUDA), written into out."""
    x, w, odt = args.x, args.w, args.out_dtype
    if x.device.type == "cuda" and odt == x.dtype:
        r = torch.bmm(x, w)
    elif x.device.type == "cuda" and x.dtype != torch.float32 and odt == torch.float32:
        try:
            r = torch.bmm(x, w, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            r = torch.bmm(x.float(), w.float())
    else:
        r = torch.bmm(x.float(), w.float()).to(odt)
    if args.out is None:
        return r
    return args.out.copy_(r)


# ---------------------------------------------------------------------------------------------
# References for tests: float32 (default) or float64, no shortcuts.


def grouped_gemm_ref(
    a: list[torch.Tensor], b: list[torch.Tensor], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """[A_i @ B_i] computed in `dtype` (float32 or float64)."""
    return [ai.to(dtype) @ bi.to(dtype) for ai, bi in zip(a, b)]


def grouped_mm_ref(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(T, N) in `dtype`; rows of expert e are x[rows] @ w[e]; rows past offs[-1] are zero."""
    T, N = x.shape[0], w.shape[2]
    y = torch.zeros(T, N, dtype=dtype, device=x.device)
    start = 0
    for e, end in enumerate(offs.to("cpu", torch.int64).tolist()):
        if end > start:
            y[start:end] = x[start:end].to(dtype) @ w[e].to(dtype)
        start = max(start, end)
    return y
