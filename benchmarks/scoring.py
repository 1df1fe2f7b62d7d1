"""The arithmetic of a benchmark result: bytes needed, FLOPs, the roofline floor, and
`derive` / `format_table`, which turn raw timings into TFLOP/s, GB/s, fraction of floor,
ratio to the best peer and the bar. Plain Python, no torch.

Rows of an fp8 shape carry their operands' `dtype` ("fp8" or "bf16") and FP8 `scale`
("block", "row"): each row's floor counts the bytes its own operands need and the matmul rate
of its dtype (the dense FP8 rate for FP8 rows), and a dense FP8 ceiling row, where one was
timed, gives the FP8 rows `fraction_of_dense`."""

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


def fp8_bytes_needed(sizes: Sequence[Size], granularity: str, out_elem: int = 2) -> int:
    """bytes_needed for FP8 operands (one byte each) plus their float32 scales: block, one per
    1x128 group of A and per 128x128 block of B; row, one per row of A and column of B."""
    total = 0
    for m, n, k in sizes:
        if m <= 0:
            continue
        kb, nb = -(-k // 128), -(-n // 128)
        scales = m * kb + kb * nb if granularity == "block" else m + n
        total += m * k + k * n + m * n * out_elem + 4 * scales
    return total


def shape_bytes(sizes: Sequence[Size], dtype: str) -> dict[str, Any]:
    """A shape's `bytes` (what its default reads: block-scaled FP8 for an fp8 shape) and, for
    an fp8 shape, `bytes_by_mode` (per row mode_of: "fp8-block", "fp8-row", "bf16")."""
    if dtype != "fp8":
        elem = {"fp32": 4}.get(dtype, 2)
        return {"bytes": bytes_needed(sizes, elem, elem)}
    by_mode = {"fp8-block": fp8_bytes_needed(sizes, "block"),
               "fp8-row": fp8_bytes_needed(sizes, "row"), "bf16": bytes_needed(sizes, 2, 2)}
    return {"bytes": by_mode["fp8-block"], "bytes_by_mode": by_mode}


def mode_of(row: dict[str, Any]) -> str:
    """"fp8-block", "fp8-row", "bf16", ...: the key of a row's bytes in bytes_by_mode."""
    dtype = str(row.get("dtype") or "")
    return f"{dtype}-{row['scale']}" if row.get("scale") else dtype


def mm_rate(ceilings: dict[str, Any], dtype: str | None) -> float | None:
    """The dense matmul rate bounding a row of `dtype` (FP8: the measured dense FP8 rate)."""
    if dtype == "fp8":
        return ceilings.get("fp8_mm_flops_per_s")
    return ceilings.get("mm_flops_per_s")


def fp8_compute_bound(sizes: Sequence[Size], ceilings: dict[str, Any]) -> bool:
    """Whether block-scaled FP8 on `sizes` is bound by the dense FP8 rate rather than by the
    copy bandwidth (False when either ceiling is missing)."""
    bw, rate = ceilings.get("copy_bytes_per_s"), ceilings.get("fp8_mm_flops_per_s")
    if not bw or not rate:
        return False
    return floor_ms(fp8_bytes_needed(sizes, "block"), flops(sizes), bw, rate)[1] == "compute"


def fill_row(row: dict[str, Any], info: dict[str, Any], ceilings: dict[str, Any]) -> None:
    """A row's bytes, FLOPs, floor (from its own operands' bytes and its dtype's rate),
    TFLOP/s, GB/s and fraction of the floor, in place. A ceiling row (a different
    computation of the same FLOPs) gets TFLOP/s only."""
    ms = row.get("ms")
    timed = row.get("status") == "ok" and bool(ms)
    if row.get("ceiling"):
        row.update(flops=info["flops"], floor_ms=None, floor_bound=None)
        if timed:
            row["tflops"] = info["flops"] / ms / 1e9
        return
    nbytes = (info.get("bytes_by_mode") or {}).get(mode_of(row), info["bytes"])
    bw, rate = ceilings.get("copy_bytes_per_s"), mm_rate(ceilings, row.get("dtype"))
    floor = bound = None
    if bw and rate:
        floor, bound = floor_ms(nbytes, info["flops"], bw, rate)
    row.update(bytes=nbytes, flops=info["flops"], floor_ms=floor, floor_bound=bound)
    if not timed:
        return
    row["tflops"] = info["flops"] / ms / 1e9
    row["gbps"] = nbytes / ms / 1e6
    if floor:
        row["fraction_of_floor"] = floor / ms


def fill_dense(rows: list[dict[str, Any]]) -> float | None:
    """`dense_ms` and `fraction_of_dense` (dense time / this time) on the FP8 rows of one shape
    whose dense FP8 ceiling was timed; returns the dense time (None: not timed)."""
    dense = next((r for r in rows if r.get("ceiling") and r.get("status") == "ok"
                  and r.get("ms")), None)
    if dense is None:
        return None
    for r in rows:
        if r.get("dtype") == "fp8" and not r.get("ceiling") and r.get("status") == "ok" \
                and r.get("ms"):
            r["dense_ms"] = dense["ms"]
            r["fraction_of_dense"] = dense["ms"] / r["ms"]
    return dense["ms"]


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
    bw = ceil.get("copy_bytes_per_s")
    shapes = doc.get("shapes", {})
    for info in shapes.values():
        rate = mm_rate(ceil, info.get("dtype"))
        if bw and rate:
            info["floor_ms"], info["floor_bound"] = floor_ms(info["bytes"], info["flops"], bw,
                                                             rate)
    best: dict[str, tuple[float, str]] = {}
    for row in doc["results"]:
        if row.get("peer") and row.get("status") == "ok" and row.get("ms"):
            cur = best.get(row["shape"])
            if cur is None or row["ms"] < cur[0]:
                best[row["shape"]] = (row["ms"], row["impl"])
    for name, info in shapes.items():
        dense = fill_dense([r for r in doc["results"] if r["shape"] == name])
        if dense is not None:
            info["dense_ms"] = dense
    for row in doc["results"]:
        info = shapes.get(row["shape"])
        if info is None:
            row.setdefault("floor_ms", None)
            continue
        fill_row(row, info, ceil)
        ms = row.get("ms")
        if row.get("status") != "ok" or not ms or row.get("ceiling"):
            continue
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
    fp8 = f", FP8 mm {ceil['fp8_mm_flops_per_s'] / 1e12:.0f} TFLOP/s" if ceil.get(
        "fp8_mm_flops_per_s") else ""
    lines = [f"moe-gemm bench | {doc.get('device')} | {doc.get('date')} | copy "
             f"{ceil.get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s, bf16 mm "
             f"{ceil.get('mm_flops_per_s', 0) / 1e12:.0f} TFLOP/s{fp8}"]
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
