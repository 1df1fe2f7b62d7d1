"""`moe-gemm bench`: our grouped GEMM against its peers, on one GPU, in one process.

What one run does (see benchmarks/README.md for the columns):

1. Measures the two ceilings on this device: a 2 GiB device-to-device copy (bytes read plus
   written) and a bf16 8192^3 torch.mm, both on random data.
2. For every suite shape (`benchmarks.suite`): builds fresh random inputs (rotating
   several sets when one set would fit in L2), a float32 reference, then for each
   implementation (ours with no config, the peers, the variant matrix) checks the result
   against the reference (ours into a NaN-poisoned `out`), warms up and times it:
   - `ms_single`: per-launch CUDA events with the GPU idle at each call (what one call costs,
     launch gap included);
   - `ms`: back-to-back, N launches queued behind a `torch.cuda._sleep` backlog between two
     events, divided by N: the GPU time with the host enqueue hidden (short kernels under
     per-launch events mostly time the launch gap).
   Each is the median of `--reps` samples. An implementation that raises is recorded with
   its error and the run goes on; one that cannot take the shape is recorded as n/a.
3. Measures host overhead on a small MoE case: CPU time of one call (no sync) and the gap
   between a call and its kernel, ours against torch's grouped_mm.
4. Derives floors, TFLOP/s, GB/s, fraction of floor and the ratio to the best peer; writes
   JSON (progressively, so a crash keeps what finished) and a PNG; prints the table last.

A CUDA error such as an illegal address poisons the process's context: the run records who
did it and marks the rest "not run". `--isolate` runs each shape in its own subprocess and
retries a crashed shape without the culprit, so one crash costs one implementation.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.suite import (
    DEFAULT_NAME,
    GROUPED_MM_FN,
    GROUPED_MM_NAME,
    TOLERANCE,
    Impl,
    Inputs,
    NotApplicable,
    Prepared,
    ShapeSpec,
    VarlenInputs,
    bytes_needed,
    derive,
    flops,
    format_table,
    full_suite,
    host_overhead_shape,
    implementations,
    input_bytes,
    input_sets_needed,
    loop_body,
    make_inputs,
    offsets,
    reference,
    rel_err,
    short_error,
    smoke_suite,
)
from moe_gemm import __version__
from moe_gemm.ops import api as ops

HOST_OVERHEAD = "host-overhead"
DEFAULT_REPS = 30
SMOKE_REPS = 3
# Back-to-back samples queue enough launches for ~5 ms of GPU work: long enough that event
# resolution (~0.5 us) and the inter-launch gaps are noise, short enough for 30 samples.
B2B_TARGET_MS = 5.0
MAX_BACKLOG_MS = 200.0
# Fault injection for testing --isolate: "SHAPE/IMPL" makes that implementation abort the
# process the moment it starts ("SHAPE/IMPL@timing": at its first timed sample), like a crash
# that takes the CUDA context with it.
ABORT_ENV = "MOE_GEMM_BENCH_ABORT_IN"
# Substrings of errors after which the CUDA context cannot be trusted (sticky errors).
_STICKY = ("illegal memory access", "illegal instruction", "misaligned address",
           "unspecified launch failure", "device-side assert", "an illegal", "launch timeout")


# ---------------------------------------------------------------------------------------------
# Timing


class Clock:
    """Times callables on one device: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._cycles_per_ms: float | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _events(self) -> tuple[Any, Any]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _calibrate(self) -> float:
        torch.cuda._sleep(100_000)
        start, end = self._events()
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self._cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)
        return self._cycles_per_ms

    def backlog(self, ms: float) -> None:
        """Keep the GPU busy for about `ms` so the launches after it queue up behind it."""
        if not self.cuda or ms <= 0 or not hasattr(torch.cuda, "_sleep"):
            return
        rate = self._cycles_per_ms or self._calibrate()
        torch.cuda._sleep(int(min(ms, MAX_BACKLOG_MS) * rate))

    def single(self, fns: Sequence[Callable[[], object]], reps: int) -> list[float]:
        """ms of one call each rep, the device idle before it (launch gap included)."""
        samples = []
        for r in range(reps):
            fn = fns[r % len(fns)]
            self.sync()
            if self.cuda:
                start, end = self._events()
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return samples

    def back_to_back(
        self, fns: Sequence[Callable[[], object]], reps: int, calls: int, backlog_ms: float
    ) -> list[float]:
        """ms per call, `calls` calls queued between two events behind a GPU backlog."""
        samples = []
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


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))])


# ---------------------------------------------------------------------------------------------
# Ceilings


