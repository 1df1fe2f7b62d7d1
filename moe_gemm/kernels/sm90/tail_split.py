"""The tail split: a short last wave of tiles computed by several CTAs each, a share of K each.

Scheduler side (`plan`, `unit`, `split_k`): with T tiles on `grid` CTAs the last wave holds
rem = T mod grid tiles. When 2 * rem <= grid, each of them is split `ways` times, ways =
min(grid // rem, the kernel's split_ways, k_tiles // SPLIT_PART_K_TILES (at least 2); k_tiles
of the deepest problem): unit j of the last wave (linear index full + j, full = T - rem,
j < ways * rem) is share p = j // rem of tail tile i = j mod rem. A tile of k k-tiles takes
w = min(ways, k // SPLIT_PART_K_TILES, at least 2) shares (w = ways where every problem has
one K), share p over k-tiles [k * p / w, k * (p + 1) / w); shares 0 .. w - 2 publish an fp32
partial, share w - 1 (the finisher) adds them and stores the tile, shares past w have no
work. The finisher has the highest index, so every publisher is launched before
it: a finisher never waits on a CTA that is not yet resident. A tile shorter than
SPLIT_MIN_K_TILES (the varlen form's zero tail, a general-form problem of short K) is not
split: share 0's CTA computes it whole and the other shares have nothing to do.

Math side (`publish`, `absorb`): a publisher writes its fp32 accumulators to its workspace
slot and bumps the tile's counter (release); the finisher waits for w - 1 on the counter
(acquire), adds the partials into its own accumulators in share order (the sum does not
depend on timing), stores the tile and resets the counter to 0 for the next launch.
`moe_gemm.ops.schedule.tail_split_assignment` is the Python truth.

Clusters and ping-pong: under a 2-CTA cluster the unit of the split is the cluster tile (T
counts cluster tiles, `grid` clusters), so both CTAs of a cluster run the same share of K
(their multicast loads stay paired) and each publishes or finishes its own tile: tail tile
i's CTA of rank r joins through counter and slots 2 * i + r (a rank past the problem's edge
computes its share for its peer and joins nothing). In ping-pong each warpgroup owns its
tiles, so a tile's handoff is one warpgroup's (its own named barrier, 128 threads).
`moe_gemm.ops.schedule.tail_split_tiles` is the Python truth for those.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from .constants import (
    DESC_RING,
    SLOT_BYTES,
    SPLIT_COUNTER_BYTES,
    SPLIT_MAX_CTAS,
    SPLIT_MIN_K_TILES,
    SPLIT_PART_K_TILES,
)
from .tile_scheduler import ROLE_FINISH, ROLE_PUBLISH, ROLE_SKIP, WorkTile

# Named barriers around the partial-tile handoff: both math warpgroups (cooperative), or each
# warpgroup its own (ping-pong: 6 and 8; 7 is the gated swapped epilogue's, 4 and 5 the
# ping-pong mainloop order's).
BAR_SPLIT = 6
BAR_SPLIT_WG1 = 8

# WorkTile.role above its 2 kind bits: the tail tile (its counter), the share, the tile's
# ways (how many shares its finisher waits for) and the launch's (the stride of the tail
# tiles' partial slots). (rem <= SPLIT_MAX_CTAS / 2 = 128 tail tiles, or 2 per cluster tile
# of rem <= SPLIT_MAX_CTAS / 4 clusters; ways <= 16.)
TAIL_SHIFT, SHARE_SHIFT, WAYS_SHIFT, STRIDE_SHIFT = 2, 10, 15, 20
TAIL_MASK, SHARE_MASK, WAYS_MASK, STRIDE_MASK = 0xFF, 0x1F, 0x1F, 0x1F


@dataclass(frozen=True, eq=False)
class SplitPlan:
    """The launch's split, computed once per CTA by the scheduler warp."""

    total: Int32  # all tiles
    full: Int32  # the tiles of the whole waves
    rem: Int32  # the last wave's tiles
    ways: Int32  # CTAs per last-wave tile (1: not split)


def split_role(kind: int, tail_i: Int32, share: Int32, ways: Int32, stride: Int32) -> Int32:
    return Int32(kind) | (tail_i << TAIL_SHIFT) | (share << SHARE_SHIFT) | (
        ways << WAYS_SHIFT) | (stride << STRIDE_SHIFT)


