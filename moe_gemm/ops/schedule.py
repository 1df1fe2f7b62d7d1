"""The tile schedule: which CTA computes which output tile of which problem.

This module is the single source of truth for the persistent kernels' work assignment, in
plain Python/numpy so it runs (and is tested) anywhere:

- A problem (M, N, K) is cut into ceil(M/tile_m) x ceil(N/tile_n) output tiles; each tile runs
  ceil(K/tile_k) k-iterations (K = 0 still has tiles: they store zeros). M = 0 or N = 0 gives
  no tiles.
- Problems are laid end to end (optionally in K-descending order, `ksort_permutation`) and
  their tiles numbered 0..total-1. CTA c of a grid of G takes linear tiles c, c+G, c+2G, ...
  (round robin, as CUTLASS's grouped schedulers do). In the ping-pong kernel the CTA's two
  consumer warpgroups take its tiles alternately.
- Inside a problem, `tile_coord` rasterizes a tile index to (m_tile, n_tile) by a raster code
  (`swizzle`, kernels/sm90/constants.raster_code): panels of m-tiles (or n-tiles), the
  panel's axis fastest, optionally serpentine. With panels of m-tiles consecutive tiles share
  B's columns (B, the expert weights, is most of the bytes) and a panel's A rows stay in L2.
- Two visitors find (problem, tile) for a linear tile index: `device_visit` emulates exactly
  the warp-wide search the kernel runs on the GPU (CUTLASS kDeviceOnly: a window of 32 problem
  sizes, an inclusive prefix sum by shuffles, a ballot, forward only), and
  `host_precompute_table` builds the per-CTA table of (problem_idx, problem_start_tile) that
  the host visitor uploads (CUTLASS kHostPrecompute). Both must assign identically.
- `cost_model` gives each CTA's work in k-iterations and the makespan, which decides K-sort.
- Tail split (general/varlen/batched kernels for long K, `tail_split_assignment`; under a
  cluster its unit is the cluster tile, `tail_split_tiles`): when the last wave holds rem <=
  G/2 tiles, the launch splits them `ways` times (`tail_split_units`): unit full+j (full =
  the tiles of the whole waves) is share j // rem of tile full + j mod rem over a share of
  K; a tile takes min(ways, its own k-tiles / 16, at least 2) shares (fewer where a list's
  problem is shallower than the deepest), the first of them publish fp32 partials and the
  last one's CTA adds them and stores.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_gemm.kernels.sm90.constants import (
    SPLIT_MAX_CTAS,
    SPLIT_MIN_K_TILES,
    SPLIT_PART_K_TILES,
    SPLIT_WAYS,
    SWAP_ROW_UNIT,
    SWAP_TILE_ROWS,
    raster_fields,
)

Size = tuple[int, int, int]  # (M, N, K)
WARP = 32


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tiles_per_problem(sizes: Sequence[Size], tile_m: int, tile_n: int) -> list[int]:
    """Output tiles of each problem: ceil(M/tile_m) * ceil(N/tile_n) (0 if M or N is 0)."""
    return [-(-m // tile_m) * -(-n // tile_n) for m, n, _ in sizes]  # inline: once per new set


def even_row_span(m_tile: int, rows: int, max_rows: int = SWAP_TILE_ROWS,
                  unit: int = SWAP_ROW_UNIT) -> tuple[int, int]:
    """(first row, rows computed) of swapped tile m_tile of an expert of `rows` rows: its
    ceil(rows / unit) units split over ceil(rows / max_rows) tiles as evenly as they go, the
    larger shares first (the kernel's swapped.even_row_span; the last tile's computed rows may
    pass the expert's end by less than a unit, which its store clips)."""
    units = ceil_div(max(rows, 0), unit)
    tiles = max(ceil_div(max(rows, 0), max_rows), 1)
    share, extra = divmod(units, tiles)
    first = m_tile * share + min(m_tile, extra)
    return first * unit, (share + (m_tile < extra)) * unit


def even_row_split(rows: int, max_rows: int = SWAP_TILE_ROWS, unit: int = SWAP_ROW_UNIT
                   ) -> list[int]:
    """The rows each of an expert's swapped tiles computes (even_row_span of each)."""
    return [even_row_span(j, rows, max_rows, unit)[1]
            for j in range(ceil_div(max(rows, 0), max_rows))]


def k_tiles(k: int, tile_k: int) -> int:
    """k-iterations of one output tile of a problem with this K."""
    return ceil_div(k, tile_k)


def tile_coord(t: int, tiles_m: int, tiles_n: int, swizzle: int = 0) -> tuple[int, int]:
    """(m_tile, n_tile) of tile `t` (0 <= t < tiles_m * tiles_n) inside one problem.

    `swizzle` is a raster code (kernels/sm90/constants.raster_code; the kernel's
    tile_scheduler.raster_tile computes the same): tiles go in panels of `panel` tiles along
    M (or N), the panel's own axis fastest, panel after panel (the last may be narrower);
    serpentine walks the other axis backwards in odd panels, so a panel starts where the
    previous one ended. A plain positive number is panels of that many m-tiles; panel 0 (or
    one at least the problem's extent) walks the whole problem along its axis (M fastest,
    column-major, along M; N fastest along N).
    """
    if not 0 <= t < tiles_m * tiles_n:
        raise ValueError(f"tile {t} outside a {tiles_m}x{tiles_n} problem")
    panel, along, serpentine = raster_fields(swizzle)
    fast, slow = (tiles_n, tiles_m) if along == "n" else (tiles_m, tiles_n)
    s = min(panel, fast) if panel > 0 else fast
    p, r = divmod(t, s * slow)
    width = min(s, fast - p * s)
    f, w = p * s + r % width, r // width
    if serpentine and p % 2 == 1:
        w = slow - 1 - w
    return (w, f) if along == "n" else (f, w)


def ksort_permutation(sizes: Sequence[Size]) -> list[int]:
    """Problem order by K descending; stable, so equal K keep their given order."""
    return sorted(range(len(sizes)), key=lambda i: -sizes[i][2])


@dataclass(frozen=True)
class Assignment:
    """Per CTA, the (problem, tile_in_problem) it computes, in order."""

    per_cta: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def num_ctas(self) -> int:
        return len(self.per_cta)


def linear_assignment(tile_counts: Sequence[int], num_ctas: int) -> Assignment:
    """The assignment by definition: linear tile t goes to CTA t % num_ctas."""
    owners: list[list[tuple[int, int]]] = [[] for _ in range(num_ctas)]
    t = 0
    for p, count in enumerate(tile_counts):
        for j in range(count):
            owners[t % num_ctas].append((p, j))
            t += 1
    return Assignment(tuple(tuple(o) for o in owners))


def cta_tiles(
    sizes_mn: Sequence[tuple[int, int]],
    tile_m: int,
    tile_n: int,
    num_ctas: int,
    swizzle: int = 0,
    cluster_m: int = 1,
    cluster_n: int = 1,
) -> list[list[tuple[int, int, int]]]:
    """Per CTA, the (problem, m_tile, n_tile) tiles it stores, in order: what the kernel's
    trace records (either visitor; both schedules: a ping-pong CTA's warpgroups take its tiles
    alternately, in this order).

    With a cm x cn cluster the unit of work is a cluster tile (cm x cn adjacent tiles of one
    problem, `swizzle` ordering the cluster tiles); cluster c = cta // (cm * cn) takes linear
    cluster tiles round robin and its CTA of rank r the tile (mu * cm + r, nu) (2x1) or
    (mu, nu * cn + r) (1x2). A rank past the problem's last m-tile (n-tile) computes but
    stores nothing, so it has no entry here.
    """
    size = cluster_m * cluster_n
    units = [ceil_div(m, tile_m * cluster_m) * ceil_div(n, tile_n * cluster_n)
             for m, n in sizes_mn]
    owners = linear_assignment(units, num_ctas // size).per_cta
    return _cluster_ranks(owners, sizes_mn, tile_m, tile_n, num_ctas, swizzle, cluster_m,
                          cluster_n)


def _cluster_ranks(owners, sizes_mn: Sequence[tuple[int, int]], tile_m: int, tile_n: int,
                   num_ctas: int, swizzle: int, cluster_m: int, cluster_n: int
                   ) -> list[list[tuple[int, int, int]]]:
    """Per CTA, the (problem, m_tile, n_tile) it stores, from each cluster's (problem, cluster
    tile) list: its CTA of rank r takes the rank's tile, none past the problem's edge."""
    size = cluster_m * cluster_n
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(num_ctas)]
    for c, cluster in enumerate(owners):
        for p, local in cluster:
            m, n = sizes_mn[p]
            mu, nu = tile_coord(local, ceil_div(m, tile_m * cluster_m),
                                ceil_div(n, tile_n * cluster_n), swizzle)
            for rank in range(size):
                mt = mu * cluster_m + (rank if cluster_m > 1 else 0)
                nt = nu * cluster_n + (rank if cluster_n > 1 else 0)
                if mt < ceil_div(m, tile_m) and nt < ceil_div(n, tile_n):
                    out[c * size + rank].append((p, mt, nt))
    return out


def packed_pair_tiles(
    sizes_mn: Sequence[tuple[int, int]],
    experts: int,
    tile_m: int,
    tile_n: int,
    num_ctas: int,
    swizzle: int = 0,
) -> list[list[tuple[int, int, int]]]:
    """`cta_tiles` for the varlen kernel's packed pairs (2x1 clusters, GroupedGemmSm90
    packed_pairs): the experts' tiles (problems [0, experts), each rasterized by `swizzle`)
    are numbered end to end and cluster unit u takes tiles 2u and 2u + 1, rank r tile 2u + r
    (an odd last tile: rank 1 computes it again and stores nothing); the zero tail (problems
    from `experts` on, the kernel's problem E) follows in ordinary 2x1 cluster tiles. Units go
    round robin to the num_ctas / 2 clusters."""
    tiles = []
    for p in range(experts):
        m, n = sizes_mn[p]
        tm, tn = ceil_div(m, tile_m), ceil_div(n, tile_n)
        tiles += [(p, *tile_coord(j, tm, tn, swizzle)) for j in range(tm * tn)]
    units: list[list[tuple[int, int, int]]] = [
        [tiles[i] for i in (2 * u, 2 * u + 1) if i < len(tiles)]
        for u in range(ceil_div(len(tiles), 2))]
    for p in range(experts, len(sizes_mn)):
        m, n = sizes_mn[p]
        um, un = ceil_div(m, 2 * tile_m), ceil_div(n, tile_n)
        for z in range(um * un):
            mu, nu = tile_coord(z, um, un, swizzle)
            units.append([(p, 2 * mu + r, nu) for r in range(2)
                          if 2 * mu + r < ceil_div(m, tile_m)])
    clusters = num_ctas // 2
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(num_ctas)]
    for u, unit in enumerate(units):
        for rank, tile in enumerate(unit):
            out[2 * (u % clusters) + rank].append(tile)
    return out


