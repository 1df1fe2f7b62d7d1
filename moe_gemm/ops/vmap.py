"""torch.vmap for the registered ops: one call of the op per batch entry, results stacked.

The ops' eager paths read data pointers (the kernels) or write results into preallocated
tensors row range by row range (the torch backend), neither of which a vmap BatchedTensor
allows. Under vmap the public functions therefore call the registered ops (ops/api._traced),
and the rule below, registered on each of them, runs the op on every batch entry's plain
tensors (the same eager path as any call: kernels on a Hopper GPU, torch elsewhere) and
stacks the results. That costs one launch per entry, which is what a Python loop over the
batch would cost. The `_grad` ops get the same rule (a backward run inside vmap); vmap with
grad or jvp transforms keeps the eager path (in_vmap says why).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["in_vmap", "register_loop_vmap", "vmap_active"]

_Vmap = torch._C._functorch.TransformType.Vmap
_depth = torch._C._functorch.get_dynamic_layer_stack_depth


def in_vmap() -> bool:
    """Whether torch.vmap (torch.func.vmap, nested or not) is running with no other functorch
    transform (grad, jvp) around or inside it. Only then do the public ops take the
    registered ops: those have no functorch autograd (torch.library's generated
    autograd.Function refuses grad and jvp transforms), so vmap(grad(f)), jacfwd and hessian
    keep the eager path, which differentiates the torch backend's ops."""
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
