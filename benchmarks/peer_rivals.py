"""The tiles a peer's autotuner chose in a zoo run, as re-rank rivals for our tuned tables.

    python -m benchmarks.peer_rivals benchmarks/results/zoo-nvidia-h200-2026-12-02.json \\
        --out rivals.json
    moe-gemm tune --rerank moe_gemm/tables/nvidia-h200.json --zoo --tokens 8192 \\
        --rivals-file rivals.json --out moe_gemm/tables/nvidia-h200.json

At the same tile, schedule, cluster and tile order our kernel runs within about 2% of QuACK's
(docs/measurements.md, "Our kernel against QuACK's at the same config"), so where QuACK tuned
beats our default the tile its autotuner chose is the first config of ours to try there. For
every case of the run whose QuACK-tuned row says what it chose, this writes that config in our
words ('pp 128x192 c1x2 p8ns': QuACK's varlen tile order is our serpentine panels of 8
n-tiles), keyed by the tuner's label of the zoo shape ('Kimi-K2/gate_up tokens=8192').
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import zoo_report
from benchmarks.report import write_json
from benchmarks.suite import QUACK_TUNED_NAME
from benchmarks.zoo import quack_config_fields
from moe_gemm.tuning import space


def our_name(quack_fields: dict) -> str:
    """Our config name (moe_gemm.tuning.space) for a QuACK GemmConfig's tile, schedule and
    cluster, in QuACK's varlen tile order: bands of 8 clusters along N, serpentine along M
    (our raster p8ns)."""
    return space.name_of({
        "schedule": "pingpong" if quack_fields.get("pingpong") else "cooperative",
        "tile_m": quack_fields["tile_m"], "tile_n": quack_fields["tile_n"],
        "cluster_m": quack_fields.get("cluster_m") or 1,
        "cluster_n": quack_fields.get("cluster_n") or 1,
        "raster_panel": 8, "raster_along": "n", "raster_serpentine": True})


def tuner_label(case: str) -> str:
    """The tuner's label of a zoo case: 'Model/proj/T' -> 'Model/proj tokens=T'."""
    model_proj, _, tokens = case.rpartition("/")
    if not model_proj or not tokens.isdigit():
        raise ValueError(f"zoo case {case!r}: expected 'Model/proj/tokens'")
    return f"{model_proj} tokens={tokens}"


def peer_rivals(run: dict, only_lost: bool = False) -> dict[str, list[str]]:
    """{tuner label: [our name of QuACK tuned's choice]} over the run's cases (with
    only_lost, the cases where our default trailed the best peer)."""
    lost = {r.get("case") for r in run.get("results", [])
            if r.get("default") and (r.get("vs_best_peer") or 1.0) < 1.0}
    out: dict[str, list[str]] = {}
    for r in run.get("results", []):
        text, case = r.get("chosen"), r.get("case")
        if r.get("impl") != QUACK_TUNED_NAME or r.get("status") != "ok" or not text or not case:
            continue
        if only_lost and case not in lost:
            continue
        out[tuner_label(case)] = [our_name(quack_config_fields(text))]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_rivals", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a zoo run's JSON (benchmarks/results/zoo-<device>-<date>.json)")
    p.add_argument("--out", required=True, help="the rivals file to write")
    p.add_argument("--only-lost", action="store_true",
                   help="only the cases where our default trailed the best peer")
    args = p.parse_args(argv)
    try:
        text = Path(args.run).read_text()
    except OSError as exc:
        print(f"error: {args.run}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        run = json.loads(text)
    except ValueError as exc:
        print(f"error: {args.run}: not JSON ({exc})", file=sys.stderr)
        return 2
    try:
        zoo_report.check_run(args.run, run)
        rivals = peer_rivals(run, args.only_lost)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not rivals:
        print(f"error: {args.run}: no case where QuACK tuned ran and said what it chose",
              file=sys.stderr)
        return 2
    write_json(Path(args.out), rivals)
    print(f"wrote {args.out}: {len(rivals)} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
