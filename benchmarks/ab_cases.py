"""What the zoo A/B scripts share (benchmarks.pick_ab, benchmarks.env_ab, benchmarks.same_config):
their choice of zoo cases, the case fields on each row, and the line that sums up one variant's
ratios over them."""

from __future__ import annotations

import argparse
import statistics

from benchmarks.runner import names_problem, split_names, zoo_tokens_problem
from benchmarks.zoo import build_cases, named_cases
from moe_gemm.tuning.argcheck import empty_option


def add_case_options(p: argparse.ArgumentParser) -> None:
    """--cases, or --models x --tokens x --projs."""
    p.add_argument("--cases", help="comma-separated MODEL/PROJ/TOKENS zoo cases (instead of "
                   "--models x --tokens x --projs)")
    p.add_argument("--models", default="all", help="zoo models (default: all)")
    p.add_argument("--tokens", default="2048,8192", help="token counts (default: %(default)s)")
    p.add_argument("--projs", default="gate_up,down", help="projections (default: both)")


def cases_from_args(args: argparse.Namespace, fp8: bool = False) -> list:
    """The (ShapeSpec, fields) zoo cases the options name (ValueError naming a bad one);
    with fp8, the FP8 cases of models that ship FP8 checkpoints (--models all: those)."""
    # An empty value or item is refused, not read as the default or left out: `--cases ""`
    # (an unset shell variable) ran every default case, and `--models "a,"` stood for 'a'.
    if why := (empty_option(args, ["cases", "models", "tokens", "projs"])
               or names_problem(args.models, None, "--models")
               or zoo_tokens_problem(args.tokens)):
        raise ValueError(why)
    projs = split_names(args.projs)
    if any(p not in ("gate_up", "down") for p in projs):
        raise ValueError(f"--projs takes gate_up and/or down; got {args.projs!r}")
    if args.cases is not None:
        return named_cases(args.cases, args.seed, False, fp8)
    models = None if fp8 and args.models == "all" else args.models
    return build_cases(models, args.tokens, projs, args.seed, False, fp8)


CASE_FIELDS = ("model", "proj", "tokens", "E", "N", "K", "rows", "layout")


def table_key(case: dict) -> tuple:
    """A zoo case's (or row's) exact key in a tuned table: bf16 varlen, its rows-per-expert
    bucket."""
    from moe_gemm.ops.tuned import rows_bucket

    return ("varlen", "bfloat16", "bfloat16", case["E"], case["N"], case["K"],
            rows_bucket(case["rows"] / case["E"]))


def tag_rows(rows: list[dict], name: str, fields: dict, **extra) -> None:
    """Put the zoo case (its name and CASE_FIELDS of `fields`) and `extra` on each row."""
    for r in rows:
        r.update(case=name, **{k: fields[k] for k in CASE_FIELDS}, **extra)


def ratio_line(label: str, ratios: list[float]) -> str:
    """'<label> over N cases: median, min, max; >1% faster on a, >1% slower on b' of time
    ratios (above 1: faster than the baseline)."""
    ratios = sorted(ratios)
    return (f"{label} over {len(ratios)} cases: median {statistics.median(ratios):.3f}, min "
            f"{ratios[0]:.3f}, max {ratios[-1]:.3f}; >1% faster on "
            f"{sum(x > 1.01 for x in ratios)}, >1% slower on {sum(x < 0.99 for x in ratios)}")