def _time_copy(clock: Clock, elems: int, reps: int, gen: torch.Generator) -> tuple[float, int]:
    src = torch.randn(elems, dtype=torch.bfloat16, device=clock.device, generator=gen)
    dst = torch.empty_like(src)

    def copy() -> object:
        return dst.copy_(src)

    for _ in range(3):
        copy()
    clock.sync()
    return _median(clock.back_to_back([copy], reps, 2, 1.0)), 2 * elems * src.element_size()


def _time_mm(clock: Clock, n: int, reps: int, gen: torch.Generator) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=clock.device, generator=gen).mul_(0.1)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=clock.device, generator=gen).mul_(0.1)

    def mm() -> object:
        return torch.mm(a, b)

    for _ in range(3):
        mm()
    clock.sync()
    return _median(clock.back_to_back([mm], reps, 2, 1.0))


def measure_ceilings(clock: Clock, smoke: bool, reps: int) -> dict[str, Any]:
    """Copy bandwidth and bf16 matmul rate on this device, random data, medians of `reps`."""
    gen = torch.Generator(device=clock.device)
    gen.manual_seed(7)
    # 2 GiB per buffer on a GPU (far past any L2); 4 MiB in smoke mode.
    copy_ms, moved = _time_copy(clock, 2**21 if smoke else 2**30, reps, gen)
    n = 256 if smoke else 8192
    mm_ms = _time_mm(clock, n, reps, gen)
    return {
        "copy_bytes_per_s": moved / (copy_ms * 1e-3),
        "mm_flops_per_s": 2 * n**3 / (mm_ms * 1e-3),
        "copy": {"buffer_bytes": moved // 2, "bytes_moved": moved, "ms": copy_ms,
                 "tb_per_s": moved / copy_ms / 1e9},
        "mm": {"n": n, "dtype": "bf16", "ms": mm_ms, "tflops": 2 * n**3 / mm_ms / 1e9},
        "method": "device-to-device copy (bytes = read + write) and torch.mm n^3 on random "
        f"data; back-to-back events, median of {reps}",
    }


# ---------------------------------------------------------------------------------------------
# Running


def _context_alive(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return (torch.ones(1, device=device) + 1).item() == 2.0
    except Exception:
        return False


@dataclass
class Run:
    """Settings and accumulated results of one bench process."""

    device: torch.device
    clock: Clock
    reps: int
    seed: int
    smoke: bool
    variants: bool
    skip: frozenset[str]
    doc: dict[str, Any]
    out_path: Path | None
    l2_bytes: int = 0
    progress: bool = True

    def save(self) -> None:
        if self.out_path is not None:
            write_json(self.out_path, self.doc, compact=True)

    def mark(self, shape: str | None, impl: str | None = None) -> None:
        """Record what is running in a sidecar file (cheap enough to call per sample), so a
        parent process can tell which implementation a hard crash happened in."""
        if self.out_path is None:
            return
        side = progress_path(self.out_path)
        if shape is None:
            side.unlink(missing_ok=True)
            return
        tmp = side.with_name(side.name + ".tmp")
        tmp.write_text(json.dumps({"shape": shape, "impl": impl}))
        os.replace(tmp, side)

    @property
    def poisoned(self) -> dict[str, Any] | None:
        return self.doc.get("poisoned_by")

    def log(self, msg: str) -> None:
        if self.progress:
            print(msg, file=sys.stderr, flush=True)


def progress_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.name + ".inprogress")


def _shape_seed(seed: int, name: str, index: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 101 + index) % (2**63)


def _after_error(run: Run, shape: str, impl: str, exc: BaseException) -> None:
    if run.device.type != "cuda":
        return
    if not _context_alive(run.device):
        run.doc["poisoned_by"] = {"shape": shape, "impl": impl, "error": short_error(exc)}
    elif any(s in str(exc).lower() for s in _STICKY):
        # The error text says sticky but a probe still works: note it, keep going.
        run.doc.setdefault("sticky_errors", []).append({"shape": shape, "impl": impl})
    else:
        gc.collect()
        torch.cuda.empty_cache()  # after an OOM or a half-built implementation


def _poison_note(run: Run) -> str:
    p = run.poisoned or {}
    return (f"not run: CUDA context poisoned by {p.get('impl')} on {p.get('shape')} "
            "(use --isolate)")


def _not_run_row(spec: ShapeSpec, impl: Impl, why: str) -> dict[str, Any]:
    return {"shape": spec.name, "impl": impl.name, "peer": impl.peer, "default": impl.default,
            "status": "error", "ms": None, "error": why, "not_run": True}


