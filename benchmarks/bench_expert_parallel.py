"""Benchmark: the expert-parallel MoE layer (dispatch, expert GEMMs, combine) across W ranks.

The shape is DeepSeek-V3's MoE layer: H=7168, I=2048, top-8 of E=256 routed experts, one shared
expert (I=2048), split over W ranks (E/W experts each), tokens 128..16384 *per rank*, uniform
random routing. For each token count every rank times, after warm-up, with CUDA events (or the
wall clock on CPUs), the median of --iters calls of:

    route      the router (logits + top-k), all E experts
    dispatch   tokens to the ranks holding their experts (all-to-all, counts exchanged first)
    shared     the shared expert on the rank's own tokens
    experts    the grouped GEMMs over the local experts on the received tokens
    combine    partial outputs back and summed per token (all-to-all)
    total      the whole forward, where the shared expert runs while the tokens are in flight

Each phase is reported as the slowest rank's time. overlap = (route + dispatch + shared +
experts + combine - total) / min(dispatch, shared): the fraction of the shorter of dispatch
and shared-expert time that the forward hid behind the other (0 = serial, 1 = fully hidden).
baseline = the same layer on one device with E/W experts and the same tokens per device (the
compute a rank does, with no communication); comm_overhead = total / baseline.

    torchrun --nproc-per-node 8 benchmarks/bench_expert_parallel.py --out ep_h100x8.json
    python benchmarks/bench_expert_parallel.py --world 2 --out ep_h100x2.json   # spawns W
    python benchmarks/bench_expert_parallel.py --smoke --world 2                # CPU, gloo

The JSON (--out, written by rank 0) holds "device", "date", "world_size", the versions, the
settings, per-token-count rows and an accuracy check of the expert-parallel output against
the whole layer on one device (at the smallest token count; skipped with --no-check).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import moe_gemm  # noqa: E402
from benchmarks.report import out_argument  # noqa: E402
from benchmarks.runner import (  # noqa: E402
    counts_problem,
    given_options,
    number_problem,
    split_names,
)
from moe_gemm.layers.dispatch import AllToAllDispatcher, expert_range  # noqa: E402
from moe_gemm.layers.expert_parallel import ExpertParallelMoE  # noqa: E402
from moe_gemm.layers.moe import MoE  # noqa: E402
from moe_gemm.testing import calc_diff  # noqa: E402
from moe_gemm.tuning.table_io import dumps_by_line, write_json  # noqa: E402

DEFAULT_TOKENS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
SMOKE = {"hidden": 64, "intermediate": 32, "experts": 16, "top_k": 4, "shared": 32,
         "tokens": [8, 32], "iters": 3, "warmup": 1}


def _init_weights(moe: MoE, seed: int) -> None:
    """randn / sqrt(fan_in), generated on the device (E=256 in bf16 is 22 GB: no host copy)."""
    gen = torch.Generator(device=moe.gate_up_proj.device).manual_seed(seed)
    for p in moe.parameters():
        p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)
                / math.sqrt(p.shape[-1]))


def _router(H: int, E: int, k: int, device: torch.device, seed: int) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return {"router_weight": torch.randn(E, H, generator=gen, device=device) / math.sqrt(H),
            "e_score_correction_bias": None, "top_k": k, "scoring": "softmax",
            "renormalize": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
            "router_fp32": True}


class Timer:
    """Median time of a callable: CUDA events on GPUs, perf_counter on CPUs."""

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            dist.barrier()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


def _slowest(us: float, device: torch.device) -> float:
    t = torch.tensor([us], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    rank, W = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available() and not args.cpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    H, I, E, k, Is = args.hidden, args.intermediate, args.experts, args.top_k, args.shared
    start, end = expert_range(E, rank, W)
    with torch.no_grad():
        local = MoE(H, I, end - start, 1, shared_intermediate_size=Is, device=device,
                    dtype=dtype)
        _init_weights(local, args.seed + 1 + rank)
        if local.shared_experts is not None:  # replicated: the same on every rank
            for i, p in enumerate(local.shared_experts.parameters()):
                gen = torch.Generator(device=device).manual_seed(args.seed + 1000 + i)
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=dtype)
                        / math.sqrt(p.shape[-1]))
    router = _router(H, E, k, device, args.seed)
    disp = AllToAllDispatcher(static_splits=args.static_splits)
    ep = ExpertParallelMoE(local, router, E, dispatcher=disp)
    # Baseline: one device, E/W experts, same tokens and top-k (capped at E/W): the compute
    # one rank does, without any communication.
    base = MoE(H, I, end - start, min(k, end - start), shared_intermediate_size=Is,
               device=device, dtype=dtype)
    base.load_state_dict(local.state_dict(), strict=False)
    timer = Timer(device, args.iters, args.warmup)
    rows = []
    check = None
    for T in args.tokens:
        gen = torch.Generator(device=device).manual_seed(args.seed + 7 * T + rank)
        x = torch.randn(T, H, generator=gen, device=device, dtype=dtype)
        with torch.no_grad():
            weights, ids = ep.route(x)
            d, _ = disp.dispatch(x, ids, weights, E)
            part = ep.experts(d)
            t = {
                "route": timer(lambda: ep.route(x)),
                "dispatch": timer(lambda: disp.dispatch(x, ids, weights, E)),
                "shared": timer(lambda: ep.shared(x)),
                "experts": timer(lambda: ep.experts(d)),
                "combine": timer(lambda: disp.combine(part, d.handle)),
                "total": timer(lambda: ep(x)),
                "baseline": timer(lambda: base(x)),
            }
        t = {name: _slowest(us, device) for name, us in t.items()}
        parts = t["route"] + t["dispatch"] + t["shared"] + t["experts"] + t["combine"]
        hideable = min(t["dispatch"], t["shared"]) if Is else 0.0
        recv = torch.tensor([d.x.shape[0]], device=device, dtype=torch.float64)
        dist.all_reduce(recv, op=dist.ReduceOp.MAX)
        rows.append({
            "tokens_per_rank": T,
            **{f"{name}_us": round(us, 2) for name, us in t.items()},
            "overlap": round(max(0.0, min(1.0, (parts - t["total"]) / hideable)), 3)
            if hideable > 0 else None,
            "comm_overhead": round(t["total"] / t["baseline"], 3),
            "max_received_tokens": int(recv.item()),
            "tflops_per_rank": round(2 * T * k * 3 * H * I / t["experts"] / 1e6, 2),
        })
        if rank == 0:
            r = rows[-1]
            print(f"T={T:6d}/rank  route {r['route_us']:9.1f}  dispatch {r['dispatch_us']:9.1f}"
                  f"  experts {r['experts_us']:9.1f}  combine {r['combine_us']:9.1f}  total "
                  f"{r['total_us']:9.1f} us  baseline {r['baseline_us']:9.1f}  overlap "
                  f"{r['overlap']}", flush=True)
        if check is None and args.check:
            check = _check(ep, x, router, local, args, device, dtype)
    if rank != 0:
        return None
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {
        "benchmark": "expert_parallel_moe",
        "device": props.name if props else f"cpu ({platform.processor() or platform.machine()})",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": W,
        "dist_backend": dist.get_backend(),
        "torch": torch.__version__,
        "moe_gemm": moe_gemm.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {"hidden": H, "intermediate": I, "experts": E, "top_k": k,
                  "shared_intermediate": Is, "experts_per_rank": E // W},
        "static_splits": args.static_splits,
        "iters": args.iters,
        "rows": rows,
        "check": check,
    }


def _check(ep: ExpertParallelMoE, x: torch.Tensor, router: dict[str, Any], local: MoE,
           args: argparse.Namespace, device: torch.device, dtype: torch.dtype
           ) -> dict[str, Any]:
    """The EP output against the whole layer on every rank (all experts gathered)."""
    W = dist.get_world_size()
    gu = [torch.empty_like(local.gate_up_proj) for _ in range(W)]
    dn = [torch.empty_like(local.down_proj) for _ in range(W)]
    dist.all_gather(gu, local.gate_up_proj.data.contiguous())
    dist.all_gather(dn, local.down_proj.data.contiguous())
    shared = None
    if local.shared_experts is not None:
        shared = {n: getattr(local.shared_experts, n).weight
                  for n in ("gate_proj", "up_proj", "down_proj")}
    full = MoE.from_fused(torch.cat(gu), torch.cat(dn), router["router_weight"].to(dtype),
                          router["top_k"], shared=shared, router_fp32=True)
    full.router_weight.data = router["router_weight"]
    with torch.no_grad():
        got, want = ep(x), full(x)
    diff = torch.tensor([calc_diff(got, want)], dtype=torch.float64, device=device)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {"tokens_per_rank": x.shape[0], "max_calc_diff": float(diff.item()),
            "ok": bool(diff.item() < (1e-4 if dtype != torch.float32 else 1e-8))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    _main_rank(args)


def _main_rank(args: argparse.Namespace) -> None:
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    try:
        result = run_rank(args)
        if result is not None:
            if args.out:
                write_json(Path(args.out), result)
                print(f"wrote {args.out}")
            else:
                print(dumps_by_line(result), end="")
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=None,
                   help="spawn this many ranks (default: launched by torchrun, else all GPUs)")
    p.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default "
                   "128..16384; --smoke: 8,32)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--shared", type=int, default=2048, help="shared expert size (0 = none)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static-splits", action="store_true",
                   help="fixed-size all-to-all (no host read of the counts)")
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--cpu", action="store_true", help="gloo on CPUs even where GPUs exist")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPUs (a quick check; a size "
                   "given beside it stands)")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", type=out_argument, help="write the JSON here (rank 0)")
    args = p.parse_args(argv)
    # Checked before --smoke replaces the sizes, and before any rank starts: a bad size was a
    # traceback in every rank (0 tokens ran as a case), --world 0 meant "the default" and
    # --timeout-s nan a traceback from the process group.
    if why := _arg_problem(args):
        p.error(why)
    if args.tokens is not None:
        args.tokens = [int(t) for t in split_names(args.tokens)]
    args.preset = set()  # the sizes --smoke filled in (an explicit one beside it stands)
    if args.smoke:
        args.cpu = True
        args.preset = set(SMOKE) - given_options(p, argv)
        for name in args.preset:
            setattr(args, name, SMOKE[name])
    if args.tokens is None:
        args.tokens = DEFAULT_TOKENS
    if args.world is not None and (why := _split_problem(args, args.world)):
        p.error(why)
    return args


def _arg_problem(args: argparse.Namespace) -> str | None:
    """Why the sizes and counts cannot make a run, or None."""
    for option in ("hidden", "intermediate", "experts", "top_k", "iters", "world"):
        value = getattr(args, option)
        if value is not None and (why := number_problem(value, "--" + option.replace("_", "-"))):
            return why
    for option in ("shared", "warmup"):  # (--shared 0: no shared expert)
        if why := number_problem(getattr(args, option), f"--{option}", zero=True):
            return why
    if why := number_problem(args.timeout_s, "--timeout-s"):
        return why
    return counts_problem(args.tokens) if args.tokens is not None else None


def _split_problem(args: argparse.Namespace, world: int) -> str | None:
    """Why `world` ranks cannot split the layer (its experts evenly, top-k of them), or None:
    each rank raised a ValueError traceback of its own."""
    smoke = " (--smoke's)" * ("experts" in getattr(args, "preset", ()))
    if args.top_k > args.experts:
        return f"--top-k {args.top_k} is more than --experts {args.experts}{smoke}"
    if args.experts % world:
        return f"--experts {args.experts}{smoke} does not split evenly over {world} ranks"
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world or (
        torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu else 2)
    if world < 1:
        raise SystemExit("--world must be >= 1")
    if why := _split_problem(args, world):  # (a world parse_args did not know: one line)
        print(f"{Path(sys.argv[0]).name}: error: {why}", file=sys.stderr)
        raise SystemExit(2)
    if torchrun:
        _main_rank(args)
        return
    import torch.multiprocessing as mp

    mp.start_processes(_spawned, args=(world, _free_port(), args), nprocs=world,
                       start_method="spawn")


if __name__ == "__main__":
    main()
