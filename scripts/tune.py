"""Quick config sweep on suite shapes (device): median CUDA-event time per config.

    python scripts/tune.py --shapes uniform,mixtral --configs "cooperative:128x256:4,pingpong"
A config is schedule[:MxN[:stages[:visitor[:a_hint/b_hint]]]] (hints: first|normal|last).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from moe_gemm import GemmConfig, grouped_gemm, grouped_mm  # noqa: E402
from moe_gemm.bench_suite import full_suite, make_inputs  # noqa: E402


def timeit(fn, reps=15, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000)
    return statistics.median(times)


def parse(spec):
    parts = spec.split(":")
    kw = {"backend": "cute", "schedule": parts[0]}
    if len(parts) > 1 and parts[1]:
        m, n = parts[1].split("x")
        kw.update(tile_m=int(m), tile_n=int(n))
    if len(parts) > 2 and parts[2]:
        kw["stages"] = int(parts[2])
    if len(parts) > 3 and parts[3]:
        kw["visitor"] = parts[3]
    hints = parts[4].replace("/", ",") if len(parts) > 4 and parts[4] else None
    return GemmConfig(**kw), hints


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="uniform")
    p.add_argument("--configs", default="")
    p.add_argument("--out", default="")
    a = p.parse_args()
    suite = {s.name: s for s in full_suite()}
    rows = []
    for shape in a.shapes.split(","):
        spec = suite[shape]
        inp = make_inputs(spec, spec.counts(0), torch.device("cuda"), 0)
        if spec.form == "general":
            def run(cfg):
                return grouped_gemm(inp.a, inp.b, config=cfg)
        else:
            def run(cfg):
                return grouped_mm(inp.x, inp.w, inp.offs, config=cfg)
        os.environ.pop("MOE_GEMM_L2_HINTS", None)
        rows.append((shape, "default", timeit(lambda: run(None))))
        for cs in filter(None, a.configs.split(",")):
            cfg, hints = parse(cs)
            if hints:
                os.environ["MOE_GEMM_L2_HINTS"] = hints
            else:
                os.environ.pop("MOE_GEMM_L2_HINTS", None)
            try:
                rows.append((shape, cs, timeit(lambda: run(cfg))))
            except Exception as exc:  # noqa: BLE001
                rows.append((shape, cs, f"error: {type(exc).__name__}: {exc}"[:160]))
            print(rows[-1], flush=True)
        inp = None  # noqa: F841  (free the inputs before the next shape)
        torch.cuda.empty_cache()
    for shape, name, us in rows:
        print(f"{shape:12s} {name:44s} {us if isinstance(us, str) else f'{us:9.1f} us'}")
    if a.out:
        json.dump(rows, open(a.out, "w"))


if __name__ == "__main__":
    main()