def _last_launch() -> object | None:
    """What our host wrapper last launched on this thread, if it was ever loaded."""
    host = sys.modules.get("moe_gemm.ops.launch")  # loaded only once cute has run
    fn = getattr(host, "last_launch", None)
    try:
        return fn() if callable(fn) else None
    except Exception:
        return None


def _launch_fields(before: object | None, after: object | None) -> dict[str, Any]:
    """backend (and the kernel choice the heuristics made) for one of our calls."""
    if after is None or after is before:
        return {"backend": "torch"}
    fields: dict[str, Any] = {"backend": "cute"}
    choice = getattr(after, "choice", None)
    if dataclasses.is_dataclass(choice) and not isinstance(choice, type):
        fields["kernel"] = dataclasses.asdict(choice)
    elif choice is not None:
        fields["kernel"] = repr(choice)
    if isinstance(getattr(after, "num_ctas", None), int):
        fields["num_ctas"] = after.num_ctas  # type: ignore[attr-defined]
    return fields


@dataclass(eq=False)  # identity semantics: `t in active` must not compare tensors
class _Timing:
    """An implementation that passed its check, waiting for its interleaved samples."""

    impl: Impl
    row: dict[str, Any]
    prepared: list[Prepared]
    calls: int
    backlog_ms: float
    single: list[float] = field(default_factory=list)
    b2b: list[float] = field(default_factory=list)
    repeat: list[float] = field(default_factory=list)

    @property
    def fns(self) -> list[Callable[[], object]]:
        return [p.run for p in self.prepared]


def prepare_impl(
    run: Run, spec: ShapeSpec, impl: Impl, sets: list[Inputs], ref: torch.Tensor
) -> tuple[dict[str, Any], _Timing | None]:
    """Build, first-call, check and warm up one implementation; never raises.

    Returns its row ("pending" when it passed and waits for timing, else "n/a" or "error")
    and the timing state for the pending ones.
    """
    row: dict[str, Any] = {"shape": spec.name, "impl": impl.name, "peer": impl.peer,
                           "default": impl.default, "status": "pending", "ms": None}
    if impl.notes:
        row["notes"] = impl.notes
    if impl.config is not None:
        row["config"] = impl.config.as_dict()
    if run.poisoned:
        return _not_run_row(spec, impl, _poison_note(run)), None
    run.mark(spec.name, impl.name)
    if os.environ.get(ABORT_ENV) == f"{spec.name}/{impl.name}":
        os.abort()  # fault injection: a hard crash, as an illegal address can end a process
    clock = run.clock
    try:
        prepared = [impl.build(spec, s, run.device) for s in sets]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = _last_launch()
            t0 = time.perf_counter()
            prepared[0].run()
            clock.sync()
            row["first_call_s"] = time.perf_counter() - t0  # includes any JIT compile
            if not impl.peer:
                row.update(_launch_fields(before, _last_launch()))
            out = prepared[0].check()
            clock.sync()
        if caught:
            row["warnings"] = sorted({str(w.message)[:300] for w in caught})[:5]
        err = rel_err(out, ref)
        del out
        row["rel_err"] = err
        tol = TOLERANCE[spec.dtype]
        if not err <= tol:
            row.update(status="error", error=f"wrong result: relative error {err:.3g} > {tol}")
            return row, None
        fns = [p.run for p in prepared]
        for i in range(max(3, len(fns))):
            fns[i % len(fns)]()
        host = clock.host_ms(fns, 5)
        est = max(_median(clock.single(fns, 3)), 1e-4)
        calls = 1 if run.smoke else max(1, min(1000, math.ceil(B2B_TARGET_MS / est)))
        row["host_us"] = _median(host) * 1e3
        return row, _Timing(impl, row, prepared, calls, _median(host) * calls * 1.25 + 0.1)
    except NotApplicable as exc:
        row.update(status="n/a", reason=str(exc))
        return row, None
    except Exception as exc:  # one failing implementation must never abort the run
        row.update(status="error", error=short_error(exc))
        _after_error(run, spec.name, impl.name, exc)
        return row, None


