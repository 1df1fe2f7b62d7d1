"""The whole MoE layer forward: the fused layer, our unfused layer, transformers' default
grouped_mm experts and SonicMoE, on four real models' layer shapes and 1 to 16k tokens.

    python -m benchmarks.bench_moe_layer --out moe-layer.json     # ~5 min on an H100
    python -m benchmarks.bench_moe_layer --smoke --out smoke.json # CPU: the script works

Models (one layer each, bf16, random weights of transformers' layouts):
- deepseek-v3-ep8: one rank of 8-way expert parallelism: 32 local experts, H=7168, I=2048,
  top-8 (sigmoid, group-limited, every slot local) and the shared expert (I=2048);
- qwen3-30b-a3b: 128 experts, H=2048, I=768, top-8 softmax, renormalised;
- gpt-oss-120b: 128 experts, H=2880, I=2880, top-4, biases, clamped SwiGLU over alternating
  gate/up columns (transformers' GptOssMLP: its router, then the experts implementation);
- mixtral-8x7b: 8 experts, H=4096, I=14336, top-2.

Implementations (impl names): "moe_gemm fused" (MoE.from_hf(block), or the "moe_gemm" experts of
GPT-OSS, on the fused kernel: the layer's default on Hopper), "moe_gemm unfused" (the same with
fused=False: two grouped_mm launches and torch ops between them), "transformers grouped_mm" (the
block itself with transformers' default experts implementation) and "sonicmoe" (sonicmoe.MoE of
the same H, I, E, k with its own top-k softmax router and plain SwiGLU, without DeepSeek's
shared expert; where the package imports and runs: what happened is recorded either way); on
DeepSeek-V3 also "moe_gemm fused, routed experts only" (the fused layer without its shared
expert: SonicMoE's scope). sonic-moe 0.1.2 runs on DSL 4.8.1 with quack-kernels 0.6.0 ahead of a
newer QuACK on the path (`pip install --no-deps --target DIR quack-kernels==0.6.0 sonic-moe`,
then PYTHONPATH=DIR); with QuACK 0.6.4 or 0.6.5 its forward raises a TypeError about a
ContextVar in its epilogue.

Before timing, a child process runs one fused forward per model against the unfused layer
(a fault there cannot poison the timed process); should it fail, the run goes on without the
in-kernel gather, or without the fused rows, and the JSON says so ("fused_probe").

Timing: each implementation as a CUDA-graph replay where it captures (eager otherwise; the row
says which), after warm-up, batches of calls timed by CUDA events, implementations interleaved
round by round (each round in a seeded shuffled order, each batch right after half a batch of
the same implementation, untimed), the median batch per call. Kernels are compiled before
timing, in parallel (every variant the fused and unfused layers will launch, from the library's
own choice). The JSON keeps device, date, versions, per-row times with the speedup over the
unfused layer (of the medians; and `speedup_vs_unfused_rounds`, the ratio within each round:
its median, 10th and 90th percentile, which the power state's drift between runs moves less),
and per model each implementation's worst agreement (calc_diff) with the unfused
layer over the timed token counts.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import moe_gemm  # noqa: E402
from benchmarks.clock import quantile  # noqa: E402
from benchmarks.report import write_json  # noqa: E402
from benchmarks.runner import (  # noqa: E402
    counts_problem,
    names_problem,
    number_problem,
    split_names,
)
from moe_gemm.layers.fused_experts import GATHER_ENV  # noqa: E402
from moe_gemm.layers.shared_stream import SHARED_STREAM_ENV  # noqa: E402
from moe_gemm.ops.combine import COMBINE_ENV  # noqa: E402
from moe_gemm.ops.fused_launch import (  # noqa: E402
    FAST_GATE_ENV,
    GATHER_FENCE_ENV,
    GATHER_WIDE_ENV,
)
from moe_gemm.ops.router_topk import ROUTER_ENV  # noqa: E402
from moe_gemm.ops.swap_rules import SWAP_AB_ENV  # noqa: E402
from moe_gemm.ops.token_gather import TOKEN_GATHER_ENV  # noqa: E402
from moe_gemm.testing import calc_diff  # noqa: E402
from moe_gemm.tuning.table_io import json_line  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    "deepseek-v3-ep8": dict(kind="deepseek", H=7168, I=2048, E=32, k=8),
    "qwen3-30b-a3b": dict(kind="qwen3", H=2048, I=768, E=128, k=8),
    "gpt-oss-120b": dict(kind="gpt-oss", H=2880, I=2880, E=128, k=4),
    "mixtral-8x7b": dict(kind="mixtral", H=4096, I=14336, E=8, k=2),
}
SMOKE_MODELS = {name: dict(m, H=64, I=32, E=16, k=min(m["k"], 4)) for name, m in MODELS.items()}
TOKENS = [1, 16, 128, 1024, 4096, 16384]
FUSED, UNFUSED, HF, SONIC = ("moe_gemm fused", "moe_gemm unfused", "transformers grouped_mm",
                             "sonicmoe")
FUSED_COMBINE = "moe_gemm fused, embedding_bag combine"  # --combine-torch
FUSED_ROUTER = "moe_gemm fused, torch router"  # --router-torch
FUSED_WIDE = "moe_gemm fused, wide gather"  # --gather-wide
FUSED_WIDE_NOFENCE = "moe_gemm fused, wide gather, no fence"  # --gather-wide-nofence
# The fused layer once more, unchanged, under a second name (--control): what the harness gives
# one thing timed twice (an H200 ran one kernel 1.025-1.040x faster under one name than under
# another, 2026-12-04), the margin a switch's row must clear.
FUSED_CONTROL = "moe_gemm fused, control"
FUSED_IEEE_GATE = "moe_gemm fused, IEEE gate"  # --ieee-gate
FUSED_SELECT = "moe_gemm fused, index_select"  # --index-select
FUSED_TORCH_GATHER = "moe_gemm fused, torch token gather"  # --token-gather-torch
FUSED_NOSWAP = "moe_gemm fused, no swapped tiles"  # --no-swap
FUSED_SHARED_STREAM = "moe_gemm fused, shared expert after the routed"  # --shared-after
# DeepSeek-V3's fused layer without its shared expert: the scope of SonicMoE's row (which has
# none), so that the two compare like for like.
FUSED_ROUTED = "moe_gemm fused, routed experts only"
# The fused layer again under library switches, beside the default: impl name -> (option,
# {variable: value}, what the option adds).
SWITCHED = {
    FUSED_COMBINE: ("combine_torch", {COMBINE_ENV: "torch"},
                    "with embedding_bag as the top-k combine"),
    FUSED_ROUTER: ("router_torch", {ROUTER_ENV: "torch"}, "with the routers' torch ops"),
    FUSED_IEEE_GATE: ("ieee_gate", {FAST_GATE_ENV: "0"},
                      "with the IEEE sigmoid in the gated epilogue"),
    FUSED_SELECT: ("index_select", {GATHER_ENV: "0"},
                   "with the tokens gathered by index_select (the in-kernel gather off)"),
    FUSED_TORCH_GATHER: ("token_gather_torch", {TOKEN_GATHER_ENV: "torch"},
                         "with the plan's token gather as torch's index_select (not our "
                         "kernel)"),
    FUSED_SHARED_STREAM: ("shared_after", {SHARED_STREAM_ENV: "0"},
                          "with the shared expert after the routed experts on one stream (the "
                          "default: on a second stream beside them; DeepSeek-V3, the other "
                          "models have none)"),
    FUSED_NOSWAP: ("no_swap", {SWAP_AB_ENV: "0"},
                   "without swapped tiles (the fused kernels' M-side tiles at every size)"),
    FUSED_WIDE: ("gather_wide", {GATHER_WIDE_ENV: "1"},
                 "with the in-kernel gather at every size, on every tile below the heavy "
                 "accumulators"),
    FUSED_WIDE_NOFENCE: ("gather_wide_nofence", {GATHER_WIDE_ENV: "1", GATHER_FENCE_ENV: "0"},
                         "with the in-kernel gather at every size (as --gather-wide) and no "
                         "proxy fence before the WGMMAs read a gathered stage"),
    FUSED_CONTROL: ("control", {}, "once more, unchanged (an A/A control: its ratio to the "
                                   "default row is the run's own margin)"),
}
PROBE_TOKENS = 256
PROBE_MAX_DIFF = 1e-3  # calc_diff of the fused against the unfused layer (bf16: ~1e-5)


# ---------------------------------------------------------------------------------------------
# Models


def hf_block(kind: str, H: int, I: int, E: int, k: int, device: torch.device,
             dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The transformers block of a model kind, built on `meta` and materialized on the device
    in `dtype` with randn / sqrt(fan_in) weights (never a full fp32 copy)."""
    import transformers as tf

    if kind == "deepseek":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as cls
        cfg = tf.DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                                  num_experts_per_tok=k, n_group=8, topk_group=4,
                                  n_shared_experts=1, routed_scaling_factor=2.5)
    elif kind == "qwen3":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock as cls,
        )
        cfg = tf.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                num_experts_per_tok=k, norm_topk_prob=True)
    elif kind == "gpt-oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as cls
        cfg = tf.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                              num_experts_per_tok=k)
    else:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as cls
        cfg = tf.MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                               num_experts_per_tok=k)
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        block = cls(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in block.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            fan_in = p.shape[-1] if p.dim() > 1 else H
            if kind == "gpt-oss" and name in ("gate_up_proj", "down_proj"):
                fan_in = p.shape[-2]  # (E, K, N): K is the contraction
            t = torch.randn(tuple(p.shape), device=device, generator=gen) / fan_in ** 0.5
            setattr(module, name, torch.nn.Parameter(t.to(dtype), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.zeros(b.shape, device=device, dtype=b.dtype))
    return block.eval()


def experts_of(block: torch.nn.Module) -> torch.nn.Module:
    return block.experts


def ours(kind: str, block: torch.nn.Module, fused: bool | None) -> Callable:
    """Our layer over the block's weights: MoE.from_hf, or GPT-OSS's block with the moe_gemm
    experts implementation (its router and biases are transformers')."""
    from moe_gemm.integrations import register_transformers
    from moe_gemm.layers.moe import MoE

    register_transformers()
    if kind == "gpt-oss":
        def run(x: torch.Tensor) -> torch.Tensor:
            experts = block.experts
            experts.config._experts_implementation = "moe_gemm"
            experts.moe_gemm_fused = fused
            return block(x)[0]

        return run
    moe = MoE.from_hf(block)
    moe.fused = fused
    return moe


def routed_only(moe: torch.nn.Module) -> Callable:
    """The layer without its shared expert during each call (the same module and weights)."""
    def run(x: torch.Tensor) -> torch.Tensor:
        shared, moe.shared_experts = moe.shared_experts, None
        try:
            return moe(x)
        finally:
            moe.shared_experts = shared

    return run


def with_env(fn: Callable, env: dict[str, str]) -> Callable:
    """fn with the environment variables of `env` set during each call (and so during a
    CUDA-graph capture of it)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        old = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            return fn(*args, **kwargs)
        finally:
            for name, value in old.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    return run


def transformers_layer(kind: str, block: torch.nn.Module) -> Callable:
    def run(x: torch.Tensor) -> torch.Tensor:
        block.experts.config._experts_implementation = "grouped_mm"
        y = block(x)
        return y[0] if isinstance(y, tuple) else y

    return run


def sonic_layer(m: dict, device: torch.device, dtype: torch.dtype) -> Callable:
    """SonicMoE's MoE module of the same shape (raises what importing or building raises)."""
    import sonicmoe
    from sonicmoe.enums import ActivationType

    layer = sonicmoe.MoE(num_experts=m["E"], num_experts_per_tok=m["k"], hidden_size=m["H"],
                         intermediate_size=m["I"], activation_function=ActivationType.SWIGLU,
                         add_bias=m["kind"] == "gpt-oss", std=0.02).to(device, dtype).eval()

    def run(x: torch.Tensor) -> torch.Tensor:
        return layer(x.reshape(-1, x.shape[-1]),
                     kernel_backend_moe=sonicmoe.KernelBackendMoE.sonicmoe,
                     is_inference_mode=True)[0]

    return run


# ---------------------------------------------------------------------------------------------
# Kernels: compiled in parallel before timing


def kernel_keys(m: dict, tokens: list[int], device: torch.device) -> set:
    """Every CompileKey the fused and unfused layers launch for these token counts (the
    library's own choices for this device, tuned tables included)."""
    from moe_gemm.capability import sm_count
    from moe_gemm.config import GemmConfig
    from moe_gemm.ops import launch_kernel
    from moe_gemm.ops.fused_launch import fused_choice, fused_key
    from moe_gemm.ops.fused_validation import check_fused_mm
    from moe_gemm.ops.heuristics import choose_varlen

    H, I, E, k = m["H"], m["I"], m["E"], m["k"]
    gpt = m["kind"] == "gpt-oss"
    nsm = sm_count(device) if device.type == "cuda" else 132  # (CPU: an H100's, for tests)
    cfg, meta = GemmConfig(), torch.device("meta")
    table = launch_kernel._table_device(device)
    bf16 = torch.bfloat16
    keys = set()
    for T in tokens:
        S = T * k
        for N, K in ((2 * I, H), (H, I)):  # gate-up, down: unfused grouped_mm
            choice = choose_varlen(cfg, S, E, N, K, nsm, 2, device=table)
            keys.add(launch_kernel._compile_key("varlen", bf16, bf16, "n" if gpt else "k",
                                                choice, False))
        w1 = (torch.empty(E, H, 2 * I, dtype=bf16, device=meta) if gpt
              else torch.empty(E, 2 * I, H, dtype=bf16, device=meta).transpose(1, 2))
        w2 = (torch.empty(E, I, H, dtype=bf16, device=meta) if gpt
              else torch.empty(E, H, I, dtype=bf16, device=meta).transpose(1, 2))
        offs = torch.empty(E, dtype=torch.int32, device=meta)
        up = check_fused_mm(torch.empty(T, H, dtype=bf16, device=meta), w1, offs,
                            row_index=torch.empty(S, dtype=torch.int32, device=meta),
                            bias=torch.empty(E, 2 * I, device=meta) if gpt else None,
                            gate="clamped_swiglu" if gpt else "silu",
                            gate_layout="alternating" if gpt else "concat", concrete=False)
        down = check_fused_mm(torch.empty(S, I, dtype=bf16, device=meta), w2, offs,
                              bias=torch.empty(E, H, device=meta) if gpt else None,
                              row_weight=torch.empty(S, device=meta), concrete=False)
        for args, major in ((up, "n" if gpt else "k"), (down, "n" if gpt else "k")):
            choice, in_kernel = fused_choice(args, cfg, nsm, device)
            keys.add(fused_key(args, choice, major, in_kernel))
    return keys


def precompile(keys: set, jobs: int, timeout: float) -> dict:
    # Imported by name from a path entry: the spawned workers import the same module to find
    # its worker function (a module loaded from a file location has no importable name).
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import precompile as module

    return module.compile_all(sorted(keys, key=lambda k: k.name()), jobs, timeout)


# ---------------------------------------------------------------------------------------------
# Timing


class Timed:
    """One implementation's forward on a fixed input: a CUDA-graph replay where it captures."""

    def __init__(self, fn: Callable, x: torch.Tensor, graph: bool):
        self.fn, self.x, self.graph, self.mode = fn, x, None, "eager"
        with torch.inference_mode():
            for _ in range(2):
                self.y = fn(x)
            if graph and x.device.type == "cuda":
                try:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        fn(x)
                    torch.cuda.current_stream().wait_stream(side)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        self.y = fn(x)
                    g.replay()
                    torch.cuda.synchronize()
                    self.graph, self.mode = g, "graph"
                except Exception:  # noqa: BLE001 - not capturable: timed eagerly
                    torch.cuda.synchronize()
                    self.graph = None

    def call(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self.fn(self.x)


PROFILE_TOP = 8  # kernels kept per implementation by --profile


def kernel_breakdown(t: Timed, device: torch.device, calls: int = 3) -> dict[str, Any]:
    """Where one implementation's time goes (--profile): its kernels over `calls` of what is
    timed (the CUDA-graph replay where it captured, else eager forwards; torch.profiler; CPU
    ops on a CPU): the sum over every kernel per forward ('kernel_ms') and the PROFILE_TOP
    kernels, most time first: name, ms and launches per forward."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with torch.inference_mode(), profile(
            activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            t.call()
        if cuda:
            torch.cuda.synchronize()

    def spent(e) -> float:  # us over all calls
        return e.device_time_total if cuda else e.self_cpu_time_total

    events = sorted((e for e in prof.key_averages() if spent(e) > 0), key=spent, reverse=True)
    return {"mode": t.mode, "kernel_ms": round(sum(map(spent, events)) / calls / 1e3, 4),
            "top": [{"kernel": e.key[:120], "ms": round(spent(e) / calls / 1e3, 4),
                     "launches": e.count / calls} for e in events[:PROFILE_TOP]]}


def time_calls(fn: Callable[[], Any], calls: int, device: torch.device) -> float:
    """Milliseconds per call over one batch of `calls` calls of fn (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


def time_batch(t: Timed, calls: int, device: torch.device) -> float:
    """Milliseconds per call over one batch of `calls` of an implementation."""
    return time_calls(t.call, calls, device)


def round_order(items, r: int, seed: int = 0) -> list:
    """Round r's order of an interleaved timing: a seeded shuffle, so that no implementation is
    always first and none always follows the same one. On an H200 a 20 ms layer timed right
    after a lighter one (transformers' elementwise-bound experts) ran up to 7% faster than
    after a heavier one (DeepSeek-V3 EP8 at 16384 tokens, the power cap's clocks); a fixed
    cyclic order (each round rotated by one) kept every implementation behind the same one."""
    items = list(items)
    random.Random(seed * 1_000_003 + r).shuffle(items)
    return items


def warm_calls(calls: int) -> int:
    """Untimed calls run right before each timed batch (half a batch): each batch starts in the
    clock state its own implementation sets, not the previous one's."""
    return max(1, calls // 2)


def measure(timed: dict[str, Timed], device: torch.device, rounds: int,
            target_ms: float, order_seed: int = 0) -> dict[str, float]:
    """Median ms per call of each implementation (measure_rounds)."""
    samples = measure_rounds(timed, device, rounds, target_ms, order_seed)
    return {name: statistics.median(v) for name, v in samples.items()}


def measure_rounds(timed: dict[str, Timed], device: torch.device, rounds: int,
                   target_ms: float, order_seed: int = 0) -> dict[str, list[float]]:
    """Each implementation's ms per call in every round, interleaved round by round
    (round_order, shuffled from order_seed), each batch behind its own warm-up (warm_calls)."""
    first = {name: time_batch(t, 1, device) for name, t in timed.items()}
    calls = {name: max(2, min(200, int(target_ms / max(ms, 1e-3)))) for name, ms in first.items()}
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for r in range(rounds):
        for name in round_order(timed, r, order_seed):
            time_batch(timed[name], warm_calls(calls[name]), device)
            samples[name].append(time_batch(timed[name], calls[name], device))
    return samples


def paired_speedups(base: list[float], ms: list[float]) -> dict[str, float]:
    """The speed-up over the base implementation round by round (base over ms of the same
    round), as median, 10th and 90th percentile: a layer's time drifts with the GPU's power
    state between runs (DeepSeek-V3 EP8 at 4096 tokens, H100, 2026-12-05: 0.96x in one run,
    1.03x in the next, the same kernels), and a ratio inside one round sees both sides in the
    same state."""
    ratios = [b / m for b, m in zip(base, ms) if m > 0]
    if not ratios:
        return {}
    return {"median": round(statistics.median(ratios), 3),
            "p10": round(quantile(ratios, 0.1), 3), "p90": round(quantile(ratios, 0.9), 3)}


def layer_flops(m: dict, T: int) -> float:
    """Routed expert GEMMs (and DeepSeek's shared expert) in FLOP."""
    H, I, k = m["H"], m["I"], m["k"]
    routed = 2 * T * k * (H * 2 * I + I * H)
    return routed + (2 * T * 3 * H * I if m["kind"] == "deepseek" else 0)


# ---------------------------------------------------------------------------------------------
# The run


def run(args: argparse.Namespace) -> dict:
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    models = SMOKE_MODELS if smoke else MODELS
    names = args.models.split(",") if args.models else list(models)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (
        [1, 5] if smoke else TOKENS)
    result: dict[str, Any] = {
        "suite": "moe-layer",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "versions": {"moe_gemm": moe_gemm.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "dtype": str(dtype).removeprefix("torch."),
        "timing": "CUDA-graph replays where they capture (row 'mode'), interleaved rounds, "
                  "median ms per call; speedup_vs_unfused_rounds: the ratio within each round "
                  "(median, p10, p90)",
        "order_seed": args.order_seed,
        "models": {n: models[n] for n in names},
        "rows": [],
        "accuracy": {},
        "sonicmoe": {"status": "not tried"},
        "precompile": None,
    }
    try:
        import transformers  # noqa: F401
    except ImportError:
        result["error"] = "transformers is not installed: the layers are its blocks"
        return result
    if not smoke:
        keys = set()
        for n in names:
            keys |= kernel_keys(models[n], tokens, device)
            for option, env, _ in SWITCHED.values():  # (a switch may change kernels)
                if getattr(args, option):
                    keys |= with_env(kernel_keys, env)(models[n], tokens, device)
        result["precompile"] = precompile(keys, args.jobs, args.compile_timeout)
    impl_names = [FUSED, UNFUSED, HF]
    if not smoke:
        result["fused_probe"] = probe_in_subprocess(names, args.probe_timeout)
        if not result["fused_probe"]["ok"]:
            impl_names.remove(FUSED)
        elif result["fused_probe"].get("gather") is False:
            os.environ[GATHER_ENV] = "0"  # the fused path without the in-kernel gather
    sonic_ok = not smoke and not args.no_sonic
    if sonic_ok:
        result["sonicmoe"] = {"status": "trying"}
    started = time.monotonic()
    sonic_spent = 0.0
    for n in names:
        m = models[n]
        block = hf_block(m["kind"], m["H"], m["I"], m["E"], m["k"], device, dtype, seed=1)
        impls: dict[str, Callable] = {
            FUSED: ours(m["kind"], block, True if smoke else None),
            UNFUSED: ours(m["kind"], block, False),
            HF: transformers_layer(m["kind"], block),
        }
        for impl, (option, env, _) in SWITCHED.items():
            if getattr(args, option) and FUSED in impl_names:
                # The fused layer itself under the switch: the same weights in the same memory
                # (two copies measured up to 8% apart on DeepSeek-V3 EP8 on an H200, whichever
                # switch each had).
                impls[impl] = with_env(impls[FUSED], env)
        if m["kind"] == "deepseek" and FUSED in impl_names:
            impls[FUSED_ROUTED] = routed_only(impls[FUSED])
        impls = {name: fn for name, fn in impls.items()
                 if name in impl_names or name in SWITCHED or name == FUSED_ROUTED}
        if sonic_ok:
            try:
                impls[SONIC] = sonic_layer(m, device, dtype)
            except Exception as exc:  # noqa: BLE001 - recorded
                result["sonicmoe"] = {"status": "failed to build", "error": _error(exc)}
                sonic_ok = False
        for T in tokens:
            if time.monotonic() - started > args.budget_s:
                result["stopped"] = f"time budget of {args.budget_s} s reached"
                break
            gen = torch.Generator(device=device).manual_seed(T)
            # (1, T, H): transformers' blocks take (batch, sequence, hidden)
            x = torch.randn(1, T, m["H"], device=device, generator=gen).to(dtype)
            timed: dict[str, Timed] = {}
            for name, fn in list(impls.items()):
                t0 = time.monotonic()
                try:
                    timed[name] = Timed(fn, x, graph=not smoke)
                except Exception as exc:  # noqa: BLE001 - a peer that fails is recorded
                    if name != SONIC:
                        raise
                    result["sonicmoe"] = {"status": "forward failed", "model": n, "tokens": T,
                                          "error": _error(exc)}
                    impls.pop(SONIC)
                    sonic_ok = False
                if name == SONIC:
                    # Its kernels compile on first use (QuACK's JIT): bounded apart.
                    sonic_spent += time.monotonic() - t0
                    if sonic_spent > args.sonic_budget_s and SONIC in impls:
                        impls.pop(SONIC)
                        sonic_ok = False
                        result["sonicmoe"]["stopped"] = (
                            f"after {sonic_spent:.0f} s of first calls (its compiles), past "
                            f"--sonic-budget-s; later rows have no sonicmoe")
            # The worst agreement over the timed token counts (each row's first output).
            worst = result["accuracy"].setdefault(n, {})
            for name, diff in _agreement(timed).items():
                old = worst.get(name, 0.0)
                worst[name] = diff if math.isnan(diff) or diff > old else old  # (NaN sticks)
            samples = measure_rounds(timed, device, args.rounds, args.target_ms,
                                     args.order_seed)
            ms = {name: statistics.median(v) for name, v in samples.items()}
            base = ms[UNFUSED]
            for name, t in timed.items():
                row = {"model": n, "tokens": T, "impl": name, "ms": round(ms[name], 4),
                       "mode": t.mode, "speedup_vs_unfused": round(base / ms[name], 3),
                       "speedup_vs_unfused_rounds": paired_speedups(samples[UNFUSED],
                                                                    samples[name]),
                       "tflops": round(layer_flops(m, T) / ms[name] / 1e9, 2)}
                result["rows"].append(row)
                paired = row["speedup_vs_unfused_rounds"]
                spread = f" (rounds {paired['p10']:.2f}-{paired['p90']:.2f})" if paired else ""
                print(f"{n:16s} T={T:6d} {name:24s} {ms[name]:9.4f} ms  x{row['speedup_vs_unfused']:.2f} "
                      f"vs unfused{spread}  [{t.mode}]", flush=True)
            if args.profile:
                kept = result.setdefault("profile", {}).setdefault(n, {})[str(T)] = {}
                for name, t in timed.items():
                    kept[name] = spent = kernel_breakdown(t, device)
                    print(f"{'':16s}   {name:24s} kernels {spent['kernel_ms']:.3f} ms: " + ", ".join(
                        f"{k['kernel'][:40]} {k['ms']:.3f}" for k in spent["top"][:3]), flush=True)
            if SONIC in timed and result["sonicmoe"].get("status") == "trying":
                result["sonicmoe"]["status"] = "ran"
            del timed, x
            gc.collect()
        del impls, block
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------
# The probe: one fused forward per model in a child process before anything is timed, so a
# fault in a kernel costs the child, not the run (a CUDA fault poisons its process).


def probe(names: list[str]) -> dict:
    """In the child: each model's fused layer against the unfused one at PROBE_TOKENS."""
    device, out = torch.device("cuda"), {}
    for n in names:
        m = MODELS[n]
        block = hf_block(m["kind"], m["H"], m["I"], m["E"], m["k"], device, torch.bfloat16, 1)
        x = torch.randn(1, PROBE_TOKENS, m["H"], device=device).to(torch.bfloat16)
        with torch.inference_mode():
            fused = ours(m["kind"], block, None)(x).float()
            base = ours(m["kind"], block, False)(x).float()
            torch.cuda.synchronize()
        out[n] = calc_diff(fused, base)
        del block
        torch.cuda.empty_cache()
    return out


def probe_in_subprocess(names: list[str], timeout: float) -> dict:
    """{"ok", "gather", "diffs" | "error"}: the fused path as is, else without the in-kernel
    gather (MOE_GEMM_FUSED_GATHER=0), else not at all."""
    import subprocess

    tried = []
    for gather in (True, False):
        env = dict(os.environ, **({} if gather else {GATHER_ENV: "0"}))
        cmd = [sys.executable, "-m", "benchmarks.bench_moe_layer", "--probe", "--models",
               ",".join(names)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                                  cwd=str(Path(__file__).resolve().parents[1]))
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            diffs = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
            # (A NaN or infinite diff, an output the fused path left unwritten, comes as null.)
            if diffs is not None and all(d is not None and d < PROBE_MAX_DIFF
                                         for d in diffs.values()):
                return {"ok": True, "gather": gather, "diffs": diffs, "tried": tried}
            tried.append({"gather": gather, "rc": proc.returncode, "diffs": diffs,
                          "stderr": proc.stderr[-1500:]})
        except subprocess.TimeoutExpired:
            tried.append({"gather": gather, "error": f"timed out after {timeout:.0f} s"})
    return {"ok": False, "tried": tried}


def _agreement(timed: dict[str, Timed]) -> dict[str, float]:
    """calc_diff of each implementation's output against the unfused layer's (SonicMoE routes
    with its own router and weights, the routed-only row leaves the shared expert out: not
    comparable, left out)."""
    base = timed[UNFUSED].y.float()
    return {name: calc_diff(t.y.float(), base) for name, t in timed.items()
            if name not in (UNFUSED, SONIC, FUSED_ROUTED)}


def _error(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}"[:600] + where


def _arg_problem(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot make a run, or None. An unknown --models name raised KeyError
    and a --tokens typo ValueError (tracebacks), 0 tokens was timed as a case, and an --out
    folder raised IsADirectoryError after the whole run, its results lost."""
    from moe_gemm.tuning.argcheck import output_problem

    if args.models is not None and (why := names_problem(args.models, list(MODELS))):
        return why
    if args.tokens is not None and (why := counts_problem(args.tokens)):
        return why
    if args.rounds < 1:
        return "--rounds must be at least 1"
    if not args.budget_s > 0:  # (a negative one timed nothing and exited 0)
        return f"--budget-s must be > 0; got {args.budget_s}"
    # (--target-ms nan: a traceback after the warm-up)
    for option, value in (("--target-ms", args.target_ms), ("--sonic-budget-s",
                                                             args.sonic_budget_s),
                          ("--probe-timeout", args.probe_timeout)):
        if why := number_problem(value, option):
            return why
    return output_problem(Path(args.out), "--out") if args.out else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--models", help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--tokens", help="comma-separated token counts (default 1..16384)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case")
    p.add_argument("--target-ms", type=float, default=20.0, help="length of a timed batch")
    p.add_argument("--order-seed", type=int, default=0,
                   help="seeds the rounds' shuffled order (a repeated run takes another: what "
                        "precedes a layer moves its time at the power limit)")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop timing past this")
    p.add_argument("--sonic-budget-s", type=float, default=60.0,
                   help="stop trying SonicMoE once its first calls took this long")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile workers")
    p.add_argument("--compile-timeout", type=float, default=300.0)
    p.add_argument("--no-sonic", action="store_true", help="skip SonicMoE")
    p.add_argument("--profile", action="store_true",
                   help=f"also record each implementation's kernel time per forward and its top "
                        f"{PROFILE_TOP} kernels per case, over what is timed (graph replays "
                        "where it captures; torch.profiler; JSON 'profile')")
    for impl, (option, env, what) in SWITCHED.items():
        setting = " ".join(f"{name}={value}" for name, value in env.items()) or "no switch"
        p.add_argument("--" + option.replace("_", "-"), action="store_true",
                       help=f"also time the fused layer {what} ('{impl}', {setting})")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU (fp32, the fused ops' torch backend)")
    p.add_argument("--probe", action="store_true",
                   help="(the child process) one fused forward per model; prints JSON")
    p.add_argument("--probe-timeout", type=float, default=150.0)
    args = p.parse_args(argv)
    if why := _arg_problem(args):  # (before --probe too: an unknown model was a KeyError)
        print(f"bench_moe_layer: {why}", file=sys.stderr)
        return 2
    if (args.probe or not args.smoke) and not torch.cuda.is_available():
        print("bench_moe_layer: no CUDA GPU (use --smoke on the CPU; --probe needs one)",
              file=sys.stderr)
        return 2
    if args.probe:
        print(json_line(probe(split_names(args.models) if args.models else list(MODELS))))
        return 0
    if args.models is not None:  # (' qwen3-30b-a3b' was checked as its stripped name)
        args.models = ",".join(split_names(args.models))
    result = run(args)
    if args.out:
        # (json.dumps wrote a NaN or infinite value as the bare word NaN or Infinity, which
        # strict JSON readers refuse along with the whole file; written as null here)
        write_json(Path(args.out), result)
        print(f"wrote {args.out}")
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
