"""Adopting the fused kernels' own picks into a tuned table, from fused_configs runs.

    python -m benchmarks.fused_configs --models gpt-oss-120b --tokens 1024,1280,2048,4096 \\
        --up default --up 'pp 128x128 c1x2 p8' ... --out FC.json
    python -m benchmarks.fused_adopt FC.json [FC2.json ...] \\
        --table moe_gemm/tables/nvidia-h200.json [--min-gain 0.02] [--dry-run]

The fused MoE kernels rank tiles differently from grouped_mm (their epilogue carries a gate
and a bias beside the accumulators), and a tuned table keys their entries apart, by form
(moe_gemm.ops.tuned.FUSED_FORMS: fused, fused-gate, fused-bias, fused-gate-bias). Per table
key (form, dtypes, E, N, K, rows-per-expert bucket) of the runs' GEMMs, the config variants
timed on every one of that key's token counts are scored by the geometric mean of the
default's time over theirs; the best is adopted as the key's entry where it scores at least
1 + min_gain and runs no token count more than `min_gain / 2` slower than the default. (The
default is what the table already answers, so a later run measures against the entry an
earlier one adopted.) Several runs (oldest first) are pooled: each run's token counts are
measurements of the key, scored together, and a config must have been timed in all of them.
A second run of the leaders is the way to tell a gain from the spread: two runs of 5 rounds
on an H200 (2026-12-04) put the same config 1.03x apart, and leaders of one run at 1.02-1.03x
tied in the next. A run whose default for the key differs from the newest run's (the table
changed in between) is left out of that key. Variants under option words (wide, select,
ieeegate, noswap) change more than the config and are never adopted. Every timed kernel
becomes a sample of its shape (rows = routed rows; the newest run's where several timed it):
a launch within a quarter octave of a timed row count, in a bucket with no entry, takes the
kernel timed fastest there (tuned.measured_lookup). The entry records the runs (`fused_ab`:
the newest's date and device, how many runs, token counts, the default it beat, speedups). A
run on another device than the table's is refused.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.fused_configs import DEFAULT, OPTION_WORDS, is_unfused  # noqa: E402
from moe_gemm.ops import tuned  # noqa: E402
from moe_gemm.tuning import space, table_io  # noqa: E402
from moe_gemm.tuning.argcheck import loads_json  # noqa: E402

# Above the spread of two interleaved rounds of one kernel in fused_configs' harness (the
# same config under two names differed by up to 1% on an H200, 2026-12-04).
MIN_GAIN = 0.02


def _plain(row: dict) -> bool:
    """A timed row of the default or a config variant without option words."""
    words = row["variant"].split()
    return ("us" in row and "fields" in row and "shape" in row and not is_unfused(
        row["variant"]) and not any(w in OPTION_WORDS for w in words[1:]))


def _fields_key(fields: dict) -> tuple:
    return tuned.normalize(fields)


def table_key(shape: dict) -> tuple:
    """The table key (table_io.key_tuple) a row's shape falls in."""
    return table_io.key_tuple(tuned.Key(
        shape["form"], shape["dtype"], shape["out_dtype"], int(shape["E"]), int(shape["N"]),
        int(shape["K"]), tuned.rows_bucket(int(shape["rows"]) / int(shape["E"]))))


def _by_key(rows: list[dict]) -> dict[tuple, dict[int, list[dict]]]:
    """A run's plain fused rows by table key, then token count."""
    by_key: dict[tuple, dict[int, list[dict]]] = {}
    for r in rows:
        if _plain(r) and r["shape"]["form"] in tuned.FUSED_FORMS:
            by_key.setdefault(table_key(r["shape"]), {}).setdefault(r["tokens"], []).append(r)
    return by_key


def _measurements(per_tokens: dict[int, list[dict]]) -> list[tuple[int, dict, dict]]:
    """(tokens, the default's row, {config: its fastest row}) per token count with a default."""
    out = []
    for t in sorted(per_tokens):
        rs = per_tokens[t]
        default = next((r for r in rs if r["variant"] == DEFAULT), None)
        if default is None:
            continue
        timed: dict[tuple, dict] = {}
        for r in rs:
            fk = _fields_key(r["fields"])
            if fk not in timed or r["us"] < timed[fk]["us"]:
                timed[fk] = r
        out.append((t, default, timed))
    return out


def decide(runs: list[list[dict]], min_gain: float = MIN_GAIN) -> dict[tuple, dict]:
    """Per table key, over the rows of one or more runs (oldest first): {"best": fields,
    "score", "worst", "tokens", "speedups", "default": the default's kernel names, "us": the
    best's time at the last run's first token count, "rows": its routed rows there, "runs":
    how many runs were pooled, "dropped": runs left out (another default), "adopt": bool}.

    A key's measurements are the token counts of every run that timed its default; runs whose
    default for a token count is not the newest run's config (the table changed between
    them) are left out of that key. A config is scored over all the measurements, and only
    one timed at every one of them can be adopted."""
    by_run = [_by_key(rows) for rows in runs]
    keys = list(dict.fromkeys(k for per in by_run for k in per))
    out = {}
    for key in keys:
        points: list[tuple[int, dict, dict]] = []
        defaults: dict[int, tuple] = {}  # the newest run's default config per token count
        first = None  # the newest run's first measurement: the entry's time and rows
        pooled = dropped = 0
        for per in reversed(by_run):  # newest first: its defaults are the table's answers
            ms = _measurements(per.get(key, {}))
            if not ms:
                continue
            if any(defaults.get(t, _fields_key(d["fields"])) != _fields_key(d["fields"])
                   for t, d, _ in ms):
                dropped += 1
                continue
            for t, d, _ in ms:
                defaults.setdefault(t, _fields_key(d["fields"]))
            first = first or ms[0]
            points = ms + points  # (oldest first, as the runs were given)
            pooled += 1
        if first is None:
            continue
        best = None
        for fk in set.intersection(*(set(timed) for _, _, timed in points)):
            speedups = [d["us"] / timed[fk]["us"] for _, d, timed in points]
            score = math.exp(sum(math.log(v) for v in speedups) / len(speedups))
            if best is None or score > best["score"]:
                best = dict(best=first[2][fk]["fields"], score=score, worst=min(speedups),
                            speedups=speedups, us=first[2][fk]["us"],
                            rows=int(first[2][fk]["shape"]["rows"]),
                            same=fk == _fields_key(first[1]["fields"]))
        if best is None:
            continue
        best.update(tokens=[t for t, _, _ in points], runs=pooled, dropped=dropped,
                    default=[d.get("kernel") for _, d, _ in points],
                    adopt=(not best.pop("same") and best["score"] >= 1.0 + min_gain
                           and best["worst"] >= 1.0 - min_gain / 2))
        out[key] = best
    return out


