"""Same config, same process: our varlen kernel against QuACK's, both pinned to one config.

    python -m benchmarks.same_config [--cases MODEL/PROJ/TOKENS,...] [--configs "pp 128x128 c1x2;..."]
        [--reps 12] [--out FILE]

The model zoo compares our default (a tuned table's pick) with QuACK's own pick, so a row we
lose mixes two questions: is our kernel slower than QuACK's at the same tile, cluster and
schedule, or did we pick a worse config? This benchmark answers the first. Per zoo case and
per config (named as `moe-gemm tune` names them: 'pp 128x192 c2x1' is ping-pong, a 128x192
tile, clusters of 2 along M), our grouped_mm with that config and QuACK's varlen GEMM with the
same tile, schedule and cluster (quack.gemm_interface.gemm_tuned.fn with a fixed GemmConfig,
its raster swizzle 8 like our panel 8) run in one process on the same inputs, each output
checked against a float32 reference first, then timed as the zoo times (benchmarks.clock:
back-to-back calls behind a sleep backlog, rounds interleaved, the starting implementation
rotating). Rows carry time, TFLOP/s and, on ours, `vs_quack` = QuACK's time / ours (above 1:
ours faster).

Only configs both kernels build are meaningful: ping-pong 128x{128,160,192,208} and 192x128,
cooperative 256x{128,160,192,208} and 128x{224,256}, clusters 1x1, 1x2 and 2x1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks.clock import Clock, quantile
from benchmarks.runner import device_info
from benchmarks.suite import _quack_gemm
from benchmarks.zoo import build_cases
from moe_gemm.tuning import space

DEFAULT_CASES = ("OLMoE-1B-7B/gate_up/2048", "OLMoE-1B-7B/down/8192",
                 "Qwen3-30B-A3B/down/8192", "GLM-4.5/down/8192")
DEFAULT_CONFIGS = ("pp 128x128 c1x2", "pp 128x128 c2x1", "pp 128x192 c2x1", "pp 128x160 c1x2",
                   "coop 256x128 c2x1")
TARGET_MS = 5.0  # GPU work per sample, as the zoo's samples
ERR_TOL = 2e-2  # max |out - ref| / max |ref| for a bf16 output of an fp32 accumulation


def parse_cases(text: str) -> list[tuple[str, str, int]]:
    """'MODEL/PROJ/TOKENS,...' -> [(model, proj, tokens)] (ValueError naming a bad item)."""
    cases = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split("/")
        if len(parts) != 3 or parts[1] not in ("gate_up", "down") or not parts[2].isdigit():
            raise ValueError(f"a case is MODEL/gate_up|down/TOKENS, e.g. "
                             f"OLMoE-1B-7B/down/8192; got {item!r}")
        cases.append((parts[0], parts[1], int(parts[2])))
    if not cases:
        raise ValueError("no case given")
    return cases


def parse_configs(text: str) -> list[dict]:
    """';'-separated config names -> their fields (ValueError naming a bad one)."""
    fields = [space.parse_name(s.strip()) for s in text.split(";") if s.strip()]
    if not fields:
        raise ValueError("no config given")
    for f in fields:
        space.config_of(f)  # buildable by us (ValueError otherwise)
    return fields


def quack_config(fields: dict) -> dict:
    """The keyword arguments of QuACK's GemmConfig for the same tile, schedule and cluster."""
    return {"tile_m": fields["tile_m"], "tile_n": fields["tile_n"],
            "pingpong": fields["schedule"] == "pingpong",
            "cluster_m": fields.get("cluster_m") or 1, "cluster_n": fields.get("cluster_n") or 1,
            "device_capacity": 9, "is_dynamic_persistent": False, "max_swizzle_size": 8}


