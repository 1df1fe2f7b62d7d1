"""`moe-gemm bench`: our grouped GEMM against its peers, on one GPU, in one process.

`--suite fp8` runs the FP8 shapes (`benchmarks.suite_fp8`) and `--suite off-grid` the shapes
off the tuned grid (`benchmarks.suite_off_grid`) through the same harness; `--suite zoo` runs
the model-zoo benchmark instead (`benchmarks.zoo`). The modules: clock (timing), ceilings,
runner (one case: check, then interleaved timing), report (JSON, PNG), host_overhead, suite
(shapes, implementations), suite_fp8, suite_off_grid, scoring, zoo.

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
3. With `--only host-overhead` (or in a full run), measures host overhead: CPU time of one
   call and the gap between a call and its kernel, ours against torch's grouped_mm
   (`benchmarks.host_overhead`, which also runs alone).
4. Derives floors, TFLOP/s, GB/s, fraction of floor and the ratio to the best peer; writes
   JSON (progressively, so a crash keeps what finished) and a PNG; prints the table last.

A CUDA error such as an illegal address poisons the process's context: the run records who
did it and marks the rest "not run". `--isolate` runs each shape in its own subprocess and
retries a crashed shape without the culprit, so one crash costs one implementation.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks import suite_fp8, suite_off_grid
from benchmarks.ceilings import measure_ceilings
from benchmarks.clock import B2B_TARGET_MS, Clock, median
from benchmarks.host_overhead import CASE_NAMES, measure_host_overhead
from benchmarks.report import plot_png, write_json
from benchmarks.runner import (
    ABORT_ENV,
    Run,
    after_error,
    bench_device,
    device_info,
    our_failures,
    progress_path,
    run_shape,
    unknown_skip,
)
from benchmarks.scoring import derive, format_table, fp8_compute_bound
from benchmarks.suite import (
    FP8,
    TOLERANCE,
    Impl,
    ShapeSpec,
    full_suite,
    implementations,
    short_error,
    smoke_suite,
)
from moe_gemm import __version__
from moe_gemm.ops.tuned import device_slug
from moe_gemm.tuning.argcheck import output_problem

__all__ = ["ABORT_ENV", "main"]

HOST_OVERHEAD = "host-overhead"
DEFAULT_REPS = 30
SMOKE_REPS = 3
ISOLATE_TIMEOUT_S = 300.0  # per shape subprocess (the largest suite shape with every peer: ~60 s)


def _new_doc(device: torch.device, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from moe_gemm.capability import cute_problem

    name, info, _ = device_info(device)
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


def shape_implementations(spec: ShapeSpec, args: argparse.Namespace, seed: int,
                          ceilings: dict[str, Any]) -> list[Impl]:
    """The suite's rows for one shape: an fp8 shape's (the dense FP8 ceiling where `ceilings`
    make it compute-bound), else ours, the peers and the variants."""
    if spec.dtype == FP8:
        return suite_fp8.implementations(spec, fp8_compute_bound(spec.sizes(seed), ceilings))
    return implementations(spec, args.variants, args.quack_tuned)


def impl_names(suite: list[ShapeSpec], host_overhead: bool) -> list[str]:
    """Every implementation a run of `suite` can time, whatever its options (the variant
    matrix, QuACK tuned), then the host-overhead cases: the names --skip-impl takes."""
    names: list[str] = []
    for spec in suite:
        impls = (suite_fp8.implementations(spec, True) if spec.dtype == FP8
                 else implementations(spec, True, True))
        names += [i.name for i in impls]
    names += CASE_NAMES if host_overhead else ()
    return list(dict.fromkeys(names))


def run_in_process(args: argparse.Namespace, argv: list[str], device: torch.device,
                   specs: list[ShapeSpec], host_overhead: bool,
                   out_path: Path | None) -> dict[str, Any]:
    doc = _new_doc(device, args, argv)
    if args.reps < 20 and not args.smoke:
        doc["warning"] = f"reps={args.reps}: reported numbers need medians of at least 20"
    _, _, l2 = device_info(device)
    run = Run(device=device, clock=Clock(device), reps=args.reps, seed=args.seed,
              smoke=args.smoke, variants=args.variants, skip=frozenset(args.skip_impl or ()),
              doc=doc, out_path=out_path, l2_bytes=l2 if not args.smoke else 1 << 20,
              progress=not args.quiet)
    try:
        doc["ceilings"] = measure_ceilings(run.clock, args.smoke, args.reps,
                                           fp8=any(s.dtype == FP8 for s in specs))
    except Exception as exc:
        doc["ceilings"] = {"error": short_error(exc)}
        after_error(run, "ceilings", "ceilings", exc)
    run.save()
    for spec in specs:
        run_shape(run, spec, shape_implementations(spec, args, args.seed, doc["ceilings"]))
    if host_overhead:
        try:
            doc["host_overhead"] = measure_host_overhead(
                run.clock, smoke=run.smoke, reps=run.reps, skip=run.skip,
                mark=lambda name: run.mark(None if name is None else HOST_OVERHEAD, name),
                on_error=lambda name, exc: after_error(run, HOST_OVERHEAD, name, exc))
        except Exception as exc:
            doc["host_overhead"] = {"error": short_error(exc)}
            after_error(run, HOST_OVERHEAD, "host overhead", exc)
    doc["complete"] = True
    derive(doc)
    run.save()
    return doc


def _child_argv(args: argparse.Namespace, only: str, out: Path, skip: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.bench", "--suite", args.suite_name,
           "--only", only, "--out", str(out),
           "--png", "none", "--no-table", "--quiet", "--reps", str(args.reps),
           "--seed", str(args.seed), "--device", args.device or "auto",
           "--variants" if args.variants else "--no-variants"]
    if args.quack_tuned:
        cmd.append("--quack-tuned")
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
                             for i in shape_implementations(s, args, args.seed, {})}
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
        merged[key] = median([c[key] for c in items])
    merged["per_process"] = [{k: c[k] for k in ("copy_bytes_per_s", "mm_flops_per_s")}
                             for c in items]
    return merged


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-gemm bench", description=(
        "Time moe_gemm against torch.bmm, torch grouped_mm, torch.mm loops (eager and CUDA "
        "graph) and QuACK on one GPU; print a table, write JSON and a PNG. Exit status: 1 "
        "when one of our rows failed (a wrong result or an error; the JSON has it too), 2 for "
        "bad arguments."))
    p.add_argument("--suite", choices=SUITES, default="bench",
                   help="bench: the shapes below (default); fp8: the FP8 shapes, ours "
                   "against torch's FP8 grouped GEMMs; off-grid: shapes off the tuned grid "
                   "(benchmarks.suite_off_grid); zoo: real models' expert GEMMs "
                   "(moe-gemm bench --suite zoo --help)")
    p.add_argument("--quack-tuned", action="store_true",
                   help="also time QuACK with tuned=True (its autotuner: seconds to minutes "
                   "per shape)")
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
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds per shape subprocess with --isolate (default "
                   f"{ISOLATE_TIMEOUT_S:.0f})")
    p.add_argument("--out", help="JSON path (default benchmarks/results/bench-<device>-<date>."
                   "json)")
    p.add_argument("--png", help="PNG path (default: beside the JSON); 'none' to skip")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if "
                   "available)")
    p.add_argument("--skip-impl", action="append", metavar="NAME",
                   help="skip an implementation by exact name (repeatable)")
    p.add_argument("--no-table", action="store_true", help="do not print the table")
    p.add_argument("--quiet", action="store_true", help="no per-implementation progress lines")
    return p


SUITES = ("bench", "fp8", "off-grid", "zoo")
SHAPES = {"bench": (full_suite, smoke_suite),
          "fp8": (suite_fp8.fp8_suite, suite_fp8.fp8_smoke_suite),
          "off-grid": (suite_off_grid.off_grid_suite, suite_off_grid.off_grid_smoke_suite)}


def split_suite(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--suite value or "bench", the other arguments); None when the value is unknown. The
    abbreviations argparse takes for --suite (--su, --sui, --suit: unique among the options)
    count too: `--sui fp8` ran the bf16 suite."""
    rest, suite, i = [], "bench", 0
    names = ("--su", "--sui", "--suit", "--suite")
    while i < len(argv):
        a = argv[i]
        if a in names and i + 1 < len(argv):
            suite, i = argv[i + 1], i + 2
            continue
        if a.split("=", 1)[0] in names and "=" in a:
            suite = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return (suite if suite in SUITES else None), rest


