"""Host overhead: what one call costs the CPU, and how long until its kernel starts.

    python -m benchmarks.host_overhead --out host.json [--smoke] [--reps N]

Small problems, so the GPU work is short and the host path shows. Every case is measured in
the same process as torch's own grouped_mm, so the comparison holds on whatever CPU the GPU
machine has:

| case | call |
| --- | --- |
| grouped_mm 2-D | ours and torch's: x (64, 512), w (8, 512, 512), offs on the GPU |
| grouped_mm 3-D | ours and torch's: x (8, 8, 512), w (8, 512, 512) |
| GroupedGemmPlan call | a plan over 8 problems, called again and again (its launch recorded as a CUDA graph at the first call and replayed, the default) |
| GroupedGemmPlan call (direct launch) | the same plan built with MOE_GEMM_PLAN_GRAPH=0 (the kernel called each time) |
| grouped_gemm (8 problems), (256 problems) | separate allocations per problem, the same tensors every call |
| torch.mm loop (8 problems), (256 problems) | the host-known loop, for scale |

Per case: `cpu_us`, time.perf_counter around one call without synchronising (median of many,
the GPU synchronised every 16 calls outside the timed region so the launch queue never
fills); `single_us`, CUDA events around one call with the GPU idle (`single_cpu_us`: that
call's own CPU time, right after the synchronisation); `queued_us`, events around one call
enqueued behind a GPU backlog (the call's own GPU time, its launches' processing on the GPU
included, the host's enqueue hidden); `gpu_us`, the back-to-back time per call behind a
backlog (successive launches overlap there); `launch_gap_us = single_us - queued_us`, the time
the host adds between the call and its kernels running (about `single_cpu_us` where the call's
kernels are launched at its end; a call that launches a small kernel early, as torch's
grouped_mm does, shows less); `gap_b2b_us = single_us - gpu_us`, the same gap taken against
back-to-back time (it also counts the GPU's launch processing that back-to-back calls overlap,
which differs between kernels). `checks` holds the targets: our grouped_mm at or below torch's
in CPU time and in both gaps (2-D and 3-D), a repeated plan call at most 10 us of CPU,
grouped_gemm on 256 problems at most 250 us of CPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from benchmarks.clock import Clock, median, quantile
from benchmarks.report import write_json
from benchmarks.runner import bench_device
from benchmarks.suite import GROUPED_MM_FN, GROUPED_MM_NAME, short_error
from moe_gemm.ops import api as ops
from moe_gemm.ops.general_launch import PLAN_GRAPH_ENV

PLAN_CPU_US_MAX = 10.0
GEMM_256_CPU_US_MAX = 250.0
OURS_MM2 = "moe_gemm grouped_mm 2-D"
OURS_MM3 = "moe_gemm grouped_mm 3-D"
TORCH_MM2 = f"{GROUPED_MM_NAME} 2-D"
TORCH_MM3 = f"{GROUPED_MM_NAME} 3-D"
PLAN = "moe_gemm GroupedGemmPlan call"
PLAN_DIRECT = "moe_gemm GroupedGemmPlan call (direct launch)"
GEMM8 = "moe_gemm grouped_gemm (8 problems)"
GEMM256 = "moe_gemm grouped_gemm (256 problems)"
LOOP8 = "torch.mm loop (8 problems)"
LOOP256 = "torch.mm loop (256 problems)"
# Every case build_cases can return (torch's only where torch has grouped_mm): the names
# --skip-impl takes.
CASE_NAMES = (OURS_MM2, OURS_MM3, TORCH_MM2, TORCH_MM3, PLAN, PLAN_DIRECT, GEMM8, GEMM256,
              LOOP8, LOOP256)


def _sizes(smoke: bool) -> dict[str, int]:
    if smoke:
        return {"E": 4, "rows": 16, "N": 32, "K": 32, "M3": 4, "many_m": 2}
    return {"E": 8, "rows": 64, "N": 512, "K": 512, "M3": 8, "many_m": 8}


def build_cases(device: torch.device, smoke: bool, seed: int = 0
                ) -> tuple[dict[str, Callable[[], object]], dict[str, Any]]:
    """Name -> zero-argument call, and the sizes used."""
    s = _sizes(smoke)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen) * 0.1

    E, T, N, K = s["E"], s["rows"], s["N"], s["K"]
    x = randn(T, K)
    w = randn(E, N, K).transpose(1, 2)  # the (E, N, K) checkpoint layout, as users pass it
    offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (T // E)
    x3 = randn(E, s["M3"], K)
    m = s["many_m"]
    a8, b8 = [randn(m, K) for _ in range(8)], [randn(K, N) for _ in range(8)]
    a256, b256 = [randn(m, K) for _ in range(256)], [randn(K, N) for _ in range(256)]
    plan = ops.GroupedGemmPlan(a8, b8)
    with mock.patch.dict(os.environ, {PLAN_GRAPH_ENV: "0"}):
        direct_plan = ops.GroupedGemmPlan(a8, b8)
    cases: dict[str, Callable[[], object]] = {
        OURS_MM2: lambda: ops.grouped_mm(x, w, offs),
        OURS_MM3: lambda: ops.grouped_mm(x3, w),
    }
    if GROUPED_MM_FN is not None:
        gmm = GROUPED_MM_FN
        cases[TORCH_MM2] = lambda: gmm(x, w, offs=offs)
        cases[TORCH_MM3] = lambda: gmm(x3, w)
    cases[PLAN] = plan
    cases[PLAN_DIRECT] = direct_plan
    cases[GEMM8] = lambda: ops.grouped_gemm(a8, b8)
    cases[GEMM256] = lambda: ops.grouped_gemm(a256, b256)
    out8 = [torch.empty(m, N, device=device, dtype=torch.bfloat16) for _ in range(8)]
    out256 = [torch.empty(m, N, device=device, dtype=torch.bfloat16) for _ in range(256)]

    def loop(a, b, out) -> Callable[[], object]:
        def body() -> object:
            for ai, bi, oi in zip(a, b, out):
                torch.mm(ai, bi, out=oi)
            return out
        return body

    cases[LOOP8] = loop(a8, b8, out8)
    cases[LOOP256] = loop(a256, b256, out256)
    info = {"grouped_mm 2-D": {"T": T, "E": E, "N": N, "K": K},
            "grouped_mm 3-D": {"G": E, "M": s["M3"], "N": N, "K": K},
            "lists": {"M": m, "N": N, "K": K}, "dtype": "bf16",
            "w_layout": "(E, N, K) storage passed as w_t.transpose(1, 2)"}
    return cases, info


ROUNDS = 6  # each measurement is taken in this many interleaved rounds over all cases


def _summary(cpu: list[float], single: list[float], queued: list[float], b2b: list[float],
             single_cpu: list[float]) -> dict[str, float]:
    return {"cpu_us": median(cpu) * 1e3, "cpu_us_p10": quantile(cpu, 0.1) * 1e3,
            "cpu_us_p90": quantile(cpu, 0.9) * 1e3, "single_us": median(single) * 1e3,
            "single_cpu_us": median(single_cpu) * 1e3,
            "queued_us": median(queued) * 1e3, "gpu_us": median(b2b) * 1e3,
            "launch_gap_us": (median(single) - median(queued)) * 1e3,
            "gap_b2b_us": (median(single) - median(b2b)) * 1e3}


def measure_cases(clock: Clock, cases: dict[str, Callable[[], object]], reps: int, iters: int,
                  smoke: bool, mark: Callable[[str | None], None] = lambda name: None,
                  on_error: Callable[[str, BaseException], None] = lambda n, e: None
                  ) -> dict[str, dict[str, Any]]:
    """Every case's numbers, sampled interleaved: each of ROUNDS rounds takes a share of every
    case's samples, starting one case later each round, so that warm-up, clock and power
    drift fall on all cases alike (the first case measured alone once showed a gap ~10 us
    larger than in later positions). A case that raises records its error and drops out."""
    entries: dict[str, dict[str, Any]] = {}
    live: dict[str, Callable[[], object]] = {}

    def attempt(name: str, step: Callable[[], object]) -> bool:
        try:
            step()
            return True
        except Exception as exc:  # one failing case must not lose the others
            entries[name] = {"error": short_error(exc)}
            live.pop(name, None)
            on_error(name, exc)
            return False

    for name, fn in cases.items():
        mark(name)
        live[name] = fn
        attempt(name, lambda fn=fn: [fn() for _ in range(5)])
    mark(None)
    rounds = 2 if smoke else ROUNDS
    share_iters, share_reps = max(1, iters // rounds), max(1, -(-reps // rounds))
    calls = 1 if smoke else 200
    samples: dict[str, tuple[list[float], ...]] = {name: ([], [], [], [], []) for name in live}
    for r in range(rounds):
        names = list(live)
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        for name in order:
            if name in live:
                cpu = samples[name][0]
                attempt(name, lambda: cpu.extend(
                    clock.host_ms([live[name]], share_iters, sync_every=16)))
        for name in order:
            if name in live:
                attempt(name, lambda: samples[name][1].extend(
                    clock.single([live[name]], share_reps, host=samples[name][4])))
        for name in order:
            if name in live:
                # (a backlog several times the call's host time, so its launches are all
                # queued before the GPU reaches them)
                backlog = median(samples[name][0]) * 4 + 0.05
                attempt(name, lambda: samples[name][2].extend(
                    clock.queued([live[name]], share_reps, backlog)))
        for name in order:
            if name in live:
                backlog = median(samples[name][0]) * calls * 1.25 + 0.1
                attempt(name, lambda: samples[name][3].extend(
                    clock.back_to_back([live[name]], share_reps, calls, backlog)))
    for name in live:
        entries[name] = _summary(*samples[name])
    return {name: entries[name] for name in cases if name in entries}


def checks(entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The host-cost targets, each {"value", "limit" or "torch", "ok"} (ok None: not measured)."""
    def get(name: str, field: str) -> float | None:
        return entries.get(name, {}).get(field)

    out: dict[str, dict[str, Any]] = {}
    for label, ours, theirs in (("grouped_mm 2-D", OURS_MM2, TORCH_MM2),
                                ("grouped_mm 3-D", OURS_MM3, TORCH_MM3)):
        for field in ("cpu_us", "launch_gap_us", "gap_b2b_us"):
            v, t = get(ours, field), get(theirs, field)
            out[f"{label} {field} <= torch"] = {
                "value": v, "torch": t, "ok": None if v is None or t is None else v <= t}
    for label, name, limit in (("GroupedGemmPlan call cpu_us", PLAN, PLAN_CPU_US_MAX),
                               ("grouped_gemm 256 problems cpu_us", GEMM256,
                                GEMM_256_CPU_US_MAX)):
        v = get(name, "cpu_us")
        out[f"{label} <= {limit:g}"] = {"value": v, "limit": limit,
                                         "ok": None if v is None else v <= limit}
    return out


