"""Benchmark: moe_gemm's MoE experts vs transformers' default "grouped_mm" experts implementation.

The shape is a DeepSeek-V3 MoE layer: H=7168, I=2048 (moe_intermediate_size), top-8 of
E=256 routed experts, or with --ep 8 one rank's shard of an 8-way expert-parallel layout
(E=32 local experts, every routed slot landing on this rank). Tokens sweep 1..8192.

Both implementations run on the *same* transformers `DeepseekV3Experts` module (random bf16
weights, transformers' fused layout gate_up_proj (E, 2I, H), down_proj (E, H, I)) with the
same routing (uniform top-k without repetition, fp32 weights), through the registered experts
functions: `ALL_EXPERTS_FUNCTIONS["grouped_mm"]` (transformers' default) and
`ALL_EXPERTS_FUNCTIONS["moe_gemm"]` (ours). With --layer the whole block is timed as well:
`DeepseekV3MoE` (router + experts + shared expert) against `MoE.from_hf(block)`. With --graph
both are also timed as CUDA-graph replays (launch overhead removed), which both support.

Timing: CUDA events around each call after warm-up, median of --iters (>= 20) calls.
TFLOP/s counts the routed GEMMs only: 2 * T * k * (H * 2I + I * H). ratio = the transformers
time of the same row group / this row's time (> 1: faster than transformers).

    python benchmarks/bench_moe.py --out benchmarks/results/moe_h100.json          # E=256
    python benchmarks/bench_moe.py --ep 8 --graph --layer --out moe_ep8.json       # E=32
    python benchmarks/bench_moe.py --smoke                                         # CPU check

Without transformers installed only our rows are measured. The JSON (--out) holds the device,
versions, the backend moe_gemm used, per-row timings and an accuracy check of ours against
transformers on every token count.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import moe_gemm  # noqa: E402
from benchmarks.report import out_path_argument, write_json  # noqa: E402
from benchmarks.runner import (  # noqa: E402
    counts_problem,
    given_options,
    number_problem,
    split_names,
)
from moe_gemm.capability import cute_problem  # noqa: E402
from moe_gemm.config import GemmConfig  # noqa: E402
from moe_gemm.layers.moe import MoE, moe_experts  # noqa: E402
from moe_gemm.testing import calc_diff  # noqa: E402

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
# --smoke's sizes on the CPU (each stands unless given beside it)
SMOKE = {"hidden": 64, "intermediate": 32, "experts": 8, "topk": 2, "tokens": [1, 7, 33],
         "iters": 3, "warmup": 1}
PEER = "hf_grouped_mm"
OURS = "moe_gemm"


def _transformers() -> Any | None:
    try:
        import transformers
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: F401
    except ImportError:
        return None
    if int(transformers.__version__.split(".")[0]) < 5:
        return None
    return transformers


def _param(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype,
           gen: torch.Generator) -> torch.nn.Parameter:
    # randn / sqrt(fan_in): activations stay O(1) through both GEMMs at any H, I.
    t = torch.randn(shape, device=device, dtype=dtype, generator=gen) / math.sqrt(shape[-1])
    return torch.nn.Parameter(t, requires_grad=False)


def build_block(H: int, I: int, E: int, k: int, device: torch.device, dtype: torch.dtype,
                seed: int) -> torch.nn.Module | None:
    """A transformers DeepseekV3MoE with random weights, built on `meta` then materialized
    straight on the device in `dtype` (never a full fp32 copy: E=256 is 22 GB in bf16)."""
    if _transformers() is None:
        return None
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    import moe_gemm.integrations as integrations

    integrations.register_transformers()
    n_group = 8 if E % 8 == 0 and E // 8 >= 2 else 1
    cfg = DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=k,
        n_group=n_group, topk_group=max(1, n_group // 2), n_shared_experts=1,
        routed_scaling_factor=2.5,
    )
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        block = DeepseekV3MoE(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in block.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, _param(tuple(p.shape), device, dtype, gen))
    block.gate.e_score_correction_bias = torch.zeros(E, device=device)
    return block.eval()


class _PlainExperts(torch.nn.Module):
    """Stand-in for transformers' experts module when transformers is absent."""

    def __init__(self, H: int, I: int, E: int, device: torch.device, dtype: torch.dtype,
                 seed: int) -> None:
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)
        self.gate_up_proj = _param((E, 2 * I, H), device, dtype, gen)
        self.down_proj = _param((E, H, I), device, dtype, gen)