@dataclass(frozen=True)
class MmaWork:
    """Tensor-core work of a problem set in multiply-adds: what the problems need and what
    the kernel's tiles compute (every tile is computed whole; a cluster's rank past the edge
    computes its tile too)."""

    useful: int
    computed: int

    @property
    def wasted_fraction(self) -> float:
        """Computed work beyond the useful, as a fraction of the useful (0.05 = 5% extra)."""
        return (self.computed - self.useful) / self.useful if self.useful else 0.0


def mma_work(
    sizes: Sequence[Size], tile_m: int, tile_n: int, tile_k: int = 64,
    cluster_m: int = 1, cluster_n: int = 1, swapped: bool = False,
) -> MmaWork:
    """Useful and computed multiply-adds of `sizes` under a tile (and cluster) shape: M and N
    round up to whole (cluster) tiles, K to whole k-tiles; swapped tiles (the rows on the
    WGMMA's N side) compute each problem's rows split by even_row_split instead."""
    useful = computed = 0
    for m, n, k in sizes:
        if m <= 0 or n <= 0 or k <= 0:
            continue
        useful += m * n * k
        rows = (sum(even_row_split(m)) if swapped
                else ceil_div(m, tile_m * cluster_m) * tile_m * cluster_m)
        cols = ceil_div(n, tile_n * cluster_n) * tile_n * cluster_n
        computed += rows * cols * ceil_div(k, tile_k) * tile_k
    return MmaWork(useful, computed)


