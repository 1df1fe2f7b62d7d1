"""The batcher's queue: the jobs waiting for a launch, per batch key.

Each key keeps a heap in (priority level, arrival) order and the jobs, rows and FLOPs it holds,
so that whether its jobs fill a launch is known without walking them. A job that leaves while
queued (cancelled) is only marked and uncounted: it stays in its heap until it reaches the top,
where it is dropped (taking it out of the middle of a heap would mean rebuilding it). The
batch limits are the batcher's, passed to `full` and `take`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from moe_gemm_server.engine import WeightSet

from .metrics import Metrics


@dataclass(eq=False)
class Job:
    """One request's work. `payload` is (x, counts) for "mm", (a_list, b_list) for "gemm"."""

    kind: str
    key: Hashable
    payload: tuple[Any, Any]
    rows: int
    flops: int
    out_dtype: torch.dtype
    ws: WeightSet | None = None
    priority: int = 2
    deadline: float | None = None  # time.monotonic() seconds
    model: str = ""
    request_id: str = ""
    seq: int = 0
    t_enqueue: float = 0.0
    t_start: float = 0.0
    state: str = "new"  # new -> queued -> running -> done | cancelled | expired
    future: asyncio.Future[Any] | None = field(default=None, repr=False)


class JobQueue:
    """The queued jobs by batch key, and their count on the queued-requests gauge."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._heaps: dict[Hashable, list[tuple[int, int, Job]]] = {}
        self._agg: dict[Hashable, list[int]] = {}  # key -> [jobs, rows, flops] still queued
        self._count = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._count

    def push(self, job: Job) -> None:
        """Queue `job` (marked "queued"), behind the jobs of its priority level."""
        job.seq = next(self._seq)
        heapq.heappush(self._heaps.setdefault(job.key, []), (job.priority, job.seq, job))
        agg = self._agg.setdefault(job.key, [0, 0, 0])
        agg[0] += 1
        agg[1] += job.rows
        agg[2] += job.flops
        self._count += 1
        self.metrics.queued.set(self._count)

    def remove(self, job: Job) -> None:
        """Stop counting a queued job that leaves (cancelled, expired or taken)."""
        agg = self._agg[job.key]
        agg[0] -= 1
        agg[1] -= job.rows
        agg[2] -= job.flops
        self._count -= 1
        self.metrics.queued.set(self._count)

    def head(self, key: Hashable) -> Job | None:
        """The first job still queued under `key`, or None (the key is then forgotten)."""
        heap = self._heaps.get(key)
        while heap and heap[0][2].state != "queued":
            heapq.heappop(heap)  # lazily drop cancelled / expired jobs
        if not heap:
            self._heaps.pop(key, None)
            self._agg.pop(key, None)
            return None
        return heap[0][2]

    def best(self) -> Job | None:
        """The job to lead the next launch: the lowest priority level, then the earliest."""
        best = None
        for key in list(self._heaps):
            job = self.head(key)
            if job is not None and (best is None or (job.priority, job.seq) < (best.priority,
                                                                               best.seq)):
                best = job
        return best

    def full(self, key: Hashable, max_requests: int, max_rows: int, max_flops: int) -> bool:
        """Whether the jobs queued under `key` reach a limit of one launch."""
        agg = self._agg.get(key)
        if agg is None:
            return False
        return agg[0] >= max_requests or agg[1] >= max_rows or agg[2] >= max_flops

    def take(self, key: Hashable, max_requests: int, max_rows: int, max_flops: int
             ) -> tuple[list[Job], list[Job]]:
        """(batch, expired): the jobs of one launch under `key`, in (priority, arrival) order
        while they fit (the first one always), marked "running"; and the jobs met on the way
        whose deadline has passed, marked "expired", for the batcher to fail."""
        heap = self._heaps.get(key, [])
        batch: list[Job] = []
        expired: list[Job] = []
        rows = flops = 0
        now = time.monotonic()
        while heap and len(batch) < max_requests:
            job = heap[0][2]
            if job.state != "queued":
                heapq.heappop(heap)
                continue
            if job.deadline is not None and now >= job.deadline:
                heapq.heappop(heap)
                self.remove(job)
                job.state = "expired"
                expired.append(job)
                continue
            if batch and (rows + job.rows > max_rows or flops + job.flops > max_flops):
                break
            heapq.heappop(heap)
            self.remove(job)
            job.state = "running"
            job.t_start = now
            batch.append(job)
            rows += job.rows
            flops += job.flops
        return batch, expired

    def clear(self) -> list[Job]:
        """Empty the queue; returns the jobs its heaps held (those already left included)."""
        jobs = [job for heap in self._heaps.values() for _, _, job in heap]
        self._heaps.clear()
        self._agg.clear()
        self._count = 0
        self.metrics.queued.set(0)
        return jobs
