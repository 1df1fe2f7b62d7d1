"""Does an output share memory with an input or with another output?

The kernels read A and B while other CTAs already store D, and the torch backend writes one
expert at a time, so an `out` that overlaps an operand would give a silently wrong result.
The ops run such a call into a temporary and copy it into `out` (the result is then exactly
as if the operands had been cloned); outputs that overlap each other are an error, as they are
for torch's own out= functions.

Checks are host-only (shapes, strides, addresses) and cheap for the common cases: tensors in
different allocations are disjoint by their byte spans; two row-major 2-D views of one buffer
(e.g. column blocks of a wider matrix), or two column-major ones (row blocks of a transposed
buffer), are decided exactly; anything else whose spans meet is treated as overlapping (a copy
too many, never a wrong answer).
"""

from __future__ import annotations

import torch


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, one past the last byte] that t's elements can touch (None if empty)."""
    if t.numel() == 0:
        return None
    lo = hi = t.data_ptr()
    size = t.element_size()
    for n, s in zip(t.shape, t.stride()):
        ext = (n - 1) * s * size
        if ext < 0:
            lo += ext
        else:
            hi += ext
    return lo, hi + size


def _rows_disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two 2-D views certainly share no element: exact for row-major views of one
    row stride (_row_major_disjoint) and for column-major ones (their transposes are)."""
    if a.dim() != 2 or b.dim() != 2:
        return False
    return _row_major_disjoint(a, b) or _row_major_disjoint(a.t(), b.t())


def _row_major_disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact for two 2-D views with unit column stride, one row stride and one element size:
    True when no element of one is an element of the other."""
    if a.element_size() != b.element_size():
        return False
    (ma, na), (mb, nb) = a.shape, b.shape
    s0 = a.stride(0)
    if s0 != b.stride(0) or (na > 1 and a.stride(1) != 1) or (nb > 1 and b.stride(1) != 1):
        return False
    if s0 < max(na, nb) or s0 <= 0:
        return False
    d, rem = divmod(b.data_ptr() - a.data_ptr(), a.element_size())
    if rem:
        return False
    # b's row j starts at a's row q + j plus r elements (0 <= r < s0): it can meet a's row
    # q + j (when r < na) or a's row q + j + 1 (when r + nb > s0).
    q, r = divmod(d, s0)

    def rows_meet(shift: int) -> bool:  # some j in [0, mb) with 0 <= q + j + shift < ma
        return max(0, -(q + shift)) < min(mb, ma - (q + shift))

    return not ((r < na and rows_meet(0)) or (r + nb > s0 and rows_meet(1)))


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """False only when a and b certainly share no element."""
    sa, sb = _span(a), _span(b)
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False
    return not _rows_disjoint(a, b)


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def _ranges_meet(lo: int, hi: int, t: torch.Tensor) -> bool:
    """Whether t's storage shares a byte with [lo, hi)."""
    t_lo, t_hi = _storage_range(t)
    return t_lo < hi and lo < t_hi


