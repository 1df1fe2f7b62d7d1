"""Kernel choice for the FP8 ops, from host-known shapes only (never a GPU value).

The FP8 kernel (kernels/sm90/grouped_gemm_fp8.py) builds a narrower tile family than the
16-bit one: its promotion keeps a second accumulator, so cooperative tiles are 128 x up to 192
and ping-pong tiles 64 x up to 192 or 128 x up to 96 (constants_fp8.fp8_tile_problem); it
always runs the device visitor. A GemmConfig's pins are honoured where the FP8 kernel builds
them and refused with the reason otherwise. There are no tuned FP8 tables yet: the rules
below decide what a config leaves at "auto" (benchmarks/bench_fp8.py measures alternatives).
"""

from __future__ import annotations

import functools

from moe_gemm.config import GemmConfig
from moe_gemm.env import env_value
from moe_gemm.kernels.sm90.constants_fp8 import (
    FP8_TILE_K,
    fp8_tile_problem,
    scale_blocks_spanned,
)
from moe_gemm.ops.choice_rules import KernelChoice, raster_of
from moe_gemm.ops.choice_switches import tail_split_enabled, with_l2_hints, with_split_ways

# The block-scaled kernel's promotion one stage behind the WGMMAs
# (GroupedGemmFp8Sm90._mainloop_lagged), for tiles with room for a third accumulator. With the
# scales loaded from global memory by the math threads it ran 15-36% slower than the plain
# loop and the ring on an H200 (2026-11-28 and 2026-11-29, bench_fp8: DeepSeek-V3 EP32 up 8k
# rows 620-626 us against 529 plain and 459 ring), hence off there unless
# MOE_GEMM_FP8_PROMOTE_LAG=1; with the scales staged in shared memory (below) it is the
# varlen default. MOE_GEMM_FP8_PROMOTE_LAG=0 promotes staged scales in the plain loop instead
# (GroupedGemmFp8Sm90._mainloop_staged: two accumulators, not three), an A/B switch: timed on
# an H200 (2026-12-02, bench_fp8's `-staged-plain` rows) it ran 16-23% slower than the lag on
# every compute-bound shape (DeepSeek-V3 EP32 up 8k rows 525 against 427 us) and 2-5% on the
# varlen decode rows. The plan caches key on it (ops/api.py's switches).
PROMOTE_LAG_ENV = "MOE_GEMM_FP8_PROMOTE_LAG"


def promote_lag_requested() -> bool | None:
    """MOE_GEMM_FP8_PROMOTE_LAG as True / False, None when unset or empty (the default)."""
    return env_value(PROMOTE_LAG_ENV)


# The block-scaled plain loop with each stage's scales loaded this many stages before its
# promotion (GroupedGemmFp8Sm90._mainloop_prefetched) instead of one. A B scale is a new L2
# line every stage; one stage ahead, ptxas waits for it before the stage's last WGMMA is
# issued. Measured on an H200 (2026-11-28, bench_fp8, interleaved in one process:
# fp8-nvidia-h200-2026-11-28.json in the results history), 3 ahead against 1 (the plain
# loop): cooperative 128x128 on the five compute-bound shapes 11-14% faster (DeepSeek-V3 EP32
# up 8k rows 529 -> 458 us, down 281 -> 251; Kimi-K2 EP32 up 16k 1020 -> 880; DeepGEMM's
# 4x8192 up 1922 -> 1670, down 1007 -> 884); ping-pong 64x128 on decode-sized experts 5-6%
# faster (E=256, 256 rows 144 -> 137 us, 2048 rows 238 -> 224); the batched decode headline
# within noise. 2 ahead ran slower than the plain loop on the compute-bound shapes and 4 ahead
# gained at most 3% there (the ring's register moves land differently in ptxas's schedule;
# docs/measurements.md). Tiles whose columns span two scale blocks (160 or 192 columns, or a
# narrow 48 or 96) keep the plain loop: they hold two B scales per stage, and with the ring
# ptxas spills on some (batched cooperative 128x192: 20 B at 3 ahead, 120 at 4; ping-pong
# 64x192: 72 B), none was timed with it. MOE_GEMM_FP8_SCALE_AHEAD (1 to 4) overrides both;
# 1 is the plain loop.
SCALE_AHEAD_ENV = "MOE_GEMM_FP8_SCALE_AHEAD"  # (its range is declared in env.VARIABLES)
DEFAULT_SCALE_AHEAD = 3


