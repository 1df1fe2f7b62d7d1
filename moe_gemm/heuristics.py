"""Pick a kernel configuration from problem shapes: pure functions, cached.

Every choice a GemmConfig leaves at "auto" is decided here from host-known facts only (shapes
known on the host, dtype, SM count), never from values on the GPU, so the MoE path stays free
of host synchronisation. The numbers behind each rule are in AGENTS.md ("Measured facts").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    return KernelChoice(schedule, visitor, tile[0], tile[1], config.stages, sort, 8)


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
    return KernelChoice(schedule, visitor, tile[0], tile[1], config.stages, False, 8)


@functools.lru_cache(maxsize=64)
def _check_tile(schedule: str, tile: tuple[int, int]) -> None:
    allowed = PINGPONG_TILES if schedule == "pingpong" else COOPERATIVE_TILES
    if tile not in allowed:
        raise ValueError(
            f"tile {tile[0]}x{tile[1]} is not built for schedule {schedule!r}; expected one of "
            + ", ".join(f"{m}x{n}" for m, n in allowed)
        )
