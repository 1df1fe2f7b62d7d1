"""The v2 statistics book: a deleted weight set's late requests do not count toward a new set
of the same name."""

from __future__ import annotations

from moe_gemm_server.metrics import StatsBook


def _counts(book: StatsBook, name: str) -> tuple[int, int, int, int]:
    s = book.as_v2(name)
    inf = s["inference_stats"]
    return (s["execution_count"], inf["success"]["count"], inf["fail"]["count"],
            inf["queue"]["count"])


def test_requests_of_a_deleted_set_finishing_late_are_not_counted_for_its_successor():
    book = StatsBook()
    book.queued("w", 0.001, version=3)
    book.launch("w", 1, 8, 0.002, version=3)
    assert _counts(book, "w") == (1, 0, 0, 1)
    book.forget("w", version=3)  # deleted while one request of it is still finishing
    assert _counts(book, "w") == (0, 0, 0, 0)
    book.done("w", True, 0.004, version=3)  # the late answer of the deleted set
    book.launch("w", 1, 8, 0.002, version=3)
    book.queued("w", 0.001, version=3)
    assert _counts(book, "w") == (0, 0, 0, 0)
    # A new set of the same name (a newer version) counts from zero.
    book.queued("w", 0.001, version=5)
    book.launch("w", 2, 16, 0.002, version=5)
    book.done("w", False, 0.004, version=5)
    assert _counts(book, "w") == (1, 0, 1, 1)
    # Unversioned updates (ad-hoc grouped-gemm jobs) and other names are unaffected.
    book.done("w", True, 0.001)
    book.done("other", True, 0.001, version=1)
    assert _counts(book, "w") == (1, 1, 1, 1) and _counts(book, "other") == (0, 1, 0, 0)
