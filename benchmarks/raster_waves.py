"""Operand panels each wave of tiles loads, per tile order, on real models' routings (no GPU).

A persistent grid runs its tiles in waves: the i-th tile of every CTA runs at about the same
time and walks K at about the same pace, so tiles of one wave that share an A row panel (one
expert's tile_m rows) or a B column panel (one expert's tile_n columns) read it from L2 once
between them, while a panel that comes back in a later wave has usually left L2 (a K = 7168
panel of 128 bf16 rows is 1.8 MB; the H100's and H200's L2 is 50 MB). This counts, for each
wave of the schedule module's tile order (moe_gemm.ops.schedule.cta_tiles: the kernel's own,
clusters included), the distinct A and B panels at full K, sums them over the waves, and
divides by the compulsory bytes (every routed row of A and every used expert's B once). It is
an upper-bound model of DRAM reads, with no reuse across waves: use it to compare tile orders
(rasters) of one tile, and ncu (benchmarks.dram_traffic) for the bytes a GPU really reads (on
an H100 it matched ncu's read ratio within 0.01 on four compute-bound picks, 1x2 and 2x1
clusters: docs/measurements.md, 2026-12-06).

    python -m benchmarks.raster_waves [--models all] [--tokens 2048,8192] \
        [--configs "pp 64x256 c2x1 p8;pp 64x256 c2x1 p8ns"] [--out waves.json]

Configs are named as `moe-gemm tune` names them (tuning/space.py); the default list compares
the rasters p8 (panels of 8 m-tiles), p16, p8n and p8ns (panels of 8 n-tiles, serpentine) on
three tiles. The zoo's routing (moe_gemm.tuning.zoo.topk_counts, seeded) gives each expert's
rows; 132 CTAs (an H100 SXM's or an H200's SMs).

With a tuned table, each zoo case's pick (its exact bf16 varlen entry; swapped tiles left out)
against the same config under every raster (RASTERS): the cases whose pick reads at least
--min-ratio times the bytes of the model's best raster, and, with --rivals-out, a table holding
those picks with that raster, for `benchmarks.pick_ab --against` to time in the zoo's regime
(the tuner chooses rasters by time; this points at picks worth timing again; on the H100's
seven flagged rows none of those rasters ran faster at the power limit, where L2 bytes weigh
more than DRAM bytes: docs/measurements.md, 2026-12-06 later):

    python -m benchmarks.raster_waves --table moe_gemm/tables/nvidia-h100-80gb-hbm3.json \
        --models all --tokens 2048,4096,8192 [--min-ratio 1.1] [--rivals-out rivals.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.ab_cases import table_key
from benchmarks.report import out_argument, write_json
from benchmarks.runner import names_problem, split_names, zoo_tokens_problem
from moe_gemm.kernels.sm90.constants import raster_code
from moe_gemm.ops import schedule as sched
from moe_gemm.tuning import space, table_io
from moe_gemm.tuning import zoo as models
from moe_gemm.tuning.argcheck import empty_option

NUM_SMS = 132
BYTES = 2  # 16-bit operands
DEFAULT_CONFIGS = tuple(f"{tile} {raster}" for tile in
                        ("pp 64x256 c2x1", "pp 128x192 c2x1", "coop 128x256 c2x1")
                        for raster in ("p8", "p16", "p8n", "p8ns"))
# The rasters a pick is compared with (--table): panel x axis x serpentine.
RASTERS = tuple({"raster_panel": panel, "raster_along": along, "raster_serpentine": serpentine}
                for panel in (4, 8, 16, 32) for along in ("m", "n")
                for serpentine in (False, True))


def wave_bytes(rows: list[int], N: int, K: int, fields: dict, num_ctas: int = NUM_SMS
               ) -> tuple[int, int]:
    """(bytes of the distinct A and B panels of each wave, summed over the waves; the
    compulsory bytes) of experts with `rows` rows each, (N, K) each, under a config's fields.

    A wave is each cluster's w-th cluster tile (the kernel's order: schedule.linear_assignment
    and schedule.tile_coord, as schedule.cta_tiles takes them); a CTA of a cluster tile whose
    tile lies past its problem's edge still runs (it computes for its peer's multicast), so it
    holds its place in the wave, and loads no panel of its own past the edge."""
    tm, tn = fields["tile_m"], fields["tile_n"]
    cm, cn = fields.get("cluster_m") or 1, fields.get("cluster_n") or 1
    swizzle = raster_code(fields.get("raster_panel") or 8, fields.get("raster_along") or "m",
                          bool(fields.get("raster_serpentine")))
    tiles_n, units_n = sched.ceil_div(N, tn), sched.ceil_div(N, tn * cn)
    units = [sched.ceil_div(m, tm * cm) * units_n for m in rows]
    owners = sched.linear_assignment(units, num_ctas // (cm * cn)).per_cta
    total = 0
    for w in range(max((len(o) for o in owners), default=0)):
        a_panels, b_panels = set(), set()
        for o in owners:
            if w >= len(o):
                continue
            p, local = o[w]
            mu, nu = sched.tile_coord(local, sched.ceil_div(rows[p], tm * cm), units_n, swizzle)
            a_panels.update((p, mu * cm + r) for r in range(cm)
                            if mu * cm + r < sched.ceil_div(rows[p], tm))
            b_panels.update((p, nu * cn + r) for r in range(cn) if nu * cn + r < tiles_n)
        total += (len(a_panels) * tm + len(b_panels) * tn) * K * BYTES
    compulsory = (sum(rows) + sum(1 for m in rows if m) * N) * K * BYTES
    return total, compulsory


def zoo_cases(model_names: str | None, tokens: list[int], seed: int):
    """(model, projection, tokens, per-expert rows) of each zoo case, token count by token
    count (the zoo's seeded routing)."""
    for t in tokens:
        for m in models.select_models(model_names or ",".join(models.DEFAULT_MODELS)):
            for p in m.projections():
                yield m, p, t, models.topk_counts(p.E, t, min(p.top_k, p.E), seed)


def rows_of(model_names: str | None, tokens: list[int], configs: list[str], seed: int
            ) -> list[dict[str, Any]]:
    fields = {c: space.parse_name(c) for c in configs}
    out = []
    for m, p, t, counts in zoo_cases(model_names, tokens, seed):
        for name, f in fields.items():
            total, compulsory = wave_bytes(counts, p.N, p.K, f)
            out.append({"model": m.name, "proj": p.proj, "tokens": t, "E": p.E,
                        "N": p.N, "K": p.K, "rows": sum(counts), "config": name,
                        "wave_gb": total / 1e9, "x_compulsory": total / compulsory})
    return out


def _raster_of(fields: dict) -> tuple:
    return (fields.get("raster_panel") or 8, fields.get("raster_along") or "m",
            bool(fields.get("raster_serpentine")))


def table_rows(table: dict, model_names: str | None, tokens: list[int], seed: int
               ) -> list[dict[str, Any]]:
    """Per zoo case with an exact entry in `table` (swapped picks left out): the pick's bytes
    and those of the same config under its best raster (the first of RASTERS at the fewest
    bytes; the pick's own where none reads fewer)."""
    out = []
    for m, p, t, counts in zoo_cases(model_names, tokens, seed):
        case = {"E": p.E, "N": p.N, "K": p.K, "rows": sum(counts)}
        entry = table_io.find_entry(table, table_key(case))
        if entry is None or entry["config"].get("swap_ab"):
            continue
        pick = table_io.explicit_fields(entry["config"])
        base, compulsory = wave_bytes(counts, p.N, p.K, pick)
        if not compulsory:
            continue
        best, best_fields = base, pick
        for raster in RASTERS:
            f = {**pick, **raster}
            if _raster_of(f) == _raster_of(pick):
                continue
            b, _ = wave_bytes(counts, p.N, p.K, f)
            if b < best:
                best, best_fields = b, f
        out.append({"model": m.name, "proj": p.proj, "tokens": t, "E": p.E, "N": p.N,
                    "K": p.K, "rows": case["rows"], "pick": space.name_of(pick),
                    "pick_x_compulsory": base / compulsory, "best": space.name_of(best_fields),
                    "best_x_compulsory": best / compulsory, "ratio": base / best,
                    "entry": entry, "best_fields": best_fields})
    return out


# What a rivals table keeps of an entry: its key, its label and the config (then renamed).
RIVAL_FIELDS = ("form", "dtype", "out_dtype", "E", "N", "K", "bucket", "rows", "layout", "label",
                "config")


def rivals_table(table: dict, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """`table`'s header with, for each row, its entry's key holding the row's best raster
    (none of the replaced pick's timings or records: pick_ab --against times it)."""
    entries = []
    for r in rows:
        e = {k: v for k, v in r["entry"].items() if k in RIVAL_FIELDS}
        config = dict(e["config"])
        config.update({k: r["best_fields"][k] for k in RASTERS[0]})
        e["config"], e["name"] = config, r["best"]
        entries.append(e)
    return {**{k: v for k, v in table.items() if k not in ("entries", "samples")},
            "entries": entries, "samples": []}


def table_main(args: argparse.Namespace, tokens: list[int]) -> int:
    try:
        table = table_io.read_table(Path(args.table))
    except (OSError, ValueError) as exc:
        print(f"error: --table: {exc}", file=sys.stderr)
        return 2
    rows = table_rows(table, args.models, tokens, args.seed)
    flagged = [r for r in rows if r["ratio"] >= args.min_ratio]
    public = [{k: v for k, v in r.items() if k not in ("entry", "best_fields")} for r in rows]
    if args.out:
        write_json(Path(args.out), {"table": args.table, "tokens": tokens,
                                    "num_ctas": NUM_SMS, "rows": public})
    if args.rivals_out:
        write_json(Path(args.rivals_out), rivals_table(table, flagged))
    print(f"{'case':30} | {'pick':28} | {'x comp':>6} | {'best raster':28} | {'x comp':>6} "
          f"| {'ratio':>5}")
    for r in flagged:
        case = f"{r['model']}/{r['proj']}/{r['tokens']}"
        print(f"{case[:30]:30} | {r['pick'][:28]:28} | {r['pick_x_compulsory']:6.2f} | "
              f"{r['best'][:28]:28} | {r['best_x_compulsory']:6.2f} | {r['ratio']:5.2f}")
    print(f"{len(flagged)} of {len(rows)} picks read at least {args.min_ratio:g}x the bytes of "
          "their best raster")
    if flagged:
        print("cases: " + ",".join(f"{r['model']}/{r['proj']}/{r['tokens']}" for r in flagged))
    return 0


def summary(rows: list[dict[str, Any]], configs: list[str]) -> list[dict[str, Any]]:
    """Per config, the median of its bytes over the first config of the same tile's, case by
    case (below 1: fewer panels per wave)."""
    base: dict[tuple, float] = {}
    out = []
    for c in configs:
        tile = " ".join(c.split()[:3])
        first = next(x for x in configs if " ".join(x.split()[:3]) == tile)
        ratios = []
        for r in rows:
            key = (r["model"], r["proj"], r["tokens"])
            if r["config"] == first:
                base[key] = r["wave_gb"]
            if r["config"] == c and base.get(key):
                ratios.append(r["wave_gb"] / base[key])
        if ratios:
            out.append({"config": c, "vs": first, "median": statistics.median(ratios),
                        "min": min(ratios), "max": max(ratios), "cases": len(ratios)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.raster_waves",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated zoo models, or 'all'")
    p.add_argument("--tokens", default="2048,8192", help="token counts (default 2048,8192)")
    p.add_argument("--configs", default=";".join(DEFAULT_CONFIGS),
                   help="';'-separated configs as the tuner names them")
    p.add_argument("--seed", type=int, default=1234, help="routing seed (the zoo's)")
    p.add_argument("--out", type=out_argument, help="write the rows and the summary as JSON")
    p.add_argument("--table", default=None,
                   help="a tuned table: compare each zoo case's pick with its best raster "
                        "(instead of --configs)")
    p.add_argument("--min-ratio", type=float, default=1.1,
                   help="with --table: list the picks reading at least this many times the "
                        "bytes of their best raster (default 1.1)")
    p.add_argument("--rivals-out", type=out_argument, default=None,
                   help="with --table: write those picks with their best raster as a table "
                        "(for benchmarks.pick_ab --against)")
    args = p.parse_args(argv)
    # An empty value or entry is refused, not read as the default or dropped (`--models ""`
    # was the default models, `--configs ";"` an empty table that exited 0).
    if why := (empty_option(args, ["models", "tokens", "configs"])
               or (args.models is not None and names_problem(args.models, None, "--models"))
               or zoo_tokens_problem(args.tokens)
               or names_problem(args.configs, None, "--configs", ";")):
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.table is None and args.rivals_out:
        print("error: --rivals-out needs --table", file=sys.stderr)
        return 2
    if not args.min_ratio >= 1.0:  # (NaN too)
        print(f"error: --min-ratio must be at least 1; got {args.min_ratio}", file=sys.stderr)
        return 2
    if args.table is not None:
        try:
            tokens = models.parse_tokens(args.tokens, (2048, 8192))
            return table_main(args, tokens)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    configs = split_names(args.configs, ";")
    try:
        for c in configs:
            space.parse_name(c)
        tokens = models.parse_tokens(args.tokens, (2048, 8192))
        rows = rows_of(args.models, tokens, configs, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summ = summary(rows, configs)
    if args.out:
        write_json(Path(args.out), {"tokens": tokens, "num_ctas": NUM_SMS, "rows": rows,
                                    "summary": summ})
    print(f"{'case':30} | {'config':26} | {'GB':>7} | {'x compulsory':>12}")
    for r in rows:
        case = f"{r['model']}/{r['proj']}/{r['tokens']}"
        print(f"{case[:30]:30} | {r['config'][:26]:26} | {r['wave_gb']:7.2f} | "
              f"{r['x_compulsory']:12.2f}")
    print("median bytes against the same tile's first config, over the cases:")
    for s in summ:
        print(f"  {s['config']:26} / {s['vs']:26}: {s['median']:.3f} "
              f"({s['min']:.3f}-{s['max']:.3f}, {s['cases']} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
