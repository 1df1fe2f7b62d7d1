"""The sm90 kernel's integer helpers, executed on the CPU against moe_gemm.ops.schedule.

The CuTe DSL runs a @cute.jit function's host code on the CPU, so the very functions the
scheduler warp runs (tile_scheduler.raster_tile, tail_split.TailSplit, problems.VarlenProblems)
are compiled once each and called here on many inputs: the raster order, the tail split's
units and the clamping of unchecked offsets are proven equal to the Python schedule (which
the GPU trace tests prove the whole kernel follows) without a GPU.
"""

# (No `from __future__ import annotations`: the DSL evaluates the probes' annotations, and
# `cute` is imported inside the fixtures, where the DSL is known to be present.)
import itertools
import os
import random

import pytest
import torch

from moe_gemm.capability import cutlass_dsl_problem
from moe_gemm.kernels.sm90.constants import SPLIT_MIN_K_TILES, SPLIT_WAYS, raster_code
from moe_gemm.ops import schedule as sched

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")

ROWS = 4096  # output rows of the raster probe (tiles_m * tiles_n at most)


@pytest.fixture(scope="module")
def dsl():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    return cutlass, cute, from_dlpack


@pytest.fixture(scope="module")
def raster_fn(dsl):
    cutlass, cute, from_dlpack = dsl
    from cutlass import Int32

    from moe_gemm.kernels.sm90.tile_scheduler import raster_tile

    @cute.jit
    def probe(out: cute.Tensor, tiles_m: Int32, tiles_n: Int32, raster: Int32):
        for i in cutlass.range(tiles_m * tiles_n):
            m, n = raster_tile(i, tiles_m, tiles_n, raster)
            out[i, 0] = m
            out[i, 1] = n

    out = torch.full((ROWS, 2), -1, dtype=torch.int32)
    compiled = cute.compile(probe, from_dlpack(out), Int32(1), Int32(1), Int32(0))

    def run(tiles_m, tiles_n, code):
        out.fill_(-1)
        compiled(from_dlpack(out), Int32(tiles_m), Int32(tiles_n), Int32(code))
        return [tuple(r) for r in out[:tiles_m * tiles_n].tolist()]

    return run


CODES = [0, 1, 2, 3, 8, 16, 1 << 30, raster_code(4, "m", True), raster_code(3, "n"),
         raster_code(2, "n", True), raster_code(5, "m", True), raster_code(0, "n", True),
         raster_code(1, "n", True), -3]


def test_raster_matches_schedule(raster_fn):
    rng = random.Random(5)
    shapes = [(1, 1), (1, 7), (7, 1), (5, 3), (17, 56), (3, 40), (64, 2), (9, 9)] + [
        (rng.randint(1, 40), rng.randint(1, 40)) for _ in range(6)]
    for (tm, tn), code in itertools.product(shapes, CODES):
        want = [sched.tile_coord(t, tm, tn, code) for t in range(tm * tn)]
        assert raster_fn(tm, tn, code) == want, (tm, tn, hex(code & 0xFFFFFFFF))
        assert len(set(want)) == tm * tn  # a bijection onto the problem's tiles


def test_serpentine_panels_start_where_the_previous_ended():
    # 5 x 3 tiles, panels of 2 m-tiles: the second panel walks N backwards, so its first
    # tiles reuse the columns (B) the first panel ended on.
    got = [sched.tile_coord(t, 5, 3, raster_code(2, "m", True)) for t in range(15)]
    assert got == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2),
                   (2, 2), (3, 2), (2, 1), (3, 1), (2, 0), (3, 0),
                   (4, 0), (4, 1), (4, 2)]
    # Panels of n-tiles: N fastest inside a panel.
    got = [sched.tile_coord(t, 2, 3, raster_code(2, "n")) for t in range(6)]
    assert got == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (1, 2)]
    # The plain numbers keep their meaning (panels of m-tiles, no serpentine).
    assert [sched.tile_coord(t, 3, 2, 2) for t in range(6)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]


