"""Pick a kernel configuration from problem shapes: pure functions, cached.

Every choice a GemmConfig leaves at "auto" is decided here from host-known facts only (shapes
known on the host, dtype, SM count), never from values on the GPU, so the MoE path stays free
of host synchronisation. The numbers behind each rule are in AGENTS.md ("Measured facts").
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

from . import schedule as sched
from .config import COOPERATIVE_TILES, PINGPONG_TILES, GemmConfig

TILE_K = 64


@dataclass(frozen=True)
class KernelChoice:
    schedule: str  # "pingpong" | "cooperative"
    visitor: str  # "device" | "host"
    tile_m: int
    tile_n: int
    stages: int | None
    sort_by_k: bool
    swizzle: int  # m-tiles per raster panel (see schedule.tile_coord)
    a_policy: int = 0  # L2 eviction priority of A / B loads (0: set by with_l2_hints)
    b_policy: int = 0


# TMA L2 eviction priorities (createpolicy encodings, as CUTLASS's CacheHintSm90).
L2_POLICY = {"normal": 0x1000000000000000, "first": 0x12F0000000000000,
             "last": 0x14F0000000000000}


def with_l2_hints(choice: KernelChoice, m_tiles_per_problem: float, n_tiles: float
                  ) -> KernelChoice:
    """A is re-read by every n-tile of its problem, B by every m-tile: keep what is re-read in
    L2 (evict_last) and stream what is read once (evict_first), so the single-use expert
    weights of a decode or a uniform small-M batch do not push reusable rows out of L2.
    MOE_GEMM_L2_HINTS="a,b" (first|normal|last) overrides, for tuning."""
    env = os.environ.get("MOE_GEMM_L2_HINTS")
    if env:
        a, b = (v.strip() for v in env.split(","))
    else:
        a = "last" if n_tiles >= 2 else "first"
        b = "first" if m_tiles_per_problem <= 1.0 else "normal"
    return replace(choice, a_policy=L2_POLICY[a], b_policy=L2_POLICY[b])


def _pick_tile(schedule: str, avg_m: float, n: int) -> tuple[int, int]:
    if schedule == "cooperative":
        return (128, 256) if n >= 256 else (128, 128)
    # Ping-pong: each warpgroup owns a tile; 128x128 keeps 128 fp32 accumulators/thread.
    if avg_m <= 64 and n >= 256:
        return (64, 256)
    return (128, 128)


def choose_general(
    config: GemmConfig, sizes: tuple[tuple[int, int, int], ...], num_sms: int
) -> KernelChoice:
    """For grouped_gemm (sizes known on the host)."""
    nonempty = [s for s in sizes if s[0] > 0 and s[1] > 0]
    avg_m = sum(s[0] for s in nonempty) / max(1, len(nonempty))
    max_n = max((s[1] for s in nonempty), default=128)
    schedule = config.schedule if config.schedule != "auto" else "pingpong"
    if config.tile_m is not None:
        tile = (config.tile_m, config.tile_n)
        _check_tile(schedule, tile)
    else:
        tile = _pick_tile(schedule, avg_m, max_n)
    visitor = config.visitor if config.visitor != "auto" else "device"
    if config.sort_by_k is None:
        sort = sched.should_sort_by_k(sizes, tile[0], tile[1], TILE_K, num_sms)
    else:
        sort = config.sort_by_k
    choice = KernelChoice(schedule, visitor, tile[0], tile[1], config.stages, sort, 8)
    m_tiles = sum(-(-m // tile[0]) for m, _, _ in nonempty) / max(1, len(nonempty))
    n_tiles = sum(-(-n // tile[1]) for _, n, _ in nonempty) / max(1, len(nonempty))
    return with_l2_hints(choice, m_tiles, n_tiles)


def choose_varlen(
    config: GemmConfig, T: int, E: int, N: int, K: int, num_sms: int
) -> KernelChoice:
    """For grouped_mm (per-expert row counts live on the GPU: decide from T and E only)."""
    avg_m = T / max(1, E)
    if config.schedule != "auto":
        schedule = config.schedule
    else:
        schedule = "cooperative" if avg_m >= 512 and N >= 256 else "pingpong"
    if config.tile_m is not None:
        tile = (config.tile_m, config.tile_n)
        _check_tile(schedule, tile)
    else:
        tile = _pick_tile(schedule, avg_m, N)
    visitor = config.visitor if config.visitor != "auto" else "device"
    choice = KernelChoice(schedule, visitor, tile[0], tile[1], config.stages, False, 8)
    return with_l2_hints(choice, avg_m / tile[0], N / tile[1])


@functools.lru_cache(maxsize=64)
def _check_tile(schedule: str, tile: tuple[int, int]) -> None:
    allowed = PINGPONG_TILES if schedule == "pingpong" else COOPERATIVE_TILES
    if tile not in allowed:
        raise ValueError(
            f"tile {tile[0]}x{tile[1]} is not built for schedule {schedule!r}; expected one of "
            + ", ".join(f"{m}x{n}" for m, n in allowed)
        )
