"""The model-zoo benchmark: real MoE models' expert GEMMs, ours against the peers.

    python -m benchmarks.zoo [--fp8] [--models M,...] [--tokens T,...] [--budget-s S] [--out FILE]
    moe-gemm bench --suite zoo ...

Each case is one projection (gate_up or down) of one model (moe_gemm.tuning.zoo: configs and
checkpoint layouts) at one token count, routed with the zoo's seeded top-k routing. Per case,
in one process and interleaved round by round (benchmarks.runner): our grouped_mm with no
config (`default`: what users get, tuned tables included), torch's grouped_mm, the torch.mm
loop captured in a CUDA graph, QuACK's varlen GEMM untuned and with tuned=True. Every output
is checked against a float32 reference before it is timed. Rows carry time, TFLOP/s, GB/s,
the fraction of the roofline floor (ceilings measured in the same run) and the ratio to the
best peer; the JSON and a PNG heat map of that ratio are written after every case.

With --fp8, the models that ship FP8 checkpoints (FP8_MODELS) in FP8 instead: per case, our
scaled_grouped_mm block-scaled (1x128 / 128x128, the default row) and row-wise, torch's FP8
grouped GEMMs (the peers: torch._scaled_grouped_mm row-wise, F.scaled_grouped_mm block-wise;
n/a with torch's reason where missing or refused), our bf16 default for reference and, where
the case is compute-bound, the dense FP8 torch._scaled_mm of the same M x N x K
(benchmarks.suite_fp8). Each row's floor counts its own operands' bytes and its dtype's dense
rate (the FP8 rate measured in the run for the FP8 rows); `vs_best_peer` is against the best
FP8 peer.

The default subset (DEFAULT_MODELS x both projections x DEFAULT_TOKENS) fits about nine
minutes on an H100 with --budget-s 480; --budget-s stops before a case that would not fit and
lists the rest under "not_run"; --resume FILE adds the missing cases of an earlier run's JSON
on the same device with the same settings (seed, routing, reps: those --merge compares)
(--rerun: measures the selected cases again, replacing theirs). On a machine of several GPUs,
`--shard I/N` (one process per GPU, CUDA_VISIBLE_DEVICES=I, each with its own --out) splits
the cases, and `--merge FILE --merge FILE ...` joins the shards' JSON (or puts a rerun of some
cases on top of a whole run) without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks import suite_fp8, zoo_report
from benchmarks.ceilings import measure_ceilings
from benchmarks.clock import B2B_TARGET_MS, Clock
from benchmarks.report import write_json
from benchmarks.runner import (
    Run,
    bench_device,
    device_info,
    our_failures,
    run_shape,
    split_names,
    unknown_skip,
)
from benchmarks.scoring import fp8_compute_bound
from benchmarks.suite import (
    DEFAULT_NAME,
    FP8,
    GROUPED_MM_NAME,
    QUACK_NAME,
    QUACK_TUNED_NAME,
    Impl,
    Inputs,
    NotApplicable,
    Prepared,
    ShapeSpec,
    _build_graph,
    _build_grouped_mm,
    _build_quack,
    _build_quack_tuned,
    _ours,
    build_quack_config,
    quack_autotune_seconds,
)
from moe_gemm.tuning import zoo as models
from moe_gemm.tuning.argcheck import cache_problem, empty_option, loads_json, output_problem
from moe_gemm.tuning.shards import (
    finish_shards,
    gpu_ids,
    launch_shards,
    parse_shard,
    take_shard,
)

DEFAULT_MODELS = models.DEFAULT_MODELS
FP8_MODELS = models.FP8_MODELS
DEFAULT_TOKENS = models.DEFAULT_TOKENS
DEFAULT_REPS = 15
DEFAULT_BUDGET_S = 480.0
# The cap is compared with the autotune's estimate (suite.quack_autotune_seconds): 40-67 s on
# the largest gate/up rows of an H100 (DeepSeek-V3, Kimi-K2, Llama-4-Maverick, Mixtral-8x22B;
# 24-66 s measured where not cached, 2026-12-05). A cap below that leaves the peer out
# exactly where the bar needs it (bar.peers_not_run).
QUACK_TUNE_CAP_S = 75.0
GRAPH_NAME = "torch.mm loop (CUDA graph)"
# Options whose empty value would read as "all" or "the default" (see empty_option).
NONEMPTY = ["cases", "models", "tokens", "proj", "resume", "quack_cache", "quack_chosen", "out",
            "out_dir", "png",
            "device", "skip_impl", "merge"]
SMOKE_SCALE = 64  # smoke mode: N and K divided by this (at least 16), E at most 8


# ---------------------------------------------------------------------------------------------
# Cases


def case_name(model: str, proj: str, tokens: int, fp8: bool = False) -> str:
    return f"{model}/{proj}/{tokens}" + ("/fp8" if fp8 else "")


def build_cases(model_names: str | None, tokens: str | None, projs: list[str], seed: int,
                smoke: bool, fp8: bool = False) -> list[tuple[ShapeSpec, dict[str, Any]]]:
    """(ShapeSpec, zoo fields) per case, token count by token count (priority order); with
    fp8, FP8 shapes of models that ship FP8 checkpoints (ValueError naming any other)."""
    # None only: an empty --models names no model, it is refused rather than the default.
    picked = models.select_models(model_names if model_names is not None else
                                  ",".join(FP8_MODELS if fp8 else DEFAULT_MODELS))
    if fp8 and (no_fp8 := [m.name for m in picked if not m.fp8_id]):
        raise ValueError(f"no FP8 checkpoint is published for {', '.join(no_fp8)}; --fp8 "
                         f"takes {', '.join(FP8_MODELS)}")
    default_tokens = (1, 16) if smoke else DEFAULT_TOKENS
    cases = []
    for t in models.parse_tokens(tokens, default_tokens):
        for m in picked:
            for p in m.projections():
                if p.proj not in projs:
                    continue
                E, N, K = p.E, p.N, p.K
                if smoke:  # tiny, with rows still 16-byte multiples (the TMA rule)
                    E = min(E, 8)
                    N, K = (max(16, v // SMOKE_SCALE // 16 * 16) for v in (N, K))
                    if fp8:  # whole 128-wide scale blocks along K
                        K = max(128, K // 128 * 128)
                counts = models.topk_counts(E, t, min(p.top_k, E), seed)
                rows = sum(counts)
                name = case_name(m.name, p.proj, t, fp8)
                spec = ShapeSpec(name, "varlen", FP8 if fp8 else "bf16",
                                 f"{m.name} {p.proj}: {t} tokens x top-{p.top_k}, E={E} N={N} "
                                 f"K={K}, weights {p.layout}", experts=E, rows=rows, n=N, k=K,
                                 fixed_counts=tuple(counts), layout=p.layout)
                fields = {"model": m.name, "proj": p.proj, "tokens": t, "E": E, "N": N,
                          "K": K, "rows": rows, "top_k": p.top_k, "layout": p.layout,
                          "shape": f"E={E} N={N} K={K} rows={rows}"}
                if fp8:
                    fields["checkpoint"] = m.fp8_id
                cases.append((spec, fields))
    return cases


def selected_cases(args: argparse.Namespace, projs: list[str], smoke: bool
                   ) -> list[tuple[ShapeSpec, dict[str, Any]]]:
    """The cases a run measures: --cases in the order given, else --models x --tokens x
    --proj (build_cases). ValueError naming a bad one."""
    if args.cases is None:
        return build_cases(args.models, args.tokens, projs, args.seed, smoke, args.fp8)
    return named_cases(args.cases, args.seed, smoke, args.fp8)


def named_cases(text: str, seed: int, smoke: bool, fp8: bool = False
                ) -> list[tuple[ShapeSpec, dict[str, Any]]]:
    """The cases of a --cases value ('MODEL/PROJ/TOKENS,...'), in its order; a case named
    twice is measured once. ValueError naming a bad one."""
    cases, seen = [], set()
    for m, p, t in parse_cases(text):
        spec, fields = build_cases(m, str(t), [p], seed, smoke, fp8)[0]
        if spec.name not in seen:
            seen.add(spec.name)
            cases.append((spec, fields))
    return cases


def parse_cases(text: str) -> list[tuple[str, str, int]]:
    """'MODEL/PROJ/TOKENS,...' -> [(model, proj, tokens)] (ValueError naming a bad item; an
    empty one, as a trailing comma leaves, too: split_names, as every list option)."""
    cases = []
    for item in split_names(text):
        parts = item.split("/")
        if len(parts) != 3 or parts[1] not in ("gate_up", "down") or not parts[2].isdecimal():
            raise ValueError(f"--cases: a case is MODEL/gate_up|down/TOKENS, e.g. "
                             f"OLMoE-1B-7B/down/8192; got {item!r}")
        cases.append((parts[0], parts[1], int(parts[2])))
    return cases


def implementations(run: Run, quack_tuned: bool, cap_s: float,
                    budget_left, quack_chosen: dict[str, str] | None = None) -> list[Impl]:
    """Ours (default), then the peers: torch's grouped_mm, the mm loop in a CUDA graph, QuACK."""
    impls = [
        Impl(DEFAULT_NAME, False, _ours(None), default=True,
             notes="grouped_mm(x, w, offs), config=None (tuned tables, then the rules)"),
        Impl(GROUPED_MM_NAME, True, _build_grouped_mm, notes="torch's grouped_mm, 2D x 3D"),
        Impl(GRAPH_NAME, True, _build_graph,
             notes="one torch.mm per non-empty expert, offsets known on the host, captured "
             "once per input set and replayed"),
        Impl(QUACK_NAME, True, _build_quack,
             notes="quack.gemm_interface.gemm(x, w, cu_seqlens_m=..., tuned=False)"),
    ]
    if quack_tuned:
        tuned = _guarded_quack_tuned(run, cap_s, budget_left)
        notes = ("quack.gemm_interface.gemm(..., tuned=True): QuACK's autotuner on the first "
                 "call")
        if quack_chosen:
            tuned = _replayed_quack_tuned(quack_chosen, tuned)
            notes += ("; where --quack-chosen names the config it chose for the case in an "
                      "earlier run on this GPU kind, that config is run instead (its chosen "
                      "field says 'replayed')")
        impls.append(Impl(QUACK_TUNED_NAME, True, tuned, notes=notes))
    return impls