def routing(T: int, E: int, k: int, device: torch.device, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform top-k without repetition; fp32 weights summing to 1 per token."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(T, E, device=device, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(T, k, device=device, generator=gen) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def time_us(fn: Callable[[], Any], iters: int, warmup: int, device: torch.device) -> float:
    """Median wall time of one call in microseconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        events = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def graphed(fn: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], Any]:
    """fn captured in a CUDA graph (its inputs must be static tensors); returns replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    H, I, k = args.hidden, args.intermediate, args.topk
    E = args.experts // args.ep  # (parse_args checked that --ep divides --experts)
    tokens = args.tokens
    config = GemmConfig(backend=args.backend)
    tf = _transformers()
    block = build_block(H, I, E, k, device, dtype, args.seed)
    experts = block.experts if block is not None else _PlainExperts(H, I, E, device, dtype,
                                                                      args.seed)
    our_layer = MoE.from_hf(block, config=config) if block is not None and args.layer else None
    fns: dict[str, Callable[..., torch.Tensor]] = {}
    if tf is not None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        peer_fn, our_fn = ALL_EXPERTS_FUNCTIONS["grouped_mm"], ALL_EXPERTS_FUNCTIONS["moe_gemm"]
        fns[PEER] = lambda x, ids, w: peer_fn(experts, x, ids, w)
        if args.backend == "auto":
            fns[OURS] = lambda x, ids, w: our_fn(experts, x, ids, w)
        else:
            fns[OURS] = lambda x, ids, w: moe_experts(
                x, ids, w, experts.gate_up_proj.transpose(1, 2),
                experts.down_proj.transpose(1, 2), config=config)
    else:
        fns[OURS] = lambda x, ids, w: moe_experts(
            x, ids, w, experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2),
            config=config)

    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    for T in tokens:
        x = torch.randn(T, H, device=device, dtype=dtype, generator=gen)
        ids, w = routing(T, E, k, device, args.seed + T)
        flops = 2.0 * T * k * (H * 2 * I + I * H)
        group: dict[str, float] = {}
        with torch.inference_mode():
            outs = {name: fn(x, ids, w) for name, fn in fns.items()}
            if PEER in outs:
                checks.append({"tokens": T, "calc_diff_vs_transformers":
                               calc_diff(outs[OURS], outs[PEER])})
            del outs
            variants: list[tuple[str, Callable[[], Any]]] = []
            for name, fn in fns.items():
                variants.append((name, lambda fn=fn: fn(x, ids, w)))
                if args.graph and device.type == "cuda":
                    variants.append((name + "+graph", graphed(lambda fn=fn: fn(x, ids, w),
                                                              device)))
            if args.layer and block is not None and our_layer is not None:
                xb = x.view(1, T, H)
                variants.append(("layer:" + PEER, lambda: block(xb)))
                variants.append(("layer:" + OURS, lambda: our_layer(xb)))
            for name, fn in variants:
                us = time_us(fn, args.iters, args.warmup, device)
                group[name] = us
                rows.append({"tokens": T, "impl": name, "us": us,
                             "tflops": flops / us * 1e-6})
        for row in rows:
            if row["tokens"] != T:
                continue
            name = row["impl"]
            base = name.replace(OURS, PEER) if OURS in name else name
            row["ratio"] = group[base] / row["us"] if base in group else None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"tokens={T}: " + ", ".join(f"{n} {u:.1f} us" for n, u in group.items()),
              flush=True)
    return {
        "bench": "moe_experts",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": None if tf is None else tf.__version__,
        "moe_gemm": moe_gemm.__version__,
        "moe_gemm_backend": args.backend if args.backend != "auto" else (
            "cute" if cute_problem(device) is None else f"torch ({cute_problem(device)})"),
        "shape": {"H": H, "I": I, "E": E, "E_total": args.experts, "ep": args.ep, "top_k": k,
                  "dtype": args.dtype, "routing": "uniform top-k without repetition"},
        "iters": args.iters,
        "results": rows,
        "checks": checks,
    }