@pytest.mark.parametrize("panel,along,serp", [(-1, "m", False), (1 << 16, "m", False),
                                              (4, "k", False), (True, "m", False)])
def test_raster_code_refuses_bad_fields(panel, along, serp):
    with pytest.raises(ValueError):
        raster_code(panel, along, serp)


def _split_probe(dsl, cluster_size: int):
    """The scheduler warp's tail-split units (TailSplit.plan / unit / split_k) of a kernel of
    `cluster_size`-CTA clusters, run on the CPU: run(total, grid, k_tiles, tile_k, rank, skip)
    -> per unit t (lin, share, problem, k_tiles, k_start, role); skip: the CTA's tile is past
    its problem's edge (ROLE_SKIP)."""
    cutlass, cute, from_dlpack = dsl
    from cutlass import Int32

    from moe_gemm.kernels.sm90.tail_split import TailSplit
    from moe_gemm.kernels.sm90.tile_scheduler import ROLE_SKIP, ROLE_TILE, WorkTile

    class Cfg:
        tile_m, tile_n, threads_per_wg, split_ways = 128, 256, 128, SPLIT_WAYS
        pingpong = False

    Cfg.cluster_size = cluster_size

    @cute.jit
    def probe(out: cute.Tensor, total: Int32, grid: Int32, k_tiles: Int32, tile_k: Int32,
              rank: Int32, skip: Int32):
        tail = TailSplit(Cfg())
        plan = tail.plan(total, grid, k_tiles)
        role = Int32(ROLE_TILE)
        if skip != 0:
            role = Int32(ROLE_SKIP)
        for t in cutlass.range(total + grid):
            lin, share, tail_i = tail.unit(plan, t)
            work = tail.split_k(WorkTile(7, 1, 2, tile_k, 0, role, 0, 0), share, tail_i,
                                plan, rank)
            out[t, 0] = lin
            out[t, 1] = share
            out[t, 2] = work.problem
            out[t, 3] = work.k_tiles
            out[t, 4] = work.k_start
            out[t, 5] = work.role

    out = torch.zeros(1024, 6, dtype=torch.int32)
    compiled = cute.compile(probe, from_dlpack(out), Int32(1), Int32(1), Int32(1), Int32(1),
                            Int32(0), Int32(0))

    def run(total, grid, k_tiles, tile_k=None, rank=0, skip=False):
        """tile_k: this tile's k-iterations (default k_tiles; 0: the varlen zero tail)."""
        out.fill_(-9)
        compiled(from_dlpack(out), Int32(total), Int32(grid), Int32(k_tiles),
                 Int32(k_tiles if tile_k is None else tile_k), Int32(rank), Int32(int(skip)))
        return out[:total + grid].tolist()

    return run


@pytest.fixture(scope="module")
def split_fn(dsl):
    return _split_probe(dsl, 1)


@pytest.fixture(scope="module")
def cluster_split_fn(dsl):
    return _split_probe(dsl, 2)


