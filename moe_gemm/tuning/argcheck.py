"""Argument checks shared by `moe-gemm tune` and the zoo benchmark (`moe-gemm bench --suite
zoo`): each returns why an argument is unusable (one line for the CLI to print before exiting
with 2), or None."""

from __future__ import annotations

import argparse
import os
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


def output_problem(path: Path, option: str = "--out") -> str | None:
    """Why a file cannot be written at `path` (its folder created as needed), checked before a
    command does its work so that a bad path fails at once instead of after the work, or
    None. Creates the missing folders, as the write would."""
    if path.is_dir():
        return f"{option} {path}: is a folder, not a file"
    existing = next((p for p in path.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        return f"{option} {path}: {existing} is a file, not a folder"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{option} {path}: cannot create its folder ({exc.strerror or exc})"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"{option} {path}: its folder is not writable"
    return None