def print_table(report: dict[str, Any]) -> None:
    shape = report["shape"]
    print(f"\n{report['device']} | torch {report['torch']} | transformers "
          f"{report['transformers']} | moe_gemm backend: {report['moe_gemm_backend']}")
    print(f"H={shape['H']} I={shape['I']} E={shape['E']} (of {shape['E_total']}, ep="
          f"{shape['ep']}) top-{shape['top_k']} {shape['dtype']}")
    for c in report["checks"]:
        if c["calc_diff_vs_transformers"] > 1e-4:
            print(f"WARNING tokens={c['tokens']}: calc_diff vs transformers = "
                  f"{c['calc_diff_vs_transformers']:.3g}")
    print(f"{'tokens':>7} | {'impl':<26} | {'us':>10} | {'TFLOP/s':>8} | {'ratio':>6}")
    for r in report["results"]:
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        print(f"{r['tokens']:>7} | {r['impl']:<26} | {r['us']:>10.1f} | {r['tflops']:>8.2f} | "
              f"{ratio:>6}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168, help="H (default 7168, DeepSeek-V3)")
    p.add_argument("--intermediate", type=int, default=2048, help="I per expert (default 2048)")
    p.add_argument("--experts", type=int, default=256, help="routed experts in total (256)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ways: time one rank's E/ep experts (8 -> E=32)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (8)")
    p.add_argument("--tokens", help="comma-separated token counts (default 1..8192)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--backend", choices=["auto", "cute", "torch"], default="auto",
                   help="moe_gemm backend for our rows")
    p.add_argument("--iters", type=int, default=30, help="timed calls per row (>= 20)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    p.add_argument("--layer", action="store_true",
                   help="also time the whole block: DeepseekV3MoE vs MoE.from_hf")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is there")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on the CPU (H=64, I=32, E=8, top-2, 3 token counts; a size "
                   "given beside it stands)")
    p.add_argument("--out", type=out_path_argument, help="write the JSON report here")
    args = p.parse_args(argv)
    # Checked before --smoke replaces the sizes: a bad value is refused, not run (a size of 0
    # was timed as a case, a negative one or --ep 0 was a traceback, after minutes of
    # building weights without --smoke).
    if why := _arg_problem(args):
        p.error(why)
    args.tokens = ([int(t) for t in split_names(args.tokens)] if args.tokens is not None
                   else DEFAULT_TOKENS)
    args.preset = set()  # the sizes --smoke filled in (an explicit one beside it stands)
    if args.smoke:
        args.preset = set(SMOKE) - given_options(p, argv)
        for name in args.preset:
            setattr(args, name, SMOKE[name])
        args.cpu = args.layer = True
    elif args.iters < 20:
        p.error("--iters must be >= 20 for a stable median (use --smoke for a quick check)")
    if args.experts % args.ep:  # (of the sizes run; was a SystemExit from run(): exit 1)
        p.error(f"--ep {args.ep} must divide --experts {args.experts}"
                + " (--smoke's)" * ("experts" in args.preset))
    if not 1 <= args.topk <= args.experts // args.ep:
        p.error(f"--topk must be in [1, experts / ep = {args.experts // args.ep}]")
    return args


def _arg_problem(args: argparse.Namespace) -> str | None:
    """Why the sizes and counts cannot make a run, or None."""
    for option in ("hidden", "intermediate", "experts", "ep", "topk", "iters"):
        if why := number_problem(getattr(args, option), f"--{option}"):
            return why
    if why := number_problem(args.warmup, "--warmup", zero=True):
        return why
    return counts_problem(args.tokens) if args.tokens is not None else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.out is not None:
        write_json(args.out, report)
        print(f"wrote {args.out}")
    print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
