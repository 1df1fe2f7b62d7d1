"""Where grouped_mm's varlen form runs swapped tiles (kernels/sm90/swapped.py: each expert as
out^T = w^T x^T, its routed rows on the WGMMA's N side), and the choice that runs them.

The order of precedence: GemmConfig.swap_ab, then MOE_GEMM_SWAP_AB, then (for an all-auto
config) a tuned table's exact entry that was timed beside the swapped kernel (heuristics
reads it), then the window below.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from moe_gemm.config import SWAP_CLUSTERS, GemmConfig
from moe_gemm.env import env_value
from moe_gemm.kernels.sm90.constants import SWAP_ROW_UNIT, SWAP_TILE_COLS, SWAP_TILE_ROWS

if TYPE_CHECKING:
    from moe_gemm.ops.choice_rules import KernelChoice

SWAP_AB_ENV = "MOE_GEMM_SWAP_AB"

# Where an all-auto config takes swapped tiles (kernels/sm90/swapped.py): about one 256-row
# swapped tile per expert, where the M-side tiles pad an expert to two 128-row tiles (25% of
# the multiply-adds) and the swapped one to 16 rows (3%). Measured on an H200 (2026-12-01,
# `benchmarks.env_ab --switch MOE_GEMM_SWAP_AB`, the zoo's harness, against the tuned
# tables' picks): all 27 zoo and held-out cases in this window faster (34 measurements),
# 1.016-1.50x, 160 experts included (GLM-4.5, Qwen3-Coder-480B: 1.05-1.10x); outside it mixed
# or slower (many rows per expert: the picks' larger tiles and clusters win, down to 0.67x at
# 2048 rows of K = 32768; 256 experts or K = 768-1024: 0.92-0.98x; decode-sized experts: a
# median 0.945x). docs/measurements.md, 2026-12-01 (swapped tiles). A tuned table's exact
# entry that was timed beside the swapped kernel (`moe-gemm tune`, `--rerank --rivals`)
# names swap_ab and decides instead (heuristics._choose_varlen_tuned): the window is the guess
# off those shapes.
SWAP_ROWS_PER_EXPERT = (192, 320)
SWAP_MAX_EXPERTS = 160
SWAP_MIN_K = 2048


def swap_ab_wanted(config: GemmConfig, T: int, E: int, K: int, out_itemsize: int,
                   measured: bool | None = None, *, N: int | None = None,
                   num_sms: int | None = None) -> bool:
    """Whether grouped_mm's varlen form runs swapped tiles: config.swap_ab where it is set,
    else never for a config pinning the kernel's choice or for 32-bit output, else
    MOE_GEMM_SWAP_AB where it is set, else for an all-auto config (T routed rows over E
    experts of depth K, 16-bit output) `measured` where a tuned table's exact entry decided it
    (an entry timed beside the swapped kernel names swap_ab either way), else the window
    above; with N and num_sms, only where the swapped tiles fill at least one wave."""
    if config.swap_ab is not None:
        return config.swap_ab
    if config.tuning_pinned or out_itemsize != 2:
        # (the switch too: it must not override a caller's pinned tile, schedule or cluster
        # without a word, nor refuse fp32 output, which the swapped tiles cannot store)
        return False
    forced = env_value(SWAP_AB_ENV)
    if forced is not None:
        return bool(forced)
    if E == 0:
        return False
    if measured is not None:
        return measured
    low, high = SWAP_ROWS_PER_EXPERT
    if N is not None and num_sms and swapped_tiles(T, E, N) < num_sms:
        # Fewer tiles than SMs leaves SMs idle that the M-side tiles (2-4x as many on such
        # shapes) keep busy: 16 experts x 256 rows x N = 512 is 64 swapped tiles on 132 SMs,
        # where ping-pong 128x192 won (H200, the tuner's re-rank, 2026-12-01). The 27 cases
        # the window was measured on had 512 or more.
        return False
    return E <= SWAP_MAX_EXPERTS and K >= SWAP_MIN_K and low * E <= T <= high * E


def swapped_tiles(T: int, E: int, N: int) -> int:
    """About how many swapped tiles T routed rows over E experts make (an expert in the window
    fills one or two 256-row tiles; each tile is SWAP_TILE_COLS weight columns wide)."""
    return max(E, -(-T // SWAP_TILE_ROWS)) * -(-N // SWAP_TILE_COLS)


def swapped_choice(choice: KernelChoice, out_itemsize: int, stages: int | None = None,
                   cluster_n: int = 1) -> KernelChoice:
    """The swapped kernel's choice (kernels/sm90/swapped.py): its fixed tile, schedule and
    visitor, a 1 x `cluster_n` cluster (1 or 2: config.SWAP_CLUSTERS), the raster and the L2
    hints of `choice`, `stages` A/B stages (None: as many as fit); never packed pairs (a
    tuned entry's packed 2x1 kernel where the window swaps: the swapped kernel refuses them)."""
    if (1, cluster_n) not in SWAP_CLUSTERS:
        raise ValueError(f"swapped tiles run in a 1x1 or 1x2 cluster; got 1x{cluster_n}")
    if out_itemsize != 2:
        raise ValueError("swap_ab=True stores 16-bit output (bf16 or fp16); got a "
                         f"{out_itemsize * 8}-bit out_dtype")
    return replace(choice, schedule="cooperative", visitor="device", tile_m=SWAP_TILE_ROWS,
                   tile_n=SWAP_TILE_COLS, stages=stages, epi_n=SWAP_ROW_UNIT, cluster_m=1,
                   cluster_n=cluster_n, epi_whole=False, tail_split=False, trim_a=True, swap_ab=True,
                   wave_fit=False, packed_pairs=False)


