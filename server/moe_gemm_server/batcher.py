"""Dynamic batcher: concurrent requests merged into one grouped launch, with admission control.

Requests become Jobs with a batch key: ("mm", weight set, version, x dtype, out dtype) for
the MoE form, ("gemm", dtype) for ad-hoc problems. Jobs with one key can share a launch: for
the MoE form the engine regroups all their rows per expert (a grouped GEMM takes ragged rows,
so nothing is padded) and hands each job exactly its own rows back; ad-hoc problem lists are
simply concatenated.

Scheduling, on the event loop:
- a bounded queue (`max_queue` jobs; `submit` raises QueueFull beyond it);
- the next launch is led by the best queued job: lowest priority level first (1 = highest),
  FIFO within a level; it then waits until that job has been queued `delay` seconds, or until
  its key holds a full launch (max requests, rows or FLOPs), whichever comes first, and takes
  same-key jobs in (priority, arrival) order while they fit;
- a job whose deadline passed while queued is failed with JobTimeout, never run; a job
  cancelled (client gone, timed out in the handler) is dropped;
- one launch at a time, in a single worker thread (the engine's lock serializes GPU work
  anyway), so the event loop keeps accepting requests while the device computes;
- if a merged launch runs out of device memory, its jobs are retried one by one and only
  those that still do not fit fail.

The queue's bookkeeping (a heap per key, the jobs, rows and FLOPs each holds) and `Job` are
job_queue.py's; the batcher decides when to launch and runs the launches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from moe_gemm_server.engine import Engine, EngineOutOfMemory

from .job_queue import Job, JobQueue
from .logs import log_field
from .metrics import Metrics, StatsBook

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds max_queue jobs."""


class Draining(Exception):
    """The batcher takes no new work (shutting down)."""


class JobTimeout(Exception):
    """The job's deadline passed before it could run."""


def _version(job: Job) -> int | None:
    """The version of the weight set a job runs on (None for ad-hoc grouped-gemm jobs)."""
    return None if job.ws is None else job.ws.version


