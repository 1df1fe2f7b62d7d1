"""The grouped tile scheduler for the sm90 kernels: one scheduler warp, a shared-memory ring.

Why a dedicated warp: the device visitor is a warp-wide search (32 problem sizes per window,
a 5-step shuffle prefix sum, a ballot) with a global-memory read latency of ~600 cycles per
window. Running it once per tile in one warp, ahead of the mainloop, keeps that latency off
the load warp and the math warpgroups: they read a finished 32-byte record (a WorkTile) from
shared memory.

The assignment is the one `moe_gemm.ops.schedule` defines (round robin over linear tiles of
the problems laid end to end; `raster_tile` orders one problem's tiles; a cluster walks
cluster tiles and each CTA takes its row or column), so the Python emulation there and this
code must change together: the GPU trace tests compare them.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64, const_expr

from .constants import (
    DESC_RING,
    RASTER_ALONG_N,
    RASTER_PANEL_MASK,
    RASTER_SERPENTINE,
    RECORD_INTS,
    SCHED_STAGES,
    SLOT_BYTES,
)

WARP = 32

# WorkTile.role, low 2 bits: what the math warpgroups do with the tile. With the tail split
# the rest of the bits say which share of which tail tile it is (tail_split.split_role).
ROLE_SKIP = 0  # computed but not stored (a cluster's CTA past the problem's edge)
ROLE_TILE = 1  # an ordinary tile
ROLE_FINISH = 2  # a tail tile's last share of K: add the partials, then the epilogue
ROLE_PUBLISH = 3  # a tail tile's other shares of K: write the fp32 partial, no epilogue
# Packed pairs (GroupedGemmSm90 packed_pairs; no tail split there): above the kind bits, this
# CTA loads B's whole box alone (its pair's other tile has another expert or column).
ROLE_B_ALONE = 4


class WorkTile:
    """One tile of a CTA's work, as the scheduler warp publishes it and every other warp reads
    it (a RECORD_INTS x int32 record of the shared-memory ring).

    problem: the problem index (-1: no more work); m_tile, n_tile: the output tile;
    k_tiles: its k-iterations; k_start: the first one (a tail split's later shares, else 0);
    row_start: the varlen form's first row of the expert in x (else 0); role: ROLE_* in the
    low 2 bits (see above); ring_slot: this record's descriptor slot in the CTA's ring;
    rows: the problem's row count (the varlen form's expert rows: where its stores end).
    Loop-carried through the DSL's dynamic loops like any Int32 (the two mlir methods).
    """

    FIELDS = ("problem", "m_tile", "n_tile", "k_tiles", "row_start", "role", "ring_slot",
              "k_start", "rows")

    def __init__(self, problem, m_tile, n_tile, k_tiles, row_start, role, ring_slot, k_start,
                 rows=0):
        self.problem = Int32(problem)
        self.m_tile = Int32(m_tile)
        self.n_tile = Int32(n_tile)
        self.k_tiles = Int32(k_tiles)
        self.row_start = Int32(row_start)
        self.role = Int32(role)
        self.ring_slot = Int32(ring_slot)
        self.k_start = Int32(k_start)
        self.rows = Int32(rows)

    def values(self) -> tuple[Int32, ...]:
        return tuple(getattr(self, f) for f in self.FIELDS)

    def __extract_mlir_values__(self):
        return [v.ir_value() for v in self.values()]

    def __new_from_mlir_values__(self, values):
        return WorkTile(*(Int32(v) for v in values))

    def has_work(self):
        return self.problem >= 0

    def stores(self):
        """Whether the tile's result is stored (ROLE_TILE or ROLE_FINISH)."""
        return self.role != ROLE_SKIP

    def kind(self) -> Int32:
        return self.role & 3

    def b_alone(self):
        """Packed pairs: whether this CTA loads B's whole box itself (no multicast)."""
        return (self.role & ROLE_B_ALONE) != 0


# The record's size is a host-side constant too (the shared-memory budget counts the ring).
assert len(WorkTile.FIELDS) == RECORD_INTS, "constants.RECORD_INTS must match WorkTile.FIELDS"


