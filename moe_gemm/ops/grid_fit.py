"""How a launch's tiles fill the grid: tile counts per form, and the whole-wave tile fit.

A persistent launch runs its tiles in waves of one tile per SM (132 on an H100 SXM or an
H200). Where the tile count is known on the host (grouped_gemm's lists, grouped_mm's 3-D
form, a 2-D grouped_mm of one expert) and the work is compute-bound, a tile whose count ends
a little past a whole wave leaves most SMs idle for the last one: one dense 3000 x 1000 x 1536
GEMM in 128x128 tiles is 192 tiles, 1.45 waves, where 192x128 tiles make 129, one wave.
`wave_fit` then moves the choice to the tile of a small family that runs the fewest
tile-area-waves, when that saves a clear share of the time. For grouped_mm of several experts
the routing (on the GPU) decides the count; it lies in a range (`routed_ctas`) over which the
waves are averaged, so a tile is moved only where most routings gain.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from moe_gemm.kernels.sm90.constants import SPLIT_PART_K_TILES, TILE_K
from moe_gemm.ops import schedule as sched

# Mainloops of at most this many k-tiles (K <= 1024 at TILE_K = 64) take the ping-pong schedule.
SHORT_K_TILES = 16
# K from which a cooperative launch's short last wave is split by default (grouped_mm's and
# grouped_gemm's rules; the grid-filling rule takes the split on its own terms).
LONG_K = 4096

# Tile counts: (tile_m, tile_n) -> tiles, or with a cluster (tile_m, tile_n, cm, cn) -> the
# CTAs a launch takes, as a (fewest, most) range: equal where the count is known.
TileCount = Callable[[int, int], float]
CtaCount = Callable[[int, int, int, int], tuple[float, float]]


def expected_tiles(T: int, E: int, N: int, tile_m: int, tile_n: int) -> float:
    """About how many tiles a launch of T rows routed over E experts has, the routing
    unknown (it lives on the GPU): rows spread uniformly, so E * (1 - (1 - 1/E)^T) experts
    get rows, each its rows / tile_m tiles plus half a partial one (or one, if fewer rows).
    Skewed routing fills fewer experts, so this is an upper bound of sorts."""
    if T <= 0 or E <= 0:
        return 0.0
    active = E * -math.expm1(T * math.log1p(-1.0 / E)) if E > 1 else 1.0
    m_tiles = active * max(1.0, T / active / tile_m + 0.5)
    return m_tiles * -(-N // tile_n)


def list_tiles(sizes) -> TileCount:
    """The exact tile count of a list of (M, N, K) problems, per tile shape."""
    return lambda tm, tn: sum(-(-m // tm) * -(-n // tn) for m, n, _ in sizes if m > 0 and n > 0)


def batched_tiles(G: int, M: int, N: int) -> TileCount:
    """The exact tile count of G problems of M x N, per tile shape."""
    return lambda tm, tn: G * -(-M // tm) * -(-N // tn)


def cluster_ctas(blocks: Sequence[tuple[int, int, int]]) -> CtaCount:
    """The CTAs a launch of (count, M, N) blocks (count problems of M x N each) takes in
    clusters of cm x cn: the two CTAs of a pair always share one problem, so a problem with
    an odd tile count along the pair's axis leaves a partner idle (it still holds an SM)."""
    def count(tm: int, tn: int, cm: int, cn: int) -> tuple[float, float]:
        total = 0
        for g, m, n in blocks:
            if m > 0 and n > 0:
                total += g * (-(-(-(-m // tm)) // cm) * cm) * (-(-(-(-n // tn)) // cn) * cn)
        return total, total
    return count


def routed_ctas(T: int, E: int, N: int) -> CtaCount:
    """The CTAs of T rows routed over E experts, the routing unknown (it lives on the GPU):
    at fewest the rows packed into whole m-tiles, at most one partial m-tile more per expert
    that gets rows (and its pair partner in a 2x1 cluster), times the n-tiles."""
    active = min(E, T)

    def count(tm: int, tn: int, cm: int, cn: int) -> tuple[float, float]:
        n_ctas = -(-(-(-N // tn)) // cn) * cn
        fewest = -(-(-(-T // tm)) // cm) * cm
        return fewest * n_ctas, max(fewest, T // tm + active * cm) * n_ctas
    return count


def fill_grid(schedule: str, tile: tuple[int, int], tiles: Callable[[int, int], float],
               num_sms: int, k_tiles: float, shares: int = 0, switch_ok: bool = False
               ) -> tuple[str, tuple[int, int], bool]:
    """(schedule, tile, tail split) where `tile` leaves most SMs idle (tiles(tile_m, tile_n):
    the launch's tile count) and the mainloops are long (more than SHORT_K_TILES k-tiles; a
    short one is bound by its launch and epilogue, where nothing was measured): few routed
    rows (decode on a few experts) or few problems of long K. Then the launch is bound by how
    many SMs stream the weights, not by the tile's L2 traffic. shares: the most CTAs the
    tail split may share a tile over (split_shares: MOE_GEMM_SPLIT_WAYS), 0 where it may not
    be taken (it splits a launch of at most half the grid over K, tail_split.py); switch_ok:
    the schedule may change (not pinned).

    H200 (`moe-gemm tune --shapes ... --configs`, CUDA-graph replays, L2 cold). Without the
    split (2026-12-01): ping-pong 64x256 -> 64x128 at 1-8 routed rows, E=64 N=2048 K=7168 1
    row 35.9 -> 19.5 us, 4 rows 42.2 -> 32.3; E=16 N=5120 K=8192 1 row 42.5 -> 27.9; E=8
    N=4096 K=14336 2 rows 78.2 -> 59.6; E=128 N=1536 K=2048 8 rows 17.0 -> 13.1; E=8 N=14336
    K=4096 2 rows (112 tiles) 60.7 -> 58.0; a wave nearly full stays (8 x 1x4096x4096, 128
    tiles, 65.0 us against 67.2). Cooperative 128x256 -> 128x64 on long K: E=8 N=512 K=32768
    1024 rows 302 -> 133 us, E=4 N=1024 K=16384 512 rows 155 -> 65; the 3-D form, 8 x
    128x512x32768 299 -> 142, 4 x 256x1024x16384 153 -> 84. One expert of 3000 rows, N=1000
    (~96 tiles of 128x256, over half a wave) stays. With the split over up to 8 CTAs
    (2026-12-01, later): cooperative 128x128 split beat 128x64 on all four long-K cases (117
    against 133, 57.5 against 65.2, 103 against 142, 74.0 against 83.1; 128x256 split 120,
    64.5, 109, 76.7; a second run 124 / 131 / 113, 54.8 / 62.6 / 58.2, 101 / 129, 73.6 /
    86.6; 8 x 512x512x7168, 128 tiles of 128x128 and no split, 58.1 against 73.9). At one
    routed row cooperative 128x64 split in four or more beat ping-pong 64x128: E=64 N=2048
    K=7168 (32 tiles, 4 shares) 14.8 against 19.7 us, E=16 N=2048 K=4096 (32, 4) 11.8
    against 12.7, E=4 N=1024 K=14336 (16, 8) 17.7 against 36.5; split in two it lost: E=32
    N=1024 K=2048 10.4 against 7.9, E=8 N=4096 K=4096 14.5 against 12.9, 8 x 64x512x7168
    31.3 against 24.0."""
    if k_tiles <= SHORT_K_TILES:
        return schedule, tile, False
    if schedule == "pingpong" and tile in ((64, 256), (64, 128)):
        # (four shares at least: two lost to ping-pong 64x128 on every shape measured; a
        # MOE_GEMM_SPLIT_WAYS cap under four leaves no launch four shares, so no switch.
        # 128x64 first: at one routed row its four shares beat 128x128's seven, whose
        # finisher adds six 64 KiB partials; 128x128 where only its tiles get four, on the
        # mainloops where that was measured, K >= 16384)
        if shares >= 4 and switch_ok and k_tiles >= 4 * SPLIT_PART_K_TILES:
            if tiles(128, 64) <= num_sms / 4:
                return "cooperative", (128, 64), True
            if k_tiles >= 16 * SPLIT_PART_K_TILES and tiles(128, 128) <= num_sms / 4:
                return "cooperative", (128, 128), True
        # (a wave nearly full stays: 8 x 1x4096x4096, 128 tiles, 65.0 us against 67.2)
        if tile == (64, 256) and tiles(*tile) <= num_sms * 7 / 8:
            return schedule, (64, 128), False
    elif schedule == "cooperative" and tile[0] == 128 and tile[1] > 64:
        if tiles(*tile) <= num_sms / 2:
            if shares:
                return schedule, (128, min(tile[1], 128)), True
            return schedule, (128, 64), False
    return schedule, tile, False


def last_wave_long(sizes: tuple[tuple[int, int, int], ...], sort: bool,
                    tile: tuple[int, int], num_sms: int, max_k_tiles: int, shares: int) -> bool:
    """Whether the kernel would split the lists' last wave (its ways sized by the deepest
    problem) and a tile of that wave has K >= LONG_K: the last wave holds the last problems in
    launch order, which K-sort makes the shallowest, so a deep problem elsewhere says nothing
    of it (a wave of K = 512 tiles is not split by the kernel, only given a workspace)."""
    ordered = [sizes[i] for i in sched.ksort_permutation(sizes)] if sort else sizes
    counts = sched.tiles_per_problem(ordered, *tile)
    split = sched.tail_split_units(sum(counts), num_sms, max_k_tiles, shares)
    if split is None:
        return False
    left = split[1]  # the last wave's tiles, counted from the end
    for (_, _, k), count in zip(reversed(ordered), reversed(counts)):
        if count:
            if k >= LONG_K:
                return True
            left -= count
            if left <= 0:
                return False
    return False


# A 1x2 cluster idles the second CTA of a pair wherever a problem has an odd n-tile count (it
# loads its half of A for its peer and stores nothing): picked automatically only when such
# idle tiles are at most this fraction of the work.
PAIR_IDLE_MAX = 1 / 16


def pairs_fill(sizes: tuple[tuple[int, int, int], ...], tile_m: int, tile_n: int) -> bool:
    """Whether n-tile pairs cover the set's tiles with little idle work (PAIR_IDLE_MAX)."""
    work = idle = 0
    for m, n, k in sizes:
        if m > 0 and n > 0:
            tiles_m, tiles_n = -(-m // tile_m), -(-n // tile_n)
            k_tiles = max(1, -(-k // TILE_K))
            work += tiles_m * tiles_n * k_tiles
            idle += tiles_m * (tiles_n & 1) * k_tiles
    return work > 0 and idle <= work * PAIR_IDLE_MAX


# The family the fit picks from: (schedule, tile_m, tile_n, cluster_m, cluster_n), tiles that
# ran within ~6% of one another per unit of output on a compute-bound launch of many waves
# (H200, 2026-12-01, `moe-gemm tune --configs`, one 8192 x 2048 x 2048 GEMM: 90-93 us for
# ping-pong 128x128 1x2, 64x256 2x1, cooperative 128x256 and 256x128; 98 for ping-pong
# 192x128 1x2). Left out: 128x208 and 128x224, slower per unit there and on one wave
# (3000 x 1000 x 1536: 30.0 and 19.0 us where their tile-area-waves predicted about 17), and
# ping-pong 192x128 without the pair (113.5 us against 81.5 with it, 3000^3). In ties the
# larger tile first (fewer bytes per FLOP), then this order.
FAMILY = (
    ("cooperative", 128, 256, 1, 1),
    ("cooperative", 256, 128, 1, 1),
    ("pingpong", 192, 128, 1, 2),
    ("pingpong", 128, 192, 1, 2),
    ("pingpong", 128, 160, 1, 2),
    ("pingpong", 128, 128, 1, 2),
    ("pingpong", 64, 256, 2, 1),
)
# Move only where the fit's tile-area-waves are at most this share of the choice's.
GAIN = 0.92
# Past this many waves a partial last one costs at most 1/8: left as it is.
MAX_WAVES = 8
# FLOPs per byte of operands and output above which a launch is taken as compute-bound
# (the H200's ridge is ~206, 989 TFLOP/s over 4.8 TB/s; the H100's ~295): below, its time
# follows bytes, which a partial wave still moves at nearly the full rate.
MIN_INTENSITY = 256.0
# The tail split's fp32 join, in waves: a split last wave is charged its share of the grid
# plus this (the split ran 10% behind whole waves of 192x128: 75.3 against 67.6 us on
# 6144 x 1024 x 4096, where tile-area-waves gave 1.45 x 32768 against 2 x 24576).
SPLIT_JOIN_WAVES = 0.25
# CTA counts sampled across a routed launch's range (expected_waves).
SPREAD_POINTS = 9


def expected_waves(span: tuple[float, float], num_sms: int, cm: int, cn: int,
                   split: bool = False) -> float:
    """waves() averaged over CTA counts spread evenly across span (fewest, most): where the
    routing decides the count, a tile whose range straddles a wave's end is charged the
    chance of the extra wave, not all or nothing."""
    lo, hi = span
    if hi <= lo:
        return waves(lo, num_sms, cm, cn, split)
    points = [math.ceil(lo + (hi - lo) * i / (SPREAD_POINTS - 1)) for i in range(SPREAD_POINTS)]
    return sum(waves(p, num_sms, cm, cn, split) for p in points) / SPREAD_POINTS



def waves(ctas: float, num_sms: int, cm: int, cn: int, split: bool = False) -> float:
    """The waves a launch of `ctas` CTAs runs in (clusters of cm x cn take whole pairs of
    SMs); split: the cooperative tail split shares a last wave of at most half the grid."""
    slots = max(1, num_sms // (cm * cn) * (cm * cn))
    full, rest = divmod(ctas, slots)
    if rest == 0:
        return full
    if split and rest <= slots / 2:
        return full + rest / slots + SPLIT_JOIN_WAVES
    return full + 1


def wave_fit(schedule: str, tile: tuple[int, int], cluster: tuple[int, int], split: bool,
             ctas: CtaCount, num_sms: int, intensity: float, k_tiles: float,
             min_k_tiles: int, area: float = 0.0) -> tuple[str, int, int, int, int] | None:
    """The FAMILY member to run instead of (schedule, tile, cluster, split), or None to keep
    it: only on compute-bound launches (intensity, FLOPs per byte, >= MIN_INTENSITY) of
    mainloops longer than min_k_tiles (short ones are bound by their epilogues), of more than
    half a wave (fewer tiles are the grid-filling rule's) and at most MAX_WAVES, and only
    where the member's tile-area-waves are at most GAIN of the choice's. area: the launch's
    output elements; no tile runs fewer tile-area-waves than area / num_sms, so a choice
    within GAIN of that is kept without counting the members."""
    if intensity < MIN_INTENSITY or k_tiles <= min_k_tiles:
        return None
    cm, cn = cluster
    now_span = ctas(tile[0], tile[1], cm, cn)
    if sum(now_span) / 2 <= num_sms / 2:
        return None
    now_waves = expected_waves(now_span, num_sms, cm, cn, split)
    if now_waves > MAX_WAVES:
        return None
    now = now_waves * tile[0] * tile[1]
    if GAIN * now < area / num_sms:
        return None
    best, best_key = None, None
    for rank, member in enumerate(FAMILY):
        _, tm, tn, mcm, mcn = member
        cost = expected_waves(ctas(tm, tn, mcm, mcn), num_sms, mcm, mcn) * tm * tn
        key = (cost, -tm * tn, rank)
        if best_key is None or key < best_key:
            best, best_key = member, key
    if best is None or best_key[0] > GAIN * now:
        return None
    if (best[0], (best[1], best[2]), (best[3], best[4])) == (schedule, tile, cluster):
        return None
    return best


def intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte (0 for an empty launch)."""
    return flops / bytes_moved if bytes_moved > 0 else 0.0
