"""Quick config sweep on suite shapes (device): median CUDA-event time per config.

    python scripts/tune.py --shapes uniform,mixtral --configs "cooperative:128x256:4,pingpong"
A config is schedule[:MxN[:stages[:visitor[:a_hint/b_hint[:flag...]]]]] (hints: first|normal|
last; flags: pdl1 = programmatic dependent launch, swN = raster panel of N m-tiles, epi64 = the
128x64 cooperative epilogue subtile, ew1 = whole-tile epilogue, c2 = 2x1 cluster, cn2 = 1x2
cluster, ts0 / ts1 = tail split off / on); "default" is config=None, and "default" with flags
(e.g. "default::::::sw32") the default choice with only those changed. A "3d-" prefix (or "3d" alone) runs a uniform general
shape through grouped_mm's 3-D form on stacked operands. --seed picks the routing and data
(the bench uses 1234).
Peers, timed in the same interleaved rounds: "bmm" (torch.bmm), "gmm" (F.grouped_mm),
"loop" (the bench's torch.mm loop), "quack" (QuACK's varlen GEMM, when importable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.bench import Clock  # noqa: E402
from benchmarks.suite import (  # noqa: E402
    GROUPED_MM_FN,
    NotApplicable,
    ShapeSpec,
    _as_varlen,
    _build_quack,
    full_suite,
    loop_body,
    make_inputs,
)
from moe_gemm import GemmConfig, grouped_gemm, grouped_mm  # noqa: E402
from moe_gemm.ops import launch as host_sm90  # noqa: E402
from moe_gemm.ops.support import operand_major  # noqa: E402
from moe_gemm.ops.validation import check_grouped_bmm, check_grouped_mm  # noqa: E402


def measure(fns: dict, reps: int = 20) -> dict:
    """Back-to-back GPU ms per call (launches queued behind a sleep backlog), interleaved
    across configs each round so clock drift hits all alike; median of `reps`."""
    clock = Clock(torch.device("cuda"))
    plan = {}
    for name, fn in fns.items():
        try:
            for _ in range(2):
                fn()
            clock.sync()
            host = statistics.median(clock.host_ms([fn], 3))
            est = max(statistics.median(clock.single([fn], 2)), 1e-3)
            calls = max(2, min(200, int(3.0 / est)))
            plan[name] = (fn, calls, host * calls * 1.3 + 0.2)
        except Exception as exc:  # noqa: BLE001
            plan[name] = f"error: {type(exc).__name__}: {exc}"[:160]
    samples: dict = {k: [] for k, v in plan.items() if not isinstance(v, str)}
    for _ in range(reps):
        for name in samples:
            fn, calls, backlog = plan[name]
            samples[name] += clock.back_to_back([fn], 1, calls, backlog)
    return {k: (statistics.median(v) * 1000 if k in samples else plan[k])
            for k, v in [(k, samples.get(k)) for k in plan]}


def parse(spec):
    parts = spec.split(":")
    kw = {"backend": "cute", "schedule": parts[0]}
    default = parts[0] == "default"  # the heuristic's choice, with only the flags changed
    if len(parts) > 1 and parts[1]:
        m, n = parts[1].split("x")
        kw.update(tile_m=int(m), tile_n=int(n))
    if len(parts) > 2 and parts[2]:
        kw["stages"] = int(parts[2])
    if len(parts) > 3 and parts[3]:
        kw["visitor"] = parts[3]
    hints = parts[4].replace("/", ",") if len(parts) > 4 and parts[4] else None
    flags = {"pdl": 0, "sw": None, "epi": None, "cn": None, "c": None, "ew": None,
             "ts": None}
    for tok in parts[5:]:
        for name in flags:
            if tok.startswith(name) and tok[len(name):].isdigit():
                flags[name] = int(tok[len(name):])
    if flags["c"]:
        kw.update(cluster_m=flags["c"], cluster_n=1)
    if flags["cn"]:
        kw.update(cluster_m=1, cluster_n=flags["cn"])
    return (None if default else GemmConfig(**kw)), hints, flags


def patched_plan(form, args, cfg, flags):
    """A launch plan with the raster swizzle / epilogue subtile overridden (tuning only)."""
    cfg = cfg if cfg is not None else GemmConfig(backend="cute")
    plan = (host_sm90.BmmPlan if form == "batched" else host_sm90.MmPlan)(args, cfg)
    changes = {}
    if flags["sw"]:
        changes["swizzle"] = flags["sw"]
    if flags["epi"]:
        changes["epi_n"] = flags["epi"]
    if flags["ew"]:
        changes["epi_whole"] = True
    if flags["ts"] is not None:
        changes["tail_split"] = bool(flags["ts"])
    plan.choice = replace(plan.choice, **changes)
    w = args.w
    b_major = "k" if operand_major(w) == "col" else "n"
    plan.kernel = host_sm90._compiled(host_sm90._compile_key(
        form, args.dtype, args.out_dtype, b_major, plan.choice, False))
    return plan


def _flat(out):
    if isinstance(out, (list, tuple)):
        return torch.cat([o.reshape(-1) for o in out])
    return out.reshape(-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="uniform")
    p.add_argument("--configs", default="")
    p.add_argument("--out", default="")
    p.add_argument("--seed", type=int, default=0, help="routing and data seed (bench: 1234)")
    p.add_argument("--custom", default="", help="extra varlen shapes, comma-separated "
                   "name:E:T:N:K[:zipf_s] (zipf_s 0 = experts equally likely), usable in --shapes")
    a = p.parse_args()
    suite = {s.name: s for s in full_suite()}
    for item in filter(None, a.custom.split(",")):
        name, *nums = item.split(":")
        E, T, N, K = (int(v) for v in nums[:4])
        suite[name] = ShapeSpec(name, "varlen", "bf16", f"custom E={E} T={T} N={N} K={K}",
                                experts=E, rows=T, n=N, k=K,
                                zipf_s=float(nums[4]) if len(nums) > 4 else 0.0)
    rows = []
    for shape in a.shapes.split(","):
        spec = suite[shape]
        counts = spec.counts(a.seed)
        inp = make_inputs(spec, counts, torch.device("cuda"), a.seed)
        if spec.form == "varlen":  # 128x256 tiles and waves on the device's SMs
            tiles = sum(-(-c // 128) for c in counts) * -(-spec.n // 256)
            nsm = torch.cuda.get_device_properties(0).multi_processor_count
            rows.append((shape, "128x256 tiles / waves", f"{tiles} / {tiles / nsm:.2f}"))
        A3 = B3 = None
        if spec.form == "general" and len(set(spec.problems)) == 1:
            A3, B3 = torch.stack(inp.a), torch.stack(inp.b)
        try:
            vx, vw, voffs = _as_varlen(inp, torch.device("cuda"), "tune")
        except NotApplicable:
            vx = vw = voffs = None
        fns = {}
        for cs in ["default", *filter(None, a.configs.split(","))]:
            if cs == "quack":
                try:
                    fns[cs] = _build_quack(spec, inp, torch.device("cuda")).run
                except Exception as exc:  # noqa: BLE001 - not installed / not applicable
                    print(f"quack: {exc}")
                continue
            if cs in ("bmm", "gmm", "loop"):
                if cs == "bmm" and A3 is not None:
                    fns[cs] = lambda: torch.bmm(A3, B3)
                elif cs == "gmm" and GROUPED_MM_FN is not None and vx is not None:
                    fns[cs] = lambda: GROUPED_MM_FN(vx, vw, offs=voffs)
                elif cs == "loop":
                    fns[cs] = loop_body(inp, torch.device("cuda"))
                continue
            batched = cs.startswith("3d")
            body = cs[3:] if cs.startswith("3d-") else ("default" if batched else cs)
            if batched and A3 is None:
                continue
            cfg, hints, flags = parse(body)
            plan = None
            if flags["sw"] or flags["epi"] or flags["ew"] or flags["ts"] is not None:
                if batched:
                    plan = patched_plan("batched", check_grouped_bmm(A3, B3, None, None), cfg,
                                        flags)
                elif spec.form == "varlen":
                    plan = patched_plan("varlen", check_grouped_mm(inp.x, inp.w, inp.offs,
                                                                   None, None), cfg, flags)

            def fn(cfg=cfg, hints=hints, pdl=flags["pdl"], batched=batched, plan=plan):
                if hints:
                    os.environ["MOE_GEMM_L2_HINTS"] = hints
                else:
                    os.environ.pop("MOE_GEMM_L2_HINTS", None)
                host_sm90.PDL = pdl
                if plan is not None:
                    return plan(A3, B3, None) if batched else plan(inp.x, inp.w, inp.offs, None)
                if batched:
                    return grouped_mm(A3, B3, config=cfg)
                if spec.form == "general":
                    return grouped_gemm(inp.a, inp.b, config=cfg)
                return grouped_mm(inp.x, inp.w, inp.offs, config=cfg)
            fns[cs] = fn
        for name, us in measure(fns).items():
            rows.append((shape, name, us))
        for name, fn in fns.items():  # the grid each of ours ran with
            if name not in ("bmm", "gmm", "loop", "quack"):
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - e.g. a config this form rejects
                    rows.append((shape, name, f"error: {type(exc).__name__}: {exc}"[:160]))
                    continue
                info = host_sm90.last_launch()
                if info is not None:
                    rows.append((shape, name + " ctas", str(info.num_ctas)))
        # Swizzle and epilogue subtile change neither the math nor its order: the result must
        # be bitwise the default's.
        base = fns["default"]()
        for name, plan_fn in fns.items():
            if any(f in name for f in (":sw", ":epi", ":c2", ":cn2", ":ew")):
                try:
                    same = _flat(plan_fn()).equal(_flat(base))
                except Exception:  # noqa: BLE001 - reported above
                    continue
                rows.append((shape, name + " bitwise==default", str(same)))
            elif ":ts" in name:  # the split tail tiles add two fp32 halves: not bitwise
                try:
                    got, ref = _flat(plan_fn()).float(), _flat(base).float()
                except Exception:  # noqa: BLE001 - reported above
                    continue
                err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                rows.append((shape, name + " max|diff|/max|default|", f"{err:.2e}"))
        inp = A3 = B3 = vx = vw = voffs = None  # noqa: F841  (free before the next shape)
        torch.cuda.empty_cache()
    for shape, name, us in rows:
        print(f"{shape:12s} {name:44s} {us if isinstance(us, str) else f'{us:9.1f} us'}")
    if a.out:
        json.dump(rows, open(a.out, "w"))


if __name__ == "__main__":
    main()