def scale_ahead_requested() -> int:
    """MOE_GEMM_FP8_SCALE_AHEAD as a stage count, 0 when unset or empty (the default: see
    above). Raises EnvError (a ValueError) for anything but an integer from 1 to 4."""
    return env_value(SCALE_AHEAD_ENV) or 0


# Block scales staged in shared memory by TMA beside each stage's operands
# (GroupedGemmFp8Sm90._mainloop_lagged with ScaleLoads), with the promotion one stage behind the
# WGMMAs where the tile has room for the third accumulator: the varlen default. The math
# threads read a stage's scales from shared memory right after issuing its WGMMAs and
# promote it while the next stage's run. Measured on an H200 (2026-11-29, one process,
# interleaved CUDA-graph replays, outputs bitwise equal), against the three-ahead register
# ring: DeepSeek-V3 EP32 down 8k rows 256 -> 248 us, DeepGEMM's 4 x 8192 down 894 -> 873,
# Kimi-K2 EP32 up 16k 899 -> 892, DeepSeek-V3 EP32 up 8k 459 -> 459, E=256 decode 224 ->
# 224 (the launch's copy of row-major A scales to M-major included). Staged without the lag
# ran 2-5% slower than the ring (cooperative 128x128), so the kernel stages only with the lag,
# and tiles without room for it (those spanning two scale blocks) keep the ring; the lag with
# scales from global memory ran 25-36% slower. MOE_GEMM_FP8_SMEM_SCALES=0 / 1 forces the
# ring / the staged scales (on the tiles that take them); a pinned MOE_GEMM_FP8_SCALE_AHEAD
# means the ring.
SMEM_SCALES_ENV = "MOE_GEMM_FP8_SMEM_SCALES"
DEFAULT_SMEM_SCALES = True
# Where K / 128 is a multiple of 4, a checkpoint's (N / 128, K / 128) weight scales are the
# TMA load's k-block-major layout as they are (each row of them 16-byte aligned); otherwise
# the launch copies them every call, and on decode-sized problems that copy costs more than
# staging gains, so those keep the ring (the FP8 zoo on an H200, 2026-11-29: Qwen3-30B-A3B
# down, K = 768, at 16 tokens 42.6 us staged against 38.6 with the ring, at 2048 tokens 93.4
# against 103.2; GLM-4.5-Air down, K = 1408: 125.2 / 119.6 and 281.9 / 299.6).
STAGED_KB_MULTIPLE = 4
# The forms that can stage them: varlen and batched (one scale tensor per operand, whose
# problem the TMA box indexes); the masked form keeps the ring and general's per-problem scale
# pointers have no TMA descriptor. The batched form stages only when asked
# (MOE_GEMM_FP8_SMEM_SCALES=1): on an H200 (2026-12-02, bench_fp8, its default cooperative
# 128x128 1x2 tile) the staged scales with the lag ran slower than its ring, DeepGEMM's 4 x
# 8192 rows as 3-D x up 2121 against 1892 us, down 1097 against 1023, the decode headline 316
# against 303, where the same rows in the varlen form (with the whole-tile epilogue the
# batched form lacks) ran 1505 staged against 2013 with the ring.
_STAGED_FORMS = ("varlen", "batched")


# The whole-tile epilogue (the tile's 16-bit output staged in shared memory at once, then one
# TMA store) for the varlen form's cooperative 128-row tiles in 1x2 clusters, the compute-bound
# default. Measured on an H200 (2026-12-01, one process, CUDA-graph replays interleaved over 9
# rounds, outputs bitwise equal), block scales, against the subtile epilogue: DeepSeek-V3 EP32
# up 8k rows 425 / 440 us, down 231 / 239; DeepGEMM's 4 x 8192 up 1553 / 1602, down 819 / 850;
# Kimi-K2 EP32 up 16k 842 / 888 (3-5% faster; the same shapes gave 3-4% in a second run).
# The same epilogue without the cluster (with the tail split) was 1-4% slower than the default
# there. Its smem equals the four subtile buffers', so the A/B depth does not change (4, 5 or 6
# stages timed within 2% of one another on these shapes).
WHOLE_EPILOGUE_IN_PAIRS = True