@cute.jit
def publish_work(sched: cute.Tensor, index: Int32, work: WorkTile):
    """Lane 0 of the scheduler warp: the record into ring entry `index`."""
    values = work.values()
    for i in cutlass.range_constexpr(RECORD_INTS):
        sched[i, index] = values[i]


@cute.jit
def consume_work(sched_pipe: pipeline.PipelineAsync, sched: cute.Tensor,
                 state: pipeline.PipelineState):
    """(next WorkTile, advanced state): every reading warp calls this once per record, in order
    (its lane 0 releases the ring entry)."""
    sched_pipe.consumer_wait(state)
    work = WorkTile(*(sched[i, state.index] for i in range(RECORD_INTS)))
    cute.arch.sync_warp()
    if cute.arch.lane_idx() == 0:
        sched_pipe.consumer_release(state)
    state.advance()
    return work, state


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
    local: Int32, tiles_m: Int32, tiles_n: Int32, raster: Int32
) -> tuple[Int32, Int32]:
    """(m_tile, n_tile) of tile `local` inside one problem; mirrors schedule.tile_coord.

    `raster` (constants.raster_code): panels of `panel` tiles along M (or N), the panel's axis
    fastest, panel after panel; serpentine walks the other axis backwards in odd panels.
    Panel 0: one panel (column-major along M). The plain 8 / 16 the heuristics pass are
    panels of 8 / 16 m-tiles.
    """
    panel = raster & RASTER_PANEL_MASK
    along_n = (raster & RASTER_ALONG_N) != 0
    fast = tiles_m
    slow = tiles_n
    if along_n:
        fast = tiles_n
        slow = tiles_m
    s = fast
    if panel > 0:
        s = cutlass.min(panel, fast)
    panel_tiles = s * slow
    p = local // panel_tiles
    r = local - p * panel_tiles
    width = cutlass.min(s, fast - p * s)
    f = p * s + r % width
    w = r // width
    if (raster & RASTER_SERPENTINE) != 0:
        if p % 2 == 1:
            w = slow - 1 - w
    m_tile = f
    n_tile = w
    if along_n:
        m_tile = w
        n_tile = f
    return m_tile, n_tile


