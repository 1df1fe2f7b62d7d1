"""DRAM and L2 bytes of our default and the peers on zoo projections or the benchmark suite,
measured by ncu (GPU).

    python -m benchmarks.dram_traffic [--models M,...] [--tokens 2048,8192] \
        [--impls ours,grouped_mm,mm_loop,quack,quack_tuned] [--fp8] [--out traffic.json]
    python -m benchmarks.dram_traffic --suite [--only moe-prefill,...] [--out traffic.json]

For each case (a zoo projection at a token count with the zoo's seeded routing, or a shape of
`moe-gemm bench`'s suite with its routing) and implementation,
a worker process (this module with --worker) builds the inputs, runs the implementation twice
(compiles, autotunes, warms caches of handles), then once between cudaProfilerStart and
cudaProfilerStop; ncu (--profile-from-start off, caches flushed before each kernel) measures
every kernel of that call: DRAM bytes read and written, L2 (lts) bytes, GPU time, and the
tensor pipe's, L2's and DRAM's utilization (percent of peak). A row sums the bytes over the
call's kernels (the mm loop launches one per expert) and divides the DRAM bytes
read by the compulsory ones: every problem's A rows read once and the weights of every
problem (expert) that has rows read once. An implementation that does not take a case's
form (QuACK's varlen GEMM on separate per-problem lists) is listed as not applicable. Re-reads of a weight or activation panel that left L2 before its next use show up as a
ratio above 1; the kernel v2 target is <= 1.15 on compute-bound shapes.

ncu serializes and replays kernels: its times are for reading beside the bytes, not for
comparing speed (that is `moe-gemm bench --suite zoo`).
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

METRICS = {
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
    "lts__t_bytes.sum": "l2_bytes",
    "gpu__time_duration.sum": "gpu_ns",
}
# Utilizations (percent of peak), read beside the bytes: where the time goes. Averaged over a
# call's kernels weighted by their time. The tensor pipe's counter covers wgmma on sm_90 (ncu
# on an H200 did not report the gmma-specific sm__pipe_tensor_op_gmma_* name). One that ncu
# does not report is left out of the row; a run whose ncu refuses one is repeated without them.
UTILIZATION = {
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pct",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
}
# With --stalls: why warps did not issue, as warps stalled per issued instruction for each
# reason (ncu's WarpStateStats ratios), and the issue slots' use. Between two kernels of the
# same tile the reason that grows tells where cycles go: `barrier` (named barriers: the
# epilogue's, ping-pong's order), `long_scoreboard` (global/L2 loads), `wait` (fixed-latency
# dependences: wgmma waits), `sleeping`/`branch_resolving` (mbarrier try-wait loops),
# `math_pipe_throttle` (the tensor pipe busy), `mio_throttle` / `short_scoreboard` (shared
# memory, stmatrix), `membar` (fences).
STALL_REASONS = ("barrier", "long_scoreboard", "short_scoreboard", "wait", "math_pipe_throttle",
                 "mio_throttle", "membar", "sleeping", "branch_resolving", "dispatch_stall",
                 "no_instruction", "lg_throttle")
STALLS = {
    **{f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio": f"stall_{r}"
       for r in STALL_REASONS},
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
}
# With --fabric: the L2 sectors that crossed the fabric between the L2's two partitions (an
# SM's request served by the far partition), summed over the kernels like the bytes: between two
# rasters of one tile that read alike from DRAM, the one whose CTAs share data across the
# partitions pays it here.
FABRIC = {"lts__t_sectors_srcunit_ltcfabric.sum": "l2_fabric_sectors"}
OPTIONAL = {**UTILIZATION, **STALLS, **FABRIC}
IMPLS = ("ours", "grouped_mm", "mm_loop", "quack", "quack_tuned")
FP8_IMPLS = ("ours_fp8_block", "ours_fp8_row", "torch_fp8_row")
DEFAULT_IMPLS = ("ours", "quack", "mm_loop")
WORKER_TIMEOUT_S = 600.0


def compulsory_bytes(counts: list[int], n: int, k: int, itemsize: int = 2,
                     out_itemsize: int = 2) -> tuple[int, int]:
    """(bytes read, bytes written) that any implementation must move: x (rows x K) and the
    (K x N) weights of every expert with rows, read once (FP8: 1 byte each, scales not
    counted); the (rows x N) output written once (bf16)."""
    return compulsory_of_sizes([(m, n, k) for m in counts], itemsize, out_itemsize)


def compulsory_of_sizes(sizes: list[tuple[int, int, int]], itemsize: int = 2,
                        out_itemsize: int = 2) -> tuple[int, int]:
    """compulsory_bytes for problems of any sizes (M, N, K), each with its own A and B: a
    problem with rows reads its A and B once and writes its C once; an empty one moves
    nothing."""
    used = [(m, n, k) for m, n, k in sizes if m > 0]
    return (sum(m * k + k * n for m, n, k in used) * itemsize,
            sum(m * n for m, n, _ in used) * out_itemsize)


def _number(raw: str) -> float:
    raw = raw.replace(",", "").strip()
    return float(raw) if raw not in ("", "n/a") else 0.0


def parse_ncu_csv(text: str, metrics: dict[str, str] = METRICS,
                  optional: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The kernels of `ncu --csv --print-units base` output, one dict per kernel with METRICS'
    short names (plus "kernel"), in launch order. Reads both layouts: `--page raw` (a row per
    kernel, a column per metric, then a units row without an ID) and the details page (a row
    per kernel and metric: "Metric Name", "Metric Value"). Lines that are not CSV (ncu's
    ==PROF== notes, the program's prints) are skipped; thousands separators are tolerated.
    ValueError when the output has CSV but not the metrics asked for."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    reader = csv.reader(io.StringIO("\n".join(lines)))
    header = next(reader)
    col = {name: i for i, name in enumerate(header)}
    if "ID" not in col:
        raise ValueError("ncu output has no ID column")
    kernels: dict[int, dict[str, Any]] = {}
    long_form = "Metric Name" in col and "Metric Value" in col
    for row in reader:
        if len(row) != len(header) or not row[col["ID"]].strip().isdigit():
            continue
        rec = kernels.setdefault(int(row[col["ID"]]), {
            "kernel": row[col["Kernel Name"]] if "Kernel Name" in col else ""})
        if long_form:
            short = metrics.get(row[col["Metric Name"]])
            if short is not None:
                rec[short] = _number(row[col["Metric Value"]])
        else:
            for metric, short in metrics.items():
                if metric in col:
                    rec[short] = _number(row[col[metric]])
    out = [kernels[i] for i in sorted(kernels)]
    missing = sorted({m for m, short in metrics.items() for r in out
                      if short not in r and m not in optional})
    if missing:
        raise ValueError(f"ncu output lacks {', '.join(missing)}")
    return out


def summarize(kernels: list[dict[str, Any]], sizes: list[tuple[int, int, int]],
              itemsize: int = 2) -> dict[str, Any]:
    """One row's sums and ratios from its kernels: sizes are the problems' (M, N, K); itemsize
    the operands' (1 for FP8)."""
    read, write = compulsory_of_sizes(sizes, itemsize)
    tot = {short: sum(kr[short] for kr in kernels) for short in METRICS.values()}
    for short in OPTIONAL.values():
        if not all(short in kr for kr in kernels):
            continue
        if short in FABRIC.values():
            tot[short] = sum(kr[short] for kr in kernels)
        elif tot["gpu_ns"] > 0:
            tot[short] = sum(kr[short] * kr["gpu_ns"] for kr in kernels) / tot["gpu_ns"]
    return {
        "kernels": len(kernels),
        "kernel_names": sorted({kr["kernel"][:80] for kr in kernels}),
        **tot,
        "us": tot["gpu_ns"] / 1e3,
        "compulsory_read": read,
        "compulsory_write": write,
        "read_ratio": tot["dram_read"] / read if read else None,
        "write_ratio": tot["dram_write"] / write if write else None,
        "l2_per_compulsory": tot["l2_bytes"] / (read + write) if read + write else None,
    }


