"""Wasted tensor-core work of our default kernel choice on real models' routings (no GPU).

Routed experts end in partial tiles (an expert of 130 rows fills a 128-row tile and 2 rows of
a second), and a cluster along M computes whole cluster tiles (the pair's CTA past an expert's
end loads and computes but stores nothing). For each zoo projection and token count this
takes the seeded skewed top-k routing of the model zoo (moe_gemm.tuning.zoo.topk_counts), the
kernel our default picks for it (the tuned table of --device, then the rules), and reports
what the schedule module computes (moe_gemm.ops.schedule.mma_work): multiply-adds computed
beyond the useful ones, as a fraction of the useful.

    python -m benchmarks.mma_waste [--models all] [--tokens 2048,8192] \
        [--device "NVIDIA H100 80GB HBM3"] [--out waste.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.report import out_argument, write_json
from benchmarks.runner import names_problem, zoo_tokens_problem
from moe_gemm.config import GemmConfig
from moe_gemm.kernels.sm90.constants import SWAP_TILE_COLS
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.heuristics import choose_varlen
from moe_gemm.tuning import zoo as models
from moe_gemm.tuning.argcheck import empty_option

H100 = "NVIDIA H100 80GB HBM3"
NUM_SMS = 132
TILE_K = 64  # the 16-bit kernel's k-tile (a K tail rounds up to it)


def waste_rows(model_names: str | None, tokens: list[int], device: str | None,
               seed: int = 1234) -> list[dict[str, Any]]:
    """One row per projection and token count: the default choice and its wasted fraction."""
    rows = []
    for t in tokens:
        for m in models.select_models(model_names or ",".join(models.DEFAULT_MODELS)):
            for p in m.projections():
                counts = models.topk_counts(p.E, t, min(p.top_k, p.E), seed)
                T = sum(counts)
                c = choose_varlen(GemmConfig(), T, p.E, p.N, p.K, NUM_SMS, 2, device=device,
                                  swap_ok=True)
                work = sched.mma_work([(r, p.N, p.K) for r in counts], c.tile_m, c.tile_n,
                                      TILE_K, c.cluster_m, c.cluster_n, c.swap_ab)
                rows.append({
                    "model": m.name, "proj": p.proj, "tokens": t, "top_k": p.top_k, "E": p.E,
                    "N": p.N, "K": p.K, "rows": T, "rows_per_expert": T / p.E,
                    "choice": f"{'swap' if c.swap_ab else c.schedule} {c.tile_m}x{c.tile_n} "
                              f"c{c.cluster_m}x{c.cluster_n}",
                    "wasted_fraction": work.wasted_fraction,
                    # the same tile without the cluster: what the M rounding alone costs
                    "wasted_without_cluster": sched.mma_work(
                        [(r, p.N, p.K) for r in counts], c.tile_m, c.tile_n,
                        TILE_K, swapped=c.swap_ab).wasted_fraction,
                })
    return rows


def zoo_routings(model_names: str | None, tokens: list[int], seed: int) -> list[list[int]]:
    """Rows per expert of every zoo projection at every token count (the zoo's routing)."""
    return [models.topk_counts(p.E, t, min(p.top_k, p.E), seed) for t in tokens
            for m in models.select_models(model_names or ",".join(models.DEFAULT_MODELS))
            for p in m.projections()]


def granularity_floor(model_names: str | None, tokens: list[int], seed: int = 1234,
                      steps: tuple[int, ...] = (128, 64, 32, 16, 8)) -> list[dict[str, Any]]:
    """The waste that rounding each expert's rows up to `g` alone costs, for each g (no N or K
    rounding, no cluster): the least any tiling can waste whose row tiles are multiples of g.
    A WGMMA's M side is 64 rows per warpgroup, its N side a multiple of 8, so below 64 rows
    only a tile with the expert's rows on the N side (swap-AB) gets finer."""
    counts_all = zoo_routings(model_names, tokens, seed)
    out = []
    for g in steps:
        w = [sum(-(-r // g) * g for r in c) / max(1, sum(c)) - 1 for c in counts_all]
        out.append({"rows_granularity": g, "median": statistics.median(w), "max": max(w),
                    "above_5_percent": sum(x > 0.05 for x in w), "cases": len(w)})
    return out


# Row tilings a kernel could use for each expert's last tile (name, tile rows, the most tail
# rows a swap-AB tile takes, whether an empty 64-row half is skipped). A swapped tail puts the
# expert's last rows on the WGMMA's N side, which steps by 8 rows.
# (name, tile_m, swap_max, half_skip, trim): trim > 0 loads a tail tile's A rows rounded up to
# trim instead of a whole box (the kernel's trimmed A loads: 16), computing as many rows.
TAIL_DESIGNS = (
    ("128-row tiles", 128, 0, False, 0),
    ("128, an empty 64-row half skipped", 128, 0, True, 0),
    ("128, tail A rows loaded to 16", 128, 0, False, 16),
    ("128, last <= 32 rows swapped", 128, 32, False, 0),
    ("128, last <= 64 rows swapped", 128, 64, False, 0),
    ("64-row tiles", 64, 0, False, 0),
    ("64, last <= 32 rows swapped", 64, 32, False, 0),
)
N_STEP = 8  # a WGMMA's N is a multiple of 8


def rows_computed(rows: int, tile_m: int, swap_max: int = 0, half_skip: bool = False) -> int:
    """The rows one expert's tiles compute: whole tiles, then its last tile as a swapped tile
    (rows rounded up to N_STEP) when at most swap_max rows, else half a tile when half_skip
    and the rows fit in it, else a whole tile."""
    full, tail = divmod(max(rows, 0), tile_m)
    if tail == 0:
        return full * tile_m
    if tail <= swap_max:
        return full * tile_m + -(-tail // N_STEP) * N_STEP
    if half_skip and tail <= tile_m // 2:
        return full * tile_m + tile_m // 2
    return (full + 1) * tile_m


# The tile width the operand-bytes model below assumes (the zoo's prefill picks are mostly
# 128-256 columns wide).
BYTES_TILE_N = 192


def operand_rows_loaded(rows: int, tile_m: int, tile_n: int = BYTES_TILE_N,
                        swap_max: int = 0, trim: int = 0) -> int:
    """Rows of A and B one expert's tiles of one column of n-tiles load from L2, per element
    of K (times K x 2 bytes: the L2-to-SM operand bytes): each tile loads its A box and its B
    box (tile_n rows of the weights), partial or not. The TMA boxes are the tile's, so a tail
    tile loads a whole A box; skipping its empty half saves WGMMAs, not bytes; a swapped tail
    tile would load an A box of its own rows (rounded to N_STEP); with trim, a tail tile loads
    its rows rounded up to trim. Multicast not counted."""
    full, tail = divmod(max(rows, 0), tile_m)
    loaded = full * (tile_m + tile_n)
    if tail:
        a_rows = tile_m
        if tail <= swap_max:
            a_rows = -(-tail // N_STEP) * N_STEP
        elif trim:
            a_rows = -(-tail // trim) * trim
        loaded += a_rows + tile_n
    return loaded


# Every tile swapped (the rows on the WGMMA's N side, weights on its M side in tiles of
# SWAP_TILE_COLS columns), each expert's rows split evenly over ceil(rows / max_rows) tiles in
# whole units of rows: (name, max_rows, unit). Its tiles of one weight panel then differ by at
# most one unit, so they stay in step (docs/measurements.md: skipped row blocks).
SWAP_DESIGNS = (
    ("swapped, <= 256 rows a tile, 16-row units", 256, 16),
    ("swapped, <= 256 rows a tile, 8-row units", 256, 8),
)


def swap_designs(model_names: str | None, tokens: list[int], seed: int = 1234
                 ) -> list[dict[str, Any]]:
    """SWAP_DESIGNS on the zoo's routings: the rows-rounding waste, and the L2-to-SM operand
    bytes per weight column against 128-row tiles of BYTES_TILE_N columns (each swapped tile
    loads its rows and its SWAP_TILE_COLS weight columns, per element of K)."""
    counts_all = zoo_routings(model_names, tokens, seed)
    base = [sum(operand_rows_loaded(r, 128) for r in c) / BYTES_TILE_N for c in counts_all]
    out = []
    for name, max_rows, unit in SWAP_DESIGNS:
        w = [sum(sum(sched.even_row_split(r, max_rows, unit)) for r in c) / max(1, sum(c)) - 1
             for c in counts_all]
        b = [sum(rows + SWAP_TILE_COLS for r in c
                 for rows in sched.even_row_split(r, max_rows, unit))
             / SWAP_TILE_COLS / max(1e-30, b0) for c, b0 in zip(counts_all, base)]
        out.append({"design": name, "max_rows": max_rows, "unit": unit,
                    "median": statistics.median(w), "max": max(w),
                    "above_5_percent": sum(x > 0.05 for x in w), "cases": len(w),
                    "operand_bytes_vs_128": statistics.median(b)})
    return out


def tail_designs(model_names: str | None, tokens: list[int], seed: int = 1234
                 ) -> list[dict[str, Any]]:
    """The rows-rounding waste of each TAIL_DESIGNS tiling on the zoo's routings (no N or K
    rounding, no cluster): what tail-exact tiles could recover, design by design; and the
    L2-to-SM operand bytes each loads relative to plain 128-row tiles (operand_rows_loaded),
    which is what bounds these tiles' time when they are bandwidth-bound (a half tile still
    loads its whole stage: measured neutral on the H200, docs/measurements.md)."""
    counts_all = zoo_routings(model_names, tokens, seed)
    base = [sum(operand_rows_loaded(r, 128) for r in c) for c in counts_all]
    out = []
    for name, tile_m, swap_max, half, trim in TAIL_DESIGNS:
        w = [sum(rows_computed(r, tile_m, swap_max, half) for r in c) / max(1, sum(c)) - 1
             for c in counts_all]
        b = [sum(operand_rows_loaded(r, tile_m, BYTES_TILE_N, swap_max, trim) for r in c)
             / max(1, b0) for c, b0 in zip(counts_all, base)]
        out.append({"design": name, "tile_m": tile_m, "swap_max": swap_max, "half_skip": half,
                    "median": statistics.median(w), "max": max(w),
                    "above_5_percent": sum(x > 0.05 for x in w), "cases": len(w),
                    "operand_bytes_vs_128": statistics.median(b)})
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    w = [r["wasted_fraction"] for r in rows]
    if not w:
        return {"cases": 0}
    return {"cases": len(w), "median": statistics.median(w), "max": max(w),
            "above_5_percent": sum(x > 0.05 for x in w)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mma_waste", description=__doc__
                                .split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated zoo models, or 'all'")
    p.add_argument("--tokens", default="2048,8192", help="token counts (default 2048,8192)")
    p.add_argument("--device", default=H100, help="tuned table to choose from ('' = rules)")
    p.add_argument("--seed", type=int, default=1234, help="routing seed (the zoo's)")
    p.add_argument("--out", type=out_argument, help="write the rows and the summary as JSON")
    args = p.parse_args(argv)
    # An empty value or entry is refused, not read as the default or dropped (`--models ""`
    # was the default models; '' --device is the rules, documented, so it is not checked).
    if why := (empty_option(args, ["models", "tokens"])
               or (args.models is not None and names_problem(args.models, None, "--models"))
               or zoo_tokens_problem(args.tokens)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:  # (a bad --models or --tokens was a traceback; raster_waves says it in one line)
        tokens = models.parse_tokens(args.tokens, (2048, 8192))
        rows = waste_rows(args.models, tokens, args.device or None, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    floor = granularity_floor(args.models, tokens, args.seed)
    designs = tail_designs(args.models, tokens, args.seed)
    swapped = swap_designs(args.models, tokens, args.seed)
    doc = {"device_table": args.device or None, "tokens": tokens, "rows": rows,
           "summary": summary(rows), "rows_granularity_floor": floor, "tail_designs": designs,
           "swap_designs": swapped}
    if args.out:
        write_json(Path(args.out), doc)
    print(f"{'case':34} | {'rows/expert':>11} | {'choice':24} | {'waste':>6} | {'no cluster':>10}")
    for r in rows:
        case = f"{r['model']}/{r['proj']}/{r['tokens']}"
        print(f"{case[:34]:34} | {r['rows_per_expert']:11.1f} | {r['choice']:24} | "
              f"{100 * r['wasted_fraction']:5.1f}% | {100 * r['wasted_without_cluster']:9.1f}%")
    s = doc["summary"]
    if s["cases"]:
        print(f"median {100 * s['median']:.1f}%, max {100 * s['max']:.1f}%, above 5% on "
              f"{s['above_5_percent']} of {s['cases']}")
    print("least waste of any tiling whose row tiles are multiples of g (rows rounding alone):")
    for f in floor:
        print(f"  g={f['rows_granularity']:3d}: median {100 * f['median']:5.1f}%, max "
              f"{100 * f['max']:6.1f}%, above 5% on {f['above_5_percent']} of {f['cases']}")
    print(f"rows rounding of tail designs (each expert's last tile), and the L2-to-SM operand "
          f"bytes they load against 128-row tiles ({BYTES_TILE_N}-column tiles):")
    for d in designs + swapped:
        print(f"  {d['design']:42s}: median {100 * d['median']:5.1f}%, max "
              f"{100 * d['max']:6.1f}%, above 5% on {d['above_5_percent']} of {d['cases']}; "
              f"bytes x{d['operand_bytes_vs_128']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