def measure_host_overhead(clock: Clock, *, smoke: bool, reps: int, skip: frozenset[str] = frozenset(),
                          mark: Callable[[str | None], None] = lambda name: None,
                          on_error: Callable[[str, BaseException], None] = lambda n, e: None,
                          seed: int = 0) -> dict[str, Any]:
    """Every case's numbers and the checks (a case that raises records its error)."""
    cases, info = build_cases(clock.device, smoke, seed)
    iters = 20 if smoke else 300
    cases = {name: fn for name, fn in cases.items() if name not in skip}
    entries = measure_cases(clock, cases, reps, iters, smoke, mark, on_error)
    return {
        "shape": info, "calls": entries, "checks": checks(entries),
        "method": f"cpu_us: time.perf_counter around one call, no sync, median of {iters} "
        "(synchronized every 16 calls outside the timed region); single_us: events around one "
        "call with the GPU idle (single_cpu_us: its CPU time); queued_us: events around one call "
        "enqueued behind a backlog; "
        f"every measurement interleaved over the cases in {2 if smoke else ROUNDS} rounds; "
        "gpu_us: back-to-back behind a backlog; launch_gap_us = single_us - queued_us, the time "
        "the host adds between the call and its kernels running; gap_b2b_us = single_us - "
        "gpu_us",
    }