@pytest.mark.parametrize("total,grid", [(10, 8), (300, 66), (100, 33), (40, 66)])
@pytest.mark.parametrize("k_tiles", [SPLIT_MIN_K_TILES - 1, 64])
def test_tail_split_cluster_units(cluster_split_fn, total, grid, k_tiles):
    """Under a 2-CTA cluster (total: cluster tiles, grid: clusters) both ranks run the same
    share of K; rank r of tail cluster tile i joins through tail tile 2 * i + r; a rank past
    its problem's edge keeps ROLE_SKIP on every share (it computes for its peer only)."""
    from moe_gemm.kernels.sm90 import tail_split as ts
    from moe_gemm.kernels.sm90.tile_scheduler import ROLE_FINISH, ROLE_PUBLISH, ROLE_SKIP

    split = sched.tail_split_units(total, grid, k_tiles)
    ranks = [cluster_split_fn(total, grid, k_tiles, rank=r) for r in (0, 1)]
    skipped = cluster_split_fn(total, grid, k_tiles, rank=1, skip=True)
    for t in range(total + grid):
        r0, r1, sk = ranks[0][t], ranks[1][t], skipped[t]
        assert r0[:5] == r1[:5] == sk[:5]  # the same unit, problem and share of K
        if split is None or t < split[0] or r0[2] < 0 or r0[1] == 0:
            assert r0[5] == r1[5] and sk[5] == ROLE_SKIP
            continue
        full, rem, ways = split
        tail_i, p = (t - full) % rem, (t - full) // rem
        kind = ROLE_FINISH if p == ways - 1 else ROLE_PUBLISH
        for rank, role in ((0, r0[5]), (1, r1[5])):
            assert role & 3 == kind
            assert (role >> ts.TAIL_SHIFT) & ts.TAIL_MASK == 2 * tail_i + rank
            assert (role >> ts.STRIDE_SHIFT) & ts.STRIDE_MASK == ways
        assert sk[5] == ROLE_SKIP


@pytest.mark.parametrize("total,grid", [(10, 8), (13, 8), (16, 8), (7, 8), (3, 8), (0, 8),
                                        (300, 132), (310, 132), (264, 132), (197, 132),
                                        (16, 132), (1, 132), (30, 132)])
@pytest.mark.parametrize("k_tiles", [SPLIT_MIN_K_TILES - 1, SPLIT_MIN_K_TILES, 57, 512])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_tail_split_units_match_schedule(split_fn, total, grid, k_tiles, zero_tail):
    """The scheduler warp's units are schedule.tail_split_units's: share p of K over
    [k * p / ways, k * (p + 1) / ways), the last share finishing; a tile without K (the
    varlen zero tail) computed whole by share 1 and no other."""
    from moe_gemm.kernels.sm90 import tail_split as ts
    from moe_gemm.kernels.sm90.tile_scheduler import ROLE_FINISH, ROLE_PUBLISH, ROLE_TILE

    tile_k = 0 if zero_tail else k_tiles
    split = sched.tail_split_units(total, grid, k_tiles)
    for t, (lin, share, problem, kt, k_start, role) in enumerate(split_fn(total, grid, k_tiles,
                                                                          tile_k)):
        if split is None or t < split[0]:
            assert (lin, share, problem, kt, k_start, role) == (t, 0, 7, tile_k, 0, ROLE_TILE)
            continue
        full, rem, ways = split
        j = t - full
        if j >= ways * rem:
            assert lin == total  # past the last tile: the search ends the CTA
            continue
        tail_i, p = j % rem, j // rem
        assert lin == full + tail_i and share == p + 1
        if zero_tail:  # not split: share 1 computes it whole
            want = (7, 0, 0, ROLE_TILE) if p == 0 else (-1,)
            assert (problem, kt, k_start, role)[:len(want)] == want
            continue
        lo, hi = k_tiles * p // ways, k_tiles * (p + 1) // ways
        assert hi > lo and (problem, kt, k_start) == (7, hi - lo, lo)
        kind = ROLE_FINISH if p == ways - 1 else ROLE_PUBLISH
        assert role & 3 == kind
        assert (role >> ts.TAIL_SHIFT) & ts.TAIL_MASK == tail_i
        assert (role >> ts.SHARE_SHIFT) & ts.SHARE_MASK == p
        assert (role >> ts.WAYS_SHIFT) & ts.WAYS_MASK == ways
        assert (role >> ts.STRIDE_SHIFT) & ts.STRIDE_MASK == ways


@pytest.mark.parametrize("total,grid", [(10, 132), (3, 132), (30, 132), (197, 132), (13, 8)])
@pytest.mark.parametrize("deepest,tile_k", [(512, 16), (512, 31), (512, 32), (512, 100),
                                            (512, 511), (512, 15), (256, 0), (64, 48)])
