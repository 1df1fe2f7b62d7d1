"""Pick a kernel configuration from problem shapes: pure functions, cached.

Every choice a GemmConfig leaves at "auto" is decided here from host-known facts only (shapes
known on the host, dtype, SM count, device name), never from values on the GPU, so the MoE
path stays free of host synchronisation. Given the device's name (the host wrappers pass it),
a config with every tuned field at "auto" is first looked up in the tuned tables
(moe_gemm.ops.tuned: the exact shape, else the vote of the nearest timed shapes); what they do not
answer, and every config that pins a tuned field, is decided by the rules below (the numbers
behind each rule are in the comments and AGENTS.md). A choice not taken from an exact table
entry, for a config that pins no tuned field, is then fitted to whole waves where the launch
is compute-bound (grid_fit.wave_fit: the tile count known on the host, or its range over the
routings for grouped_mm of several experts).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from moe_gemm.config import GemmConfig
from moe_gemm.env import env_value
from moe_gemm.kernels.sm90.constants import SPLIT_WAYS, TILE_K
from moe_gemm.ops import grid_fit, tuned
from moe_gemm.ops import schedule as sched
from moe_gemm.ops.choice_rules import (  # noqa: F401 (KernelChoice, raster_of, choice_fields re-exported)
    AB_ITEMSIZE,
    ITEMSIZE,
    KernelChoice,
    check_tail_split,
    check_tile,
    choice_fields,
    cluster_choice,
    fill_known,
    fit_schedule,
    fit_waves,
    general_rules,
    narrowed,
    pick_tile,
    pinned_whole_epilogue,
    raster_of,
    short_rows,
    split_allowed,
    warn_unusable,
)
from moe_gemm.ops.choice_switches import (  # noqa: F401 (re-exported)
    FAST_GATE_ENV,
    GATHER_FENCE_ENV,
    GATHER_WIDE_ENV,
    GENERAL_SWITCHES,
    L2_POLICY,
    PACKED_PAIRS_ENV,
    PEEK_WAIT_ENV,
    SPLIT_WAYS_ENV,
    TAIL_SPLIT_ENV,
    TRIM_A_ENV,
    general_switches,
    packed_pairs_problem,
    split_shares,
    tail_split_enabled,
    trim_a_default,
    with_l2_hints,
    with_packed_pairs,
    with_peek_wait,
    with_split_ways,
    with_trim_a,
)
from moe_gemm.ops.grid_fit import LONG_K, SHORT_K_TILES
from moe_gemm.ops.swap_rules import (  # noqa: F401 (the swapped tiles' rules, re-exported)
    SWAP_AB_ENV,
    SWAP_MAX_EXPERTS,
    SWAP_MIN_K,
    SWAP_ROWS_PER_EXPERT,
    swap_ab_wanted,
    swapped_choice,
    swapped_tiles,
)


def _filled(config: GemmConfig, T: int, E: int, N: int, K: int, num_sms: int,
            shares: int) -> GemmConfig:
    """A tile voted by the nearest tuned shapes, fitted to the grid as grid_fit.fill_grid fits
    the rules' tile: the vote weighs shapes by distance in N, K and rows per expert, which does
    not say how many experts get rows (one routed row on 64 experts lies beside 16 tokens x
    top-8)."""
    return narrowed(config, lambda tm, tn: grid_fit.expected_tiles(T, E, N, tm, tn), num_sms,
                     -(-K // TILE_K), shares)


def _general_filled(config: GemmConfig, sizes: tuple[tuple[int, int, int], ...],
                    num_sms: int, shares: int = 0) -> GemmConfig:
    """_filled for grouped_gemm's lists: the exact tile count (a vote's path only; a set of
    as many problems as SMs fills the grid: no pass over it)."""
    if len(sizes) >= num_sms:
        return config
    live = [(m, n, k) for m, n, k in sizes if m > 0 and n > 0]
    if not live or len(live) >= num_sms:
        return config
    return narrowed(config, grid_fit.list_tiles(live), num_sms,
                     sum(-(-k // TILE_K) for _, _, k in live) / len(live), shares)


def choose_general(
    config: GemmConfig, sizes: tuple[tuple[int, int, int], ...], num_sms: int,
    out_itemsize: int = 2, *, device: str | None = None, dtype: str = "bfloat16",
    out_dtype: str | None = None,
) -> KernelChoice:
    """For grouped_gemm (sizes known on the host). Cached per problem set: a repeated call
    with the same sizes costs one tuple hash (~1 us for 8 problems) instead of the rules and
    the K-sort cost model (~30 us). device: the GPU's name, for the tuned tables (None:
    rules only); dtype / out_dtype: torch dtype names of the inputs and the output."""
    state = tuned.state() if device else None
    return with_split_ways(with_peek_wait(with_l2_hints(_choose_general_tuned(
        config, sizes, num_sms, out_itemsize, device, dtype, out_dtype or dtype, state,
        split_shares()))))


@functools.lru_cache(maxsize=256)
def _choose_general_tuned(config, sizes, num_sms, out_itemsize, device, dtype, out_dtype,
                          state, shares) -> KernelChoice:
    hit = _general_hit(config, sizes, num_sms, device, dtype, out_dtype)
    if hit is not None:
        try:
            tuned_config = hit.apply(config)
            if hit.how == "exact":
                return _choose_general(tuned_config, sizes, num_sms, out_itemsize, shares)
            tuned_config = _general_filled(tuned_config, sizes, num_sms, shares)
            return _general_fitted(config, tuned_config, sizes, num_sms, out_itemsize, shares)
        except ValueError as exc:
            warn_unusable(hit, exc)
    return _general_fitted(config, config, sizes, num_sms, out_itemsize, shares)


# Lists of at most this many problems, of at most FIT_MAX_SIZES distinct live (M, N) sizes,
# are fitted to whole waves: the fit passes over the problems and counts each candidate's CTAs
# per size (8 tile shapes) on every new problem set (8 problems on the CPU-only dev machine:
# 36 us a new set's choice, 16 without the fit; a repeated set's choice is cached); a longer
# list is left as the rules have it.
FIT_MAX_PROBLEMS = 64
FIT_MAX_SIZES = 16


def _general_fitted(user: GemmConfig, config: GemmConfig, sizes, num_sms: int,
                    out_itemsize: int, shares: int) -> KernelChoice:
    """_choose_general(config), fitted to whole waves (grid_fit.wave_fit) for short lists of
    a few distinct sizes."""
    choice = _choose_general(config, sizes, num_sms, out_itemsize, shares)
    if len(sizes) > FIT_MAX_PROBLEMS or user.tuning_pinned:
        return choice
    blocks: dict[tuple[int, int], int] = {}
    flops = bytes_moved = k_sum = area = 0.0
    for m, n, k in sizes:
        if m > 0 and n > 0:
            blocks[m, n] = blocks.get((m, n), 0) + 1
            if len(blocks) > FIT_MAX_SIZES:
                return choice
            flops += 2.0 * m * n * k
            bytes_moved += (m * k + n * k) * AB_ITEMSIZE + m * n * out_itemsize
            k_sum += k
            area += m * n
    if not blocks:
        return choice
    live = sum(blocks.values())
    return fit_waves(
        config, choice, lambda c: _choose_general(c, sizes, num_sms, out_itemsize, shares),
        grid_fit.cluster_ctas([(g, m, n) for (m, n), g in blocks.items()]),
        flops, bytes_moved, k_sum / live, num_sms, area)


def _general_key(sizes, dtype: str, out_dtype: str) -> tuple[tuned.Key, int] | None:
    """(key, rows) for a problem set the tables can hold: non-empty problems sharing N, K
    (one pass, stopping at the first N or K that differs)."""
    n0 = k0 = None
    rows = live = 0
    for m, n, k in sizes:
        if m > 0 and n > 0:
            if n0 is None:
                n0, k0 = n, k
            elif n != n0 or k != k0:
                return None
            rows += m
            live += 1
    if not live:
        return None
    return tuned.Key("general", dtype, out_dtype, live, n0, k0,
                     tuned.rows_bucket(rows / live)), rows


def _general_hit(config, sizes, num_sms, device, dtype, out_dtype) -> tuned.Hit | None:
    if device is None or config.tuning_pinned or not tuned.has_form(device, "general"):
        return None
    found = _general_key(sizes, dtype, out_dtype)
    if found is None:
        return None
    rules = rules_baseline("general", config, num_sms, dtype=dtype, out_dtype=out_dtype,
                           shape=sizes)
    return tuned.lookup(device, found[0], found[1], num_sms, rules)


@functools.lru_cache(maxsize=256)
def _choose_general(
    config: GemmConfig, sizes: tuple[tuple[int, int, int], ...], num_sms: int,
    out_itemsize: int = 2, shares: int = SPLIT_WAYS,
) -> KernelChoice:
    # One pass over the problems (a new problem set every call comes here every call).
    count = sum_m = sum_k_tiles = max_k_tiles = 0
    max_n = None
    for m, n, k in sizes:
        if m > 0 and n > 0:
            count += 1
            sum_m += m
            k_tiles = -(-k // TILE_K)
            sum_k_tiles += k_tiles
            max_k_tiles = k_tiles if k_tiles > max_k_tiles else max_k_tiles
            max_n = n if max_n is None or n > max_n else max_n
    avg_m = sum_m / max(1, count)
    max_n = 128 if max_n is None else max_n
    # H200, 2026-11-21, interleaved back-to-back A/B: long-K problems want cooperative
    # 128x256 (uniform headline: 561 us vs pingpong 128x128 620); short mainloops want
    # ping-pong, whose epilogue hides behind the other warpgroup's mainloop (k-varying,
    # 2-16 k-tiles per tile: pingpong 128x192 122 us vs cooperative 130).
    avg_k_tiles = sum_k_tiles / max(1, count)
    schedule, tile, stages = general_rules(config, avg_m, max_n, avg_k_tiles)
    ruled, filled_split = (schedule, tile), False
    if count < num_sms:  # (each live problem has a tile at least: no more can fill the grid)

        exact = grid_fit.list_tiles(sizes)

        def tiles(tm: int, tn: int) -> float:
            # At least sum_m / tm of them: past the grid, no pass over the problems (131
            # problems of ~256 rows and long K: 64-82 us a choice with the pass, 50 without,
            # as before the grid was counted; CPU-only dev machine).
            if sum_m / tm > num_sms:
                return sum_m / tm
            return exact(tm, tn)

        schedule, tile, stages, filled_split = fill_known(
            config, schedule, tile, stages, avg_m, max_n, tiles, num_sms, avg_k_tiles, shares)
    else:
        schedule, tile, stages = short_rows(config, schedule, tile, stages, avg_m, max_n,
                                            avg_k_tiles)
    visitor = config.visitor if config.visitor != "auto" else "device"
    cm, cn = cluster_choice(config)
    if (config.cluster_m is None and config.visitor != "host" and schedule == "cooperative"
            and not config.tail_split and tile[1] == 256
            and grid_fit.pairs_fill(sizes, tile[0], tile[1])):
        # 1x2, as for the batched form: the two CTAs of a cluster take adjacent n-tiles of one
        # m-tile and multicast A. Uniform headline as 256 lists (H200s, 2026-11-21,
        # interleaved, docs/measurements.md): 528 us vs 542 at 1x1 and
        # torch.bmm 533 (two runs); on another machine 541 vs 543, bmm 545.
        cm, cn = 1, 2
    if cm * cn > 1:
        visitor = "device"  # (GemmConfig refuses a pinned cluster with visitor="host")
    if config.sort_by_k is None:
        sort = sched.should_sort_by_k(sizes, tile[0], tile[1], TILE_K, num_sms)
    else:
        sort = config.sort_by_k
    if config.tail_split is None:
        # As grouped_mm's rule (long K, cooperative, 1x1, the tile not narrowed), where the
        # exact tile count says the kernel will split a last wave with long-K tiles in it.
        tail_split = filled_split or (
            shares > 0 and schedule == "cooperative" and visitor == "device" and cm * cn == 1
            and (schedule, tile) == ruled and max_k_tiles * TILE_K >= LONG_K
            and grid_fit.last_wave_long(sizes, sort, tile, num_sms, max_k_tiles, shares))
    else:
        tail_split = config.tail_split
        if tail_split:
            check_tail_split(schedule, visitor, cm, cn)
    epi_whole = pinned_whole_epilogue(config, schedule, out_itemsize)
    swizzle = raster_of(config, 8)
    return _general_choice(schedule, visitor, tile[0], tile[1], stages, sort, cm, cn, swizzle,
                           epi_whole, tail_split and shares > 0)


@functools.lru_cache(maxsize=64)
def _general_choice(schedule: str, visitor: str, tile_m: int, tile_n: int, stages: int | None,
                    sort: bool, cluster_m: int = 1, cluster_n: int = 1, swizzle: int = 8,
                    epi_whole: bool = False, tail_split: bool = False) -> KernelChoice:
    """One KernelChoice per distinct value: building the frozen dataclass (14 fields, each set
    through object.__setattr__) took ~12 us on the CPU-only dev machine, paid on every new
    problem set."""
    return KernelChoice(schedule, visitor, tile_m, tile_n, stages, sort, swizzle,
                        cluster_m=cluster_m, cluster_n=cluster_n, epi_whole=epi_whole,
                        tail_split=tail_split)


def choose_varlen(
    config: GemmConfig, T: int, E: int, N: int, K: int, num_sms: int, out_itemsize: int = 2,
    *, device: str | None = None, dtype: str = "bfloat16", out_dtype: str | None = None,
    split_ok: bool = True, swap_ok: bool = False, table_unswap: bool = True,
) -> KernelChoice:
    """For grouped_mm (per-expert row counts live on the GPU: decide from T and E only).
    device: the GPU's name, for the tuned tables (None: rules only); split_ok=False: for a
    kernel built without the tail split (the masked form), whose choice must not count on
    it; swap_ok: the launch can run swapped tiles (grouped_mm's plain 2-D x 3-D form), taken
    where swap_ab_wanted says so; table_unswap=False: a tuned entry's swap_ab=False (timed on
    grouped_mm's kernels) does not keep the M-side tiles where the window would swap (the
    fused kernels, whose epilogues rank the two differently: fused_launch.swappable)."""
    state = tuned.state() if device else None
    shares = split_shares() if split_ok else 0
    choice, measured = _choose_varlen_tuned(config, T, E, N, K, num_sms, out_itemsize, device,
                                            dtype, out_dtype or dtype, state, shares)
    if measured is False and not table_unswap:
        measured = None
    if swap_ok and swap_ab_wanted(config, T, E, K, out_itemsize, measured, N=N,
                                  num_sms=num_sms):
        if not choice.swap_ab:  # (a pin or a tuned entry made it so already, with its stages)
            choice = swapped_choice(choice, out_itemsize)
    elif choice.swap_ab and (not swap_ok or config.swap_ab is False
                             or env_value(SWAP_AB_ENV) is False):
        # A tuned entry's swapped kernel where the launch cannot run it (the masked and
        # fused forms) or the caller turned it off: the best other config the same search
        # timed on that shape, else the rules without the tables.
        choice = _choose_varlen_unswapped(config, T, E, N, K, num_sms, out_itemsize, device,
                                          dtype, out_dtype or dtype, state, shares)
    return with_packed_pairs(with_split_ways(with_peek_wait(with_trim_a(with_l2_hints(
        choice)))), config.packed_pairs)


def varlen_hit_choice(config: GemmConfig, hit: tuned.Hit | None, T: int, E: int, N: int,
                      K: int, num_sms: int, out_itemsize: int = 2) -> KernelChoice | None:
    """A tuned hit's choice for a varlen launch, finished as choose_varlen finishes its own;
    None without a hit or where the hit cannot build here (warned once). For a form of its
    own that looks the tables up itself (the fused kernels: fused_launch.fused_tuned)."""
    choice = _varlen_from_hit(config, hit, T, E, N, K, out_itemsize,
                              split_shares(), num_sms)
    if choice is None:
        return None
    return with_packed_pairs(with_split_ways(with_peek_wait(with_trim_a(with_l2_hints(
        choice)))), config.packed_pairs)


@functools.lru_cache(maxsize=512)
def _choose_varlen_tuned(config, T, E, N, K, num_sms, out_itemsize, device, dtype, out_dtype,
                         state, shares) -> tuple[KernelChoice, bool | None]:
    """(the choice, swap_ab as the tuned table's exact entry names it, else None). The tuner
    and `moe-gemm tune --rerank` name it where they timed the swapped kernel, and that
    measurement outranks the window (a neighbours pick does not: the window is the better
    guess off the tuned shapes)."""
    hit = _varlen_hit(config, T, E, N, K, num_sms, device, dtype, out_dtype)
    choice = _varlen_from_hit(config, hit, T, E, N, K, out_itemsize, shares, num_sms)
    if choice is not None:
        return choice, dict(hit.fields).get("swap_ab") if hit.how == "exact" else None
    return _varlen_fitted(config, config, T, E, N, K, out_itemsize, shares, num_sms), None


@functools.lru_cache(maxsize=512)
def _choose_varlen_unswapped(config, T, E, N, K, num_sms, out_itemsize, device, dtype,
                             out_dtype, state, shares) -> KernelChoice:
    """The choice for a launch that cannot run the swapped tiles its tuned entry names:
    tuned.unswapped_pick (that shape's fastest M-side config as timed nearby, else the
    neighbours' vote among M-side configs), else the rules."""
    hit = _varlen_hit(config, T, E, N, K, num_sms, device, dtype, out_dtype, unswapped=True)
    choice = _varlen_from_hit(config, hit, T, E, N, K, out_itemsize, shares, num_sms)
    if choice is not None:
        return choice
    return _varlen_fitted(config, config, T, E, N, K, out_itemsize, shares, num_sms)


def _varlen_from_hit(config, hit, T, E, N, K, out_itemsize, shares,
                     num_sms) -> KernelChoice | None:
    """A tuned hit's choice: an exact entry's config through the rules, a neighbours' pick
    filled and fitted to whole waves; None without a hit or where the hit cannot build here
    (warned once)."""
    if hit is None:
        return None
    try:
        tuned_config = hit.apply(config)
        if hit.how == "exact":
            return _varlen_rules(tuned_config, T, E, N, K, out_itemsize, shares, num_sms)
        tuned_config = _filled(tuned_config, T, E, N, K, num_sms, shares)
        return _varlen_fitted(config, tuned_config, T, E, N, K, out_itemsize, shares, num_sms)
    except ValueError as exc:
        warn_unusable(hit, exc)
        return None


def _varlen_fitted(user: GemmConfig, config: GemmConfig, T: int, E: int, N: int, K: int,
                   out_itemsize: int, shares: int, num_sms: int) -> KernelChoice:
    """_varlen_rules(config), fitted to whole waves (grid_fit.wave_fit): one expert (a dense
    layer through the grouped op) holds all T rows, an exact count; over more experts the
    count lies in a range the routing decides (grid_fit.routed_ctas)."""
    choice = _varlen_rules(config, T, E, N, K, out_itemsize, shares, num_sms)
    if T <= 0 or E <= 0 or user.tuning_pinned:
        return choice
    ctas = (grid_fit.cluster_ctas(((1, T, N),)) if E == 1 else grid_fit.routed_ctas(T, E, N))
    return fit_waves(
        config, choice, lambda c: _varlen_rules(c, T, E, N, K, out_itemsize, shares, num_sms),
        ctas, 2.0 * T * N * K,
        (T * K + min(E, T) * N * K) * AB_ITEMSIZE + T * N * out_itemsize, K, num_sms, T * N)


def _varlen_hit(config, T, E, N, K, num_sms, device, dtype, out_dtype,
                unswapped: bool = False) -> tuned.Hit | None:
    """The tables' answer for a varlen shape (tuned.lookup; unswapped: tuned.unswapped_pick,
    for a launch that cannot run an entry's swapped kernel)."""
    if device is None or config.tuning_pinned or T <= 0 or E <= 0:
        return None
    key = tuned.Key("varlen", dtype, out_dtype, E, N, K, tuned.rows_bucket(T / E))
    rules = rules_baseline("varlen", config, num_sms, dtype=dtype, out_dtype=out_dtype,
                           shape=(T, E, N, K))
    if unswapped:
        return tuned.unswapped_pick(device, key, T, rules)
    return tuned.lookup(device, key, T, num_sms, rules)


def _varlen_rules(config: GemmConfig, T: int, E: int, N: int, K: int, out_itemsize: int,
                  shares: int, num_sms: int) -> KernelChoice:
    avg_m = T / max(1, E)
    if config.schedule != "auto":
        schedule = config.schedule
    else:
        # Cooperative 128x256 from 128 rows per expert up (moe-down, 256 rows/expert: 191 us
        # vs pingpong 203; moe-prefill and mixtral likewise); below that a ping-pong tile
        # (moe-decode, 4 rows/expert: pingpong 64x256 271 us vs cooperative 300).
        schedule = "cooperative" if avg_m >= 128 and N >= 256 else "pingpong"
        if schedule == "cooperative" and -(-K // TILE_K) <= SHORT_K_TILES and N >= 192:
            # Short K: ping-pong hides each tile's epilogue behind the other warpgroup's
            # mainloop, as for grouped_gemm's short problems. E=128, N=2048, K=768, 256
            # rows/expert: pingpong 128x192 213 / 216 us vs cooperative 128x256 222 / 221 (two
            # runs, H200, 2026-11-21); at K=1408 (moe-down) cooperative still wins, 191 vs 200.
            schedule = "pingpong"
        schedule = fit_schedule(schedule, config)
    tile_narrowed = filled_split = False
    if config.tile_m is not None:
        tile = (config.tile_m, config.tile_n)
        check_tile(schedule, tile)
    else:
        picked = pick_tile(schedule, avg_m, N)
        ruled = schedule
        schedule, tile, filled_split = grid_fit.fill_grid(
            schedule, picked, lambda tm, tn: grid_fit.expected_tiles(T, E, N, tm, tn), num_sms,
            -(-K // TILE_K), shares if split_allowed(config) else 0,
            config.schedule == "auto")
        tile_narrowed = (schedule, tile) != (ruled, picked)
    visitor = config.visitor if config.visitor != "auto" else "device"
    stages = config.stages
    cm, cn = cluster_choice(config)
    if config.packed_pairs and config.cluster_m is None:
        cm, cn = 2, 1  # (packed pairs are the 2x1 cluster's)
    if cm * cn > 1:
        visitor = "device"
    # Long K, cooperative 128x256: 3 A/B stages (see choose_general), but in a 1x2 cluster
    # (A multicast) the 4th stage that fits: H200, 2026-11-30 (`benchmarks.same_config`, 21
    # pairs on 19 zoo projections, in-process), 4 stages over 3 a median 1.014x as fast (0.996
    # to 1.123; DeepSeek-V3 gate/up at 4096 tokens 4713 vs 5295 us, Kimi-K2 gate/up at 8192
    # 8368 vs 9158), level with QuACK, whose default takes 4 there.
    long_k_128x256 = schedule == "cooperative" and tile == (128, 256) and K >= 4096 and (
        (cm, cn) != (1, 2))
    if stages is None and long_k_128x256:
        stages = 3
    # Long K, 128x256, 16-bit output: the whole-tile epilogue (2 barrier syncs per tile, not
    # 16; its 64 KiB of staging leaves 3 A/B stages, which long K uses anyway). H200,
    # 2026-11-21, back-to-back: mixtral 2795 vs 2825 us (QuACK 2808), moe-prefill 2958 vs
    # 2982; at K=1408 (moe-down) the lost 4th stage costs more: 189 vs 184, so not there.
    if config.whole_epilogue is None:
        epi_whole = long_k_128x256 and out_itemsize == 2 and config.stages in (None, 3)
        if epi_whole:
            stages = 3
    else:
        epi_whole = pinned_whole_epilogue(config, schedule, out_itemsize)
    # Raster panel (m-tiles per panel, see schedule.tile_coord): 16 for the same long-K case.
    # A wider panel re-reads each expert's B from HBM fewer times (mixtral: 17 m-tiles per
    # expert, B 117 MB each: 3 passes at 8, 2 at 16), which saves power, and under sustained
    # load these shapes run at the 700 W cap. H200, 2026-11-21, each alone for ~1 s
    # (scripts/isolation_probe.py): mixtral 2860-2887 us vs 2925-2934 at 8, moe-prefill 3091
    # vs 3114; interleaved with other kernels (the bench) panels of 4-16 measured the same.
    swizzle = raster_of(config, 16 if epi_whole else 8)
    # Tail split (kernels/constants.py) for long K: when the last wave of tiles fills at most
    # half the grid, several CTAs share each of its tiles, a share of K each (mixtral: 7448
    # tiles of 128x256 on 132 SMs leave 56 in the last wave, split in two). Decided on the GPU
    # per launch (the tile count lives there); where the tail is too full, nothing is split.
    # Zoo prefill rows whose last wave it splits, up to 8 ways against 2 (H200, 2026-12-01,
    # benchmarks.env_ab): a median 1.004x as fast, 0.999-1.046 (Mixtral-8x22B down).
    # A tile fitted to the grid (grid_fit.fill_grid) takes it where fill_grid says so (its few
    # tiles split over K fill the grid), not otherwise: a 128x64 tile narrowed without it is
    # one short wave already, which the split's fp32 join slowed by 2-4% (133 against 136 us,
    # 65 against 68).
    if config.tail_split is None:
        tail_split = not config.packed_pairs and (filled_split or (
            schedule == "cooperative" and visitor == "device" and cm * cn == 1
            and K >= LONG_K and not tile_narrowed))
    else:
        tail_split = config.tail_split
        if tail_split:
            check_tail_split(schedule, visitor, cm, cn)
    choice = KernelChoice(schedule, visitor, tile[0], tile[1], stages, False, swizzle,
                          cluster_m=cm, cluster_n=cn, epi_whole=epi_whole,
                          tail_split=tail_split and shares > 0)
    if config.packed_pairs:
        # (a pin or a tuned entry; GemmConfig refused the pins that cannot build it, and the
        # rules' own cluster, panel or split must not make it unbuildable either)
        why = packed_pairs_problem(choice)
        if why is not None:
            raise ValueError(f"packed_pairs=True: {why}")
        choice = replace(choice, packed_pairs=True)
    # A config (a caller's pin or a tuned entry) with swap_ab=True: the swapped kernel, with
    # the config's raster, stages and cluster where it pins one (1x1 or 1x2; the rules' own
    # cluster is the M-side tile's, not the swapped one's).
    if not config.swap_ab:
        return choice
    return swapped_choice(choice, out_itemsize, config.stages,
                          config.cluster_n if config.cluster_m is not None else 1)


def choose_batched(config: GemmConfig, G: int, M: int, N: int, K: int, num_sms: int,
                   out_itemsize: int = 2, *, device: str | None = None, dtype: str = "bfloat16",
                   out_dtype: str | None = None) -> KernelChoice:
    """For grouped_mm's 3D x 3D form: the general rules for one (M, N, K) shared by all.
    device: the GPU's name, for the tuned tables (None: rules only)."""
    state = tuned.state() if device else None
    return with_split_ways(with_peek_wait(with_l2_hints(_choose_batched_tuned(
        config, G, M, N, K, num_sms, out_itemsize, device, dtype, out_dtype or dtype, state,
        split_shares()))))


@functools.lru_cache(maxsize=256)
def _choose_batched_tuned(config, G, M, N, K, num_sms, out_itemsize, device, dtype, out_dtype,
                          state, shares) -> KernelChoice:
    hit = _batched_hit(config, G, M, N, K, num_sms, device, dtype, out_dtype)
    if hit is not None:
        try:
            tuned_config = hit.apply(config)
            if hit.how == "exact":
                return _choose_batched(tuned_config, G, M, N, K, num_sms, out_itemsize, shares)
            tuned_config = narrowed(tuned_config, grid_fit.batched_tiles(G, M, N), num_sms,
                                     -(-K // TILE_K), shares)
            return _batched_fitted(config, tuned_config, G, M, N, K, num_sms, out_itemsize,
                                   shares)
        except ValueError as exc:
            warn_unusable(hit, exc)
    return _batched_fitted(config, config, G, M, N, K, num_sms, out_itemsize, shares)


def _batched_fitted(user: GemmConfig, config: GemmConfig, G: int, M: int, N: int, K: int,
                    num_sms: int, out_itemsize: int, shares: int) -> KernelChoice:
    """_choose_batched(config), fitted to whole waves (grid_fit.wave_fit)."""
    choice = _choose_batched(config, G, M, N, K, num_sms, out_itemsize, shares)
    if user.tuning_pinned:
        return choice
    return fit_waves(
        config, choice, lambda c: _choose_batched(c, G, M, N, K, num_sms, out_itemsize, shares),
        grid_fit.cluster_ctas(((G, M, N),)), 2.0 * G * M * N * K,
        G * ((M * K + N * K) * AB_ITEMSIZE + M * N * out_itemsize), K, num_sms, G * M * N)


def _batched_hit(config, G, M, N, K, num_sms, device, dtype, out_dtype) -> tuned.Hit | None:
    if device is None or config.tuning_pinned or G <= 0 or M <= 0:
        return None
    key = tuned.Key("batched", dtype, out_dtype, G, N, K, tuned.rows_bucket(M))
    rules = rules_baseline("batched", config, num_sms, dtype=dtype, out_dtype=out_dtype,
                           shape=(G, M, N, K))
    return tuned.lookup(device, key, G * M, num_sms, rules)


@functools.lru_cache(maxsize=256)
def _choose_batched(config: GemmConfig, G: int, M: int, N: int, K: int, num_sms: int,
                    out_itemsize: int = 2, shares: int = SPLIT_WAYS) -> KernelChoice:
    schedule, tile, stages = general_rules(config, M, N, -(-K // TILE_K))
    ruled = tile
    schedule, tile, stages, filled_split = fill_known(
        config, schedule, tile, stages, M, N, grid_fit.batched_tiles(G, M, N), num_sms,
        -(-K // TILE_K), shares)
    # Tiles are found by division (every problem has the same count): the visitor and K-sort
    # have nothing to decide here.
    cm, cn = cluster_choice(config)
    if (config.cluster_m is None and schedule == "cooperative" and N >= 2 * tile[1]
            and tile == ruled and not filled_split and not config.tail_split):
        # 1x2: the two CTAs of a cluster take the two n-tiles of one m-tile and multicast A.
        # Uniform headline (256 x 128x512x7168, H200, 2026-11-21, back-to-back): 524 us vs
        # 543 at 1x1 and torch.bmm 531; fp16 524 vs 541 / 532 (interleaved A/B).
        cm, cn = 1, 2
    epi_whole = pinned_whole_epilogue(config, schedule, out_itemsize)
    tail_split = filled_split if config.tail_split is None else config.tail_split
    if tail_split:
        check_tail_split(schedule, "device", cm, cn)
    return KernelChoice(schedule, "device", tile[0], tile[1], stages, False,
                        raster_of(config, 8), cluster_m=cm, cluster_n=cn,
                        epi_whole=epi_whole, tail_split=tail_split and shares > 0)


def choice_source(hit: tuned.Hit | None, choice: KernelChoice) -> str:
    """Where a choice came from, for reports: "table:exact", "table:neighbours" or "rules"
    (hit: tuned_hit's answer for the call), with "+waves" where the whole-wave fit then moved
    its tile and "+swap" where swapped tiles replaced it (swap_ab_wanted's window or switch)."""
    source = "rules" if hit is None else f"table:{hit.how}"
    if choice.swap_ab and not (hit is not None and dict(hit.fields).get("swap_ab")):
        return source + "+swap"
    return source + "+waves" if choice.wave_fit else source


def tuned_hit(form: str, config: GemmConfig, num_sms: int, *, device: str | None,
              dtype: str = "bfloat16", out_dtype: str | None = None,
              shape: tuple = ()) -> tuned.Hit | None:
    """The tuned-table answer the choice for this call starts from, or None (rules only).

    shape: (T, E, N, K) for "varlen", (G, M, N, K) for "batched", the sizes for "general".
    For reports (benchmarks, the server's warm-up log); the choose_* functions use the same
    lookups."""
    out_dtype = out_dtype or dtype
    if form == "varlen":
        return _varlen_hit(config, *shape, num_sms, device, dtype, out_dtype)
    if form == "batched":
        return _batched_hit(config, *shape, num_sms, device, dtype, out_dtype)
    if form == "general":
        return _general_hit(config, tuple(shape), num_sms, device, dtype, out_dtype)
    raise ValueError(f"form must be 'varlen', 'batched' or 'general'; got {form!r}")


def rules_baseline(form: str, config: GemmConfig, num_sms: int, *, dtype: str = "bfloat16",
                   out_dtype: str | None = None, shape: tuple = ()) -> dict:
    """The rules' config for this call as the tables' neighbours vote compares against it
    (tuned.lookup's baseline: the rules before the grid fit); shape as tuned_hit's."""
    itemsize = ITEMSIZE.get(out_dtype or dtype, 2)
    if form == "varlen":
        T, E, N, K = shape
        rules = _varlen_rules(config, T, E, N, K, itemsize, split_shares(), num_sms)
    elif form == "batched":
        rules = _choose_batched(config, *shape, num_sms, itemsize, split_shares())
    elif form == "general":
        rules = _choose_general(config, tuple(shape), num_sms, itemsize, split_shares())
    else:
        raise ValueError(f"form must be 'varlen', 'batched' or 'general'; got {form!r}")
    return choice_fields(rules, form)


def clear_caches() -> None:
    """Forget every cached choice (tests; the online autotuner after adding an entry)."""
    for fn in (_choose_general_tuned, _choose_general, _choose_varlen_tuned,
               _choose_varlen_unswapped,
               _choose_batched_tuned, _choose_batched):
        fn.cache_clear()
