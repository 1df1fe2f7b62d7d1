"""Our default with one of the library's kernel switches set each way, on zoo cases, in one
process.

    python -m benchmarks.env_ab --switch MOE_GEMM_TRIM_A [--values 0,1] [--models all]
        [--tokens 2048,8192] [--projs gate_up,down] [--cases MODEL/PROJ/TOKENS,...]
        [--configs "pp 128x128;coop 128x256"] [--reps 10] [--out FILE]
    python -m benchmarks.env_ab --fp8 --switch MOE_GEMM_FP8_HALF_SKIP [--models ...] ...

Some kernel options are environment switches that grouped_mm's plan cache keys on (trimmed A
loads, the tail split): a change applies to the next call. Per zoo case this times our
default (tuned table, then the rules) and any pinned `--configs` once per switch value,
interleaved round by round through the zoo's harness (benchmarks.runner: the zoo's inputs and
routing, every output checked against a float32 reference first, then back-to-back samples
behind a sleep backlog). Without --configs, a case where the switch does not change the kernel
the default launches is skipped. Rows carry `switch_value` and `vs_first` = the
first value's time / this one's (above 1: faster than the first value). With --fp8 the cases
are the FP8 zoo's (models that ship FP8 checkpoints) and the rows our scaled_grouped_mm
default with block scales and with row-wise scales (labels fp8-block, fp8-row), each at
every value; --configs is not taken there.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

from benchmarks import suite_fp8
from benchmarks.ab_cases import add_case_options, cases_from_args, ratio_line, tag_rows
from benchmarks.runner import ab_run, add_ab_options, names_problem, run_shape, split_names
from benchmarks.suite import FP8, Impl, Prepared, _ours
from moe_gemm.tuning import space
from moe_gemm.tuning.argcheck import empty_option

OURS = "moe_gemm"


def with_switch(build: Callable, name: str, value: str) -> Callable:
    """An implementation builder whose calls run with `name` set to `value` (the plan cache
    keys on it, so each value keeps its own plan)."""

    def wrap(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            with mock.patch.dict(os.environ, {name: value}):
                return fn()
        return call

    def built(spec, inp, device: torch.device) -> Prepared:
        with mock.patch.dict(os.environ, {name: value}):
            prepared = build(spec, inp, device)
        return Prepared(wrap(prepared.run), wrap(prepared.check))

    return built


def launched_key(case: dict[str, Any], device: torch.device, name: str, value: str,
                 fp8: bool = False) -> object:
    """The kernel our default launches on a zoo case with the switch at `value` (fp8: the
    block-scaled and the row-wise kernels of scaled_grouped_mm, bf16 output)."""
    from moe_gemm.capability import device_name, sm_count
    from moe_gemm.tuning.zoo import default_kernel_key

    with mock.patch.dict(os.environ, {name: value}):
        if fp8:
            from moe_gemm.config import GemmConfig
            from moe_gemm.ops.heuristics_fp8 import choose_fp8
            from moe_gemm.ops.scaled_launch import fp8_compile_key

            avg = case["rows"] / case["E"]
            return tuple(fp8_compile_key("varlen", torch.float8_e4m3fn, torch.bfloat16, g,
                                         choose_fp8("varlen", GemmConfig(), avg, case["N"],
                                                    case["K"], 2, g))
                         for g in ("block", "row"))
        return default_kernel_key(case["E"], case["N"], case["K"], case["rows"],
                                  case.get("layout", "ENK"), device_name(device),
                                  sm_count(device))


def implementations(configs: list[str], name: str, values: list[str],
                    fp8: bool = False) -> list[Impl]:
    if fp8:  # our FP8 default, block-scaled and row-wise, at each value
        return [Impl(f"{OURS} fp8-{g} {name}={v}", peer=False,
                     build=with_switch(suite_fp8.ours_fp8(g), name, v), dtype=FP8, scale=g)
                for g in ("block", "row") for v in values]
    impls = []
    for label in ["default"] + configs:
        cfg = None if label == "default" else space.config_of(space.parse_name(label))
        for v in values:
            impls.append(Impl(f"{OURS} {label} {name}={v}", peer=False,
                              build=with_switch(_ours(cfg), name, v), config=cfg))
    return impls


def add_ratios(rows: list[dict[str, Any]], name: str, values: list[str]) -> list[str]:
    """switch_value and vs_first on the rows; the table's lines."""
    lines, nan = [], float("nan")
    by = {r["impl"]: r for r in rows}
    for r in rows:
        label, _, setting = r["impl"][len(OURS) + 1:].rpartition(" ")
        r["config_label"], r["switch_value"] = label, setting.split("=", 1)[1]
        first = by.get(f"{OURS} {label} {name}={values[0]}", {})
        if r.get("ms") and first.get("ms"):
            r["vs_first"] = first["ms"] / r["ms"]
        lines.append(f"  {label:24s} {name}={r['switch_value']:4s} | "
                     f"{(r.get('ms') or nan) * 1e3:9.1f} us | vs first "
                     f"{r.get('vs_first', nan):.3f}")
    return lines


