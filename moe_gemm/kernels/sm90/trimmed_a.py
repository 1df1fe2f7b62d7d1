"""Trimmed A loads: an expert's last tile loads only the rows of A its expert has.

Routed experts end in a partial tile (an expert of 130 rows fills one 128-row tile and 2 rows of
a second), and a whole tile_m box of A loads rows that are computed and never stored. The
varlen kernels are bound by their L2-to-SM operand bytes more than by the tensor pipe
(docs/measurements.md: skipping the WGMMAs of an empty half tile gained nothing), so such a
tile (GroupedGemmSm90 with trim_a) loads its rows rounded up to 16 instead: as 64-row boxes,
then at most one 32-row and one 16-row box, stacked from row 0 of the stage
(constants.A_ROW_BOXES). The rows of the stage past them keep what an earlier stage left
there; their accumulator rows are never stored (the D store ends at the expert's last row).

The stage's full barrier is armed with the bytes this tile loads (B's, plus A's as loaded),
in the one arrive.expect_tx that also arms it for whole tiles. In a 1x2 cluster both CTAs
compute the same rows: a whole box is split between them as before, each half multicast to
both; a trimmed tile's boxes are all issued by the first CTA, multicast to both, and each CTA
arms its barrier with all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from .constants import A_ROW_BOXES


def box_heights(tile_m: int) -> tuple[int, ...]:
    """The box heights a tile of tile_m rows uses for a partial tile (those below tile_m)."""
    return tuple(h for h in A_ROW_BOXES if h < tile_m)


@dataclass(frozen=True)
class TrimmedA:
    """The load warp's A copies of one tile: the whole box, or the boxes of its rows. Frozen:
    the load loop reads it without carrying it (make it with `trimmed_a`)."""

    cfg: Any  # the kernel (tile_m, ...)
    work: Any  # the tile (WorkTile)
    tAgA: cute.Tensor  # the whole boxes (the kernel's A partition)
    tAsA: cute.Tensor
    whole: Any  # Boolean: the tile has tile_m rows of its expert
    units: Any  # Int32: its rows in A_ROW_BOXES[-1]-row units, rounded up
    a_bytes: Any  # Int32: the A bytes a stage loads
    parts: tuple  # (atom, smem partition, gmem partition) per box height below tile_m

    @cute.jit
    def fill_stage(self, atom_a: cute.CopyAtom, k: Int32, stage: Int32, bar, policy, mask,
                   rank_n: Int32):
        """Issue k-tile k's A copies into stage `stage` (the barrier already expects them).
        mask: the A multicast mask of a 1x2 cluster (None without); rank_n: the CTA's rank
        along N in it."""
        cfg, work = self.cfg, self.work
        if self.whole:
            cute.copy(atom_a, self.tAgA[(None, work.m_tile, k)], self.tAsA[(None, stage)],
                      tma_bar_ptr=bar, mcast_mask=mask, cache_policy=policy)
        elif rank_n == 0:
            row = Int32(0)  # the next box's first row in the tile
            units = self.units
            for h in A_ROW_BOXES:
                if const_expr(h < cfg.tile_m):
                    atom, tAs, tAg = self.parts[A_ROW_BOXES.index(h)]
                    per = h // A_ROW_BOXES[-1]
                    # 64-row boxes while four units remain; then one box of each smaller
                    # height whose bit is set in the units left.
                    count = units // per
                    if const_expr(h != A_ROW_BOXES[0]):
                        count = cutlass.min(count, Int32(1))
                    for _ in cutlass.range(count, unroll=1):
                        cute.copy(atom, tAg[(None, row // h, k)],
                                  tAs[(None, row // h, 0, stage)], tma_bar_ptr=bar,
                                  mcast_mask=mask, cache_policy=policy)
                        row = row + h
                        units = units - per


def trimmed_a(cfg, atoms, tensors, problems, sA: cute.Tensor, work, tAgA: cute.Tensor,
              tAsA: cute.Tensor) -> TrimmedA:
    """The TrimmedA of one tile. atoms / tensors: one TMA atom and tensor per A_ROW_BOXES
    height (A's own where the tile uses no box of that height). The tile's rows are the
    kernel's `tile_row_span` (a whole tile's first row is m_tile * tile_m)."""
    tile_m, tile_k = cfg.tile_m, cfg.tile_k
    smallest = A_ROW_BOXES[-1]
    first, rows = cfg.tile_row_span(work)
    units = (rows + smallest - 1) // smallest  # (none past the expert's end)
    parts = []
    for h, atom, tma_rows in zip(A_ROW_BOXES, atoms, tensors):
        if h < tile_m:
            g = problems.a_row_boxes(tma_rows, work, h, first)
            s = cute.flat_divide(sA, (h, tile_k))
            tAs, tAg = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                             cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))
            parts.append((atom, tAs, tAg))
        else:
            parts.append(None)
    return TrimmedA(cfg, work, tAgA, tAsA, units * smallest == tile_m, units,
                    units * (smallest * tile_k * cfg.ab_dtype.width // 8), tuple(parts))
