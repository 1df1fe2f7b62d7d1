"""How well our config choice does on shapes no tuned table holds (no GPU).

A shipped table holds, besides its entries, every candidate config the tuner timed on every
shape (its "samples"). That makes it its own held-out test: for each model of the table's zoo,
take that model's shapes out, let the lookup choose for each held-out shape from the rest as it
would for a shape it never saw (the neighbours step of moe_gemm.ops.tuned.lookup: the nearest
timed shapes' vote, or the rules when it has none or no clear gain over them), and read the
chosen config's measured time on that shape from the held-out samples. Also scored: the rules alone, and "nearest" (only the held-out token
count is taken out: the same projection's entry at the nearest rows-per-expert bucket, the
lookup's former answer to a new token count). Regret = chosen config's time / the best time
measured on that shape. The tuner times every schedule x tile x cluster at plain defaults on
every shape, then variations (stages, raster panel, tail split, whole-tile epilogue) of the
winners only; a choice whose variation was not timed on a shape is scored by its family's
plain-default time there and counted as approximate. Each path is also scored by family: the
best time any timed variant of its pick's schedule x tile x cluster reached on the shape, the
same (optimistic) footing for every path, so that untimed variations favour none of them.
`--hold tokens` leaves out every shape at one token count in turn instead (a batch size no
one tuned: its nearest timed shapes are the same projections at other token counts).

    python -m benchmarks.choice_generalization [--device "NVIDIA H200"] [--table PATH] \\
        [--hold {model,tokens}] [--out regret.json]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.report import out_argument, write_json
from moe_gemm.ops import tuned
from moe_gemm.tuning import table_io
from moe_gemm.tuning.space import name_of, parse_name

DEFAULT_DEVICES = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
# The lookup's former second step, scored for reference: the same projection's entry at most
# this many rows-per-expert buckets away.
NEAREST_MAX = 2
WITHIN = 1.03  # "within 3%" of the best measured time


def _shape_key(s: dict) -> tuple:
    return (s["form"], s["dtype"], s.get("out_dtype", s["dtype"]), int(s["E"]), int(s["N"]),
            int(s["K"]), int(s["rows"]))


def _model_of(entry: dict) -> str:
    """The zoo model an entry was tuned for ('Mixtral-8x7B/down tokens=16' -> 'Mixtral-8x7B')."""
    return str(entry.get("label", "?")).split("/", 1)[0]


def _tokens_of(entry: dict) -> str:
    """The token count an entry was tuned at ('Mixtral-8x7B/down tokens=16' -> '16')."""
    return str(entry.get("label", "?")).rpartition("tokens=")[2] or "?"


# What a held-out group is: every shape of one zoo model (a model nobody tuned), or every
# shape at one token count (a batch size nobody tuned, its neighbours the same projections at
# other token counts).
HOLD = {"model": _model_of, "tokens": _tokens_of}


def _family(name: str) -> str:
    """The plain-default member of a config's schedule x tile x cluster family, by name."""
    words = name.split()
    # (stages 's3' and rasters 'p8ns' dropped; 'swap' and 'pp' kept)
    base = " ".join(w for w in words[:3] if not re.fullmatch(r"s\d+|p\d+n?s?", w))
    return name_of(parse_name(base))


def _tile(name: str) -> tuple:
    """A config's schedule and tile, by name ('pp 192x128 c1x2 s4 p8' -> pingpong 192 x 128)."""
    f = parse_name(name)
    return f["schedule"], f["tile_m"], f["tile_n"]


def evaluate(doc: dict, hold: str = "model") -> dict[str, Any]:
    """Per held-out shape: the best measured time and what each choice path picks and costs.
    hold: what is left out of the table in turn (HOLD: a zoo model, or a token count)."""
    samples = doc["samples"]
    entries = [e for e in doc["entries"] if "rows" in e and "label" in e]
    timed: dict[tuple, dict[str, float]] = defaultdict(dict)
    for s in samples:
        names = timed[_shape_key(s)]
        name = name_of(s["config"])
        names[name] = min(names.get(name, math.inf), float(s["us"]))
    group_of = HOLD[hold]
    shape_group = {_shape_key(e): group_of(e) for e in entries}

    rows = []
    for held in sorted({group_of(e) for e in entries}):
        train = [s for s in samples if shape_group.get(_shape_key(s)) != held]
        timed_train = tuned.parse_samples(train)
        for e in (e for e in entries if group_of(e) == held):
            key, shape = tuned.key_of(e), _shape_key(e)
            times = timed.get(shape, {})
            if not times:
                continue
            best = min(times.values())
            rules_name = e.get("rules_name")
            row: dict[str, Any] = {"label": e["label"], "best_us": best,
                                   "best": min(times, key=times.get),
                                   "candidates": len(times)}

            def score(path: str, name: str | None, _times=times, _best=best, _row=row) -> None:
                us = _times.get(name) if name else None
                approx = us is None and name is not None and _family(name) in _times
                if approx:
                    us = _times[_family(name)]
                fam = [t for n, t in _times.items() if name and _family(n) == _family(name)]
                _row[path] = {"choice": name, "us": us, "approx": approx,
                              "regret": None if us is None else us / _best,
                              "family_regret": min(fam) / _best if fam else None}
                if us is None and name is not None:
                    # A tile the shape's tuning never timed at all: the shape was tuned before
                    # the tile was built (a table retuned in parts), not a gap in the vote.
                    tile = _tile(name)
                    _row[path]["newer_tile"] = all(_tile(n) != tile for n in _times)

            score("rules", rules_name)
            if row["rules"]["us"] is None and e.get("rules_us"):
                row["rules"].update(us=float(e["rules_us"]),
                                    regret=float(e["rules_us"]) / best)
            # The neighbours step, as lookup takes it: the vote's pick where it clearly beats
            # the rules' config; else the rules.
            baseline = tuned.normalize(parse_name(rules_name)) if rules_name else None
            found = tuned.neighbours_pick(timed_train, key, int(e["rows"]), baseline)
            pick = name_of(dict(found)) if found is not None else None
            score("neighbours", pick or rules_name)
            row["neighbours"]["used_pick"] = pick is not None
            if pick is None:
                row["neighbours"].update({k: row["rules"][k] for k in (
                    "us", "regret", "approx", "family_regret")})
            # Nearest: the same projection's other token counts stay in the table.
            near = None
            for o in entries:
                if o is e or tuned.key_of(o).family() != key.family():
                    continue
                d = abs(int(o["bucket"]) - key.bucket)
                rank = (d, -int(o["bucket"]))
                if d <= NEAREST_MAX and (near is None or rank < near[0]):
                    near = (rank, name_of(o["config"]))
            if near is not None:
                score("nearest", near[1])
            rows.append(row)
    return {"device": doc.get("device"), "created": doc.get("created"), "held_out": hold,
            "rows": rows,
            "summary": {path: summarize(rows, path)
                        for path in ("rules", "neighbours", "nearest")}}


