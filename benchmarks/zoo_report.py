"""Scoring and reporting the zoo benchmark: per-row numbers, the bar, the table, the PNG.

Per row (one implementation on one zoo case), from the case's bytes needed and FLOPs and the
ceilings measured in the run that timed it: `floor_ms` (the roofline floor), `tflops`, `gbps`,
`fraction_of_floor` (floor / time) and `vs_best_peer` (the fastest peer's time / this time,
> 1: faster than every peer), and where the rows carry their rounds' samples
`vs_best_peer_rounds`: the same ratio taken round by round (the fastest peer of each round
against this row's sample of that round; the rounds interleave the implementations, so a
round's clock and power state are shared) as its median, p10 and p90. In an FP8 run each
row's floor counts its own operands' bytes
(FP8 values and scales, or bf16) and its dtype's dense rate, the peers are torch's FP8 grouped
GEMMs, and where the dense FP8 ceiling was timed the FP8 rows get `fraction_of_dense`. The bar: our default at least as fast as the best peer on at
least BAR_SHARE of the cases and at least BAR_MIN on every case.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from benchmarks.clock import median, quantile
from benchmarks.scoring import fill_dense, fill_row

BAR_SHARE = 0.90
BAR_MIN = 0.97


def derive_case(rows: list[dict[str, Any]], info: dict[str, Any],
                ceilings: dict[str, Any]) -> None:
    """Fill the derived columns of one case's rows (in place)."""
    peers = [r for r in rows if r.get("peer") and r.get("status") == "ok" and r.get("ms")]
    best = min(peers, key=lambda r: r["ms"]) if peers else None
    dense = fill_dense(rows)
    if dense is not None:
        info["dense_ms"] = dense
    for r in rows:
        fill_row(r, info, ceilings)
        if r.get("status") != "ok" or not r.get("ms") or r.get("ceiling"):
            continue
        if best is not None:
            r["best_peer"] = best["impl"]
            r["vs_best_peer"] = best["ms"] / r["ms"]
            r.pop("best_peer_chosen", None)  # (a resumed run derives its rows again)
            if best.get("chosen"):
                r["best_peer_chosen"] = best["chosen"]  # e.g. QuACK tuned's tile
        r.pop("vs_best_peer_rounds", None)
        paired = paired_ratios(r, peers)
        if paired:
            r["vs_best_peer_rounds"] = {"median": round(median(paired), 4),
                                        "p10": round(quantile(paired, 0.1), 4),
                                        "p90": round(quantile(paired, 0.9), 4)}


def paired_ratios(row: dict[str, Any], peers: list[dict[str, Any]]) -> list[float]:
    """Per round, the fastest peer's sample over this row's ([] unless every one of them has
    a sample in every round)."""
    mine = row.get("ms_rounds")
    theirs = [p.get("ms_rounds") for p in peers if p is not row]
    if not mine or not theirs or any(not t or len(t) != len(mine) for t in theirs):
        return []
    return [min(t[i] for t in theirs) / m for i, m in enumerate(mine) if m > 0]


