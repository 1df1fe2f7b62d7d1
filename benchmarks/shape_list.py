"""What the shape-list benchmarks (bench_fp8, masked) share: their command line, the run's
header and the loop that times one shape after another within a time budget, saving the JSON
after each so a stopped run keeps what it measured."""

from __future__ import annotations

import argparse
import platform
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import write_json

METHOD = ("back-to-back CUDA-graph replays between events, median of --reps rounds "
          "interleaved across implementations; us per call")


def parser(doc: str | None, reps: int, budget_s: float) -> argparse.ArgumentParser:
    """--out, --reps, --only, --budget-s and --smoke (a benchmark adds its own after)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--budget-s", type=float, default=budget_s, help="stop starting shapes after")
    p.add_argument("--reps", type=int, default=reps, help="round-robin rounds per shape")
    p.add_argument("--only", default="", help="comma-separated shape names")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (harness check)")
    return p


def pick_shapes(args: argparse.Namespace, shapes: Sequence, smoke_shapes: Sequence) -> list:
    """The run's shapes: the smoke set or the full one, narrowed to --only's names."""
    chosen = list(smoke_shapes if args.smoke else shapes)
    if args.only:
        wanted = set(args.only.split(","))
        chosen = [s for s in chosen if s.name in wanted]
    return chosen


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
               on_row: Callable[[dict[str, Any]], None] | None = None) -> None:
    """doc["shapes"] += run_one(shape) per shape (a traceback row if it raises, a skipped row
    once budget_s seconds have passed since t0), the JSON rewritten after each; then the run's
    seconds."""
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
