"""torch.vmap for the registered ops: one call of the op per batch entry, results stacked.

The ops' eager paths read data pointers (the kernels) or write results into preallocated
tensors row range by row range (the torch backend), neither of which a vmap BatchedTensor
allows. Under vmap the public functions therefore call the registered ops (ops/api._traced),
and the rule below, registered on each of them, runs the op on every batch entry's plain
tensors (the same eager path as any call: kernels on a Hopper GPU, torch elsewhere) and
stacks the results. That costs one launch per entry, which is what a Python loop over the
batch would cost. The `_grad` ops get the same rule (a backward run inside vmap); vmap with
grad or jvp transforms keeps the eager path (in_vmap says why).

That eager path reads offs, masked_m and row_index on the host (checks, row ranges), which a
BatchedTensor cannot give: where vmap runs with grad (vmap(grad(f)), grad(vmap(f)), jacrev)
and one of them is batched (batched_values), the ops run through `per_entry`, an
autograd.Function whose vmap rule calls the eager op on each entry's plain tensors and whose
backward recomputes each entry's forward under autograd (one more forward per entry: the
torch backend's gradients, and the kernels' raising backward, exactly as an eager call's).
Reverse mode, first order only: forward-mode AD (jvp, jacfwd, hessian) and a second
derivative raise NotImplementedError naming the combination.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["batched_values", "check_out_batched", "in_vmap", "per_entry", "per_entry_into",
           "register_loop_vmap", "vmap_active"]

_Vmap = torch._C._functorch.TransformType.Vmap
_depth = torch._C._functorch.get_dynamic_layer_stack_depth
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_batched_tensor = torch._C._functorch.is_batchedtensor
_unwrapped = torch._C._functorch.get_unwrapped


def in_vmap() -> bool:
    """Whether torch.vmap (torch.func.vmap, nested or not) is running with no other functorch
    transform (grad, jvp) around or inside it. Only then do the public ops take the
    registered ops: those have no functorch autograd (torch.library's generated
    autograd.Function refuses grad and jvp transforms), so vmap(grad(f)), jacfwd and hessian
    keep the eager path, which differentiates the torch backend's ops (through per_entry
    where a value argument is batched: batched_values)."""
    return _depth() > 0 and all(k == _Vmap for k in _transforms())


def vmap_active() -> bool:
    """Whether a torch.vmap is running at any level (with other transforms or not)."""
    return _depth() > 0 and _Vmap in _transforms()


def functorch_active() -> bool:
    """Whether any torch.func transform (vmap, grad, jvp) is running."""
    return _depth() > 0


def _transforms() -> list[Any]:
    return [i.key() for i in torch._C._functorch.get_interpreter_stack()]


def _select(arg: Any, dim: Any, i: int) -> Any:
    """Batch entry i of one argument (a tensor, a list of tensors, or anything unbatched)."""
    if isinstance(dim, (list, tuple)):
        return [_select(a, d, i) for a, d in zip(arg, dim)]
    return arg if dim is None else arg.select(dim, i)


def _batched(dim: Any) -> bool:
    if isinstance(dim, (list, tuple)):
        return any(map(_batched, dim))
    return dim is not None


def _all_batched(dim: Any) -> bool:
    if isinstance(dim, (list, tuple)):
        return all(map(_all_batched, dim))
    return dim is not None


def _stack(results: list[Any]) -> tuple[Any, Any]:
    """(output, out_dims) of the per-entry results, every output batched at dim 0."""
    first = results[0]
    if first is None:  # a mutating `_out` op: the writes went into the batched `out`
        return None, None
    if isinstance(first, torch.Tensor):
        return torch.stack(results), 0
    stacked = [torch.stack(parts) for parts in zip(*results)]
    if isinstance(first, tuple):
        return tuple(stacked), (0,) * len(stacked)
    return stacked, [0] * len(stacked)


def _empty_batch(op: Any, in_dims: tuple, args: tuple) -> tuple[Any, Any]:
    """A mapped dimension of size 0: the op's fake implementation on meta tensors of one
    entry's shape gives the shapes and dtypes, and the results are empty batches of them
    (as torch.vmap returns for torch's own ops)."""
    device = next(t.device for t in _tensors(args))

    def entry(arg: Any, dim: Any) -> Any:
        if isinstance(dim, (list, tuple)):
            return [entry(a, d) for a, d in zip(arg, dim)]
        if not isinstance(arg, torch.Tensor):
            return arg
        shape = list(arg.shape)
        if dim is not None:
            del shape[dim]
        return torch.empty(shape, dtype=arg.dtype, device="meta")

    like = op(*(entry(a, d) for a, d in zip(args, in_dims)))
    if like is None:
        return None, None
    empty = lambda t: torch.empty((0, *t.shape), dtype=t.dtype, device=device)  # noqa: E731
    if isinstance(like, torch.Tensor):
        return empty(like), 0
    if isinstance(like, tuple):
        return tuple(map(empty, like)), (0,) * len(like)
    return [empty(t) for t in like], [0] * len(like)


def _tensors(args: Any) -> Any:
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _tensors(a)
        elif isinstance(a, torch.Tensor):
            yield a


def register_loop_vmap(*ops: Any) -> None:
    """Register the per-entry loop as the vmap rule of each torch.library custom op."""
    for op in ops:
        op.register_vmap(_loop_rule(op))


def _loop_rule(op: Any) -> Any:
    schema = op._opoverload._schema
    name = schema.name
    written = [i for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]

    def rule(info: Any, in_dims: tuple, *args: Any) -> tuple[Any, Any]:
        for i in written:
            if not _all_batched(in_dims[i]) and any(map(_batched, in_dims)):
                arg = schema.arguments[i].name
                raise ValueError(
                    f"{name} under torch.vmap: `{arg}` is written in place and must be "
                    f"batched like the inputs (pass a batched `{arg}`, or leave it None and "
                    f"let the op return a new tensor)")
        if info.batch_size == 0:
            return _empty_batch(op, in_dims, args)
        results = [op(*(_select(a, d, b) for a, d in zip(args, in_dims)))
                   for b in range(info.batch_size)]
        return _stack(results)

    return rule


# ---------------------------------------------------------------------------------------------
# vmap with grad: batched value arguments


def batched_values(*values: Any) -> bool:
    """Whether a torch.vmap running with another transform (grad, jvp: not in_vmap) batches
    one of these value arguments (offs, masked_m, row_index: the eager path reads them on the
    host, which a BatchedTensor refuses). Then the op takes `per_entry`."""
    if not (_depth() > 0 and _Vmap in _transforms()):
        return False
    return any(v is not None and _is_batched(v) for v in values)


def check_out_batched(op: str, outs: Any, inputs: Any) -> None:
    """The eager path under torch.vmap with grad (not in_vmap): an `out` (a tensor or a list
    of them) that is not batched where an input is, a ValueError as the registered ops' vmap
    rule raises it (the write of a batched result into it raised torch's RuntimeError)."""
    if not vmap_active() or not any(map(_is_batched, inputs)):
        return
    for o in (outs if isinstance(outs, (list, tuple)) else (outs,)):
        if isinstance(o, torch.Tensor) and not _is_batched(o):
            raise ValueError(
                f"{op} under torch.vmap: `out` is written in place and must be batched like "
                f"the inputs (pass a batched `out`, or leave it None and let the op return a "
                f"new tensor)")


def _is_batched(t: Any) -> bool:
    """t, or a tensor it wraps (grad's wrappers sit around vmap's and inside them), is a
    BatchedTensor."""
    while isinstance(t, torch.Tensor) and _wrapped(t):
        if _batched_tensor(t):
            return True
        t = _unwrapped(t)
    return False


def per_entry(call: Callable[..., torch.Tensor], *tensors: Any) -> torch.Tensor:
    """call(*tensors) (an eager op of tensors and Nones, one tensor out) where batched_values:
    under vmap, call runs on each entry's plain tensors and the results are stacked; its
    backward is each entry's, by the same eager op run again under autograd."""
    return _PerEntry.apply(call, *tensors)


def per_entry_into(out: Any, out_dtype: Any, run: Callable[[Any], torch.Tensor],
                   write: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """run(out_dtype) (a per_entry call), written into `out` by write(out, y) where one is
    given: y computed in out's dtype (out_dtype, if given too, must agree, as eager's check
    asks), write copying the rows the op writes, differentiably, as the traced ops do."""
    if out is None:
        return run(out_dtype)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None; got {type(out).__name__}")
    if out_dtype is not None and out_dtype != out.dtype:
        raise TypeError(f"out must have dtype {out_dtype}; got {out.dtype}")
    return write(out, run(out.dtype))


_FORWARD_AD = ("{what} of moe_gemm's ops under torch.vmap with batched offs, masked_m or "
               "row_index is not supported: they differentiate per batch entry in reverse "
               "mode, first order (vmap(grad(f)), grad(vmap(f)), jacrev); batch only the "
               "other arguments, or loop over the entries")


def _entry_shape(t: torch.Tensor, dim: int | None) -> list[int]:
    shape = list(t.shape)
    if dim is not None:
        del shape[dim]
    return shape


def _entries(args: tuple, dims: tuple, batch_size: int) -> list[tuple]:
    return [tuple(_select(a, d, b) for a, d in zip(args, dims)) for b in range(batch_size)]


class _PerEntry(torch.autograd.Function):
    """per_entry's forward (the eager op), vmap rule (the op per entry) and backward."""

    @staticmethod
    def forward(call: Callable[..., torch.Tensor], *tensors: Any) -> torch.Tensor:
        return call(*tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.call = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        needs = tuple(ctx.needs_input_grad[1:])
        if not any(needs):
            return (None,) * (1 + len(needs))
        return (None, *_PerEntryVjp.apply(ctx.call, needs, grad, *ctx.saved_tensors))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, call: Any, *tensors: Any) -> tuple[Any, Any]:
        if info.batch_size == 0:  # (the op on meta tensors of an entry's shape: its fake)
            return _empty_batch(call, in_dims[1:], tensors)
        return _stack([_PerEntry.apply(call, *entry)
                       for entry in _entries(tensors, in_dims[1:], info.batch_size)])

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(_FORWARD_AD.format(what="Forward-mode AD (jvp, jacfwd)"))


class _PerEntryVjp(torch.autograd.Function):
    """_PerEntry's backward: the gradients of the inputs marked in `needs` (None for the
    others; zeros for one the result does not depend on), by the eager op run again on each
    entry under autograd."""

    @staticmethod
    def forward(call: Callable[..., torch.Tensor], needs: tuple, grad: torch.Tensor,
                *tensors: Any) -> tuple:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() if n else t for t, n in zip(tensors, needs)]
            wrt = [t for t, n in zip(leaves, needs) if n]
            got = iter(torch.autograd.grad(call(*leaves), wrt, grad, allow_unused=True))
        grads = []
        for t, n in zip(tensors, needs):
            g = next(got) if n else None
            grads.append(torch.zeros_like(t) if n and g is None else g)
        return tuple(grads)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        pass  # (no second derivative: backward raises)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError(_FORWARD_AD.format(what="A second derivative"))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, call: Any, needs: tuple, grad: Any,
             *tensors: Any) -> tuple[Any, Any]:
        results = [_PerEntryVjp.apply(call, needs, *entry)
                   for entry in _entries((grad, *tensors), in_dims[2:], info.batch_size)]
        if not results:  # (an empty batch: empty gradients of an entry's shapes)
            return (tuple(t.new_zeros((0, *_entry_shape(t, d))) if n else None
                          for t, d, n in zip(tensors, in_dims[3:], needs)),
                    tuple(0 if n else None for n in needs))
        outs = [None if parts[0] is None else torch.stack(parts) for parts in zip(*results)]
        return tuple(outs), tuple(None if o is None else 0 for o in outs)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise NotImplementedError(_FORWARD_AD.format(what="Forward-mode AD (jvp, jacfwd)"))
