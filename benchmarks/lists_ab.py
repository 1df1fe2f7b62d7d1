"""grouped_gemm on lists of problems: our default pick against pinned configs, same process.

    python -m benchmarks.lists_ab [--cases "132x16x4096x4096,264x16x2048x7168"]
        [--configs "coop 128x256 c1x2;pp 64x256"] [--b-layout kn|nk] [--peers] [--reps 15]
        [--out FILE]

The varlen A/B scripts (pick_ab, env_ab) run zoo cases; this one runs the general form, where
the choice reads the list's problem sizes (ops/choice_rules.py), e.g. lists of at least as many
short problems as SMs on long K, which a config rule once sent to a 128-row cooperative tile.
A case is written PxMxNxK: P problems of (M, N, K), each with its own A (M, K) and B
allocations; B (K, N) row-major as in the suite's general shapes (--b-layout kn), or the
transposed view of an (N, K) weight as nn.Linear stores it (nk): the kernels differ, and so
may the better pick. Each case goes through the suite's harness
(every output checked against a float32 reference first, then back-to-back samples behind a
sleep backlog, interleaved round by round); our default (config=None) first, then each
config as `moe-gemm tune` names it, then with --peers torch's grouped_mm and the torch.mm loop
in a CUDA graph. Rows carry `vs_default` = the default's time / this one's (above 1: this one
faster), and the table prints us | TFLOP/s | GB/s | ratio.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.runner import (
    ab_start,
    add_ab_options,
    config_fields,
    names_problem,
    run_shape,
    split_names,
)
from benchmarks.suite import (
    DEFAULT_NAME,
    GROUPED_MM_NAME,
    Impl,
    ShapeSpec,
    _build_graph,
    _build_grouped_mm,
    _ours,
)
from moe_gemm.tuning import space

DEFAULT_CASES = ("132x16x4096x4096", "132x64x4096x4096", "200x32x4096x4096",
                 "264x16x2048x7168", "132x1x4096x4096", "160x48x1536x4096")
DEFAULT_CONFIGS = ("coop 128x256 c1x2",)


def parse_cases(text: str) -> list[tuple[int, int, int, int]]:
    """'PxMxNxK,...' -> [(P, M, N, K)]: P >= 1 problems, M >= 0, N and K >= 1 (ValueError
    naming the case otherwise)."""
    if why := names_problem(text, None, "--cases"):
        raise ValueError(why)
    cases = []
    for case in split_names(text):
        parts = case.split("x")
        if len(parts) != 4 or not all(p.isascii() and p.isdigit() for p in parts):
            raise ValueError(f"--cases: {case!r} (expected PxMxNxK, four counts)")
        P, M, N, K = (int(p) for p in parts)
        if P < 1 or N < 1 or K < 1:
            raise ValueError(f"--cases: {case!r} (P, N and K must be at least 1)")
        cases.append((P, M, N, K))
    return cases


def parse_configs(text: str) -> list[dict]:
    """';'-separated config names -> their fields, each buildable (ValueError otherwise)."""
    return config_fields(text, form="general") if text else []


def implementations(configs: list[dict], peers: bool) -> list[Impl]:
    impls = [Impl(DEFAULT_NAME, False, _ours(None), default=True, notes="config=None")]
    for fields in configs:
        cfg = space.config_of(fields)
        impls.append(Impl(f"moe_gemm {space.name_of(fields)}", False, _ours(cfg), config=cfg))
    if peers:
        impls.append(Impl(GROUPED_MM_NAME, True, _build_grouped_mm,
                          notes="2D x 3D, operands concatenated outside the timed region"))
        impls.append(Impl("torch.mm loop (CUDA graph)", True, _build_graph,
                          notes="one torch.mm per problem, captured once and replayed"))
    return impls


def add_ratios(rows: list[dict[str, Any]], flops: float, nbytes: float) -> list[str]:
    """TFLOP/s, GB/s and vs_default on every timed row; the table's lines."""
    default = next((r for r in rows if r["impl"] == DEFAULT_NAME and r.get("ms")), None)
    nan = float("nan")
    lines = []
    for r in rows:
        ms = r.get("ms")
        if not ms:
            lines.append(f"  {r['impl']:34s} | {r.get('status', 'not timed')}")
            continue
        r["tflops"], r["gbps"] = flops / ms / 1e9, nbytes / ms / 1e6
        if default is not None:
            r["vs_default"] = default["ms"] / ms
        lines.append(f"  {r['impl']:34s} | {ms * 1e3:9.1f} us | {r['tflops']:6.1f} TFLOP/s | "
                     f"{r['gbps']:7.1f} GB/s | {r.get('vs_default', nan):.3f}")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lists_ab",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(DEFAULT_CASES),
                   help="comma-separated PxMxNxK cases (default: %(default)s)")
    p.add_argument("--configs", default=";".join(DEFAULT_CONFIGS),
                   help="';'-separated configs as `moe-gemm tune` names them, timed beside the "
                   "default (default: %(default)s)")
    p.add_argument("--b-layout", choices=("kn", "nk"), default="kn",
                   help="each B's storage: (K, N) row-major, or the transposed view of an "
                   "(N, K) weight (default: %(default)s)")
    p.add_argument("--peers", action="store_true",
                   help="also torch's grouped_mm and the torch.mm loop in a CUDA graph")
    add_ab_options(p, reps=15)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = ab_start(args, argv, "lists_ab", "our kernels are Hopper kernels",
                       lambda: (parse_cases(args.cases), parse_configs(args.configs)))
    if started is None:
        return 2
    (cases, configs), run = started
    doc = run.doc
    impls = implementations(configs, args.peers)
    print("impl | us | TFLOP/s | GB/s | default / this")
    for P, M, N, K in cases:
        name = f"{P}x{M}x{N}x{K}"
        spec = ShapeSpec(name=name, form="general", dtype="bf16",
                         description=f"{P} problems of (M={M}, N={N}, K={K})",
                         problems=((M, N, K),) * P, b_layout=args.b_layout.upper())
        print(f"{name}: {spec.description}", flush=True)
        first = len(doc["results"])
        run_shape(run, spec, impls)
        rows = doc["results"][first:]
        for r in rows:
            r.update(case=name, problems=P, M=M, N=N, K=K, b_layout=args.b_layout)
        flops = 2.0 * P * M * N * K
        nbytes = 2.0 * P * (M * K + K * N + M * N)
        print("\n".join(add_ratios(rows, flops, nbytes)), flush=True)
        run.save()
    failed = [r["impl"] for r in doc["results"] if r.get("status") == "error"]
    for impl in dict.fromkeys(failed):
        print(f"lists_ab: {impl} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
