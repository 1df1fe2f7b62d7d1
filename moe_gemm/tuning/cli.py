"""`moe-gemm tune`: time our kernel configs on shapes and write a tuned table.

    moe-gemm tune --zoo [--models M,...] [--tokens T,...] [--out FILE] [--budget-s S]
    moe-gemm tune --shapes 128,1536,2048,4096,32768 --shapes 8,28672,4096,16384
    moe-gemm tune --shapes 8,28672,4096,16384 --configs "coop 128x256 s3;pp 128x192 c2x1"
                                        time only these configs and the rules' choice (an A/B,
                                        printed; no table is written)
    moe-gemm tune --list --zoo          what would be tuned (no GPU needed)
    moe-gemm tune --zoo --gpus 4 --out T.json   one shard per GPU, merged into T
    moe-gemm tune --zoo --shard 1/4 --no-merge --out t1.json   shard 1 of 4, by hand
    moe-gemm tune --merge t0.json --merge t1.json ... --out T.json
                                        add shards' tables into T (no GPU needed)
    moe-gemm tune --rerank T.json --zoo --tokens 8192 --out T.json
                                        time T's pick and its best rivals per shape against
                                        one another in the zoo's regime (moe_gemm.tuning.rerank)

A --shapes item is E,N,K,ROWS[,ROWS...]: E experts with (N, K) weights, one shape per ROWS
(routed rows for grouped_mm, rows per problem for --form batched). --zoo takes the MoE
projections of moe_gemm.tuning.zoo at the token counts given (tokens x top_k rows), in
priority order: every model at the first token count, then at the next, and so on. Those are
grouped_mm 2-D shapes in each checkpoint's own weight layout: --form (batched, general) and
--layout apply to --shapes only.

The table at --out (default ./tuned-<device>.json) is updated shape by shape and rewritten
atomically after each, so --budget-s (total wall seconds, compiles included) can stop the run
at any shape and the file holds everything that finished. Point MOE_GEMM_TUNED_TABLE at it to
use it, or ship it as moe_gemm/tables/<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time
from pathlib import Path

from moe_gemm.ops import tuned
from moe_gemm.tuning import rerank, space
from moe_gemm.tuning.argcheck import (
    cache_problem,
    choice_switches_set,
    empty_option,
    loads_json,
    output_problem,
)
from moe_gemm.tuning.shape_args import (  # noqa: F401 (re-exported: the benchmarks' A/Bs)
    DEFAULT_TOKENS,
    config_problem,
    parse_shape_items,
    zoo_shapes,
)
from moe_gemm.tuning.shards import parse_shard, take_shard
from moe_gemm.tuning.table_merge import NO_GPU, merge, out_path, refuse_out, run_on_gpus
from moe_gemm.tuning.timing import REST_MS, TARGET_MS, TIMINGS
from moe_gemm.tuning.tuner import FINAL_ROUNDS

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
               "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
SHAPE_BUDGET_S = 30.0
# Options whose empty value would read as "all" or "the default" (see empty_option).
NONEMPTY = ["models", "tokens", "shapes", "configs", "out", "out_dir", "report", "skip_table",
            "merge", "device", "rerank", "rivals", "rivals_file"]
FIRST_SHAPE_EST_S = 10.0


def _milliseconds(text: str, positive: bool) -> float:
    """A finite number of milliseconds, >= 0 (or > 0 where `positive`); the message states
    the bound of the option that takes it."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and (v > 0 if positive else v >= 0)):
        bound = "> 0" if positive else ">= 0"
        raise argparse.ArgumentTypeError(f"expected a finite number of milliseconds {bound}, "
                                         f"got {text!r}")
    return v


def _rest_ms(text: str) -> float:
    """--rest-ms: a finite number of milliseconds >= 0."""
    return _milliseconds(text, positive=False)


