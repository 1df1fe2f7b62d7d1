"""The tail split: a short last wave of tiles computed by twice as many CTAs, half of K each.

Scheduler side (`plan`, `unit`, `split_k`): with T tiles on `grid` CTAs the last wave holds
rem = T mod grid tiles. When 2 * rem <= grid, unit j of the last wave (linear index full + j,
full = T - rem) is half of tail tile j mod rem: j < rem the lower half of K (publisher), else
the upper half (finisher). The publisher CTA has the lower index, so it is launched first: a
finisher never waits on a CTA that is not yet resident. A tile shorter than SPLIT_MIN_K_TILES
is not split: its publisher CTA computes it whole and its finisher has nothing to do.

Math side (`publish`, `absorb`): the publisher writes its fp32 accumulators to the tile's
workspace slot and bumps the tile's counter (release); the finisher waits for the counter
(acquire), adds the partial into its own accumulators, stores the tile and resets the counter
to 0 for the next launch. `moe_gemm.ops.schedule.tail_split_assignment` is the Python truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .constants import DESC_RING, SLOT_BYTES, SPLIT_COUNTER_BYTES, SPLIT_MAX_CTAS, SPLIT_MIN_K_TILES
from .tile_scheduler import ROLE_FINISH, ROLE_PUBLISH, WorkTile

BAR_SPLIT = 6  # named barrier: both math warpgroups, around the partial-tile handoff


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """The launch's split, computed once per CTA by the scheduler warp."""

    total: Int32  # all tiles
    full: Int32  # the tiles of the whole waves
    rem: Int32  # the last wave's tiles
    split: cutlass.Boolean  # whether the last wave is split


@dataclass(frozen=True, eq=False)
class TailSplit:
    """(Frozen: read-only inside the DSL's dynamic loops, see problems.Problems.)"""

    cfg: object  # the kernel: tile_m, tile_n, threads_per_wg

    # -- scheduler warp ------------------------------------------------------------------------

    @cute.jit
    def plan(self, total: Int32, grid: Int32) -> SplitPlan:
        full = (total // grid) * grid
        rem = total - full
        split = cutlass.Boolean(False)
        if rem > 0:
            if 2 * rem <= grid:
                if grid <= SPLIT_MAX_CTAS:
                    split = True
        return SplitPlan(total, full, rem, split)

    @cute.jit
    def unit(self, plan: SplitPlan, t: Int32):
        """(linear tile, part, tail index) of this CTA's unit t: part 0 a whole tile, 1 the
        lower half of tail tile `tail index`, 2 its upper half."""
        lin = t
        part = Int32(0)
        tail_i = Int32(0)
        if plan.split:
            if t >= plan.full:
                j = t - plan.full
                if j < 2 * plan.rem:
                    part = Int32(1)
                    tail_i = j
                    if j >= plan.rem:
                        part = Int32(2)
                        tail_i = j - plan.rem
                    lin = plan.full + tail_i
                else:
                    lin = plan.total  # past the last tile: the search ends this CTA
        return lin, part, tail_i

    @cute.jit
    def split_k(self, work: WorkTile, part: Int32, tail_i: Int32) -> WorkTile:
        """The unit's share of K and role (a tile too short to split: the publisher's CTA
        computes it whole and the finisher's record ends its work)."""
        problem = work.problem
        k_tiles = work.k_tiles
        k_start = work.k_start
        role = work.role
        if part != 0:
            if k_tiles >= SPLIT_MIN_K_TILES:
                half = k_tiles // 2
                if part == 1:
                    k_tiles = half
                    role = ROLE_PUBLISH | (tail_i << 2)
                else:
                    k_start = half
                    k_tiles = k_tiles - half
                    role = ROLE_FINISH | (tail_i << 2)
            elif part == 2:
                problem = Int32(-1)
        return WorkTile(problem, work.m_tile, work.n_tile, k_tiles, work.row_start, role,
                        work.ring_slot, k_start, work.rows)

    # -- math warpgroups -----------------------------------------------------------------------

    @cute.jit
    def _addresses(self, workspace: cute.Tensor, tail_i: Int32):
        """(counter, partial tile) of tail tile `tail_i` (constants.split_workspace_bytes)."""
        cfg = self.cfg
        grid, _, _ = cute.arch.grid_dim()
        base = workspace.iterator.toint() + Int64(grid) * (DESC_RING * SLOT_BYTES)
        counter = cute.make_ptr(Int32, base + Int64(tail_i) * 4, cute.AddressSpace.gmem,
                                assumed_align=4)
        partial = base + SPLIT_COUNTER_BYTES + Int64(tail_i) * (cfg.tile_m * cfg.tile_n * 4)
        return counter, partial

    @cute.jit
    def _partial_tensor(self, acc: cute.Tensor, partial: Int64) -> cute.Tensor:
        """The slot as (accumulator index, math thread): each thread's fragment element i at
        i * 256 + thread, so a warp's stores and loads of one element are one 128-byte line."""
        n = cute.size(acc)
        threads = 2 * self.cfg.threads_per_wg
        return cute.make_tensor(
            cute.make_ptr(cutlass.Float32, partial, cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout((n, threads), stride=(threads, 1)),
        )

    @cute.jit
    def publish(self, acc: cute.Tensor, workspace: cute.Tensor, tail_i: Int32,
                mma_tidx: Int32):
        """Lower half of a split tile: fp32 accumulators to the slot, then counter += 1
        (release: every math thread's stores are fenced and joined at a barrier first)."""
        counter, partial = self._addresses(workspace, tail_i)
        part = self._partial_tensor(acc, partial)
        for i in cutlass.range_constexpr(cute.size(acc)):
            part[i, mma_tidx] = acc[i]
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=BAR_SPLIT, number_of_threads=2 * self.cfg.threads_per_wg)
        if mma_tidx == 0:
            cute.arch.atomic_add(counter, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def absorb(self, acc: cute.Tensor, workspace: cute.Tensor, tail_i: Int32,
               mma_tidx: Int32):
        """Upper half of a split tile: wait for the publisher's counter (acquire), add its
        partial into acc, reset the counter to 0 for the next launch."""
        counter, partial = self._addresses(workspace, tail_i)
        if mma_tidx == 0:
            seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
            while seen == 0:
                seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
        cute.arch.barrier(barrier_id=BAR_SPLIT, number_of_threads=2 * self.cfg.threads_per_wg)
        cute.arch.fence_acq_rel_gpu()
        part = self._partial_tensor(acc, partial)
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] + part[i, mma_tidx]
        if mma_tidx == 0:
            cute.arch.atomic_exch(counter, Int32(0), sem="relaxed", scope="gpu")