# The FP8 stage loops can probe the next stage's full barrier right after issuing a stage and
# take that probe at the next wait (kernels/sm90/stage_wait.py): the math warps of the FP8
# loop are issue-bound (the promotion's FFMAs), and waiting on the barrier after the promotion
# put its latency between two WGMMA batches. ncu on an H200 (2026-12-02, 8 experts x 8192
# rows, N 4096, K 7168, base clocks): tensor pipe 82.7% -> 87.8% busy with block scales, 82.0%
# -> 89.4% row-wise (cuBLAS's dense row-wise kernel on the same tile: 91.5%). Timed
# (bench_fp8's `-nopeek` rows, fp8-nvidia-h200-2026-12-02.json, and a second run of the decode
# rows): the five compute-bound varlen shapes 2.3-5.1% faster with block scales and 3.1-5.6%
# row-wise; varlen decode with block scales (the lagged ping-pong 64x128) 1.9% and 0.3-0.6%
# faster; but row-wise varlen decode (plain ping-pong 64x128) 0.6-0.8% and the batched decode
# headline (cooperative 128x128, either scales) 0.8-1.2% slower in both runs (there the
# probe's short suspend holds back the release of a stage the memory-bound load warp waits
# for). So the varlen form probes, except row-wise ping-pong tiles; the batched, general and
# masked forms (decode-sized in their measured uses, no compute-bound shape timed) do not.
# MOE_GEMM_FP8_PEEK_WAIT=0 / 1 forces it off / on everywhere. The plan caches key on it
# (ops/api.py's switches).
PEEK_WAIT_FP8_ENV = "MOE_GEMM_FP8_PEEK_WAIT"


def default_peek_wait(form: str, schedule: str, mode: str) -> bool:
    """Whether an FP8 kernel probes its stage barriers a stage ahead by default (above)."""
    return form == "varlen" and not (mode == "outer" and schedule == "pingpong")


def peek_wait_requested() -> bool | None:
    """MOE_GEMM_FP8_PEEK_WAIT as True / False, None when unset or empty (the default)."""
    return env_value(PEEK_WAIT_FP8_ENV)


# A cooperative 128-row tile whose rows past its problem's end cover the second warpgroup's
# 64 rows (an expert's last tile of at most 64 rows) can leave that warpgroup idle: it takes
# the stages off the ring without WGMMAs or promotions, and the first warpgroup's WGMMAs have
# the tensor cores to themselves (GroupedGemmFp8Sm90 skip_empty_half). Measured on an H200
# (2026-12-02, block and row-wise scales, interleaved in one process): on routed experts of
# ~1k rows (bench_fp8's DeepSeek-V3 / Kimi-K2 EP32 shards, whose last tiles waste 4-8% of the
# MMA rows) 0.4-3.2% faster in two runs; but on the zoo's 8192-token cases of 128-384 experts
# (~170-410 rows each; DeepSeek-V3, Kimi-K2, GLM-4.5, Qwen3-235B) up to 10% slower with
# block scales and 31% row-wise (DeepSeek-V3 gate-up 4.40 against 4.09 ms), unexplained:
# the idle warpgroup still waits on every stage's full barrier (it must not release a stage
# before its fill), and a build where the busy warpgroup released for both was slower still.
# On problems of 8192 rows (DeepGEMM's 4 x 8192, varlen and batched) it ran within 0.7%.
# So it is on by default from HALF_SKIP_MIN_ROWS rows per problem (the varlen and batched
# forms, where those measurements were made), off below; MOE_GEMM_FP8_HALF_SKIP=1 / 0 forces
# it on / off everywhere (the plan caches key on it).
HALF_SKIP_ENV = "MOE_GEMM_FP8_HALF_SKIP"
HALF_SKIP_MIN_ROWS = 768
_HALF_SKIP_FORMS = ("varlen", "batched")


# The tile order's panel (m-tiles walked before the next column of tiles, within a problem)
# of the varlen form's FP8 tiles. Routed experts of ~1k rows skewed up to ~3x span 8-24
# 128-row tiles: in panels of 8 a large expert leaves a short last panel that walks every
# column of B again for one or two m-tiles; panels of 16 leave fewer. Measured on an H200
# (2026-12-02, bench_fp8's sweep, block scales, two runs, each in one process, interleaved),
# cooperative 128x128 in 1x2 clusters, panels of 16 against 8: the up projections 1.1-2.2%
# faster (DeepSeek-V3 EP32 8k rows 395-396 against 400-402 us, Kimi-K2 EP32 16k 764-765
# against 777-782, DeepGEMM's 4 x 8192 1453 against 1473), the downs within 0.2% in the
# second run (2.3% faster in the first); panels of 4 ran 2-4% slower than 8 on the ups. The
# batched form's compute-bound default runs the varlen kernel (scaled_launch); the other
# forms keep 8 (not measured).
VARLEN_RASTER_PANEL = 16
DEFAULT_RASTER_PANEL = 8


def default_raster_panel(form: str) -> int:
    """The FP8 kernels' raster panel where a config leaves it to us (above)."""
    return VARLEN_RASTER_PANEL if form == "varlen" else DEFAULT_RASTER_PANEL


