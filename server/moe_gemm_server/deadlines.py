"""A request's deadline: its timeout counted from its arrival, and the wait for its body under it.

Service inherits DeadlinesMixin; the routers ask it for a request's deadline (deadline_for) and
receive and decode its body under that deadline (by_deadline), so a request's timeout covers its
body's arrival as well as its wait in the queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from .config import Settings
from .errors import APIError
from .metrics import Metrics

T = TypeVar("T")

# Beyond a year a timeout means none (and a huge integer would overflow a float).
MAX_TIMEOUT_US = 365 * 24 * 3600 * 10**6


class DeadlinesMixin:
    """Service's deadline methods (Service inherits them); they use its settings and
    metrics."""

    settings: Settings
    metrics: Metrics

    def deadline_for(self, request: Request, timeout_us: int | None) -> float | None:
        """The monotonic time by which the request must be answered: its timeout (us; None
        or 0 = the operator's default, which also caps it) from its arrival; None = no
        deadline."""
        default = self.settings.default_timeout_us
        us = timeout_us if timeout_us else default
        if default and us > default:
            # The model config says allow_timeout_override, which in Triton's queue policy lets
            # a request shorten the operator's default timeout, never lengthen (or remove) it.
            us = default
        if not us:
            return None
        arrival = request.scope.get("state", {}).get("t_arrival", time.monotonic())
        return None if us > MAX_TIMEOUT_US else arrival + us / 1e6

    async def by_deadline(self, deadline: float | None, work: Awaitable[T]) -> T:
        """`work` (receiving and decoding a request's body) awaited until `deadline` at most:
        a body still arriving, or still being decoded, when the request's timeout passes is
        answered 504 then, as a queued request is (a slow body otherwise got its 504 only once
        its last byte came, or a 408 at --body-timeout-s). A decode running in a worker
        thread finishes there unawaited."""
        if deadline is None:
            return await work
        # (asyncio.wait rather than wait_for: a TimeoutError the work raises itself stays its
        # own, and wait_for's timer can fire a hair before `deadline` reads as passed)
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task in done:
            return task.result()
        # (cancelled, not awaited: its end is no concern of the answer; the callback reads
        # an error it might still raise, which asyncio would otherwise log as never retrieved)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        task.cancel()
        self.metrics.rejections.labels("timeout").inc()
        raise APIError(504, "the request's timeout expired before its body was received and "
                            "decoded")
