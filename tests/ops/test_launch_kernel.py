"""launch_kernel's grid: how many CTAs a launch takes for its tiles."""

from __future__ import annotations

from dataclasses import replace

from moe_gemm.ops import launch_kernel
from moe_gemm.ops.heuristics import KernelChoice

COOP = KernelChoice("cooperative", "device", 128, 256, None, False, 8)


def test_a_launch_without_the_tail_split_takes_at_most_its_tiles():
    # 331 rows over 4 experts of 512 columns: at most (3 + 4) x 2 tiles of 128x256.
    assert launch_kernel.varlen_grid(None, 132, COOP, 331, 4, 512) == (14, 1)
    assert launch_kernel._grid(None, 132, 1, 500) == (132, 4)


def test_a_tail_split_launch_takes_every_sm():
    """Its few tiles are split over K on the SMs they leave idle (tail_split.py)."""
    split = replace(COOP, tail_split=True)
    assert launch_kernel.varlen_grid(None, 132, split, 331, 4, 512) == (132, 1)
    assert launch_kernel._grid(None, 132, 1, 10, whole=True) == (132, 1)
    assert launch_kernel._grid(None, 132, 1, 500, whole=True) == (132, 4)
