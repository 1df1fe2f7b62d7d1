"""Where the call-to-kernel gap of one call goes, on a GPU machine.

For each host-overhead case (benchmarks/host_overhead.py) called with the GPU idle, it splits
the time from the call to its kernel's start into: CPU time before the launch API call, the
launch API call itself, and the driver-to-GPU latency; and it reports the kernel's duration on
the idle GPU. Timestamps come from the torch profiler (CUPTI), which records runtime and
driver launch calls (cudaLaunchKernel, cuLaunchKernelEx) and kernel activity on one clock.

    python scripts/launch_gap_probe.py [--reps 50] [--idle-ms 0] [--out gap.json]

Prints a table; --out writes every case's medians as JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks.host_overhead import build_cases  # noqa: E402
from moe_gemm.ops import mm_launch  # noqa: E402
from moe_gemm.tuning.table_io import write_json  # noqa: E402


def _mark_plan_calls() -> None:
    """Wrap the plans' launch (what the ops call) in a profiler range, so the trace shows
    when a call reaches its plan (the lookup and checks before it) and how long the plan takes
    to launch."""
    for cls in (mm_launch.MmPlan, mm_launch.BmmPlan):
        inner = cls.launch

        def call(self, *a, __inner=inner, **k):
            with record_function("plan_call"):
                return __inner(self, *a, **k)

        cls.launch = call

LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaLaunchKernelEx")


def _probe(fn, reps: int, idle_s: float) -> dict[str, float]:
    """idle_s: a pause after each synchronisation (0: none; a pause lets the CPU's clock and
    caches cool, which inflated every case's CPU time ~3x on one host)."""
    cpu_after_sync = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if idle_s:
            time.sleep(idle_s)
        t = time.perf_counter()
        fn()
        cpu_after_sync.append((time.perf_counter() - t) * 1e6)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            torch.cuda.synchronize()
            if idle_s:
                time.sleep(idle_s)
            with record_function(f"probe_call_{i}"):
                fn()
        torch.cuda.synchronize()
    events = prof.events()
    calls = sorted((e for e in events if e.name.startswith("probe_call_")),
                   key=lambda e: e.time_range.start)
    plans = sorted((e for e in events if e.name == "plan_call"), key=lambda e: e.time_range.start)
    launches = sorted((e for e in events if e.name in LAUNCH_NAMES),
                      key=lambda e: e.time_range.start)
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.name not in LAUNCH_NAMES and not e.name.startswith("probe_call")
                      and "Memcpy" not in e.name and "Memset" not in e.name),
                     key=lambda e: e.time_range.start)
    rows = []
    for c in calls:
        c0, c1 = c.time_range.start, c.time_range.end
        ls = [e for e in launches if c0 <= e.time_range.start <= c1]
        ks = [e for e in kernels if c0 <= e.time_range.start <= c1 + 200]
        if not ls or not ks:
            continue
        last_l, first_k = ls[-1], ks[0]
        ps = [e for e in plans if c0 <= e.time_range.start <= c1]
        extra = ({"to_plan_us": ps[0].time_range.start - c0,
                  "plan_to_launch_us": last_l.time_range.start - ps[0].time_range.start}
                 if ps else {})
        rows.append({**extra,
            "call_us": c1 - c0,
            "before_launch_us": last_l.time_range.start - c0,
            "launch_api_us": last_l.time_range.end - last_l.time_range.start,
            "after_launch_us": c1 - last_l.time_range.end,
            "api_to_kernel_us": first_k.time_range.start - last_l.time_range.start,
            "call_to_kernel_us": first_k.time_range.start - c0,
            "kernel_us": sum(k.time_range.end - k.time_range.start for k in ks),
            "launches": len(ls), "kernels": len(ks),
        })
    out = {"cpu_after_sync_us": statistics.median(cpu_after_sync), "traced": len(rows)}
    if rows:
        for key in rows[-1]:
            vals = [r[key] for r in rows if key in r]
            out[key] = statistics.median(vals)
        out["kernel_names"] = sorted({k.name[:80] for k in kernels})[:4]
        out["launch_names"] = sorted({e.name for e in launches})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=50, help="calls traced per case (default 50)")
    p.add_argument("--idle-ms", type=float, default=0.0,
                   help="pause after each synchronisation (default none)")
    p.add_argument("--out", help="write every case's medians as JSON here")
    args = p.parse_args()
    device = torch.device("cuda")
    _mark_plan_calls()
    cases, _ = build_cases(device, smoke=False)
    result = {"device": torch.cuda.get_device_name(device), "cases": {}}
    for name, fn in cases.items():
        if "256" in name:
            continue
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        try:
            result["cases"][name] = _probe(fn, args.reps, args.idle_ms / 1e3)
        except Exception as exc:  # noqa: BLE001 - one case's failure must not lose the others
            result["cases"][name] = {"error": repr(exc)[:300]}
    if args.out:
        write_json(Path(args.out), result)
    keys = ("cpu_after_sync_us", "to_plan_us", "plan_to_launch_us", "before_launch_us", "launch_api_us", "api_to_kernel_us",
            "call_to_kernel_us", "kernel_us", "launches")
    print(f"{'case':40} | " + " | ".join(k.replace("_us", "")[:14] for k in keys))
    for name, r in result["cases"].items():
        if "error" in r:
            print(f"{name[:40]:40} | error {r['error'][:80]}")
            continue
        print(f"{name[:40]:40} | " + " | ".join(f"{r.get(k, float('nan')):14.1f}" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
