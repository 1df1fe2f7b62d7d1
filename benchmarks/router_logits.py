"""DeepSeek-V3-style fp32 router logits: one GEMM of the 16-bit operands with fp32 output
(layers/routing.router_logits_fp32, what the MoE layers run) against transformers' way
(F.linear(x.float(), weight.float()): two widening copies, then an fp32 GEMM).

    python -m benchmarks.router_logits [--tokens 1024,4096,16384] [--out FILE]
    python -m benchmarks.router_logits --smoke        # CPU: the script works

Shapes (H, E): DeepSeek-V3 / Kimi-K2's router over 256 experts, one rank of 8-way expert
parallelism's 32, GLM-4.5's 160. Per shape: bf16 x of seeded random values, the router weight
at 0.02 scale; both outputs against the fp64 product (max abs error) and the experts each
picks (sigmoid_grouped_topk, top-8 of 8 groups, 4 kept: the fraction of tokens with the
same set). Timing: CUDA events around `--calls` back-to-back calls, the two interleaved for
`--rounds` rounds, the median. Rows print us | TFLOP/s | GB/s | ratio (the widened GEMM's
time over ours).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.report import out_argument, write_json  # noqa: E402
from benchmarks.runner import counts_problem, number_problem, split_names  # noqa: E402
from moe_gemm.layers.routing import router_logits_fp32, sigmoid_grouped_topk  # noqa: E402

SHAPES = {"deepseek-v3": (7168, 256), "deepseek-v3-ep8": (7168, 32), "glm-4.5": (5120, 160)}
OURS, WIDENED = "moe_gemm router_logits_fp32", "F.linear widened to fp32"


def widened(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float())


def time_ms(fn, calls: int, device: torch.device) -> float:
    if device.type != "cuda":
        import time

        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3 / calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def experts(logits: torch.Tensor) -> torch.Tensor:
    bias = torch.zeros(logits.shape[1], device=logits.device)
    return sigmoid_grouped_topk(logits, bias, 8, 8, 4, 2.5, True)[1].sort(dim=1).values


def run_shape(name: str, T: int, H: int, E: int, device: torch.device, rounds: int,
              calls: int) -> list[dict[str, Any]]:
    g = torch.Generator(device="cpu").manual_seed(T * 7 + E)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(E, H, generator=g) * 0.02).to(device, torch.bfloat16)
    fns = {OURS: lambda: router_logits_fp32(x, w), WIDENED: lambda: widened(x, w)}
    ref = x.double() @ w.double().t()
    want = experts(ref.float())
    rows = {}
    for impl, fn in fns.items():
        out = fn()
        rows[impl] = dict(model=name, tokens=T, H=H, E=E, impl=impl,
                          max_abs_err=(out.double() - ref).abs().max().item(),
                          same_experts=(experts(out) == want).all(dim=1).float().mean().item())
        fn()  # (warm)
    times: dict[str, list[float]] = {impl: [] for impl in fns}
    for r in range(rounds):
        for impl in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            times[impl].append(time_ms(fns[impl], calls, device))
    flops, size = 2.0 * T * H * E, x.element_size()
    bytes_ = (T * H + E * H) * size + T * E * 4  # ours: 16-bit operands in, fp32 logits out
    base = statistics.median(times[WIDENED])
    for impl, row in rows.items():
        ms = statistics.median(times[impl])
        row.update(us=round(ms * 1e3, 2), tflops=round(flops / ms / 1e9, 2),
                   gbps=round(bytes_ / ms / 1e6, 1), ratio=round(base / ms, 3))
    return list(rows.values())


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':16} {'tokens':>6} {'impl':28} {'us':>9} {'TFLOP/s':>8} {'GB/s':>8} "
             f"{'ratio':>6} {'same experts':>12}"]
    lines += [f"{r['model']:16} {r['tokens']:6d} {r['impl']:28} {r['us']:9.1f} "
              f"{r['tflops']:8.1f} {r['gbps']:8.1f} {r['ratio']:6.2f} {r['same_experts']:12.4f}"
              for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_logits",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1024,4096,16384", help="comma-separated token counts")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20, help="calls per timed batch")
    p.add_argument("--out", type=out_argument, help="write the JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the harness")
    args = p.parse_args(argv)
    # (with --smoke too, which runs one round of one call: --rounds 0 was a StatisticsError
    # traceback and --calls 0 a ZeroDivisionError once the first shape was set up)
    if why := (counts_problem(args.tokens) or number_problem(args.rounds, "--rounds")
               or number_problem(args.calls, "--calls")):
        print(f"error: {why}", file=sys.stderr)
        return 2
    tokens = [int(t) for t in split_names(args.tokens)]
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU (use --smoke on a CPU)", file=sys.stderr)
        return 2
    shapes = {n: (64, 16) for n in SHAPES} if args.smoke else SHAPES
    rows = []
    for T in ([5, 33] if args.smoke else tokens):
        for name, (H, E) in shapes.items():
            rows += run_shape(name, T, H, E, device, 1 if args.smoke else args.rounds,
                              1 if args.smoke else args.calls)
    result = {"suite": "router-logits", "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "rows": rows}
    if args.out:
        write_json(Path(args.out), result)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
