"""Prometheus metrics and the per-model statistics of the v2 `stats` endpoint.

Each app owns its own CollectorRegistry, so several apps (tests) can live in one process.
What users of batching servers ask for is here by default, as histograms rather than
cumulative counters: time in queue, time in compute, requests and rows per executed launch;
plus the queued gauge and rejections by reason (docs/HTTP-API.md, "Metrics", lists them).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# The *_created series double the exposition for no use here (process-wide switch).
disable_created_metrics()

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
QUEUE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)
BATCH_REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_ROW_BUCKETS = tuple(float(1 << i) for i in range(0, 21, 2))

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The service's Prometheus collectors (names prefixed moe_gemm_)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "moe_gemm_requests", "HTTP requests by route template, method and status",
            ["route", "method", "status"], registry=r,
        )
        self.latency = Histogram(
            "moe_gemm_request_duration_seconds", "HTTP request latency, arrival to last byte",
            ["route", "method"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "moe_gemm_requests_in_flight", "HTTP requests being handled", registry=r
        )
        self.resident_bytes = Gauge(
            "moe_gemm_resident_weight_bytes", "bytes of resident expert weights", registry=r
        )
        self.weight_sets = Gauge("moe_gemm_weight_sets", "resident weight sets", registry=r)
        self.ready = Gauge("moe_gemm_ready", "1 when the service is ready", registry=r)
        self.queued = Gauge("moe_gemm_queued_requests", "requests waiting in the batcher queue",
                            registry=r)
        self.queue_time = Histogram(
            "moe_gemm_queue_time_seconds", "time a request waited before its launch started",
            ["kind"], buckets=QUEUE_BUCKETS, registry=r,
        )
        self.compute_time = Histogram(
            "moe_gemm_compute_time_seconds", "time of one executed launch (copy in, run, copy out)",
            ["kind"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.batch_requests = Histogram(
            "moe_gemm_batch_requests", "requests merged into one executed launch",
            ["kind"], buckets=BATCH_REQUEST_BUCKETS, registry=r,
        )
        self.batch_rows = Histogram(
            "moe_gemm_batch_rows", "rows (tokens) in one executed launch",
            ["kind"], buckets=BATCH_ROW_BUCKETS, registry=r,
        )
        self.rejections = Counter(
            "moe_gemm_rejections", "requests not run, by reason", ["reason"], registry=r
        )
        self.launch_errors = Counter(
            "moe_gemm_launch_errors", "launches that raised, by error type", ["error"], registry=r
        )
        self.weight_load_errors = Counter(
            "moe_gemm_weight_load_errors", "weight files that failed to load, at start or in a "
            "rescan of the data directory", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, n: int = 1) -> None:
        self.count += n
        self.ns += int(seconds * 1e9)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStats:
    """Triton-style statistics of one model (weight set)."""

    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batch: dict[int, _Duration] = field(default_factory=lambda: defaultdict(_Duration))


class StatsBook:
    """Per-model statistics, updated from the event loop and read by the stats routes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelStats] = defaultdict(ModelStats)
        # Per name, the newest weight-set version deleted: a request on it that finishes
        # afterwards must not count toward a new set of the same name.
        self._retired: dict[str, int] = {}

    def _stale(self, model: str, version: int | None) -> bool:
        return version is not None and version <= self._retired.get(model, 0)

    def launch(self, model: str, requests: int, rows: int, seconds: float,
               version: int | None = None) -> None:
        with self._lock:
            if self._stale(model, version):
                return
            s = self._models[model]
            s.execution_count += 1
            s.inference_count += rows
            s.compute_infer.add(seconds, requests)
            s.batch[requests].add(seconds)
            s.last_inference_ms = int(time.time() * 1000)

    def queued(self, model: str, seconds: float, version: int | None = None) -> None:
        with self._lock:
            if not self._stale(model, version):
                self._models[model].queue.add(seconds)

    def done(self, model: str, ok: bool, seconds: float, version: int | None = None) -> None:
        with self._lock:
            if self._stale(model, version):
                return
            s = self._models[model]
            (s.success if ok else s.fail).add(seconds)

    def forget(self, model: str, version: int | None = None) -> None:
        """Drop a deleted set's statistics; with its version, also whatever its requests still
        in flight would report later."""
        with self._lock:
            self._models.pop(model, None)
            if version is not None:
                self._retired[model] = max(version, self._retired.get(model, 0))

    def as_v2(self, model: str, version: str = "1") -> dict[str, object]:
        with self._lock:
            s = self._models.get(model) or ModelStats()
            zero = {"count": 0, "ns": 0}
            return {
                "name": model,
                "version": version,
                "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": s.success.as_dict(),
                    "fail": s.fail.as_dict(),
                    "queue": s.queue.as_dict(),
                    "compute_input": dict(zero),
                    "compute_infer": s.compute_infer.as_dict(),
                    "compute_output": dict(zero),
                    "cache_hit": dict(zero),
                    "cache_miss": dict(zero),
                },
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": dict(zero),
                        "compute_infer": d.as_dict(),
                        "compute_output": dict(zero),
                    }
                    for size, d in sorted(s.batch.items())
                ],
            }
