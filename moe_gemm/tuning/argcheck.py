"""Argument checks shared by `moe-gemm tune` and the zoo benchmark (`moe-gemm bench --suite
zoo`): each returns why an argument is unusable (one line for the CLI to print before exiting
with 2), or None."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path


def empty_option(args: argparse.Namespace, names: list[str]) -> str | None:
    """The first of `names` (argparse dests) given as an empty or blank string. The commands
    read a missing value as "all" or "the default", so an empty one (an unset shell variable,
    `--models "$MODELS"`) would silently select everything: refuse it instead."""
    for name in names:
        value = getattr(args, name, None)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            return f"--{name.replace('_', '-')} is empty (leave the option out for its default)"
    return None


def out_argument(text: str) -> str:
    """argparse's type for an --out path: an empty one or one that cannot be written is
    refused when the arguments are read (one line, exit 2), not by a traceback once the work
    is done."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (leave the option out to write nothing)")
    if why := output_problem(Path(text), "--out"):
        raise argparse.ArgumentTypeError(why.removeprefix("--out "))
    return text


def output_problem(path: Path, option: str = "--out") -> str | None:
    """Why a file cannot be written at `path` (its missing folders created by the write), checked
    before a command does its work so that a bad path fails at once instead of after the work,
    or None. Leaves nothing behind: missing folders, and a file in the folder, are created to
    prove they can be (a permission check alone is wrong for root, for whom /proc looks
    writable) and removed again, so a command refused afterwards (no GPU, say) leaves no empty
    folders; the writers create them when they write."""
    why = _write_problem(path)
    return None if why is None else f"{option} {path}: {why}"


def cache_problem() -> str | None:
    """Why the compiled-kernel cache (MOE_GEMM_CACHE_DIR, default ~/.cache/moe_gemm) cannot be
    written, or None (also with MOE_GEMM_DISK_CACHE=0: nothing is written there). The tuner's
    compile workers hand every kernel over through it: with a file in its place or a folder
    that is not writable each compile failed, and a run on the GPU ended with every shape
    "tuned" to nothing, its reason only in the table's failures."""
    from moe_gemm.ops.kernel_cache import cache_root, disk_cache_enabled

    if not disk_cache_enabled():
        return None
    root = cache_root()
    why = _write_problem(root / "probe")
    if why is None:
        return None
    return (f"the kernel cache {root} cannot be written ({why}): set MOE_GEMM_CACHE_DIR to a "
            "writable folder, or MOE_GEMM_DISK_CACHE=0")


def _write_problem(path: Path) -> str | None:
    """output_problem's reason, without the option and path it starts with."""
    if path.is_dir():
        return "is a folder, not a file"
    existing = next((p for p in path.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"{existing} is a file, not a folder"
    missing = [p for p in path.parents if not p.exists()]  # deepest first
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create its folder ({exc.strerror or exc})"
    try:
        if not os.access(path.parent, os.W_OK | os.X_OK):
            return "its folder is not writable"
        # The writers put a temporary file beside `path`, then rename it: prove one can be made.
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        except OSError as exc:
            return f"cannot create a file in its folder ({exc.strerror or exc})"
        os.close(fd)
        os.unlink(probe)
        return None
    finally:
        for folder in missing:
            try:
                folder.rmdir()
            except OSError:  # (something else was put there meanwhile: leave it)
                break


def loads_json(data: str | bytes) -> object:
    """json.loads for a file a command was given, every parse failure a ValueError (the
    callers' one-line "not JSON" error): json.JSONDecodeError and UnicodeDecodeError already
    are; a RecursionError (arrays or objects nested past the parser's depth) was a traceback."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def choice_switches_set() -> str | None:
    """The kernel-choice switches set in the environment (MOE_GEMM_PACKED_PAIRS=1, ...), as one
    warning line, or None. Each changes every candidate the tuner builds after the candidate
    is named (ops/choice_switches.py, ops/swap_rules.py), while the table records the names:
    a table tuned under MOE_GEMM_PACKED_PAIRS=1 held 2x1 configs timed packed and launched
    unpacked."""
    from moe_gemm.ops.choice_switches import (
        PACKED_PAIRS_ENV,
        PEEK_WAIT_ENV,
        SPLIT_WAYS_ENV,
        TAIL_SPLIT_ENV,
        TRIM_A_ENV,
    )
    from moe_gemm.ops.swap_rules import SWAP_AB_ENV

    names = ("MOE_GEMM_L2_HINTS", PACKED_PAIRS_ENV, PEEK_WAIT_ENV, SPLIT_WAYS_ENV,
             TAIL_SPLIT_ENV, TRIM_A_ENV, SWAP_AB_ENV)
    set_ = [f"{n}={os.environ[n]}" for n in names if os.environ.get(n, "").strip()]
    if not set_:
        return None
    return (f"{', '.join(set_)} set: every candidate is built and timed with "
            f"{'it' if len(set_) == 1 else 'them'}, and the table records the configs without "
            f"{'it' if len(set_) == 1 else 'them'} (unset to tune the configs as named)")
