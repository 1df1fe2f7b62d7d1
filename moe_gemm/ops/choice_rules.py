"""The rule pieces every form's config choice shares (ops/heuristics.py, heuristics_fp8.py).

KernelChoice (what a launch compiles and runs), the default tiles, the grid-filling and
whole-wave fits of a tile, the checks of pinned fields, and the fields that reproduce a choice.
Pure functions of host-known facts, as heuristics.py's choices are.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

from moe_gemm.config import COOPERATIVE_TILES, PINGPONG_TILES, GemmConfig
from moe_gemm.kernels.sm90.constants import SPLIT_WAYS, TILE_K, raster_code, raster_fields
from moe_gemm.ops import grid_fit, tuned
from moe_gemm.ops.grid_fit import SHORT_K_TILES


def raster_of(config: GemmConfig, default_panel: int) -> int:
    """The kernel's raster code for a config's raster pins, the panel defaulting to
    `default_panel` (m-tiles per panel, no serpentine, unless pinned)."""
    return raster_code(config.raster_panel or default_panel, config.raster_along or "m",
                       bool(config.raster_serpentine))


@dataclass(frozen=True)
class KernelChoice:
    schedule: str  # "pingpong" | "cooperative"
    visitor: str  # "device" | "host"
    tile_m: int
    tile_n: int
    stages: int | None
    sort_by_k: bool
    swizzle: int  # the raster code: panel, axis, serpentine (constants.raster_code)
    a_policy: int = 0  # L2 eviction priority of A / B loads, used when l2_hints is set
    b_policy: int = 0
    l2_hints: bool = False
    epi_n: int = 32  # cooperative epilogue subtile width (compile-time)
    cluster_m: int = 1  # CTAs per cluster along M (B multicast)
    cluster_n: int = 1  # CTAs per cluster along N (A multicast)
    epi_whole: bool = False  # whole-tile epilogue (compile-time)
    tail_split: bool = False  # a short last wave split over K (kernels/constants.py)
    promote_lag: bool = False  # FP8: promotion one stage behind the WGMMAs (heuristics_fp8)
    scale_ahead: int = 1  # FP8 block scales: stages ahead their scales load (heuristics_fp8)
    smem_scales: bool = False  # FP8 block scales staged in shared memory (heuristics_fp8)
    skip_empty_half: bool = False  # FP8: a warpgroup whose rows are all past the end idles
    trim_a: bool = False  # varlen: an expert's last tile loads only its own A rows
    peek_wait: bool = False  # 16-bit: the math warps test the next stage's barrier a k-tile ahead
    split_ways: int = SPLIT_WAYS  # with tail_split: the most CTAs one tail tile is split over
    wave_fit: bool = False  # the whole-wave fit moved the tile (grid_fit.wave_fit; reports)
    swap_ab: bool = False  # varlen: the rows on the WGMMA's N side (kernels/sm90/swapped.py)
    packed_pairs: bool = False  # varlen 2x1: a cluster pairs consecutive tiles, across experts


def pick_tile(schedule: str, avg_m: float, n: int) -> tuple[int, int]:
    if schedule == "cooperative":
        # 128x256: each A row feeds 256 columns, the least L2 traffic per FLOP.
        return (128, 256) if n >= 256 else (128, 128)
    # Ping-pong: each warpgroup owns a tile (tile_m * tile_n / 128 fp32 accumulators per
    # thread: 192 at 128x192, the most that fits beside the epilogue's registers).
    if avg_m <= 64 and n >= 256:
        return (64, 256)
    if avg_m > 64 and n >= 192:
        # 128x192 over 128x128 wherever it was measured (H200, 2026-11-21, back-to-back):
        # k-varying 122 us vs 136; varlen, E=8 N=14336 K=4096 at 128 rows/expert 313 vs 356,
        # E=128 N=2048 K=768 at 256 rows/expert 213 vs 233, E=128 N=5760 K=2880 1349 vs 1422
        # (docs/measurements.md).
        return (128, 192)
    return (128, 128)


def split_allowed(config: GemmConfig, pinned_split: bool = True) -> bool:
    """Whether a config leaves the grid-filling rule free to take the tail split (cooperative,
    device visitor, 1x1 cluster): not pinned to a cluster or the host visitor, nor (where
    pinned_split: the config is the caller's) the split pinned off."""
    return ((config.tail_split is not False or not pinned_split)
            and config.visitor in ("auto", "device")
            and (config.cluster_m or 1) * (config.cluster_n or 1) == 1)


def short_rows(config: GemmConfig, schedule: str, tile: tuple[int, int], stages: int | None,
               avg_m: float, n: int, k_tiles: float) -> tuple[str, tuple[int, int], int | None]:
    """Problems of at most 64 rows on long K: ping-pong's 64-row tile where the rules gave
    cooperative (fill_known's first step; also for lists of more problems than SMs, where the
    grid is full and nothing else of fill_known applies: 132 problems of 16 x 4096 x 4096
    took cooperative 128x256 1x2, 7x the useful MMA work, where 131 took ping-pong 64x256)."""
    if (config.tile_m is None and schedule == "cooperative" and config.schedule == "auto"
            and avg_m <= 64 and k_tiles > SHORT_K_TILES
            and fit_schedule("pingpong", config) == "pingpong"):
        return "pingpong", pick_tile("pingpong", avg_m, n), config.stages
    return schedule, tile, stages


def fill_known(config: GemmConfig, schedule: str, tile: tuple[int, int], stages: int | None,
                avg_m: float, n: int, tiles: Callable[[int, int], float], num_sms: int,
                k_tiles: float, shares: int = 0
                ) -> tuple[str, tuple[int, int], int | None, bool]:
    """The general and batched forms' (schedule, tile, stages, tail split) past
    general_rules, where the tile count is known: problems of at most 64 rows take
    ping-pong's 64-row tile even on long K (8 x 1x4096x4096: 65.0 us against cooperative
    128x256's 71.8; the varlen rule's 64-row tile, moe-decode 271 against 300), then
    grid_fit.fill_grid fills a grid that the tile leaves mostly idle (shares: where the form
    builds the tail split and the caller allows it, the most CTAs it may share a tile over,
    else 0). A pinned tile or schedule is kept."""
    if config.tile_m is not None:
        return schedule, tile, stages, False
    schedule, tile, stages = short_rows(config, schedule, tile, stages, avg_m, n, k_tiles)
    filled, narrow, split = grid_fit.fill_grid(schedule, tile, tiles, num_sms, k_tiles,
                                               shares if split_allowed(config) else 0,
                                               config.schedule == "auto")
    if (filled, narrow) != (schedule, tile):
        # (the rules' stage count is for their tile: the new one takes its default)
        return filled, narrow, config.stages, split
    return schedule, tile, stages, split


def narrowed(config: GemmConfig, tiles: Callable[[int, int], float], num_sms: int,
              k_tiles: float, shares: int = 0) -> GemmConfig:
    """A voted config fitted by grid_fit.fill_grid (tiles: the launch's tile count). The
    vote's stages, whole-tile epilogue and tail split were timed on its tile: a new tile takes
    what the rules give it (default stages, no whole-tile epilogue, the tail split where
    grid_fit.fill_grid takes it), else the H200 table's vote for E=1 N=512 K=14336 at 512 rows
    ran 128x64 with 128x256's 3 stages and whole epilogue."""
    tile = (config.tile_m, config.tile_n)
    if config.tile_m is None or config.schedule not in ("pingpong", "cooperative"):
        return config
    # (A vote's own tail split was timed for another launch: not a pin here.)
    schedule, narrow, split = grid_fit.fill_grid(
        config.schedule, tile, tiles, num_sms, k_tiles,
        shares if split_allowed(config, False) else 0, True)
    if (schedule, narrow) == (config.schedule, tile):
        return config.replace(tail_split=True) if split and not config.tail_split else config
    try:
        return config.replace(schedule=schedule, tile_m=narrow[0], tile_n=narrow[1],
                              stages=None, whole_epilogue=False, tail_split=split)
    except ValueError:  # (a pinned field the new tile does not build with: keep the vote)
        return config


_unusable_warned: set = set()


def warn_unusable(hit: tuned.Hit, exc: Exception) -> None:
    """A table entry the rules refuse for this call (it then runs by the rules): warn once."""
    if hit.fields not in _unusable_warned:
        _unusable_warned.add(hit.fields)
        warnings.warn(f"moe_gemm: tuned config {dict(hit.fields)} from {hit.source} cannot run "
                      f"here ({exc}); using the rules", RuntimeWarning, stacklevel=5)


def pinned_whole_epilogue(config: GemmConfig, schedule: str, out_itemsize: int) -> bool:
    """config.whole_epilogue where the rules do not decide it (general and batched forms)."""
    if not config.whole_epilogue:
        return False
    check_whole_epilogue(schedule, out_itemsize)
    return True


def check_whole_epilogue(schedule: str, out_itemsize: int) -> None:
    if schedule != "cooperative":
        raise ValueError("whole_epilogue=True is built for the cooperative schedule; the "
                         f"configured tile runs {schedule}")
    if out_itemsize != 2:
        raise ValueError("whole_epilogue=True is built for 16-bit (bf16/fp16) output")


def check_tail_split(schedule: str, visitor: str, cm: int, cn: int) -> None:
    """A pinned tail split: both schedules and every cluster build it, on the device
    visitor only (the split's plan counts the tiles on the GPU)."""
    if visitor != "device":
        raise ValueError("tail_split=True is built for the device visitor; this config runs "
                         f"{schedule}, visitor {visitor}, cluster {cm}x{cn}")


def general_rules(config: GemmConfig, avg_m: float, max_n: int, avg_k_tiles: float
                   ) -> tuple[str, tuple[int, int], int | None]:
    """(schedule, tile, stages) for problems known on the host (general and batched forms)."""
    if config.schedule != "auto":
        schedule = config.schedule
    else:
        schedule = fit_schedule("pingpong" if avg_k_tiles <= SHORT_K_TILES and max_n >= 192
                                 else "cooperative", config)
    if config.tile_m is not None:
        tile = (config.tile_m, config.tile_n)
        check_tile(schedule, tile)
    else:
        tile = pick_tile(schedule, avg_m, max_n)
    stages = config.stages
    if stages is None and schedule == "cooperative" and tile == (128, 256) and avg_k_tiles >= 64:
        # Long K: 3 stages beat 4 (uniform 561 vs 568 us; moe-prefill 3189 vs 3256).
        stages = 3
    return schedule, tile, stages


# The kernels' operands are 16-bit (bf16 / fp16).
AB_ITEMSIZE = 2


def fit_waves(config: GemmConfig, choice: KernelChoice,
               rules: Callable[[GemmConfig], KernelChoice], ctas: grid_fit.CtaCount,
               flops: float, bytes_moved: float, K: float, num_sms: int,
               area: float) -> KernelChoice:
    """`choice` (the form's rules for `config`), or where grid_fit.wave_fit moves it, the
    rules for config pinned to the fit's tile and cluster (default stages, no tail split or
    whole-tile epilogue: what the fit assumed), marked wave_fit. For a caller's config that
    pins no tuned field (the callers check); ctas: the launch's CTA count per tile and
    cluster, K: the problems' (average) depth, area: their output elements."""
    member = grid_fit.wave_fit(
        choice.schedule, (choice.tile_m, choice.tile_n), (choice.cluster_m, choice.cluster_n),
        choice.tail_split, ctas, num_sms,
        grid_fit.intensity(flops, bytes_moved), K / TILE_K, SHORT_K_TILES, area)
    if member is None:
        return choice
    schedule, tm, tn, cm, cn = member
    try:
        moved = config.replace(schedule=schedule, tile_m=tm, tile_n=tn, cluster_m=cm,
                               cluster_n=cn, stages=None, whole_epilogue=False,
                               tail_split=False)
    except ValueError:  # (a vote's field the member does not build with: keep the choice)
        return choice
    return replace(rules(moved), wave_fit=True)


ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def choice_fields(choice: KernelChoice, form: str) -> dict:
    """The explicit GemmConfig fields that reproduce a KernelChoice (for the tuner's candidates
    and for comparing the rules' choice with a tuned table's)."""
    panel, along, serpentine = raster_fields(choice.swizzle)
    fields = {
        "schedule": choice.schedule, "visitor": choice.visitor,
        "tile_m": choice.tile_m, "tile_n": choice.tile_n,
        "cluster_m": choice.cluster_m, "cluster_n": choice.cluster_n,
        "stages": choice.stages, "raster_panel": panel,
        "whole_epilogue": choice.epi_whole,
    }
    if along != "m":
        fields["raster_along"] = along
    if serpentine:
        fields["raster_serpentine"] = True
    fields["tail_split"] = choice.tail_split
    if form == "general":
        fields["sort_by_k"] = choice.sort_by_k
    if choice.swap_ab:
        fields["swap_ab"] = True
    if choice.packed_pairs:
        fields["packed_pairs"] = True
    return fields


def cluster_choice(config: GemmConfig) -> tuple[int, int]:
    """(cluster_m, cluster_n): what the config pins, else 1x1 (AGENTS.md has the 2x1 / 1x2
    measurements; the general and batched rules may then pick 1x2). Both schedules build
    every cluster (fit_schedule says which one "auto" takes under a pinned one)."""
    if config.cluster_m is None:
        return 1, 1
    return config.cluster_m, config.cluster_n or 1


def fit_schedule(schedule: str, config: GemmConfig) -> str:
    """The rule's schedule (for schedule="auto"), fitted to what the config fixes: under a
    pinned cluster, the tail split or the whole-tile epilogue the cooperative one, but a given
    tile built for one schedule only (e.g. 128x256 cooperative, 64x256 ping-pong) selects
    that schedule, as GemmConfig documents. Clusters build with both schedules, so a
    ping-pong-only tile in a pinned cluster runs ping-pong; GemmConfig already refuses the
    tail split and the whole-tile epilogue on a ping-pong-only tile."""
    if (config.cluster_m or 1) * (config.cluster_n or 1) > 1:
        schedule = "cooperative"
    if config.tail_split or config.whole_epilogue:
        schedule = "cooperative"
    if config.tile_m is not None:
        tile = (config.tile_m, config.tile_n)
        if schedule == "pingpong" and tile not in PINGPONG_TILES:
            schedule = "cooperative"
        elif schedule == "cooperative" and tile not in COOPERATIVE_TILES:
            schedule = "pingpong"
    return schedule


@functools.lru_cache(maxsize=64)
def check_tile(schedule: str, tile: tuple[int, int]) -> None:
    allowed = PINGPONG_TILES if schedule == "pingpong" else COOPERATIVE_TILES
    if tile not in allowed:
        raise ValueError(
            f"tile {tile[0]}x{tile[1]} is not built for schedule {schedule!r}; expected one of "
            + ", ".join(f"{m}x{n}" for m, n in allowed)
        )
