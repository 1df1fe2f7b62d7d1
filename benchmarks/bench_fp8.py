"""The FP8 grouped GEMM against its peers, on one GPU, in one process, in bounded time:

    python -m benchmarks.bench_fp8 --out fp8.json [--budget-s 270] [--smoke] [--no-sweep]

1. Ceilings measured in the same run: device-to-device copy bandwidth (the floor of the
   memory-bound decode rows) and, per compute-bound shape, the dense FP8 torch._scaled_mm of
   the same M x N x K (row-wise scales; and per-tensor with fast accumulation, the fastest
   dense FP8 path torch has).
2. Shapes: the FP8 decode headline (256 x 128x512x7168, each problem its own weights, the
   batched form), E=256 decode routing (256 and 2048 routed rows, N=512, K=7168), and
   DeepSeek-V3 / Kimi-K2 expert-parallel prefill shards (4k-32k rows; up 4096x7168, down
   7168x2048; DeepGEMM's published 4 x 8192 rows among them, also as the batched form).
3. Per shape, interleaved round by round, each captured in a CUDA graph: ours (block scales,
   the default config; the same with the scales loaded by the math threads three stages
   ahead instead of staged in shared memory (`-ring`), one stage ahead (`-ahead1`, the
   plain loop) and four (`-ahead4`), with the lagged promotion on scales from global
   memory (`-lag`), and with every stage waited for in full rather than through a probe of
   its barrier made a stage earlier (`-nopeek`, also row-wise; `-peek`: the probe forced on,
   for the forms and tiles whose default waits in full), and with the staged scales
   promoted in the plain loop rather than a stage behind (`-staged-plain`), and with the
   second warpgroup of a tile whose last 64 rows are empty left idle (`-halfskip`, also
   row-wise); unless
   --no-sweep a few alternative configs), ours row-wise,
   torch._scaled_grouped_mm (row-wise, where the installed torch has it), torch's
   block-scaled grouped mm (where it exists), our bf16 kernel and torch's bf16 grouped_mm on
   the same shape, and the dense FP8 ceiling. Each implementation's result is spot-checked
   against the fp64 product of its own dequantized operands (256 sampled rows) first.
4. Accuracy on long K (7168, 14336): relative error against fp64 with fp32 output.
5. The activation quantizer (1x128 groups): our kernel against the torch op sequence.

Times are medians of back-to-back CUDA-graph replays between events (benchmarks.clock),
in us; TFLOP/s count 2*M*N*K; bytes are the compulsory ones (FP8 operands read once, scales,
bf16 output written). The JSON is written after every shape, so a run cut short keeps what
finished. On a machine without the Hopper kernels --smoke checks the harness on tiny shapes.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import shape_list
from benchmarks.clock import Clock
from benchmarks.fp8_operands import (
    BF16,
    CHUNK_ELEMS,
    E4M3,
    half_skip,
    peek_wait,
    promote_lag,
    quantize_acts,
    quantize_weights,
    scale_ahead,
    smem_scales,
    spot_error,
    torch_blockwise_grouped_mm,
    torch_scaled_grouped_mm,
)
from benchmarks.report import write_json


@dataclass(frozen=True)
class Shape:
    name: str
    form: str  # "batched" | "varlen"
    groups: int  # G (batched) or E (varlen)
    rows: int  # M per problem (batched) or T routed rows (varlen)
    N: int
    K: int
    bound: str  # "memory" | "compute"
    note: str = ""


SHAPES = [
    Shape("decode-headline", "batched", 256, 128, 512, 7168, "memory",
          "256 problems of 128x512x7168, each its own weights"),
    Shape("decode-e256-rows256", "varlen", 256, 256, 512, 7168, "memory",
          "DeepSeek-V3 gate_up at TP8, 32 tokens x top-8"),
    Shape("decode-e256-rows2048", "varlen", 256, 2048, 512, 7168, "memory",
          "DeepSeek-V3 gate_up at TP8, 256 tokens x top-8"),
    Shape("dsv3-ep32-up-8k", "varlen", 8, 8192, 4096, 7168, "compute",
          "DeepSeek-V3 EP32 shard (8 experts) gate_up, 8k rows"),
    Shape("dsv3-ep32-down-8k", "varlen", 8, 8192, 7168, 2048, "compute",
          "DeepSeek-V3 EP32 shard down, 8k rows"),
    Shape("deepgemm-4x8192-up", "varlen", 4, 32768, 4096, 7168, "compute",
          "DeepGEMM's contiguous 4 x 8192 rows, N4096 K7168"),
    Shape("deepgemm-4x8192-down", "varlen", 4, 32768, 7168, 2048, "compute",
          "DeepGEMM's contiguous 4 x 8192 rows, N7168 K2048"),
    Shape("kimi-k2-ep32-up-16k", "varlen", 12, 16384, 4096, 7168, "compute",
          "Kimi-K2 EP32 shard (12 of 384 experts) gate_up, 16k rows"),
    Shape("deepgemm-4x8192-up-batched", "batched", 4, 8192, 4096, 7168, "compute",
          "DeepGEMM's 4 x 8192 rows as the batched form (a 3-D x), N4096 K7168"),
    Shape("deepgemm-4x8192-down-batched", "batched", 4, 8192, 7168, 2048, "compute",
          "DeepGEMM's 4 x 8192 rows as the batched form (a 3-D x), N7168 K2048"),
]
SMOKE_SHAPES = [
    Shape("smoke-batched", "batched", 4, 64, 128, 256, "memory"),
    Shape("smoke-varlen", "varlen", 4, 100, 128, 256, "compute"),
]


def sweep_configs(shape: Shape) -> dict[str, Any]:
    """Alternative FP8 configs timed beside the default (--sweep)."""
    from moe_gemm import GemmConfig

    c = {
        "coop-128x128": GemmConfig(schedule="cooperative", tile_m=128, tile_n=128,
                                   tail_split=False),
        "coop-128x192": GemmConfig(schedule="cooperative", tile_m=128, tile_n=192,
                                   tail_split=False),
        "coop-128x160": GemmConfig(schedule="cooperative", tile_m=128, tile_n=160,
                                   tail_split=False),
        "pp-64x128": GemmConfig(schedule="pingpong", tile_m=64, tile_n=128),
        "pp-64x192": GemmConfig(schedule="pingpong", tile_m=64, tile_n=192),
    }
    if shape.form == "batched":
        if shape.bound != "compute":  # (compute-bound: the pair's rows below)
            c["coop-128x128-c1x2"] = GemmConfig(schedule="cooperative", tile_m=128,
                                                tile_n=128, cluster_m=1, cluster_n=2)
    else:
        c["coop-128x128-c2x1"] = GemmConfig(schedule="cooperative", tile_m=128, tile_n=128,
                                            cluster_m=2, cluster_n=1)
        if shape.bound == "compute":
            c["coop-128x128-ts"] = GemmConfig(schedule="cooperative", tile_m=128, tile_n=128,
                                              tail_split=True)
    if shape.bound == "compute":
        # The default pair's tile order and depth: panels of 4, 8 or 16 m-tiles (the default
        # is 16 in the varlen form, 8 in the others), panels of n-tiles walked serpentine,
        # and four stages.
        pair = dict(schedule="cooperative", tile_m=128, tile_n=128, cluster_m=1, cluster_n=2)
        for panel in (4, 8, 16):
            c[f"coop-128x128-c1x2-p{panel}"] = GemmConfig(**pair, raster_panel=panel)
        c["coop-128x128-c1x2-p8ns"] = GemmConfig(**pair, raster_panel=8, raster_along="n",
                                                 raster_serpentine=True)
        c["coop-128x128-c1x2-s4"] = GemmConfig(**pair, stages=4)
    return c


# ---------------------------------------------------------------------------------------------
# operands


def routed_offs(T: int, E: int, seed: int, device) -> torch.Tensor:
    """Rows per expert as top-8-of-E routing gives them: a log-normal expert popularity (the
    busiest expert ~3x the mean), every row one expert."""
    gen = torch.Generator().manual_seed(seed)
    pop = torch.randn(E, generator=gen).mul(0.6).exp()
    picks = torch.multinomial(pop / pop.sum(), T, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=E).cumsum(0).to(torch.int32).to(device)


def fp8_weights(G: int, N: int, K: int, seed: int, device) -> dict[str, torch.Tensor]:
    """bf16 weights [G, K, N] (K-major views, as checkpoints store [G, N, K]) and their
    block-scaled and row-wise FP8 forms, drawn a few experts at a time (a 256 x 512 x 7168
    fp32 draw would be 3.7 GB)."""
    w16 = torch.empty(G, N, K, dtype=BF16, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    step = max(1, CHUNK_ELEMS // (N * K))
    for g in range(0, G, step):
        w16[g:g + step] = torch.randn(min(step, G - g), N, K, generator=gen,
                                      device=device) / K ** 0.5
    wb, sb = quantize_weights(w16, "block")
    wr, sr = quantize_weights(w16, "row")
    return {"wb": wb, "sb": sb, "wr": wr, "sr": sr, "w16": w16.transpose(1, 2)}


def fp8_acts(shape_lead: tuple[int, ...], K: int, seed: int, device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(*shape_lead, K, generator=gen, device=device).to(BF16)
    xb, sa = quantize_acts(x, "block")
    xr, sar = quantize_acts(x, "row")
    return {"x16": x, "xb": xb, "sa": sa, "xr": xr, "sar": sar}


# ---------------------------------------------------------------------------------------------
# implementations


def implementations(shape: Shape, ops: dict, sweep: bool) -> dict[str, tuple[Any, Any]]:
    """name -> (call, operands for the spot check) for one shape's operands; (None, why) for a
    peer that cannot run here."""
    import torch.nn.functional as F

    import moe_gemm

    x, w, o = ops["acts"], ops["w"], ops.get("offs")
    impls: dict[str, tuple[Callable, dict]] = {}
    block = {"x": x["xb"], "w": w["wb"], "sa": x["sa"], "sb": w["sb"], "g": "block"}
    row = {"x": x["xr"], "w": w["wr"], "sa": x["sar"], "sb": w["sr"], "g": "row"}
    bf16 = {"x": x["x16"], "w": w["w16"], "sa": None, "sb": None, "g": "bf16"}

    def ours(a, cfg=None):
        return lambda: moe_gemm.scaled_grouped_mm(a["x"], a["w"], a["sa"], a["sb"], o,
                                                  config=cfg)

    def switched(a, *switches):  # ours inside our FP8 environment switches (factories)
        def run():
            with contextlib.ExitStack() as stack:
                for switch in switches:
                    stack.enter_context(switch())
                return ours(a)()
        return run

    def no_staging():
        return smem_scales(False)

    impls["ours-fp8-block"] = (ours(block), block)
    impls["ours-fp8-row"] = (ours(row), row)
    # each stage waited for in full, not through a probe made a stage earlier
    no_peek = functools.partial(peek_wait, False)
    impls["ours-fp8-block-nopeek"] = (switched(block, no_peek), block)
    impls["ours-fp8-row-nopeek"] = (switched(row, no_peek), row)
    peek = functools.partial(peek_wait, True)  # (the default's way where it probes)
    impls["ours-fp8-block-peek"] = (switched(block, peek), block)
    impls["ours-fp8-row-peek"] = (switched(row, peek), row)
    # a tile's second warpgroup idle where all its rows are past the expert's end, on every
    # tile that builds it / on none (the default: from HALF_SKIP_MIN_ROWS rows per problem)
    for suffix, on in (("halfskip", True), ("nohalfskip", False)):
        skip = functools.partial(half_skip, on)
        impls[f"ours-fp8-block-{suffix}"] = (switched(block, skip), block)
        impls[f"ours-fp8-row-{suffix}"] = (switched(row, skip), row)
    # the staged scales promoted in the plain loop (two accumulators), not a stage behind
    impls["ours-fp8-block-staged-plain"] = (
        switched(block, functools.partial(promote_lag, False)), block)
    # the lagged promotion with the scales from global memory
    impls["ours-fp8-block-lag"] = (switched(block, promote_lag, no_staging), block)
    for n in (1, 4):  # the scales n stages ahead, beside the default ring's 3 (1: plain)
        impls[f"ours-fp8-block-ahead{n}"] = (
            switched(block, functools.partial(scale_ahead, n)), block)
    # the scales loaded 3 ahead by the math threads, not staged
    impls["ours-fp8-block-ring"] = (switched(block, no_staging), block)
    if sweep:
        for name, cfg in sweep_configs(shape).items():
            impls[f"ours-fp8-block/{name}"] = (ours(block, cfg), block)
    device = x["x16"].device
    row_mm, why = torch_scaled_grouped_mm(device)
    impls["torch-scaled-grouped-mm-row"] = (None, why) if row_mm is None else (
        lambda: row_mm(row["x"], row["w"], row["sa"], row["sb"], offs=o, out_dtype=BF16), row)
    block_mm, why = torch_blockwise_grouped_mm(device)
    impls["torch-scaled-grouped-mm-block"] = (None, why) if block_mm is None else (
        lambda: block_mm(block["x"], block["w"], block["sa"], block["sb"], offs=o), block)
    impls["ours-bf16"] = (lambda: moe_gemm.grouped_mm(bf16["x"], bf16["w"], o), bf16)
    if x["x16"].device.type != "cuda":
        return impls
    if hasattr(F, "grouped_mm"):
        impls["torch-grouped-mm-bf16"] = (lambda: F.grouped_mm(bf16["x"], bf16["w"], offs=o),
                                          bf16)
    if shape.form == "batched":
        impls["torch-bmm-bf16"] = (lambda: torch.bmm(bf16["x"], bf16["w"]), bf16)
    return impls


def dense_ceilings(shape: Shape, device) -> dict[str, Callable]:
    """The dense FP8 GEMM of the shape's total M x N x K (one weight): row-wise scales, and
    per-tensor scales with fast accumulation."""
    if not hasattr(torch, "_scaled_mm") or torch.device(device).type != "cuda":
        return {}
    M = shape.groups * shape.rows if shape.form == "batched" else shape.rows
    gen = torch.Generator(device=device).manual_seed(3)
    a = torch.randn(M, shape.K, generator=gen, device=device).to(E4M3)
    b = torch.randn(shape.N, shape.K, generator=gen, device=device).to(E4M3).t()
    sa, sb = torch.ones(M, 1, device=device), torch.ones(1, shape.N, device=device)
    one = torch.ones((), device=device)
    return {
        "dense-fp8-row": lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=BF16),
        "dense-fp8-tensor-fast": lambda: torch._scaled_mm(a, b, one, one, out_dtype=BF16,
                                                          use_fast_accum=True),
    }


# ---------------------------------------------------------------------------------------------
# timing


def graphed(fn: Callable[[], Any], device) -> Callable[[], Any]:
    """fn captured in a CUDA graph (its inputs static tensors): the replay (fn on the CPU)."""
    if torch.device(device).type != "cuda":
        return fn
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


def time_round_robin(clock: Clock, fns: dict[str, Callable], reps: int) -> dict[str, float]:
    """Median us per call of each fn, sampled round by round (each sample: back-to-back calls
    for ~5 ms of GPU work behind a 1 ms backlog)."""
    calls = {}
    for name, fn in fns.items():
        est = statistics.median(clock.single([fn], 3))
        calls[name] = max(1, min(200, int(5.0 / max(est, 1e-3))))
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name] += clock.back_to_back([fn], 1, calls[name], 1.0)
    return {n: statistics.median(s) * 1e3 for n, s in samples.items()}


def compulsory_bytes(shape: Shape, offs: torch.Tensor | None, fp8: bool) -> int:
    e = 1 if fp8 else 2
    if shape.form == "batched":
        G, M, N, K = shape.groups, shape.rows, shape.N, shape.K
        scales = G * (M * K // 128 + (K // 128) * -(-N // 128)) * 4 if fp8 else 0
        return G * (M * K * e + K * N * e + M * N * 2) + scales
    T, N, K = shape.rows, shape.N, shape.K
    counts = torch.diff(offs.cpu(), prepend=torch.zeros(1, dtype=offs.dtype))
    active = int((counts > 0).sum())
    scales = (T * K // 128 + active * (K // 128) * -(-N // 128)) * 4 if fp8 else 0
    return T * K * e + active * K * N * e + T * N * 2 + scales


def copy_bandwidth(clock: Clock, device, smoke: bool) -> float:
    """Bytes per second (read + written) of a 1 GiB device-to-device copy (4 MiB smoke)."""
    src = torch.empty(1 << (22 if smoke else 30), dtype=torch.uint8, device=device).random_()
    src = src.view(BF16)
    dst = torch.empty_like(src)
    ms = statistics.median(clock.back_to_back([lambda: dst.copy_(src)], 10, 2, 1.0))
    return 2 * src.numel() * 2 / (ms * 1e-3)


# ---------------------------------------------------------------------------------------------
# the run


def run_shape(shape: Shape, clock: Clock, device, reps: int, sweep: bool, copy_bps: float
              ) -> dict[str, Any]:
    res: dict[str, Any] = {**asdict(shape), "impls": {}}
    if shape.form == "batched":
        ops = {"acts": fp8_acts((shape.groups, shape.rows), shape.K, 0, device),
               "w": fp8_weights(shape.groups, shape.N, shape.K, 0, device), "offs": None}
        flops = 2 * shape.groups * shape.rows * shape.N * shape.K
    else:
        ops = {"acts": fp8_acts((shape.rows,), shape.K, 0, device),
               "w": fp8_weights(shape.groups, shape.N, shape.K, 0, device),
               "offs": routed_offs(shape.rows, shape.groups, 0, device)}
        flops = 2 * shape.rows * shape.N * shape.K
    offs = ops["offs"]
    fns: dict[str, Callable] = {}
    for name, (fn, a) in implementations(shape, ops, sweep).items():
        if fn is None:
            res["impls"][name] = {"error": a}
            continue
        try:
            y = fn()
            clock.sync()
            err = spot_error(y, a["x"], a["w"], a["sa"], a["sb"], offs, a["g"])
            fns[name] = graphed(fn, device)
            res["impls"][name] = {"spot_rel_err": err}
        except Exception as exc:  # noqa: BLE001 - a peer that cannot take the shape
            res["impls"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    dense = {}
    if shape.bound == "compute":
        for name, fn in dense_ceilings(shape, device).items():
            try:
                fn()
                dense[name] = graphed(fn, device)
            except Exception as exc:  # noqa: BLE001
                res["impls"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    times = time_round_robin(clock, {**fns, **dense}, reps)
    fp8_floor_us = compulsory_bytes(shape, offs, True) / copy_bps * 1e6
    bf16_floor_us = compulsory_bytes(shape, offs, False) / copy_bps * 1e6
    for name, us in times.items():
        entry = res["impls"].setdefault(name, {})
        fp8 = "bf16" not in name
        entry.update(us=round(us, 2), tflops=round(flops / us / 1e6, 1),
                     floor_fraction=round((fp8_floor_us if fp8 else bf16_floor_us) / us, 3))
    res["fp8_floor_us"] = round(fp8_floor_us, 2)
    res["bf16_floor_us"] = round(bf16_floor_us, 2)
    ours = times.get("ours-fp8-block")
    if ours:
        peers = {n: t for n, t in times.items() if not n.startswith(("ours", "dense"))
                 and "bf16" not in n}
        if peers:
            best = min(peers, key=peers.get)
            res["best_fp8_peer"] = best
            res["ours_speedup_vs_best_fp8_peer"] = round(peers[best] / ours, 3)
        if dense:
            ceiling = min(times[n] for n in dense)
            res["dense_ceiling_us"] = round(ceiling, 2)
            res["ours_fraction_of_dense"] = round(ceiling / ours, 3)
        if "ours-bf16" in times:
            res["ours_fp8_speedup_vs_ours_bf16"] = round(times["ours-bf16"] / ours, 3)
        sweep_best = min((t, n) for n, t in times.items() if n.startswith("ours-fp8-block"))
        res["best_ours_config"] = sweep_best[1]
    del ops
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def accuracy(device, smoke: bool) -> list[dict[str, Any]]:
    import moe_gemm
    from moe_gemm.ops.scaled_reference import scaled_grouped_mm_ref
    from moe_gemm.testing_fp8 import fp8_errors, make_fp8_moe_inputs

    out = []
    for K in ((256,) if smoke else (7168, 14336)):
        for g in ("block", "row"):
            x, w, sa, sb, offs = make_fp8_moe_inputs(512, 4, K, 256, g, device=device, seed=K)
            ref = scaled_grouped_mm_ref(x, w, sa, sb, offs)
            row = {"K": K, "granularity": g}
            y = moe_gemm.scaled_grouped_mm(x, w, sa, sb, offs, out_dtype=torch.float32)
            row["ours_fp32_out"] = fp8_errors(y, ref)
            y = moe_gemm.scaled_grouped_mm(x, w, sa, sb, offs)
            row["ours_bf16_out"] = fp8_errors(y, ref)
            if g == "row" and hasattr(torch, "_scaled_grouped_mm"):
                try:
                    yt = torch._scaled_grouped_mm(x, w, sa, sb, offs=offs, out_dtype=BF16)
                    row["torch_scaled_grouped_mm_bf16_out"] = fp8_errors(yt, ref)
                except Exception as exc:  # noqa: BLE001
                    row["torch_scaled_grouped_mm_bf16_out"] = {"error": str(exc)[:200]}
            out.append(row)
    return out


def quantize_cost(clock: Clock, device, smoke: bool, reps: int) -> list[dict[str, Any]]:
    from moe_gemm import quantize_fp8_per_token_group
    from moe_gemm.ops.quantize import _per_token_group_torch

    rows = []
    for T in ((64,) if smoke else (256, 2048, 8192, 32768)):
        K = 256 if smoke else 7168
        x = torch.randn(T, K, device=device).to(BF16)
        fns = {"ours-kernel": graphed(lambda: quantize_fp8_per_token_group(x), device),
               "torch-ops": graphed(lambda: _per_token_group_torch(x, 128, E4M3), device)}
        times = time_round_robin(clock, fns, reps)
        moved = T * K * (2 + 1) + T * K // 128 * 4
        rows.append({"T": T, "K": K, **{f"{n}_us": round(t, 2) for n, t in times.items()},
                     "ours_gbps": round(moved / times["ours-kernel"] / 1e3, 1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = shape_list.parser(__doc__, reps=7, budget_s=270.0)
    p.add_argument("--no-sweep", dest="sweep", action="store_false",
                   help="time only the default config of ours")
    args = p.parse_args(argv)
    if why := shape_list.arg_problem(args, SHAPES, SMOKE_SHAPES):
        print(f"error: {why}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    clock = Clock(device)
    shapes = shape_list.pick_shapes(args, SHAPES, SMOKE_SHAPES)
    doc = shape_list.header("fp8", device)
    out = Path(args.out)
    doc["copy_bytes_per_s"] = copy_bps = copy_bandwidth(clock, device, args.smoke)
    write_json(out, doc)
    for sections in (("quantize", lambda: quantize_cost(clock, device, args.smoke, args.reps)),
                     ("accuracy", lambda: accuracy(device, args.smoke))):
        try:
            doc[sections[0]] = sections[1]()
        except Exception:  # noqa: BLE001 - keep going: the shapes matter most
            doc[sections[0]] = {"error": traceback.format_exc()[-600:]}
        write_json(out, doc)
    failed = shape_list.run_shapes(
        doc, out, shapes, t0, args.budget_s,
        lambda shape: run_shape(shape, clock, device, args.reps, args.sweep, copy_bps),
        on_row=lambda row: print(_line(row), flush=True))
    # The sections time and check our own quantizer and kernel (torch's errors inside them
    # are caught per call), so a section that raised is our failure too.
    failed += [name for name in ("quantize", "accuracy")
               if isinstance(doc.get(name), dict) and "error" in doc[name]]
    return shape_list.exit_status(failed)


def _line(r: dict[str, Any]) -> str:
    if "impls" not in r:
        return f"{r['name']}: {r.get('skipped') or r.get('error', '')[-200:]}"
    parts = [f"{r['name']}:"]
    for n, e in r["impls"].items():
        parts.append(f"  {n} {e.get('us', '-')} us {e.get('tflops', '')} TF "
                     f"floor {e.get('floor_fraction', '')} err {e.get('spot_rel_err', '')}"
                     + (f" ERROR {e['error'][:80]}" if "error" in e else ""))
    for k in ("fp8_floor_us", "dense_ceiling_us", "ours_fraction_of_dense",
              "ours_speedup_vs_best_fp8_peer", "best_fp8_peer", "best_ours_config"):
        if k in r:
            parts.append(f"  {k}: {r[k]}")
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
