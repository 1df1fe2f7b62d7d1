"""Splitting a work list over several GPUs: `--shard I/N` of `moe-gemm tune` and the zoo.

One process per GPU (CUDA_VISIBLE_DEVICES=I) takes every N-th item of the list, starting at
item I. The lists are in priority order and alternate models and projections, so taking every
N-th item spreads the heavy and the light shapes over the shards about evenly, and shard I
of N always gets the same items (a shard can be rerun alone). Each shard writes its own file;
`moe-gemm tune --merge` and `python -m benchmarks.zoo --merge` put them together.
"""

from __future__ import annotations

import argparse
from typing import Sequence, TypeVar

T = TypeVar("T")


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N (argparse type: a clear error otherwise)."""
    try:
        i_text, n_text = text.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        i, n = -1, 0
    if n < 1 or not 0 <= i < n:
        raise argparse.ArgumentTypeError(
            f"expected I/N with 0 <= I < N (shard I of N, e.g. 0/4), got {text!r}")
    return i, n


def take_shard(items: Sequence[T], shard: tuple[int, int] | None) -> list[T]:
    """Shard I of N of `items`: items I, I + N, I + 2N, ... (all of them for None)."""
    if shard is None:
        return list(items)
    i, n = shard
    return list(items[i::n])