def read_quack_chosen(path: str) -> tuple[str, dict[str, str]]:
    """--quack-chosen FILE (an earlier zoo run): its device and, per case, the config QuACK's
    autotuner chose there (its row's "chosen"). ValueError saying why it cannot be used."""
    try:
        old = loads_json(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--quack-chosen {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--quack-chosen {path}: not JSON ({exc})") from None
    zoo_report.check_run(f"--quack-chosen {path}", old)
    chosen = {}
    for r in old.get("results", []):
        text = r.get("chosen")
        if r.get("impl") == QUACK_TUNED_NAME and r.get("status") == "ok" and text:
            quack_config_fields(text)  # (ValueError naming the text it cannot read)
            chosen[r.get("case") or r["shape"]] = text
    if not chosen:
        raise ValueError(f"--quack-chosen {path}: no case where QuACK tuned ran and said "
                         "what it chose")
    return str(old.get("device")), chosen


def quack_config_fields(text: str) -> dict[str, Any]:
    """QuACK GemmConfig keyword arguments from its repr as the zoo records it ('config:
    GemmConfig(tile_m=128, tile_n=256, pingpong=False, cluster_m=1, ...)'): ints, booleans
    and None. ValueError for text of another form."""
    import re

    m = re.search(r"GemmConfig\(([^()]*)\)", text)
    if m is None:
        raise ValueError(f"QuACK's choice {text[:80]!r}: expected 'GemmConfig(...)'")
    fields: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in m.group(1).split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"QuACK's choice {text[:80]!r}: cannot read {item!r}")
        consts = {"True": True, "False": False, "None": None}
        if value in consts:
            fields[name] = consts[value]
        elif re.fullmatch(r"-?\d+", value):
            fields[name] = int(value)
        else:
            raise ValueError(f"QuACK's choice {text[:80]!r}: cannot read {item!r}")
    if "tile_m" not in fields or "tile_n" not in fields:
        raise ValueError(f"QuACK's choice {text[:80]!r}: no tile_m / tile_n")
    return fields


REPLAYED = "(replayed)"


def _replayed_quack_tuned(chosen: dict[str, str], fallback):
    """QuACK tuned as its autotuner chose on an earlier run of the same case (the config run
    directly: its autotune, 10-65 s a case on an H200, is what a run of every case cannot
    afford on one GPU); `fallback` (the autotune) for a case the earlier run lacks."""

    def build(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
        text = chosen.get(spec.name)
        if text is None:
            return fallback(spec, inp, device)
        # (a choice an earlier run had replayed already says so once, not once per replay)
        label = text if text.endswith(REPLAYED) else f"{text} {REPLAYED}"
        return build_quack_config(inp, device, quack_config_fields(text), label)

    return build


def impl_names(fp8: bool) -> list[str]:
    """The implementations a bf16 (or with fp8, an FP8) zoo run can time, QuACK tuned
    included: the names --skip-impl takes."""
    if fp8:
        spec = ShapeSpec("names", "varlen", FP8, "", experts=1, rows=1, n=16, k=128)
        return [i.name for i in suite_fp8.implementations(spec, True)]
    return [DEFAULT_NAME, GROUPED_MM_NAME, GRAPH_NAME, QUACK_NAME, QUACK_TUNED_NAME]


def _guarded_quack_tuned(run: Run, cap_s: float, budget_left):
    """QuACK tuned=True, unless its autotune would take longer than cap_s or the budget left
    (estimated from the untuned QuACK call's time on this case): then n/a, with why."""

    def build(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
        untuned = next((r for r in reversed(run.doc["results"]) if r["shape"] == spec.name
                        and r["impl"] == QUACK_NAME), None)
        if untuned is None or untuned.get("status") != "pending" or not untuned.get("est_ms"):
            raise NotApplicable("QuACK untuned did not run here")
        est = quack_autotune_seconds(untuned["est_ms"])
        limit = min(cap_s, budget_left() - 10.0)
        if est > limit:
            raise NotApplicable(f"QuACK's autotune would take ~{est:.0f} s here, over the "
                                f"{limit:.0f} s allowed (--quack-tune-cap-s, --budget-s)")
        return _build_quack_tuned(spec, inp, device)

    return build


def estimate_case_s(fields: dict[str, Any], ceilings: dict[str, Any], reps: int,
                    quack_tuned: bool, cap_s: float, history: float) -> float:
    """Seconds a case should take, from its floor: checks, interleaved timing, QuACK's
    autotune; `history` scales it by how far earlier estimates were off (>= 1)."""
    elem = 2
    E, N, K, rows = fields["E"], fields["N"], fields["K"], fields["rows"]
    nbytes = (rows * K + E * N * K + rows * N) * elem
    nflops = 2 * rows * N * K
    bw = ceilings.get("copy_bytes_per_s") or 3e12
    rate = ceilings.get("mm_flops_per_s") or 6e14
    call_ms = max(nbytes / bw, nflops / rate) * 1e3 * 1.5 + 0.01
    timing = reps * 6 * max(B2B_TARGET_MS, call_ms) * 1.5 / 1e3
    checks = 6 * 12 * call_ms / 1e3 + nflops / 4e13  # first calls, warm-up, fp32 reference
    tune = quack_autotune_seconds(call_ms) if quack_tuned else 0.0
    tune = tune if tune <= cap_s else 0.0  # over the cap it is skipped
    return (2.0 + timing + checks + tune) * history


# ---------------------------------------------------------------------------------------------
# Running


def _choice_source(fields: dict[str, Any], device: torch.device, fp8: bool = False) -> str:
    """How our default picked its kernel here: a tuned table (exact / nearest / model) or
    the rules, "+waves" where the whole-wave fit moved the tile (FP8: always the rules,
    moe_gemm.ops.heuristics_fp8 has no tables)."""
    if device.type != "cuda":
        return "torch backend"
    if fp8:
        return "rules"
    from moe_gemm.capability import device_name, sm_count
    from moe_gemm.config import GemmConfig
    from moe_gemm.ops.heuristics import choice_source, choose_varlen, tuned_hit

    shape = (fields["rows"], fields["E"], fields["N"], fields["K"])
    nsm, name = sm_count(device), device_name(device)
    hit = tuned_hit("varlen", GemmConfig(), nsm, device=name, shape=shape)
    return choice_source(hit, choose_varlen(GemmConfig(), *shape, nsm, device=name,
                                            swap_ok=True))


def _precompile(cases, device: torch.device, log) -> Any:
    """Start compiling every case's default kernel in worker processes (the disk cache's
    per-kernel lock makes the first call wait for its worker instead of compiling again)."""
    if device.type != "cuda":
        return None
    try:
        from moe_gemm.capability import cute_problem, device_name, sm_count
        from moe_gemm.tuning.compile_pool import CompilePool

        if cute_problem(device):
            return None
        if why := cache_problem():
            # (the workers hand their kernels over through the disk cache: without it each
            # kernel would be compiled twice, once in a worker and again in this process)
            log(f"[zoo] not compiling ahead: {why}")
            return None
        name, nsm = device_name(device), sm_count(device)
        keys = [models.default_kernel_key(f["E"], f["N"], f["K"], f["rows"], f["layout"], name,
                                          nsm) for _, f in cases]
        pool = CompilePool()
        if pool.inline:
            return None
        pool.submit(dict.fromkeys(keys))
        log(f"[zoo] compiling {len(set(keys))} kernels in {pool.workers} processes")
        return pool
    except Exception as exc:  # noqa: BLE001 - precompiling is an optimisation
        log(f"[zoo] no precompile: {type(exc).__name__}: {exc}")
        return None


def use_quack_cache(path: str) -> str | None:
    """Point QuACK's autotuner at its disk cache in `path` (created if missing): it stores
    each shape's config timings there and, where they are already there for the same configs
    and QuACK version, takes their fastest instead of autotuning. The reason it cannot, or
    None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"--quack-cache {path}: {exc.strerror or exc}"
    if not os.access(path, os.W_OK):
        return f"--quack-cache {path}: not writable"
    os.environ["QUACK_CACHE_DIR"] = os.path.abspath(path)
    os.environ["QUACK_CACHE_AUTOTUNING"] = "1"
    return None


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's "settings" (args.reps resolved): what --merge and --resume compare."""
    return {"dtype": FP8 if args.fp8 else "bf16",
            "reps": args.reps, "seed": args.seed, "smoke": args.smoke,
            "budget_s": args.budget_s, "quack_tuned": args.quack_tuned,
            "quack_autotune_cache": bool(getattr(args, "quack_cache", None)),
            "quack_chosen_from": (Path(args.quack_chosen).name
                                  if getattr(args, "quack_chosen", None) else None),
            # "drawn in arrays" tells these counts from those of the token-by-token draw
            # before it (the same law, other counts for a seed): zoo_report refuses to merge
            # runs of the two, and --resume to extend one with the other.
            "routing": f"moe_gemm.tuning.zoo.topk_counts: top-k distinct experts per "
            f"token, log-normal popularity sigma={models.ROUTING_SIGMA}, top-k > 1 "
            "drawn in arrays",
            "timing": "ms: back-to-back median of interleaved rounds (GPU time, "
            "host enqueue hidden); ms_single: per-launch events median"}


def new_doc(device: torch.device, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    name, info, _ = device_info(device)
    return {
        "device": name, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "complete": False, "device_info": info, "argv": argv, "settings": run_settings(args),
        "ceilings": {}, "runs": [], "cases": {}, "results": [], "not_run": [], "not_rerun": [],
    }


def run(args: argparse.Namespace, argv: list[str], device: torch.device,
        out_path: Path, png: Path | None, log) -> dict[str, Any]:
    """Every case that fits the budget; the JSON (and the PNG) rewritten after each, so a
    run stopped at any point leaves what finished."""
    t0 = time.monotonic()
    cases = take_shard(selected_cases(args, args.proj, args.smoke), args.shard)
    doc = new_doc(device, args, argv)
    if args.resume:
        old = read_resume(args.resume)
        check_resume(args.resume, old, doc["settings"], doc["device"])
        done = {c for c, info in old.get("cases", {}).items() if info.get("complete")}
        # Kept until measured again: with --rerun a case that the budget leaves out keeps
        # FILE's measurement (listed under "not_rerun"), it is never lost.
        doc["results"] = [r for r in old.get("results", []) if r.get("case") in done]
        doc["cases"] = {c: old["cases"][c] for c in done}
        doc["runs"] = list(old.get("runs", []))
        if not args.rerun:
            cases = [(s, f) for s, f in cases if s.name not in done]
    pool = _precompile(cases, device, log)
    _, _, l2 = device_info(device)
    run_doc: dict[str, Any] = {"ceilings": {}, "shapes": {}, "results": []}
    r = Run(device=device, clock=Clock(device), reps=args.reps, seed=args.seed,
            smoke=args.smoke, variants=False, skip=frozenset(args.skip_impl or ()),
            doc=run_doc, out_path=None, l2_bytes=l2 if not args.smoke else 1 << 20,
            progress=not args.quiet)
    ceilings = measure_ceilings(r.clock, args.smoke, args.reps, fp8=args.fp8)
    doc["ceilings"] = ceilings
    doc["runs"].append({"date": doc["date"], "argv": argv, "ceilings": ceilings})
    budget_left = lambda: args.budget_s - (time.monotonic() - t0)  # noqa: E731
    quack_tuned = args.quack_tuned and not args.fp8
    quack_chosen = None
    if quack_tuned and args.quack_chosen:
        chosen_on, quack_chosen = read_quack_chosen(args.quack_chosen)
        if chosen_on != doc["device"]:
            raise ValueError(f"--quack-chosen {args.quack_chosen} was measured on "
                             f"{chosen_on}, this is {doc['device']}")
    impls = implementations(r, quack_tuned, args.quack_tune_cap_s, budget_left, quack_chosen)
    history = 1.0
    try:
        for i, (spec, fields) in enumerate(cases):
            autotunes = quack_tuned and spec.name not in (quack_chosen or {})
            est = estimate_case_s(fields, ceilings, args.reps, autotunes,
                                  args.quack_tune_cap_s, history)
            if budget_left() < est:
                _leave(doc, cases[i:])
                doc["stopped"] = (f"budget: {budget_left():.0f} s left, the next case needs "
                                  f"~{est:.0f} s")
                break
            t_case = time.monotonic()
            run_shape(r, spec, suite_fp8.implementations(
                spec, fp8_compute_bound(spec.sizes(args.seed), ceilings)) if args.fp8 else impls)
            took = time.monotonic() - t_case
            history = max(1.0, 0.5 * history + 0.5 * took / max(est / history, 1e-3))
            rows = [x for x in run_doc["results"] if x["shape"] == spec.name]
            info = {**run_doc["shapes"][spec.name], **fields, "seconds": round(took, 1),
                    "complete": not any(x.get("not_run") for x in rows),
                    "run": len(doc["runs"]) - 1}  # which of doc["runs"] measured it
            for x in rows:
                x["case"] = spec.name
                x.update({k: v for k, v in fields.items()})
                if x.get("default"):
                    x["choice_source"] = _choice_source(fields, device, args.fp8)
            zoo_report.derive_case(rows, info, ceilings)
            doc["cases"][spec.name] = info
            doc["results"] = [x for x in doc["results"] if x.get("case") != spec.name] + rows
            doc["bar"] = zoo_report.bar(doc["results"])
            write_json(out_path, doc, compact=True)
            if png is not None:
                zoo_report.plot_png(doc, png)
            if r.poisoned:
                _leave(doc, cases[i + 1:])
                doc["stopped"] = f"CUDA context poisoned: {r.poisoned}"
                break
            run_doc["results"].clear()
            gc.collect()
    finally:
        if pool is not None:
            pool.close()
    doc["complete"] = not doc["not_run"]
    doc["bar"] = zoo_report.bar(doc["results"])
    doc["seconds"] = round(time.monotonic() - t0, 1)
    return doc


def read_resume(path: str) -> dict[str, Any]:
    """--resume FILE's run, checked as --merge checks its files (ValueError saying why)."""
    try:
        old = loads_json(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--resume {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"--resume {path}: not JSON ({exc})") from None
    zoo_report.check_run(f"--resume {path}", old)
    return old


def check_resume(path: str, old: dict[str, Any], ours: dict[str, Any],
                 device: str | None = None) -> None:
    """ValueError unless --resume FILE's run `old` is one this run (its settings `ours`, on
    `device` when known) may add cases to: the same device and the settings --merge requires
    alike (zoo_report.SAME_SETTINGS): cases of another seed or routing draw (other counts,
    other data) added to a run would read as one run."""
    if device is not None and old.get("device") != device:
        raise ValueError(f"--resume {path} was measured on {old.get('device')}, "
                         f"this is {device}")
    # (runs from before --fp8 carry no dtype: they are bf16 runs)
    theirs = {"dtype": "bf16", **(old.get("settings") or {})}
    if theirs["dtype"] != ours["dtype"]:
        raise ValueError(f"--resume {path} is a {theirs['dtype']} run, this is {ours['dtype']}")
    if diff := [k for k in zoo_report.SAME_SETTINGS if theirs.get(k) != ours.get(k)]:
        said = "; ".join(f"{k} {theirs.get(k)!r} (this run: {ours.get(k)!r})" for k in diff)
        raise ValueError(f"--resume {path} was run with other settings: {said}")


def _leave(doc: dict[str, Any], cases: list) -> None:
    """Cases a run stops before: not run, or (with --rerun) kept from the earlier run."""
    left = [spec.name for spec, _ in cases]
    doc["not_run"] = [c for c in left if c not in doc["cases"]]
    doc["not_rerun"] = [c for c in left if c in doc["cases"]]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-gemm bench --suite zoo", description=(
        "Time our default against torch's grouped_mm, the mm loop in a CUDA graph and QuACK "
        "(untuned and tuned) on real MoE models' expert GEMMs; write JSON and a PNG. Exit status: 1 "
        "when one of our rows failed (a wrong result or an error; the JSON has it too), 2 for "
        "bad arguments."))
    p.add_argument("--fp8", action="store_true", help="FP8: our scaled_grouped_mm "
                   "(block-scaled and row-wise) against torch's FP8 grouped GEMMs, on the "
                   "models that ship FP8 checkpoints")
    p.add_argument("--models", help="comma-separated model names, 'all' (default: "
                   f"{','.join(DEFAULT_MODELS)}; with --fp8 {','.join(FP8_MODELS)}), or "
                   "'held-out' (models no table was tuned on); --list shows them")
    p.add_argument("--tokens", help="token counts, in order ('all' = "
                   f"{','.join(map(str, models.TOKENS))}; default "
                   f"{','.join(map(str, DEFAULT_TOKENS))})")
    p.add_argument("--proj", default="gate_up,down", help="projections (default both)")
    p.add_argument("--cases", help="comma-separated MODEL/PROJ/TOKENS cases, measured in "
                   "that order (instead of --models x --tokens x --proj; e.g. to measure a "
                   "few rows of a --resume FILE again with --rerun)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="wall seconds for the whole run; cases that would not fit are listed "
                   "as not run (default %(default)s)")
    p.add_argument("--reps", type=int, default=None,
                   help=f"interleaved rounds per case (default {DEFAULT_REPS})")
    p.add_argument("--quack-tuned", action=argparse.BooleanOptionalAction, default=True,
                   help="time QuACK with tuned=True (default on)")
    p.add_argument("--quack-tune-cap-s", type=float, default=QUACK_TUNE_CAP_S,
                   help="skip QuACK tuned where its autotune would take longer (default "
                   "%(default)s)")
    p.add_argument("--quack-cache", metavar="DIR", help="QuACK's own autotune cache "
                   "(QUACK_CACHE_DIR, QUACK_CACHE_AUTOTUNING=1): QuACK tuned's timings per "
                   "shape are kept in DIR, and a later run on the same GPU kind reads its "
                   "choice there instead of autotuning again (raise --quack-tune-cap-s then)")
    p.add_argument("--quack-chosen", metavar="FILE", help="an earlier zoo run on this GPU "
                   "kind: QuACK tuned runs the config its autotuner chose there for each case "
                   "FILE has (no autotune; the row's chosen says 'replayed'), autotuning only "
                   "the others")
    p.add_argument("--resume", metavar="FILE", help="keep FILE's finished cases, run the rest")
    p.add_argument("--rerun", action="store_true", help="with --resume: measure this run's "
                   "cases again where FILE has them too (e.g. after a retune), keeping FILE's "
                   "other cases (and the earlier rows of any the budget leaves: not_rerun); each case "
                   "records which run measured it")
    p.add_argument("--seed", type=int, default=1234, help="routing and data seed")
    p.add_argument("--out", help="JSON path (default benchmarks/results/zoo-<device>-<date>."
                   "json)")
    p.add_argument("--out-dir", help="write zoo-<device>-<date>.json (and the PNG) here "
                   "instead (not with --out)")
    p.add_argument("--png", help="PNG path (default beside the JSON; 'none' to skip)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu")
    p.add_argument("--skip-impl", action="append", metavar="NAME", help="leave out an "
                   "implementation by exact name (repeatable)")
    p.add_argument("--smoke", action="store_true", help="tiny stand-ins, torch backend: checks "
                   "the harness (CPU is fine)")
    p.add_argument("--shard", type=parse_shard, metavar="I/N", help="run shard I of N of the "
                   "cases (every N-th, from the I-th): one process per GPU "
                   "(CUDA_VISIBLE_DEVICES=I), each with its own --out; --merge joins them")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="run on N GPUs at once "
                   "(the first N visible): one shard per GPU, joined into --out at the end")
    p.add_argument("--merge", action="append", default=[], metavar="FILE",
                   help="join these runs' JSON (repeatable, in order: a later file's case "
                   "replaces an earlier one's) into --out (or the default path) with the bar "
                   "derived again, and exit; no GPU needed")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def run_on_gpus(args: argparse.Namespace, argv: list[str]) -> int:
    """`--gpus N`: this command once per GPU on shard i of N (each its own JSON in a temporary
    folder), then the shards joined (on top of --resume's file, when given) into --out."""
    clash = [o for o, on in (("--shard", args.shard is not None), ("--device", args.device))
             if on]
    if clash:
        print(f"error: --gpus picks the shards and devices itself; drop {' and '.join(clash)}",
              file=sys.stderr)
        return 2
    try:
        gpus = gpu_ids(args.gpus, None if args.smoke else torch.cuda.device_count())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    tmp, codes, parts = launch_shards("benchmarks.zoo", argv, gpus, "zoo", ["--png", "none"], log)
    args.merge = ([args.resume] if args.resume else []) + parts
    rc = merge(args) if parts else 1
    return finish_shards("error", gpus, codes, len(parts), rc, tmp)


def merge(args: argparse.Namespace) -> int:
    """`--merge`: one document from several runs' (see zoo_report.merge_docs)."""
    from moe_gemm.ops.tuned import device_slug

    try:
        docs = [(f, loads_json(Path(f).read_text())) for f in args.merge]
        doc = zoo_report.merge_docs(docs)
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        print(f"error: --merge: {exc}", file=sys.stderr)
        return 2
    stem = "zoo-fp8" if doc.get("settings", {}).get("dtype") == FP8 else "zoo"
    # (As a run checks them: an --out naming a folder raised out of write_json with a
    # traceback, and a --png folder was "written" as <folder>.png.)
    paths = _output_paths(args, stem, device_slug(str(doc.get("device"))), doc.get("date"))
    if paths is None:
        return 2
    out_path, png = paths
    write_json(out_path, doc)
    notes = [f"wrote {out_path} ({len(doc['cases'])} cases from {len(docs)} files)"]
    if png is not None:
        why = zoo_report.plot_png(doc, png)
        notes.append(f"wrote {png}" if why is None else f"warning: {why}")
    print("; ".join(notes), flush=True)
    print(zoo_report.format_table(doc), flush=True)
    return 0



def _output_paths(args: argparse.Namespace, stem: str, device: str, date: object
                  ) -> tuple[Path, Path | None] | None:
    """The results file (--out, else <stem>-<device>-<date>.json in --out-dir or
    benchmarks/results) and the PNG (--png, none, or beside it); None after printing why one
    of them cannot be written."""
    out_path = Path(args.out) if args.out else (
        Path(args.out_dir or "benchmarks/results") / f"{stem}-{device}-{date}.json")
    png = None if (args.png or "").lower() == "none" else (
        Path(args.png) if args.png else out_path.with_suffix(".png"))
    for option, path in (("--out", out_path), ("--png", png)):
        if path is not None and (why := output_problem(path, option)):
            print(f"error: {why}", file=sys.stderr)
            return None
    return out_path, png

def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m benchmarks.zoo` and `moe-gemm bench --suite zoo`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.list:
        # --models and --fp8 narrow the list as they narrow a run (an unknown name is refused,
        # not answered with every model).
        try:
            listed = models.MODELS if args.models is None else models.select_models(args.models)
        except ValueError as exc:
            print(f"error: --models: {exc}", file=sys.stderr)
            return 2
        for m in (m for m in listed if m.fp8_id or not args.fp8):
            star = "*" if m.name in DEFAULT_MODELS else " "
            fp8 = f"  FP8: {m.fp8_id}" if m.fp8_id else ""
            print(f"{star} {m.name:18s} E={m.experts:<4d} top-{m.top_k} hidden={m.hidden:<5d} "
                  f"intermediate={m.intermediate:<5d} {m.layout}  {m.hf_id}{fp8}")
        print("(* = in the default subset; --fp8 takes the models with an FP8 checkpoint)")
        return 0
    if why := empty_option(args, NONEMPTY):
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.out and args.out_dir and args.shard is None:
        # (--out won and --out-dir was ignored without a word. A --gpus run's shards are
        # given their own --out after the caller's options, so a shard may carry both.)
        print("error: --out and --out-dir both name the results file: give one",
              file=sys.stderr)
        return 2
    if args.merge:
        return merge(args)
    # Checked before --gpus starts its shards, so that a bad argument is one error, not N.
    # --reps 0 is refused (as `moe-gemm bench --reps 0` is), not read as the default.
    args.reps = args.reps if args.reps is not None else (2 if args.smoke else DEFAULT_REPS)
    proj = [p.strip() for p in args.proj.split(",")]  # (an empty one: refused below)
    why = ("--reps must be at least 1" if args.reps < 1
           else "--proj must be a subset of gate_up,down"
           if not set(proj) <= {"gate_up", "down"} or not proj
           # A budget <= 0 (or nan) would run no case and still write a JSON and exit 0.
           else "--budget-s must be positive" if not args.budget_s > 0
           else "--quack-tune-cap-s must be positive" if not args.quack_tune_cap_s > 0
           else "--rerun re-measures cases of a --resume FILE; give one"
           if args.rerun and not args.resume else None)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if why := unknown_skip(args.skip_impl, impl_names(args.fp8)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        if args.cases is not None and (args.models is not None or args.tokens is not None
                                       or set(proj) != {"gate_up", "down"}):
            raise ValueError("--cases names the cases itself: give it or --models / --tokens "
                             "/ --proj, not both")
        selected_cases(args, proj, True)
        if args.quack_chosen:
            read_quack_chosen(args.quack_chosen)
        if args.resume:
            old = read_resume(args.resume)
            if args.gpus != 1:  # (else each shard refuses it: one error, not N; they and a
                # one-GPU run check the device, known only there)
                check_resume(args.resume, old, run_settings(args))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.quack_cache and (why := use_quack_cache(args.quack_cache)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.gpus != 1:  # (the shards inherit the environment, QuACK's cache among it)
        return run_on_gpus(args, argv)
    args.proj = proj
    try:
        device = bench_device(args.device, args.smoke, "the zoo (GBs of weights)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name, _, _ = device_info(device)
    from moe_gemm.ops.tuned import device_slug

    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    # Paths that cannot be written fail now, in one line, not after every case ran.
    paths = _output_paths(args, "zoo-fp8" if args.fp8 else "zoo", device_slug(name), date)
    if paths is None:
        return 2
    out_path, png = paths
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # smoke timings mean nothing; keep a loaded CI machine calm
    try:
        doc = run(args, argv, device, out_path, png, log)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    write_json(out_path, doc)
    notes = [f"wrote {out_path}"]
    if png is not None:
        why = zoo_report.plot_png(doc, png)
        notes.append(f"wrote {png}" if why is None else f"warning: {why}")
    print("; ".join(notes), flush=True)
    print(zoo_report.format_table(doc), flush=True)
    failed = our_failures(doc)
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

