"""Service: the state one app serves from (engine, store, batcher, metrics) and its lifecycle.

- start(): builds the Engine (a bad --device fails the start), starts the batcher, then loads
  every stored weight set and warms the kernels in the background: /v2/health/live answers at
  once, /v2/health/ready only when everything it will serve is compiled.
- run(): admission (ready, not draining, queue bound), then waits for the job's result while
  watching its deadline and the client's connection; a timed-out or abandoned job is dropped
  from the queue, and a late result is never sent.
- put/delete weights (service_weights.py, a mixin Service inherits): streamed to a temp file,
  checked, copied to the device and warmed, then committed to disk atomically and swapped in;
  an upload is acknowledged only when durable.
- drain(): readiness turns 503, new requests get 503, queued and in-flight work finishes;
  what is still queued, or still sending its body, when the drain times out is answered 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from starlette.requests import Request

from moe_gemm.config import GemmConfig
from moe_gemm.env import refused_variables
from moe_gemm_server.engine import Engine, EngineOutOfMemory

from .batcher import Batcher, Draining, Job, JobTimeout, QueueFull
from .config import Settings
from .deadlines import DeadlinesMixin
from .errors import APIError, unavailable, unprocessable
from .faults import device_failure
from .limits import BodyCutoff
from .metrics import Metrics, StatsBook
from .service_weights import Upload, WeightsMixin, resident_nbytes
from .storage import WeightStore
from .sync import StoreWatcher

log = logging.getLogger(__name__)

# request.state key: run() has counted the request in the v2 statistics (success or fail)
_STATS_COUNTED = "stats_counted"


def build_engine(settings: Settings) -> Engine:
    """The Engine `settings` describe. Raises ValueError (device, or a library MOE_GEMM_*
    variable set to a value the library refuses) or RuntimeError (backend)."""
    check_library_environment()
    return Engine(
        settings.device,
        config=GemmConfig(backend=settings.backend),
        warmup_rows=settings.warmup_rows,
        max_rows=max(settings.max_rows, settings.max_batch_rows),
        tune=settings.tune_at_start,
    )


def check_library_environment() -> None:
    """ValueError naming each library MOE_GEMM_* variable (moe_gemm.env) set to a value the
    library refuses. The library reads most of them only where it acts on them (a tuned-table
    lookup, the fused path on a GPU), so a typo such as MOE_GEMM_FUSED=flase would otherwise
    start a server whose every matmul then fails with that message, answered 422 as if the
    client had sent something wrong: the operator's mistake is refused at start instead."""
    if refused := refused_variables():
        raise ValueError("the library refuses its environment: " + "; ".join(refused.values()))


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class Service(DeadlinesMixin, WeightsMixin):
    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.stats = StatsBook()
        self.engine: Engine | None = engine
        self.store = WeightStore(settings.data_dir)
        self.batcher: Batcher | None = None
        self.ready = False
        self.not_ready_reason = "starting"
        self.draining = False
        self.drain_started = float("inf")
        self.inflight = 0
        self._weights_lock: asyncio.Lock | None = None
        self._load_task: asyncio.Task[None] | None = None
        self.load_errors: dict[str, str] = {}
        # A sticky device error: the process must be replaced (see faults.py). on_fatal is
        # how the command line's server is told to exit non-zero.
        self.fatal_error: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        self._reserved_bytes = 0  # uploads admitted under the budget, not yet installed
        self._credited: set[str] = set()  # of them, replacements counting the old as freed
        self._uploads: dict[str, list[Upload]] = {}  # of them, those past their checks
        self.watcher = StoreWatcher(self)
        self._sync_task: asyncio.Task[None] | None = None
        # Bodies still arriving when a drain times out are answered 503 (limits.py).
        self.body_cutoff = BodyCutoff(
            on_cut=lambda: self.metrics.rejections.labels("draining").inc())

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        if self.engine is None:
            self.engine = build_engine(s)
        log.info("engine on %s, backend %s%s", self.engine.device, self.engine.backend,
                 f" ({self.engine.backend_reason})" if self.engine.backend_reason else "")
        self._weights_lock = asyncio.Lock()
        self.batcher = Batcher(
            self.engine,
            delay_s=s.batch_delay_s,
            max_rows=s.max_batch_rows,
            max_flops=s.max_batch_flops,
            max_requests=s.max_batch_requests,
            max_queue=s.max_queue,
            metrics=self.metrics,
            stats=self.stats,
        )
        self.batcher.start()
        self.not_ready_reason = "loading weights and compiling kernels"
        self._load_task = asyncio.get_running_loop().create_task(self._load_all())
        self._load_task.add_done_callback(self._load_finished)

    async def _load_all(self) -> None:
        assert self.engine is not None
        t0 = time.monotonic()
        await asyncio.to_thread(self.store.cleanup_temp)
        # (the directory the sets are loaded from: sync.py tells a volume unmounted from under
        # the path, whose empty mountpoint lists no set, from every set deleted)
        self.watcher.home = await asyncio.to_thread(self.store.dir_id)
        names = await asyncio.to_thread(self.store.names)
        for name in names:
            if not await self._load_stored(name):
                return  # a sticky device error: the process is going away
        try:
            await asyncio.to_thread(self.engine.warm_up_grouped_gemm)
        except Exception:  # noqa: BLE001 - the matmul path will report its own errors
            log.exception("warm-up of the grouped_gemm path failed")
        self._update_weight_metrics()
        self.ready = True
        self.not_ready_reason = ""
        self.metrics.ready.set(1)
        log.info("ready: %d weight set(s) loaded and warmed in %.1fs", len(names) -
                 len(self.load_errors), time.monotonic() - t0)
        if self.settings.sync_interval_s > 0:  # sets written by other servers (sync.py)
            self._sync_task = asyncio.get_running_loop().create_task(
                self.watcher.run(self.settings.sync_interval_s))

    async def _load_stored(self, name: str) -> bool:
        """Load, check and warm one stored set. A file that cannot be loaded, for whatever
        reason (a malformed or pathological header, a bad tensor, over the budget, a bug), is
        logged and skipped: one bad file must not keep the server from ever being ready.
        Returns False only after a sticky device error."""
        assert self.engine is not None
        fid = self.watcher.file_id(name)  # before reading: a later rewrite is noticed
        try:
            tensor, layout, scale = await asyncio.to_thread(self.store.load, name)
            with self._reserve(name, resident_nbytes(tensor, scale)):
                await asyncio.to_thread(functools.partial(self.engine.add_weights, name, tensor,
                                                          layout, scale=scale))
            self.watcher.record(name, fid)
            return True
        except Exception as e:  # noqa: BLE001 - any per-file failure is that file's alone
            if self._check_fatal(e):
                return False
            msg = e.message if isinstance(e, APIError) else str(e) or type(e).__name__
            if not isinstance(e, (APIError, ValueError, TypeError, OSError, EngineOutOfMemory)):
                msg = f"{type(e).__name__}: {msg}"  # unexpected: say what it was
                log.exception("unexpected error loading weight set %r", name)
            if fid is not None:
                self.watcher.record_failure(name, fid, e)
        self.load_errors[name] = msg
        self.metrics.weight_load_errors.inc()
        log.error("could not load weight set %r from %s: %s", name, self.store.root, msg)
        return True

    def _load_finished(self, task: asyncio.Task[None]) -> None:
        """Say why, should loading and warming fail as a whole: the server stays not-ready, and
        an exception kept in a task nobody awaits would never be seen."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.not_ready_reason = f"start-up failed ({type(exc).__name__}: {exc}); see the log"
        log.error("loading the stored weight sets failed; not ready", exc_info=exc)

    async def wait_ready(self) -> None:
        if self._load_task is not None:
            await asyncio.shield(self._load_task)

    async def drain(self, timeout: float) -> bool:
        """Readiness 503, new work refused; wait for queued and in-flight work. True if idle."""
        if not self.draining:
            self.draining = True
            self.drain_started = time.monotonic()
            self.not_ready_reason = "draining"
            self.metrics.ready.set(0)
            log.info("draining: %d queued, %d in flight", self.batcher.queued if self.batcher
                     else 0, self.inflight)
        if self.batcher is not None:
            self.batcher.flush()
        end = time.monotonic() + timeout
        while self.inflight > 0 or (self.batcher is not None and self.batcher.busy):
            if time.monotonic() >= end:
                log.warning("drain timed out with %d request(s) in flight", self.inflight)
                self.body_cutoff.cut("draining: the server is shutting down")
                if self.batcher is not None:
                    # What still waits on the batcher is answered now, 503 (retry elsewhere):
                    # left waiting, uvicorn cancels these requests once its graceful timeout
                    # passes, and a cancelled request is answered a plain-text 500.
                    failed = self.batcher.fail_all()
                    if failed:
                        self.metrics.rejections.labels("draining").inc(failed)
                return False
            await asyncio.sleep(0.005)
        return True

    async def stop(self) -> None:
        await self.drain(self.settings.drain_timeout_s)
        if self._sync_task is not None and not self._sync_task.done():
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sync_task
        await self.watcher.cancel_loads()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._load_task
        if self.batcher is not None:
            await self.batcher.close()

    # ------------------------------------------------------------------ admission

    @property
    def is_ready(self) -> bool:
        return self.ready and not self.draining

    def fail_device(self, reason: str) -> None:
        """A sticky device error: not ready from now on, and the process is to exit non-zero
        (on_fatal) so that its supervisor replaces it. Idempotent."""
        if self.fatal_error is not None:
            return
        self.fatal_error = reason
        self.ready = False
        self.not_ready_reason = f"device failed ({reason}); the server is restarting"
        self.metrics.ready.set(0)
        log.critical("unrecoverable device error: %s; exiting so the supervisor restarts the "
                     "server (stored weight sets are reloaded on start)", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _check_fatal(self, exc: BaseException) -> bool:
        reason = device_failure(exc)
        if reason is not None:
            self.fail_device(reason)
        return reason is not None

    def check_serving(self, request: Request) -> None:
        """503 unless ready and (not draining, or the request arrived before the drain)."""
        if not self.ready:
            self.metrics.rejections.labels("not_ready").inc()
            raise unavailable(f"not ready: {self.not_ready_reason}")
        if self.draining:
            arrival = request.scope.get("state", {}).get("t_arrival", float("inf"))
            if arrival >= self.drain_started:
                self.metrics.rejections.labels("draining").inc()
                raise unavailable("draining: the server is shutting down")

    def admit(self, request: Request) -> None:
        """check_serving, plus a 429 before the body is read when the queue is already full."""
        self.check_serving(request)
        if self.batcher is not None and self.batcher.queued >= self.settings.max_queue:
            self.metrics.rejections.labels("queue_full").inc()
            raise APIError(429, f"queue full ({self.settings.max_queue} requests waiting); "
                                "retry later", {"Retry-After": "1"})

    @contextlib.asynccontextmanager
    async def tracked(self) -> AsyncIterator[None]:
        """Counts the request as in flight (a drain waits for it)."""
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def priority_level(self, priority: int | None) -> int:
        return priority if priority else self.settings.default_priority

    async def run(self, request: Request, job: Job) -> Any:
        """Queue `job` and wait for its result, its deadline, or the client leaving."""
        state = request.scope.setdefault("state", {})
        arrival = state.get("t_arrival", time.monotonic())
        ok = False
        try:
            result = await self._run(request, job)
            ok = True
            return result
        finally:
            if job.model:
                state[_STATS_COUNTED] = True
                self.stats.done(job.model, ok, time.monotonic() - arrival,
                                None if job.ws is None else job.ws.version)

    @contextlib.contextmanager
    def failures_counted(self, request: Request, name: str) -> Iterator[None]:
        """A request naming weight set `name` that ends in an error before run() counted it (the
        queue full, a body or parameter refused, the set left out of memory) is a failure in
        the set's v2 statistics, as Triton's `fail` counts every failed request of a model;
        an unknown name (404, 422) counts toward no set."""
        try:
            yield
        except BaseException:
            state = request.scope.get("state", {})
            try:
                ws = self.engine.get_weights(name) if self.engine is not None else None
            except KeyError:
                ws = None
            if ws is not None and not state.get(_STATS_COUNTED):
                arrival = state.get("t_arrival", time.monotonic())
                self.stats.done(name, False, time.monotonic() - arrival, ws.version)
            raise

    async def _run(self, request: Request, job: Job) -> Any:
        assert self.batcher is not None
        now = time.monotonic()
        if job.deadline is not None and now >= job.deadline:
            self.metrics.rejections.labels("timeout").inc()
            raise APIError(504, "the request's timeout expired before it could be queued")
        try:
            fut = self.batcher.submit(job)
        except QueueFull:
            raise APIError(429, f"queue full ({self.settings.max_queue} requests waiting); "
                                "retry later", {"Retry-After": "1"}) from None
        except Draining:
            raise unavailable("draining: the server is shutting down") from None
        gone = asyncio.ensure_future(_wait_disconnect(request))
        timeout = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
        try:
            done, _ = await asyncio.wait({fut, gone}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.batcher.cancel(job, "cancelled")
            raise
        finally:
            if not gone.done():
                gone.cancel()
        if fut.done() and not fut.cancelled():
            exc = fut.exception()
            if exc is None:
                return fut.result()
            if self._check_fatal(exc):
                self.metrics.rejections.labels("device_failed").inc()
                raise unavailable(f"not ready: {self.not_ready_reason}")
            if isinstance(exc, JobTimeout):
                raise APIError(504, "the request's timeout expired while it was queued")
            if isinstance(exc, EngineOutOfMemory):
                self.metrics.rejections.labels("out_of_memory").inc()
                raise unavailable(f"out of memory for this request: {exc}")
            if isinstance(exc, Draining):
                raise unavailable("draining: the server is shutting down")
            if isinstance(exc, (ValueError, TypeError)):
                raise unprocessable(str(exc))
            raise exc
        if gone in done:
            self.batcher.cancel(job, "disconnected")
            request.scope.setdefault("state", {})["disconnected"] = True
            raise ClientGone()
        self.batcher.cancel(job, "timeout")
        raise APIError(504, "the request's timeout expired before its result was ready")


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (http.disconnect after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