def samples(rows: list[dict]) -> list[dict]:
    """Every timed kernel of the run's fused GEMMs as a table sample (the fastest time of a
    kernel timed under several names)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if not _plain(r) or r["shape"]["form"] not in tuned.FUSED_FORMS:
            continue
        s = r["shape"]
        k = (s["form"], s["dtype"], s["out_dtype"], int(s["E"]), int(s["N"]), int(s["K"]),
             int(s["rows"]), _fields_key(r["fields"]))
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = dict(form=s["form"], dtype=s["dtype"], out_dtype=s["out_dtype"],
                           E=int(s["E"]), N=int(s["N"]), K=int(s["K"]), rows=int(s["rows"]),
                           config=_written(r["fields"]), us=round(r["us"], 2))
    return list(best.values())


def _written(fields: dict) -> dict:
    """A config as tables write it: the tuned fields that are set."""
    return {k: v for k, v in fields.items() if v is not None and v != "auto"}


def adopt(table: dict, results: dict | list[dict], min_gain: float = MIN_GAIN) -> list[str]:
    """Put the adopted entries of one run, or of several runs pooled (oldest first; see
    decide), and their samples into `table`; the lines saying what changed (ValueError: a run
    from another device than the table's). A shape's samples come from the newest run that
    timed it (times of different runs are not compared with each other)."""
    runs = [results] if isinstance(results, dict) else list(results)
    for result in runs:
        if result.get("device") != table.get("device"):
            raise ValueError(f"the run is from {result.get('device')!r}, the table is for "
                             f"{table.get('device')!r}")
    rows = [result.get("rows") or [] for result in runs]
    lines = []
    for key, d in sorted(decide(rows, min_gain).items()):
        form, dtype, out_dtype, E, N, K, bucket = key
        gains = ", ".join(f"{t}: {s:.3f}x" for t, s in zip(d["tokens"], d["speedups"]))
        if d["runs"] > 1 or d["dropped"]:
            gains += f"; {d['runs']} runs" + (
                f", {d['dropped']} left out (another default)" if d["dropped"] else "")
        name = space.name_of(table_io.explicit_fields(_written(d["best"])))
        what = f"{form} E={E} N={N} K={K} bucket {bucket}"
        if not d["adopt"]:
            lines.append(f"{what}: kept ({name} {d['score']:.3f}x; {gains})")
            continue
        newest = runs[-1]
        entry = dict(form=form, dtype=dtype, out_dtype=out_dtype, E=E, N=N, K=K, bucket=bucket,
                     rows=d["rows"], config=_written(d["best"]), us=round(d["us"], 2),
                     name=name, fused_ab={
                         "date": newest.get("date"), "device": newest.get("device"),
                         "runs": d["runs"], "tokens": d["tokens"], "against": d["default"],
                         "speedups": [round(s, 3) for s in d["speedups"]],
                         "how": "benchmarks.fused_configs, adopted by benchmarks.fused_adopt"})
        table_io.add_result(table, entry, [])
        lines.append(f"{what}: {name} ({d['score']:.3f}x; {gains})")
    for run_rows in rows:  # (oldest first: a newer run's samples replace a shape's older ones)
        table_io.add_result(table, None, samples(run_rows))
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_adopt",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", metavar="RESULT",
                   help="benchmarks.fused_configs --out files (GPU runs; several: oldest first, "
                        "pooled per table key)")
    p.add_argument("--table", required=True, help="the tuned table to add the entries to")
    p.add_argument("--min-gain", type=float, default=MIN_GAIN,
                   help="the geometric-mean speedup over the default an entry needs, as a "
                        "fraction (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="say what would change; write nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 0.0 <= args.min_gain < 1.0:
        print(f"error: --min-gain is a fraction in [0, 1); got {args.min_gain}",
              file=sys.stderr)
        return 2
    try:
        results = []
        for name in args.results:
            try:
                result = loads_json(Path(name).read_bytes())
            except ValueError as exc:  # (named: several results may be given)
                raise ValueError(f"{name}: not JSON ({exc})") from None
            if not isinstance(result, dict) or result.get("suite") != "fused-configs":
                raise ValueError(f"{name} is not a benchmarks.fused_configs result")
            results.append(result)
        table = table_io.read_table(Path(args.table))
        lines = adopt(table, results, args.min_gain)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.dry_run:
        table_io.write(Path(args.table), table)
    print("\n".join(lines) or "no fused GEMM with a default and a config variant in the run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
