"""Implementations run for seconds at a time back to back, as a prefill server keeps the GPU
busy: time per call, and energy per call from the board's energy counter (NVML).

    python -m benchmarks.sustained --cases DeepSeek-V3/gate_up/8192 \\
        [--impls default,quack,mm_loop,'pp 128x160 c1x2 p8ns'] [--seconds 1.5] [--reps 3]
        [--out FILE]

Compute-bound GEMMs on an H100 or H200 SXM run at the board's power limit (700 W), where the
SM clock drops to what that power buys: there a kernel's speed is set by the energy it
spends per call, not only by its cycles. The zoo's samples (a few ms behind a GPU sleep)
start on a cooled GPU; a sample here runs `--seconds` without a gap, so the clock has settled
at the limit, and the energy counter's delta over it (mJ) divided by the calls gives the
energy per call. The host queues the calls in batches of about 5 ms of GPU work, so kernels
shorter than their own launch cost leave gaps (the zoo's compute-bound rows take 0.3-10 ms).
Implementations interleave round by round, the order rotating. Every output is checked against a float32 reference first (the zoo's
harness builds and checks them).

Implementations: `default` (our default pick), a config of ours as `moe-gemm tune` names it
('pp 128x192 c1x2 p8ns'), and the zoo's peers `grouped_mm`, `mm_loop`, `quack` (untuned).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks import zoo
from benchmarks.ab_cases import add_case_options, cases_from_args, tag_rows
from benchmarks.gpu_state import open_gpu_state
from benchmarks.runner import (
    ab_run,
    add_ab_options,
    input_sets,
    names_problem,
    number_problem,
    prepare_impl,
    split_names,
)
from benchmarks.scoring import flops, shape_bytes
from benchmarks.suite import Impl, _ours, reference
from moe_gemm.tuning import space
from moe_gemm.tuning.argcheck import empty_option

PEERS = {"grouped_mm": zoo.GROUPED_MM_NAME, "mm_loop": zoo.GRAPH_NAME, "quack": zoo.QUACK_NAME}
DEFAULT_IMPLS = "default,quack"


def implementations(run, words: list[str]) -> list[Impl]:
    """The Impls `--impls` names (ValueError naming one it does not know); `run` is the zoo's
    (None: the peers need none but QuACK tuned, which is not offered here)."""
    zoo_impls = {i.name: i for i in zoo.implementations(run, False, 0.0, lambda: 0.0)}
    out = []
    for w in words:
        if w == "default":
            out.append(zoo_impls[zoo.DEFAULT_NAME])
        elif w in PEERS:
            out.append(zoo_impls[PEERS[w]])
        else:
            config = space.config_of(space.parse_name(w))
            out.append(Impl(f"moe_gemm {space.name_of(space.parse_name(w))}", False,
                            _ours(config), config=config))
    return out


def sustained_sample(fns, calls: int, seconds: float, state) -> dict[str, Any]:
    """Run `fns` round robin, `calls` launches per batch, for about `seconds` of wall time
    with no gap; GPU ms per call, mJ per call, mean W and median SM MHz over the window."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0, t0 = state.energy_mj(), time.perf_counter()
    start.record()
    n, mhz = 0, []
    while time.perf_counter() - t0 < seconds:
        for _ in range(calls):
            fns[n % len(fns)]()
            n += 1
        m = state.sm_mhz()
        if m is not None:
            mhz.append(m)
    end.record()
    end.synchronize()
    wall = time.perf_counter() - t0
    e1 = state.energy_mj()
    ms = start.elapsed_time(end) / n
    out: dict[str, Any] = {"ms": ms, "calls": n}
    if e0 is not None and e1 is not None:
        out["mj_per_call"] = (e1 - e0) / n
        out["mean_w"] = (e1 - e0) / 1e3 / wall
    if mhz:
        out["sm_mhz"] = statistics.median(mhz)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sustained",
                                description=__doc__.split("\n\n")[0])
    add_case_options(p)
    p.add_argument("--impls", default=DEFAULT_IMPLS,
                   help="comma-separated: default, grouped_mm, mm_loop, quack, or a config of "
                   "ours ('pp 128x192 c1x2 p8ns') (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=1.5, help="wall seconds a sample runs")
    add_ab_options(p, 3)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # (nan passed a `<= 0` test and sampled nothing; inf never ended a sample)
    if why := number_problem(args.seconds, "--seconds"):
        print(f"sustained: {why}", file=sys.stderr)
        return 2
    words = split_names(args.impls)
    try:
        # An empty --impls or entry is refused, not dropped (`--impls ""` timed the default).
        if why := empty_option(args, ["impls"]) or names_problem(args.impls, None, "--impls"):
            raise ValueError(why)
        cases = cases_from_args(args)
        impls = implementations(None, words)  # (checked before any GPU work)
        names = [i.name for i in impls]
        if twice := list(dict.fromkeys(n for n in names if names.count(n) > 1)):
            # (samples are gathered by name: the two rows would share, and mix, one list)
            raise ValueError(f"--impls names {', '.join(map(repr, twice))} more than once")
    except (KeyError, ValueError) as exc:
        print(f"sustained: {exc}", file=sys.stderr)
        return 2
    run = ab_run(args, argv, "sustained", "it times GPU kernels",
                 settings={"seconds": args.seconds,
                           "timing": "each sample `seconds` of back-to-back calls, no gap; "
                           "energy from NVML's total energy counter"})
    if isinstance(run, str):
        print(run, file=sys.stderr)
        return 2
    state = open_gpu_state(run.device.index or 0)
    if not state.available:
        print("sustained: NVML is not available: no energy readings", file=sys.stderr)
    print(f"{'case':30} | {'impl':34} | {'us':>8} | {'TFLOP/s':>7} | {'GB/s':>6} | "
          f"{'mJ/call':>8} | {'W':>5} | {'MHz':>5} | ratio", flush=True)
    for spec, f in cases:
        sizes = spec.sizes(run.seed)
        work, nbytes = flops(sizes), shape_bytes(sizes, spec.dtype)["bytes"]
        run.doc["shapes"][spec.name] = {"flops": work, "bytes": nbytes}
        sets = input_sets(run, spec)
        ref = reference(sets[0])
        ready = []
        for impl in impls:
            row, timing = prepare_impl(run, spec, impl, sets, ref)
            tag_rows([row], spec.name, f)
            run.doc["results"].append(row)
            if timing is not None:
                ready.append((row, timing))
        del ref
        samples: dict[str, list[dict]] = {row["impl"]: [] for row, _ in ready}
        for r in range(args.reps):
            for k in range(len(ready)):
                row, timing = ready[(k + r) % len(ready)]
                samples[row["impl"]].append(
                    sustained_sample(timing.fns, timing.calls, args.seconds, state))
        first = None
        for row, _ in ready:
            got = samples[row["impl"]]
            row["status"] = "ok"
            row["samples"] = got
            for key in ("ms", "mj_per_call", "mean_w", "sm_mhz"):
                vals = [s[key] for s in got if key in s]
                if vals:
                    row[key] = statistics.median(vals)
            first = first or row
            row["vs_first"] = first["ms"] / row["ms"]
            print(f"{spec.name:30} | {row['impl'][:34]:34} | {row['ms'] * 1e3:8.1f} | "
                  f"{work / row['ms'] / 1e9:7.1f} | {nbytes / row['ms'] / 1e6:6.0f} | "
                  f"{row.get('mj_per_call', float('nan')):8.1f} | "
                  f"{row.get('mean_w', float('nan')):5.0f} | {row.get('sm_mhz', float('nan')):5.0f}"
                  f" | {row['vs_first']:.3f}", flush=True)
        run.save()
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