def summarize(rows: list[dict], path: str) -> dict[str, Any]:
    scored = [r[path] for r in rows if path in r]
    regrets = sorted(x["regret"] for x in scored if x["regret"] is not None)
    out: dict[str, Any] = {"shapes": len(scored), "untimed": len(scored) - len(regrets),
                           "untimed_newer_tile": sum(1 for x in scored if x.get("newer_tile")),
                           "approx": sum(1 for x in scored if x.get("approx"))}
    if regrets:
        out.update(median=statistics.median(regrets),
                   p90=regrets[min(len(regrets) - 1, int(0.9 * len(regrets)))],
                   max=regrets[-1],
                   within_3pct=sum(1 for r in regrets if r <= WITHIN) / len(regrets))
    fam = sorted(x["family_regret"] for x in scored if x.get("family_regret") is not None)
    if fam:
        out.update(family_median=statistics.median(fam),
                   family_p90=fam[min(len(fam) - 1, int(0.9 * len(fam)))], family_max=fam[-1])
    if path == "neighbours":
        out["picked"] = sum(1 for x in scored if x.get("used_pick"))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.choice_generalization",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", action="append",
                   help="a device whose shipped table to test (repeatable; default the H100's "
                   "and the H200's)")
    p.add_argument("--table", action="append", help="a table file to test instead (repeatable)")
    p.add_argument("--hold", choices=sorted(HOLD), default="model",
                   help="what each round leaves out of the table: a zoo model's shapes "
                   "(default), or every shape at one token count")
    p.add_argument("--out", type=out_argument, help="write the per-shape rows and the summaries as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    paths = list(args.table or [])
    for device in args.device or ([] if paths else DEFAULT_DEVICES):
        path = tuned.shipped_path(device)
        if not path.exists():
            print(f"error: no shipped table for {device!r} ({path.name})", file=sys.stderr)
            return 2
        paths.append(str(path))
    docs = []
    for path in paths:  # (all read first: a bad second table is refused before any output)
        try:
            # The tuner's reader: entries and samples that do not parse are left out with a
            # warning, as the library's lookup skips them (indexed unchecked, a non-object
            # entry or a sample of E=1e400 was a TypeError / OverflowError traceback).
            doc = table_io.read_table(Path(path), warn=lambda why: print(
                f"warning: {why}", file=sys.stderr))
            if not doc["samples"]:
                raise ValueError(f"not a {tuned.FORMAT} table with samples")
        except (OSError, ValueError) as exc:
            print(f"error: {path}: {exc}", file=sys.stderr)
            return 2
        docs.append(doc)
    results = []
    for path, doc in zip(paths, docs):
        res = evaluate(doc, args.hold)
        res["table"] = path
        results.append(res)
        held = "zoo model" if args.hold == "model" else "token count"
        print(f"{res['device']} (table of {res['created']}), {len(res['rows'])} shapes, each "
              f"{held} held out in turn: regret = chosen config's time / best measured")
        print(f"  {'path':10} | {'shapes':>6} | {'approx':>6} | {'untimed':>7} | {'median':>6} | "
              f"{'p90':>6} | {'max':>6} | within 3% | family: median | p90 | max")
        for path_name, s in res["summary"].items():
            if "median" not in s:
                print(f"  {path_name:10} | {s['shapes']:6d} | {s['approx']:6d} | {s['untimed']:7d} "
                      "| (nothing timed)")
                continue
            extra = f"  (the vote's own pick on {s['picked']})" if "picked" in s else ""
            if s["untimed_newer_tile"]:
                extra += (f"  ({s['untimed_newer_tile']} untimed: a tile newer than that "
                          "shape's tuning)")
            print(f"  {path_name:10} | {s['shapes']:6d} | {s['approx']:6d} | {s['untimed']:7d} | "
                  f"{s['median']:6.3f} | {s['p90']:6.3f} | {s['max']:6.3f} | "
                  f"{s['within_3pct']:9.0%} | {s['family_median']:14.3f} | "
                  f"{s['family_p90']:5.3f} | {s['family_max']:5.3f}{extra}")
    if args.out:
        write_json(Path(args.out), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