def default_half_skip(form: str, avg_m: float) -> bool:
    """Whether an FP8 cooperative 128-row tile skips an empty second half by default: on
    problems of HALF_SKIP_MIN_ROWS rows or more (about) in the varlen and batched forms."""
    return form in _HALF_SKIP_FORMS and avg_m >= HALF_SKIP_MIN_ROWS


def half_skip_requested() -> bool | None:
    """MOE_GEMM_FP8_HALF_SKIP as True / False, None when unset or empty (the default)."""
    return env_value(HALF_SKIP_ENV)


def smem_scales_requested() -> bool | None:
    """MOE_GEMM_FP8_SMEM_SCALES as True / False, None when unset or empty (the default).
    Raises EnvError (a ValueError) for anything but 1 / 0 (or true / false, yes / no, on /
    off)."""
    return env_value(SMEM_SCALES_ENV)


def kernel_scale_mode(granularity: str) -> str:
    """The kernel's compile-time scale mode of a user-facing granularity."""
    return "block" if granularity == "block" else "outer"


def choose_fp8(form: str, config: GemmConfig, avg_m: float, N: int, K: int,
               out_itemsize: int, granularity: str) -> KernelChoice:
    """The FP8 kernel of `form` ("varlen", "batched", "general", or "masked": the varlen
    rules without staged scales) for grouped rows of about avg_m per problem (varlen: T / E),
    N columns and depth K. Raises ValueError for pins the FP8 kernel does not build."""
    return with_split_ways(with_l2_hints(_choose(
        form, config, avg_m, N, K, out_itemsize, kernel_scale_mode(granularity),
        tail_split_enabled(), promote_lag_requested(), scale_ahead_requested(),
        smem_scales_requested(), peek_wait_requested(), half_skip_requested())))


