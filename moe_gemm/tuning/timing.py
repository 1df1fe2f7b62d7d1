"""Timing candidates as the tuner does: L2-cold CUDA-graph replays, interleaved, each
after a short rest.

For each candidate one CUDA graph is captured holding `calls` launches that cycle through
several independent input sets (enough that together they are at least L2_FACTOR times the
L2, so no launch finds its operands left in L2 by the previous one; a set that alone is that
big is used alone). A sample is one replay between two events, divided by `calls`: GPU time
per call with no host gap between the launches. Samples are taken in rounds, one per
candidate per round, the starting candidate rotating, so clock and power drift falls on all
candidates alike. Each graph is replayed a few times before its first sample, and the GPU is
first kept busy for WARMUP_MS so the first candidate does not run on a cool, boosting GPU.

Each sample starts after REST_MS of a low-power wait on the GPU (`torch.cuda._sleep`), as
the benchmarks take theirs (benchmarks/clock.py: every back-to-back sample queued behind a
sleep backlog). Without it, samples run back to back for the whole round at the power
limit, and the ranking changes: on an H200 the same graphs of one varlen shape (E=128,
N=2048, K=768, 65536 rows) took 7-18% longer back to back than with the rest, cluster
configs the most (ping-pong 128x192 2x1: 424 against 360 us; 128x128 1x2: 370 against 338),
so a tuner sampling back to back picked configs that lost in the benchmarks. rest_ms=0
(`moe-gemm tune --rest-ms 0`) keeps the back-to-back regime for those who tune for it.

Eager mode (`moe-gemm tune --timing eager`) samples as the benchmarks do instead
(benchmarks/clock.py back_to_back): no graph; each sample waits for the GPU to finish, queues
a sleep long enough to hide the host's enqueue, then `calls` ordinary launches between two
events; the sleep is the larger of the rest and that backlog, so with `--rest-ms 0` it is the
backlog alone, as in the benchmarks. Same inputs, interleaving and sample length as the graph
mode; what differs is the launch path and the GPU's short idle before each sample: the regime
the model zoo ranks implementations in.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

L2_FACTOR = 3  # input bytes across the rotated sets per L2 size
# GPU time of one replay (one sample), at least (`moe-gemm tune --sample-ms`). The zoo's
# samples hold ~5 ms (benchmarks/clock.py B2B_TARGET_MS): a long kernel spends the second
# half of such a sample nearer the power limit than a 2 ms sample does.
TARGET_MS = 2.0
MAX_CALLS = 64  # launches per graph: each captured launch holds its own workspace
WARMUP_MS = 200.0
REST_MS = 1.0  # GPU rest before each sample (module docstring)


def sets_needed(set_bytes: int, l2_bytes: int, max_sets: int = 16) -> int:
    """Input sets to rotate so that their total is at least L2_FACTOR x the L2 (1 when one
    set alone is), capped at max_sets."""
    if l2_bytes <= 0 or set_bytes >= L2_FACTOR * l2_bytes:
        return 1
    return max(2, min(max_sets, math.ceil(L2_FACTOR * l2_bytes / max(1, set_bytes))))


def calls_per_graph(est_ms: float, n_sets: int, target_ms: float = TARGET_MS,
                    max_calls: int = MAX_CALLS) -> int:
    """Launches per graph: about target_ms of work, a whole number of passes over the sets."""
    calls = max(1, math.ceil(target_ms / max(est_ms, 1e-4)))
    calls = min(max(calls, n_sets), max(max_calls, n_sets))
    return max(n_sets, calls // n_sets * n_sets)


def gpu_warmup(device: torch.device, ms: float = WARMUP_MS) -> None:
    """Keep the GPU at work for about `ms` (bf16 4096^2 matmuls)."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    b = a @ a
    end.record()
    end.synchronize()
    per = max(start.elapsed_time(end), 1e-3)
    for _ in range(int(ms / per)):
        b = a @ a
    torch.cuda.synchronize(device)
    del a, b


def estimate_ms(fns: Sequence[Callable[[], object]], device: torch.device) -> float:
    """Median event time of a few single launches (after two warm-up calls each)."""
    for fn in fns[:2]:
        fn()
        fn()
    samples = []
    for i in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fns[i % len(fns)]()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


TIMINGS = ("graph", "eager")  # how the tuner samples (module docstring)


@dataclass(eq=False)
class Timed:
    """One candidate's captured graph (or, eager, its launches) and its samples (ms per
    call). Eager: `run` makes the `calls` launches and `backlog_ms` is the sleep queued ahead
    of them, enough to cover their host time."""

    name: str
    graph: torch.cuda.CUDAGraph | None
    calls: int
    samples: list[float] = field(default_factory=list)
    run: Callable[[], object] | None = None
    backlog_ms: float = 0.0

    @property
    def eager(self) -> bool:
        return self.graph is None

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else math.inf


def capture(name: str, fns: Sequence[Callable[[], object]], calls: int,
            device: torch.device) -> Timed:
    """A graph of `calls` launches cycling through `fns` (one per input set); each fn has run
    outside capture before (plans built, kernels loaded)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    for _ in range(2):
        graph.replay()
    return Timed(name, graph, calls)


def capture_eager(name: str, fns: Sequence[Callable[[], object]], calls: int,
                  device: torch.device) -> Timed:
    """The eager counterpart of capture: `calls` launches cycling through `fns`, run once
    here (plans built, kernels loaded) while their host time is measured; the backlog ahead
    of each sample covers that host time with a margin (as the benchmarks' does)."""

    def run() -> None:
        for i in range(calls):
            fns[i % len(fns)]()

    run()
    _synchronize(device)
    t0 = time.perf_counter()
    run()
    host_ms = (time.perf_counter() - t0) * 1e3
    _synchronize(device)
    return Timed(name, None, calls, run=run, backlog_ms=host_ms * 1.25 + 0.1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_sleep_rate: dict[int, float] = {}


def sleep_cycles_per_ms(device: torch.device) -> float:
    """torch.cuda._sleep's cycles per millisecond on `device` (measured once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    rate = _sleep_rate.get(idx)
    if rate is None:
        with torch.cuda.device(idx):
            torch.cuda._sleep(100_000)  # (the GPU leaves idle clocks first)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 20_000_000  # ~10 ms at a boost clock: events resolve ~0.5 us
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rate = _sleep_rate[idx] = cycles / max(start.elapsed_time(end), 1e-3)
    return rate


def rest(device: torch.device, ms: float) -> None:
    """Queue about `ms` of a low-power wait on the current stream (CUDA devices only)."""
    if ms > 0 and device.type == "cuda":
        torch.cuda._sleep(int(ms * sleep_cycles_per_ms(device)))


def sample_rounds(timed: Sequence[Timed], rounds: int, device: torch.device,
                  rest_ms: float = REST_MS) -> None:
    """`rounds` interleaved samples of every graph (starting one later each round), each
    after `rest_ms` of rest. An eager candidate's sample first waits for the GPU, then rests
    at least its backlog (module docstring)."""
    if not timed:
        return
    for r in range(rounds):
        k = r % len(timed)
        order = list(timed[k:]) + list(timed[:k])
        events = []
        for t in order:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            if t.eager:
                _synchronize(device)
                rest(device, max(rest_ms, t.backlog_ms))
                start.record()
                t.run()
            else:
                rest(device, rest_ms)
                start.record()
                t.graph.replay()
            end.record()
            events.append((t, start, end))
        torch.cuda.synchronize(device)
        for t, start, end in events:
            t.samples.append(start.elapsed_time(end) / t.calls)
