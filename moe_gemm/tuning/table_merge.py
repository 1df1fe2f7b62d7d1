"""Tuned tables of several runs put together: `moe-gemm tune --merge FILE...` and `--gpus N`
(the command once per GPU on shard i of N, each into a table of its own, then merged)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_gemm.tuning.argcheck import output_problem
from moe_gemm.tuning.shards import finish_shards, gpu_ids, launch_shards

NO_GPU = "needs a CUDA GPU (use --list without one)"


def out_path(out: str | None, out_dir: str | None, slug: str) -> Path:
    """The table a run or a merge writes: --out, or <slug>.json in --out-dir, or
    ./tuned-<slug>.json."""
    return Path(out) if out else (
        Path(out_dir) / f"{slug}.json" if out_dir else Path(f"tuned-{slug}.json"))


def refuse_out(why: str) -> int:
    """Exit 2 for an --out that is no table for this GPU: replaced by a new table after the
    first shape, it was lost (another device's table, such as the shipped H100 one named on an
    H200, or a file that is no table at all), with one log line that --quiet hid. Replacing it
    takes --no-merge."""
    print(f"moe-gemm tune: --out {why}: give another --out, or --no-merge to replace it",
          file=sys.stderr)
    return 2


def run_on_gpus(args: argparse.Namespace, argv: list[str], log) -> int:
    """`--gpus N`: this command once per GPU, each on shard i of N into a table of its own (a
    temporary folder), then those tables merged into --out (added to the table there, unless
    --no-merge). A shard that fails leaves the others' results merged; the exit code says."""
    import shutil

    import torch

    clash = [o for o, on in (("--shard", args.shard is not None),
                             ("--device", args.device != "cuda")) if on]
    if clash:
        print(f"moe-gemm tune: --gpus picks the shards and devices itself; drop "
              f"{' and '.join(clash)}", file=sys.stderr)
        return 2
    if torch.cuda.device_count() < 1:
        # Before gpu_ids: CUDA_VISIBLE_DEVICES can name GPUs a CPU-only torch cannot use, and
        # asking such a torch for a device's name raises an AssertionError.
        print(f"moe-gemm tune: {NO_GPU}", file=sys.stderr)
        return 2
    try:
        gpus = gpu_ids(args.gpus, torch.cuda.device_count())
    except ValueError as exc:
        print(f"moe-gemm tune: {exc}", file=sys.stderr)
        return 2
    from moe_gemm.capability import device_name
    from moe_gemm.ops import tuned
    from moe_gemm.tuning import table_io

    name = device_name(torch.device("cuda", 0))
    out = out_path(args.out, args.out_dir, tuned.device_slug(name))
    if not args.no_merge and (why := table_io.load_existing(out, name)[1]):
        return refuse_out(why)  # now, not when the shards' tables are merged into it
    # --resume skips what --out holds (as one process would; --no-merge starts afresh).
    skip = ["--skip-table", str(out)] if args.resume and not args.no_merge and out.exists() else []
    tmp, codes, parts = launch_shards("moe_gemm.tuning", argv, gpus, "tune",
                                      ["--no-merge", *skip], log)
    rc = 1
    if parts:
        # --no-merge: a new table of the shards alone, put in place only once it is whole.
        target = tmp / "merged.json" if args.no_merge else out
        rc = merge(parts, str(target), log)
        if rc == 0 and args.no_merge:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(target), str(out))
    return finish_shards("moe-gemm tune", gpus, codes, len(parts), rc, tmp)


def merge(files: list[str], out: str | None, log, out_dir: str | None = None) -> int:
    """`--merge`: the entries, samples and failures of `files` added into the table at `out`
    (or <device>.json in `out_dir`; a new table with the first file's header when absent), in
    order, so a later file's entry replaces an earlier one's for the same key. Every file must
    be a table of one device; entries and samples the reader would skip are left out, with a
    warning."""
    import copy

    from moe_gemm.ops import tuned
    from moe_gemm.tuning import table_io

    if not out and not out_dir:
        print("moe-gemm tune: --merge needs --out FILE or --out-dir DIR (the table to add "
              "into)", file=sys.stderr)
        return 2

    def warn(s: str) -> None:
        print(f"moe-gemm tune: warning: {s}", file=sys.stderr)

    docs = []
    for f in files:
        try:
            docs.append((f, table_io.read_table(Path(f), warn=warn)))
        except (OSError, ValueError) as exc:
            print(f"moe-gemm tune: --merge {f}: {exc}", file=sys.stderr)
            return 2
    device = docs[0][1]["device"]
    if others := sorted({d["device"] for _, d in docs} - {device}):
        print(f"moe-gemm tune: --merge takes tables of one device; got {device} and "
              f"{', '.join(others)}", file=sys.stderr)
        return 2
    target = out_path(out, out_dir, tuned.device_slug(device))
    option = "--out" if out else "--out-dir"
    # Before merging anything: a path that cannot be written fails now, in one line.
    if why := output_problem(target, option):
        print(f"moe-gemm tune: {why}", file=sys.stderr)
        return 2
    if target.exists():
        try:
            doc = table_io.read_table(target, device, warn=warn)
        except (OSError, ValueError) as exc:
            print(f"moe-gemm tune: {option} {target}: {exc}", file=sys.stderr)
            return 2
    else:  # the first file's header; every file's valid entries are added below
        doc = {**copy.deepcopy(docs[0][1]), "entries": [], "samples": [],
               "failures": []}
    for f, other in docs:
        n = table_io.merge_into(doc, other)
        log(f"[tune] --merge {f}: {n} entries")
    try:
        table_io.write(target, doc)
    except OSError as exc:  # e.g. the disk filled up since the check above
        print(f"moe-gemm tune: --out {target}: {exc}", file=sys.stderr)
        return 2
    print(f"merged {len(files)} tables into {target}: {len(doc['entries'])} entries")
    return 0
