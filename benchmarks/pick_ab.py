"""Our default's pick against the same pick with a few fields changed, on zoo cases, in the
zoo's regime.

    python -m benchmarks.pick_ab --vary p8 --vary p8ns [--models all] [--tokens 2048,8192]
        [--reps 10] [--out FILE]
    python -m benchmarks.pick_ab --against T.json     the pick against T's pick (exact key)
    python -m benchmarks.pick_ab --against T.json --adopt TABLE [--min-gain 0.013]
    python -m benchmarks.pick_ab --against-config 'swap 256x128' [--adopt TABLE]

The tuner ranks configs by CUDA-graph samples with a rest between them; the zoo times back to
back behind a sleep backlog, as a serving loop runs. Some levers (the tile order above all)
rank differently in the two regimes, so a change of the default is decided here: per zoo case,
the config our default picks (tuned table, then the rules) is rebuilt with each `--vary`
word list applied to it ('p8ns': panels of 8 n-tiles, serpentine; 's4'; 'c1x2'; 'ts', 'ew'
and 'no-ts', 'no-ew' to turn those off),
and with `--against T.json` the pick of another tuned table for the same key is a variant
too (after the default pick itself, unless --vary names the first). Every variant goes through the zoo's harness in one process (same inputs and routing,
every output checked against a float32 reference first, then interleaved rounds). Each row
carries `vs_first` = the first variant's time / this one's (above 1: this one faster) and
`is_default` where the variant is what the default launches. With --with-peers the zoo's
peers (not QuACK tuned) run in the same rounds, so each variant runs among the same kernels as
in the zoo: the A/B alone interleaves only our own, and some kernels time differently there.

`--against-config NAME` does the same with one config for every case (a config the tables'
searches never timed there, such as the swapped kernel on many rows per expert), as a table of
that config at each case's key would.

With --adopt TABLE, each case where T's pick ran at least --min-gain faster than the default's
pick gets T's entry in TABLE (with a `zoo_ab` record of the two times); TABLE is rewritten once,
at the end. T may be another device's table (the H100's picks tried on an H200): only its
config moves, with the time measured here, and the record's `how` names T's device. TABLE must
be this GPU's. --adopt runs the peers in the same rounds unless --no-with-peers says otherwise:
our kernels alone have ranked a pick the other way round from the zoo's own rows.
`benchmarks.peer_rivals --table` writes such a T from a zoo run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import zoo
from benchmarks.ab_cases import add_case_options, cases_from_args, ratio_line, table_key, tag_rows
from benchmarks.runner import ab_run, add_ab_options, run_shape
from benchmarks.suite import Impl, _ours
from moe_gemm.tuning import space, table_io

OURS = "moe_gemm"
# --adopt's default margin: above the spread of two interleaved rounds of one config in the
# zoo's harness on compute-bound rows (~1%; docs/measurements.md).
MIN_GAIN = 0.013

# A --vary word and the kind of field it sets; a variant's word replaces the pick's word of
# the same kind (so 'p8' after a pick of 'p8ns' is along m, not serpentine).
_KINDS = (("raster", r"p\d+n?s?"), ("stages", r"s\d+"), ("cluster", r"c\d+x\d+"),
          ("tail_split", r"ts"), ("whole_epilogue", r"ew"))


def _kind(word: str) -> str | None:
    """The field a word sets; 'no-' before an on/off word ('no-ew', 'no-ts') turns it off."""
    if word.startswith("no-") and word[3:] in ("ts", "ew"):
        word = word[3:]
    return next((kind for kind, pattern in _KINDS if re.fullmatch(pattern, word)), None)


def parse_variants(items: list[str], against: bool = False) -> list[list[str]]:
    """--vary values -> word lists (ValueError naming a word that changes no field we vary).
    With --against no --vary is needed: the baseline is then the pick as it is ([])."""
    variants = []
    for item in items:
        words = [w for w in item.replace(",", " ").replace(":", " ").split() if w]
        if not words:
            raise ValueError("an empty --vary")
        for w in words:
            if _kind(w) is None:
                raise ValueError(f"--vary {item!r}: {w!r} is not one of: raster 'p8', 'p8ns', "
                                 "'p16'; stages 's4'; cluster 'c1x2'; 'ts', 'ew' (or "
                                 "'no-ts', 'no-ew')")
        variants.append(words)
    if against:
        return variants or [[]]
    if len(variants) < 2:
        raise ValueError("give at least two --vary variants to compare (e.g. --vary p8 "
                         "--vary p8ns), or --against TABLE")
    return variants


def table_pick(doc: dict, case: dict[str, Any]) -> dict | None:
    """The fields of `doc`'s entry for a zoo case's exact key (bf16 varlen), or None."""
    entry = table_io.find_entry(doc, table_key(case))
    return None if entry is None else table_io.explicit_fields(entry["config"])


def _foreign(other: dict, table: dict) -> str:
    """' (<device>'s table)' where the --against table was tuned on another device than the
    --adopt table's: its picks are candidates timed here like any other (only the config
    moves into the adopted entry, with this device's time), and the record says where the
    rival came from."""
    theirs = other.get("device")
    return f" ({theirs}'s table)" if theirs and theirs != table.get("device") else ""


def config_table(name: str, cases: list, device: str | None) -> dict:
    """A table holding config `name` (as `moe-gemm tune` names configs) at each zoo case's
    exact key: what --against-config times and --adopt takes (ValueError naming a config the
    kernels cannot build for the bf16 varlen form)."""
    from moe_gemm.ops.tuned import rows_bucket

    fields = space.parse_name(name, "varlen")
    space.config_of(fields)  # buildable (ValueError otherwise)
    config = {k: v for k, v in fields.items() if v is not None}
    entries, keys = [], set()
    for _, f in cases:
        key = table_key(f)
        if key in keys:
            continue
        keys.add(key)
        entries.append({"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16",
                        "E": f["E"], "N": f["N"], "K": f["K"],
                        "bucket": rows_bucket(f["rows"] / f["E"]), "rows": f["rows"],
                        "config": dict(config), "name": space.name_of(fields)})
    return {"device": device, "entries": entries, "samples": []}


def vary(fields: dict, words: list[str]) -> dict:
    """The pick's fields with `words` applied (a word replaces the pick's word of its kind)."""
    kinds = {_kind(w) for w in words}
    base = [w for w in space.name_of(fields).split() if _kind(w) not in kinds]
    out = space.parse_name(" ".join(base + [w for w in words if not w.startswith("no-")]))
    if fields.get("visitor") == "host":
        out["visitor"] = "host"
    space.config_of(out)  # buildable (ValueError otherwise)
    return out


def launched_fields(case: dict[str, Any], device: torch.device,
                    fields: dict | None = None) -> dict:
    """The fields of the config grouped_mm launches on this case and GPU: our default's (no
    `fields`: tuned table, then the rules), or `fields` pinned, as the rules complete them
    (a table entry leaves stages to the rules, which give cooperative 128x256 three on long
    K, for example)."""
    from moe_gemm.capability import device_name, sm_count
    from moe_gemm.config import GemmConfig
    from moe_gemm.ops.heuristics import choose_varlen

    config = GemmConfig() if fields is None else space.config_of(fields)
    choice = choose_varlen(config, case["rows"], case["E"], case["N"], case["K"],
                           sm_count(device), device=device_name(device), swap_ok=True)
    return space.fields_of(choice, "varlen")


def implementations(variants: list[dict | None]) -> list[tuple[Impl, int]]:
    """One of ours per variant's fields, with the variant's index (None: no such variant
    here; one that comes out equal to an earlier one is timed once, under the earlier index)."""
    out, seen = [], set()
    for i, fields in enumerate(variants):
        if fields is None:
            continue
        name = space.name_of(fields)
        if name in seen:
            continue
        seen.add(name)
        config = space.config_of(fields)
        out.append((Impl(f"{OURS} {name}", peer=False, build=_ours(config), config=config), i))
    return out


def add_ratios(rows: list[dict[str, Any]], pick: dict, flops: float) -> list[str]:
    """TFLOP/s, `vs_first` and `is_default` on the case's rows; the table's lines."""
    default_name = f"{OURS} {space.name_of(pick)}"
    first = next((r for r in rows if r.get("variant") == 0 and r.get("ms")), None)
    lines = []
    nan = float("nan")
    for r in rows:
        r["is_default"] = r["impl"] == default_name
        if r.get("ms"):
            r["tflops"] = flops / r["ms"] / 1e9
            if first is not None and r.get("variant", -1) >= 0:  # (ours, not a peer)
                r["vs_first"] = first["ms"] / r["ms"]
        label = r["impl"][len(OURS) + 1:] if r["impl"].startswith(OURS + " ") else r["impl"]
        lines.append(f"  {label:26s}{'*' if r['is_default'] else ' '}| "
                     f"{(r.get('ms') or nan) * 1e3:9.1f} us | {r.get('tflops', nan):6.1f} "
                     f"TFLOP/s | vs first {r.get('vs_first', nan):.3f}")
    return lines


def adopt(table: dict, other: dict, results: list[dict[str, Any]], against: int,
          min_gain: float, device: str, when: str, with_peers: bool = False,
          source: str = "--against") -> list[str]:
    """Put `other`'s entry into `table` for each case whose variant `against` (the --against
    pick) ran at least min_gain faster than variant 0; the lines saying what changed.
    with_peers: whether the zoo's peers ran in the same rounds (the entry's record says);
    source: the option that named the rival (the record's `how`)."""
    how = (f"benchmarks.pick_ab {source} (the zoo's regime"
           + (", among its peers)" if with_peers else ", our kernels alone)"))
    lines = []
    by_case: dict[str, dict[int, dict]] = {}
    for r in results:
        if r.get("ms"):
            by_case.setdefault(r["case"], {})[r.get("variant", -1)] = r
    for case, rows in by_case.items():
        base, theirs = rows.get(0), rows.get(against)
        if base is None or theirs is None or base["ms"] / theirs["ms"] < 1.0 + min_gain:
            continue
        key = table_key(theirs)
        new, mine = table_io.find_entry(other, key), table_io.find_entry(table, key)
        if new is None or mine is None:
            continue
        old = mine.get("name")
        mine["config"] = dict(new["config"])
        mine["name"] = new.get("name") or space.name_of(table_io.explicit_fields(new["config"]))
        mine["us"] = round(theirs["ms"] * 1e3, 2)  # (this regime's time: see zoo_ab)
        # A zoo_check record speaks of the pick it checked ("this pick ... put back"): about
        # the replaced pick it would now be read as this one's.
        mine.pop("zoo_check", None)
        mine["zoo_ab"] = {"date": when, "device": device, "against": old,
                          "ms": round(theirs["ms"], 4), "against_ms": round(base["ms"], 4),
                          "speedup": round(base["ms"] / theirs["ms"], 3),
                          "how": how}
        lines.append(f"{case}: {old} -> {mine['name']} ({base['ms'] / theirs['ms']:.3f}x)")
    return lines


def summary(results: list[dict[str, Any]]) -> list[str]:
    """Per variant (by its words' position), the median and range of vs_first over cases."""
    by_case: dict[str, list[dict]] = {}
    for r in results:
        by_case.setdefault(r["case"], []).append(r)
    per_variant: dict[int, list[float]] = {}
    for rows in by_case.values():
        for r in rows:
            if "vs_first" in r:
                per_variant.setdefault(r["variant"], []).append(r["vs_first"])
    return [ratio_line(f"variant {v}: vs first", ratios)
            for v, ratios in sorted(per_variant.items())]


def peers_wanted(args: argparse.Namespace) -> bool:
    """--with-peers as given, else on exactly when --adopt changes a table: an A/B of our
    kernels alone has ranked a pick the zoo's own rows then measured 11% slower (the zoo runs
    each kernel among the peers; docs/measurements.md, 2026-12-05), and the zoo decides."""
    return bool(args.adopt) if args.with_peers is None else args.with_peers


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pick_ab",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--vary", action="append", default=[], metavar="WORDS",
                   help="words applied to the default's pick, as `moe-gemm tune` names "
                   "configs ('p8ns', 's4 p16'); give two or more, the first is the baseline")
    p.add_argument("--against", metavar="TABLE", help="also time this tuned table's pick "
                   "for each case's key (a case it has no entry for runs without it)")
    p.add_argument("--against-config", metavar="NAME", action="append", help="instead of "
                   "--against: time this config ('swap 256x128', 'coop 256x128 c1x2') on every "
                   "case, as a table holding it at each case's key (one per run)")
    p.add_argument("--adopt", metavar="TABLE", help="with --against or --against-config: put "
                   "that pick into TABLE's entry for each case where it ran at least "
                   "--min-gain faster than the default's pick")
    p.add_argument("--min-gain", type=float, default=MIN_GAIN,
                   help="--adopt's margin, as a fraction (default %(default)s)")
    p.add_argument("--with-peers", action=argparse.BooleanOptionalAction, default=None,
                   help="interleave the zoo's peers too (torch's grouped_mm, the mm loop in a "
                   "CUDA graph, QuACK untuned), so each variant runs among the same kernels "
                   "as in the zoo (default: on with --adopt, off otherwise)")
    add_case_options(p)
    add_ab_options(p, reps=10)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.with_peers = peers_wanted(args)
    try:
        if args.against_config is not None:
            if len(args.against_config) > 1:
                # (argparse kept the last one: a second rival was dropped without a word)
                raise ValueError("give one --against-config a run (run pick_ab once per "
                                 f"rival); got {len(args.against_config)}: "
                                 + ", ".join(repr(c) for c in args.against_config))
            args.against_config = args.against_config[0]
        if args.against and args.against_config:
            raise ValueError("give --against or --against-config, not both")
        against = args.against or args.against_config
        variants = parse_variants(args.vary, against=bool(against))
        other = None
        if args.against:
            try:
                other = table_io.read_table(Path(args.against))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"--against {args.against}: {exc}") from None
        cases = cases_from_args(args)
        table = None
        if args.adopt:
            if not against:
                raise ValueError("--adopt takes the --against table's picks: give --against "
                                 "or --against-config")
            if not 0.0 <= args.min_gain < 1.0:
                raise ValueError(f"--min-gain is a fraction in [0, 1); got {args.min_gain}")
            try:
                table = table_io.read_table(Path(args.adopt))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"--adopt {args.adopt}: {exc}") from None
        if args.against_config:
            try:
                other = config_table(args.against_config, cases,
                                     table.get("device") if table is not None else None)
            except ValueError as exc:
                raise ValueError(f"--against-config {args.against_config!r}: {exc}") from None
    except ValueError as exc:
        print(f"pick_ab: {exc}", file=sys.stderr)
        return 2
    run = ab_run(args, argv, "pick_ab", "the configs are our Hopper kernels'",
                 variants=[" ".join(v) or "default" for v in variants] + (
                     [f"table {args.against}" if args.against
                      else f"config {args.against_config}"] if other is not None else []),
                 settings={"with_peers": args.with_peers})
    if isinstance(run, str):
        print(run, file=sys.stderr)
        return 2
    device, doc = run.device, run.doc
    # The zoo's peers but QuACK tuned (its autotune would dominate the run).
    peers = zoo.implementations(run, False, 0.0, lambda: 0.0)[1:] if args.with_peers else []
    for spec, f in cases:
        pick = launched_fields(f, device)
        try:
            theirs = table_pick(other, f) if other is not None else None
            impls = implementations([vary(pick, words) for words in variants] + (
                [theirs and launched_fields(f, device, theirs)] if other is not None else []))
        except ValueError as exc:
            print(f"{spec.name}: skipped, a variant is not buildable here: {exc}", flush=True)
            continue
        print(f"{spec.name}: E={f['E']} N={f['N']} K={f['K']} rows={f['rows']}, default "
              f"{space.name_of(pick)}", flush=True)
        first = len(doc["results"])
        run_shape(run, spec, [impl for impl, _ in impls] + peers)
        rows = doc["results"][first:]
        index = {impl.name: i for impl, i in impls}
        for r in rows:
            tag_rows([r], spec.name, f, variant=index.get(r["impl"], -1))
        print("\n".join(add_ratios(rows, pick, 2.0 * f["rows"] * f["N"] * f["K"])), flush=True)
        run.save()
    lines = summary(doc["results"])
    if not lines:
        print("pick_ab: no case timed two variants: nothing to compare", file=sys.stderr)
        return 1
    print("\n".join(lines))
    if table is not None:
        if table.get("device") != doc["device"]:
            print(f"pick_ab: --adopt {args.adopt} is for {table.get('device')!r}, this GPU is "
                  f"{doc['device']!r}: left as it was", file=sys.stderr)
            return 1
        source = (f"--against-config '{args.against_config}'" if args.against_config
                  else "--against" + _foreign(other, table))
        changed = adopt(table, other, doc["results"], len(variants), args.min_gain,
                        doc["device"], doc["date"], with_peers=args.with_peers, source=source)
        if changed:
            table_io.write(Path(args.adopt), table)
        print("\n".join(changed) or f"--adopt: no pick ran {args.min_gain:.1%} faster; "
              f"{args.adopt} left as it was")
    return 0


if __name__ == "__main__":
    sys.exit(main())