def overlaps_any(out: torch.Tensor, tensors) -> bool:
    """may_overlap(out, t) for any t. First by allocation (each storage's byte range, the
    per-call cost on grouped_mm's out= path); spans only for tensors whose allocation meets
    out's. By range, not by storage identity: two storages can share memory (torch.from_numpy
    or from_dlpack of overlapping views), and an out one row ahead of x in another storage
    was taken as disjoint, so grouped_mm's torch path overwrote rows of x before reading
    them (grouped_gemm, which compares byte spans, was right). A non-strided out (sparse,
    mkldnn) has no storage to compare: False, so that the validation after it names the
    layout; likewise where an input has no storage or sizes to read (a sparse or nested
    tensor, which the plan caches' fast paths hand over unchecked). Under torch.func (grad,
    vmap) the wrapped tensors' memory is compared."""
    if out.layout != torch.strided:
        return False
    try:
        lo, hi = _storage_range(out)
        return any(_ranges_meet(lo, hi, t) and may_overlap(out, t)
                   for t in tensors if isinstance(t, torch.Tensor))
    except (RuntimeError, NotImplementedError):
        if any(isinstance(t, torch.Tensor) and (t.is_nested or t.layout != torch.strided)
               for t in (out, *tensors)):
            return False
        if any(isinstance(t, torch.Tensor) and _wrapped(t) for t in (out, *tensors)):
            # torch.func's wrappers (grad, vmap) have no storage of their own: the tensors
            # they wrap are compared (a batched one's whole batch: a copy too many at worst).
            # Read only here, where the storage read failed: no cost on the plain path.
            return overlaps_any(_innermost(out), [_innermost(t) for t in tensors
                                                  if isinstance(t, torch.Tensor)])
        raise


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _innermost(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under t's torch.func wrappers (t itself when it has none)."""
    while _wrapped(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


# Interleaved layouts up to this many elements have their offsets counted (128 MiB of int64 on
# the host at most); a larger one is taken as overlapping.
_COUNTED_MAX = 1 << 24


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Two of t's indices address one element (an expanded, zero-stride or as_strided view).

    torch answers 0 (no), 1 (yes: a zero stride) or 2 (too hard: any other layout that is
    not dense). Its 2 covers both plain strided views (a column slice, out[:, ::2]) and views
    whose strides interleave onto the same elements (as_strided((10, 8), (1, 1))): read as
    "no", the latter took the whole result, each write overwriting others, and returned it.
    Decided here: ordered by stride, each dim stepping past everything the smaller ones reach
    is disjoint (every plain strided view: no per-element work); otherwise the element
    offsets are counted, on the host from the sizes and strides alone (rare layouts; past
    _COUNTED_MAX elements such a layout counts as overlapping)."""
    answer = torch._debug_has_internal_overlap(t)
    if answer != 2:
        return answer == 1
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    reach = 0  # the largest offset the dims so far reach
    for s, n in dims:
        if s <= reach:
            break
        reach += (n - 1) * s
    else:
        return False
    if t.numel() > _COUNTED_MAX:
        return True  # (refused as possibly overlapping rather than counted on the host)
    offsets = torch.zeros((), dtype=torch.int64)
    for s, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s).flatten()
    return offsets.unique().numel() < offsets.numel()


def outputs_aliasing_inputs(outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[int]:
    """Indices of the outputs that may share memory with an input, after checking that no two
    outputs share memory (ValueError naming them). One sweep over the byte spans sorted by
    start (O(n log n) when nothing meets; inputs may overlap each other freely). Under
    torch.func (grad, vmap) the wrapped tensors' memory is compared, as overlaps_any does
    (the wrappers have no storage: reading their spans raised torch's RuntimeError)."""
    if any(map(_wrapped, outs)) or any(map(_wrapped, inputs)):
        outs, inputs = list(map(_innermost, outs)), list(map(_innermost, inputs))
    items = []
    for i, o in enumerate(outs):
        if (sp := _span(o)) is not None:
            items.append((sp[0], sp[1], True, i))
    for j, t in enumerate(inputs):
        if (sp := _span(t)) is not None:
            items.append((sp[0], sp[1], False, j))
    items.sort(key=lambda it: it[0])
    aliased: set[int] = set()
    active: list[tuple[int, bool, int]] = []  # (end, is_out, index) of spans still open
    for lo, hi, is_out, idx in items:
        active = [a for a in active if a[0] > lo]
        for _, other_out, jdx in active:
            if not (is_out or other_out):
                continue
            if is_out and other_out:
                if not _rows_disjoint(outs[jdx], outs[idx]):
                    a, b = sorted((idx, jdx))
                    raise ValueError(f"out[{a}] and out[{b}] share memory; each problem "
                                     f"needs its own output")
                continue
            o, t = (idx, jdx) if is_out else (jdx, idx)
            if o not in aliased and not _rows_disjoint(outs[o], inputs[t]):
                aliased.add(o)
        active.append((hi, is_out, idx))
    return sorted(aliased)