def _default_tile_n(N: int) -> int:
    # 128 columns: one 128x128 weight-scale block per tile (no per-column block selection in
    # the promotion) and 2 x 64 accumulator registers per thread. Narrow outputs get the
    # smallest multiple of 16 that covers them.
    return 128 if N >= 128 else max(16, -(-N // 16) * 16)


# Measured on an H100 80GB HBM3 (2026-11-28, block scales, CUDA-graph replays; the rows in
# docs/measurements.md): on routed experts of 48 to 2048 rows (E=32 to 384, N=1536 to 7168,
# K=1536 to 7168; 17 shapes) cooperative 128x128 tiles in 1x2 clusters, whose two CTAs share
# their A rows through multicast, were never slower than the lone tile (with or without the
# tail split) beyond run-to-run noise (~1.5%) and up to 10% faster; 2x1 clusters lost up to 50%
# at 64 rows per expert and won only one of three shapes at 1024-2048. At 16 rows and fewer
# per expert the 64x128 ping-pong tile stayed ahead.
FP8_PINGPONG_MAX_ROWS = 32


# The batched form too (H200, 2026-11-28, bench_fp8's decode headline, 256 problems of
# 128 x 512 x 7168, block scales): 1x2 took 306 us against 334 us for the lone tile and 341 us
# for the lone tile with the tail split; on DeepGEMM's 4 x 8192-row varlen shapes (4 problems,
# the batched form's layout) 1x2 was 13-14% ahead of the lone tile. The general form's
# problems each have their own sizes and strides and were never timed with clusters: 1x1.
# The masked form takes the varlen form's rules.
_CLUSTERED_FORMS = ("varlen", "batched", "masked")


def _default_cluster(form: str, N: int, tile_n: int) -> tuple[int, int]:
    """The cluster of a cooperative FP8 tile the config leaves to us: a pair of column tiles
    where there are two (the varlen and batched forms: the measurements above)."""
    return (1, 2) if form in _CLUSTERED_FORMS and N >= 2 * tile_n else (1, 1)


@functools.lru_cache(maxsize=512)
def _choose(form: str, config: GemmConfig, avg_m: float, N: int, K: int, out_itemsize: int,
            mode: str, split_ok: bool, lag: bool | None = None, ahead: int = 0,
            smem: bool | None = None, peek: bool | None = None,
            half_skip: bool | None = None) -> KernelChoice:
    if config.visitor == "host":
        raise ValueError("the FP8 kernels run the device visitor; use visitor='device' or "
                         "'auto'")
    if config.sort_by_k:
        raise ValueError("sort_by_k=True is not built for the FP8 kernels")
    cm, cn = (1, 1) if config.cluster_m is None else (config.cluster_m, config.cluster_n)
    if config.tile_m is not None:
        tile = (config.tile_m, config.tile_n)
        schedule = config.schedule
        if schedule == "auto":
            # A 64-row tile is ping-pong only; otherwise the one that builds it, cooperative
            # first.
            # Where neither builds it, the cooperative refusal is the one to name for a
            # 256-row tile (ping-pong has no such rows: that would not be the reason).
            coop_why = fp8_tile_problem("cooperative", *tile, mode)
            schedule = "pingpong" if tile[0] == 64 else (
                "cooperative" if coop_why is None or tile[0] == 256 else "pingpong")
    else:
        if config.schedule != "auto":
            schedule = config.schedule
        elif config.tail_split or config.whole_epilogue or cm * cn > 1:
            schedule = "cooperative"
        else:
            # Up to 32 rows per problem (decode: a few tokens per expert) a 64-row ping-pong
            # tile wastes half the MMA rows a 128-row tile would; beyond, both warpgroups
            # share a 128-row tile (measured: the table above _default_cluster).
            schedule = "pingpong" if avg_m <= FP8_PINGPONG_MAX_ROWS else "cooperative"
        tile = ((64 if schedule == "pingpong" else 128), _default_tile_n(N))
        if config.cluster_m is None and schedule == "cooperative" and not (
                config.tail_split or config.whole_epilogue):
            cm, cn = _default_cluster(form, N, tile[1])
    why = fp8_tile_problem(schedule, tile[0], tile[1], mode)
    if why is not None:
        raise ValueError(f"the FP8 kernel cannot build this tile: {why}")
    if config.tail_split is None:
        tail_split = (schedule == "cooperative" and cm * cn == 1 and form != "general"
                      and K >= 32 * FP8_TILE_K)
    else:
        tail_split = config.tail_split
        if tail_split and (schedule != "cooperative" or cm * cn != 1 or form == "general"):
            raise ValueError("tail_split=True is built for grouped_mm's forms, the cooperative "
                             "schedule and a 1x1 cluster")
    epi_whole = bool(config.whole_epilogue)
    if epi_whole and (schedule != "cooperative" or out_itemsize != 2 or tile[0] != 128):
        raise ValueError("whole_epilogue=True is built for cooperative 128-row tiles with "
                         "16-bit output")
    if (config.whole_epilogue is None and form == "varlen" and schedule == "cooperative"
            and tile[0] == 128 and out_itemsize == 2 and (cm, cn) == (1, 2)):
        epi_whole = WHOLE_EPILOGUE_IN_PAIRS
    # The lag where asked for and built (block scales, room for a third accumulator).
    lag_fits = fp8_tile_problem(schedule, tile[0], tile[1], mode, promote_lag=True) is None
    # Staged scales (varlen, block scales, tiles with room for the lag, which they run
    # with unless MOE_GEMM_FP8_PROMOTE_LAG=0): by default unless a ring depth is pinned.
    if smem is None:
        smem = (DEFAULT_SMEM_SCALES and form == "varlen" and ahead == 0
                and ((K // FP8_TILE_K) % STAGED_KB_MULTIPLE == 0
                     or avg_m > FP8_PINGPONG_MAX_ROWS))
    smem = smem and mode == "block" and form in _STAGED_FORMS and lag_fits
    # (lag False: staged scales promoted in the plain loop; None: the default)
    lag = lag_fits and lag is not False and (bool(lag) or smem)
    # The scales' prefetch depth where the plain block-scaled loop runs (the lagged loop and
    # row-wise scales load none per stage); 0: the default above.
    if ahead == 0:
        ahead = DEFAULT_SCALE_AHEAD if scale_blocks_spanned(tile[1]) == 1 else 1
    # (the lagged loop and staged scales load none per stage)
    ahead = ahead if mode == "block" and not lag and not smem else 1
    return KernelChoice(schedule, "device", tile[0], tile[1], config.stages, False,
                        raster_of(config, default_raster_panel(form)), cluster_m=cm,
                        cluster_n=cn,
                        epi_whole=epi_whole, tail_split=tail_split and split_ok,
                        promote_lag=lag, scale_ahead=ahead, smem_scales=smem,
                        peek_wait=default_peek_wait(form, schedule, mode) if peek is None
                        else peek,
                        # (built for cooperative 128-row tiles: one 64-row half a warpgroup)
                        skip_empty_half=((default_half_skip(form, avg_m) if half_skip is None
                                          else half_skip)
                                         and schedule == "cooperative" and tile[0] == 128))


def clear_caches() -> None:
    _choose.cache_clear()
