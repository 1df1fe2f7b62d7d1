"""Device: does a suite shape's ranking depend on what ran just before (clocks, power)?

Times each implementation alone after an idle pause ("alone": the GPU starts cool, as in a
one-implementation script) and interleaved round by round with the others (as `moe-gemm
bench` and `moe-gemm tune` do), with the SM clock and power read after each block.

    python3 scripts/isolation_probe.py --shape mixtral [--rounds 3] [--out $OUT/probe.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.clock import Clock  # noqa: E402
from benchmarks.suite import (  # noqa: E402
    GROUPED_MM_FN,
    _build_quack,
    full_suite,
    loop_body,
    make_inputs,
)
from moe_gemm import grouped_gemm, grouped_mm  # noqa: E402
from moe_gemm.tuning.space import config_of, parse_name  # noqa: E402
from moe_gemm.tuning.table_io import write_json  # noqa: E402


def smi() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return f"<{exc}>"


def build_impls(spec, inp, dev, configs: str, quack: bool = True) -> dict:
    """Name -> zero-argument call for a suite shape: our default, each extra config (named as
    `moe-gemm tune` prints them, e.g. "coop 128x256 c1x2 s3 p16"), the torch peers, and QuACK
    (when importable and `quack`)."""
    impls = {}
    if spec.form == "general":
        impls["moe_gemm"] = lambda: grouped_gemm(inp.a, inp.b)
    else:
        impls["moe_gemm"] = lambda: grouped_mm(inp.x, inp.w, inp.offs)
    for cs in filter(None, (c.strip() for c in configs.split(";"))):
        cfg = config_of(parse_name(cs, spec.form))
        if spec.form == "general":
            impls[cs] = lambda cfg=cfg: grouped_gemm(inp.a, inp.b, config=cfg)
        else:
            impls[cs] = lambda cfg=cfg: grouped_mm(inp.x, inp.w, inp.offs, config=cfg)
    impls["torch.mm loop"] = loop_body(inp, dev)
    if spec.form == "varlen" and GROUPED_MM_FN is not None:
        impls["F.grouped_mm"] = lambda: GROUPED_MM_FN(inp.x, inp.w, offs=inp.offs)
    if spec.form == "general" and len(set(spec.problems)) == 1:
        a3, b3 = torch.stack(inp.a), torch.stack(inp.b)
        impls["moe_gemm 3-D"] = lambda: grouped_mm(a3, b3)
        impls["torch.bmm"] = lambda: torch.bmm(a3, b3)
    if quack:
        try:
            impls["QuACK"] = _build_quack(spec, inp, dev).run
        except Exception as exc:  # noqa: BLE001
            print(f"QuACK: {exc}")
    return impls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="mixtral")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle", type=float, default=3.0)
    p.add_argument("--out", default="")
    p.add_argument("--configs", default="",
                   help="extra moe_gemm configs, ';'-separated, named as `moe-gemm tune` "
                   "prints them (e.g. 'coop 128x256 c1x2 s3 p16;pp 128x192')")
    p.add_argument("--alone-only", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="routing and data seed (bench: 1234)")
    a = p.parse_args()
    dev = torch.device("cuda")
    spec = {s.name: s for s in full_suite()}[a.shape]
    inp = make_inputs(spec, spec.counts(a.seed), dev, a.seed)
    impls = build_impls(spec, inp, dev, a.configs)
    clock = Clock(dev)
    for fn in impls.values():
        for _ in range(3):
            fn()
    clock.sync()
    est = {n: statistics.median(clock.single([f], 3)) for n, f in impls.items()}
    rows = []
    for r in range(a.rounds):
        for name, fn in impls.items():  # alone: idle first, then one block of this impl only
            time.sleep(a.idle)
            calls = max(2, int(100 / est[name]))  # ~0.1 s of work per sample
            s = clock.back_to_back([fn], 10, calls, 0.5)
            rows.append({"round": r, "mode": "alone", "impl": name,
                         "us": statistics.median(s) * 1e3, "smi": smi()})
        if a.alone_only:
            continue
        time.sleep(a.idle)
        for rep in range(10):  # interleaved: every impl once per pass, no idle in between
            for name, fn in impls.items():
                calls = max(2, int(100 / est[name]))
                s = clock.back_to_back([fn], 1, calls, 0.5)
                rows.append({"round": r, "mode": "interleaved", "impl": name,
                             "us": s[0] * 1e3, "smi": smi() if rep == 9 else ""})
    summary = {}
    for mode in ("alone", "interleaved"):
        for name in impls:
            v = [x["us"] for x in rows if x["mode"] == mode and x["impl"] == name]
            if v:
                summary[f"{mode} {name}"] = statistics.median(v)
    if a.out:
        write_json(Path(a.out), {"shape": a.shape, "rows": rows, "summary": summary})
    for row in rows:
        if row["smi"]:
            print(f"{row['round']} {row['mode']:11s} {row['impl']:14s} {row['us']:8.1f} us  "
                  f"{row['smi']}")
    for k, v in summary.items():
        print(f"{k:28s} {v:8.1f} us")


if __name__ == "__main__":
    main()