class Batcher:
    """Queue + scheduler + single launch worker (see module docstring)."""

    def __init__(
        self,
        engine: Engine,
        *,
        delay_s: float,
        max_rows: int,
        max_flops: int,
        max_requests: int,
        max_queue: int,
        metrics: Metrics,
        stats: StatsBook,
        run: Callable[[Engine, list[Job]], list[Any]] | None = None,
    ) -> None:
        self.engine = engine
        self.delay_s = delay_s
        self.max_rows = max_rows
        self.max_flops = max_flops
        self.max_requests = max_requests
        self.max_queue = max_queue
        self.metrics = metrics
        self.stats = stats
        self._run_fn = run or run_jobs
        self._jobs = JobQueue(metrics)
        self._wakeup = asyncio.Event()
        self._running = 0
        self._current: list[Job] = []  # the batch being executed
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-gemm-launch")
        self._task: asyncio.Task[None] | None = None
        self.draining = False  # refuse new jobs
        self.flushing = False  # run queued jobs without waiting for the batch delay

    # ------------------------------------------------------------------ public

    @property
    def queued(self) -> int:
        return len(self._jobs)

    @property
    def busy(self) -> bool:
        return len(self._jobs) > 0 or self._running > 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="moe-gemm-batcher")

    def submit(self, job: Job) -> asyncio.Future[Any]:
        """Queue a job; its future gets the result (or JobTimeout / EngineOutOfMemory / ...).

        Raises:
            Draining: shutting down.
            QueueFull: max_queue jobs are already waiting.
        """
        if self.draining:
            self.metrics.rejections.labels("draining").inc()
            raise Draining()
        if len(self._jobs) >= self.max_queue:
            self.metrics.rejections.labels("queue_full").inc()
            raise QueueFull()
        job.future = asyncio.get_running_loop().create_future()
        job.t_enqueue = time.monotonic()
        job.state = "queued"
        self._jobs.push(job)
        self._wakeup.set()
        return job.future

    def cancel(self, job: Job, reason: str) -> None:
        """Drop a queued job (or discard a running job's result), counting `reason`."""
        if job.state == "queued":
            self._jobs.remove(job)
            job.state = "cancelled"
            self.metrics.rejections.labels(reason).inc()
            self._wakeup.set()
        elif job.state == "running":
            job.state = "cancelled"
            self.metrics.rejections.labels(reason).inc()
        if job.future is not None and not job.future.done():
            job.future.cancel()

    def flush(self) -> None:
        """From now on, launch queued work without waiting for the batch delay."""
        self.flushing = True
        self._wakeup.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or running; False if `timeout` seconds pass first."""
        end = time.monotonic() + timeout
        while self.busy:
            if time.monotonic() >= end:
                return False
            await asyncio.sleep(0.005)
        return True

    async def close(self) -> None:
        """Stop the scheduler; fail whatever is still queued with Draining."""
        self.draining = True
        self.flushing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.fail_all()
        await asyncio.to_thread(self._executor.shutdown, True)

    def fail_all(self) -> int:
        """Refuse new jobs, and fail every queued job and those of the running launch with
        Draining now (the launch itself runs on; its results are discarded). Returns how many
        jobs were failed."""
        self.draining = True
        failed = 0
        for job in self._jobs.clear() + self._current:
            if job.state in ("queued", "running"):
                job.state = "cancelled"
                failed += 1
                if job.future is not None and not job.future.done():
                    job.future.set_exception(Draining())
        return failed

    # ------------------------------------------------------------------ scheduling

    def _take(self, key: Hashable) -> list[Job]:
        """The next launch's jobs under `key`; those whose deadline passed while queued are
        failed with JobTimeout, never run."""
        batch, expired = self._jobs.take(key, self.max_requests, self.max_rows, self.max_flops)
        for job in expired:
            self.metrics.rejections.labels("timeout").inc()
            if job.future is not None and not job.future.done():
                job.future.set_exception(JobTimeout())
        return batch

    def _full(self, key: Hashable) -> bool:
        """Whether the jobs queued under `key` fill a launch (max requests, rows or FLOPs)."""
        return self._jobs.full(key, self.max_requests, self.max_rows, self.max_flops)

    async def _loop(self) -> None:
        while True:
            head = self._jobs.best()
            if head is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.delay_s > 0 and not self.flushing:
                until = head.t_enqueue + self.delay_s
                while not self._full(head.key) and head.state == "queued" and not self.flushing:
                    remaining = until - time.monotonic()
                    if remaining <= 0:
                        break
                    self._wakeup.clear()
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), remaining)
                    except (asyncio.TimeoutError, TimeoutError):
                        break
                if head.state != "queued" and not self.flushing:
                    # The head left while it waited (cancelled, timed out): the next head waits
                    # out its own delay from its own arrival. (Launching it at once ran a job
                    # queued a moment ago with no batching, past a deadline it should have
                    # missed.)
                    continue
                # A higher-priority job may have arrived: lead with the best one now, without
                # a second wait.
                head = self._jobs.best()
                if head is None:
                    continue
            batch = self._take(head.key)
            if batch:
                try:
                    await self._execute(batch)
                except asyncio.CancelledError:
                    raise
                except Exception:  # never let one bad launch kill the scheduler
                    log.exception("batch execution failed")

    # ------------------------------------------------------------------ execution

    async def _execute(self, batch: list[Job]) -> None:
        self._current = batch
        try:
            await self._execute_batch(batch)
        finally:
            self._current = []

    async def _execute_batch(self, batch: list[Job]) -> None:
        t0 = time.monotonic()
        kind = batch[0].kind
        for job in batch:
            wait = t0 - job.t_enqueue
            self.metrics.queue_time.labels(kind).observe(wait)
            self.stats.queued(job.model, wait, _version(job))
        try:
            results = await self._launch(batch)
        except Exception as e:  # noqa: BLE001 - delivered to the request(s) it belongs to
            if len(batch) == 1:
                self._fail_launch(batch[0], e)
                return
            # A merged launch fails as a whole (out of memory, or one request the checks
            # let through that the launch cannot take): each request runs alone, so only the
            # one at fault gets the error.
            log.warning("merged launch of %d requests failed (%s: %s); retrying one by one",
                        len(batch), type(e).__name__, str(e)[:200])
            for job in batch:
                if job.state != "running":
                    continue
                try:
                    (result,) = await self._launch([job])
                except Exception as e1:  # noqa: BLE001 - delivered to the request
                    self._fail_launch(job, e1)
                else:
                    self._deliver(job, result)
            return
        for job, result in zip(batch, results):
            self._deliver(job, result)

    async def _launch(self, jobs: list[Job]) -> list[Any]:
        kind = jobs[0].kind
        loop = asyncio.get_running_loop()
        self._running += 1
        t0 = time.monotonic()
        try:
            results = await loop.run_in_executor(self._executor, self._run_fn, self.engine, jobs)
        except Exception as e:
            self.metrics.launch_errors.labels(type(e).__name__).inc()
            raise
        finally:
            self._running -= 1
        dt = time.monotonic() - t0
        rows = sum(j.rows for j in jobs)
        self.metrics.compute_time.labels(kind).observe(dt)
        self.metrics.batch_requests.labels(kind).observe(len(jobs))
        self.metrics.batch_rows.labels(kind).observe(rows)
        for model in {j.model for j in jobs}:
            mine = [j for j in jobs if j.model == model]
            self.stats.launch(model, len(mine), sum(j.rows for j in mine), dt,
                              _version(mine[0]))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("launch kind=%s requests=%d rows=%d %.3f ms ids=%s", kind, len(jobs), rows,
                      dt * 1e3, ",".join(log_field(j.request_id) for j in jobs))
        return results

    def _deliver(self, job: Job, result: Any) -> None:
        if job.state == "running":
            job.state = "done"
        if job.future is not None and not job.future.done():
            job.future.set_result(result)

    def _fail_launch(self, job: Job, exc: BaseException) -> None:
        """A launch of this job alone failed: logged (out of memory is expected, not a bug)."""
        if not isinstance(exc, EngineOutOfMemory):
            # (a v2 request's id is the client's own string: escaped, it cannot end the line)
            log.error("launch of request %s failed", log_field(job.request_id), exc_info=exc)
        self._fail(job, exc)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if job.state == "running":
            job.state = "done"
        if job.future is not None and not job.future.done():
            job.future.set_exception(exc)


def run_jobs(engine: Engine, jobs: list[Job]) -> list[Any]:
    """Run one launch for same-key jobs (worker thread)."""
    first = jobs[0]
    if first.kind == "mm":
        assert first.ws is not None
        return engine.grouped_mm_many(first.ws, [j.payload for j in jobs],
                                      out_dtype=first.out_dtype)
    if first.kind == "gemm":
        return engine.grouped_gemm_many([j.payload for j in jobs], out_dtype=first.out_dtype)
    raise ValueError(f"unknown job kind {first.kind!r}")