def summary(results: list[dict[str, Any]], values: list[str]) -> list[str]:
    """Per config label and switch value, the median and range of vs_first over cases."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in results:
        if "vs_first" in r and r["switch_value"] != values[0]:
            groups.setdefault((r["config_label"], r["switch_value"]), []).append(r["vs_first"])
    return [ratio_line(f"{label} ={v}: vs ={values[0]}", ratios)
            for (label, v), ratios in sorted(groups.items())]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.env_ab",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--switch", required=True, help="a MOE_GEMM_* kernel switch")
    p.add_argument("--values", default="0,1", help="its values, the first the baseline "
                   "(default: %(default)s)")
    p.add_argument("--configs", help="';'-separated configs to time besides the default, as "
                   "`moe-gemm tune` names them ('pp 128x128;coop 128x256') (default: none)")
    p.add_argument("--fp8", action="store_true", help="the FP8 zoo's cases and our FP8 "
                   "default (block-scaled and row-wise)")
    add_case_options(p)
    add_ab_options(p, reps=10)
    return p


def main(argv: list[str] | None = None) -> int:
    from moe_gemm.env import LIBRARY_VARIABLES

    args = _parser().parse_args(argv)
    name = args.switch
    values = split_names(args.values)
    configs = [] if args.configs is None else split_names(args.configs, ";")
    try:
        # An empty value or item is refused, not dropped: `--configs "$C"` with C unset timed
        # the default alone, and `--values 0,1,` stood for 0,1.
        if why := (empty_option(args, ["values", "configs"])
                   or names_problem(args.values, None, "--values")
                   or (args.configs is not None
                       and names_problem(args.configs, None, "--configs", ";"))):
            raise ValueError(why)
        if name not in LIBRARY_VARIABLES:
            raise ValueError(f"--switch {name!r} is not one of the library's variables "
                             "(docs/USAGE.md lists them)")
        if len(values) < 2 or len(set(values)) != len(values):
            raise ValueError(f"--values needs two or more distinct values; got {args.values!r}")
        if args.fp8 and configs:
            raise ValueError("--configs is not taken with --fp8 (the FP8 default only)")
        for c in configs:
            space.config_of(space.parse_name(c))
        cases = cases_from_args(args, args.fp8)
    except ValueError as exc:
        print(f"env_ab: {exc}", file=sys.stderr)
        return 2
    run = ab_run(args, argv, "env_ab", "the switches are our Hopper kernels'",
                 settings={"switch": name, "values": values, "configs": configs,
                           "fp8": args.fp8})
    if isinstance(run, str):
        print(run, file=sys.stderr)
        return 2
    impls = implementations(configs, name, values, args.fp8)
    for spec, f in cases:
        keys = {launched_key(f, run.device, name, v, args.fp8) for v in values}
        if len(keys) == 1 and not configs:
            print(f"{spec.name}: skipped, {name} does not change the default's kernel here",
                  flush=True)
            continue
        print(f"{spec.name}: E={f['E']} N={f['N']} K={f['K']} rows={f['rows']}", flush=True)
        first = len(run.doc["results"])
        run_shape(run, spec, impls)
        rows = run.doc["results"][first:]
        tag_rows(rows, spec.name, f)
        print("\n".join(add_ratios(rows, name, values)), flush=True)
        run.save()
    lines = summary(run.doc["results"], values)
    if not lines:
        print("env_ab: no case timed two values: nothing to compare", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