# ---------------------------------------------------------------------------------------------
# The worker: one implementation, one case, one profiled call


def _config_of(name: str):
    """The GemmConfig of an "ours:<config>" implementation (ValueError if unreadable)."""
    from moe_gemm.tuning.space import config_of, parse_name

    return config_of(parse_name(name.split(":", 1)[1]))


def _impl(name: str):
    from benchmarks import suite, suite_fp8

    if name.startswith("ours:"):
        return suite._ours(_config_of(name))
    return {
        "ours": suite._ours(None),
        "grouped_mm": suite._build_grouped_mm,
        "mm_loop": suite._build_loop,
        "quack": suite._build_quack,
        "quack_tuned": suite._build_quack_tuned,
        "ours_fp8_block": suite_fp8.ours_fp8("block"),
        "ours_fp8_row": suite_fp8.ours_fp8("row"),
        "torch_fp8_row": suite_fp8._torch_peer("row"),
    }[name]


SUITE_PREFIX = "suite/"
NOT_APPLICABLE_RC = 4  # the worker's exit status when the implementation does not take the case


def suite_cases(only: str | None) -> list[tuple[Any, dict[str, Any]]]:
    """(ShapeSpec, fields) of the benchmark suite's 16-bit shapes (all of them, or the names in
    `only`; ValueError naming an unknown one)."""
    from benchmarks.runner import names_problem, split_names
    from benchmarks.suite import full_suite

    specs = full_suite()
    # (an empty name, as a trailing comma leaves, is unknown: refused, not dropped)
    if only is not None and (why := names_problem(only, [s.name for s in specs], "--only")):
        raise ValueError(why)
    names = [] if only is None else split_names(only)
    return [(s, {"suite": s.name, "form": s.form, "dtype": s.dtype, "shape": s.description})
            for s in specs if not names or s.name in names]