def _sample_ms(text: str) -> float:
    """--sample-ms: a finite number of milliseconds > 0."""
    return _milliseconds(text, positive=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-gemm tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zoo", action="store_true", help="tune the model zoo's projections")
    p.add_argument("--models", help="with --zoo: comma-separated model names, 'all' (the "
                   "default) or 'held-out' (models the shipped tables were not tuned on)")
    p.add_argument("--tokens", help="with --zoo: token counts, in priority order (default "
                   f"{','.join(map(str, DEFAULT_TOKENS))}; 'all')")
    p.add_argument("--shapes", action="append", default=[], metavar="E,N,K,ROWS[,ROWS...]",
                   help="shapes to tune (repeatable)")
    p.add_argument("--form", choices=["varlen", "batched", "general"], default="varlen",
                   help="for --shapes: grouped_mm 2-D (varlen), 3-D (batched) or grouped_gemm "
                   "lists (general); the zoo's shapes are always varlen")
    # default None, read as "ENK": a --layout given with --zoo alone is refused (see main).
    p.add_argument("--layout", choices=["ENK", "EKN"], default=None,
                   help="for --shapes: weights stored (E, N, K) K-contiguous (default) or "
                   "(E, K, N); the zoo's shapes take each model's own layout")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--out-dtype", choices=["bf16", "fp16", "fp32"], help="default: --dtype")
    p.add_argument("--out", help="table to write/update (default ./tuned-<device>.json)")
    p.add_argument("--out-dir", help="write/update <device>.json here instead (the name the "
                   "package ships it under in moe_gemm/tables)")
    p.add_argument("--no-merge", action="store_true",
                   help="start a new table instead of adding to the one at --out (replacing "
                   "a file there that is no table for this device)")
    p.add_argument("--resume", action="store_true",
                   help="skip shapes the table at --out already has an entry for (continue an "
                   "earlier run; without it, shapes already there are tuned again)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new shapes so the run ends within this many seconds")
    p.add_argument("--shape-budget-s", type=float, default=SHAPE_BUDGET_S,
                   help="at most this long on one shape's search")
    p.add_argument("--rounds", type=int, default=FINAL_ROUNDS,
                   help="timed rounds of the final stage (default %(default)s)")
    p.add_argument("--rest-ms", type=_rest_ms, default=None, help="GPU rest before each "
                   f"timed sample, ms (default {REST_MS}, as the benchmarks sample; 0: back to "
                   "back, the sustained power-limited regime, which ranks configs "
                   f"differently; --rerank: {rerank.REST_MS})")
    p.add_argument("--sample-ms", type=_sample_ms, default=None, help="GPU time one "
                   f"sample holds, at least (default {TARGET_MS}; the zoo's samples hold ~5 "
                   "ms, which long kernels spend partly at the power limit; --rerank: "
                   f"{rerank.SAMPLE_MS})")
    p.add_argument("--timing", choices=TIMINGS, default=None, help="how samples run: "
                   "CUDA-graph replays (default) or eager launches after the GPU idles, as the "
                   f"benchmarks and the model zoo time them (--rerank: {rerank.TIMING})")
    p.add_argument("--rerank", metavar="TABLE", help="search nothing: per shape, time "
                   "TABLE's pick, the --top fastest other configs of its samples and the "
                   "rules' choice against one another (--rounds rounds, the zoo's regime "
                   "unless --timing/--rest-ms/--sample-ms say otherwise) and write the "
                   "winner; shapes TABLE has no entry for are skipped (unless --rivals)")
    p.add_argument("--top", type=int, default=rerank.DEFAULT_TOP,
                   help="with --rerank: rivals per shape (default %(default)s)")
    p.add_argument("--rivals", default=None, help="with --rerank: configs timed beside "
                   "every shape's pick, ';'-separated ('swap 256x128;coop 128x256 c1x2 s4'); "
                   "shapes TABLE has no entry for are then re-ranked from the rules' choice")
    p.add_argument("--rivals-file", metavar="FILE", default=None, help="with --rerank: a "
                   "JSON object of shape labels ('Kimi-K2/gate_up tokens=8192', as --list "
                   "shows them) to lists of configs timed beside that shape's pick (as "
                   "`python -m benchmarks.peer_rivals` writes from a zoo run: the tiles a "
                   "peer's autotuner chose)")
    p.add_argument("--margin", type=float, default=rerank.DEFAULT_MARGIN, help="with "
                   "--rerank: a rival replaces the pick only when faster by more than this "
                   "fraction (default %(default)s)")
    p.add_argument("--workers", type=int, default=None, help="compile processes")
    p.add_argument("--seed", type=int, default=1234, help="routing and data seed")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N")
    p.add_argument("--configs", help="';'-separated config names (as printed, e.g. 'coop "
                   "128x256 c1x2 s3 p16' or 'swap 256x128'): time only these and the rules' "
                   "choice, print, and write no table")
    p.add_argument("--report", help="with --configs: also write the timings as JSON here")
    p.add_argument("--shard", type=parse_shard, metavar="I/N", help="tune shard I of N of "
                   "the shapes (every N-th, from the I-th): one process per GPU, each with its "
                   "own --out; --merge puts them together")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="tune on N GPUs at once: "
                   "one shard per GPU (the first N visible), merged into --out at the end")
    # (repeatable: a --gpus --resume run hands its shards --out's table after the caller's)
    p.add_argument("--skip-table", action="append", default=[], metavar="FILE",
                   help="skip shapes this table has an entry for (as --resume does with "
                   "--out's) (repeatable)")
    p.add_argument("--merge", action="append", default=[], metavar="FILE",
                   help="add this table's entries and samples into the table at --out (or "
                   "<device>.json in --out-dir) (repeatable; later files win on the same key) "
                   "and exit; no GPU needed")
    p.add_argument("--list", action="store_true", help="print the shapes and exit")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `moe-gemm tune`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    why = empty_option(args, NONEMPTY)
    if why is None and args.out and args.out_dir and args.shard is None:
        # (--out would win and --out-dir be ignored. A --gpus run's shards are told their own
        # --out after the caller's options, so a shard may carry both.)
        why = "--out and --out-dir both name the table to write: give one"
    if why is None and args.report and not args.configs:
        # (a tuning run or a re-rank wrote its table and left --report unwritten, silently)
        why = "--report writes the timings of --configs: add --configs, or drop --report"
    if why is None and args.gpus < 1:
        # Checked here, before --gpus looks for GPUs, so that it is the error reported.
        why = f"--gpus {args.gpus}: must be >= 1"
    if why is None and args.rounds < 1:  # (a final stage of no rounds has no median)
        why = f"--rounds {args.rounds}: must be >= 1"
    if why is None and args.workers is not None and args.workers < 1:
        # (0 read as the default and a negative count as one process, silently)
        why = f"--workers {args.workers}: must be >= 1 (leave it out for one per core but two)"
    if why is None and not args.zoo and (args.models is not None or args.tokens is not None):
        # Without --zoo they select nothing: the run would tune --shapes alone, silently.
        why = "--models and --tokens choose the zoo's shapes: add --zoo"
    if why is None and args.zoo and args.form != "varlen" and (not args.shapes or args.configs):
        # The zoo's shapes are grouped_mm 2-D MoE projections whatever --form says: alone,
        # --form batched was ignored without a word; with --configs, the configs were read
        # and checked as batched ones and then timed on the zoo's varlen shapes.
        why = (f"--form {args.form} is for --shapes; the zoo's shapes are varlen (grouped_mm "
               "2-D)" + (", and --configs take one form: time them in separate runs"
                         if args.configs else ""))
    if why is None and args.zoo and args.layout is not None and not args.shapes:
        # The zoo's shapes keep the layout each checkpoint stores (gpt-oss and Llama 4 EKN,
        # the others ENK: --list shows it), and a table's keys carry no layout, so tuning
        # them in another layout would file its picks under their keys: --layout was ignored.
        why = (f"--layout {args.layout} is for --shapes; the zoo's shapes take each model's "
               "own weight layout (ENK or EKN, as --list shows)")
    if why:
        print(f"moe-gemm tune: {why}", file=sys.stderr)
        return 2
    if args.merge:
        if others := _beside_merge(argv):
            # (they were ignored: `--list --merge` wrote the table, bad values passed)
            print(f"moe-gemm tune: --merge puts tables together and does nothing else; drop "
                  f"{', '.join(others)}", file=sys.stderr)
            return 2
        return merge(args.merge, args.out, log, out_dir=args.out_dir)
    if why := _rerank_problem(args):
        print(f"moe-gemm tune: {why}", file=sys.stderr)
        return 2
    dtype = DTYPE_NAMES[args.dtype]
    out_dtype = DTYPE_NAMES[args.out_dtype or args.dtype]
    try:
        shapes = parse_shape_items(args.shapes, args.form, args.layout or "ENK", dtype,
                                   out_dtype, args.seed)
        if args.zoo:
            shapes += zoo_shapes(args.models, args.tokens, dtype, out_dtype, args.seed)
    except ValueError as exc:
        print(f"moe-gemm tune: {exc}", file=sys.stderr)
        return 2
    if not shapes:
        print("moe-gemm tune: nothing to tune: give --zoo and/or --shapes", file=sys.stderr)
        return 2
    shapes = take_shard(shapes, args.shard)
    configs = []
    if args.configs:
        from moe_gemm.tuning.space import parse_name

        try:
            configs = [parse_name(c, args.form) for c in args.configs.split(";") if c.strip()]
            if not configs:  # e.g. ";": else the run would tune instead of comparing
                raise ValueError(f"--configs {args.configs!r} names no config")
            for text, fields in zip(filter(str.strip, args.configs.split(";")), configs):
                config_problem(text.strip(), fields, args.form, dtype, out_dtype)
        except ValueError as exc:
            print(f"moe-gemm tune: {exc}", file=sys.stderr)
            return 2
    for flag, value in (("--budget-s", args.budget_s), ("--shape-budget-s", args.shape_budget_s)):
        # (nan too; inf is refused as the other commands' seconds are: no limit is the
        # option left out; checked before --list answers)
        if value is not None and not (value > 0 and math.isfinite(value)):
            print(f"moe-gemm tune: {flag} must be a positive finite number of seconds",
                  file=sys.stderr)
            return 2
    if not re.fullmatch(r"cuda(:\d+)?", args.device.strip()):
        # (--list answered for any --device; a run refused it: cuda or cuda:N only, the GPU
        # itself is checked when the run starts)
        print(f"moe-gemm tune: --device {args.device!r}: expected cuda or cuda:N",
              file=sys.stderr)
        return 2
    for skip_table in args.skip_table:
        if why := _skip_table_problem(Path(skip_table)):
            # (a run logged it as "not used" and tuned every shape again, where --list had
            # left out what it holds)
            print(f"moe-gemm tune: --skip-table {skip_table}: {why}", file=sys.stderr)
            return 2
    if args.list:
        # (as a run leaves out what --resume's --out and --skip-table already hold)
        have = _listed_as_done(args)
        shapes = [s for s in shapes if table_io_key(s) not in have]
        if args.rerank and not (args.rivals or args.rivals_file):
            # (a re-rank without rivals skips the shapes its table has no entry for)
            from moe_gemm.tuning import table_io

            try:
                source = table_io.read_table(Path(args.rerank))
            except (OSError, ValueError) as exc:
                print(f"moe-gemm tune: --rerank {args.rerank}: {exc}", file=sys.stderr)
                return 2
            shapes = [s for s in shapes
                      if table_io.find_entry(source, table_io_key(s)) is not None]
        for s in shapes:
            k = s.key()
            print(f"{s.describe():58s} {k.form} E={k.E} N={k.N} K={k.K} bucket={k.bucket} "
                  f"{s.layout}")
        return 0
    if configs and args.gpus != 1:
        print("moe-gemm tune: --configs times on one GPU; drop --gpus", file=sys.stderr)
        return 2
    # Paths that cannot be written fail now, in one line, not after minutes of tuning.
    outputs = [("--out", args.out), ("--report", args.report),
               ("--out-dir", args.out_dir and str(Path(args.out_dir) / "table.json"))]
    for option, path in outputs:
        if path and (why := output_problem(Path(path), option)):
            print(f"moe-gemm tune: {why}", file=sys.stderr)
            return 2
    if why := cache_problem():  # (the compile workers hand every kernel over through it)
        print(f"moe-gemm tune: {why}", file=sys.stderr)
        return 2
    if configs:
        return run_compare(args, shapes, configs, log)
    if args.gpus != 1:
        return run_on_gpus(args, argv, log)
    return run(args, shapes, log)


