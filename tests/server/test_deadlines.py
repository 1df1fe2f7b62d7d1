"""A request's deadline (deadlines.DeadlinesMixin): its timeout from its arrival, capped by the
operator's default, and work awaited under it answered 504 when it passes."""

from __future__ import annotations

import asyncio
import time

import pytest

from moe_gemm_server.deadlines import MAX_TIMEOUT_US, DeadlinesMixin
from moe_gemm_server.errors import APIError
from moe_gemm_server.metrics import Metrics


class _Settings:
    def __init__(self, default_timeout_us: int) -> None:
        self.default_timeout_us = default_timeout_us


class _Request:
    def __init__(self, arrival: float) -> None:
        self.scope = {"state": {"t_arrival": arrival}}


def _service(default_us: int) -> DeadlinesMixin:
    s = DeadlinesMixin()
    s.settings = _Settings(default_us)  # type: ignore[assignment]
    s.metrics = Metrics()
    return s


@pytest.mark.parametrize("default_us, timeout_us, want_s", [
    (0, None, None),             # no timeout anywhere: no deadline
    (0, 0, None),
    (0, 2_000_000, 2.0),         # the request's own
    (5_000_000, None, 5.0),      # the operator's default
    (5_000_000, 2_000_000, 2.0),  # a request may shorten the default ...
    (5_000_000, 9_000_000, 5.0),  # ... never lengthen it
    (0, MAX_TIMEOUT_US + 1, None),  # past a year: none (no float overflow)
    (0, 10**30, None),
])
def test_deadline_counts_from_arrival_and_the_default_caps_it(default_us, timeout_us, want_s):
    arrival = 1000.0
    got = _service(default_us).deadline_for(_Request(arrival), timeout_us)  # type: ignore[arg-type]
    assert got == (None if want_s is None else arrival + want_s)


def test_by_deadline_returns_the_work_or_answers_504_when_it_passes():
    s = _service(0)

    async def slow(seconds: float, value: str) -> str:
        await asyncio.sleep(seconds)
        return value

    async def main() -> None:
        assert await s.by_deadline(None, slow(0.01, "no deadline")) == "no deadline"
        assert await s.by_deadline(time.monotonic() + 5, slow(0.01, "in time")) == "in time"
        t0 = time.monotonic()
        with pytest.raises(APIError) as info:
            await s.by_deadline(t0 + 0.05, slow(5, "late"))
        assert info.value.status == 504 and time.monotonic() - t0 < 2
        with pytest.raises(APIError):  # a deadline already passed: 504 at once
            await s.by_deadline(t0 - 1, slow(5, "late"))

        async def fails() -> None:
            raise TimeoutError("the work's own")

        with pytest.raises(TimeoutError, match="the work's own"):  # its own error stays its own
            await s.by_deadline(time.monotonic() + 5, fails())

    asyncio.run(main())
    assert s.metrics.rejections.labels("timeout")._value.get() == 2
