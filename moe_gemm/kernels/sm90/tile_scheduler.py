"""The grouped tile scheduler for the sm90 kernels: one scheduler warp, a shared-memory ring.

Why a dedicated warp: the device visitor is a warp-wide search (32 problem sizes per window,
a 5-step shuffle prefix sum, a ballot) with a global-memory read latency of ~600 cycles per
window. Running it once per tile in one warp, ahead of the mainloop, keeps that latency off
the load warp and the math warpgroups: they read a finished 32-byte record from shared memory.

Record (8 x Int32) per tile, in the order the CTA executes its tiles:
    [problem, m_tile, n_tile, k_tiles, row_start, valid, ring_slot, k_start]
`problem == -1` is the end-of-work sentinel. `row_start` is the varlen form's first row of
the expert in x (0 in the general form). `valid` is 1, or 0 for a cluster CTA past the
problem's edge (computes, stores nothing); with the tail split its low 2 bits are the role
(grouped_gemm_sm90.ROLE_*) and the rest the tail tile's index. `ring_slot` is the descriptor
ring slot; `k_start` the first k-tile (a tail split's upper half; else 0). The assignment is the one `moe_gemm.schedule`
defines (round robin over linear tiles; `tile_coord` rasterization), so the Python emulation
there and this code must change together.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

RECORD_INTS = 8
WARP = 32


@cute.jit
def warp_inclusive_sum(value: Int32, lane: Int32) -> Int32:
    """Inclusive prefix sum across the 32 lanes (5 shuffle-up steps)."""
    total = value
    for step in cutlass.range_constexpr(5):
        offset = 1 << step
        other = cute.arch.shuffle_sync_up(total, offset)
        if lane >= offset:
            total = total + other
    return total


@cute.jit
def ceil_div_i32(a: Int32, b: Int32) -> Int32:
    return (a + b - 1) // b


@cute.jit
def raster_tile(
    local: Int32, tiles_m: Int32, tiles_n: Int32, swizzle: Int32
) -> tuple[Int32, Int32]:
    """(m_tile, n_tile) of tile `local` inside one problem; mirrors schedule.tile_coord.

    M fastest inside panels of `swizzle` m-tiles: consecutive tiles share B's columns and a
    panel's rows of A stay in L2.
    """
    s = cutlass.min(swizzle, tiles_m)
    panel_tiles = s * tiles_n
    panel = local // panel_tiles
    r = local - panel * panel_tiles
    rows = cutlass.min(s, tiles_m - panel * s)
    m_tile = panel * s + r % rows
    n_tile = r // rows
    return m_tile, n_tile