def table_io_key(shape) -> tuple:
    from moe_gemm.tuning import table_io

    return table_io.key_tuple(shape.key())


def _skip_table_problem(path: Path) -> str | None:
    """Why --skip-table's file is no table (missing, not JSON, no tuned table), or None. Its
    device is checked when a run starts (a table made for another GPU is refused then)."""
    from moe_gemm.tuning import table_io

    if not path.is_file():
        return "no such table file"
    try:
        table_io.read_table(path)
    except (OSError, ValueError) as exc:
        return str(exc)
    return None


def _listed_as_done(args: argparse.Namespace) -> set[tuple]:
    """The table keys a run would skip, where --list can know them without the GPU: the
    entries of --out with --resume, and of --skip-table (read for whichever device they were
    made for; a run refuses a --skip-table made for another device, and reads --out for its
    own)."""
    from moe_gemm.tuning import table_io

    paths = [Path(p) for p in args.skip_table]
    if args.resume and not args.no_merge and args.out:
        paths.append(Path(args.out))
    have: set[tuple] = set()
    for path in paths:
        try:
            have |= {table_io.entry_key(e) for e in table_io.read_table(path)["entries"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue  # (a run says why it does not use it)
    return have


# What --merge takes beside its tables (argparse dests); any other option given is refused.
_MERGE_OPTIONS = frozenset({"merge", "out", "out_dir", "quiet", "help"})


def _beside_merge(argv: list[str]) -> list[str]:
    """The options given in `argv` that --merge does not take (it ignored them: `--device
    cpu`, `--gpus 2` or `--list` with --merge wrote the table; bad values passed)."""
    parser = _parser()
    unset = object()
    # (None for the appending options: argparse appends to a default it is given)
    parser.set_defaults(**{a.dest: None if isinstance(a, argparse._AppendAction) else unset
                           for a in parser._actions})
    given = vars(parser.parse_args(argv))
    return [a.option_strings[0] for a in parser._actions
            if a.dest not in _MERGE_OPTIONS and given.get(a.dest, unset) not in (unset, None)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The parsed options, the timing ones' defaults filled in (a re-rank's are the zoo's
    regime, moe_gemm.tuning.rerank)."""
    args = _parser().parse_args(argv)
    defaults = ((rerank.TIMING, rerank.REST_MS, rerank.SAMPLE_MS) if args.rerank
                else ("graph", REST_MS, TARGET_MS))
    for name, value in zip(("timing", "rest_ms", "sample_ms"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _rerank_problem(args: argparse.Namespace) -> str | None:
    # (the values first, whatever else is given: `--top -5 --margin 7` passed without
    # --rerank)
    if args.top < 1:
        return f"--top {args.top}: must be >= 1"
    if not 0 <= args.margin < 1:  # (nan too)
        return f"--margin {args.margin}: must be in [0, 1)"
    if not args.rerank:
        return ("--rivals needs --rerank" if args.rivals else
                "--rivals-file needs --rerank" if args.rivals_file else None)
    if args.configs:
        return "--rerank and --configs are two ways to time given configs; give one"
    try:
        rerank_rivals(args)
    except ValueError as exc:
        return f"--rivals: {exc}"
    try:
        rivals_by_label(args)
    except ValueError as exc:
        return f"--rivals-file {args.rivals_file}: {exc}"
    if not Path(args.rerank).is_file():  # (before --list answers as if it could run)
        return f"--rerank {args.rerank}: no such table file"
    return None


def rerank_rivals(args: argparse.Namespace) -> tuple[dict, ...]:
    """--rivals as config fields (ValueError naming a config it cannot read or run, as for
    --configs)."""
    names = [n.strip() for n in (args.rivals or "").split(";") if n.strip()]
    if args.rivals is not None and not names:
        raise ValueError(f"{args.rivals!r} names no config")
    return tuple(_runnable(n, args) for n in names)


def _runnable(name: str, args: argparse.Namespace) -> dict:
    """A config name's fields, refused (ValueError) where config_problem refuses them."""
    fields = space.parse_name(name, args.form)
    dtype = DTYPE_NAMES[args.dtype]
    config_problem(name, fields, args.form, dtype, DTYPE_NAMES[args.out_dtype or args.dtype])
    return fields


def rivals_by_label(args: argparse.Namespace) -> dict[str, tuple[dict, ...]]:
    """--rivals-file as {shape label: config fields}; ValueError saying what is wrong."""
    if not args.rivals_file:
        return {}
    try:
        raw = tuned.read_table_bytes(Path(args.rivals_file), "a rivals file")
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    try:
        doc = loads_json(raw)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(n, str) for n in v)
            for k, v in doc.items()):
        raise ValueError("expected an object of shape labels to lists of config names")
    return {label: tuple(_runnable(n, args) for n in names) for label, names in doc.items()}