@dataclass(frozen=True, eq=False)
class TileScheduler:
    """The scheduler warp: for each of its CTA's tiles, in order, find (problem, tile), encode
    the problem's descriptors into the record's ring slot and publish the WorkTile.

    Finding a linear tile's problem: batched by division (every problem has the same count);
    host visitor from the per-CTA table the host built (schedule.host_precompute_table);
    device visitor by a warp-wide search of 32-problem windows (schedule.device_next), forward
    only from where the last search ended. With a cluster the unit of work is a cluster tile
    (cluster_m x cluster_n adjacent tiles of one problem): the cluster walks the linear cluster
    tiles and each CTA takes its rank's tile; a rank past the problem's edge computes (its peer
    needs its half of the shared operand) and stores nothing (ROLE_SKIP).
    """

    cfg: object  # the kernel: tile, cluster, visitor
    problems: object  # problems.Problems of the launch's form
    tail: object  # tail_split.TailSplit or None

    @cute.jit
    def _search(self, lin: Int32, base_problem: Int32, base_tile: Int32, lane: Int32,
                single: cutlass.Constexpr = False):
        """Device visitor: (problem, its first linear tile, window start, window tile) of
        linear tile `lin`; problem -1 past the last tile. Units of work are cluster tiles,
        or (`single`) tiles."""
        cfg = self.cfg
        unit_m = cfg.tile_m if const_expr(single) else cfg.tile_m * cfg.cluster_m
        unit_n = cfg.tile_n if const_expr(single) else cfg.tile_n * cfg.cluster_n
        num_problems = self.problems.num_problems
        problem = Int32(-1)
        start = Int32(0)
        searching = cutlass.Boolean(True)
        while searching:
            cnt = self.problems.tile_count(base_problem + lane, unit_m, unit_n)
            end = base_tile + warp_inclusive_sum(cnt, lane)
            window_end = cute.arch.shuffle_sync(end, WARP - 1)
            if lin < window_end:
                hit = cute.arch.popc(cute.arch.vote_ballot_sync(end <= lin))
                start = cute.arch.shuffle_sync(end - cnt, hit)
                problem = base_problem + hit
                base_problem = problem
                base_tile = start
                searching = False
            else:
                if base_problem + WARP >= num_problems:
                    searching = False
                else:
                    base_problem = base_problem + WARP
                    base_tile = window_end
        return problem, start, base_problem, base_tile

    @cute.jit
    def count_tiles(self, lane: Int32, upto: Int32) -> Int32:
        """The tiles (tile_m x tile_n, not cluster tiles) of problems [0, upto), summed by the
        warp (packed pairs: the experts' tiles, the zero tail left out)."""
        cfg = self.cfg
        total = Int32(0)
        p0 = Int32(0)
        while p0 < upto:
            cnt = Int32(0)
            if p0 + lane < upto:
                cnt = self.problems.tile_count(p0 + lane, cfg.tile_m, cfg.tile_n)
            total = total + cute.arch.shuffle_sync(warp_inclusive_sum(cnt, lane), WARP - 1)
            p0 = p0 + WARP
        return total

    @cute.jit
    def _tile_at(self, lin: Int32, problem: Int32, start: Int32, raster: Int32):
        """Packed pairs: (m_tile, n_tile, first row, rows, depth) of linear tile `lin` of
        `problem`, whose first linear tile is `start` (tiles, not cluster tiles)."""
        rows, cols, depth, row_start = self.problems.dims(problem)
        m_tile, n_tile = raster_tile(lin - start, ceil_div_i32(rows, self.cfg.tile_m),
                                     ceil_div_i32(cols, self.cfg.tile_n), raster)
        return m_tile, n_tile, row_start, rows, depth

    @cute.jit
    def _packed_work(self, t: Int32, pairs: Int32, experts_tiles: Int32, rank: Int32,
                     raster: Int32, base_problem: Int32, base_tile: Int32, lane: Int32,
                     records: Int32):
        """Packed pairs: the WorkTile of this CTA (rank 0 or 1) for cluster unit t, and the
        search state. Units [0, pairs) pair linear tiles 2t and 2t + 1 of the experts' tiles
        (an odd last one: rank 1 computes rank 0's tile for its B half and stores nothing);
        the zero tail's cluster tiles follow (problems.VarlenProblems, k-tiles 0 on both
        ranks, so the two CTAs' A/B rings stay in step: every expert has the same K)."""
        cfg = self.cfg
        problems = self.problems
        work = WorkTile(-1, 0, 0, 0, 0, ROLE_SKIP, records % DESC_RING, 0)
        if t < pairs:
            lin0 = 2 * t
            p0, s0, base_problem, base_tile = self._search(lin0, base_problem, base_tile, lane,
                                                           single=True)
            m0, n0, r0, rows0, d0 = self._tile_at(lin0, p0, s0, raster)
            p1 = p0
            m1, n1, r1, rows1, d1 = m0, n0, r0, rows0, d0
            role0 = Int32(ROLE_TILE)
            role1 = Int32(ROLE_SKIP)  # (an odd last tile: rank 1 repeats rank 0's)
            if lin0 + 1 < experts_tiles:
                p1, s1, base_problem, base_tile = self._search(lin0 + 1, base_problem,
                                                               base_tile, lane, single=True)
                m1, n1, r1, rows1, d1 = self._tile_at(lin0 + 1, p1, s1, raster)
                role1 = Int32(ROLE_TILE)
                if p1 != p0 or n1 != n0:
                    role0 = role0 | ROLE_B_ALONE
                    role1 = role1 | ROLE_B_ALONE
            work = WorkTile(p0, m0, n0, ceil_div_i32(d0, cfg.tile_k), r0, role0,
                            records % DESC_RING, 0, rows0)
            if rank == 1:
                work = WorkTile(p1, m1, n1, ceil_div_i32(d1, cfg.tile_k), r1, role1,
                                records % DESC_RING, 0, rows1)
        else:
            tail = problems.offs.shape[0]  # the zero tail's problem index, E
            if tail < problems.num_problems:
                rows, cols, depth, row_start = problems.dims(tail)
                z = t - pairs
                if z < problems.tile_count(tail, cfg.tile_m * cfg.cluster_m, cfg.tile_n):
                    m_tile, n_tile, role = self._tile_of(z, rows, cols, rank, raster)
                    work = WorkTile(tail, m_tile, n_tile, ceil_div_i32(depth, cfg.tile_k),
                                    row_start, role, records % DESC_RING, 0, rows)
        return work, base_problem, base_tile

    @cute.jit
    def count_all(self, lane: Int32) -> Int32:
        """Every problem's units of work (tiles, or cluster tiles under a cluster), summed by
        the warp (the tail split's plan needs the total)."""
        cfg = self.cfg
        unit_m = cfg.tile_m * cfg.cluster_m
        unit_n = cfg.tile_n * cfg.cluster_n
        total = Int32(0)
        if const_expr(self.problems.uniform):
            total = self.problems.num_problems * self.problems.tiles_each(unit_m, unit_n)
        else:
            p0 = Int32(0)
            while p0 < self.problems.num_problems:
                cnt = self.problems.tile_count(p0 + lane, unit_m, unit_n)
                total = total + cute.arch.shuffle_sync(warp_inclusive_sum(cnt, lane), WARP - 1)
                p0 = p0 + WARP
        return total

    @cute.jit
    def run(self, sched_pipe: pipeline.PipelineAsync, sched: cute.Tensor, table: cute.Tensor,
            raster: Int32, ring: Int64, a_smem: cute.ComposedLayout,
            b_smem: cute.ComposedLayout, d_smem: cute.ComposedLayout, gather=None,
            ab_pipe: pipeline.PipelineTmaAsync | None = None):
        """Publish the CTA's records. gather (gather-A, gather.RowGather): this warp also
        fills its share of A's rows of each record's stages (ab_pipe's ring) right after
        publishing it."""
        cfg = self.cfg
        problems = self.problems
        lane = cute.arch.lane_idx()
        cta, _, _ = cute.arch.block_idx()
        records = Int32(0)
        grid, _, _ = cute.arch.grid_dim()
        # With a cluster the unit of work is a cluster tile (cluster_m x cluster_n adjacent
        # tiles); the cluster walks the linear cluster tiles and each CTA takes its rank's.
        rank = Int32(0)
        if const_expr(cfg.cluster_size > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta = cta // cfg.cluster_size
        grid = grid // cfg.cluster_size
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SCHED_STAGES)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                cfg.ab_stages)
        base_problem = Int32(0)  # device visitor window start (forward only)
        base_tile = Int32(0)  # linear index of base_problem's first tile
        t = Int32(cta)  # this CTA's current linear tile
        slot = Int32(0)  # host visitor: row of this CTA's table
        working = cutlass.Boolean(True)
        per_problem = Int32(0)  # batched: every problem has the same tile count
        if const_expr(problems.uniform):
            per_problem = problems.tiles_each(cfg.tile_m * cfg.cluster_m,
                                              cfg.tile_n * cfg.cluster_n)
        pairs = Int32(0)  # packed pairs: the pair units, then the zero tail's
        experts_tiles = Int32(0)
        if const_expr(cfg.packed_pairs):
            experts_tiles = self.count_tiles(lane, problems.offs.shape[0])
            pairs = (experts_tiles + 1) // 2
        plan = None
        if const_expr(self.tail is not None):
            plan = self.tail.plan(self.count_all(lane), grid,
                                  ceil_div_i32(problems.split_depth(lane), cfg.tile_k))
        while working:
            lin = t  # the linear unit this record computes (all of it, or a share of its K)
            share = Int32(0)  # tail split: 0 whole unit, s >= 1 share s - 1 of tail unit tail_i
            tail_i = Int32(0)
            if const_expr(self.tail is not None):
                lin, share, tail_i = self.tail.unit(plan, t)
            problem = Int32(-1)
            start = Int32(0)
            if const_expr(cfg.packed_pairs):
                pass  # (the record below: _packed_work)
            elif const_expr(problems.uniform):
                if per_problem > 0:
                    if lin < problems.num_problems * per_problem:
                        problem = lin // per_problem
                        start = problem * per_problem
            elif const_expr(cfg.visitor == "host"):
                if slot < table.shape[1]:
                    problem = table[cta, slot, 0]
                    start = table[cta, slot, 1]
            else:
                problem, start, base_problem, base_tile = self._search(
                    lin, base_problem, base_tile, lane)
            work = WorkTile(-1, 0, 0, 0, 0, ROLE_SKIP, records % DESC_RING, 0)
            expert_rows = Int32(0)
            if const_expr(cfg.packed_pairs):
                work, base_problem, base_tile = self._packed_work(
                    t, pairs, experts_tiles, rank, raster, base_problem, base_tile, lane,
                    records)
                expert_rows = work.rows
            elif problem >= 0:
                rows, cols, depth, row_start = problems.dims(problem)
                expert_rows = rows
                m_tile, n_tile, role = self._tile_of(lin - start, rows, cols, rank, raster)
                work = WorkTile(problem, m_tile, n_tile, ceil_div_i32(depth, cfg.tile_k),
                                row_start, role, records % DESC_RING, 0, rows)
                if const_expr(self.tail is not None):
                    work = self.tail.split_k(work, share, tail_i, plan, rank)
            if work.problem < 0:
                working = False
            sched_pipe.producer_acquire(state)
            if lane == 0:
                publish_work(sched, state.index, work)
            if const_expr(problems.uses_ring):
                slot_addr = ring + Int64(records % DESC_RING) * SLOT_BYTES
                if work.problem >= 0:
                    problems.write_descs(slot_addr, work.problem, expert_rows, work.row_start,
                                         a_smem, b_smem, d_smem)
                    # Publish the descriptors to the tensormap proxy (the TMA unit reads them
                    # there); the load and store warps acquire them per record.
                    cute.nvgpu.cpasync.fence_tma_desc_release()
                # Every lane's writes are fenced before lane 0 publishes the record.
                cute.arch.sync_warp()
            if lane == 0:
                sched_pipe.producer_commit(state)
            state.advance()
            if const_expr(gather is not None):
                if work.has_work():
                    ab_state = gather.fill_tile(work, ab_pipe, ab_state)
            t = t + grid
            slot = slot + 1
            records = records + 1
        sched_pipe.producer_tail(state)

    @cute.jit
    def _tile_of(self, local: Int32, rows: Int32, cols: Int32, rank: Int32, raster: Int32):
        """(m_tile, n_tile, role) of this CTA's tile: local is the unit's index in its problem
        (the tile's, or under a cluster the cluster tile's)."""
        cfg = self.cfg
        tiles_m = ceil_div_i32(rows, cfg.tile_m)
        tiles_n = ceil_div_i32(cols, cfg.tile_n)
        m_tile = Int32(0)
        n_tile = Int32(0)
        role = Int32(ROLE_SKIP)
        if const_expr(cfg.cluster_size > 1):
            units_m = ceil_div_i32(rows, cfg.tile_m * cfg.cluster_m)
            units_n = ceil_div_i32(cols, cfg.tile_n * cfg.cluster_n)
            m_unit, n_unit = raster_tile(local, units_m, units_n, raster)
            m_tile = m_unit * cfg.cluster_m
            n_tile = n_unit * cfg.cluster_n
            if const_expr(cfg.cluster_m > 1):
                m_tile = m_tile + rank
            if const_expr(cfg.cluster_n > 1):
                n_tile = n_tile + rank
            # An odd last row (column) of tiles: this CTA still loads (its peer needs its half
            # of the shared operand) and computes, but stores nothing.
            if m_tile < tiles_m:
                if n_tile < tiles_n:
                    role = Int32(ROLE_TILE)
        else:
            m_tile, n_tile = raster_tile(local, tiles_m, tiles_n, raster)
            role = Int32(ROLE_TILE)
        return m_tile, n_tile, role


def ring_base(workspace: cute.Tensor, cta: Int32) -> Int64:
    """This CTA's descriptor ring in the workspace (DESC_RING slots of SLOT_BYTES)."""
    return workspace.iterator.toint() + Int64(cute.arch.make_warp_uniform(cta)) * (
        DESC_RING * SLOT_BYTES
    )