def main(argv: list[str] | None = None) -> int:
    """Entry point of `moe-gemm bench` and `python -m benchmarks.bench`; returns the exit code.
    `--suite zoo` hands the other arguments to `benchmarks.zoo`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    suite_name, argv = split_suite(argv)
    if suite_name is None:
        print(f"error: --suite must be one of {', '.join(SUITES)}", file=sys.stderr)
        return 2
    if suite_name == "zoo":
        from benchmarks import zoo

        return zoo.main(argv)
    args = _parser().parse_args(argv)
    args.suite_name = suite_name
    full, smoke = SHAPES[suite_name]
    suite = smoke() if args.smoke else full()
    extra = [HOST_OVERHEAD] if suite_name == "bench" else []
    known = [s.name for s in suite] + extra
    # None only: an empty --only names no shape and is refused, not read as the whole suite.
    names = known if args.only is None else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n and n not in known]
    if any(names) and "" in names:
        print(f"error: --only: an empty entry in {args.only!r} (a stray ','?)", file=sys.stderr)
        return 2
    if not any(names):
        print(f"error: --only names no shape; expected some of {', '.join(known)}",
              file=sys.stderr)
        return 2
    if unknown:
        print(f"error: unknown shape(s) {', '.join(unknown)}; expected some of "
              f"{', '.join(known)}", file=sys.stderr)
        return 2
    if args.list:  # (the shapes --only names, as a run would take them)
        for s in suite:
            if s.name in names:
                print(f"{s.name:13s} {s.form:8s} {s.dtype}  {s.description}")
        if HOST_OVERHEAD in extra and HOST_OVERHEAD in names:
            print(f"{HOST_OVERHEAD:13s} host CPU time per call (small MoE case)")
        return 0
    if args.reps is None:
        args.reps = SMOKE_REPS if args.smoke else DEFAULT_REPS
    if args.reps < 1:
        print("error: --reps must be at least 1", file=sys.stderr)
        return 2
    if args.timeout is not None and not args.isolate:
        # (without --isolate nothing bounds a shape: a limit that looked set would not hold)
        print("error: --timeout applies with --isolate only", file=sys.stderr)
        return 2
    if args.timeout is None:
        args.timeout = ISOLATE_TIMEOUT_S
    if not args.timeout > 0:  # (nan too) else every --isolate shape "times out" at once
        print("error: --timeout must be positive", file=sys.stderr)
        return 2
    if why := unknown_skip(args.skip_impl, impl_names(suite, bool(extra))):
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        device = bench_device(args.device, args.smoke, "the full suite (GBs of inputs)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    stem = "bench" if suite_name == "bench" else f"bench-{suite_name}"
    # The results folder's naming, <suite>-<device>-<date> (a CPU smoke run's says "cpu")
    device_part = device_slug(torch.cuda.get_device_name(device)) if device.type == "cuda" \
        else "cpu"
    for option, value in (("--out", args.out), ("--png", args.png)):
        # (an empty one, e.g. an unset shell variable, was read as the default and wrote there)
        if value is not None and not value.strip():
            print(f"error: {option} is empty (leave the option out for its default)",
                  file=sys.stderr)
            return 2
    out_path = Path(args.out) if args.out else (
        Path("benchmarks/results") / f"{stem}-{device_part}-{date}.json")
    png_path = None if (args.png or "").lower() == "none" else (
        Path(args.png) if args.png else out_path.with_suffix(".png"))
    # Paths that cannot be written fail now, in one line, not after the whole suite ran.
    for option, path in (("--out", out_path), ("--png", png_path)):
        if path is not None and (why := output_problem(path, option)):
            print(f"error: {why}", file=sys.stderr)
            return 2
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
    return _exit_status(doc)


def _exit_status(doc: dict) -> int:
    """1 when one of our rows failed (it is in the JSON too), so a script sees it; else 0."""
    failed = our_failures(doc)
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

