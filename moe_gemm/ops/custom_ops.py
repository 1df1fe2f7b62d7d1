"""grouped_mm and grouped_gemm registered as torch.library custom ops.

torch.compile, torch.export, make_fx and the fake / functional tensor modes cannot look inside
the host path (it reads data pointers and calls a compiled kernel through TVM-FFI), so under
them the public ops (ops/api.py) call these registered ops instead: the tracer records one
opaque node whose fake implementation gives shapes and dtypes, and at run time the node runs
the same eager path as any other call (cached plans, CUDA-graph safe, the torch backend where
the kernels cannot run). Eager calls never come here: they skip the custom-op dispatch.

    moe_gemm::_grouped_mm(Tensor x, Tensor w, Tensor? offs, str config,
                          ScalarType? out_dtype) -> Tensor
    moe_gemm::_grouped_mm_out(Tensor x, Tensor w, Tensor? offs, Tensor(a!) out, str config,
                              ScalarType? out_dtype) -> ()
    moe_gemm::_grouped_gemm(Tensor[] a, Tensor[] b, str config,
                            ScalarType? out_dtype) -> Tensor[]
    moe_gemm::_grouped_gemm_out(Tensor[] a, Tensor[] b, Tensor(a!)[] out, str config,
                                ScalarType? out_dtype) -> ()
    moe_gemm::_grouped_mm_grad(Tensor grad, Tensor x, Tensor w, Tensor? offs, str config,
                               ScalarType? out_dtype) -> (Tensor, Tensor)
    moe_gemm::_grouped_gemm_grad(Tensor[] grads, Tensor[] a, Tensor[] b, str config,
                                 ScalarType? out_dtype) -> Tensor[]
    moe_gemm::_check_gemm_outs(Tensor[] a, Tensor[] b, Tensor(a!)[] out,
                               ScalarType? out_dtype) -> ()   (eager's checks of `out`)
    moe_gemm::_inference_only(Tensor y, str message) -> Tensor
    moe_gemm::_no_backward(Tensor grad, SymInt[] size, ScalarType dtype, str message) -> Tensor

The ops are underscored: the Python functions are the API. A GemmConfig crosses the schema as
a string, "" for None, else a dict literal of the fields that differ from the defaults
(encode_config: plain Python, so torch.compile folds it to a constant and guards on the
config; decode_config parses each string once). Gradients are as in eager: where the forward ran
torch's own path (GemmConfig(backend="torch"), off the GPU, or an input the kernels do not take,
decided at run time as the eager call decides) the `_grad` ops compute eager autograd's
products; where it ran the Hopper kernels they raise (GemmConfig(backend="cute"): the
`_no_backward` op) when a backward actually runs, so a model whose parameters require grad
still compiles and a backward through it fails as in eager. `_inference_only`
gives a traced MoE layer the same raising backward its eager form has. FlopCounterMode counts
the ops by shape (register_flop_formula below).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import math
import numbers
from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from moe_gemm.config import GemmConfig
from moe_gemm.ops.reference import expert_spans
from moe_gemm.ops.validation import (
    _as_tensor_list,
    check_grouped_bmm,
    check_grouped_gemm,
    check_grouped_mm,
    check_out_untracked,
    shape_text,
)
from moe_gemm.ops.vmap import register_loop_vmap

__all__ = ["decode_config", "encode_config", "grouped_gemm", "grouped_mm"]

NO_BACKWARD = (
    "moe_gemm's grouped GEMMs are inference-only: the moe_gemm::{op} op, which runs them "
    "under torch.compile, make_fx and tensor modes (FlopCounterMode, ...), has no backward. "
    "Run the model under torch.no_grad() / torch.inference_mode(), or call moe_gemm eagerly "
    "(outside such modes) with GemmConfig(backend='torch') for the differentiable torch path."
)
_FIELDS = tuple((f.name, f.default) for f in dataclasses.fields(GemmConfig))


def encode_config(config: GemmConfig | None) -> str:
    """The `config` argument of the ops for a GemmConfig (see the module docstring)."""
    if config is None:
        return ""
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a moe_gemm.GemmConfig or None; got {type(config).__name__}")
    items = [f"{name!r}: {getattr(config, name)!r}" for name, default in _FIELDS
             if getattr(config, name) != default]
    return "{" + ", ".join(items) + "}"


@functools.lru_cache(maxsize=256)
def decode_config(text: str) -> GemmConfig | None:
    """The GemmConfig an encode_config string stands for (validated like a new one)."""
    if not text:
        return None
    fields = ast.literal_eval(text)
    if not isinstance(fields, dict):
        raise ValueError(f"not an encoded GemmConfig: {text!r}")
    return GemmConfig(**fields)


# ---------------------------------------------------------------------------------------------
# The Python side: what ops/api.py calls while tracing


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor | None = None, *, out: Tensor | None = None,
               config: GemmConfig | None = None, out_dtype: torch.dtype | None = None
               ) -> Tensor:
    text = encode_config(config)
    check_traced_args({"x": x, "w": w, "offs": offs}, out_dtype, out=out)
    if out is None:
        return torch.ops.moe_gemm._grouped_mm(x, w, offs, text, out_dtype)
    if differentiable_out(out, out_dtype, x, w):
        y = torch.ops.moe_gemm._grouped_mm(x, w, offs, text, out.dtype)
        return write_rows(out, y, offs)
    torch.ops.moe_gemm._grouped_mm_out(x, w, offs, out, text, out_dtype)
    return out


def grouped_gemm(a: Any, b: Any, *, out: Any = None, config: GemmConfig | None = None,
                 out_dtype: torch.dtype | None = None) -> list[Tensor]:
    text = encode_config(config)
    a, b = _as_tensor_list("a", a, "(M_i, K_i)"), _as_tensor_list("b", b, "(K_i, N_i)")
    check_traced_args(out_dtype=out_dtype)
    if out is None:
        return list(torch.ops.moe_gemm._grouped_gemm(a, b, text, out_dtype))
    out = _as_tensor_list("out", out, "(M_i, N_i)")
    check_traced_outs(out)
    if out and grad_tracked(*a, *b):
        # (eager's checks of out first: count, shapes, one dtype, out_dtype's)
        torch.ops.moe_gemm._check_gemm_outs(detached(a), detached(b), out, out_dtype)
        ys = torch.ops.moe_gemm._grouped_gemm(a, b, text, out[0].dtype)
        return [write_rows(o, y, None, f"out[{i}]") for i, (o, y) in enumerate(zip(out, ys))]
    torch.ops.moe_gemm._grouped_gemm_out(a, b, out, text, out_dtype)
    return out


def detached(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach() for t in tensors]


def check_traced_outs(outs: list[Tensor]) -> None:
    """check_traced_args of each tensor of a list `out` (_as_tensor_list made it)."""
    for i, o in enumerate(outs):
        check_traced_args(out=o, out_name=f"out[{i}]")


def grad_tracked(*inputs: Tensor | None) -> bool:
    """Grad on and an input requiring it: a traced call must then stay differentiable."""
    return torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in inputs)


def differentiable_out(out: Tensor, out_dtype: torch.dtype | None,
                       *inputs: Tensor | None) -> bool:
    """Whether a traced call with `out` must be differentiable (grad on, an input requiring
    it): then it runs the functional op, whose registered autograd links the result, and
    copies into `out` (write_rows), as the eager call's in-place write is differentiable. The
    `_out` ops run under no_grad and have no autograd: through them the gradient would be
    lost without a word."""
    if not grad_tracked(*inputs):
        return False
    if out_dtype is not None and out_dtype != out.dtype:
        # (a TypeError, as the eager call's check of out's dtype)
        raise TypeError(f"out must have dtype {out_dtype} (out_dtype); got {out.dtype}: give "
                        "one of them or make them agree")
    return True


# The tensor arguments of the ops that may be None (the others, x, w, scales, masked_m, must
# be tensors).
OPTIONAL_TENSORS = frozenset(("offs", "row_index", "bias", "row_weight"))


def check_traced_args(tensors: dict[str, Any] | None = None, out_dtype: Any = None,
                      reals: dict[str, Any] | None = None,
                      out: Any = None, out_name: str = "out") -> None:
    """The argument checks eager makes that a traced call must make itself: the op's schema
    would refuse wrong types with torch's own message (or coerce them), and the registered
    ops run under no_grad, where eager's refusal of an `out` autograd tracks cannot fire.
    tensors: tensor arguments (None allowed for OPTIONAL_TENSORS); reals: numbers (symbols that torch.compile traces in
    place of ints and floats pass); out: the output."""
    for name, t in (tensors or {}).items():
        if not isinstance(t, Tensor) and (t is not None or name not in OPTIONAL_TENSORS):
            maybe = " or None" if name in OPTIONAL_TENSORS else ""
            raise TypeError(f"{name} must be a torch.Tensor{maybe}; got {type(t).__name__}")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None; got {out_dtype!r}")
    for name, v in (reals or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float, torch.SymInt, torch.SymFloat)):
            raise TypeError(f"{name} must be a real number; got {type(v).__name__}")
    if out is not None:
        if not isinstance(out, Tensor):
            raise TypeError(f"{out_name} must be a torch.Tensor or None; got "
                            f"{type(out).__name__}")
        check_out_untracked(out_name, out)


def traced_int(name: str, v: Any) -> int | torch.SymInt | None:
    """An optional int argument of a traced call as the op schema takes it: None, an int
    (numpy's integer scalars as ints) or a traced symbol; a TypeError for anything else, a
    bool included (eager's check, before the schema could coerce it)."""
    if v is None or isinstance(v, torch.SymInt):
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int or None; got {type(v).__name__}")
    return int(v)


def write_rows(out: Tensor, y: Tensor, offs: Tensor | None, name: str = "out") -> Tensor:
    """out's rows that the op writes set to y's, differentiably (rows before offs[-1] for
    the 2-D forms, all rows of a 3-D or general result; the others keep their values, as the
    eager call leaves them)."""
    if tuple(out.shape) != tuple(y.shape) or out.device != y.device:
        raise ValueError(f"{name} must be {shape_text(y)} on {y.device}; got "
                         f"{shape_text(out)} on {out.device}")
    if offs is None:
        return out.copy_(y)
    if offs.shape[0] == 0:
        return out  # (no expert: no row written)
    written = torch.arange(out.shape[0], device=out.device) < offs[-1]
    return out.copy_(torch.where(written.unsqueeze(-1), y, out))


# ---------------------------------------------------------------------------------------------
# Registrations


def _eager() -> Any:
    from moe_gemm.ops import api  # (api imports this module)

    return api


def _in_graph() -> Any:
    """No grad (the op's registered autograd links the result) and nothing the launch
    allocates kept past the call: a compiled graph's memory may be a CUDA-graph pool
    (ops/launch_resources.graph_owned)."""
    from moe_gemm.ops import launch_resources

    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(launch_resources.graph_owned())
    return stack


@torch.library.custom_op(
    "moe_gemm::_grouped_mm", mutates_args=(),
    schema="(Tensor x, Tensor w, Tensor? offs, str config, ScalarType? out_dtype) -> Tensor")
def _grouped_mm(x, w, offs, config, out_dtype):
    with _in_graph():
        return _eager().grouped_mm_eager(x, w, offs, None, decode_config(config), out_dtype)


@_grouped_mm.register_fake
def _grouped_mm_fake(x, w, offs, config, out_dtype):
    if offs is None:
        bmm = check_grouped_bmm(x, w, None, out_dtype)
        return x.new_empty((bmm.G, bmm.M, bmm.N), dtype=bmm.out_dtype)
    mm = check_grouped_mm(x, w, offs, None, out_dtype, concrete=False)
    return x.new_empty((mm.T, mm.N), dtype=mm.out_dtype)


@torch.library.custom_op(
    "moe_gemm::_grouped_mm_out", mutates_args=("out",),
    schema="(Tensor x, Tensor w, Tensor? offs, Tensor(a!) out, str config, "
           "ScalarType? out_dtype) -> ()")
def _grouped_mm_out(x, w, offs, out, config, out_dtype):
    with _in_graph():
        _eager().grouped_mm_eager(x, w, offs, out, decode_config(config), out_dtype)


@_grouped_mm_out.register_fake
def _grouped_mm_out_fake(x, w, offs, out, config, out_dtype):
    if offs is None:
        check_grouped_bmm(x, w, out, out_dtype)
    else:
        check_grouped_mm(x, w, offs, out, out_dtype, concrete=False)


@torch.library.custom_op(
    "moe_gemm::_grouped_gemm", mutates_args=(),
    schema="(Tensor[] a, Tensor[] b, str config, ScalarType? out_dtype) -> Tensor[]")
def _grouped_gemm(a, b, config, out_dtype):
    # An op's outputs must not share storage (torch.library's aliasing rule), and the eager
    # path's own outputs are views of one block: here each gets its own allocation.
    args = check_grouped_gemm(a, b, None, out_dtype)
    outs = [torch.empty(m, n, dtype=args.out_dtype, device=args.device)
            for m, n, _ in args.sizes]
    with _in_graph():
        _eager().grouped_gemm_eager(a, b, outs, decode_config(config), args.out_dtype)
    return outs


@_grouped_gemm.register_fake
def _grouped_gemm_fake(a, b, config, out_dtype):
    args = check_grouped_gemm(a, b, None, out_dtype, concrete=False)
    return [ai.new_empty((m, n), dtype=args.out_dtype) for ai, (m, n, _) in zip(args.a,
                                                                                   args.sizes)]


@torch.library.custom_op(
    "moe_gemm::_grouped_gemm_out", mutates_args=("out",),
    schema="(Tensor[] a, Tensor[] b, Tensor(a!)[] out, str config, ScalarType? out_dtype) -> ()")
def _grouped_gemm_out(a, b, out, config, out_dtype):
    with _in_graph():
        _eager().grouped_gemm_eager(a, b, out, decode_config(config), out_dtype)


@_grouped_gemm_out.register_fake
def _grouped_gemm_out_fake(a, b, out, config, out_dtype):
    check_grouped_gemm(a, b, out, out_dtype, concrete=False)


# A traced call with `out` that must stay differentiable runs the functional op and copies its
# results into `out` (differentiable_out): eager's checks of `out` then run through this op, at
# trace time on fake tensors and when the graph runs on real ones, the overlap of two outputs
# included (a traced call has no memory to compare, and copying into outputs that share memory
# gave a wrong result without a word). It declares `out` mutated, though it writes nothing, so
# that the compiled graph keeps it (an op with no result and no mutation is dead code).
@torch.library.custom_op(
    "moe_gemm::_check_gemm_outs", mutates_args=("out",),
    schema="(Tensor[] a, Tensor[] b, Tensor(a!)[] out, ScalarType? out_dtype) -> ()")
def _check_gemm_outs(a, b, out, out_dtype):
    check_grouped_gemm(a, b, out, out_dtype)


@_check_gemm_outs.register_fake
def _check_gemm_outs_fake(a, b, out, out_dtype):
    check_grouped_gemm(a, b, out, out_dtype, concrete=False)


# ---------------------------------------------------------------------------------------------
# Autograd: torch's gradients where torch's ops ran, else a backward that raises when it runs


@torch.library.custom_op(
    "moe_gemm::_no_backward", mutates_args=(),
    schema="(Tensor grad, SymInt[] size, ScalarType dtype, str message) -> Tensor")
def _no_backward(grad, size, dtype, message):
    raise RuntimeError(message)


@_no_backward.register_fake
def _no_backward_fake(grad, size, dtype, message):
    return grad.new_empty(size, dtype=dtype)


def _raising_grad(grad: Tensor, like: tuple, op: str) -> Tensor:
    return raise_in_backward(grad, like, NO_BACKWARD.format(op=op))


def raise_in_backward(grad: Tensor, like: tuple, message: str) -> Tensor:
    """A gradient shaped like `like` (shape, dtype) whose computation raises `message` when
    the backward runs (not when it is traced)."""
    return torch.ops.moe_gemm._no_backward(grad, like[0], like[1], message)


# Where the forward ran torch's own ops (asked for with GemmConfig(backend="torch"), off the
# GPU, where the kernels never run, or for inputs the kernels do not take), the gradients are
# those of eager autograd through that path: fp32 products rounded to each operand's dtype
# (on a GPU eager may take torch's grouped_mm there, whose gradients agree up to rounding),
# computed by one more registered op (opaque to the tracer like the forward; autograd does not
# run inside a registered op, hence the products written out). That op decides at run time,
# as the forward did; where the kernels ran it raises: they stay inference-only, as in eager.


def _pinned_cute(config: str) -> bool:
    """GemmConfig(backend="cute"): the forward ran the kernels (or raised)."""
    cfg = decode_config(config)
    return cfg is not None and cfg.backend == "cute"


def _check_torch_ran(ran_torch: bool, op: str) -> None:
    if not ran_torch:
        raise RuntimeError(NO_BACKWARD.format(op=op))


def _prod(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """a @ b (or batched) accumulated in fp32, rounded to dtype."""
    return torch.matmul(a.float(), b.float()).to(dtype)


@torch.library.custom_op(
    "moe_gemm::_grouped_mm_grad", mutates_args=(),
    schema="(Tensor grad, Tensor x, Tensor w, Tensor? offs, str config, ScalarType? out_dtype)"
           " -> (Tensor, Tensor)")
def _grouped_mm_grad(grad, x, w, offs, config, out_dtype):
    # (at run time, on the forward's own tensors: the same choice the forward made)
    _check_torch_ran(_eager().grouped_mm_runs_torch(x, w, offs, decode_config(config),
                                                    out_dtype), "_grouped_mm")
    if offs is None:  # batched: (G, M, K) @ (G, K, N)
        return _prod(grad, w.transpose(1, 2), x.dtype), _prod(x.transpose(1, 2), grad, w.dtype)
    gx, gw = torch.zeros_like(x, memory_format=torch.contiguous_format), torch.zeros_like(
        w, memory_format=torch.contiguous_format)
    # The forward's rows of each expert (offs clamped into [0, T], a decreasing entry an empty
    # expert: GPU values are unchecked); rows past offs[-1] never reached y: zero.
    for e, start, end in expert_spans(offs, x.shape[0]):
        gx[start:end] = _prod(grad[start:end], w[e].t(), x.dtype)
        gw[e] = _prod(x[start:end].t(), grad[start:end], w.dtype)
    return gx, gw


@_grouped_mm_grad.register_fake
def _grouped_mm_grad_fake(grad, x, w, offs, config, out_dtype):
    return x.new_empty(x.shape), w.new_empty(w.shape)


@torch.library.custom_op(
    "moe_gemm::_grouped_gemm_grad", mutates_args=(),
    schema="(Tensor[] grads, Tensor[] a, Tensor[] b, str config, ScalarType? out_dtype)"
           " -> Tensor[]")
def _grouped_gemm_grad(grads, a, b, config, out_dtype):
    _check_torch_ran(_eager().grouped_gemm_runs_torch(a, b, decode_config(config), out_dtype),
                     "_grouped_gemm")
    ga = [_prod(g, bi.t(), ai.dtype) for g, ai, bi in zip(grads, a, b)]
    gb = [_prod(ai.t(), g, bi.dtype) for g, ai, bi in zip(grads, a, b)]
    return ga + gb


@_grouped_gemm_grad.register_fake
def _grouped_gemm_grad_fake(grads, a, b, config, out_dtype):
    return [t.new_empty(t.shape) for t in (*a, *b)]


@torch.library.custom_op("moe_gemm::_inference_only", mutates_args=(),
                         schema="(Tensor y, str message) -> Tensor")
def _inference_only(y, message):
    return y.clone()  # (a registered op's output may not alias its input)


@_inference_only.register_fake
def _inference_only_fake(y, message):
    return torch.empty_like(y)


def _inference_only_setup(ctx, inputs, output) -> None:
    ctx.meta = (inputs[0].shape, inputs[0].dtype)
    ctx.message = inputs[1]


def _inference_only_backward(ctx, grad):
    return raise_in_backward(grad, ctx.meta, ctx.message), None


_inference_only.register_autograd(_inference_only_backward, setup_context=_inference_only_setup)


def mark_inference_only(y: Tensor, message: str) -> Tensor:
    """y (a copy) with a backward that raises `message`: what ops/autograd.inference_only
    does in eager, for a traced graph (the MoE layers, inference-only also where the grouped
    GEMMs' own ops are differentiable)."""
    return torch.ops.moe_gemm._inference_only(y, message)


# Which path the forward took is known from the config alone only for backend="cute"; the
# automatic choice also reads the tensors' strides and addresses (ops/support.py), so the
# `_grad` ops make it again at run time, from the saved inputs.


def _mm_setup(ctx, inputs, output) -> None:
    x, w, offs, config, out_dtype = inputs
    ctx.metas = ((x.shape, x.dtype), (w.shape, w.dtype))
    ctx.args = (config, out_dtype)
    ctx.kernels_only = _pinned_cute(config)
    if not ctx.kernels_only:
        ctx.save_for_backward(x, w, offs)


def _mm_backward(ctx, grad):
    need = ctx.needs_input_grad[:2]
    if not ctx.kernels_only:
        x, w, offs = ctx.saved_tensors
        grads = torch.ops.moe_gemm._grouped_mm_grad(grad, x, w, offs, *ctx.args)
    else:
        grads = [_raising_grad(grad, m, "_grouped_mm") for m in ctx.metas]
    gx, gw = (g if n else None for g, n in zip(grads, need))
    return gx, gw, None, None, None


def _gemm_setup(ctx, inputs, output) -> None:
    a, b, config, out_dtype = inputs
    ctx.metas = ([(t.shape, t.dtype) for t in a], [(t.shape, t.dtype) for t in b])
    ctx.args = (config, out_dtype)
    ctx.kernels_only = _pinned_cute(config)
    if not ctx.kernels_only:
        ctx.save_for_backward(*a, *b)


def _gemm_backward(ctx, grads):
    grad = next((g for g in grads if g is not None), None)
    if grad is None:
        return None, None, None, None
    G = len(ctx.metas[0])
    if not ctx.kernels_only:
        saved = ctx.saved_tensors
        a, b = list(saved[:G]), list(saved[G:])
        filled = [torch.zeros(t.shape[0], u.shape[1], dtype=grad.dtype, device=grad.device)
                  if g is None else g for g, t, u in zip(grads, a, b)]
        got = torch.ops.moe_gemm._grouped_gemm_grad(filled, a, b, *ctx.args)
        return list(got[:G]), list(got[G:]), None, None
    ga = [_raising_grad(grad, m, "_grouped_gemm") for m in ctx.metas[0]]
    gb = [_raising_grad(grad, m, "_grouped_gemm") for m in ctx.metas[1]]
    return ga, gb, None, None


# ---------------------------------------------------------------------------------------------
# FLOP counts for torch.utils.flop_counter.FlopCounterMode (which sees the registered ops, not
# what they run), from shapes alone: every row of x counts, also rows past offs[-1], which the
# kernels skip. A gradient op counts both products of the backward (2x the forward).


def _mm_flops(x_shape, w_shape) -> int:
    rows = math.prod(x_shape[:-1])
    return 2 * rows * x_shape[-1] * w_shape[-1]


def _gemm_flops(a_shapes, b_shapes) -> int:
    return sum(2 * m * k * n for (m, k), (_, n) in zip(a_shapes, b_shapes))


@register_flop_formula([torch.ops.moe_gemm._grouped_mm, torch.ops.moe_gemm._grouped_mm_out])
def _grouped_mm_flop(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(x_shape, w_shape)


@register_flop_formula(torch.ops.moe_gemm._grouped_mm_grad)
def _grouped_mm_grad_flop(grad_shape, x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _mm_flops(x_shape, w_shape)


@register_flop_formula([torch.ops.moe_gemm._grouped_gemm, torch.ops.moe_gemm._grouped_gemm_out])
def _grouped_gemm_flop(a_shapes, b_shapes, *args, out_shape=None, **kwargs) -> int:
    return _gemm_flops(a_shapes, b_shapes)


@register_flop_formula(torch.ops.moe_gemm._grouped_gemm_grad)
def _grouped_gemm_grad_flop(grad_shapes, a_shapes, b_shapes, *args, out_shape=None,
                            **kwargs) -> int:
    return 2 * _gemm_flops(a_shapes, b_shapes)


def share_flop_formulas() -> None:
    """Give the FlopCounterModes running now moe_gemm's FLOP formulas. A FlopCounterMode
    copies torch's formula registry when it is made, and `import moe_gemm` registers the ops
    at the first use of a public name: a first use inside `with FlopCounterMode()` would
    otherwise count 0 for every moe_gemm op of that block (moe_gemm._load calls this)."""
    from torch.utils import flop_counter
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    ours = {op: f for op, f in flop_counter.flop_registry.items()
            if getattr(op, "_qualified_op_name", "").startswith("moe_gemm::")}
    for mode in _get_current_dispatch_mode_stack():
        counter = getattr(mode, "counter", None)
        if isinstance(counter, flop_counter.FlopCounterMode):
            for op, f in ours.items():
                counter.flop_registry.setdefault(op, f)


_grouped_mm.register_autograd(_mm_backward, setup_context=_mm_setup)
_grouped_gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)

# torch.vmap: each batch entry through the op, results stacked (ops/vmap.py).
register_loop_vmap(_grouped_mm, _grouped_mm_out, _grouped_gemm, _grouped_gemm_out,
                   _check_gemm_outs,
                   _grouped_mm_grad, _grouped_gemm_grad, _no_backward, _inference_only)
