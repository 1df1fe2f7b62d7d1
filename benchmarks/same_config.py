"""Same config, same process: our varlen kernel against QuACK's, both pinned to one config.

    python -m benchmarks.same_config [--cases MODEL/PROJ/TOKENS,...] [--configs "pp 128x128 c1x2;..."]
        [--reps 15] [--out FILE]

The model zoo compares our default (a tuned table's pick) with QuACK's own pick, so a row we
lose mixes two questions: is our kernel slower than QuACK's at the same tile, cluster and
schedule, or did we pick a worse config? This benchmark answers the first. Per zoo case, and
per config named as `moe-gemm tune` names them ('pp 128x192 c2x1': ping-pong, a 128x192 tile,
clusters of 2 along M), our grouped_mm with that config and QuACK's varlen GEMM with the same
tile, schedule and cluster (quack.gemm_interface.gemm_tuned.fn with a fixed GemmConfig) go
through the zoo's harness (benchmarks.runner: the zoo's inputs and routing, every output
checked against a float32 reference first, then back-to-back samples behind a sleep backlog,
interleaved round by round). Rows are the harness's; ours carry
`vs_quack` = QuACK's time / ours (above 1: ours faster).

The tile order is pinned too: QuACK's varlen scheduler walks each expert's tiles in bands of
8 N-tiles (of clusters), N fastest, the bands serpentine along M (its default AlongN raster,
max_swizzle_size 8), which is our raster 'p8ns'. A config named without a raster word gets
that one; one that names a raster ('p16', 'p8') keeps it, against QuACK's fixed order.

Only configs both kernels build are meaningful: ping-pong 128x{128,160,192,208} and 192x128,
cooperative 256x{128,160,192,208} and 128x{224,256}, clusters 1x1, 1x2 and 2x1.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from typing import Any

import torch

from benchmarks.ab_cases import tag_rows
from benchmarks.runner import ab_start, add_ab_options, config_fields, run_shape
from benchmarks.suite import Impl, Inputs, Prepared, ShapeSpec, _ours, build_quack_config
from benchmarks.zoo import build_cases, parse_cases
from moe_gemm.tuning import space

DEFAULT_CASES = ("OLMoE-1B-7B/gate_up/2048", "OLMoE-1B-7B/down/8192",
                 "Qwen3-30B-A3B/down/8192", "GLM-4.5/down/8192")
DEFAULT_CONFIGS = ("pp 128x128 c1x2", "pp 128x128 c2x1", "pp 128x192 c2x1", "pp 128x160 c1x2",
                   "coop 256x128 c2x1")
OURS, QUACK = "moe_gemm", "QuACK"


# QuACK's varlen tile order as our raster code (module docstring).
QUACK_ORDER = "p8ns"


def _names_a_raster(name: str) -> bool:
    words = name.replace(",", " ").replace(":", " ").split()
    return any(re.fullmatch(r"p\d+n?s?", word) for word in words)


def parse_configs(text: str) -> list[dict]:
    """';'-separated config names -> their fields (ValueError naming a bad one); a name without
    a raster word takes QuACK's order (QUACK_ORDER)."""
    return config_fields(text, lambda n: n if _names_a_raster(n) else f"{n} {QUACK_ORDER}")


def quack_config(fields: dict) -> dict:
    """The keyword arguments of QuACK's GemmConfig for the same tile, schedule and cluster."""
    return {"tile_m": fields["tile_m"], "tile_n": fields["tile_n"],
            "pingpong": fields["schedule"] == "pingpong",
            "cluster_m": fields.get("cluster_m") or 1, "cluster_n": fields.get("cluster_n") or 1,
            "device_capacity": 9, "is_dynamic_persistent": False, "max_swizzle_size": 8}


def _quack_pinned(fields: dict):
    """An implementation builder: QuACK's varlen GEMM pinned to `fields`' tile and cluster."""

    def build(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
        return build_quack_config(inp, device, quack_config(fields))

    return build


def implementations(configs: list[dict]) -> list[Impl]:
    impls = []
    for fields in configs:
        name, cfg = space.name_of(fields), space.config_of(fields)
        impls.append(Impl(f"{OURS} {name}", peer=False, build=_ours(cfg), config=cfg))
        impls.append(Impl(f"{QUACK} {name}", peer=True, build=_quack_pinned(fields)))
    return impls


def add_ratios(rows: list[dict[str, Any]], flops: float) -> list[str]:
    """TFLOP/s on every timed row and `vs_quack` on ours; the table's lines."""
    by = {r["impl"]: r for r in rows}
    lines = []
    for r in rows:
        if r.get("ms"):
            r["tflops"] = flops / r["ms"] / 1e9
    for r in rows:
        if not r["impl"].startswith(OURS + " "):
            continue
        name = r["impl"][len(OURS) + 1:]
        q = by.get(f"{QUACK} {name}", {})
        if r.get("ms") and q.get("ms"):
            r["vs_quack"] = q["ms"] / r["ms"]
        nan = float("nan")
        lines.append(f"  {name:20s} | ours {(r.get('ms') or nan) * 1e3:8.1f} us "
                     f"{r.get('tflops', nan):6.1f} TFLOP/s | QuACK "
                     f"{(q.get('ms') or nan) * 1e3:8.1f} us {q.get('tflops', nan):6.1f} TFLOP/s"
                     f" | QuACK/ours {r.get('vs_quack', nan):.3f}")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.same_config",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help="comma-separated MODEL/PROJ/TOKENS zoo cases (default: %(default)s)")
    p.add_argument("--configs", default=";".join(DEFAULT_CONFIGS),
                   help="';'-separated configs as `moe-gemm tune` names them "
                   "(default: %(default)s)")
    add_ab_options(p, reps=15)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = ab_start(args, argv, "same_config", "our kernels and QuACK's are Hopper kernels",
                       lambda: (parse_cases(args.cases), parse_configs(args.configs)))
    if started is None:
        return 2
    (cases, configs), run = started
    doc = run.doc
    impls = implementations(configs)
    for model, proj, tokens in cases:
        try:
            spec, f = build_cases(model, str(tokens), [proj], args.seed, False)[0]
        except (ValueError, IndexError) as exc:
            print(f"same_config: {model}/{proj}/{tokens}: {exc}", file=sys.stderr)
            return 2
        print(f"{spec.name}: E={f['E']} N={f['N']} K={f['K']} rows={f['rows']} {f['layout']}",
              flush=True)
        first = len(doc["results"])
        run_shape(run, spec, impls)
        rows = doc["results"][first:]
        tag_rows(rows, spec.name, f)
        print("\n".join(add_ratios(rows, 2.0 * f["rows"] * f["N"] * f["K"])), flush=True)
        run.save()
    errors = {r["impl"]: r.get("error") for r in doc["results"] if r.get("status") == "error"}
    for impl, err in errors.items():
        print(f"same_config: {impl} failed: {err}", file=sys.stderr)
    ratios = sorted(r["vs_quack"] for r in doc["results"] if "vs_quack" in r)
    if not ratios:
        print("same_config: no config was timed on both sides: nothing to compare",
              file=sys.stderr)
        return 1
    print(f"QuACK/ours over {len(ratios)} case x config pairs: median "
          f"{statistics.median(ratios):.3f}, min {ratios[0]:.3f}, max {ratios[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