def time_interleaved(run: Run, spec: ShapeSpec, timings: list[_Timing]) -> None:
    """Sample every pending implementation once per round, `reps` rounds.

    Interleaving puts clock and power drift (seen: 6% between two timings of the same kernel
    10 s apart on an H200 running large GEMMs) on every implementation alike instead of on
    whichever ran last. Each round starts one implementation later, and the default is sampled
    again at the end of each round (`ms_repeat`): its spread against `ms` is the noise floor.
    """
    clock, active = run.clock, list(timings)
    default = next((t for t in timings if t.impl.default), None)
    for r in range(run.reps):
        if not active or run.poisoned:
            break
        k = r % len(active)
        order = active[k:] + active[:k]
        if default is not None and default in active:
            order.append(default)
        seen: set[int] = set()
        for t in order:
            if t not in active:
                continue
            run.mark(spec.name, t.impl.name)
            if os.environ.get(ABORT_ENV) == f"{spec.name}/{t.impl.name}@timing":
                os.abort()
            try:
                fns = t.fns
                if id(t) in seen:
                    t.repeat += clock.back_to_back(fns, 1, t.calls, t.backlog_ms)
                    continue
                seen.add(id(t))
                t.single += clock.single([fns[r % len(fns)]], 1)
                t.b2b += clock.back_to_back(fns, 1, t.calls, t.backlog_ms)
            except Exception as exc:
                t.row.update(status="error", error=short_error(exc))
                active.remove(t)
                _after_error(run, spec.name, t.impl.name, exc)
                if run.poisoned:
                    break
    for t in timings:
        if t.row["status"] != "pending":
            continue
        if run.poisoned or len(t.b2b) < run.reps:
            t.row.update(status="error", error=_poison_note(run), not_run=True)
            continue
        t.row.update(
            status="ok", ms=_median(t.b2b), ms_p10=_quantile(t.b2b, 0.1),
            ms_p90=_quantile(t.b2b, 0.9), ms_single=_median(t.single),
            ms_single_p10=_quantile(t.single, 0.1), ms_single_p90=_quantile(t.single, 0.9),
            calls_per_sample=t.calls, reps=run.reps, input_sets=len(t.prepared),
        )
        if t.repeat:
            t.row["ms_repeat"] = _median(t.repeat)


def run_shape(run: Run, spec: ShapeSpec) -> None:
    """Every implementation on one shape; rows appended to run.doc['results']."""
    sizes = spec.sizes(run.seed)
    elem = spec.torch_dtype.itemsize
    info = spec.describe(run.seed)
    info.update(bytes=bytes_needed(sizes, elem, elem), flops=flops(sizes))
    run.doc["shapes"][spec.name] = info
    impls = [i for i in implementations(spec, run.variants) if i.name not in run.skip]
    results = run.doc["results"]
    if run.poisoned:
        results.extend(_not_run_row(spec, i, _poison_note(run)) for i in impls)
        run.save()
        return
    t_shape = time.perf_counter()
    sets: list[Inputs] = []
    try:
        run.mark(spec.name, "input generation")
        counts = spec.counts(run.seed)
        sets.append(make_inputs(spec, counts, run.device, _shape_seed(run.seed, spec.name, 0)))
        set_bytes = input_bytes(sets[0])
        nsets = input_sets_needed(set_bytes, run.l2_bytes, 2 if run.smoke else 64)
        for i in range(1, nsets):
            sets.append(make_inputs(spec, counts, run.device, _shape_seed(run.seed, spec.name, i)))
        info.update(input_sets=nsets, set_bytes=set_bytes)
        ref = reference(sets[0])
    except Exception as exc:
        results.extend(_not_run_row(spec, i, f"input generation failed: {short_error(exc)}")
                       for i in impls)
        _after_error(run, spec.name, "input generation", exc)
        run.save()
        return
    timings: list[_Timing] = []
    for impl in impls:
        row, timing = prepare_impl(run, spec, impl, sets, ref)
        results.append(row)
        run.save()
        if timing is not None:
            timings.append(timing)
        else:
            why = row.get("error") or row.get("reason") or ""
            run.log(f"[bench] {spec.name:13s} {impl.name:37s} {row['status']}: {why[:100]}")
    del ref
    time_interleaved(run, spec, timings)
    for t in timings:
        status = f"{t.row['ms'] * 1e3:.1f} us" if t.row["status"] == "ok" else (
            f"{t.row['status']}: {str(t.row.get('error'))[:100]}")
        run.log(f"[bench] {spec.name:13s} {t.impl.name:37s} {status}")
    info["wall_s"] = time.perf_counter() - t_shape
    del sets, timings
    gc.collect()
    if run.device.type == "cuda" and not run.poisoned:
        torch.cuda.empty_cache()
    run.mark(None)
    run.save()


FRESH_SETS = 1031  # operand sets the "new operand addresses" row rotates through