def run(args: argparse.Namespace, shapes: list, log) -> int:
    """Tune `shapes` on the GPU (imports torch and the DSL only here)."""
    t_start = time.monotonic()
    import torch

    from moe_gemm.capability import device_name, sm_count
    from moe_gemm.ops import tuned
    from moe_gemm.ops.versions import runtime_versions
    from moe_gemm.tuning import table_io
    from moe_gemm.tuning.ceilings import measure_ceilings
    from moe_gemm.tuning.compile_pool import CompilePool
    from moe_gemm.tuning.runner import ShapeRunner
    from moe_gemm.tuning.tuner import tune_shape

    device, why = kernel_device(args.device)
    if why:
        print(f"moe-gemm tune: {why}", file=sys.stderr)
        return 2
    name, nsm = device_name(device), sm_count(device)
    out = out_path(args.out, args.out_dir, tuned.device_slug(name))
    source = None
    if args.rerank:
        try:
            source = table_io.read_table(Path(args.rerank), name)
        except (OSError, ValueError) as exc:
            print(f"moe-gemm tune: --rerank {args.rerank}: {exc}", file=sys.stderr)
            return 2
    doc, why = (None, None) if args.no_merge else table_io.load_existing(out, name)
    if why:
        return refuse_out(why)
    ceilings = measure_ceilings(device)
    if doc is None:
        doc = table_io.new_table(name, nsm, runtime_versions(name), ceilings)
    else:
        doc["ceilings"], doc["versions"] = ceilings, runtime_versions(name)
    have = {table_io.entry_key(e) for e in doc["entries"]} if args.resume else set()
    for skip_table in args.skip_table:
        try:
            have |= {table_io.entry_key(e)
                     for e in table_io.read_table(Path(skip_table), name)["entries"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # (it was logged as "not used" and every shape tuned again, where --list had left
            # out what it holds: a table of another device, most likely)
            print(f"moe-gemm tune: --skip-table {skip_table}: {exc}", file=sys.stderr)
            return 2
    if have:
        before = len(shapes)
        shapes = [s for s in shapes if table_io.key_tuple(s.key()) not in have]
        log(f"[tune] {before - len(shapes)} shapes already tuned, {len(shapes)} to go")
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20)
    log(f"[tune] {name}: {len(shapes)} shapes -> {out}; copy "
        f"{ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, mm "
        f"{ceilings['mm_flops_per_s'] / 1e12:.0f} TFLOP/s")
    if switched := choice_switches_set():
        log(f"[tune] warning: {switched}")
    done, stopped, slowest = 0, None, FIRST_SHAPE_EST_S
    os.environ.setdefault("MOE_GEMM_TUNED_TABLES", "1")
    found = {}
    if source is not None:
        extra, by_label = rerank_rivals(args), rivals_by_label(args)
        found = {i: f for i, s in enumerate(shapes)
                 if (f := rerank.leaders(source, s, args.top,
                                         extra + by_label.get(s.label, ()), nsm)) is not None}
        have_entry = sum(1 for f in found.values() if f.entry)
        log(f"[tune] --rerank {args.rerank}: {have_entry} of {len(shapes)} shapes have an "
            "entry there; " + ("the others start from the rules' choice" if extra
                               or by_label else "the others are skipped"))
    with CompilePool(args.workers) as pool:
        if source is None:
            _precompile(shapes, pool, nsm, log)
        else:
            _precompile_leaders([(shapes[i], f) for i, f in found.items()], pool, nsm, log)
        for i, shape in enumerate(shapes):
            if source is not None and i not in found:
                continue
            left = math.inf if args.budget_s is None else (
                args.budget_s - (time.monotonic() - t_start))
            if left < min(slowest * 1.2, args.shape_budget_s) + 5:
                stopped = f"budget: {left:.0f} s left, a shape takes up to {slowest:.0f} s"
                break
            deadline = time.monotonic() + min(args.shape_budget_s, left - 5)
            runner = None
            try:
                runner = ShapeRunner(shape, device, pool, seed=args.seed + i, l2_bytes=l2,
                                     rest_ms=args.rest_ms, sample_ms=args.sample_ms,
                                     timing_mode=args.timing)
                if source is not None:
                    res = rerank.rerank_shape(
                        shape, runner, found[i], rounds=args.rounds, margin=args.margin,
                        regime=f"{args.timing}, rest {args.rest_ms} ms, samples of "
                        f"{args.sample_ms} ms, {args.rounds} rounds")
                else:
                    res = tune_shape(shape, runner, rounds=args.rounds, deadline=deadline,
                                     out_itemsize=torch.empty(0, dtype=runner.d).element_size(),
                                     log=log)
            except torch.cuda.OutOfMemoryError as exc:
                log(f"[tune] {shape.describe()}: out of memory ({str(exc)[:120]}); skipped")
                continue
            finally:
                if runner is not None:
                    runner.close()
            slowest = max(slowest if done else 0.0, res.seconds)
            done += 1
            # A re-rank's samples are in another regime than the search's: the table keeps
            # the search's (the lookup's neighbours step votes with them). A shape re-ranked
            # from the rules' choice (no entry before) gets its entry and no samples: its few
            # timed configs would narrow that vote to themselves (it counts only configs
            # timed on every voter).
            table_io.add_result(doc, res.entry(), [] if source is not None else res.samples())
            doc.setdefault("failures", [])
            doc["failures"] += [{"shape": shape.describe(), **f} for f in res.failures()]
            if why := _save(out, doc):
                print(f"moe-gemm tune: {why}; stopped at shape {i + 1} of {len(shapes)}",
                      file=sys.stderr)
                return 1
            w, r = res.winner, res.rules
            gain = f" ({r.ms / w.ms:.3f}x the rules' {r.name})" if w and r and r.samples else ""
            if res.rerank is not None and w is not None and res.rerank["from_us"]:
                gain = (f" (was {res.rerank['from']}: {res.rerank['from_us'] / 1e3 / w.ms:.3f}x"
                        f" as long in the same rounds)")
            log(f"[tune] {i + 1}/{len(shapes)} {shape.describe()}: "
                + (f"{w.name} {w.ms * 1e3:.1f} us{gain}" if w else f"none ({res.stopped})")
                + f" [{res.seconds:.1f} s]")
    if why := _save(out, doc):
        print(f"moe-gemm tune: {why}", file=sys.stderr)
        return 1
    total = time.monotonic() - t_start
    print(f"tuned {done} of {len(shapes)} shapes in {total:.0f} s -> {out}"
          + (f"; stopped early ({stopped})" if stopped else ""))
    return 0


def _save(out: Path, doc: dict) -> str | None:
    """Write the table at `out`: None, or why it could not be written (a full disk, a file
    size limit, the folder removed meanwhile), in one line for the caller to stop with; the
    OSError escaped as a traceback after the tuning it could not save."""
    from moe_gemm.tuning import table_io

    try:
        table_io.write(out, doc)
    except OSError as exc:
        return f"cannot write the table {out} ({exc.strerror or exc})"
    return None


def _precompile(shapes: list, pool, nsm: int, log) -> None:
    """Submit every shape's rules choice and stage-1 kernels to the pool at once."""
    from moe_gemm.tuning.runner import stage1_keys

    keys = []
    for s in shapes:
        keys += stage1_keys(s, nsm)
    keys = list(dict.fromkeys(keys))
    pool.submit(keys)
    log(f"[tune] compiling {len(keys)} kernel variants in {pool.workers} processes")


def _precompile_leaders(items: list, pool, nsm: int, log) -> None:
    """--rerank: submit every shape's pick, rivals and rules' choice to the pool at once."""
    from moe_gemm.tuning.runner import compile_key_for, rules_fields

    keys = []
    for shape, found in items:
        for fields in [rules_fields(shape, nsm), found.pick, *found.rivals]:
            with contextlib.suppress(ValueError):
                keys.append(compile_key_for(shape, fields, nsm))
    keys = list(dict.fromkeys(keys))
    pool.submit(keys)
    log(f"[tune] compiling {len(keys)} kernel variants in {pool.workers} processes")


def kernel_device(spec: str):
    """(torch.device with its index, None) for a CUDA GPU our kernels run on, made the current
    device; else (None, why).

    "cuda" names the current device: torch.cuda.set_device refuses a device without an index."""
    import torch

    from moe_gemm.capability import cute_problem

    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError) as exc:
        return None, f"--device {spec!r} is not a device: {exc}"
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, NO_GPU
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif device.index >= torch.cuda.device_count():
        return None, f"--device {spec}: this machine has {torch.cuda.device_count()} GPU(s)"
    why = cute_problem(device)
    if why:
        return None, f"our kernels cannot run here: {why}"
    torch.cuda.set_device(device)
    return device, None


