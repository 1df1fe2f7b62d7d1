"""moe_gemm.schedule: the tile schedule every kernel must follow.

The three checks the design requires: every tile is visited exactly once under each visitor, the
device and host visitors assign identically, and on CUTLASS's grouped-scheduler example K-sort
cuts the modelled makespan by at least 25%. Then property tests over a few hundred random
problem sets (fixed seeds), and unit checks of each piece.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import Counter

import numpy as np
import pytest

from moe_gemm.ops.schedule import (
    WARP,
    Assignment,
    DeviceVisitorState,
    ceil_div,
    cost_model,
    device_next,
    device_visit,
    even_row_span,
    even_row_split,
    host_precompute_table,
    k_tiles,
    ksort_permutation,
    linear_assignment,
    should_sort_by_k,
    table_assignment,
    tile_coord,
    tiles_per_problem,
)

TILE_K = 64
# CUTLASS examples/python/CuTeDSL/hopper grouped-scheduler case: (M, N, K), tile 128x128, 108 CTAs.
CUTLASS_EXAMPLE = [(1152, 768, 128), (1152, 768, 1024), (768, 1152, 128), (768, 1152, 1024)]
TILES = [(64, 128), (128, 64), (128, 128), (128, 192), (128, 256), (256, 128), (64, 256)]


def expected_assignment(tile_counts: list[int], num_ctas: int) -> Assignment:
    """Independent of the module: bisect the cumulative tile starts for every linear tile."""
    starts = [0]
    for c in tile_counts:
        starts.append(starts[-1] + c)
    total = starts[-1]
    per_cta = []
    for c in range(num_ctas):
        mine = []
        for t in range(c, total, num_ctas):
            p = bisect.bisect_right(starts, t) - 1
            while tile_counts[p] == 0:  # bisect lands on the last of equal starts; be explicit
                p += 1
            mine.append((p, t - starts[p]))
        per_cta.append(tuple(mine))
    return Assignment(tuple(per_cta))


def assert_exactly_once(assignment: Assignment, tile_counts: list[int]) -> None:
    seen = Counter(pt for cta in assignment.per_cta for pt in cta)
    expected = {(p, j) for p, n in enumerate(tile_counts) for j in range(n)}
    assert set(seen) == expected, "a tile is missing or out of range"
    dupes = [pt for pt, n in seen.items() if n != 1]
    assert not dupes, f"tiles visited more than once: {dupes[:5]}"


def device_visit_with_stats(tile_counts: list[int], num_ctas: int) -> list[tuple[int, int]]:
    """Per CTA: (tiles visited, windows loaded), driving device_next the way the kernel does,
    and checking that the window never moves backwards."""
    stats = []
    total = sum(tile_counts)
    for c in range(num_ctas):
        state = DeviceVisitorState()
        visited, t, last_base = 0, c, 0
        while device_next(state, t, tile_counts) is not None:
            assert state.base_problem >= last_base, "the device visitor searched backwards"
            last_base = state.base_problem
            visited += 1
            t += num_ctas
            assert visited <= total, "the device visitor found more tiles than there are"
        stats.append((visited, state.windows_loaded))
    return stats


def random_case(rng: random.Random) -> tuple[list[tuple[int, int, int]], int, int, int]:
    """A random problem set: (sizes, tile_m, tile_n, num_ctas), with empty problems, runs of
    empty problems longer than a warp, and M/N/K not multiples of anything."""
    shape = rng.random()
    G = rng.choice([0, 1, 2, 3, rng.randint(1, 40), rng.randint(30, 140), rng.randint(100, 300)])
    tile_m, tile_n = rng.choice(TILES)
    max_m = rng.choice([64, 300, 1500]) if G < 60 else rng.choice([64, 200, 400])
    sizes = []
    empty_run = 0
    for _ in range(G):
        if empty_run > 0:
            sizes.append((0, rng.randint(1, 512), rng.randint(1, 512)))
            empty_run -= 1
            continue
        if shape < 0.2 and rng.random() < 0.05:
            empty_run = rng.randint(WARP, 2 * WARP + 5)  # a run past one 32-problem window
        m = 0 if rng.random() < 0.2 else rng.randint(1, max_m)
        n = 0 if rng.random() < 0.03 else rng.randint(1, 800)
        k = rng.choice([0, rng.randint(1, 64), rng.randint(1, 8192)])
        sizes.append((m, n, k))
    num_ctas = rng.choice([1, 2, 7, 32, 33, 108, 132, rng.randint(1, 264)])
    return sizes, tile_m, tile_n, num_ctas


# --------------------------------------------------------------------------------------------
# The three required checks


@pytest.mark.parametrize("num_ctas", [1, 5, 108, 132, 500])
def test_every_tile_exactly_once_under_each_visitor(num_ctas: int) -> None:
    counts = tiles_per_problem(CUTLASS_EXAMPLE, 128, 128) + [0, 3, 0, 1]
    assert_exactly_once(linear_assignment(counts, num_ctas), counts)
    assert_exactly_once(device_visit(counts, num_ctas), counts)
    assert_exactly_once(table_assignment(host_precompute_table(counts, num_ctas), counts), counts)


@pytest.mark.parametrize("num_ctas", [1, 5, 108, 132, 500])
def test_device_and_host_visitors_assign_identically(num_ctas: int) -> None:
    counts = tiles_per_problem(CUTLASS_EXAMPLE, 128, 128) + [0] * 40 + [2, 0, 5]
    dev = device_visit(counts, num_ctas)
    host = table_assignment(host_precompute_table(counts, num_ctas), counts)
    assert dev == host == linear_assignment(counts, num_ctas)
    assert dev == expected_assignment(counts, num_ctas)


def test_ksort_cuts_cutlass_example_makespan_by_a_quarter() -> None:
    base = cost_model(CUTLASS_EXAMPLE, 128, 128, TILE_K, 108)
    perm = ksort_permutation(CUTLASS_EXAMPLE)
    assert perm == [1, 3, 0, 2]
    sorted_cost = cost_model(CUTLASS_EXAMPLE, 128, 128, TILE_K, 108, perm)
    # 216 tiles on 108 CTAs: unsorted, half the CTAs get two K=1024 tiles (16 + 16 k-iterations)
    # while the other half get two K=128 ones (2 + 2); sorted, every CTA gets 16 + 2.
    assert base.makespan == 32 and sorted_cost.makespan == 18
    assert sorted_cost.makespan <= 0.75 * base.makespan
    assert sorted_cost.mean == base.mean == pytest.approx(18.0)
    assert sorted_cost.efficiency == pytest.approx(1.0)
    assert should_sort_by_k(CUTLASS_EXAMPLE, 128, 128, TILE_K, 108)


@pytest.mark.parametrize("overhead", [0.0, 1.0, 4.0])
def test_ksort_still_wins_with_epilogue_overhead(overhead: float) -> None:
    base = cost_model(CUTLASS_EXAMPLE, 128, 128, TILE_K, 108, per_tile_overhead=overhead)
    srt = cost_model(CUTLASS_EXAMPLE, 128, 128, TILE_K, 108, ksort_permutation(CUTLASS_EXAMPLE),
                     per_tile_overhead=overhead)
    assert srt.makespan <= 0.75 * base.makespan


# --------------------------------------------------------------------------------------------
# Property tests over random problem sets


@pytest.mark.parametrize("chunk", range(8))
def test_visitors_agree_on_random_problem_sets(chunk: int) -> None:
    rng = random.Random(1000 + chunk)
    for _ in range(45):  # 8 x 45 = 360 random problem sets
        sizes, tile_m, tile_n, num_ctas = random_case(rng)
        counts = tiles_per_problem(sizes, tile_m, tile_n)
        order = ksort_permutation(sizes) if rng.random() < 0.5 else list(range(len(sizes)))
        counts = [counts[i] for i in order]
        lin = linear_assignment(counts, num_ctas)
        dev = device_visit(counts, num_ctas)
        table = host_precompute_table(counts, num_ctas)
        host = table_assignment(table, counts)
        ctx = f"sizes={sizes} tile={tile_m}x{tile_n} ctas={num_ctas}"
        assert lin == dev, f"device visitor differs: {ctx}"
        assert lin == host, f"host table differs: {ctx}"
        assert lin == expected_assignment(counts, num_ctas), ctx
        assert_exactly_once(dev, counts)
        assert lin.num_ctas == num_ctas
        # Forward-only search: windows loaded per CTA stay within visits + a pass over the
        # problems + the final miss.
        bound_extra = ceil_div(len(counts), WARP) + 1
        for visited, windows in device_visit_with_stats(counts, num_ctas):
            assert windows <= visited + bound_extra, ctx
            assert windows >= visited + 1  # one load per search at least, plus the final miss


@pytest.mark.parametrize("chunk", range(4))
def test_cost_model_on_random_problem_sets(chunk: int) -> None:
    rng = random.Random(2000 + chunk)
    for _ in range(80):
        sizes, tile_m, tile_n, num_ctas = random_case(rng)
        overhead = rng.choice([0.0, 0.5, 3.0])
        order = ksort_permutation(sizes) if rng.random() < 0.5 else None
        cost = cost_model(sizes, tile_m, tile_n, TILE_K, num_ctas, order, overhead)
        counts = tiles_per_problem(sizes, tile_m, tile_n)
        total_work = sum((k_tiles(k, TILE_K) + overhead) * n for (_, _, k), n in zip(sizes, counts))
        assert cost.per_cta.shape == (num_ctas,)
        assert float(cost.per_cta.sum()) == pytest.approx(total_work)
        assert cost.mean == pytest.approx(total_work / num_ctas)
        assert cost.makespan == pytest.approx(float(cost.per_cta.max()) if total_work else 0.0)
        assert cost.makespan >= cost.mean - 1e-9
        assert 0.0 < cost.efficiency <= 1.0 + 1e-12
        # Per CTA, the work of exactly the tiles the linear assignment gives it.
        idx = list(range(len(sizes))) if order is None else order
        per_problem = [k_tiles(sizes[i][2], TILE_K) + overhead for i in idx]
        assign = linear_assignment([counts[i] for i in idx], num_ctas)
        for c, tiles in enumerate(assign.per_cta):
            assert cost.per_cta[c] == pytest.approx(sum(per_problem[p] for p, _ in tiles))


def test_tile_coord_is_a_bijection() -> None:
    rng = random.Random(3000)
    shapes = [(1, 1), (1, 7), (7, 1), (5, 3), (8, 8), (9, 4), (13, 11)]
    shapes += [(rng.randint(1, 40), rng.randint(1, 40)) for _ in range(40)]
    for tiles_m, tiles_n in shapes:
        for swizzle in (1, 2, 3, 4, 8, tiles_m, tiles_m + 1, 1 << 30, 0, -3):
            coords = [tile_coord(t, tiles_m, tiles_n, swizzle) for t in range(tiles_m * tiles_n)]
            assert len(set(coords)) == tiles_m * tiles_n, (tiles_m, tiles_n, swizzle)
            assert all(0 <= m < tiles_m and 0 <= n < tiles_n for m, n in coords)


# --------------------------------------------------------------------------------------------
# Units


def test_tiles_per_problem_and_k_tiles() -> None:
    sizes = [(128, 128, 64), (129, 128, 1), (1, 1, 0), (0, 512, 64), (300, 0, 64), (256, 300, 65)]
    assert tiles_per_problem(sizes, 128, 128) == [1, 2, 1, 0, 0, 2 * 3]
    assert tiles_per_problem(sizes, 64, 256) == [2, 3, 1, 0, 0, 4 * 2]
    assert tiles_per_problem([], 128, 128) == []
    assert [k_tiles(k, 64) for k in (0, 1, 64, 65, 128, 7168)] == [0, 1, 1, 2, 2, 112]
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]


def test_tile_coord_rasterization() -> None:
    # Plain column-major (M fastest) when the panel covers every m-tile.
    assert [tile_coord(t, 3, 2) for t in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1),
                                                       (2, 1)]
    # Panels of 2 m-tiles, the last panel one m-tile high.
    got = [tile_coord(t, 5, 3, swizzle=2) for t in range(15)]
    assert got == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2),
                   (2, 0), (3, 0), (2, 1), (3, 1), (2, 2), (3, 2),
                   (4, 0), (4, 1), (4, 2)]
    # swizzle 1: each m-tile sweeps all of N before the next.
    assert [tile_coord(t, 2, 3, swizzle=1) for t in range(6)] == [(0, 0), (0, 1), (0, 2),
                                                                  (1, 0), (1, 1), (1, 2)]


@pytest.mark.parametrize("t, tiles_m, tiles_n", [(-1, 2, 2), (4, 2, 2), (0, 0, 5), (0, 3, 0)])
def test_tile_coord_out_of_range(t: int, tiles_m: int, tiles_n: int) -> None:
    with pytest.raises(ValueError, match=f"tile {t} outside a {tiles_m}x{tiles_n} problem"):
        tile_coord(t, tiles_m, tiles_n)


def test_ksort_permutation_descending_and_stable() -> None:
    sizes = [(1, 1, 128), (1, 1, 1024), (9, 9, 128), (2, 2, 4096), (3, 3, 1024), (4, 4, 0)]
    assert ksort_permutation(sizes) == [3, 1, 4, 0, 2, 5]
    assert ksort_permutation([]) == []
    rng = random.Random(4000)
    for _ in range(50):
        sizes = [(rng.randint(0, 9), rng.randint(0, 9), rng.choice([0, 64, 128, 4096]))
                 for _ in range(rng.randint(1, 60))]
        perm = ksort_permutation(sizes)
        assert sorted(perm) == list(range(len(sizes)))
        ks = [sizes[i][2] for i in perm]
        assert ks == sorted(ks, reverse=True)
        for a, b in zip(perm, perm[1:]):  # stable: equal K keep their given order
            if sizes[a][2] == sizes[b][2]:
                assert a < b


def test_host_table_layout() -> None:
    counts = [3, 0, 2, 4]  # 9 tiles: problem starts 0, 3, 3, 5
    table = host_precompute_table(counts, 4)
    assert table.shape == (4, 3, 2) and table.dtype == np.int32
    problem_of = [0, 0, 0, 2, 2, 3, 3, 3, 3]
    start_of = [0, 0, 0, 3, 3, 5, 5, 5, 5]
    for t in range(9):
        assert tuple(table[t % 4, t // 4]) == (problem_of[t], start_of[t])
    # Slots past the last tile are (-1, -1): CTAs 1..3 have nothing in slot 2.
    assert (table[1:, 2] == -1).all()


def test_host_table_more_ctas_than_tiles_and_no_tiles() -> None:
    table = host_precompute_table([1, 0, 1], 5)
    assert table.shape == (5, 1, 2)
    assert table_assignment(table, [1, 0, 1]).per_cta == (((0, 0),), ((2, 0),), (), (), ())
    empty = host_precompute_table([0, 0], 3)
    assert empty.shape == (3, 1, 2) and (empty == -1).all()
    assert table_assignment(empty, [0, 0]).per_cta == ((), (), ())
    assert host_precompute_table([], 2).shape == (2, 1, 2)


def test_device_visitor_edge_cases() -> None:
    # No problems, only empty problems, and a long run of empty problems before the only tile.
    assert device_visit([], 3).per_cta == ((), (), ())
    assert device_visit([0] * 70, 2).per_cta == ((), ())
    counts = [0] * 100 + [1]
    assert device_visit(counts, 2).per_cta == (((100, 0),), ())
    state = DeviceVisitorState()
    assert device_next(state, 0, counts) == (100, 0)
    assert state.base_problem == 100 and state.windows_loaded == 4  # windows at 0, 32, 64, 96
    assert device_next(state, 1, counts) is None


def test_device_visitor_resumes_from_the_hit_problem() -> None:
    counts = [2] * 100
    state = DeviceVisitorState()
    assert device_next(state, 0, counts) == (0, 0)
    assert device_next(state, 150, counts) == (75, 150)  # two windows ahead
    assert state.base_problem == 75 and state.base_tile == 150
    before = state.windows_loaded
    assert device_next(state, 151, counts) == (75, 150)  # same problem: one load
    assert state.windows_loaded == before + 1


@pytest.mark.parametrize(
    "counts, windows",
    [
        ([3], 4),  # three hits in the first window, then the final miss
        ([2] + [0] * 31, 3),  # a miss with exactly one window of problems: no extra load
        ([2] + [0] * 32, 4),  # 33 problems: the final miss looks at the second window too
        ([0] * 32 + [1], 3),  # window 0 is all empty: skip it, hit, final miss
        ([0] * 64, 2),  # nothing anywhere: two windows, then done
        ([], 1),
    ],
)
def test_device_visitor_window_loads_exact(counts: list[int], windows: int) -> None:
    (visited, loaded), = device_visit_with_stats(counts, 1)
    assert visited == sum(counts)
    assert loaded == windows


def test_device_visitor_window_statistics_single_cta() -> None:
    # One CTA over 1000 one-tile problems: one load per tile plus the final miss.
    counts = [1] * 1000
    (visited, windows), = device_visit_with_stats(counts, 1)
    assert visited == 1000 and windows == 1001
    # A grid wider than a window: each search skips ceil(132/32) windows at most, and the total
    # stays within the bound because the skipped windows add up to one pass over the problems.
    for visited, windows in device_visit_with_stats(counts, 132):
        assert windows <= visited + math.ceil(1000 / WARP) + 1


def test_cost_model_empty_and_order() -> None:
    cost = cost_model([(0, 128, 64), (128, 0, 64)], 128, 128, 64, 4)
    assert cost.makespan == 0.0 and cost.mean == 0.0 and cost.efficiency == 1.0
    assert cost.per_cta.shape == (4,) and not cost.per_cta.any()
    sizes = [(128, 128, 64), (128, 128, 640)]
    a = cost_model(sizes, 128, 128, 64, 2)
    assert list(a.per_cta) == [1.0, 10.0]
    b = cost_model(sizes, 128, 128, 64, 2, order=[1, 0])
    assert list(b.per_cta) == [10.0, 1.0]
    c = cost_model(sizes, 128, 128, 64, 2, per_tile_overhead=2.5)
    assert list(c.per_cta) == [3.5, 12.5]


def test_should_sort_by_k_decisions() -> None:
    uniform = [(1152, 768, 1024), (768, 1152, 1024), (640, 512, 1024)] * 5
    assert not should_sort_by_k(uniform, 128, 128, TILE_K, 108)
    assert not should_sort_by_k([], 128, 128, TILE_K, 108)
    already_sorted = [CUTLASS_EXAMPLE[i] for i in ksort_permutation(CUTLASS_EXAMPLE)]
    assert not should_sort_by_k(already_sorted, 128, 128, TILE_K, 108)
    # Mixed K but one wave per CTA either way: sorting cannot shorten the makespan.
    one_tile_each = [(128, 128, 64 * (i + 1)) for i in range(8)]
    assert not should_sort_by_k(one_tile_each, 128, 128, TILE_K, 8)
    rng = random.Random(5000)
    for _ in range(40):
        sizes = [(rng.randint(1, 2000), rng.randint(1, 2000), 1024) for _ in range(20)]
        assert not should_sort_by_k(sizes, 128, 128, TILE_K, 132)


def test_should_sort_by_k_matches_the_cost_model() -> None:
    rng = random.Random(6000)
    for _ in range(60):
        sizes, tile_m, tile_n, ctas = random_case(rng)
        decision = should_sort_by_k(sizes, tile_m, tile_n, TILE_K, ctas)
        base = cost_model(sizes, tile_m, tile_n, TILE_K, ctas).makespan
        srt = cost_model(sizes, tile_m, tile_n, TILE_K, ctas, ksort_permutation(sizes)).makespan
        assert decision == (srt < 0.98 * base)


def test_should_sort_by_k_accepts_lists() -> None:
    sizes = [list(s) for s in CUTLASS_EXAMPLE]
    assert should_sort_by_k(sizes, 128, 128, TILE_K, 108)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Tail split: the last wave's tiles as half-K units (kernels with tail_split).


@pytest.mark.parametrize(
    "total,num_ctas,k_tiles,want",
    [
        (7448, 132, 64, (7392, 56, 2)),  # mixtral (seed 1234): 56.42 waves
        (4336, 132, 64, None),  # moe-prefill: 112 tiles in the last wave, more than half
        (264, 132, 64, None),  # whole waves only
        (133, 132, 64, (132, 1, 4)),  # one tile: ways capped by K (64 / 16)
        (133, 132, 512, (132, 1, 8)),  # ... and by SPLIT_WAYS
        (16, 132, 512, (0, 16, 8)),  # a launch of 16 tiles: 128 CTAs busy
        (30, 132, 512, (0, 30, 4)),  # 132 // 30
        (66, 132, 64, (0, 66, 2)),  # one half-full wave: every tile split in two
        (67, 132, 64, None),
        (10, 132, 15, None),  # K too short to split
        (10, 132, 16, (0, 10, 2)),  # the shortest split: two shares of 8 k-tiles
        (10, 132, 48, (0, 10, 3)),
        (0, 132, 64, None),
        (5, 1, 64, None),
        (600, 300, 64, None),  # more CTAs than the counters hold
    ],
)
def test_tail_split_units(total: int, num_ctas: int, k_tiles: int, want) -> None:
    from moe_gemm.ops.schedule import tail_split_units

    assert tail_split_units(total, num_ctas, k_tiles) == want


def test_tail_split_units_max_ways() -> None:
    from moe_gemm.ops.schedule import tail_split_units

    assert tail_split_units(16, 132, 512, max_ways=2) == (0, 16, 2)
    assert tail_split_units(16, 132, 512, max_ways=16) == (0, 16, 8)  # 132 // 16
    assert tail_split_units(4, 132, 4096, max_ways=16) == (0, 4, 16)


def _tail_expected(counts: list[int], ks: list[int], num_ctas: int, max_ways: int
                   ) -> Assignment:
    """Independent of the module: with rem tiles in a last wave of at most half the grid and
    K long enough, tail tile i is stored by CTA (ways - 1) * rem + i instead of CTA i."""
    base = [list(o) for o in expected_assignment(counts, num_ctas).per_cta]
    total = sum(counts)
    rem = total % num_ctas
    k = max(ks, default=0)
    if rem == 0 or 2 * rem > num_ctas or k < 16:
        return Assignment(tuple(tuple(o) for o in base))
    ways = min(num_ctas // rem, max_ways, max(k // 16, 2))
    for i in range(rem):
        tile = base[i][-1]  # CTA i's last tile is linear tile full + i
        if ks[tile[0]] >= 16:
            base[i].pop()
            base[(ways - 1) * rem + i].append(tile)
    return Assignment(tuple(tuple(o) for o in base))


@pytest.mark.parametrize("seed", range(60))
def test_tail_split_assignment_random(seed: int) -> None:
    """One K for every problem (the forms with a tail split), the varlen form's zero tail
    (K = 0) last or not, any ways cap."""
    from moe_gemm.ops.schedule import tail_split_assignment

    rng = random.Random(seed)
    num_ctas = rng.choice([8, 33, 132])
    counts = [rng.choice([0, 0, 1, 3, 8, 17]) for _ in range(rng.randint(1, 50))]
    k = rng.choice([0, 2, 15, 16, 40, 64, 300])
    ks = [k] * len(counts)
    if rng.random() < 0.5:
        counts.append(rng.choice([0, 1, 2]))
        ks.append(0)
    max_ways = rng.choice([2, 3, 8, 16])
    got = tail_split_assignment(counts, ks, num_ctas, max_ways)
    assert got == _tail_expected(counts, ks, num_ctas, max_ways)
    assert_exactly_once(got, counts)


def test_tail_split_assignment_mixtral() -> None:
    from moe_gemm.ops.schedule import tail_split_assignment

    counts = [16 * 56, 17 * 56, 17 * 56, 17 * 56, 17 * 56, 16 * 56, 16 * 56, 17 * 56]
    got = tail_split_assignment(counts, [64] * 8, 132)
    assert sum(counts) == 7448
    # CTAs 0..55 publish their last unit (store 56 tiles), 56..111 finish one (57 stored).
    assert [len(o) for o in got.per_cta] == [56] * 56 + [57] * 56 + [56] * 20
    assert got.per_cta[56][-1] == (7, 17 * 56 - 56)  # tail tile 0: expert 7's first last-wave
    # K too short to split (and the zero tail, K = 0): the plain round robin.
    assert tail_split_assignment(counts, [8] * 8, 132) == linear_assignment(counts, 132)


@pytest.mark.parametrize("seed", range(40))
def test_tail_split_tiles_clusters(seed: int) -> None:
    """The cluster form of the split's Python truth: every tile of every problem stored once
    (none past an edge); 1x1 is tail_split_assignment mapped to tile coordinates; a cluster
    whose last wave is not split stores what cta_tiles says; a split one stores each cluster
    tile's tiles on the CTAs of one cluster (ranks in order)."""
    from moe_gemm.ops.schedule import (
        cta_tiles,
        tail_split_assignment,
        tail_split_tiles,
        tail_split_units,
    )

    rng = random.Random(seed)
    num_ctas = rng.choice([16, 66, 132])
    tm, tn = rng.choice([(128, 192), (128, 128), (192, 128), (128, 256)])
    cm, cn = rng.choice([(1, 1), (1, 2), (2, 1)])
    sizes = [(rng.choice([0, 1, 64, 129, 300, 700]), rng.choice([1, 2, 3, 5]) * tn)
             for _ in range(rng.randint(1, 12))]
    k = rng.choice([8, 16, 64, 256])
    swizzle = rng.choice([0, 2, 8])
    got = tail_split_tiles(sizes, [k] * len(sizes), tm, tn, num_ctas, swizzle, cm, cn)
    assert len(got) == num_ctas
    stored = Counter(t for cta in got for t in cta)
    every = Counter((p, mt, nt) for p, (m, n) in enumerate(sizes)
                    for mt in range(ceil_div(m, tm)) for nt in range(ceil_div(n, tn)))
    assert stored == every
    size = cm * cn
    units = sum(ceil_div(m, tm * cm) * ceil_div(n, tn * cn) for m, n in sizes)
    if tail_split_units(units, num_ctas // size, k) is None:
        assert got == cta_tiles(sizes, tm, tn, num_ctas, swizzle, cm, cn)
    if size == 1:
        counts = [ceil_div(m, tm) * ceil_div(n, tn) for m, n in sizes]
        owners = tail_split_assignment(counts, [k] * len(sizes), num_ctas).per_cta
        assert got == [[(p, *tile_coord(j, ceil_div(sizes[p][0], tm), ceil_div(sizes[p][1], tn),
                                        swizzle)) for p, j in cta] for cta in owners]
    for c in range(0, num_ctas, size):  # a cluster's CTAs store the same cluster tiles
        peers = [[(p, mt // cm, nt // cn) for p, mt, nt in got[c + r]] for r in range(size)]
        assert all(set(q) <= set(peers[0]) or set(peers[0]) <= set(q) for q in peers)


def test_even_row_span_splits_each_expert_into_near_equal_tiles() -> None:
    split = even_row_split
    assert split(0) == [] and split(1) == [16] and split(16) == [16] and split(17) == [32]
    assert split(137) == [144] and split(257) == [144, 128]
    assert split(567) == [192, 192, 192]
    for unit in (8, 16):
        for rows in range(0, 2100, 3):
            tiles = split(rows, 256, unit)
            assert len(tiles) == -(-rows // 256)  # the tile count of 256-row tiles
            assert sum(tiles) == -(-rows // unit) * unit  # rows rounded up to the unit only
            assert all(t % unit == 0 and 0 < t <= 256 for t in tiles)
            assert not tiles or max(tiles) - min(tiles) <= unit  # in step
            # The spans tile the expert's rows once, in order; only the last passes its end.
            first = 0
            for j, t in enumerate(tiles):
                assert even_row_span(j, rows, 256, unit) == (first, t)
                first += t
            assert not tiles or first - tiles[-1] < rows <= first