# ---------------------------------------------------------------------------------------------
# Device visitor (kDeviceOnly), emulated lane by lane.


@dataclass
class DeviceVisitorState:
    """What the kernel's scheduler warp keeps between searches (forward only)."""

    base_problem: int = 0  # first problem of the window
    base_tile: int = 0  # linear index of base_problem's first tile
    windows_loaded: int = 0  # statistics: 32-problem windows read from GPU memory


def device_next(
    state: DeviceVisitorState, t: int, tile_counts: Sequence[int]
) -> tuple[int, int] | None:
    """(problem, problem_start_tile) of linear tile t, or None past the last tile.

    The kernel's algorithm, step for step: lane i loads problem base+i's tile count (0 past
    the last problem), an inclusive warp prefix sum gives each lane's end tile; if t is below
    the window's end, popc(ballot(end <= t)) is the hit lane, else the window moves 32
    problems on. The window then restarts at the hit problem, so the next search (t grows
    by the grid size) usually finds its tile in the first window.
    """
    G = len(tile_counts)
    while True:
        state.windows_loaded += 1
        counts = [
            tile_counts[state.base_problem + lane] if state.base_problem + lane < G else 0
            for lane in range(WARP)
        ]
        incl = list(np.cumsum(counts))  # the 5-step shuffle-up scan
        ends = [state.base_tile + int(v) for v in incl]
        window_end = ends[WARP - 1]
        if t < window_end:
            hit = sum(1 for e in ends if e <= t)  # popc(ballot(end <= t))
            start = ends[hit] - counts[hit]
            state.base_problem += hit
            state.base_tile = start
            return state.base_problem, start
        if state.base_problem + WARP >= G:
            return None
        state.base_problem += WARP
        state.base_tile = window_end


