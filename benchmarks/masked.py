"""The masked grouped GEMM (DeepGEMM's and DeepEP's low-latency layout) against the ways to do
the same work without it, on one GPU, in one process:

    python -m benchmarks.masked --out masked.json [--smoke] [--reps 9] [--only NAME,...]

Each shape is G experts with a row capacity M each and valid row counts drawn per expert
(seeded, around `expected` rows: a decode step's tokens per expert, or DeepGEMM's published
masked cases). Per shape, interleaved round by round, each captured in a CUDA graph:
- `ours-masked`: grouped_mm_masked(x, w, masked_m, expected_m=...), bf16;
- `ours-batched-full`: our batched form on every capacity row (what a caller without the
  counts on the host computes);
- `torch-bmm-full`: torch.bmm on every capacity row;
- `ours-varlen-compact` and `torch-grouped-mm-compact`: the valid rows already packed
  together (the packing not timed), grouped_mm with offs: the same useful work in the
  contiguous layout, the bar the masked form should meet;
- FP8 (block scales 1x128 / 128x128): `ours-fp8-masked` and `ours-fp8-batched-full`;
- gate-up shapes (w's N = 2I, gate then up columns): `ours-fused-masked-swiglu`
  (fused_grouped_mm_masked with gate="silu": the activation in the kernel's epilogue, I output
  columns) against `ours-masked+torch-swiglu` (the masked GEMM, then silu(gate) * up over the
  whole capacity buffer, as a caller without a masked activation kernel runs it).
Every result is checked against the fp32 product (and SwiGLU) on the valid rows first.

Times: medians of back-to-back CUDA-graph replays between events (benchmarks.clock), us.
TFLOP/s count the valid rows only (2 * sum(masked_m) * N * K); GB/s the compulsory bytes
(each expert's weights read once, the valid rows of x read and of y written); `floor_us`
those bytes at the device-to-device copy bandwidth measured in the same run; `ratio` is the
best bf16 peer's time over ours-masked (above 1: ours faster). On a machine without the Hopper
kernels --smoke runs the harness on tiny shapes (torch backend).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import shape_list
from benchmarks.bench_fp8 import copy_bandwidth, graphed, time_round_robin
from benchmarks.clock import Clock

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    name: str
    G: int  # experts (problems)
    M: int  # row capacity per expert
    N: int
    K: int
    expected: int  # typical valid rows per expert
    note: str = ""


SHAPES = [
    # DeepSeek-V3 with 8-way expert parallelism under DeepEP low-latency dispatch: 32 local
    # experts, 128 tokens per rank x top-8 over 256 experts from 8 ranks = 32 rows per expert,
    # capacity 128 x 8 = 1024.
    Shape("dsv3-ep8-ll-gate-up", 32, 1024, 4096, 7168, 32, "DeepSeek-V3 EP8 decode, gate-up"),
    Shape("dsv3-ep8-ll-down", 32, 1024, 7168, 2048, 32, "DeepSeek-V3 EP8 decode, down"),
    # The same at 32 tokens per rank (8 rows per expert).
    Shape("dsv3-ep8-ll-gate-up-small", 32, 1024, 4096, 7168, 8, "32 tokens per rank"),
    # EP32: 8 local experts, 128 tokens per rank from 32 ranks.
    Shape("dsv3-ep32-ll-gate-up", 8, 4096, 4096, 7168, 128, "DeepSeek-V3 EP32 decode"),
    # DeepGEMM's published masked cases (groups x expected rows, N x K).
    Shape("deepgemm-1x1024-up", 1, 4096, 4096, 7168, 1024, "DeepGEMM masked 1 x 1024"),
    Shape("deepgemm-4x256-up", 4, 4096, 4096, 7168, 256, "DeepGEMM masked 4 x 256"),
    Shape("deepgemm-4x256-down", 4, 4096, 7168, 2048, 256, "DeepGEMM masked 4 x 256"),
]
SMOKE_SHAPES = [Shape("smoke-gate-up", 3, 64, 128, 256, 20),
                Shape("smoke-empty", 2, 32, 64, 128, 1)]


def counts_for(shape: Shape, seed: int) -> torch.Tensor:
    """Valid rows per expert: log-normal popularity around `expected` (sigma 0.5, as the zoo's
    routing), clamped into [0, M]; int32 on the CPU."""
    g = torch.Generator().manual_seed(seed)
    pop = torch.randn(shape.G, generator=g).mul(0.5).exp()
    c = (pop / pop.mean() * shape.expected).round().clamp(0, shape.M)
    return c.to(torch.int32)


def operands(shape: Shape, counts: torch.Tensor, device) -> dict[str, torch.Tensor]:
    G, M, N, K = shape.G, shape.M, shape.N, shape.K
    gen = torch.Generator(device=device).manual_seed(1234)
    x = torch.randn(G, M, K, device=device, dtype=BF16, generator=gen)
    w_nk = torch.randn(G, N, K, device=device, dtype=BF16, generator=gen) * K ** -0.5
    masked_m = counts.to(device)
    # The valid rows packed together, for the compact (varlen) peers.
    xc = torch.cat([x[g, :int(counts[g])] for g in range(G)]) if int(counts.sum()) else \
        x.new_empty(0, K)
    offs = counts.cumsum(0).to(torch.int32).to(device)
    return {"x": x, "w": w_nk.transpose(1, 2), "masked_m": masked_m, "xc": xc, "offs": offs}


def implementations(shape: Shape, o: dict[str, torch.Tensor], smoke: bool
                    ) -> dict[str, Callable[[], torch.Tensor]]:
    import torch.nn.functional as F

    import moe_gemm

    x, w, mm, xc, offs = o["x"], o["w"], o["masked_m"], o["xc"], o["offs"]
    impls: dict[str, Callable[[], torch.Tensor]] = {
        "ours-masked": lambda: moe_gemm.grouped_mm_masked(x, w, mm, expected_m=shape.expected),
        "ours-batched-full": lambda: moe_gemm.grouped_mm(x, w),
        "torch-bmm-full": lambda: torch.bmm(x, w),
        "ours-varlen-compact": lambda: moe_gemm.grouped_mm(xc, w, offs),
    }
    if hasattr(F, "grouped_mm") and x.is_cuda:
        impls["torch-grouped-mm-compact"] = lambda: F.grouped_mm(xc, w, offs=offs)
    if "up" in shape.name:
        half = shape.N // 2

        def masked_then_swiglu():
            y = moe_gemm.grouped_mm_masked(x, w, mm, expected_m=shape.expected)
            return F.silu(y[..., :half]) * y[..., half:]

        impls["ours-fused-masked-swiglu"] = lambda: moe_gemm.fused_grouped_mm_masked(
            x, w, mm, gate="silu", expected_m=shape.expected)
        impls["ours-masked+torch-swiglu"] = masked_then_swiglu
    if shape.K % 128 == 0:
        xq, sa = moe_gemm.quantize_fp8_per_token_group(x.reshape(-1, shape.K))
        xq, sa = xq.view(shape.G, shape.M, shape.K), sa.view(shape.G, shape.M, -1)
        wq, sb = moe_gemm.quantize_fp8_per_block(w.transpose(1, 2))
        wq, sb = wq.transpose(1, 2), sb.transpose(1, 2)
        impls["ours-fp8-masked"] = lambda: moe_gemm.scaled_grouped_mm_masked(
            xq, wq, sa, sb, mm, expected_m=shape.expected)
        impls["ours-fp8-batched-full"] = lambda: moe_gemm.scaled_grouped_mm(xq, wq, sa, sb)
    return impls


def check(name: str, y: torch.Tensor, o: dict[str, torch.Tensor], counts: torch.Tensor
          ) -> float:
    """Largest error on the valid rows relative to the fp32 product's largest value."""
    x, w = o["x"], o["w"]
    if name.endswith("compact"):
        rows = torch.split(y, counts.tolist())
    else:
        rows = [y[g, :int(counts[g])] for g in range(len(counts))]
    err, scale = 0.0, 1e-30
    for g, r in enumerate(rows):
        n = int(counts[g])
        if n == 0:
            continue
        ref = x[g, :n].float() @ w[g].float()
        if "swiglu" in name:
            half = ref.shape[1] // 2
            ref = torch.nn.functional.silu(ref[:, :half]) * ref[:, half:]
        err = max(err, float((r.float() - ref).abs().max()))
        scale = max(scale, float(ref.abs().max()))
    return err / scale


