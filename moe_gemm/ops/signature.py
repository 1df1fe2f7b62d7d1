"""Recognising a repeated call by its tensors' metadata, for the cached launch plans.

A launch plan (ops/mm_launch.py, ops/general_launch.py) holds everything that follows from its
operands' types, dtypes, devices, sizes, strides and autograd flags: a later call whose tensors
agree on all of these skips validation, layout analysis and the kernel choice, and reads only
its data pointers.
`TensorSignature.check(*tensors)` answers "do these tensors agree" in one call, and
`PlanCache` keeps a few plans per bucket (a cheap key such as the problem count) behind their
signatures.

Why not a dict keyed by the metadata: reading it from Python costs ~0.45 us per tensor on the
CPU-only dev machine (seven C calls and the torch.Size and stride tuples they build), most of a
grouped_gemm call over hundreds of problems. torch.compile checks its compiled graphs' inputs
for the same properties in C++ (torch._C._dynamo.guards.TensorGuards: type, dispatch keys, the
lazily negated bit and inference tensors among them, dtype, device, requires_grad, sizes,
strides), ~60 ns per tensor here, ~0.3 us for grouped_mm's three tensors against ~1.5 us for
a tuple key. It is a private class, so it is used only after a self-test (it must accept equal
tensors and reject a change of each property) and otherwise the same comparison runs in
Python, slower but equal.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from moe_gemm.ops.validation import check_dense

_IS_NESTED = operator.attrgetter("is_nested")


def _props(t: torch.Tensor) -> tuple:
    """What a signature compares, read from Python (the fallback)."""
    return (type(t), t.dtype, t.device, t.shape, t.stride(), t.requires_grad, t.is_neg(),
            t.is_inference())


def _python_check(expected: tuple) -> Callable[..., bool]:
    def check(*tensors: Any) -> bool:
        if len(tensors) != len(expected):
            return False
        try:
            return tuple(map(_props, tensors)) == expected
        except (AttributeError, TypeError, RuntimeError):  # a non-tensor, or a nested tensor
            return False

    return check


def _guards_check(tensors: Sequence[torch.Tensor]) -> Callable[..., bool]:
    """check(*tensors) through TensorGuards. TensorGuards also requires its tensors to be
    distinct objects (torch.compile guards aliasing apart), while one tensor may well serve
    several problems here (`[w] * G`): a tensor that repeats is compared by identity with its
    first occurrence and left out of the guards."""
    from torch._C._dynamo.guards import TensorGuards

    first: dict[int, int] = {}
    unique, repeats = [], []
    for i, t in enumerate(tensors):
        j = first.setdefault(id(t), i)
        (unique if j == i else repeats).append((i, j))
    kept = [tensors[i] for i, _ in unique]
    guards = TensorGuards(
        *kept,
        dynamic_dims_sizes=[list(t.shape) for t in kept],
        dynamic_dims_strides=[list(t.stride()) for t in kept],
    )
    if not repeats:
        return guards.check  # (given another number of tensors it raises TypeError)
    check = guards.check
    pick = [i for i, _ in unique]
    again = [i for i, _ in repeats]
    of = [j for _, j in repeats]

    def check_with_repeats(*args: Any) -> bool:
        return (check(*[args[i] for i in pick])
                and all(map(operator.is_, [args[i] for i in again], [args[j] for j in of])))

    return check_with_repeats


@functools.lru_cache(maxsize=1)
def guards_usable() -> bool:
    """Whether TensorGuards is here and compares what a signature must (run once)."""
    try:
        base = torch.zeros(2, 3)
        check = _guards_check([base])
        same = torch.ones(2, 3)
        changed = [
            torch.zeros(3, 2),  # sizes
            torch.zeros(3, 2).t(),  # strides
            torch.zeros(2, 3, dtype=torch.float64),  # dtype
            torch._neg_view(torch.zeros(2, 3)),  # the lazily negated bit
            torch.zeros(2, 3, requires_grad=True),  # autograd
            torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False),  # type
        ]
        return bool(check(same)) and not any(check(t) for t in changed) and not check(3)
    except Exception:  # noqa: BLE001 - missing or changed: the Python comparison works
        return False


class TensorSignature:
    """The metadata of a fixed number of tensors; `check(*tensors)` -> whether others agree.

    check must be given exactly as many tensors as the signature was built from (PlanCache
    buckets by count); anything that is not a tensor never agrees.
    """

    __slots__ = ("check", "count")

    def __init__(self, tensors: Sequence[torch.Tensor], *, inference_mode: bool = False):
        self.count = len(tensors)
        self.check: Callable[..., bool] = (
            _guards_check(tensors) if guards_usable() else _python_check(
                tuple(map(_props, tensors))))
        if inference_mode:
            self.check = _in_inference_mode(self.check)


def _in_inference_mode(check: Callable[..., bool]) -> Callable[..., bool]:
    """check, agreeing only inside torch.inference_mode: the signature of a plan that writes
    an inference tensor, which a call outside inference mode must not write (torch refuses
    it; the kernel would not notice). Such a call misses the plan and the detailed path's
    checks raise torch's error. (TensorGuards' dispatch keys happen to differ inside and
    outside inference mode, the Python comparison's do not; this holds for both.) Plans
    writing normal tensors never pay this C call."""
    enabled = torch.is_inference_mode_enabled

    def checked(*tensors: Any) -> bool:
        return enabled() and check(*tensors)

    return checked


class PlanCache:
    """Plans behind their TensorSignatures, a few per bucket, most recently used first.

    A bucket is a cheap hashable the caller reads first (the problem count, a token count):
    lookups compare signatures only within it. Entries are immutable tuples replaced whole,
    so concurrent threads never see a half-updated bucket (at worst one loses a reordering).

    find keeps nested tensors (torch.nested) from the signature check: TensorGuards reads
    every tensor's strides before it compares anything, and a nested tensor's raise inside
    its C++ check, which cannot pass the error on: the process aborts. (Its check_verbose
    compares dispatch keys first, but costs ~12x as much; dynamo's guard managers translate
    the error, but take 8-30 us a tensor to build and import torch._dynamo.) The screen is
    one C-level pass of is_nested over the call's tensors, ~50 ns a tensor on the CPU-only
    dev machine against ~60 for the check, run only when an entry's `extra` matches. It costs
    grouped_gemm's lists the most (~25 us of ~165 on 256 problems there), and they keep it
    too: without it, a nested tensor in a list whose layout has a cached plan aborts the
    process.
    """

    def __init__(self, per_bucket: int = 8, buckets: int = 256):
        self.per_bucket = per_bucket
        self.buckets = buckets
        self._entries: dict[Hashable, tuple[tuple[TensorSignature, Hashable, Any], ...]] = {}
        self._lock = threading.Lock()

    def find(self, bucket: Hashable, extra: Hashable, tensors: Sequence[Any]) -> Any:
        """The plan whose `extra` equals this one and whose signature the tensors match."""
        entries = self._entries.get(bucket)
        if not entries:
            return None
        screened = False
        for i, (sig, ex, plan) in enumerate(entries):
            if ex != extra:
                continue
            if not screened:
                # A nested tensor matches no plan (the caller's detailed path names it), nor
                # does anything that is not a tensor (no is_nested).
                try:
                    if any(map(_IS_NESTED, tensors)):
                        return None
                except AttributeError:
                    return None
                screened = True
            if sig.check(*tensors):
                if i:
                    self._entries[bucket] = (entries[i], *entries[:i], *entries[i + 1:])
                return plan
        return None

    def add(self, bucket: Hashable, extra: Hashable, tensors: Sequence[torch.Tensor],
            plan: Any, *, out: torch.Tensor | None = None) -> None:
        """`out`: the call's output among `tensors`, if any. One made under
        torch.inference_mode limits the plan to calls inside inference mode (the others take
        the detailed path, whose checks refuse that write as torch does)."""
        entry = (TensorSignature(tensors, inference_mode=out is not None and out.is_inference()),
                 extra, plan)
        with self._lock:
            entries = self._entries.get(bucket, ())
            if not entries and len(self._entries) >= self.buckets:
                self._entries.clear()  # (a rebuilt plan costs one slow call)
            self._entries[bucket] = (entry, *entries[: self.per_bucket - 1])

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())


def _meta(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (tuple(t.shape), t.dtype, t.device)


def _meta_text(meta: tuple | None) -> str:
    return "None" if meta is None else f"shape {meta[0]}, {meta[1]} on {meta[2]}"


class BuiltFor:
    """The tensor arguments a launch plan was built for, by position: each one's shape, dtype
    and device (None: an argument it was built without).

    A plan's call checks its tensors against it, so that a direct call with other tensors is
    a ValueError naming the expectation rather than a kernel launched with sizes, a grid and a
    workspace made for other shapes (a wrong or truncated result). The plan caches call the
    plans' launch instead: their signature has already compared all of this and more, and a
    second check would only add host time to every repeated call.
    """

    __slots__ = ("owner", "names", "expected")

    def __init__(self, owner: str, **tensors: torch.Tensor | None):
        self.owner = owner
        self.names = tuple(tensors)
        self.expected = tuple(map(_meta, tensors.values()))

    def check(self, *tensors: Any) -> None:
        """A TypeError for a non-tensor or a nested one, a ValueError for a tensor whose shape,
        dtype or device is not the plan's (or one given where the plan has none, or missing)."""
        for name, want, t in zip(self.names, self.expected, tensors):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.owner}: {name} must be a torch.Tensor or None; got "
                                f"{type(t).__name__}")
            check_dense(name, t)  # (before the shape read, which a nested tensor lacks)
            got = _meta(t)
            if got != want:
                raise ValueError(f"{self.owner} was built for {name} of {_meta_text(want)}; got "
                                 f"{_meta_text(got)} (build a new plan for other tensors)")


class CheckedPlan:
    """A launch plan's direct call: its tensors checked against the ones it was built for
    (`built_for`, set by the plan's constructor), then `launch(*tensors)`, which each plan
    defines. The plan caches, whose signatures already compared the tensors, call launch."""

    built_for: BuiltFor

    def __call__(self, *tensors: Any) -> Any:
        self.built_for.check(*tensors)
        return self.launch(*tensors)  # type: ignore[attr-defined]
