"""moe_gemm.ops.schedule: the per-CTA tile sequences the GPU trace tests compare against
(`cta_tiles`, clusters included) and the MMA work a tile shape computes (`mma_work`)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from moe_gemm.kernels.sm90.constants import raster_code
from moe_gemm.ops.schedule import (
    ceil_div,
    cta_tiles,
    linear_assignment,
    mma_work,
    packed_pair_tiles,
    tile_coord,
    tiles_per_problem,
)

RASTERS = [0, 8, raster_code(2, "m", True), raster_code(3, "n"), raster_code(2, "n", True)]


def _random_sets(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        yield [(rng.choice([0, 1, 63, 64, 65, 127, 128, 129, 255, 257, 600, 1000]),
                8 * rng.randint(1, 100)) for _ in range(rng.randint(1, 40))]


@pytest.mark.parametrize("raster", RASTERS)
def test_cta_tiles_without_cluster_is_round_robin_then_raster(raster):
    for sizes in _random_sets(1, 30):
        for tile, ctas in (((128, 256), 132), ((256, 208), 7), ((64, 192), 1)):
            counts = tiles_per_problem([(m, n, 64) for m, n in sizes], *tile)
            owners = linear_assignment(counts, ctas).per_cta
            want = [[(p, *tile_coord(j, ceil_div(sizes[p][0], tile[0]),
                                     ceil_div(sizes[p][1], tile[1]), raster))
                     for p, j in cta] for cta in owners]
            assert cta_tiles(sizes, *tile, ctas, raster) == want


@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)])
@pytest.mark.parametrize("raster", RASTERS)
def test_cta_tiles_with_cluster_store_every_tile_once_pairs_in_one_problem(cluster, raster):
    cm, cn = cluster
    for sizes in _random_sets(2, 30):
        for tile, ctas in (((128, 192), 132), ((256, 128), 8), ((64, 256), 2)):
            per_cta = cta_tiles(sizes, *tile, ctas, raster, cm, cn)
            stored = Counter(t for cta in per_cta for t in cta)
            want = {(p, m, n) for p, (rows, cols) in enumerate(sizes)
                    for m in range(ceil_div(rows, tile[0])) for n in range(ceil_div(cols, tile[1]))}
            assert set(stored) == want and set(stored.values()) <= {1}
            # The two CTAs of a cluster work in lockstep on one problem's adjacent tiles.
            for c in range(0, ctas, 2):
                for a, b in zip(per_cta[c], per_cta[c + 1]):
                    if a[0] == b[0] and (a[1] // cm, a[2] // cn) == (b[1] // cm, b[2] // cn):
                        assert (b[1] - a[1], b[2] - a[2]) == (cm - 1, cn - 1)


def test_cta_tiles_past_the_edge_store_nothing():
    # One problem of 3 m-tiles, 2x1: the second cluster tile's rank 1 is past the edge.
    per_cta = cta_tiles([(300, 256)], 128, 256, 2, 8, 2, 1)
    assert per_cta == [[(0, 0, 0), (0, 2, 0)], [(0, 1, 0)]]
    # 1x2 with 3 n-tiles: the pair's second CTA has no third column.
    per_cta = cta_tiles([(100, 600)], 128, 256, 2, 8, 1, 2)
    assert per_cta == [[(0, 0, 0), (0, 0, 2)], [(0, 0, 1)]]


@pytest.mark.parametrize("raster", RASTERS)
def test_packed_pairs_store_every_tile_once_in_consecutive_pairs(raster):
    for sizes in _random_sets(3, 30):
        for tail in (0, 1, 300):
            all_sizes = sizes + ([(tail, sizes[0][1])] if tail else [])
            for tile, ctas in (((128, 256), 132), ((64, 256), 6), ((128, 128), 2)):
                per_cta = packed_pair_tiles(all_sizes, len(sizes), *tile, ctas, raster)
                stored = Counter(t for cta in per_cta for t in cta)
                want = {(p, m, n) for p, (rows, cols) in enumerate(all_sizes)
                        for m in range(ceil_div(rows, tile[0]))
                        for n in range(ceil_div(cols, tile[1]))}
                assert set(stored) == want and set(stored.values()) <= {1}
                # The experts' tiles in the tile order, pair after pair: rank 1 of a cluster
                # holds the tile after its rank 0's; the zero tail in ordinary 2x1 tiles.
                order = [(p, *tile_coord(j, ceil_div(m, tile[0]), ceil_div(n, tile[1]), raster))
                         for p, (m, n) in enumerate(sizes)
                         for j in range(ceil_div(m, tile[0]) * ceil_div(n, tile[1]))]
                nxt = {a: b for a, b in zip(order, order[1:])}
                E = len(sizes)
                for c in range(0, ctas, 2):
                    first = [t for t in per_cta[c] if t[0] < E]
                    second = [t for t in per_cta[c + 1] if t[0] < E]
                    assert len(first) - len(second) in (0, 1)
                    assert second == [nxt[a] for a in first[:len(second)]]
                    tail_first = set(t for t in per_cta[c] if t[0] >= E)
                    for p, m, n in (t for t in per_cta[c + 1] if t[0] >= E):
                        assert m % 2 == 1 and (p, m - 1, n) in tail_first


def test_packed_pairs_cross_experts():
    # Experts of 3 and 1 m-tiles, one column: cluster tiles would compute 6, the pairs 4.
    per_cta = packed_pair_tiles([(300, 256), (100, 256)], 2, 128, 256, 2, 8)
    assert per_cta == [[(0, 0, 0), (0, 2, 0)], [(0, 1, 0), (1, 0, 0)]]
    # An odd count: the last pair's rank 1 stores nothing.
    per_cta = packed_pair_tiles([(300, 256)], 1, 128, 256, 4, 8)
    assert per_cta == [[(0, 0, 0)], [(0, 1, 0)], [(0, 2, 0)], []]


def test_mma_work_counts_whole_tiles():
    w = mma_work([(130, 200, 72), (0, 64, 64), (64, 64, 0)], 128, 128)
    assert w.useful == 130 * 200 * 72
    assert w.computed == 256 * 256 * 128
    assert w.wasted_fraction == pytest.approx(256 * 256 * 128 / (130 * 200 * 72) - 1)
    # A 2x1 cluster rounds the rows up to whole pairs of tiles.
    assert mma_work([(129, 256, 64)], 128, 256, cluster_m=2).computed == 256 * 256 * 64
    assert mma_work([(129, 256, 64)], 128, 256).computed == 256 * 256 * 64
    assert mma_work([(128, 256, 64)], 128, 256, cluster_m=2).wasted_fraction == 1.0
    assert mma_work([], 128, 128).wasted_fraction == 0.0


def test_mma_work_of_swapped_tiles_rounds_rows_to_the_even_split() -> None:
    sizes = [(137, 200, 100), (257, 128, 64), (0, 128, 64), (16, 1, 64)]
    work = mma_work(sizes, 256, 128, 64, swapped=True)
    assert work.useful == 137 * 200 * 100 + 257 * 128 * 64 + 16 * 64
    # rows 144, 272 (144 + 128) and 16; columns to 128-column tiles; K to 64-deep stages
    assert work.computed == 144 * 256 * 128 + 272 * 128 * 64 + 16 * 128 * 64
    plain = mma_work(sizes, 256, 128, 64)
    assert plain.computed > work.computed  # 256-row M tiles: 256 + 512 + 256 rows
