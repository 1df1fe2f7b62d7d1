"""Calibrate the cost model (moe_gemm.ops.cost_model) on the tuner's timings.

Per config, the three constants (eff, tile_us, mem) are chosen by grid search to minimise the
squared log error of the predicted against the measured times over every shape that config
was timed on. Only configs that won a shape, or came within PROVEN of its winner, and that
were timed on at least MIN_SAMPLES shapes are offered to the lookup: the model picks among
configs measured to be good somewhere, never among ones merely predicted to be.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from moe_gemm.ops.cost_model import LAUNCH_US, Shape, terms
from moe_gemm.ops.tuned import MODEL_KIND

PROVEN = 1.03
MIN_SAMPLES = 3
EFF = np.linspace(0.25, 1.1, 35)
TILE_US = np.array([0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0])
MEM = np.linspace(0.9, 3.0, 22)
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _shape(sample: dict, nsm: int) -> Shape:
    return Shape(sample["form"], int(sample["E"]), int(sample["N"]), int(sample["K"]),
                 int(sample["rows"]), nsm, _ITEMSIZE.get(sample["dtype"], 2),
                 _ITEMSIZE.get(sample.get("out_dtype", sample["dtype"]), 2))


def fit_config(rows: list[tuple[float, float, float, float]]) -> tuple[float, float, float,
                                                                       float]:
    """Best (eff, tile_us, mem, rms log error) for samples (waves, flop_us, bytes_us, us)."""
    a = np.array(rows, dtype=np.float64)
    waves, flop_us, bytes_us, meas = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    log_meas = np.log(np.maximum(meas, 1e-3))
    # compute[e, t, i] = waves_i * (flop_us_i / eff_e + tile_us_t); memory[m, i] = mem * b_i
    compute = waves[None, None, :] * (flop_us[None, None, :] / EFF[:, None, None]
                                      + TILE_US[None, :, None])
    memory = MEM[:, None] * bytes_us[None, :]
    pred = np.maximum(compute[:, :, None, :], memory[None, None, :, :]) + LAUNCH_US
    err = ((np.log(pred) - log_meas) ** 2).mean(axis=-1)
    e, t, m = np.unravel_index(int(np.argmin(err)), err.shape)
    return float(EFF[e]), float(TILE_US[t]), float(MEM[m]), float(math.sqrt(err[e, t, m]))


def fit_model(samples: list[dict], mm_flops_per_s: float, copy_bytes_per_s: float,
              nsm: int) -> dict | None:
    """The table's "model" block, or None when there is nothing to fit."""
    if not samples or mm_flops_per_s <= 0 or copy_bytes_per_s <= 0:
        return None
    best: dict[tuple, float] = {}
    for s in samples:
        key = _shape_key(s)
        best[key] = min(best.get(key, math.inf), float(s["us"]))
    by_config: dict[tuple, list[dict]] = defaultdict(list)
    proven: set[tuple] = set()
    for s in samples:
        cfg = tuple(sorted((k, v) for k, v in s["config"].items() if v is not None))
        by_config[cfg].append(s)
        if float(s["us"]) <= PROVEN * best[_shape_key(s)]:
            proven.add(cfg)
    configs = []
    for cfg, items in by_config.items():
        if cfg not in proven or len(items) < MIN_SAMPLES:
            continue
        fields = dict(cfg)
        rows = []
        for s in items:
            t = terms(fields, _shape(s, nsm), mm_flops_per_s, copy_bytes_per_s)
            rows.append((t.waves, t.flop_us, t.bytes_us, float(s["us"])))
        eff, tile_us, mem, rms = fit_config(rows)
        configs.append({"config": fields, "eff": round(eff, 4), "tile_us": tile_us,
                        "mem": round(mem, 4), "rms_log_err": round(rms, 4),
                        "samples": len(items)})
    if not configs:
        return None
    log2 = lambda v: math.log2(max(1, v))  # noqa: E731
    buckets = [round(math.log2(max(1e-9, s["rows"] / max(1, s["E"])))) for s in samples]
    return {
        "kind": MODEL_KIND, "mm_flops_per_s": mm_flops_per_s,
        "copy_bytes_per_s": copy_bytes_per_s, "nsm": nsm, "configs": configs,
        "domain": {"forms": sorted({s["form"] for s in samples}),
                   "dtypes": sorted({(s["dtype"], s.get("out_dtype", s["dtype"]))
                                     for s in samples}),
                   "log2_N": [min(log2(s["N"]) for s in samples),
                              max(log2(s["N"]) for s in samples)],
                   "log2_K": [min(log2(s["K"]) for s in samples),
                              max(log2(s["K"]) for s in samples)],
                   "bucket": [min(buckets), max(buckets)]},
    }


def _shape_key(s: dict) -> tuple:
    return (s["form"], s["dtype"], s.get("out_dtype"), s["E"], s["N"], s["K"], s["rows"])
