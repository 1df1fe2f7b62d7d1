"""One grouped_mm launch of a suite shape with a given config, for `ncu` (device only).

    ncu -k regex:GroupedGemm -c 1 --section WarpStateStats python3 scripts/ncu_probe.py \
        --shape moe-prefill --config "pp 128x192"
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.suite import full_suite, make_inputs  # noqa: E402
from moe_gemm import grouped_mm  # noqa: E402
from moe_gemm.tuning.space import config_of, parse_name  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="moe-prefill")
    p.add_argument("--config", default="default")
    a = p.parse_args()
    spec = {s.name: s for s in full_suite()}[a.shape]
    inp = make_inputs(spec, spec.counts(0), torch.device("cuda"), 0)
    cfg = None if a.config == "default" else config_of(parse_name(a.config))
    grouped_mm(inp.x, inp.w, inp.offs, config=cfg)  # compile + warm (skipped by -c/-s)
    torch.cuda.synchronize()
    grouped_mm(inp.x, inp.w, inp.offs, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
