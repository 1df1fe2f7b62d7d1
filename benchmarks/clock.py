"""Timing callables on one device: CUDA events on a GPU, perf_counter on the CPU.

Four measurements (benchmarks/README.md says which number is which):
- `single`: one call with the GPU idle before it (what a call costs a caller, launch gap
  included);
- `back_to_back`: N calls queued behind a `torch.cuda._sleep` backlog between two events,
  divided by N: GPU time with the host's enqueue hidden (for kernels under ~100 us,
  per-launch events mostly time the launch gap);
- `queued`: one call queued behind a backlog between two events: the GPU time of that one
  call, from its first launch to its last kernel's end, with the host's enqueue hidden (no
  overlap with a neighbour's launch, as back-to-back calls have);
- `host_ms`: CPU time of one call, no synchronisation inside the timed region.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.gpu_state import GpuState, open_gpu_state
from moe_gemm.tuning.timing import rest

# Back-to-back samples queue enough launches for ~5 ms of GPU work: long enough that event
# resolution (~0.5 us) and the inter-launch gaps are noise, short enough for 30 samples.
B2B_TARGET_MS = 5.0
MAX_BACKLOG_MS = 200.0


class Clock:
    """Times callables on one device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, gpu_state: GpuState | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if gpu_state is None and self.cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            gpu_state = open_gpu_state(index)
        self.gpu_state = gpu_state or GpuState()
        # (SM MHz, W) read while each sample of the latest back_to_back call ran
        self.last_states: list[tuple[float | None, float | None]] = []

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _events(self) -> tuple[Any, Any]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def backlog(self, ms: float) -> None:
        """Keep the GPU busy for about `ms` so the launches after it queue up behind it."""
        if self.cuda and hasattr(torch.cuda, "_sleep"):
            rest(self.device, min(ms, MAX_BACKLOG_MS))

    def single(self, fns: Sequence[Callable[[], object]], reps: int,
               host: list[float] | None = None) -> list[float]:
        """ms of one call each rep, the device idle before it (launch gap included); `host`,
        if given, gets the CPU ms of each of those calls (the call alone, after the sync)."""
        return [self._one_call(fns[r % len(fns)], 0.0, host) for r in range(reps)]

    def queued(self, fns: Sequence[Callable[[], object]], reps: int, backlog_ms: float
               ) -> list[float]:
        """ms of one call each rep, enqueued while the GPU works off a backlog of `backlog_ms`
        (longer than the call's host time), so the events see the GPU's own time for it."""
        return [self._one_call(fns[r % len(fns)], backlog_ms, None) for r in range(reps)]

    def _one_call(self, fn: Callable[[], object], backlog_ms: float,
                  host: list[float] | None) -> float:
        """ms of fn() between two events after a sync (and a backlog of `backlog_ms`, if
        any); perf_counter on the CPU. `host` gets the call's CPU ms."""
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
            if host is not None:
                host.append(ms)
            return ms
        if backlog_ms > 0:
            self.backlog(backlog_ms)
        start, end = self._events()
        start.record()
        t0 = time.perf_counter()
        fn()
        if host is not None:
            host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def back_to_back(
        self, fns: Sequence[Callable[[], object]], reps: int, calls: int, backlog_ms: float
    ) -> list[float]:
        """ms per call, `calls` calls queued between two events behind a GPU backlog; the
        SM clock and power read while each sample runs go to `last_states`."""
        samples = []
        self.last_states = []
        k = 0
        for _ in range(reps):
            self.sync()
            self.backlog(backlog_ms)
            if self.cuda:
                start, end = self._events()
                start.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fns[k % len(fns)]()
                k += 1
            if self.cuda:
                end.record()
                if self.gpu_state.available:
                    # Read while the timed calls run: from the start event (the backlog, a
                    # low-power sleep kernel, is over) until the end event completes.
                    start.synchronize()
                    self.last_states.append(
                        self.gpu_state.sample_while(lambda e=end: not e.query()))
                end.synchronize()
                samples.append(start.elapsed_time(end) / calls)
            else:
                samples.append((time.perf_counter() - t0) * 1e3 / calls)
        return samples

    def host_ms(
        self, fns: Sequence[Callable[[], object]], reps: int, sync_every: int = 1
    ) -> list[float]:
        """CPU ms of one call (no sync inside the timed region)."""
        samples = []
        for r in range(reps):
            if r % sync_every == 0:
                self.sync()  # keep the launch queue from filling: outside the timed region
            fn = fns[r % len(fns)]
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        self.sync()
        return samples


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))])

