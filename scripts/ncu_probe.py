"""Launches to read under `ncu` (device only): one grouped_mm of a suite shape with a given
config, or an MoE layer's two expert GEMMs, fused and plain, at the same routing.

    ncu -k regex:GroupedGemm -c 1 --section WarpStateStats python3 scripts/ncu_probe.py \
        --shape moe-prefill --config "pp 128x192"
    ncu --profile-from-start off --metrics dram__bytes_read.sum,gpu__time_duration.sum \
        python3 scripts/ncu_probe.py --layer deepseek-v3-ep8 --tokens 4096

With --layer, the fused layer's gate-up GEMM (SiLU over concatenated gate/up columns, on the
routed rows gathered beforehand) and down GEMM (row weights), each beside grouped_mm on the
same operands, every one on the library's own choice (benchmarks.fused_configs' routing and
weights); `--interleaved` adds the gate-up GEMM on the weight repacked as interleaved. Each is
called twice (compiles, warms), then once more between cudaProfilerStart and Stop, so
`--profile-from-start off` reads one launch each. Without ncu the script prints each call's
CUDA-event time (median of 15 interleaved rounds of 3 calls, us).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.suite import full_suite, make_inputs  # noqa: E402
from moe_gemm import grouped_mm  # noqa: E402
from moe_gemm.tuning.space import config_of, parse_name  # noqa: E402


def layer_calls(model: str, tokens: int, interleaved: bool,
                device: torch.device | None = None) -> dict:
    """The layer's two GEMMs, fused and plain, as argument-free calls (the plain ones on the
    same routed rows, so both read the same operands)."""
    from benchmarks.fused_configs import MODELS, layer_case
    from moe_gemm import fused_grouped_mm
    from moe_gemm.ops.fused import interleave_gate_up

    case = layer_case(MODELS[model], tokens, device or torch.device("cuda"), torch.bfloat16)
    up, down = case["up"]["kw"], case["down"]["kw"]
    if up.get("bias") is not None or up["gate_layout"] != "concat":
        raise SystemExit(f"--layer {model}: only the concat-gate layers (no bias) are built here")
    rows = up["x"].index_select(0, up["row_index"])
    calls = {
        "plain up": lambda: grouped_mm(rows, up["w"], up["offs"]),
        "fused up": lambda: fused_grouped_mm(rows, up["w"], up["offs"], gate=up["gate"]),
        "plain down": lambda: grouped_mm(down["x"], down["w"], down["offs"]),
        "fused down": lambda: fused_grouped_mm(down["x"], down["w"], down["offs"],
                                               row_weight=down["row_weight"]),
    }
    if interleaved:
        w_il = interleave_gate_up(up["w"])
        calls["fused up, interleaved"] = lambda: fused_grouped_mm(
            rows, w_il, up["offs"], gate=up["gate"], gate_layout="interleaved")
    return calls


def event_times(calls: dict, rounds: int = 15, per_batch: int = 3) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            call()
            start.record()
            for _ in range(per_batch):
                call()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / per_batch * 1000.0)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="moe-prefill")
    p.add_argument("--config", default="default")
    p.add_argument("--layer", help="an MoE layer of benchmarks.fused_configs (deepseek-v3-ep8, "
                                   "qwen3-30b-a3b, mixtral-8x7b)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--interleaved", action="store_true")
    p.add_argument("--times", action="store_true", help="print CUDA-event times, no profiling")
    a = p.parse_args()
    if a.layer:
        calls = layer_calls(a.layer, a.tokens, a.interleaved)
        for call in calls.values():  # compile + warm
            call()
            call()
        torch.cuda.synchronize()
        if a.times:
            for name, us in event_times(calls).items():
                print(f"{name:24} {us:10.1f} us")
            return
        torch.cuda.cudart().cudaProfilerStart()
        for call in calls.values():
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    spec = {s.name: s for s in full_suite()}[a.shape]
    inp = make_inputs(spec, spec.counts(0), torch.device("cuda"), 0)
    cfg = None if a.config == "default" else config_of(parse_name(a.config))
    grouped_mm(inp.x, inp.w, inp.offs, config=cfg)  # compile + warm (skipped by -c/-s)
    torch.cuda.synchronize()
    grouped_mm(inp.x, inp.w, inp.offs, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