def bar(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The bar over every case whose default and at least one peer were timed."""
    ratios: dict[str, tuple[float, dict[str, Any]]] = {}
    for r in results:
        if r.get("default") and r.get("status") == "ok" and r.get("vs_best_peer"):
            ratios[r["case"]] = (r["vs_best_peer"], r)
    if not ratios:
        return {"cases": 0, "pass": False, "why": "no case with the default and a peer timed"}
    values = [v for v, _ in ratios.values()]
    wins = sum(1 for v in values if v >= 1.0)
    # Behind in at least 9 of 10 rounds: a loss a rerun keeps; the other losses are within
    # the round-to-round spread (only rows with their rounds' samples are classed).
    spreads = {c: r["vs_best_peer_rounds"] for c, (_, r) in ratios.items()
               if r.get("vs_best_peer_rounds")}
    losses = sorted(((v, r) for v, r in ratios.values() if v < 1.0), key=lambda x: x[0])
    # A peer that did not run on a counted case (QuACK's autotune over its time cap, an error)
    # leaves that case's ratio against the others only: named, so a reader can discount it.
    missing = [{"case": r["case"], "peer": r["impl"], "status": r.get("status"),
                **({"reason": r["reason"]} if r.get("reason") else {})}
               for r in results
               if r.get("peer") and r.get("case") in ratios and r.get("status") != "ok"]
    return {
        "cases": len(values), "default_at_least_best_peer": wins,
        "share": wins / len(values), "min_vs_best_peer": min(values),
        "pass": wins >= BAR_SHARE * len(values) and min(values) >= BAR_MIN,
        "rule": f"default >= best peer on >= {BAR_SHARE:.0%} of cases and >= {BAR_MIN}x on "
        "every case",
        "rounds_classed": len(spreads),
        "behind_in_90pct_of_rounds": sum(1 for s in spreads.values() if s["p90"] < 1.0),
        "ahead_in_90pct_of_rounds": sum(1 for s in spreads.values() if s["p10"] >= 1.0),
        "peer_wins": [{"case": r["case"], "vs_best_peer": round(v, 4),
                       **({"rounds": r["vs_best_peer_rounds"]}
                          if r.get("vs_best_peer_rounds") else {}),
                       "best_peer": r.get("best_peer"), "default_ms": r["ms"],
                       **({"best_peer_chosen": r["best_peer_chosen"]}
                          if r.get("best_peer_chosen") else {})}
                      for v, r in losses],
        "peers_not_run": missing,
    }


# Settings that must agree for two runs' cases to sit in one table (the routing, the data,
# the method); the budget may differ.
SAME_SETTINGS = ("dtype", "reps", "seed", "smoke", "quack_tuned", "routing", "timing")


def check_run(name: str, d: Any) -> None:
    """ValueError unless `d` is a zoo run's JSON as --merge and --resume read it: an object
    whose cases map names to objects, whose results (and runs) are lists of objects and whose
    settings, if any, are an object; anything else would fail inside them with a traceback."""
    def objects(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, dict) for x in v)

    if not (isinstance(d, dict) and isinstance(d.get("cases"), dict)
            and all(isinstance(v, dict) for v in d["cases"].values())
            and objects(d.get("results")) and objects(d.get("runs", []))
            and isinstance(d.get("settings", {}), dict)):
        raise ValueError(f"{name} is not a zoo run (an object with cases and results)")


def merge_docs(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One zoo document from several runs' (one shard per GPU, a rerun of some cases on top of
    a whole run), in order: a later document's case replaces an earlier one's, rows and all,
    when the later document measured it itself. A run that a document carries from an earlier
    one (a --resume of the same file) is recognized and kept once, and the cases it measured
    are not taken again, so shards resumed from one file merge without the file's old rows
    overwriting a shard's new ones. Each case keeps which run measured it ("run" indexes the
    merged "runs"); the bar is derived again. ValueError if the runs were on other devices or
    with other settings."""
    for name, d in docs:
        check_run(name, d)
    (first_name, first), rest = docs[0], docs[1:]
    out = copy.deepcopy(first)
    out["runs"] = list(out.get("runs") or [])
    for name, d in rest:
        if d.get("device") != out.get("device"):
            raise ValueError(f"{name} was measured on {d.get('device')}, {first_name} on "
                             f"{out.get('device')}")
        a, b = out.get("settings") or {}, d.get("settings") or {}
        if diff := [k for k in SAME_SETTINGS if a.get(k) != b.get(k)]:
            raise ValueError(f"{name} and {first_name} differ in {', '.join(diff)}")
        where: dict[int, int] = {}  # d's run index -> the merged one
        new_runs: set[int] = set()
        for i, run in enumerate(d.get("runs") or []):
            if run in out["runs"]:
                where[i] = out["runs"].index(run)
            else:
                where[i], _ = len(out["runs"]), out["runs"].append(copy.deepcopy(run))
                new_runs.add(i)
        done = {}
        for c, info in (d.get("cases") or {}).items():
            run = int(info.get("run", 0))
            if info.get("complete") and (run in new_runs or run not in where):
                done[c] = {**copy.deepcopy(info), "run": where.get(run, run)}
        out["cases"].update(done)
        out["results"] = [r for r in out.get("results") or [] if r.get("case") not in done] + [
            copy.deepcopy(r) for r in d.get("results") or [] if r.get("case") in done]
        out["not_run"] = list(dict.fromkeys((out.get("not_run") or []) + (d.get("not_run")
                                                                         or [])))
        out["ceilings"] = d.get("ceilings") or out.get("ceilings")
        out["date"] = max(str(out.get("date", "")), str(d.get("date", "")))
    out["not_run"] = [c for c in out.get("not_run") or [] if c not in out["cases"]]
    out.pop("not_rerun", None)
    out.pop("stopped", None)
    out.pop("seconds", None)
    out["merged"] = [Path(name).name for name, _ in docs]
    out["complete"] = not out["not_run"]
    out["bar"] = bar(out["results"])
    return out


def _clocks(ours: dict[str, Any], best: dict[str, Any] | None) -> str:
    """' | MHz ours/peer' where NVML read the SM clock of both while they ran."""
    if best is None or not ours.get("sm_mhz") or not best.get("sm_mhz"):
        return ""
    return f" | MHz {ours['sm_mhz']:.0f}/{best['sm_mhz']:.0f}"


def format_table(doc: dict[str, Any]) -> str:
    """One line per case: our default, the best peer, the ratio; the bar last."""
    ceil = doc.get("ceilings") or {}
    fp8 = (doc.get("settings") or {}).get("dtype") == "fp8"
    rate = f", FP8 mm {ceil.get('fp8_mm_flops_per_s', 0) / 1e12:.0f} TFLOP/s" if fp8 else ""
    lines = [f"moe-gemm zoo{' fp8' if fp8 else ''} | {doc.get('device')} | {doc.get('date')} | "
             f"copy {ceil.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s, bf16 mm "
             f"{ceil.get('mm_flops_per_s', 0) / 1e12:.0f} TFLOP/s{rate}"]
    dense_col = f" | {'dense%':>6}" if fp8 else ""
    head = (f"{'case':34} | {'ours us':>9} | {'floor%':>6}{dense_col} | {'best peer':24} | "
            f"{'peer us':>9} | {'ratio':>6} | choice")
    lines += [head, "-" * len(head)]
    by_case: dict[str, list[dict[str, Any]]] = {}
    for r in doc["results"]:
        by_case.setdefault(r["case"], []).append(r)
    for case, rows in by_case.items():
        ours = next((r for r in rows if r.get("default")), None)
        if ours is None:
            continue
        peers = [r for r in rows if r.get("peer") and r.get("status") == "ok"]
        best = min(peers, key=lambda r: r["ms"]) if peers else None
        if ours.get("status") != "ok":
            lines.append(f"{case[:34]:34} | {'error':>9} | {'':6} | "
                         f"{str(ours.get('error') or ours.get('reason'))[:60]}")
            continue
        frac = ours.get("fraction_of_floor")
        frac_s = "-" if frac is None else f"{100 * frac:.0f}"
        peer_name = best["impl"] if best else "-"
        peer_us = f"{best['ms'] * 1e3:9.1f}" if best else "-"
        ratio = ours.get("vs_best_peer")
        ratio_s = "-" if ratio is None else f"{ratio:.3f}"
        dense = ours.get("fraction_of_dense")
        dense_s = (f" | {'-' if dense is None else f'{100 * dense:.0f}':>6}" if fp8 else "")
        lines.append(
            f"{case[:34]:34} | {ours['ms'] * 1e3:9.1f} | {frac_s:>6}{dense_s} | "
            f"{peer_name[:24]:24} | {peer_us:>9} | {ratio_s:>6} | "
            f"{ours.get('choice_source', '-')}{_clocks(ours, best)}")
    b = doc.get("bar") or {}
    if b.get("cases"):
        lines.append(f"bar: default >= best peer on {b['default_at_least_best_peer']}/"
                     f"{b['cases']} cases ({100 * b['share']:.0f}%, need "
                     f"{100 * BAR_SHARE:.0f}%), min ratio {b['min_vs_best_peer']:.3f} (need "
                     f"{BAR_MIN}): {'PASS' if b['pass'] else 'not met'}")
        if b.get("rounds_classed"):
            lines.append(f"round by round ({b['rounds_classed']} cases): behind the best peer "
                         f"in 9 of 10 rounds on {b['behind_in_90pct_of_rounds']}, ahead in 9 of "
                         f"10 on {b['ahead_in_90pct_of_rounds']}, the rest within the spread")
        if b.get("peers_not_run"):
            lines.append(f"a peer did not run on {len({m['case'] for m in b['peers_not_run']})}"
                         " of these cases (bar.peers_not_run): their ratios are against the "
                         "others")
    if doc.get("not_run"):
        lines.append(f"not run ({doc.get('stopped', 'budget')}): {len(doc['not_run'])} cases")
    if doc.get("not_rerun"):
        lines.append(f"not measured again ({doc.get('stopped', 'budget')}): "
                     f"{len(doc['not_rerun'])} cases keep the earlier run's rows")
    bad = [r for r in doc["results"] if r.get("status") == "error"]
    if bad:
        lines.append(f"{len(bad)} failed rows (errors in the JSON); first: {bad[0]['case']} / "
                     f"{bad[0]['impl']}: {str(bad[0].get('error'))[:80]}")
    return "\n".join(ln if len(ln) <= 140 else ln[:137] + "..." for ln in lines)


def plot_png(doc: dict[str, Any], path: Path) -> str | None:
    """Heat map of our default's ratio to the best peer, per model/projection (rows) and
    token count (columns); None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    cells: dict[tuple[str, int], float] = {}
    for r in doc["results"]:
        if r.get("default") and r.get("vs_best_peer"):
            cells[(f"{r['model']} / {r['proj']}", int(r["tokens"]))] = r["vs_best_peer"]
    if not cells:
        return "nothing measured: no PNG"
    ylabels = list(dict.fromkeys(k[0] for k in cells))
    xlabels = sorted({k[1] for k in cells})
    grid = [[cells.get((y, x), float("nan")) for x in xlabels] for y in ylabels]
    fig, ax = plt.subplots(figsize=(2.0 + 1.1 * len(xlabels), 1.2 + 0.32 * len(ylabels)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.2, aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:  # not NaN
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(xlabels)))
    ax.set_xticklabels([str(x) for x in xlabels])
    ax.set_yticks(range(len(ylabels)))
    ax.set_yticklabels(ylabels, fontsize=7)
    ax.set_xlabel("tokens")
    # Two lines: one would run past a three-column figure's edge and lose the date.
    ax.set_title(f"moe_gemm default / best peer (>1: faster)\n{doc.get('device')}, "
                 f"{doc.get('date')}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
