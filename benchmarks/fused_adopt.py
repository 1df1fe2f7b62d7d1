"""Adopting the fused kernels' own picks into a tuned table, from a fused_configs run.

    python -m benchmarks.fused_configs --models gpt-oss-120b --tokens 1024,1280,2048,4096 \\
        --up default --up 'pp 128x128 c1x2 p8' ... --out FC.json
    python -m benchmarks.fused_adopt FC.json --table moe_gemm/tables/nvidia-h200.json
        [--min-gain 0.02] [--dry-run]

The fused MoE kernels rank tiles differently from grouped_mm (their epilogue carries a gate
and a bias beside the accumulators), and a tuned table keys their entries apart, by form
(moe_gemm.ops.tuned.FUSED_FORMS: fused, fused-gate, fused-bias, fused-gate-bias). Per table
key (form, dtypes, E, N, K, rows-per-expert bucket) of the run's GEMMs, the config variants
timed on every one of that key's token counts are scored by the geometric mean of the
default's time over theirs; the best is adopted as the key's entry where it scores at least
1 + min_gain and runs no token count more than `min_gain / 2` slower than the default. (The
default is what the table already answers, so a second run measures against the entry the
first adopted.) Variants under option words (wide, select, ieeegate, noswap) change more than
the config and are never adopted. Every timed kernel becomes a sample of its shape (rows =
routed rows): a launch within a quarter octave of a timed row count, in a bucket with no
entry, takes the kernel timed fastest there (tuned.measured_lookup). The entry
records the run (`fused_ab`: date, device, token counts, the default it beat, per-token
speedups). A run on another device than the table's is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.fused_configs import DEFAULT, OPTION_WORDS, is_unfused  # noqa: E402
from moe_gemm.ops import tuned  # noqa: E402
from moe_gemm.tuning import space, table_io  # noqa: E402

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


def decide(rows: list[dict], min_gain: float = MIN_GAIN) -> dict[tuple, dict]:
    """Per table key: {"best": fields, "score", "worst", "tokens", "speedups", "default":
    the default's kernel names, "us": the best's time at the first token count, "rows":
    its routed rows there, "adopt": bool}."""
    by_key: dict[tuple, dict[int, list[dict]]] = {}
    for r in rows:
        if _plain(r) and r["shape"]["form"] in tuned.FUSED_FORMS:
            by_key.setdefault(table_key(r["shape"]), {}).setdefault(r["tokens"], []).append(r)
    out = {}
    for key, per_tokens in by_key.items():
        tokens = sorted(t for t, rs in per_tokens.items()
                        if any(r["variant"] == DEFAULT for r in rs))
        if not tokens:
            continue
        defaults = {t: next(r for r in per_tokens[t] if r["variant"] == DEFAULT)
                    for t in tokens}
        timed: dict[tuple, dict[int, dict]] = {}
        for t in tokens:
            for r in per_tokens[t]:
                seen = timed.setdefault(_fields_key(r["fields"]), {})
                if t not in seen or r["us"] < seen[t]["us"]:
                    seen[t] = r
        best = None
        for fk, at in timed.items():
            if len(at) < len(tokens):
                continue
            speedups = [defaults[t]["us"] / at[t]["us"] for t in tokens]
            score = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
            if best is None or score > best["score"]:
                best = dict(best=at[tokens[0]]["fields"], score=score, worst=min(speedups),
                            speedups=speedups, us=at[tokens[0]]["us"],
                            rows=int(at[tokens[0]]["shape"]["rows"]), same=fk == _fields_key(
                                defaults[tokens[0]]["fields"]))
        if best is None:
            continue
        best.update(tokens=tokens, default=[defaults[t].get("kernel") for t in tokens],
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


def adopt(table: dict, result: dict, min_gain: float = MIN_GAIN) -> list[str]:
    """Put the run's adopted entries and its samples into `table`; the lines saying what
    changed (ValueError: the run is from another device than the table)."""
    if result.get("device") != table.get("device"):
        raise ValueError(f"the run is from {result.get('device')!r}, the table is for "
                         f"{table.get('device')!r}")
    rows = result.get("rows") or []
    lines = []
    for key, d in sorted(decide(rows, min_gain).items()):
        form, dtype, out_dtype, E, N, K, bucket = key
        gains = ", ".join(f"{t}: {s:.3f}x" for t, s in zip(d["tokens"], d["speedups"]))
        name = space.name_of(table_io.explicit_fields(_written(d["best"])))
        what = f"{form} E={E} N={N} K={K} bucket {bucket}"
        if not d["adopt"]:
            lines.append(f"{what}: kept ({name} {d['score']:.3f}x; {gains})")
            continue
        entry = dict(form=form, dtype=dtype, out_dtype=out_dtype, E=E, N=N, K=K, bucket=bucket,
                     rows=d["rows"], config=_written(d["best"]), us=round(d["us"], 2),
                     name=name, fused_ab={
                         "date": result.get("date"), "device": result.get("device"),
                         "tokens": d["tokens"], "against": d["default"],
                         "speedups": [round(s, 3) for s in d["speedups"]],
                         "how": "benchmarks.fused_configs, adopted by benchmarks.fused_adopt"})
        table_io.add_result(table, entry, [])
        lines.append(f"{what}: {name} ({d['score']:.3f}x; {gains})")
    table_io.add_result(table, None, samples(rows))
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fused_adopt",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="a benchmarks.fused_configs --out file (a GPU run)")
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
        result = json.loads(Path(args.result).read_text())
        if not isinstance(result, dict) or result.get("suite") != "fused-configs":
            raise ValueError(f"{args.result} is not a benchmarks.fused_configs result")
        table = table_io.read_table(Path(args.table))
        lines = adopt(table, result, args.min_gain)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.dry_run:
        table_io.write(Path(args.table), table)
    print("\n".join(lines) or "no fused GEMM with a default and a config variant in the run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
