"""Numbers and rules of the FP8 grouped GEMM (grouped_gemm_fp8.py) that the host side shares.
No DSL import, like constants.py.

FP8 operands are e4m3 (or e5m2) bytes, so one 128-byte swizzle row holds 128 values of K: the
FP8 kernel's pipeline stage is 128 deep in K, which is also the scale block (DeepSeek-V3's
1x128 activation and 128x128 weight blocks), so each stage meets exactly one K block's scales.
"""

from __future__ import annotations

import math

from .constants import REGS_DEFAULT, REGS_HEAVY, acc_regs, tile_problem

FP8_TILE_K = 128  # K per stage: one 128-byte swizzle row of 8-bit data, one scale block
SCALE_BLOCK = 128  # the block edge of 1x128 (activations) and 128x128 (weights) scales

# Scale modes, compile-time:
# - "block": A scales per row per 128-K block (T, K/128); B scales per 128x128 block
#   (E, K/128, N/128). Applied in every stage's promotion.
# - "outer": A scales per row, B scales per column (row-wise); the per-tensor scales are the
#   same with every row's (column's) scale equal. Applied once per tile after the mainloop.
SCALE_MODES = ("block", "outer")

# Two-level accumulation: each stage's WGMMA partials land in a temporary accumulator that is
# then added (scaled) into the main one, so each thread holds two accumulators. Their sum must
# leave room beside the epilogue's fragments and the scales: 2 x 96 = 192 fp32 registers
# (cooperative 128x192, ping-pong 64x192 or 128x96) is the largest.
FP8_MAX_ACC_REGS = 96


# The lagged promotion (GroupedGemmFp8Sm90._mainloop_lagged) keeps a third accumulator, the
# next stage's WGMMA target: 3 x 64 = 192 registers (cooperative 128x128, ping-pong 64x128) is
# the most that leaves the heavy split's 240 room for addresses and scales.
FP8_LAG_MAX_ACC_REGS = 64


def fp8_acc_regs(schedule: str, tile_m: int, tile_n: int, promote_lag: bool = False) -> int:
    """fp32 registers per math thread of the main and the temporary accumulators together."""
    return (3 if promote_lag else 2) * acc_regs(schedule, tile_m, tile_n)


def scale_blocks_spanned(tile_n: int) -> int:
    """The most 128-column scale blocks one output tile of tile_n columns overlaps: a tile
    starts at a multiple of gcd(tile_n, 128) within its block."""
    worst_start = SCALE_BLOCK - math.gcd(tile_n, SCALE_BLOCK)
    return -(-(worst_start + tile_n) // SCALE_BLOCK)


def fp8_tile_problem(schedule: str, tile_m: int, tile_n: int, scale_mode: str,
                     promote_lag: bool = False) -> str | None:
    """Why the FP8 kernel cannot build this tile, or None if it can (on top of the 16-bit
    kernel's rules, constants.tile_problem)."""
    why = tile_problem(schedule, tile_m, tile_n)
    if why is not None:
        return why
    if scale_mode not in SCALE_MODES:
        return f"unknown scale mode {scale_mode!r} (expected one of {', '.join(SCALE_MODES)})"
    regs = acc_regs(schedule, tile_m, tile_n)
    if regs > FP8_MAX_ACC_REGS:
        return (f"FP8 {schedule} {tile_m}x{tile_n} needs 2 x {regs} accumulator registers per "
                f"thread (the promotion keeps a second accumulator; at most "
                f"2 x {FP8_MAX_ACC_REGS} fit)")
    if promote_lag and scale_mode != "block":
        return ("the lagged promotion is built for block scales (row-wise and per-tensor "
                "scales promote with a plain add, where it made ptxas serialize the WGMMAs)")
    if promote_lag and regs > FP8_LAG_MAX_ACC_REGS:
        return (f"the lagged promotion keeps three accumulators: FP8 {schedule} "
                f"{tile_m}x{tile_n} needs 3 x {regs} registers per thread (at most "
                f"3 x {FP8_LAG_MAX_ACC_REGS} fit)")
    if scale_mode == "block" and scale_blocks_spanned(tile_n) > 2:
        return (f"tile_n {tile_n} can span {scale_blocks_spanned(tile_n)} 128-column scale "
                "blocks; the block-scaled kernel takes tiles that span at most two")
    return None


def fp8_register_split(schedule: str, tile_m: int, tile_n: int,
                       promote_lag: bool = False) -> tuple[int, int]:
    """(producer, math) registers per thread: the heavy split (24 / 240) once the
    accumulators take 160 registers or more."""
    heavy = fp8_acc_regs(schedule, tile_m, tile_n, promote_lag) >= 160
    return REGS_HEAVY if heavy else REGS_DEFAULT