def device_visit(tile_counts: Sequence[int], num_ctas: int) -> Assignment:
    """The whole grid's assignment as the device visitor computes it."""
    owners = []
    for c in range(num_ctas):
        state = DeviceVisitorState()
        mine = []
        t = c
        while (hit := device_next(state, t, tile_counts)) is not None:
            problem, start = hit
            mine.append((problem, t - start))
            t += num_ctas
        owners.append(tuple(mine))
    return Assignment(tuple(owners))


# ---------------------------------------------------------------------------------------------
# Tail split.


def tail_split_units(total: int, num_ctas: int, k_tiles: int,
                     max_ways: int = SPLIT_WAYS) -> tuple[int, int, int] | None:
    """(full, rem, ways) when the kernel splits the last wave of `total` tiles of `k_tiles`
    k-iterations each on `num_ctas` CTAs: full = the tiles of the whole waves, rem = the last
    wave's tiles (0 < 2 * rem <= num_ctas), ways = the CTAs each of them is split over:
    min(num_ctas // rem, max_ways, k_tiles // SPLIT_PART_K_TILES, at least 2). None where it
    does not split (no partial wave, one more than half full, or K under SPLIT_MIN_K_TILES)."""
    full = total // num_ctas * num_ctas
    rem = total - full
    if rem > 0 and 2 * rem <= num_ctas <= SPLIT_MAX_CTAS and k_tiles >= SPLIT_MIN_K_TILES:
        ways = min(num_ctas // rem, max_ways, max(k_tiles // SPLIT_PART_K_TILES, 2))
        return full, rem, ways
    return None


def tail_split_assignment(
    tile_counts: Sequence[int], k_tiles: Sequence[int], num_ctas: int,
    max_ways: int = SPLIT_WAYS,
) -> Assignment:
    """Per CTA, the (problem, tile_in_problem) whose results it stores, in order, for a
    tail-split kernel (what its trace records). The launch's split (`tail_split_units`) takes
    the largest k_tiles (the varlen and batched forms share one K, the varlen form's zero
    tail has none); tile i of the last wave, of k k-tiles, takes w = min(ways, k //
    SPLIT_PART_K_TILES, at least 2) shares (w = ways where every problem has one K; fewer for
    a general-form problem shallower than the deepest) and is stored by its finisher, CTA
    (w - 1) * rem + i; a last-wave tile with fewer than SPLIT_MIN_K_TILES k-tiles (the varlen
    form's zero tail, a general-form problem of short K) is not split and CTA i computes it
    whole, as without the split."""
    counts = list(tile_counts)
    total = sum(counts)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    owners: list[list[tuple[int, int]]] = [[] for _ in range(num_ctas)]
    split = tail_split_units(total, num_ctas, max(k_tiles, default=0), max_ways)
    full, rem, ways = split if split is not None else (total, 0, 1)
    for c in range(num_ctas):
        t = c
        while True:
            share = 0  # 0: a whole tile; s >= 1: share s - 1 of a tail tile
            lin = t
            if split is not None and t >= full:
                j = t - full
                if j >= ways * rem:
                    break
                share, lin = j // rem + 1, full + j % rem
            elif t >= total:
                break
            # The last problem starting at or before lin (empty ones share the next's start).
            p = int(np.searchsorted(starts, lin, side="right")) - 1
            whole = k_tiles[p] < SPLIT_MIN_K_TILES
            # (a tile's own shares: fewer than the launch's where its K is shallower)
            tile_ways = min(ways, max(k_tiles[p] // SPLIT_PART_K_TILES, 2))
            if share == 0 or (share == 1 if whole else share == tile_ways):
                owners[c].append((p, lin - int(starts[p])))
            t += num_ctas
    return Assignment(tuple(tuple(o) for o in owners))


def tail_split_tiles(
    sizes_mn: Sequence[tuple[int, int]], k_tiles: Sequence[int], tile_m: int, tile_n: int,
    num_ctas: int, swizzle: int = 0, cluster_m: int = 1, cluster_n: int = 1,
    max_ways: int = SPLIT_WAYS,
) -> list[list[tuple[int, int, int]]]:
    """Per CTA, the (problem, m_tile, n_tile) tiles it stores, in order, for a tail-split
    kernel of any cluster (what its trace records; `cta_tiles` without the split). Under a
    cm x cn cluster the split's unit is the cluster tile: `tail_split_assignment` over the
    cluster tiles on num_ctas / (cm * cn) clusters says which cluster stores each, and its
    CTA of rank r stores the rank's tile of it (none past the problem's edge)."""
    size = cluster_m * cluster_n
    units_mn = [(ceil_div(m, tile_m * cluster_m), ceil_div(n, tile_n * cluster_n))
                for m, n in sizes_mn]
    owners = tail_split_assignment([um * un for um, un in units_mn], k_tiles,
                                   num_ctas // size, max_ways).per_cta
    return _cluster_ranks(owners, sizes_mn, tile_m, tile_n, num_ctas, swizzle, cluster_m,
                          cluster_n)


# ---------------------------------------------------------------------------------------------
# Host visitor (kHostPrecompute).


def host_precompute_table(tile_counts: Sequence[int], num_ctas: int) -> np.ndarray:
    """(num_ctas, entries, 2) int32: slot s of CTA c holds linear tile s*num_ctas + c as
    (problem_idx, problem_start_tile); slots past the last tile hold (-1, -1).

    entries = ceil(total_tiles / num_ctas) (at least 1, so the table is never empty).
    """
    counts = np.asarray(tile_counts, dtype=np.int64)
    total = int(counts.sum())
    entries = max(1, ceil_div(total, num_ctas))
    table = np.full((num_ctas, entries, 2), -1, dtype=np.int32)
    if total:
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        problem_of_tile = np.repeat(np.arange(len(counts)), counts)
        t = np.arange(total)
        table[t % num_ctas, t // num_ctas, 0] = problem_of_tile
        table[t % num_ctas, t // num_ctas, 1] = starts[problem_of_tile]
    return table


def table_assignment(table: np.ndarray, tile_counts: Sequence[int]) -> Assignment:
    """Read a host table back the way the kernel does: slot by slot until a -1 entry."""
    num_ctas, entries, _ = table.shape
    owners = []
    for c in range(num_ctas):
        mine = []
        for s in range(entries):
            problem, start = int(table[c, s, 0]), int(table[c, s, 1])
            if problem < 0:
                break
            mine.append((problem, s * num_ctas + c - start))
        owners.append(tuple(mine))
    return Assignment(tuple(owners))


# ---------------------------------------------------------------------------------------------
# Cost model and K-sort.


@dataclass(frozen=True)
class Cost:
    per_cta: np.ndarray  # k-iterations (plus per-tile overhead) per CTA
    makespan: float  # the busiest CTA's work
    mean: float  # ideal balanced work per CTA

    @property
    def efficiency(self) -> float:
        """mean / makespan: 1.0 is perfect balance."""
        return self.mean / self.makespan if self.makespan else 1.0


def cost_model(
    sizes: Sequence[Size],
    tile_m: int,
    tile_n: int,
    tile_k: int,
    num_ctas: int,
    order: Sequence[int] | None = None,
    per_tile_overhead: float = 0.0,
) -> Cost:
    """Each CTA's work in k-iterations under round-robin assignment of `order`'s tiles.

    per_tile_overhead adds a fixed cost (in k-iteration units) per tile, e.g. the epilogue.
    """
    idx = list(range(len(sizes))) if order is None else list(order)
    ordered = [sizes[i] for i in idx]
    counts = np.asarray(tiles_per_problem(ordered, tile_m, tile_n), dtype=np.int64)
    work = np.asarray([k_tiles(k, tile_k) for _, _, k in ordered], dtype=np.float64)
    work = work + per_tile_overhead
    total = int(counts.sum())
    if total == 0:
        return Cost(np.zeros(num_ctas), 0.0, 0.0)
    tile_work = np.repeat(work, counts)
    per_cta = np.bincount(np.arange(total) % num_ctas, weights=tile_work, minlength=num_ctas)
    return Cost(per_cta, float(per_cta.max()), float(tile_work.sum() / num_ctas))


def should_sort_by_k(
    sizes: Sequence[Size], tile_m: int, tile_n: int, tile_k: int, num_ctas: int
) -> bool:
    """K-sort when the cost model says it shortens the makespan by more than 2%."""
    if len({s[2] for s in sizes}) <= 1:
        return False  # one K (every MoE layer): no order to gain, and no key to build
    key = tuple((int(m), int(n), int(k)) for m, n, k in sizes)  # lists, numpy rows: hashable
    return _should_sort_by_k(key, tile_m, tile_n, tile_k, num_ctas)


@functools.lru_cache(maxsize=256)
def _should_sort_by_k(
    sizes: tuple[Size, ...], tile_m: int, tile_n: int, tile_k: int, num_ctas: int
) -> bool:
    ks = {k for _, _, k in sizes}
    if len(ks) <= 1:
        return False
    base = cost_model(sizes, tile_m, tile_n, tile_k, num_ctas)
    perm = ksort_permutation(sizes)
    if perm == list(range(len(sizes))):
        return False
    better = cost_model(sizes, tile_m, tile_n, tile_k, num_ctas, perm)
    return better.makespan < 0.98 * base.makespan