def test_tail_split_shallower_tile_takes_fewer_shares(split_fn, total, grid, deepest, tile_k):
    """The general form's launch sizes its ways by the deepest problem: a tail tile of fewer
    k-tiles takes min(ways, its k_tiles // 16, at least 2) shares, its finisher is the last of
    them, the shares past them have no work, and the partial slots keep the launch's stride
    (schedule.tail_split_assignment says the same)."""
    from moe_gemm.kernels.sm90 import tail_split as ts
    from moe_gemm.kernels.sm90.constants import SPLIT_PART_K_TILES
    from moe_gemm.kernels.sm90.tile_scheduler import ROLE_FINISH, ROLE_PUBLISH, ROLE_TILE

    split = sched.tail_split_units(total, grid, deepest)
    rows = split_fn(total, grid, deepest, tile_k)
    if split is None:
        assert all(r[1] == 0 for r in rows[:total])
        return
    full, rem, ways = split
    mine = min(ways, max(tile_k // SPLIT_PART_K_TILES, 2))
    covered = [0] * tile_k
    for t in range(full, full + ways * rem):
        lin, share, problem, kt, k_start, role = rows[t]
        p = share - 1
        if tile_k < SPLIT_MIN_K_TILES:
            want = (7, tile_k, 0, ROLE_TILE) if p == 0 else (-1,)
            assert (problem, kt, k_start, role)[:len(want)] == want
            continue
        if p >= mine:
            assert problem == -1
            continue
        assert problem == 7 and kt >= 1
        assert role & 3 == (ROLE_FINISH if p == mine - 1 else ROLE_PUBLISH)
        assert (role >> ts.WAYS_SHIFT) & ts.WAYS_MASK == mine
        assert (role >> ts.STRIDE_SHIFT) & ts.STRIDE_MASK == ways
        if (t - full) % rem == 0:  # one tail tile's shares cover its K once
            for k in range(k_start, k_start + kt):
                covered[k] += 1
    if tile_k >= SPLIT_MIN_K_TILES:
        assert covered == [1] * tile_k
    # The Python truth, one tile per problem, problem 0 the deepest: the last tail tile
    # (problem total - 1, tail index rem - 1) is stored by the CTA of its last share.
    k_list = [deepest] + [tile_k] * (total - 1)
    owners = sched.tail_split_assignment([1] * total, k_list, grid).per_cta
    last = rem - 1 if tile_k < SPLIT_MIN_K_TILES else (mine - 1) * rem + rem - 1
    assert (total - 1, 0) in owners[last]
    assert sum(len(o) for o in owners) == total


def _varlen_rows_probe(cutlass, cute, row_counts: bool):
    """A jit function writing (first row, rows, depth, tile count) of each varlen problem, as
    the scheduler sees them, for 128 x 256 tiles."""
    from cutlass import Int32

    from moe_gemm.kernels.sm90.problems import VarlenProblems

    class Cfg:
        tile_m, tile_n = 128, 256
        gate = None

    Cfg.row_counts = row_counts

    @cute.jit
    def probe(out: cute.Tensor, x: cute.Tensor, y: cute.Tensor, offs: cute.Tensor,
              num_problems: Int32):
        problems = VarlenProblems(Cfg(), num_problems, x, y, offs)
        for p in cutlass.range(num_problems):
            rows, cols, depth, start = problems.dims(p)
            out[p, 0] = start
            out[p, 1] = rows
            out[p, 2] = depth
            out[p, 3] = problems.tile_count(p, 128, 256)

    return probe


def test_varlen_rows_clamp_unchecked_offsets(dsl):
    cutlass, cute, from_dlpack = dsl
    from cutlass import Int32

    probe = _varlen_rows_probe(cutlass, cute, row_counts=False)

    T, K, N = 300, 24, 520
    x = torch.zeros(T, K, dtype=torch.int32)
    y = torch.zeros(T, N, dtype=torch.int32)
    for offs_list in ([0, 1, 129, 129, 300], [-5, 400, 200, 100, 310], [7, 3, -1, 299, 300]):
        offs = torch.tensor(offs_list, dtype=torch.int32)
        E = len(offs_list)
        out = torch.full((E + 1, 4), -9, dtype=torch.int32)
        cute.compile(probe, from_dlpack(out), from_dlpack(x), from_dlpack(y), from_dlpack(offs),
                     Int32(E + 1))(from_dlpack(out), from_dlpack(x), from_dlpack(y),
                                   from_dlpack(offs), Int32(E + 1))
        ends = [min(max(o, 0), T) for o in offs_list] + [T]
        for p in range(E + 1):
            start = 0 if p == 0 else ends[p - 1]
            rows = max(ends[p] - start, 0)
            want = [start, rows, K if p < E else 0, -(-rows // 128) * -(-N // 256)]
            assert out[p].tolist() == want, (offs_list, p)
            assert 0 <= start and start + rows <= T  # never outside x or out


def test_varlen_row_counts_clamp_unchecked_counts(dsl):
    """The row-count option (the masked layout seen as one (E * M, K) x): expert p's rows
    start at p * M, its count clamped into [0, M], so no count reaches another expert's rows
    or past x."""
    cutlass, cute, from_dlpack = dsl
    from cutlass import Int32

    probe = _varlen_rows_probe(cutlass, cute, row_counts=True)

    M, K, N = 150, 24, 520
    for counts in ([0, 1, 129, 150, 77], [-5, 400, 150, 0, 151], [3, 3, 3, 3, 3]):
        E = len(counts)
        x = torch.zeros(E * M, K, dtype=torch.int32)
        y = torch.zeros(E * M, N, dtype=torch.int32)
        offs = torch.tensor(counts, dtype=torch.int32)
        out = torch.full((E, 4), -9, dtype=torch.int32)
        cute.compile(probe, from_dlpack(out), from_dlpack(x), from_dlpack(y), from_dlpack(offs),
                     Int32(E))(from_dlpack(out), from_dlpack(x), from_dlpack(y),
                               from_dlpack(offs), Int32(E))
        for p, c in enumerate(counts):
            rows = min(max(c, 0), M)
            want = [p * M, rows, K, -(-rows // 128) * -(-N // 256)]
            assert out[p].tolist() == want, (counts, p)


@pytest.mark.parametrize("tile_m,tile_n", [(128, 64), (128, 256), (256, 128), (256, 208)])
def test_first_accumulator_row_is_the_threads_lowest(dsl, tile_m, tile_n):
    """TailSplit.live_rows takes a math thread's first accumulator coordinate as its lowest
    row (its partials are skipped when that row is past the tile's stored rows): for the
    cooperative kernels' WGMMA layout, element 0 has the least row of every thread's
    fragment, and the two warpgroups' threads cover every row of the tile."""
    cutlass, cute, from_dlpack = dsl
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Int32
    from cutlass.cute.nvgpu import OperandMajorMode

    @cute.jit
    def probe(out: cute.Tensor, rows: cute.Tensor):
        mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, (2, 1, 1), tiler_mn=(64, tile_n))
        tile = cute.make_identity_tensor((tile_m, tile_n))
        for t in cutlass.range(256):
            coords = mma.get_slice(t).partition_C(tile)
            low = Int32(1 << 20)
            for i in cutlass.range(cute.size(coords), unroll_full=True):
                low = cutlass.min(low, coords[i][0])
                rows[coords[i][0]] = 1
            out[t, 0] = coords[0][0]
            out[t, 1] = low

    out = torch.full((256, 2), -1, dtype=torch.int32)
    rows = torch.zeros(tile_m, dtype=torch.int32)
    cute.compile(probe, from_dlpack(out), from_dlpack(rows))(from_dlpack(out), from_dlpack(rows))
    assert torch.equal(out[:, 0], out[:, 1])
    assert bool((rows == 1).all())
