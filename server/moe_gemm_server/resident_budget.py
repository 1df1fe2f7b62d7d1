"""The resident budget (--max-resident-bytes): which weight sets fit now, and why one does not.

A set is admitted under the budget and its bytes are reserved from that check until it is
installed or fails (`_reserve`), so that loads in flight together (uploads, sets another server
wrote: sync.py) never overrun it between a check and an install. A replacement counts the
resident version it replaces as freed (the swap releases it), and only one replacement of a set
at a time may: two in flight together would otherwise both spend the same bytes, and the
device would hold the old version and both new ones. The reports say how the budget and the
device's memory stand at this moment, for the messages of the sets they refuse. Held by a
mixin the Service inherits through WeightsMixin.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from moe_gemm_server.engine import Engine

from .config import Settings
from .errors import APIError


class OverBudget(APIError):
    """507: a set of `nbytes` resident bytes does not fit under --max-resident-bytes now."""

    def __init__(self, nbytes: int, message: str) -> None:
        super().__init__(507, message, reason="over_budget")
        self.nbytes = nbytes


class ResidentBudget:
    """The Service's budget checks (it inherits them): they use its settings, engine and the
    bytes reserved by the loads in flight."""

    settings: Settings
    engine: Engine | None
    _reserved_bytes: int
    # names whose resident version a replacement in flight already counts as freed
    _credited: set[str]

    @contextlib.contextmanager
    def _reserve(self, name: str, nbytes: int) -> Iterator[None]:
        """Admit a set of `nbytes` under the budget (507 otherwise) and count its bytes as
        reserved until the block ends. The check and the reservation run with no await between
        them, so two loads in flight (an upload here, a set another server wrote: sync.py)
        never both pass a check that counted neither; end the block once the set is installed
        (or failed), so that its bytes are counted at every moment. A set that replaces the
        resident version of `name` counts that version's bytes as freed; until the block ends
        no other load of `name` may count them again."""
        credited = self._check_budget(name, nbytes)
        self._reserved_bytes += nbytes
        if credited:
            self._credited.add(name)
        try:
            yield
        finally:
            self._reserved_bytes -= nbytes
            if credited:
                self._credited.discard(name)

    def _budget_use(self, name: str) -> tuple[int, int]:
        """(bytes held by the resident sets and the loads in progress, of them the bytes of
        the resident version of `name`, which its replacement frees: 0 while another
        replacement in flight already counts them as freed)."""
        assert self.engine is not None
        replaced = 0 if name in self._credited else self._resident_version_bytes(name)
        return self.engine.resident_bytes + self._reserved_bytes, replaced

    def _resident_version_bytes(self, name: str) -> int:
        """Bytes of the resident version of `name` (0: none)."""
        assert self.engine is not None
        try:
            return self.engine.get_weights(name).nbytes
        except KeyError:
            return 0

    def fits_budget(self, name: str, nbytes: int) -> bool:
        """Whether a set `name` of `nbytes` would fit under --max-resident-bytes now (a
        replaced set's bytes count as freed: the swap releases them)."""
        budget = self.settings.max_resident_bytes
        if budget is None:
            return True
        resident, replaced = self._budget_use(name)
        return resident - replaced + nbytes <= budget

    def _check_budget(self, name: str, nbytes: int) -> bool:
        """OverBudget (507) unless fits_budget. Returns whether the check counted the bytes of
        a resident version of `name` as freed."""
        if not self.fits_budget(name, nbytes):
            raise OverBudget(nbytes, f"weight set {name!r} needs {nbytes} bytes but only "
                                     f"{self.budget_report(name)}; delete a set or raise the "
                                     "budget")
        return self.settings.max_resident_bytes is not None and self._budget_use(name)[1] > 0

    def budget_report(self, name: str) -> str:
        """How the resident budget stands at this moment, for a message about the set `name`
        (--max-resident-bytes is set): "F of the B-byte resident budget ... are free (R bytes
        held by ...)"."""
        budget = self.settings.max_resident_bytes
        assert budget is not None and self.engine is not None
        resident, replaced = self._budget_use(name)
        # "free" counts the replaced version's bytes; say so, or the free bytes and the bytes
        # held would not add up to the budget
        freed = (f", {replaced} of them by the version of {name!r} this upload replaces"
                 if replaced else
                 f", the version of {name!r} among them, which another replacement of it "
                 "in progress counts as freed" if name in self._credited
                 and self._resident_version_bytes(name) else "")
        return (f"{max(0, budget - resident + replaced)} of the {budget}-byte resident budget "
                f"(--max-resident-bytes) are free ({resident} bytes held by "
                f"{len(self.engine.weight_sets())} set(s) and uploads in progress{freed})")

    def memory_report(self) -> str:
        """What the device holds and has free at this moment, for a message about a set that
        does not fit in its memory: "cuda:0: R bytes held by S resident set(s), F of T bytes
        free" (without the free bytes where the platform does not tell them)."""
        assert self.engine is not None
        held = (f"{self.engine.device}: {self.engine.resident_bytes} bytes held by "
                f"{len(self.engine.weight_sets())} resident set(s)")
        memory = self.engine.free_memory()
        if memory is None:
            return held
        free, total = memory
        return f"{held}, {free} of {total} bytes free"