def _case_spec(case: str, seed: int):
    """The ShapeSpec a worker's case name stands for, or None."""
    if case.startswith(SUITE_PREFIX):
        from benchmarks.suite import full_suite

        return next((s for s in full_suite() if s.name == case[len(SUITE_PREFIX):]), None)
    from benchmarks.zoo import build_cases

    parts = case.split("/")  # model/proj/tokens, and /fp8 for an FP8 case
    if len(parts) < 3:
        return None
    try:
        cases = build_cases(parts[0], parts[2], [parts[1]], seed, smoke=False,
                            fp8=parts[3:] == ["fp8"])
    except ValueError:
        return None
    return next((spec for spec, _ in cases if spec.name == case), None)


def worker(case: str, impl: str, seed: int) -> int:
    import torch

    from benchmarks.suite import NotApplicable, make_inputs

    spec = _case_spec(case, seed)
    if spec is None:
        print(f"error: no zoo or suite case {case!r}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    inp = make_inputs(spec, spec.counts(seed), device, seed)
    try:
        prepared = _impl(impl)(spec, inp, device)
    except NotApplicable as exc:
        print(f"not applicable: {exc}", file=sys.stderr)
        return NOT_APPLICABLE_RC
    for _ in range(2):
        prepared.run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    prepared.run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


# ---------------------------------------------------------------------------------------------
# The driver


def ncu_command(ncu: str, case: str, impl: str, seed: int,
                metrics: dict[str, str] = METRICS) -> list[str]:
    return [ncu, "--profile-from-start", "off", "--cache-control", "all",
            "--metrics", ",".join(metrics), "--csv", "--page", "raw", "--print-units", "base",
            sys.executable, "-m", "benchmarks.dram_traffic", "--worker", case, impl,
            "--seed", str(seed)]


def _profile(ncu: str, case: str, impl: str, seed: int, metrics: dict[str, str]):
    """(kernels, error, returncode) of one profiled worker run."""
    try:
        res = subprocess.run(ncu_command(ncu, case, impl, seed, metrics), capture_output=True,
                             text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {WORKER_TIMEOUT_S:.0f} s", None
    try:
        kernels = parse_ncu_csv(res.stdout, metrics, optional=tuple(OPTIONAL))
    except ValueError as exc:
        return [], str(exc), res.returncode
    if res.returncode != 0 or not kernels:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return [], " | ".join(tail) or "no kernel profiled", res.returncode
    return kernels, None, 0


def stall_summary(row: dict[str, Any], top: int = 4) -> str:
    """'issue 41% | long_scoreboard 2.10, barrier 0.84, ...': the row's largest stall ratios."""
    ratios = sorted(((row[f"stall_{r}"], r) for r in STALL_REASONS if f"stall_{r}" in row),
                    reverse=True)[:top]
    if not ratios:
        return ""
    issue = row.get("issue_pct")
    head = "" if issue is None else f"issue {issue:.0f}% | "
    return head + ", ".join(f"{r} {v:.2f}" for v, r in ratios)


def measure(ncu: str, case: str, impl: str, seed: int, fields: dict[str, Any],
            sizes: list[tuple[int, int, int]], utilization: bool = True,
            stalls: bool = False, fabric: bool = False) -> dict[str, Any]:
    """One profiled row: sizes are the case's problems (M, N, K)."""
    row: dict[str, Any] = {"case": case, "impl": impl, **fields}
    t0 = time.perf_counter()
    # The optional metric groups asked for, each with the row key that says what it lacks.
    groups = [(g, key) for g, key, on in ((UTILIZATION, "utilization_error", utilization),
                                          (STALLS, "stall_error", stalls),
                                          (FABRIC, "fabric_error", fabric)) if on]

    def asked() -> dict[str, str]:
        return {**METRICS, **{m: short for g, _ in groups for m, short in g.items()}}

    kernels, error, rc = _profile(ncu, case, impl, seed, asked())
    while error and groups and "metric" in error.lower():
        # An ncu that refuses an optional metric's name: without the last group asked for
        # (the fabric sectors, the stall ratios, then the utilizations). Any other failure
        # (the worker's own) would only fail again.
        _, key = groups.pop()
        row[key] = error
        kernels, error, rc = _profile(ncu, case, impl, seed, asked())
    for group, key in groups if kernels else ():
        unreported = [m for m, short in group.items() if not all(short in kr for kr in kernels)]
        if unreported:
            row[key] = f"ncu did not report {', '.join(unreported)}"
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    if error and (rc == NOT_APPLICABLE_RC or "not applicable:" in error):
        # (the worker's exit status, or its message where ncu returns a status of its own)
        return {**row, "status": "not_applicable", "why": error}
    if error:
        return {**row, "status": "error", "returncode": rc, "error": error}
    itemsize = 1 if impl in FP8_IMPLS else 2
    return {**row, "status": "ok", **summarize(kernels, sizes, itemsize)}


def _parser() -> argparse.ArgumentParser:
    from benchmarks.report import out_argument

    p = argparse.ArgumentParser(prog="python -m benchmarks.dram_traffic",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="comma-separated zoo models, or 'all' "
                   "(default: the zoo's default models)")
    p.add_argument("--tokens", default="2048,8192", help="token counts (default 2048,8192)")
    p.add_argument("--proj", default="gate_up,down", help="projections (default both)")
    p.add_argument("--impls", default=None,
                   help=f"comma-separated, from {', '.join(IMPLS)} and ours:<config> (our "
                   "kernel pinned to a config as `moe-gemm tune` names it: 'ours:pp 128x192 "
                   f"c2x1') (default {','.join(DEFAULT_IMPLS)}); with --fp8 from "
                   f"{', '.join(FP8_IMPLS)} (default all)")
    p.add_argument("--fp8", action="store_true",
                   help="the FP8 zoo cases (models with FP8 checkpoints), FP8 implementations")
    p.add_argument("--suite", action="store_true",
                   help="the shapes of `moe-gemm bench`'s suite instead of zoo projections")
    p.add_argument("--only", default=None,
                   help="with --suite: comma-separated suite shape names (default all)")
    p.add_argument("--seed", type=int, default=1234, help="routing and data seed (the zoo's)")
    p.add_argument("--out", type=out_argument, help="write the rows as JSON")
    p.add_argument("--ncu", default=None, help="the ncu executable (default: on PATH)")
    p.add_argument("--bytes-only", action="store_true",
                   help="leave out the utilization metrics (tensor pipe, L2, DRAM percent)")
    p.add_argument("--fabric", action="store_true",
                   help="also the L2 sectors that crossed between the L2's two partitions "
                   "(l2_fabric_sectors, 32 bytes each; a line under each row)")
    p.add_argument("--stalls", action="store_true",
                   help="also the warp stall ratios per issued instruction by reason and the "
                   "issue slots' use (a line under each row: its largest stalls)")
    p.add_argument("--worker", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.seed)
    from benchmarks.report import write_json
    from benchmarks.runner import names_problem, split_names, zoo_tokens_problem
    from benchmarks.zoo import build_cases
    from moe_gemm.tuning.argcheck import empty_option

    # An empty value or entry is refused, not read as the default or dropped: `--impls ""`
    # ran the default implementations, `--only ""` every suite shape, `--proj ","` nothing.
    if why := (empty_option(args, ["models", "tokens", "proj", "impls", "only", "ncu"])
               or (args.impls is not None and names_problem(args.impls, None, "--impls"))
               or (args.models is not None and names_problem(args.models, None, "--models"))
               or zoo_tokens_problem(args.tokens)
               or names_problem(args.proj, ["gate_up", "down"], "--proj")):
        print(f"error: {why}", file=sys.stderr)
        return 2
    allowed = FP8_IMPLS if args.fp8 else IMPLS
    impls = split_names(args.impls) if args.impls is not None else list(
        FP8_IMPLS if args.fp8 else DEFAULT_IMPLS)
    if bad := [s for s in impls if s not in allowed and (args.fp8 or not s.startswith("ours:"))]:
        print(f"error: unknown implementation(s) {', '.join(bad)}{' for --fp8' * args.fp8}; "
              f"expected some of {', '.join(allowed)}" + ("" if args.fp8 else
              " or ours:<config> (e.g. 'ours:pp 128x192 c2x1')"), file=sys.stderr)
        return 2
    for s in impls:
        if s.startswith("ours:"):
            try:
                _config_of(s)
            except (TypeError, ValueError) as exc:
                print(f"error: {s!r}: {exc}", file=sys.stderr)
                return 2
    if args.suite and (args.fp8 or args.models is not None):
        print("error: --suite takes the suite's shapes; leave out --fp8 and --models",
              file=sys.stderr)
        return 2
    if args.only is not None and not args.suite:
        print("error: --only names suite shapes; it needs --suite", file=sys.stderr)
        return 2
    projs = split_names(args.proj)
    try:  # (before looking for ncu: a bad --models is said here too, where there is none)
        if args.suite:
            cases = [(spec, {**fields, "case": SUITE_PREFIX + spec.name})
                     for spec, fields in suite_cases(args.only)]
        else:
            cases = build_cases(args.models, args.tokens, projs, args.seed, smoke=False,
                                fp8=args.fp8)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # shutil.which takes a path as well as a name, and only an executable file (an --ncu
    # folder passed os.path.exists, then every worker failed with PermissionError).
    ncu = shutil.which(args.ncu or "ncu")
    if not ncu:
        print(f"error: --ncu {args.ncu}: not an executable file" if args.ncu else
              "error: ncu (Nsight Compute) is not on PATH; pass --ncu", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {
        "date": datetime.now(timezone.utc).date().isoformat(),
        "argv": sys.argv[1:] if argv is None else argv,
        "method": "ncu --cache-control all --profile-from-start off: one call after two "
                  "warm-up calls; bytes summed over the call's kernels",
        "rows": [],
    }
    try:
        import torch

        doc["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - the name is informative only
        doc["device"] = None
    print(f"{'case':34} | {'impl':11} | {'us':>8} | {'DRAM rd GB':>10} | {'x compulsory':>12} "
          f"| {'L2 GB':>7} | {'tensor%':>7} | {'L2%':>5}", flush=True)
    for spec, fields in cases:
        case = fields.pop("case", spec.name)
        for impl in impls:
            row = measure(ncu, case, impl, args.seed, fields, spec.sizes(args.seed),
                          utilization=not args.bytes_only, stalls=args.stalls,
                          fabric=args.fabric)
            doc["rows"].append(row)
            if row["status"] == "ok":
                tensor, l2 = row.get("tensor_pct"), row.get("l2_pct")
                print(f"{case[:34]:34} | {impl:11} | {row['us']:8.1f} | "
                      f"{row['dram_read'] / 1e9:10.3f} | {row['read_ratio']:12.2f} | "
                      f"{row['l2_bytes'] / 1e9:7.2f} | "
                      f"{'-' if tensor is None else f'{tensor:.0f}':>7} | "
                      f"{'-' if l2 is None else f'{l2:.0f}':>5}", flush=True)
                if args.stalls and (summary := stall_summary(row)):
                    print(f"{'':34} | {'':11} | stalls/issue: {summary}", flush=True)
                if args.fabric and (sectors := row.get("l2_fabric_sectors")) is not None:
                    print(f"{'':34} | {'':11} | L2 fabric: {sectors * 32 / 1e9:.2f} GB "
                          f"({sectors * 32 / row['l2_bytes']:.0%} of L2 bytes)", flush=True)
            else:
                what = (f"not applicable: {row['why'][:50]}" if row["status"] == "not_applicable"
                        else f"error: {row['error'][:60]}")
                print(f"{case[:34]:34} | {impl:11} | {what}", flush=True)
            if args.out:
                write_json(Path(args.out), doc)
    return 0 if all(r["status"] in ("ok", "not_applicable") for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
