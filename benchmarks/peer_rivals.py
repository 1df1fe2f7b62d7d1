"""The tiles a peer's autotuner chose in a zoo run, as re-rank rivals for our tuned tables.

    python -m benchmarks.peer_rivals benchmarks/results/zoo-nvidia-h200-2026-12-06.json \\
        --out rivals.json
    moe-gemm tune --rerank moe_gemm/tables/nvidia-h200.json --zoo --tokens 8192 \\
        --rivals-file rivals.json --out moe_gemm/tables/nvidia-h200.json

    python -m benchmarks.peer_rivals ZOO.json --only-lost \\
        --table moe_gemm/tables/nvidia-h200.json --out rivals-table.json
    python -m benchmarks.pick_ab --cases <the cases it prints> --against rivals-table.json \\
        --adopt moe_gemm/tables/nvidia-h200.json

With --table the output is that table with each case's exact entry set to QuACK's choice
(a table for `benchmarks.pick_ab --against`, which times the two picks in the zoo's own regime
and with --adopt keeps the faster; the tuner's re-rank times in its own regime, where picks
rank differently on some shapes: docs/measurements.md, 2026-12-02).

At the same tile, schedule, cluster and tile order our kernel runs within about 2% of QuACK's
(docs/measurements.md, "Our kernel against QuACK's at the same config"), so where QuACK tuned
beats our default the tile its autotuner chose is the first config of ours to try there. For
every case of the run whose QuACK-tuned row says what it chose, this writes that config in our
words ('pp 128x192 c1x2 p8ns': QuACK's varlen tile order is our serpentine panels of 8
n-tiles), keyed by the tuner's label of the zoo shape ('Kimi-K2/gate_up tokens=8192').
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from benchmarks import zoo_report
from benchmarks.ab_cases import table_key
from benchmarks.report import out_argument, write_json
from benchmarks.suite import QUACK_TUNED_NAME
from benchmarks.zoo import quack_config_fields
from moe_gemm.tuning import space, table_io
from moe_gemm.tuning.argcheck import loads_json


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


def rival_table(run: dict, table: dict, only_lost: bool = False) -> tuple[dict, list[str]]:
    """`table` with the exact entry of each case of `run` (only_lost: each case our default
    trailed) set to QuACK tuned's choice there, and the cases whose entry changed. A case the
    table has no entry for is left out (pick_ab times such a case without a rival)."""
    rivals = peer_rivals(run, only_lost)
    by_label = {tuner_label(r["case"]): r for r in run.get("results", [])
                if r.get("default") and r.get("case") and all(k in r for k in
                                                              ("E", "N", "K", "rows"))}
    out = copy.deepcopy(table)  # (the caller's table stays as it was)
    changed = []
    for label, names in rivals.items():
        row = by_label.get(label)
        entry = row and table_io.find_entry(out, table_key(row))
        if not entry or names[0] == entry.get("name"):
            continue
        fields = space.parse_name(names[0])
        keep = {k: entry["config"][k] for k in ("swap_ab",) if k in entry["config"]}
        entry["config"] = {**{k: v for k, v in fields.items() if v is not None}, **keep}
        entry["name"] = names[0]
        changed.append(row["case"])
    return out, changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_rivals", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a zoo run's JSON (benchmarks/results/zoo-<device>-<date>.json)")
    p.add_argument("--out", type=out_argument, required=True, help="the rivals file to write (with --table: "
                   "the table to write)")
    p.add_argument("--table", metavar="TABLE", help="write TABLE with each case's entry set to "
                   "QuACK's choice instead of a rivals file, and print the cases it changed")
    p.add_argument("--only-lost", action="store_true",
                   help="only the cases where our default trailed the best peer")
    args = p.parse_args(argv)
    try:
        text = Path(args.run).read_text()
    except OSError as exc:
        print(f"error: {args.run}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        run = loads_json(text)
    except ValueError as exc:
        print(f"error: {args.run}: not JSON ({exc})", file=sys.stderr)
        return 2
    try:
        zoo_report.check_run(args.run, run)
        rivals = peer_rivals(run, args.only_lost)
        if args.table:
            table = table_io.read_table(Path(args.table), run.get("device"))
    except OSError as exc:
        print(f"error: {args.table}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not rivals:
        print(f"error: {args.run}: no case where QuACK tuned ran and said what it chose",
              file=sys.stderr)
        return 2
    if args.table:
        doc, changed = rival_table(run, table, args.only_lost)
        if not changed:
            print(f"error: {args.table} already holds QuACK's choice (or has no entry) for "
                  "every case: nothing to time", file=sys.stderr)
            return 2
        table_io.write(Path(args.out), doc)
        print(f"wrote {args.out}: {len(changed)} entries changed; cases: {','.join(changed)}")
        return 0
    write_json(Path(args.out), rivals)
    print(f"wrote {args.out}: {len(rivals)} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
