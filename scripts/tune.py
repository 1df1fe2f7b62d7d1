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
from moe_gemm.bench import Clock  # noqa: E402
from moe_gemm.bench_suite import full_suite, make_inputs  # noqa: E402


def measure(fns: dict, reps: int = 20) -> dict:
    """Back-to-back GPU ms per call (launches queued behind a sleep backlog), interleaved
    across configs each round so clock drift hits all alike; median of `reps`."""
    clock = Clock(torch.device("cuda"))
    plan = {}
    for name, fn in fns.items():
        try:
            for _ in range(2):
                fn()
            clock.sync()
            host = statistics.median(clock.host_ms([fn], 3))
            est = max(statistics.median(clock.single([fn], 2)), 1e-3)
            calls = max(2, min(200, int(3.0 / est)))
            plan[name] = (fn, calls, host * calls * 1.3 + 0.2)
        except Exception as exc:  # noqa: BLE001
            plan[name] = f"error: {type(exc).__name__}: {exc}"[:160]
    samples: dict = {k: [] for k, v in plan.items() if not isinstance(v, str)}
    for _ in range(reps):
        for name in samples:
            fn, calls, backlog = plan[name]
            samples[name] += clock.back_to_back([fn], 1, calls, backlog)
    return {k: (statistics.median(v) * 1000 if k in samples else plan[k])
            for k, v in [(k, samples.get(k)) for k in plan]}


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
        fns = {}
        for cs in ["default", *filter(None, a.configs.split(","))]:
            cfg, hints = (None, None) if cs == "default" else parse(cs)

            def fn(cfg=cfg, hints=hints):
                if hints:
                    os.environ["MOE_GEMM_L2_HINTS"] = hints
                else:
                    os.environ.pop("MOE_GEMM_L2_HINTS", None)
                if spec.form == "general":
                    return grouped_gemm(inp.a, inp.b, config=cfg)
                return grouped_mm(inp.x, inp.w, inp.offs, config=cfg)
            fns[cs] = fn
        for name, us in measure(fns).items():
            rows.append((shape, name, us))
        inp = None  # noqa: F841  (free the inputs before the next shape)
        torch.cuda.empty_cache()
    for shape, name, us in rows:
        print(f"{shape:12s} {name:44s} {us if isinstance(us, str) else f'{us:9.1f} us'}")
    if a.out:
        json.dump(rows, open(a.out, "w"))


if __name__ == "__main__":
    main()