@dataclass(frozen=True, eq=False)
class TailSplit:
    """(Frozen: read-only inside the DSL's dynamic loops, see problems.Problems.)"""

    cfg: object  # the kernel: tile, cluster_size, pingpong, threads_per_wg, split_ways

    # -- scheduler warp ------------------------------------------------------------------------

    @cute.jit
    def plan(self, total: Int32, grid: Int32, k_tiles: Int32) -> SplitPlan:
        """total: the launch's tiles (cluster tiles under a cluster), grid: its CTAs
        (clusters); k_tiles: the deepest problem's k-iterations (Problems.split_depth: the
        varlen and batched forms share one K; in the general form each tile's shares divide
        its own)."""
        full = (total // grid) * grid
        rem = total - full
        ways = Int32(1)
        if rem > 0:
            if 2 * rem <= grid:
                if grid <= SPLIT_MAX_CTAS:
                    if k_tiles >= SPLIT_MIN_K_TILES:
                        # (Divisors kept above 0 everywhere: the compiler may hoist a
                        # division out of its branch.)
                        ways = cutlass.min(grid // cutlass.max(rem, Int32(1)),
                                           Int32(self.cfg.split_ways))
                        ways = cutlass.min(ways, cutlass.max(k_tiles // SPLIT_PART_K_TILES,
                                                             Int32(2)))
        return SplitPlan(total, full, rem, ways)

    @cute.jit
    def unit(self, plan: SplitPlan, t: Int32):
        """(linear tile, share, tail index) of this CTA's unit t: share 0 a whole tile, s >= 1
        share s - 1 of tail tile `tail index`."""
        lin = t
        share = Int32(0)
        tail_i = Int32(0)
        if plan.ways > 1:
            if t >= plan.full:
                j = t - plan.full
                if j < plan.ways * plan.rem:
                    p = j // cutlass.max(plan.rem, Int32(1))
                    tail_i = j - p * plan.rem
                    share = p + 1
                    lin = plan.full + tail_i
                else:
                    lin = plan.total  # past the last tile: the search ends this CTA
        return lin, share, tail_i

    @cute.jit
    def split_k(self, work: WorkTile, share: Int32, tail_i: Int32, plan: SplitPlan,
                rank: Int32) -> WorkTile:
        """The unit's share of K and role. The tile takes min(the launch's ways, its own
        k_tiles // SPLIT_PART_K_TILES, at least 2) shares (the same as the launch's where
        every problem has one K; in the general form a shallower tile takes fewer, each
        share keeping ~1024 of K): a share past them, or past the first of a tile too short
        to split (whose first share's CTA computes it whole), ends its CTA's work. rank: the
        CTA's in its cluster (0 without one): its tile's counter and slots are tail tile
        tail_i's rank-th; a rank that stores nothing (past the problem's edge) keeps
        ROLE_SKIP and computes its share for its peer."""
        problem = work.problem
        k_tiles = work.k_tiles
        k_start = work.k_start
        role = work.role
        if share != 0:
            p = share - 1
            ways = cutlass.min(plan.ways, cutlass.max(k_tiles // SPLIT_PART_K_TILES, Int32(2)))
            tile_i = tail_i * self.cfg.cluster_size + rank
            if k_tiles >= SPLIT_MIN_K_TILES:
                if p < ways:
                    lo = k_tiles * p // cutlass.max(ways, Int32(1))
                    hi = k_tiles * (p + 1) // cutlass.max(ways, Int32(1))
                    k_start = lo
                    k_tiles = hi - lo
                    if role != ROLE_SKIP:
                        if share == ways:
                            role = split_role(ROLE_FINISH, tile_i, p, ways, plan.ways)
                        else:
                            role = split_role(ROLE_PUBLISH, tile_i, p, ways, plan.ways)
                else:
                    problem = Int32(-1)
            elif share != 1:
                problem = Int32(-1)
        return WorkTile(problem, work.m_tile, work.n_tile, k_tiles, work.row_start, role,
                        work.ring_slot, k_start, work.rows)

    # -- math warpgroups -----------------------------------------------------------------------

    @cute.jit
    def live_rows(self, first_row: Int32, work: WorkTile) -> cutlass.Boolean:
        """Whether this thread holds a row the tile stores. first_row: the thread's lowest
        accumulator row in the tile (its other rows lie below it in the WGMMA's fragment:
        +8, and +128 on 256-row tiles). A partial tile's rows past its problem's end are
        never stored, so their partials need not travel: at one routed row, 4 of the 256
        math threads publish, and a 128x64 tile's fixup moves 1/64 of its 32 KiB per share
        (the finisher reads each share's partial serially: six 64 KiB partials of 128x128
        took ~4 us, H200)."""
        return first_row < work.rows - work.m_tile * self.cfg.tile_m

    @cute.jit
    def _fields(self, role: Int32):
        """(tail tile, share, the tile's ways, the launch's ways) of a split unit's role."""
        return ((role >> TAIL_SHIFT) & TAIL_MASK, (role >> SHARE_SHIFT) & SHARE_MASK,
                (role >> WAYS_SHIFT) & WAYS_MASK, (role >> STRIDE_SHIFT) & STRIDE_MASK)

    @cute.jit
    def _counter(self, workspace: cute.Tensor, tail_i: Int32):
        """Tail tile `tail_i`'s counter (constants.split_workspace_bytes)."""
        grid, _, _ = cute.arch.grid_dim()
        base = workspace.iterator.toint() + Int64(grid) * (DESC_RING * SLOT_BYTES)
        return cute.make_ptr(Int32, base + Int64(tail_i) * 4, cute.AddressSpace.gmem,
                             assumed_align=4)

    def _threads(self) -> int:
        """The math threads that hold one tile: one warpgroup (ping-pong) or both."""
        return self.cfg.threads_per_wg * (1 if self.cfg.pingpong else 2)

    @cute.jit
    def _join(self, math_wg: Int32):
        """The tile's math threads meet (a named barrier of their own). The ping-pong id is
        computed, not branched on: a barrier in a branch on the warpgroup made ptxas see the
        accumulator writes after it as divergent and serialize every WGMMA of the kernel
        (C7520; the 1x2 ping-pong 128x192 split ran 0.62x the unsplit kernel, H100)."""
        if const_expr(self.cfg.pingpong):
            cute.arch.barrier(barrier_id=BAR_SPLIT + (BAR_SPLIT_WG1 - BAR_SPLIT) * math_wg,
                              number_of_threads=self._threads())
        else:
            cute.arch.barrier(barrier_id=BAR_SPLIT, number_of_threads=self._threads())

    @cute.jit
    def _partial_tensor(self, acc: cute.Tensor, workspace: cute.Tensor, slot: Int32
                        ) -> cute.Tensor:
        """Partial slot `slot` as (accumulator index, math thread): each thread's fragment
        element i at i * (the tile's threads) + thread, so a warp's stores and loads of one
        element are one 128-byte line."""
        cfg = self.cfg
        grid, _, _ = cute.arch.grid_dim()
        base = workspace.iterator.toint() + Int64(grid) * (DESC_RING * SLOT_BYTES)
        partial = base + SPLIT_COUNTER_BYTES + Int64(slot) * (cfg.tile_m * cfg.tile_n * 4)
        n = cute.size(acc)
        threads = self._threads()
        return cute.make_tensor(
            cute.make_ptr(cutlass.Float32, partial, cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout((n, threads), stride=(threads, 1)),
        )

    @cute.jit
    def publish(self, acc: cute.Tensor, workspace: cute.Tensor, role: Int32, mma_tidx: Int32,
                live: cutlass.Boolean, math_wg: Int32):
        """A publishing share: fp32 accumulators to its slot (tail tile i's shares take slots
        i * (the launch's ways - 1) + share), then counter += 1 (release: every math thread's
        stores are fenced and joined at a barrier first). live: whether any of this thread's
        rows is one the tile stores (`live_rows`); a thread of none writes nothing. mma_tidx:
        the thread's index among the tile's math threads; math_wg: its warpgroup."""
        tail_i, share, _, stride = self._fields(role)
        part = self._partial_tensor(acc, workspace, tail_i * (stride - 1) + share)
        if live:
            for i in cutlass.range_constexpr(cute.size(acc)):
                part[i, mma_tidx] = acc[i]
        cute.arch.fence_acq_rel_gpu()
        self._join(math_wg)
        if mma_tidx == 0:
            cute.arch.atomic_add(self._counter(workspace, tail_i), Int32(1), sem="release",
                                 scope="gpu")

    @cute.jit
    def absorb(self, acc: cute.Tensor, workspace: cute.Tensor, role: Int32, mma_tidx: Int32,
               live: cutlass.Boolean, math_wg: Int32):
        """The finishing share: wait until all ways - 1 publishers counted (acquire), add
        their partials into acc in share order (where `live`: the publishers wrote the same
        threads' slots), reset the counter to 0 for the next launch."""
        tail_i, _, ways, stride = self._fields(role)
        counter = self._counter(workspace, tail_i)
        if mma_tidx == 0:
            seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
            while seen < ways - 1:
                seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
        self._join(math_wg)
        cute.arch.fence_acq_rel_gpu()
        if live:
            for q in cutlass.range(ways - 1):
                part = self._partial_tensor(acc, workspace, tail_i * (stride - 1) + q)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] + part[i, mma_tidx]
        if mma_tidx == 0:
            cute.arch.atomic_exch(counter, Int32(0), sem="relaxed", scope="gpu")