def format_lines(result: dict[str, Any]) -> list[str]:
    # (single: the call's time to its result with the GPU idle, cpu@idle its CPU time there;
    # queued: its GPU time alone;
    # gap = single - queued, b2b gap = single - back-to-back time per call)
    lines = [f"{'case':40} | {'cpu us':>8} | {'cpu@idle':>8} | {'gap us':>8} | {'b2b gap':>8} "
             f"| {'queued us':>9} | {'gpu us':>8} | {'single us':>9}"]
    for name, e in result["calls"].items():
        if "error" in e:
            lines.append(f"{name[:40]:40} | error: {e['error'][:60]}")
        else:
            lines.append(f"{name[:40]:40} | {e['cpu_us']:8.1f} | {e['single_cpu_us']:8.1f} | "
                         f"{e['launch_gap_us']:8.1f} | "
                         f"{e['gap_b2b_us']:8.1f} | {e['queued_us']:9.1f} | "
                         f"{e['gpu_us']:8.1f} | {e['single_us']:9.1f}")
    for name, c in result["checks"].items():
        verdict = {True: "ok", False: "MISSED", None: "not measured"}[c["ok"]]
        lines.append(f"check {name}: {verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=(
        "CPU time per call and call-to-kernel gap: our ops against torch's grouped_mm."))
    p.add_argument("--out", help="JSON path (default: print only)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few reps (CPU is fine)")
    p.add_argument("--reps", type=int, default=None, help="samples per measurement")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu")
    args = p.parse_args(argv)
    from moe_gemm.tuning.argcheck import output_problem

    # Checked before anything is measured: --device foo raised RuntimeError out of
    # torch.device (a traceback), --reps 0 was taken as the default, and an --out folder
    # raised IsADirectoryError once the measurements were done.
    why = ("--reps must be at least 1" if args.reps is not None and args.reps < 1
           else output_problem(Path(args.out), "--out") if args.out else None)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        device = bench_device(args.device, args.smoke, "host overhead")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reps = args.reps or (3 if args.smoke else 30)
    result = measure_host_overhead(Clock(device), smoke=args.smoke, reps=reps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"cpu ({platform.machine()})")
    doc = {"device": name, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
           "torch": torch.__version__, "python": platform.python_version(), **result}
    if args.out:
        # (null for a NaN or infinite value: json.dumps wrote the bare words NaN and Infinity,
        # which are not JSON)
        write_json(Path(args.out), doc)
    print("\n".join(format_lines(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