def run_compare(args: argparse.Namespace, shapes: list, configs: list[dict], log) -> int:
    """--configs: an interleaved A/B of the given configs and the rules' choice per shape."""
    import torch

    from moe_gemm.capability import sm_count
    from moe_gemm.tuning.compile_pool import CompilePool
    from moe_gemm.tuning.runner import ShapeRunner
    from moe_gemm.tuning.table_io import write_json
    from moe_gemm.tuning.tuner import compare_configs

    device, why = kernel_device(args.device)
    if why:
        print(f"moe-gemm tune --configs: {why}", file=sys.stderr)
        return 2
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20)
    report = []
    with CompilePool(args.workers) as pool:
        for i, shape in enumerate(shapes):
            runner = ShapeRunner(shape, device, pool, seed=args.seed + i, l2_bytes=l2,
                                     rest_ms=args.rest_ms, sample_ms=args.sample_ms,
                                     timing_mode=args.timing)
            try:
                res = compare_configs(shape, runner, configs, rounds=max(args.rounds, 10))
            finally:
                runner.close()
            print(shape.describe())
            for o in res.outcomes:
                t = f"{o.ms * 1e3:10.1f} us" if o.samples else f"error: {o.error}"
                mark = " <- fastest" if o is res.winner else ""
                print(f"  {o.origin:5s} {o.name:40s} {t}{mark}")
                report.append({"shape": shape.describe(), "sm_count": sm_count(device),
                               "config": o.fields, "name": o.name, "origin": o.origin,
                               "us": o.ms * 1e3 if o.samples else None, "error": o.error})
    if args.report:
        write_json(Path(args.report), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