def run_shape(shape: Shape, clock: Clock, device, reps: int, copy_bps: float, smoke: bool
              ) -> dict[str, Any]:
    counts = counts_for(shape, seed=7)
    o = operands(shape, counts, device)
    valid = int(counts.sum())
    flops = 2 * valid * shape.N * shape.K
    active = int((counts > 0).sum())
    nbytes = (active * shape.N * shape.K + valid * shape.K + valid * shape.N) * 2
    res: dict[str, Any] = {**asdict(shape), "valid_rows": valid, "counts": counts.tolist(),
                           "useful_tflop": flops / 1e12, "compulsory_bytes": nbytes,
                           "floor_us": nbytes / copy_bps * 1e6, "impls": {}}
    fns = {}
    for name, fn in implementations(shape, o, smoke).items():
        entry: dict[str, Any] = {}
        try:
            tol = 0.08 if "fp8" in name else 0.02
            err = check(name, fn(), o, counts)
            entry["rel_err"] = err
            if not err <= tol:
                raise AssertionError(f"relative error {err:.3g} above {tol}")
            fns[name] = graphed(fn, device)
        except Exception:  # noqa: BLE001 - report it, time the others
            entry["error"] = traceback.format_exc()[-600:]
        res["impls"][name] = entry
    for name, us in time_round_robin(clock, fns, reps).items():
        e = res["impls"][name]
        e["us"] = round(us, 2)
        e["tflops"] = round(flops / (us * 1e-6) / 1e12, 1)
        e["gbps"] = round(nbytes / (us * 1e-6) / 1e9, 1)
        e["floor_fraction"] = round(res["floor_us"] / us, 3)
    ours = res["impls"].get("ours-masked", {}).get("us")
    peers = {n: e["us"] for n, e in res["impls"].items()
             if "us" in e and not n.startswith("ours") and "fp8" not in n}
    if ours and peers:
        best = min(peers, key=peers.get)
        res["best_peer"] = best
        res["ratio_vs_best_peer"] = round(peers[best] / ours, 3)
    fused, unfused = (res["impls"].get(n, {}).get("us") for n in ("ours-fused-masked-swiglu",
                                                                  "ours-masked+torch-swiglu"))
    if fused and unfused:
        res["fused_swiglu_speedup"] = round(unfused / fused, 3)
    for base in ("ours-batched-full", "ours-varlen-compact"):
        b = res["impls"].get(base, {}).get("us")
        if ours and b:
            res[f"ratio_vs_{base}"] = round(b / ours, 3)
    f8, f8full = (res["impls"].get(n, {}).get("us") for n in ("ours-fp8-masked",
                                                              "ours-fp8-batched-full"))
    if f8 and f8full:
        res["fp8_ratio_vs_batched_full"] = round(f8full / f8, 3)
    return res