def _inputs(f: dict, counts: tuple[int, ...], device: torch.device, seed: int):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    E, N, K, T = f["E"], f["N"], f["K"], sum(counts)
    x = torch.randn(T, K, device=device, dtype=torch.bfloat16, generator=gen)
    if f["layout"] == "ENK":  # checkpoint (E, N, K), passed as its (E, K, N) view
        w = torch.randn(E, N, K, device=device, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    else:
        w = torch.randn(E, K, N, device=device, dtype=torch.bfloat16, generator=gen)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    return x, w, offs


def _reference(x, w, counts) -> torch.Tensor:
    ref = torch.empty(x.shape[0], w.shape[2], device=x.device, dtype=torch.float32)
    start = 0
    for e, c in enumerate(counts):
        if c:
            ref[start:start + c] = x[start:start + c].float() @ w[e].float()
        start += c
    return ref


def run_case(clock: Clock, f: dict, counts, configs: list[dict], reps: int, seed: int,
             log) -> list[dict[str, Any]]:
    """Every config of one case, ours and QuACK's, interleaved; one row per implementation."""
    import moe_gemm

    device = clock.device
    qfn, why = _quack_gemm()
    if qfn is not None:
        from quack.gemm_config import GemmConfig as QuackConfig
        from quack.gemm_interface import gemm_tuned
    x, w, offs = _inputs(f, counts, device, seed)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=device), offs])
    ref = _reference(x, w, counts)
    scale = ref.abs().max().item() or 1.0
    T, N, K = x.shape[0], w.shape[2], x.shape[1]
    flops = 2.0 * T * N * K
    live, rows = [], []
    for fields in configs:
        name = space.name_of(fields)
        out_ours = torch.empty(T, N, device=device, dtype=torch.bfloat16)
        cfg = space.config_of(fields)
        calls = [("moe_gemm", lambda cfg=cfg, o=out_ours: moe_gemm.grouped_mm(
            x, w, offs, config=cfg, out=o), out_ours, None)]
        if qfn is not None:
            out_q = torch.empty(T, N, device=device, dtype=torch.bfloat16)
            qc = QuackConfig(**quack_config(fields))
            calls.append(("QuACK", lambda qc=qc, o=out_q: gemm_tuned.fn(
                x, w, o, cu_seqlens_m=cu, config=qc), out_q, None))
        else:
            calls.append(("QuACK", None, None, why))
        for impl, fn, out, reason in calls:
            row = {"config": name, "impl": impl, "status": "ok"}
            rows.append(row)
            if fn is None:
                row.update(status="n/a", notes=reason)
                continue
            try:
                fn()
                torch.cuda.synchronize(device)
                err = ((out.float() - ref).abs().max().item()) / scale
            except Exception as exc:  # noqa: BLE001 - this implementation's row says why
                row.update(status="error", notes=f"{type(exc).__name__}: {exc}"[:300])
                continue
            row["rel_err"] = err
            if not err <= ERR_TOL:
                row.update(status="wrong", notes=f"max error {err:.3g} of max|ref|")
                continue
            host_ms = statistics.median(clock.host_ms([fn], 5))
            est = statistics.median(clock.back_to_back([fn], 3, 2, host_ms * 2.5 + 0.1))
            n = max(2, int(TARGET_MS / max(est, 1e-3)))
            live.append((row, fn, n, host_ms * n * 1.25 + 0.1, []))
    for r in range(reps):  # interleaved, the starting implementation rotating
        k = r % max(1, len(live))
        for row, fn, n, backlog, samples in live[k:] + live[:k]:
            samples += clock.back_to_back([fn], 1, n, backlog)
    for row, _, n, _, samples in live:
        ms = statistics.median(samples)
        row.update(ms=ms, ms_p10=quantile(samples, 0.1), ms_p90=quantile(samples, 0.9),
                   calls_per_sample=n, tflops=flops / ms / 1e9)
    by = {(r["config"], r["impl"]): r for r in rows}
    for fields in configs:
        name = space.name_of(fields)
        ours, quack = by[(name, "moe_gemm")], by[(name, "QuACK")]
        if "ms" in ours and "ms" in quack:
            ours["vs_quack"] = quack["ms"] / ours["ms"]
        nan = float("nan")
        log(f"  {name:20s} | ours {ours.get('ms', nan) * 1e3:8.1f} us "
            f"{ours.get('tflops', nan):6.1f} TFLOP/s | QuACK {quack.get('ms', nan) * 1e3:8.1f} us "
            f"{quack.get('tflops', nan):6.1f} TFLOP/s | QuACK/ours {ours.get('vs_quack', nan):.3f}")
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.same_config",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help="comma-separated MODEL/PROJ/TOKENS zoo cases (default: %(default)s)")
    p.add_argument("--configs", default=";".join(DEFAULT_CONFIGS),
                   help="';'-separated configs as `moe-gemm tune` names them "
                   "(default: %(default)s)")
    p.add_argument("--reps", type=int, default=12, help="interleaved rounds (default 12)")
    p.add_argument("--seed", type=int, default=1234, help="routing and data seed")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N")
    p.add_argument("--out", help="write the rows as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cases = parse_cases(args.cases)
        configs = parse_configs(args.configs)
    except ValueError as exc:
        print(f"same_config: {exc}", file=sys.stderr)
        return 2
    if args.reps < 1:
        print("same_config: --reps must be at least 1", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("same_config: needs a CUDA GPU (our kernels and QuACK's are Hopper kernels)",
              file=sys.stderr)
        return 2
    name, info, _ = device_info(device)
    doc: dict[str, Any] = {
        "device": name, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "device_info": info, "argv": list(sys.argv[1:] if argv is None else argv),
        "settings": {"reps": args.reps, "seed": args.seed, "timing": (
            "ms: back-to-back median of interleaved rounds behind a sleep backlog, as the "
            "zoo")}, "results": []}
    clock = Clock(device)
    for model, proj, tokens in cases:
        try:
            spec, f = build_cases(model, str(tokens), [proj], args.seed, False)[0]
        except (ValueError, IndexError) as exc:
            print(f"same_config: {model}/{proj}/{tokens}: {exc}", file=sys.stderr)
            return 2
        print(f"{spec.name}: E={f['E']} N={f['N']} K={f['K']} rows={f['rows']} {f['layout']}",
              flush=True)
        for row in run_case(clock, f, spec.fixed_counts, configs, args.reps, args.seed,
                            lambda s: print(s, flush=True)):
            doc["results"].append({"case": spec.name, **{k: f[k] for k in (
                "model", "proj", "tokens", "E", "N", "K", "rows", "layout")}, **row})
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(doc, fh, indent=1)
    ratios = sorted(r["vs_quack"] for r in doc["results"] if "vs_quack" in r)
    if ratios:
        print(f"QuACK/ours over {len(ratios)} case x config pairs: median "
              f"{statistics.median(ratios):.3f}, min {ratios[0]:.3f}, max {ratios[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
