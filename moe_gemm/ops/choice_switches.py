"""The environment switches a kernel choice honours after the rules and tables have picked
it (L2 hints, trimmed A loads, peeked stage waits, the tail split's ways), and the names of the
variables that read them. Each takes a KernelChoice and returns it, changed or not.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from moe_gemm.env import env_reader, env_value
from moe_gemm.kernels.sm90.constants import SPLIT_WAYS, raster_fields
from moe_gemm.ops import tuned

if TYPE_CHECKING:
    from moe_gemm.ops.choice_rules import KernelChoice

TAIL_SPLIT_ENV = "MOE_GEMM_TAIL_SPLIT"
SPLIT_WAYS_ENV = "MOE_GEMM_SPLIT_WAYS"
TRIM_A_ENV = "MOE_GEMM_TRIM_A"
PACKED_PAIRS_ENV = "MOE_GEMM_PACKED_PAIRS"
PEEK_WAIT_ENV = "MOE_GEMM_PEEK_WAIT"
# What choose_general reads from the environment besides its arguments: a cache above it
# (general_launch.general_shape) keys on their values, so a changed switch applies to the
# next call, as it does for grouped_mm.
GENERAL_SWITCHES = ("MOE_GEMM_L2_HINTS", PEEK_WAIT_ENV, TAIL_SPLIT_ENV, SPLIT_WAYS_ENV,
                    *tuned.SWITCHES)
general_switches = env_reader(GENERAL_SWITCHES)  # () -> their values
# 1: the fused kernel gathers in kernel at every size on any weight, in the wide form on tiles
# past the register form (by default only below fused_launch.GATHER_MAX_ROWS routed rows)
GATHER_WIDE_ENV = "MOE_GEMM_FUSED_GATHER_WIDE"
# 0 / 1: the in-kernel gather's math warps fence the proxies before reading a gathered stage
# or not (fused_launch.gather_fence)
GATHER_FENCE_ENV = "MOE_GEMM_GATHER_FENCE"
# 0: the fused gated epilogue takes the IEEE sigmoid, not the SFU's (fused_launch.fused_key)
FAST_GATE_ENV = "MOE_GEMM_FUSED_FAST_GATE"
# TMA L2 eviction priorities (createpolicy encodings, as CUTLASS's CacheHintSm90), by the
# words MOE_GEMM_L2_HINTS takes (env.L2_HINT_WORDS).
L2_POLICY = {"normal": 0x1000000000000000, "first": 0x12F0000000000000,
             "last": 0x14F0000000000000}


def with_l2_hints(choice: KernelChoice) -> KernelChoice:
    """L2 eviction hints on the TMA loads: off by default. Measured on an H200
    (2026-11-21): the kernel without hints was as fast or faster on every suite shape, and
    evict_first on operands that are re-read (mixtral's A, re-read by 56 n-tiles) made the
    time bimodal (2.78 to 4.13 ms). MOE_GEMM_L2_HINTS="a,b" (first|normal|last) builds the
    hinted variant, for tuning."""
    hints = env_value("MOE_GEMM_L2_HINTS")
    if hints is None:
        return choice
    a, b = hints
    return replace(choice, a_policy=L2_POLICY[a], b_policy=L2_POLICY[b], l2_hints=True)


def with_trim_a(choice: KernelChoice) -> KernelChoice:
    """Trimmed A loads (kernels/sm90/trimmed_a.py) where trim_a_default takes them;
    MOE_GEMM_TRIM_A=1 / 0 takes them everywhere (the varlen form; a fused kernel that gathers
    A itself keeps its gather) / nowhere."""
    forced = env_value(TRIM_A_ENV)
    on = trim_a_default(choice) if forced is None else forced
    return replace(choice, trim_a=True) if on else choice


def trim_a_default(choice: KernelChoice) -> bool:
    """Whether a varlen kernel trims its tail tiles' A loads by default: everywhere but on
    ping-pong tiles of more than 64 rows and fewer than 192 columns without an A multicast.
    Measured on the zoo's default picks (H200, 2026-11-30, `benchmarks.env_ab`, trimmed /
    whole, 90 cases): ping-pong 64x256 2x1 median 1.010 (0.999-1.037, 17 cases), cooperative
    128x192-256 1x1 1.005 (0.973-1.043, 15), ping-pong 128x192 1x1 1.016 (1.004-1.023, 4);
    in 1x2 clusters 1.008 (0.996-1.024, 54: ping-pong 128x128 among them, 19 cases, 1.008).
    Ping-pong 128x128 1x1 pinned on the first 36 cases lost, median 0.975 (0.872-1.041)."""
    if choice.schedule == "pingpong" and choice.cluster_n == 1:
        return choice.tile_m == 64 or choice.tile_n >= 192
    return True


def packed_pairs_problem(choice: KernelChoice) -> str | None:
    """Why a choice cannot run packed pairs (GroupedGemmSm90 packed_pairs), or None: they need
    a 2x1 cluster, the device visitor, no tail split, M-side tiles and panels along M
    (consecutive tiles share B's columns; along N every pair would load B twice and A twice:
    on the H200 a pick rastered along N ran 0.59x packed)."""
    if (choice.cluster_m, choice.cluster_n) != (2, 1):
        return f"built for 2x1 clusters; the choice runs {choice.cluster_m}x{choice.cluster_n}"
    if choice.visitor != "device" or choice.tail_split or choice.swap_ab:
        return "built for the device visitor without the tail split or swapped tiles"
    if raster_fields(choice.swizzle)[1] != "m":
        return "built for raster panels along M"
    return None


def with_packed_pairs(choice: KernelChoice, asked: bool | None = None) -> KernelChoice:
    """Packed pairs as MOE_GEMM_PACKED_PAIRS says: 1 wherever the choice can run them, 0
    nowhere; unset, as chosen (a pinned packed_pairs or a tuned table's entry), except that
    the caller's `asked` False (GemmConfig.packed_pairs) keeps a tuned entry's out (its fields
    override the caller's in tuned.Hit.apply). On the H200 (2026-12-06) cooperative 128x256
    2x1 ran a median 1.13x faster packed, ping-pong 64x256 2x1 0.84-1.04x
    (docs/measurements.md): the tuner decides per shape."""
    forced = env_value(PACKED_PAIRS_ENV)
    if forced is None and asked is False:
        forced = False
    if forced is None:
        return choice
    on = bool(forced) and packed_pairs_problem(choice) is None
    return replace(choice, packed_pairs=on) if on != choice.packed_pairs else choice


def with_peek_wait(choice: KernelChoice) -> KernelChoice:
    """Peeked stage waits (GroupedGemmSm90 peek_wait) where MOE_GEMM_PEEK_WAIT=1 asks for
    them (16-bit kernels, every form; opt-in: even with the plain wait on the zoo, H200)."""
    on = bool(env_value(PEEK_WAIT_ENV))
    return replace(choice, peek_wait=on) if on != choice.peek_wait else choice


def with_split_ways(choice: KernelChoice) -> KernelChoice:
    """MOE_GEMM_SPLIT_WAYS (2-16) caps how many CTAs a tail-split kernel splits one tail tile
    over (default constants.SPLIT_WAYS; 2 = the halves of earlier builds, for A/B timing)."""
    ways = env_value(SPLIT_WAYS_ENV)
    if ways is None or not choice.tail_split or ways == choice.split_ways:
        return choice
    return replace(choice, split_ways=ways)


def tail_split_enabled() -> bool:
    """MOE_GEMM_TAIL_SPLIT=0 turns the tail split off (grouped_mm's plan cache keys on it, as
    on MOE_GEMM_L2_HINTS, so a change applies to the next call). Its finisher CTAs wait for
    publisher CTAs of lower index, which relies on the persistent grid (at most one CTA per
    SM) being resident at once, as on a GPU of one's own; switch it off where SMs are fenced
    off below the device's count (e.g. an MPS active-thread limit)."""
    return bool(env_value(TAIL_SPLIT_ENV))


def split_shares() -> int:
    """The rules' shares (a key of their caches): 0 where MOE_GEMM_TAIL_SPLIT=0, else the
    most CTAs one tail tile may be split over (MOE_GEMM_SPLIT_WAYS, default SPLIT_WAYS), which
    grid_fit.fill_grid's switch to a split tile counts on."""
    if not tail_split_enabled():
        return 0
    ways = env_value(SPLIT_WAYS_ENV)
    return SPLIT_WAYS if ways is None else ways
