"""What the shape-list benchmarks (bench_fp8, masked) share: their command line, the run's
header and the loop that times one shape after another within a time budget, saving the JSON
after each so a stopped run keeps what it measured."""

from __future__ import annotations

import argparse
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import write_json
from moe_gemm.tuning.argcheck import output_problem

METHOD = ("back-to-back CUDA-graph replays between events, median of --reps rounds "
          "interleaved across implementations; us per call")


def parser(doc: str | None, reps: int, budget_s: float) -> argparse.ArgumentParser:
    """--out, --reps, --only, --budget-s and --smoke (a benchmark adds its own after)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--budget-s", type=float, default=budget_s, help="stop starting shapes after")
    p.add_argument("--reps", type=int, default=reps, help="round-robin rounds per shape")
    p.add_argument("--only", default=None, help="comma-separated shape names")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (harness check)")
    return p


def _only(args: argparse.Namespace) -> list[str] | None:
    return None if args.only is None else [n.strip() for n in args.only.split(",")]


def pick_shapes(args: argparse.Namespace, shapes: Sequence, smoke_shapes: Sequence) -> list:
    """The run's shapes: the smoke set or the full one, narrowed to --only's names."""
    chosen = list(smoke_shapes if args.smoke else shapes)
    wanted = _only(args)
    if wanted is not None:
        chosen = [s for s in chosen if s.name in wanted]
    return chosen


def arg_problem(args: argparse.Namespace, shapes: Sequence, smoke_shapes: Sequence) -> str | None:
    """Why the arguments cannot make a run (the line to print before exiting with 2), or None.
    Each of these used to run anyway and exit 0: --reps 0 recorded every shape as a
    StatisticsError traceback, --budget-s 0 skipped every shape, an --only typo ran none, a
    run without --smoke on a machine without a GPU started the full shapes on the CPU (hours
    each), and an --out folder raised IsADirectoryError out of the first save."""
    if args.reps < 1:
        return "--reps must be at least 1"
    if not args.budget_s > 0:  # (nan too)
        return "--budget-s must be positive"
    known = [s.name for s in (smoke_shapes if args.smoke else shapes)]
    wanted = _only(args)
    if wanted is not None and not any(wanted):
        return f"--only names no shape; expected some of {', '.join(known)}"
    if wanted is not None and "" in wanted:
        return f"--only: an empty entry in {args.only!r} (a stray ','?)"
    if wanted and (unknown := [n for n in wanted if n not in known]):
        return f"unknown shape(s) {', '.join(unknown)}; expected some of {', '.join(known)}"
    if not args.smoke and not torch.cuda.is_available():
        return "the full shapes need a CUDA GPU; use --smoke on the CPU"
    return output_problem(Path(args.out), "--out")


def header(suite: str, device: torch.device) -> dict[str, Any]:
    """The run's JSON document before any shape: suite, device, date, versions, method."""
    import moe_gemm

    return {
        "suite": suite,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__, "moe_gemm": moe_gemm.__version__,
        "python": platform.python_version(), "method": METHOD, "shapes": [],
    }


def run_shapes(doc: dict[str, Any], out: Path, shapes: Sequence, t0: float, budget_s: float,
               run_one: Callable[[Any], dict[str, Any]],
               on_row: Callable[[dict[str, Any]], None] | None = None) -> list[str]:
    """doc["shapes"] += run_one(shape) per shape (a traceback row if it raises, a skipped row
    once budget_s seconds have passed since t0), the JSON rewritten after each; then the run's
    seconds. Returns what failed (`failures`: the caller's exit status)."""
    for shape in shapes:
        if time.monotonic() - t0 > budget_s:
            doc["shapes"].append({"name": shape.name, "skipped": "time budget"})
            continue
        try:
            doc["shapes"].append(run_one(shape))
        except Exception:  # noqa: BLE001 - one shape's failure must not lose the others
            doc["shapes"].append({"name": shape.name, "error": traceback.format_exc()[-800:]})
        write_json(out, doc)
        if on_row is not None:
            on_row(doc["shapes"][-1])
    doc["seconds"] = round(time.monotonic() - t0, 1)
    write_json(out, doc)
    return failures(doc)


def failures(doc: dict[str, Any]) -> list[str]:
    """The shapes whose run raised, and "<shape> <impl>" for each of our own implementations
    ("ours..." rows) that raised or gave a wrong result within a shape. A row's error used to
    stay in the JSON while the run exited 0, so a script took a broken kernel for a good run.
    The peers' errors are not ours (a torch op the installed torch lacks or refuses)."""
    failed = []
    for row in doc["shapes"]:
        if "error" in row:
            failed.append(row["name"])
        failed += [f"{row['name']} {name}" for name, entry in row.get("impls", {}).items()
                   if name.startswith("ours") and "error" in entry]
    return failed


def exit_status(failed: list[str]) -> int:
    """1 when something `failures` lists failed (its error is in the JSON), so a script sees
    it: a run whose every shape failed exited 0."""
    for name in failed:
        print(f"failed: {name} (its error is in the JSON)", file=sys.stderr)
    return 1 if failed else 0
