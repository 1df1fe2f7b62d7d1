"""The batcher's scheduling on its own (no HTTP, no GPU): a fake launch function records
when each job ran."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from moe_gemm_server.batcher import Batcher, Job, JobTimeout
from moe_gemm_server.metrics import Metrics, StatsBook

DELAY_S = 0.4


def _batcher(ran: list[tuple[float, list[str]]], delay_s: float = DELAY_S) -> Batcher:
    def run(engine, jobs):
        ran.append((time.monotonic(), [j.request_id for j in jobs]))
        return [j.request_id for j in jobs]

    return Batcher(None, delay_s=delay_s, max_rows=1 << 20, max_flops=1 << 60,  # type: ignore[arg-type]
                   max_requests=64, max_queue=16, metrics=Metrics(), stats=StatsBook(), run=run)


def _job(name: str, key: str = "k", priority: int = 2, deadline: float | None = None) -> Job:
    return Job(kind="gemm", key=key, payload=([], []), rows=1, flops=1,
               out_dtype=torch.float32, priority=priority, deadline=deadline, request_id=name)


def test_a_job_behind_a_cancelled_head_waits_its_own_delay():
    async def scenario():
        ran: list = []
        b = _batcher(ran)
        b.start()
        first = _job("first")
        b.submit(first)
        await asyncio.sleep(0.1)  # the scheduler is waiting out first's delay
        # first leaves and second arrives before the scheduler runs again
        b.cancel(first, "cancelled")
        second = _job("second")
        fut = b.submit(second)
        assert await fut == "second"
        await b.close()
        return second, ran

    second, ran = asyncio.run(scenario())
    assert [names for _, names in ran] == [["second"]]
    waited = ran[0][0] - second.t_enqueue
    assert waited >= DELAY_S - 0.02, f"second ran {waited:.3f} s after it was queued"


def test_a_job_whose_deadline_passes_while_queued_never_runs():
    async def scenario():
        ran: list = []
        b = _batcher(ran)
        b.start()
        late = _job("late", deadline=time.monotonic() + 0.1)
        fut = b.submit(late)
        with pytest.raises(JobTimeout):
            await fut
        await b.close()
        return ran

    assert asyncio.run(scenario()) == []


def test_jobs_of_one_key_merge_into_one_launch_in_priority_order():
    async def scenario():
        ran: list = []
        b = _batcher(ran, delay_s=0.2)
        b.start()
        futs = [b.submit(_job("low", priority=3)), b.submit(_job("high", priority=1)),
                b.submit(_job("other-key", key="k2"))]
        results = await asyncio.gather(*futs)
        await b.close()
        return results, ran

    results, ran = asyncio.run(scenario())
    assert results == ["low", "high", "other-key"]
    assert [names for _, names in ran] == [["high", "low"], ["other-key"]]