def main(argv: list[str] | None = None) -> int:
    args = shape_list.parser(__doc__, reps=9, budget_s=300.0).parse_args(argv)
    if why := shape_list.arg_problem(args, SHAPES, SMOKE_SHAPES):
        print(f"error: {why}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    clock = Clock(device)
    shapes = shape_list.pick_shapes(args, SHAPES, SMOKE_SHAPES)
    doc = shape_list.header("masked", device)
    doc["copy_bytes_per_s"] = copy_bps = copy_bandwidth(clock, device, args.smoke)
    failed = shape_list.run_shapes(
        doc, Path(args.out), shapes, t0, args.budget_s,
        lambda shape: run_shape(shape, clock, device, args.reps, copy_bps, args.smoke))
    print(table(doc))
    return shape_list.exit_status(failed)


def table(doc: dict[str, Any]) -> str:
    lines = [f"{'shape':28s} {'impl':26s} {'us':>9s} {'TFLOP/s':>8s} {'GB/s':>7s} "
             f"{'ratio':>6s}"]
    for r in doc["shapes"]:
        if "impls" not in r:
            lines.append(f"{r['name']:28s} {r.get('skipped') or r.get('error', '')[-60:]}")
            continue
        ours = r["impls"].get("ours-masked", {}).get("us")
        for n, e in r["impls"].items():
            ratio = f"{e['us'] / ours:.3f}" if ours and "us" in e else ""
            lines.append(f"{r['name']:28s} {n:26s} {e.get('us', 'ERR'):>9} "
                         f"{e.get('tflops', ''):>8} {e.get('gbps', ''):>7} {ratio:>6s}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