def measure_host_overhead(run: Run) -> dict[str, Any]:
    """CPU time of one call and the call-to-kernel gap on a small MoE case (issue 4 item 4)."""
    spec = host_overhead_shape(run.smoke)
    counts = spec.counts(run.seed)
    inp = make_inputs(spec, counts, run.device, _shape_seed(run.seed, spec.name, 0))
    assert isinstance(inp, VarlenInputs)
    x, w, offs = inp.x, inp.w, inp.offs
    bounds = [0, *offsets(counts)]
    a_list = [x[bounds[e]:bounds[e + 1]] for e in range(len(counts))]
    b_list = [w[e] for e in range(len(counts))]
    loop = loop_body(inp, run.device)
    # The batched (3D x 3D) form on the same rows: E problems of T / E rows each.
    x3 = x[: (x.shape[0] // len(counts)) * len(counts)].view(len(counts), -1, x.shape[1])
    calls: dict[str, Callable[[], object]] = {
        "moe_gemm.grouped_mm (default)": lambda: ops.grouped_mm(x, w, offs),
        "moe_gemm.grouped_gemm (default)": lambda: ops.grouped_gemm(a_list, b_list),
        "moe_gemm.GroupedGemmPlan call": ops.GroupedGemmPlan(a_list, b_list),
        "moe_gemm.grouped_mm 3-D (default)": lambda: ops.grouped_mm(x3, w),
        "torch.mm loop": loop,
        "torch.bmm": lambda: torch.bmm(x3, w),
    }
    if GROUPED_MM_FN is not None:
        gmm = GROUPED_MM_FN
        calls[GROUPED_MM_NAME] = lambda: gmm(x, w, offs=offs)
        calls[GROUPED_MM_NAME + " 3-D"] = lambda: gmm(x3, w)
    # Operand addresses never seen before at every call (fresh activations each step): views
    # of one buffer at FRESH_SETS row offsets, more than the launch records the C++ module
    # keeps (1024), so no call finds a record of its addresses. Made on its first (warm-up)
    # call and measured last: its ~8000 live views must not slow the other rows.
    fresh: dict[str, Any] = {}

    def new_addresses() -> object:
        sets = fresh.get("sets")
        if sets is None:
            rows = x.shape[0]
            block = torch.randn(FRESH_SETS * rows, x.shape[1], dtype=x.dtype, device=x.device)
            sets = fresh["sets"] = itertools.cycle(
                [[block[r * rows + bounds[e]:r * rows + bounds[e + 1]]
                  for e in range(len(counts))] for r in range(FRESH_SETS)])
        return ops.grouped_gemm(next(sets), b_list)

    calls["moe_gemm.grouped_gemm (new operand addresses)"] = new_addresses
    iters = 20 if run.smoke else 300
    entries: dict[str, Any] = {}
    for name, fn in calls.items():
        if name in run.skip:
            continue
        if run.poisoned:
            entries[name] = {"error": _poison_note(run)}
            continue
        run.mark(HOST_OVERHEAD, name)
        try:
            for _ in range(5):
                fn()
            cpu = run.clock.host_ms([fn], iters, sync_every=16)
            single = run.clock.single([fn], run.reps)
            calls_n = 1 if run.smoke else 200
            b2b = run.clock.back_to_back([fn], run.reps, calls_n,
                                         _median(cpu) * calls_n * 1.25 + 0.1)
            entries[name] = {
                "cpu_us": _median(cpu) * 1e3, "cpu_us_p10": _quantile(cpu, 0.1) * 1e3,
                "cpu_us_p90": _quantile(cpu, 0.9) * 1e3, "single_us": _median(single) * 1e3,
                "gpu_us": _median(b2b) * 1e3,
                "launch_gap_us": (_median(single) - _median(b2b)) * 1e3,
            }
        except Exception as exc:
            entries[name] = {"error": short_error(exc)}
            _after_error(run, spec.name, name, exc)
    run.mark(None)
    fresh.clear()
    def below(name: str, field: str = "cpu_us", peer: str = GROUPED_MM_NAME) -> bool | None:
        ours = entries.get(name, {}).get(field)
        theirs = entries.get(peer, {}).get(field)
        return None if ours is None or theirs is None else ours < theirs

    return {
        "shape": {"experts": spec.experts, "rows": spec.rows, "N": spec.n, "K": spec.k,
                  "dtype": spec.dtype, "counts": counts},
        "calls": entries,
        # Issue 4: one call of each of our ops below torch's grouped_mm in CPU time.
        "ours_below_torch": below("moe_gemm.grouped_mm (default)"),
        "grouped_gemm_below_torch": below("moe_gemm.grouped_gemm (default)"),
        "grouped_gemm_new_addresses_below_torch": below(
            "moe_gemm.grouped_gemm (new operand addresses)"),
        # ... and the gap from the call to its kernel starting (the 3-D form against torch's).
        "launch_gap_below_torch": {
            "grouped_mm": below("moe_gemm.grouped_mm (default)", "launch_gap_us"),
            "grouped_mm 3-D": below("moe_gemm.grouped_mm 3-D (default)", "launch_gap_us",
                                    GROUPED_MM_NAME + " 3-D"),
            "grouped_gemm": below("moe_gemm.grouped_gemm (default)", "launch_gap_us"),
            "grouped_gemm new operand addresses": below(
                "moe_gemm.grouped_gemm (new operand addresses)", "launch_gap_us"),
        },
        "method": f"cpu_us: time.perf_counter around one call, no sync, median of {iters} "
        "(synchronized every 16 calls outside the timed region); single_us: events around one "
        "call with the GPU idle; gpu_us: back-to-back behind a backlog; launch_gap_us = "
        "single_us - gpu_us, the time from the call to its kernel starting (plus any gaps "
        "between its kernels)",
    }


# ---------------------------------------------------------------------------------------------
# Derived numbers, the bar, outputs


def write_json(path: Path, doc: dict[str, Any], compact: bool = False) -> None:
    """Atomic write (a crash mid-write never leaves half a file); compact for progress saves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(doc, default=str, **({"separators": (",", ":")} if compact else
                                           {"indent": 1}))
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def plot_png(doc: dict[str, Any], path: Path) -> str | None:
    """Bar chart: fraction of the roofline floor per shape, ours (default) vs each peer.

    Returns None when written, else why not (matplotlib missing, nothing to plot).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    shapes = [s for s in doc.get("shapes", {}) if any(
        r["shape"] == s and r.get("fraction_of_floor") for r in doc["results"])]
    names: list[str] = []
    for r in doc["results"]:
        if (r.get("default") or r.get("peer")) and r.get("fraction_of_floor"):
            if r["impl"] not in names:
                names.append(r["impl"])
    if not shapes or not names:
        return "nothing measured: no PNG"
    names.sort(key=lambda n: n != DEFAULT_NAME)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.5 * len(shapes)), 4.8))
    colors = plt.get_cmap("tab10")
    for j, name in enumerate(names):
        xs, hs, labels = [], [], []
        for i, s in enumerate(shapes):
            r = next((r for r in doc["results"] if r["shape"] == s and r["impl"] == name
                      and r.get("fraction_of_floor")), None)
            if r is not None:
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                hs.append(r["fraction_of_floor"])
                labels.append(f"{r['ms'] * 1e3:.0f}")
        color = "black" if name == DEFAULT_NAME else colors(j % 10)
        bars = ax.bar(xs, hs, width, label=name, color=color)
        for b, text in zip(bars, labels):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), text, ha="center",
                    va="bottom", fontsize=5, rotation=90)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.95, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(shapes, rotation=15)
    ax.set_ylabel("roofline floor / time (higher is better)")
    ax.set_title(f"moe_gemm vs peers: {doc.get('device')}, {doc.get('date')} (labels: us)",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------------
# Process level: one process, or one subprocess per shape


def _device_info(device: torch.device) -> tuple[str, dict[str, Any], int]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    if device.type != "cuda":
        return f"cpu ({platform.machine()})", info, 0
    props = torch.cuda.get_device_properties(device)
    l2 = int(getattr(props, "L2_cache_size", 0) or 0) or 50 * 2**20
    info.update(name=props.name, capability=f"sm_{props.major}{props.minor}",
                sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                l2_mib=round(l2 / 2**20, 1), cuda=torch.version.cuda)
    return props.name, info, l2


def _new_doc(device: torch.device, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from moe_gemm.capability import cute_problem

    name, info, _ = _device_info(device)
    info["cute_backend"] = cute_problem(device) or "available"
    return {
        "device": name, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "complete": False, "moe_gemm": __version__, "device_info": info, "argv": argv,
        "settings": {"reps": args.reps, "seed": args.seed, "smoke": args.smoke,
                     "variants": args.variants, "b2b_target_ms": B2B_TARGET_MS,
                     "tolerance": TOLERANCE,
                     "timing": "ms: back-to-back median (GPU time, host enqueue hidden); "
                     "ms_single: per-launch events median, device idle before each call"},
        "ceilings": {}, "shapes": {}, "results": [],
    }


def run_in_process(args: argparse.Namespace, argv: list[str], device: torch.device,
                   specs: list[ShapeSpec], host_overhead: bool,
                   out_path: Path | None) -> dict[str, Any]:
    doc = _new_doc(device, args, argv)
    if args.reps < 20 and not args.smoke:
        doc["warning"] = f"reps={args.reps}: the issue asks for medians of at least 20"
    _, _, l2 = _device_info(device)
    run = Run(device=device, clock=Clock(device), reps=args.reps, seed=args.seed,
              smoke=args.smoke, variants=args.variants, skip=frozenset(args.skip_impl or ()),
              doc=doc, out_path=out_path, l2_bytes=l2 if not args.smoke else 1 << 20,
              progress=not args.quiet)
    try:
        doc["ceilings"] = measure_ceilings(run.clock, args.smoke, args.reps)
    except Exception as exc:
        doc["ceilings"] = {"error": short_error(exc)}
        _after_error(run, "ceilings", "ceilings", exc)
    run.save()
    for spec in specs:
        run_shape(run, spec)
    if host_overhead:
        try:
            doc["host_overhead"] = measure_host_overhead(run)
        except Exception as exc:
            doc["host_overhead"] = {"error": short_error(exc)}
            _after_error(run, HOST_OVERHEAD, "host overhead", exc)
    doc["complete"] = True
    derive(doc)
    run.save()
    return doc


def _child_argv(args: argparse.Namespace, only: str, out: Path, skip: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.bench", "--only", only, "--out", str(out),
           "--png", "none", "--no-table", "--quiet", "--reps", str(args.reps),
           "--seed", str(args.seed), "--device", args.device or "auto",
           "--variants" if args.variants else "--no-variants"]
    if args.smoke:
        cmd.append("--smoke")
    for name in skip:
        cmd += ["--skip-impl", name]
    return cmd


def run_isolated(args: argparse.Namespace, argv: list[str], device: torch.device,
                 suite: list[ShapeSpec], names: list[str],
                 out_path: Path | None) -> dict[str, Any]:
    """Each shape (and the host-overhead case) in its own process; crashes retried without
    the implementation that crashed."""
    doc = _new_doc(device, args, argv)
    doc["settings"]["isolate"] = True
    ceilings: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moe-gemm-bench-") as tmp:
        for name in names:
            skip = list(args.skip_impl or ())
            t0 = time.perf_counter()
            for attempt in range(32):  # bounded: each retry skips at least one more impl
                out = Path(tmp) / f"{name}-{attempt}.json"
                rc, tail = 0, ""
                try:
                    proc = subprocess.run(_child_argv(args, name, out, skip), text=True,
                                          capture_output=True, timeout=args.timeout)
                    rc, tail = proc.returncode, (proc.stderr or "")[-600:]
                except subprocess.TimeoutExpired as exc:
                    rc, tail = -1, f"timed out after {args.timeout} s; {str(exc.stderr)[-300:]}"
                child = json.loads(out.read_text()) if out.exists() else None
                if child is None:
                    doc["results"].append({"shape": name, "impl": "*", "peer": False,
                                           "default": False, "status": "error", "ms": None,
                                           "error": f"subprocess rc={rc}: {tail.strip()}"})
                    break
                if child.get("ceilings", {}).get("copy_bytes_per_s"):
                    ceilings.append(child["ceilings"])
                doc["shapes"].update(child.get("shapes", {}))
                if "host_overhead" in child:
                    doc["host_overhead"] = child["host_overhead"]
                rows = [r for r in child["results"]
                        if not r.get("not_run") and r.get("status") != "pending"]
                doc["results"].extend(rows)
                side = progress_path(out)
                culprit = child.get("poisoned_by") or (
                    json.loads(side.read_text()) if side.exists() else None)
                if rc == 0 and child.get("complete") and not child.get("poisoned_by"):
                    break
                if culprit is None or culprit.get("impl") in skip:
                    break  # nothing to skip that would make the next attempt get further
                if not any(r["impl"] == culprit["impl"] for r in rows):
                    known = {i.name: i for s in suite if s.name == name
                             for i in implementations(s, True)}
                    impl = known.get(culprit["impl"])
                    doc["results"].append({
                        "shape": name, "impl": culprit["impl"],
                        "peer": bool(impl and impl.peer), "default": bool(impl and impl.default),
                        "status": "error", "ms": None,
                        "error": f"process died (rc={rc}): {tail.strip()[-300:]}"})
                skip += [r["impl"] for r in rows] + [culprit["impl"]]
                print(f"[isolate] {name}: crash in {culprit['impl']}; retrying without it",
                      file=sys.stderr, flush=True)
            print(f"[isolate] {name}: done in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
            if ceilings:
                doc["ceilings"] = _merge_ceilings(ceilings)
            derive(doc)
            if out_path is not None:
                write_json(out_path, doc)
    doc["complete"] = True
    return doc


def _merge_ceilings(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over the per-process measurements, so every shape's floor uses one ceiling."""
    merged = dict(items[0])
    for key in ("copy_bytes_per_s", "mm_flops_per_s"):
        merged[key] = _median([c[key] for c in items])
    merged["per_process"] = [{k: c[k] for k in ("copy_bytes_per_s", "mm_flops_per_s")}
                             for c in items]
    return merged


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-gemm bench", description=(
        "Time moe_gemm against torch.bmm, torch grouped_mm, torch.mm loops (eager and CUDA "
        "graph) and QuACK on one GPU; print a table, write JSON and a PNG."))
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, few reps: checks the harness in seconds (CPU is fine)")
    p.add_argument("--only", metavar="SHAPE[,SHAPE]",
                   help=f"run only these shapes (and/or '{HOST_OVERHEAD}'); see --list")
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    p.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                   help="run the schedule x visitor x K-sort matrix where it applies")
    p.add_argument("--reps", type=int, default=None,
                   help=f"timed samples per measurement (default {DEFAULT_REPS}; smoke "
                   f"{SMOKE_REPS})")
    p.add_argument("--seed", type=int, default=1234, help="routing and data seed")
    p.add_argument("--isolate", action="store_true",
                   help="one subprocess per shape; a crash loses one implementation only")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per shape subprocess with --isolate")
    p.add_argument("--out", help="JSON path (default benchmarks/results/bench-<date>.json)")
    p.add_argument("--png", help="PNG path (default: beside the JSON); 'none' to skip")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if "
                   "available)")
    p.add_argument("--skip-impl", action="append", metavar="NAME",
                   help="skip an implementation by exact name (repeatable)")
    p.add_argument("--no-table", action="store_true", help="do not print the table")
    p.add_argument("--quiet", action="store_true", help="no per-implementation progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `moe-gemm bench` and `python -m benchmarks.bench`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    suite = smoke_suite() if args.smoke else full_suite()
    if args.list:
        for s in suite:
            print(f"{s.name:13s} {s.form:8s} {s.dtype}  {s.description}")
        print(f"{HOST_OVERHEAD:13s} host CPU time per call (small MoE case)")
        return 0
    if args.reps is None:
        args.reps = SMOKE_REPS if args.smoke else DEFAULT_REPS
    if args.reps < 1:
        print("error: --reps must be at least 1", file=sys.stderr)
        return 2
    known = [s.name for s in suite] + [HOST_OVERHEAD]
    names = known if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        print(f"error: unknown shape(s) {', '.join(unknown) or '(none)'}; expected some of "
              f"{', '.join(known)}", file=sys.stderr)
        return 2
    dev_name = args.device if args.device not in (None, "auto") else (
        "cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(dev_name)
    except RuntimeError as exc:
        print(f"error: bad --device {dev_name!r}: {exc}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("error: --device cuda but no CUDA GPU is visible", file=sys.stderr)
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif not args.smoke:
        print("error: the full suite needs a CUDA GPU (GBs of inputs); use --smoke on the CPU",
              file=sys.stderr)
        return 2
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    out_path = Path(args.out) if args.out else Path("benchmarks/results") / f"bench-{date}.json"
    png_path = None if (args.png or "").lower() == "none" else (
        Path(args.png) if args.png else out_path.with_suffix(".png"))
    specs = [s for s in suite if s.name in names]
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # CPU smoke timings mean nothing, but OpenMP threads spinning against a loaded CI
        # machine's other processes can make a tiny bf16 mm take 10 ms: use one thread.
        torch.set_num_threads(1)
    try:
        if args.isolate:
            doc = run_isolated(args, argv, device, suite, names, out_path)
        else:
            doc = run_in_process(args, argv, device, specs, HOST_OVERHEAD in names, out_path)
    finally:
        torch.set_num_threads(threads)
    derive(doc)
    write_json(out_path, doc)
    notes = [f"wrote {out_path}"]
    if png_path is not None:
        why = plot_png(doc, png_path)
        notes.append(f"wrote {png_path}" if why is None else f"warning: {why}")
    if not args.no_table:
        print("; ".join(notes), flush=True)
        print(format_table(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
