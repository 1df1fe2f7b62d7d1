"""The arithmetic of a benchmark result: bytes needed, FLOPs, the roofline floor, and
`derive` / `format_table`, which turn raw timings into TFLOP/s, GB/s, fraction of floor,
ratio to the best peer and the bar. Plain Python, no torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Size = tuple[int, int, int]  # (M, N, K)


def bytes_needed(sizes: Sequence[Size], in_elem: int, out_elem: int) -> int:
    """Fewest DRAM bytes: each needed input read once, each output written once.

    A problem with M_i = 0 (an expert with no rows) reads no weights and costs nothing.
    """
    return sum(
        (m * k + k * n) * in_elem + m * n * out_elem for m, n, k in sizes if m > 0
    )


def flops(sizes: Sequence[Size]) -> int:
    """2 * M * N * K summed over problems."""
    return sum(2 * m * n * k for m, n, k in sizes)


def floor_ms(
    nbytes: int, nflops: int, copy_bytes_per_s: float, mm_flops_per_s: float
) -> tuple[float, str]:
    """The roofline floor in ms and which ceiling sets it ("memory" or "compute")."""
    if copy_bytes_per_s <= 0 or mm_flops_per_s <= 0:
        raise ValueError("ceilings must be positive")
    mem_ms = nbytes / copy_bytes_per_s * 1e3
    cmp_ms = nflops / mm_flops_per_s * 1e3
    return (mem_ms, "memory") if mem_ms >= cmp_ms else (cmp_ms, "compute")



def derive(doc: dict[str, Any]) -> None:
    """Fill floors, TFLOP/s, GB/s, fraction of floor, ratio to best peer and the bar."""
    ceil = doc.get("ceilings") or {}
    bw, rate = ceil.get("copy_bytes_per_s"), ceil.get("mm_flops_per_s")
    shapes = doc.get("shapes", {})
    for info in shapes.values():
        if bw and rate:
            info["floor_ms"], info["floor_bound"] = floor_ms(info["bytes"], info["flops"], bw,
                                                             rate)
    best: dict[str, tuple[float, str]] = {}
    for row in doc["results"]:
        if row.get("peer") and row.get("status") == "ok" and row.get("ms"):
            cur = best.get(row["shape"])
            if cur is None or row["ms"] < cur[0]:
                best[row["shape"]] = (row["ms"], row["impl"])
    for row in doc["results"]:
        info = shapes.get(row["shape"])
        if info is None:
            row.setdefault("floor_ms", None)
            continue
        row.update(bytes=info["bytes"], flops=info["flops"], floor_ms=info.get("floor_ms"),
                   floor_bound=info.get("floor_bound"))
        ms = row.get("ms")
        if row.get("status") != "ok" or not ms:
            continue
        row["tflops"] = info["flops"] / ms / 1e9
        row["gbps"] = info["bytes"] / ms / 1e6
        if row["floor_ms"]:
            row["fraction_of_floor"] = row["floor_ms"] / ms
        if row["shape"] in best:
            row["best_peer"] = best[row["shape"]][1]
            row["vs_best_peer"] = best[row["shape"]][0] / ms
    bar: dict[str, Any] = {"shapes": {}}
    for name, info in shapes.items():
        default = next((r for r in doc["results"] if r["shape"] == name and r.get("default")),
                       None)
        entry: dict[str, Any] = {"best_peer": best.get(name, (None, None))[1],
                                 "best_peer_ms": best.get(name, (None, None))[0]}
        if default is None or default.get("status") != "ok":
            entry.update(default_ms=None, ok=False,
                         why=(default or {}).get("error", "default not measured"))
        else:
            entry.update(default_ms=default["ms"], vs_best_peer=default.get("vs_best_peer"),
                         fraction_of_floor=default.get("fraction_of_floor"))
            entry["ok"] = None if name not in best else default["ms"] <= best[name][0]
        if info.get("headline"):
            frac = entry.get("fraction_of_floor")
            entry["floor_ok"] = frac is not None and frac >= 0.95
            bar["headline"] = name
            bar["headline_fraction_of_floor"] = frac
        bar["shapes"][name] = entry
    oks = [e["ok"] for e in bar["shapes"].values() if e["ok"] is not None]
    bar["default_at_least_best_peer"] = f"{sum(oks)}/{len(oks)}"
    floor_ok = [e["floor_ok"] for e in bar["shapes"].values() if "floor_ok" in e]
    bar["pass"] = bool(oks) and all(oks) and all(floor_ok)
    doc["bar"] = bar


def _table_rows(doc: dict[str, Any], shape: str) -> list[dict[str, Any]]:
    rows = [r for r in doc["results"] if r["shape"] == shape and r.get("status") == "ok"]
    return sorted(rows, key=lambda r: (not r.get("default"), not r.get("peer"), r["ms"]))


def format_table(doc: dict[str, Any]) -> str:
    """The compact table printed last: one line per shape x implementation."""
    ceil = doc.get("ceilings") or {}
    lines = [f"moe-gemm bench | {doc.get('device')} | {doc.get('date')} | copy "
             f"{ceil.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s, bf16 mm "
             f"{ceil.get('mm_flops_per_s', 0) / 1e12:.0f} TFLOP/s"]
    head = f"{'shape':12} | {'impl':37} | {'us':>8} | {'TFLOP/s':>7} | {'GB/s':>6} | " \
           f"{'floor%':>6} | vs best peer"
    lines += [head, "-" * len(head)]
    for shape, info in doc.get("shapes", {}).items():
        if info.get("floor_ms"):
            lines.append(f"{shape:12} | {'(roofline floor, ' + info['floor_bound'] + ')':37} | "
                         f"{info['floor_ms'] * 1e3:8.1f} | {'':>7} | {'':>6} | {'100':>6} |")
        for r in _table_rows(doc, shape):
            vs = f"{r['vs_best_peer']:.2f}x" if r.get("vs_best_peer") else "-"
            frac = f"{100 * r['fraction_of_floor']:.0f}" if r.get("fraction_of_floor") else "-"
            lines.append(f"{shape:12} | {r['impl'][:37]:37} | {r['ms'] * 1e3:8.1f} | "
                         f"{_num(r.get('tflops'), 7)} | {_num(r.get('gbps'), 6)} | {frac:>6} | "
                         f"{vs}")
    bar = doc.get("bar") or {}
    if bar:
        frac = bar.get("headline_fraction_of_floor")
        lines.append(f"bar: default >= best peer on {bar.get('default_at_least_best_peer')} "
                     f"shapes; headline at {'-' if frac is None else f'{100 * frac:.0f}'}% of "
                     f"floor (need 95); {'PASS' if bar.get('pass') else 'not met'}")
    host = (doc.get("host_overhead") or {}).get("calls") or {}
    if host:
        parts = [f"{k.replace('moe_gemm.', 'ours ').replace(' (default)', '')} "
                 f"{v['cpu_us']:.1f}" for k, v in host.items() if "cpu_us" in v]
        lines.append("host CPU us/call: " + "; ".join(parts))
        gaps = [f"{k.replace('moe_gemm.', 'ours ').replace(' (default)', '')} "
                f"{v['launch_gap_us']:.1f}" for k, v in host.items() if "launch_gap_us" in v]
        lines.append("host call-to-kernel us: " + "; ".join(gaps))
    bad = [r for r in doc["results"] if r.get("status") == "error"]
    na = sum(1 for r in doc["results"] if r.get("status") == "n/a")
    if bad or na:
        lines.append(f"{len(bad)} failed, {na} n/a (errors and reasons in the JSON)")
    by_error: dict[str, list[dict[str, Any]]] = {}
    for r in bad:
        by_error.setdefault(str(r.get("error")), []).append(r)
    for error, rows in list(by_error.items())[:6]:
        more = f" (+{len(rows) - 1} more)" if len(rows) > 1 else ""
        lines.append(f"  FAILED {rows[0]['shape']} / {rows[0]['impl']}{more}: {error}")
    return "\n".join(ln if len(ln) <= 120 else ln[:117] + "..." for ln in lines)


def _num(x: float | None, width: int) -> str:
    if not x:
        return f"{'-':>{width}}"
    if x >= 10:
        return f"{x:{width}.1f}"
    return f"{x:{width}.3g}" if x >= 0.01 else f"{x:{width}.1e}"
