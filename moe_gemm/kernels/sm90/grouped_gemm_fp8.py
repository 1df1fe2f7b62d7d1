"""GroupedGemmFp8Sm90: the grouped GEMM on FP8 (e4m3 / e5m2) operands with fp32 scales.

D_p = dequant(A_p) @ dequant(B_p) for every problem p, where dequant multiplies each FP8 value
by its scale: DeepSeek-V3's recipe ("block": A scales per row per 128-K block, B scales per
128x128 block) or row-wise ("outer": a scale per row of A and per column of B; per-tensor
scales are that with equal entries). Everything but the mainloop is GroupedGemmSm90's (the
scheduler warp, the problem forms, the TMA load warp, clusters, the tail split and the
epilogue); this class changes:

- tile_k = 128: one 128-byte swizzle row of 8-bit data per stage, which is also one scale
  block along K. FP8 WGMMA reads both operands K-major from shared memory, so B is (N, K)
  K-contiguous (torch's column-major w, a checkpoint's (N, K) weight).
- the two-level accumulation: each stage's four m64nNk32 WGMMAs write a temporary fp32
  accumulator (the first with scale-d = 0), and the math warpgroup then adds it into the main
  accumulator: acc += tmp * a_scale[row, kb] * b_scale[n_block, kb] ("block"), or acc += tmp
  ("outer", whose scales multiply the finished tile once). Hopper's FP8 tensor cores keep
  fewer accumulator bits than fp32; promoting every 128 of K keeps long-K sums (K = 7168,
  14336) at fp32 accuracy, as DeepGEMM and CUTLASS's non-fast-accum FP8 kernels do.
- scales are tiny (a 128x128 tile's stage needs 128 A scales and one or two B scales, 0.5 KiB
  beside 32 KiB of operands). The math threads read them straight from global memory ahead
  of their use (one stage in the plain loop, more in the prefetched one), with any strides
  and the row index clamped into the scale tensor (rows past an expert's end or past T read
  a valid, unused scale); or, in the varlen and batched forms (smem_scales), the load warp
  stages them in shared memory by TMA beside each stage's operands (ScaleLoads) from M-major
  A scales and k-block-major B scales (ops/scaled_launch.py lays them out so).

In the plain stage loop each warpgroup waits for its stage's WGMMAs, then promotes: the tensor
cores stay busy only while the other warpgroup's WGMMAs run. The lagged loop (promote_lag,
block scales; with global scale loads opt-in through MOE_GEMM_FP8_PROMOTE_LAG=1) issues
stage k's WGMMAs before promoting stage k-1 within each warpgroup, at the cost of a third
accumulator (tiles of at most 64 accumulator registers per thread); the promotions add in the
same order, so its output is bit for bit the plain loop's. The prefetched loop (scale_ahead,
block scales; by default 3 stages on the batched and general forms' tiles within one scale
block, ops/heuristics_fp8.py) is
the plain loop with each stage's scales loaded that many stages ahead into a ring of
registers, so the B scale's L2 latency (a new line every stage) no longer holds back the
stage's last WGMMA; its output is bit for bit the plain loop's too. With staged scales the
lagged loop reads a stage's scales from shared memory once its WGMMAs are issued
(_mainloop_lagged with smem_scales: the varlen default where the third accumulator fits, see
ops/heuristics_fp8.py); loaded from global memory instead, the lag ran 25-36% slower than
the ring. Staged scales without the lag (_mainloop_staged, MOE_GEMM_FP8_PROMOTE_LAG=0) run
the plain loop on them with two accumulators: 16-23% slower than the lag on compute-bound
shapes (H200), an A/B switch. The second accumulator caps the tiles
(constants_fp8.fp8_tile_problem): cooperative 128 x up to 192, ping-pong 64 x up to 192 or
128 x up to 96. Block-scaled tiles span at most two 128-column scale blocks (so 176 and 208
columns are refused); a tile whose columns straddle a block boundary picks each 8-column
group's B scale by a run-time split. With peek_wait (the varlen default,
ops/heuristics_fp8.py) every loop probes the next stage's full barrier right after issuing a
stage and its next wait takes that probe (kernels/sm90/stage_wait.py): the promotion's
instructions hide the barrier's latency instead of following it. The waits change, not the
arithmetic: outputs are bit for bit the same. With skip_empty_half (cooperative 128-row
tiles, opt-in: ops/heuristics_fp8.py) a warpgroup whose 64 rows all lie past the problem's
end (an expert's last tile of at most 64 rows) takes its stages off the ring without WGMMAs:
its rows are never stored, and the other warpgroup's WGMMAs have the tensor cores to
themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from .constants import SPLIT_WAYS
from .constants_fp8 import (
    FP8_TILE_K,
    SCALE_BLOCK,
    SCALE_MODES,
    fp8_register_split,
    fp8_tile_problem,
    scale_blocks_spanned,
)
from .grouped_gemm import BAR_MMA_ORDER, GroupedGemmSm90, ProblemArgs, RunArgs
from .problems import (
    BatchedProblems,
    GeneralProblems,
    MaskedProblems,
    VarlenProblems,
    batch_last,
)
from .stage_wait import wait_full_unless_ready
from .tile_scheduler import WorkTile, ceil_div_i32

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# The rows of one warpgroup's share of a cooperative 128-row tile (an m64 WGMMA's rows).
HALF_ROWS = 64
SMETA_INTS = 8  # general form: (G, 8) int64 per problem, see Fp8GeneralProblems


class Fp8ProblemArgs(ProblemArgs):
    """ProblemArgs plus the scales: sfa / sfb (varlen, batched) or the general form's table."""

    FIELDS = ProblemArgs.FIELDS + ("sfa", "sfb", "smeta")


# The scale accessors extend the problem accessors (problems.py) with `scale_views(work)`:
# (A scales of the problem as (rows, k blocks), its row count, B scales as (k blocks, cols),
# its column count), where "outer" has one k block and a column per output column, and
# "block" has K/128 k blocks and ceil(N/128) column blocks. Frozen like their bases.


@dataclass(frozen=True, eq=False)
class Fp8VarlenProblems(VarlenProblems):
    sfa: cute.Tensor  # (T, KB) fp32
    sfb: cute.Tensor  # (E, KB, C) fp32

    def scale_views(self, work: WorkTile):
        return (self.sfa, self.sfa.shape[0], self.sfb[work.problem, None, None],
                self.sfb.shape[2])


@dataclass(frozen=True, eq=False)
class Fp8BatchedProblems(BatchedProblems):
    sfa: cute.Tensor  # (G, M, KB) fp32
    sfb: cute.Tensor  # (G, KB, C) fp32

    def scale_views(self, work: WorkTile):
        return (self.sfa[work.problem, None, None], self.sfa.shape[1],
                self.sfb[work.problem, None, None], self.sfb.shape[2])


@dataclass(frozen=True, eq=False)
class Fp8MaskedProblems(MaskedProblems):
    sfa: cute.Tensor  # (G, M, KB) fp32
    sfb: cute.Tensor  # (G, KB, C) fp32

    def scale_views(self, work: WorkTile):
        return (self.sfa[work.problem, None, None], self.sfa.shape[1],
                self.sfb[work.problem, None, None], self.sfb.shape[2])


@dataclass(frozen=True, eq=False)
class Fp8GeneralProblems(GeneralProblems):
    # (G, 8) int64 per problem: [sfa address, its row stride, its k-block stride, sfb address,
    # its k-block stride, its column stride, 0, 0] (strides in elements). sfa is (M, KB) and
    # sfb (KB, C) with KB and C as in the module docstring.
    smeta: cute.Tensor

    @cute.jit
    def scale_views(self, work: WorkTile):
        p = work.problem
        rows, cols, depth, _ = self.dims(p)
        kb = Int32(1)
        ncols = cols
        if const_expr(self.cfg.scale_mode == "block"):
            kb = ceil_div_i32(depth, SCALE_BLOCK)
            ncols = ceil_div_i32(cols, SCALE_BLOCK)
        sm = self.smeta
        sa = cute.make_tensor(
            cute.make_ptr(Float32, sm[p, 0], cute.AddressSpace.gmem, assumed_align=4),
            cute.make_layout((rows, kb), stride=(sm[p, 1], sm[p, 2])))
        sb = cute.make_tensor(
            cute.make_ptr(Float32, sm[p, 3], cute.AddressSpace.gmem, assumed_align=4),
            cute.make_layout((kb, ncols), stride=(sm[p, 4], sm[p, 5])))
        return sa, rows, sb, ncols


@dataclass(frozen=True)
class FragmentMap:
    """Where one math thread's accumulator values sit, as far as the scales care; read at trace
    time from the tiled MMA's C partition of thread 0 (a thread's coordinates are thread 0's
    plus its own offset, which is below 8 columns: tests/kernels/test_fp8_layouts.py proves
    both for every tile on the CPU).

    row_slot[i]: which of the thread's distinct rows value i is on (row_rep[s]: a value on
    row s); col8[i]: value i's column in thread 0, rounded down to 8 (its 8-column group);
    col_slot[i] / col_rep[q]: the same for the distinct columns."""

    row_slot: tuple[int, ...]
    row_rep: tuple[int, ...]
    col8: tuple[int, ...]
    col_slot: tuple[int, ...]
    col_rep: tuple[int, ...]


def fragment_map(coords: list[tuple[int, int]]) -> FragmentMap:
    """The FragmentMap of thread 0's (row, col) per accumulator value (plain Python)."""
    rows = sorted({r for r, _ in coords})
    cols = sorted({c for _, c in coords})
    row_slot = tuple(rows.index(r) for r, _ in coords)
    col_slot = tuple(cols.index(c) for _, c in coords)
    return FragmentMap(row_slot, tuple(row_slot.index(s) for s in range(len(rows))),
                       tuple(c & ~7 for _, c in coords), col_slot,
                       tuple(col_slot.index(q) for q in range(len(cols))))


# Staged scales (smem_scales): per A/B stage, a slot of fp32 holds a box of A scales, then
# one of B scales, each loaded by TMA. A TMA box must start 16 bytes into its contiguous axis
# (a box whose first coordinate there is not a multiple of 4 fp32 stops the kernel with an
# illegal instruction on an H200), so each box starts at the aligned coordinate below what
# the tile needs and the math threads read at the offset: tile_m + 4 rows of the M-major A
# scales from the tile's first row rounded down to 4, and (4 k-blocks, 2 column blocks) of the
# k-block-major B scales from the stage's k-block rounded down to 4 (both column blocks a tile
# can span). Slots and the B box's offset are multiples of 128 bytes.
SA_PAD = 4
SB_BOX = (4, 2)
SB_FLOATS = SB_BOX[0] * SB_BOX[1]


def _round32(n: int) -> int:
    return -(-n // 32) * 32


def staged_sb_offset(tile_m: int) -> int:
    return _round32(tile_m + SA_PAD)


def staged_slot_floats(tile_m: int) -> int:
    return _round32(staged_sb_offset(tile_m) + SB_FLOATS)


@dataclass(frozen=True)
class ScaleLoads:
    """The load warp's TMA copies of one tile's block scales into the stage ring
    (smem_scales): per k-tile, the A scales of the tile's rows (one (tile_m + SA_PAD, 1) box
    of the M-major sfa from the tile's first row rounded down to 4: rows past T are zero
    filled, rows past an expert's end are another expert's, and nothing stores either) and
    an SB_BOX box of B scales at (k rounded down to 4, the tile's first 128-column block) of
    the k-block-major sfb (its second column block and k-blocks past the last are zero
    filled past the ends; the stage uses k's one or two).
    Both land on the stage's full barrier beside A and B (its transaction count includes
    them), so the barrier costs no extra arrival and the load warp issues two more TMA copies
    a stage. Frozen: the load loop reads it without carrying it."""

    atom_sa: Any
    atom_sb: Any
    sa_box: Any  # (tile_m + SA_PAD, 1)
    sSA: cute.Tensor  # (sa_box, stage) in shared memory
    gSA: cute.Tensor  # (rows, k blocks) of sfa from the tile's first row rounded down to 4
    sSB: cute.Tensor  # (SB_BOX, stage) in shared memory
    gSB: cute.Tensor  # (k blocks, column blocks) of the problem from the tile's first

    @cute.jit
    def fill_stage(self, k: Int32, stage: Int32, bar):
        sa_box = cute.local_tile(cute.domain_offset((0, k), self.gSA), self.sa_box, (None, None))
        tSAs, tSAg = cpasync.tma_partition(
            self.atom_sa, 0, cute.make_layout(1), cute.group_modes(self.sSA, 0, 2),
            cute.group_modes(sa_box, 0, 2))
        cute.copy(self.atom_sa, tSAg[(None, 0, 0)], tSAs[(None, stage)], tma_bar_ptr=bar)
        sb_box = cute.local_tile(cute.domain_offset((k & -4, 0), self.gSB), SB_BOX,
                                 (None, None))
        tSBs, tSBg = cpasync.tma_partition(
            self.atom_sb, 0, cute.make_layout(1), cute.group_modes(self.sSB, 0, 2),
            cute.group_modes(sb_box, 0, 2))
        cute.copy(self.atom_sb, tSBg[(None, 0, 0)], tSBs[(None, stage)], tma_bar_ptr=bar)


class GroupedGemmFp8Sm90(GroupedGemmSm90):
    """The FP8 grouped GEMM (see the module docstring).

    Args (compile-time): as GroupedGemmSm90, except
        ab_dtype: cutlass.Float8E4M3FN or cutlass.Float8E5M2 (A and B alike).
        scale_mode: "block" (1x128 A, 128x128 B scales) or "outer" (row-wise A, column-wise B).
        peek_wait: every stage loop probes the next stage's barrier a stage ahead.
    B is always K-major.

    Launch arguments (__call__): GroupedGemmSm90's, plus after mD:
        mSFA: varlen (T, KB); batched (G, M, KB); general: unused (1, 1). fp32, any strides.
        mSFB: varlen (E, KB, C); batched (G, KB, C); general: unused (1, 1, 1).
        smeta: general: (G, 8) int64 (Fp8GeneralProblems); else unused (1, 8).
    KB = K / 128 and C = ceil(N / 128) in "block" mode; KB = 1 and C = N in "outer" mode.
    """

    tile_k = FP8_TILE_K

    def __init__(self, ab_dtype, d_dtype, form, schedule, visitor, tile_mn, scale_mode: str,
                 ab_stages=None, trace=False, l2_hints=False, epi_n=32, cluster_m=1,
                 cluster_n=1, epi_whole=False, tail_split=False, promote_lag=False,
                 scale_ahead=1, smem_scales=False, split_ways=SPLIT_WAYS, peek_wait=False,
                 skip_empty_half=False):
        if ab_dtype not in (cutlass.Float8E4M3FN, cutlass.Float8E5M2):
            raise ValueError(f"the FP8 kernel takes float8 e4m3 or e5m2 inputs; got {ab_dtype}")
        why = fp8_tile_problem(schedule, tile_mn[0], tile_mn[1], scale_mode, promote_lag)
        if why is not None:
            raise ValueError(why)
        if scale_ahead != 1 and (scale_mode != "block" or promote_lag
                                 or not 1 <= scale_ahead <= 4):
            raise ValueError("scale_ahead (1 to 4) is built for the plain block-scaled loop; "
                             f"got {scale_ahead} with {scale_mode} scales"
                             + (" and the lagged promotion" if promote_lag else ""))
        if smem_scales and (scale_mode != "block" or scale_ahead != 1):
            raise ValueError("smem_scales (block scales staged by the load warp) is built for "
                             "block scales read by the lagged or the plain loop (scale_ahead "
                             "1)")
        if skip_empty_half and not (schedule == "cooperative" and tile_mn[0] == 128):
            raise ValueError("skip_empty_half is built for cooperative 128-row tiles (one "
                             f"64-row half per warpgroup); got {schedule} {tile_mn[0]} rows")
        self.skip_empty_half = skip_empty_half
        self.scale_mode = scale_mode
        self.promote_lag = promote_lag
        self.scale_ahead = scale_ahead
        self.smem_scales = smem_scales
        if smem_scales and tile_mn[0] + SA_PAD > 256:
            raise ValueError("smem_scales takes tiles of at most 252 rows (a TMA box of at "
                             "most 256)")
        if smem_scales and form not in ("varlen", "batched"):
            raise ValueError("smem_scales (block scales staged by TMA) is built for the varlen "
                             f"and batched forms; got {form}")
        # A stage's staged scales (ScaleLoads): a slot of the tile's A scales and SB_BOX B
        # scales, whose bytes the stage's full barrier also waits for.
        self.staged_scale_floats = staged_slot_floats(tile_mn[0]) if smem_scales else 0
        self.staged_tx_bytes = (tile_mn[0] + SA_PAD + SB_FLOATS) * 4 if smem_scales else 0
        super().__init__(ab_dtype, d_dtype, "k", form, schedule, visitor, tile_mn,
                         ab_stages=ab_stages, trace=trace, l2_hints=l2_hints, epi_n=epi_n,
                         cluster_m=cluster_m, cluster_n=cluster_n, epi_whole=epi_whole,
                         tail_split=tail_split, split_ways=split_ways, peek_wait=peek_wait)
        self.load_regs, self.math_regs = fp8_register_split(schedule, *tile_mn, promote_lag)
        self.blocks_spanned = scale_blocks_spanned(self.tile_n)
        assert scale_mode in SCALE_MODES

    # ------------------------------------------------------------------------------------------
    # Host entry

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # FP8, as GroupedGemmSm90's
        mW: cute.Tensor,  # FP8, K-major
        mD: cute.Tensor,
        mSFA: cute.Tensor,  # see the class docstring
        mSFB: cute.Tensor,
        smeta: cute.Tensor,
        meta: cute.Tensor,
        meta32: cute.Tensor,
        offs: cute.Tensor,
        table: cute.Tensor,
        workspace: cute.Tensor,
        trace: cute.Tensor,
        num_problems: Int32,
        num_ctas: Int32,
        swizzle: Int32,
        a_policy: Int64,
        b_policy: Int64,
        pdl: Int32,
        d_base: Int64,
        stream,
    ):
        # The base's body with the scales among the problem arguments.
        self.build_and_launch(
            mA, mW, mD,
            Fp8ProblemArgs(mA, mD, meta, meta32, offs, table, num_problems, d_base,
                           mSFA, mSFB, smeta),
            RunArgs(workspace, trace, swizzle, a_policy, b_policy), num_ctas, pdl, stream)

    def make_problems(self, args: Fp8ProblemArgs):
        if const_expr(self.form == "general"):
            return Fp8GeneralProblems(self, args.num_problems, args.meta, args.meta32,
                                      args.d_base, args.smeta)
        if const_expr(self.form == "varlen"):
            return Fp8VarlenProblems(self, args.num_problems, args.mA, args.mD, args.offs,
                                     args.sfa, args.sfb)
        if const_expr(self.form == "masked"):
            return Fp8MaskedProblems(self, args.num_problems, args.mA, args.mD, args.offs,
                                     args.sfa, args.sfb)
        return Fp8BatchedProblems(self, args.num_problems, args.mA, args.mD, args.sfa,
                                  args.sfb)

    # ------------------------------------------------------------------------------------------
    # Mainloop with promotion

    def fragment_map(self, tiled_mma: cute.TiledMma) -> FragmentMap:
        """Thread 0's accumulator coordinates, static at trace time (see FragmentMap)."""
        tile = cute.make_identity_tensor((self.tile_m, self.tile_n))
        c0 = tiled_mma.get_slice(0).partition_C(tile)
        return fragment_map([tuple(c0[i]) for i in range(cute.size(c0))])

    @cute.jit
    def mainloop(
        self,
        ab_pipe: pipeline.PipelineTmaAsync,
        ab_state: pipeline.PipelineState,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        tCrA: cute.Tensor,
        tCrB: cute.Tensor,
        k_tiles: Int32,
        num_k_blocks: cutlass.Constexpr,
        math_wg: Int32,
        work: WorkTile,
        problems,
        staged: cute.Tensor | None,
    ) -> pipeline.PipelineState:
        """acc = the scaled A_tile @ B_tile over k_tiles stages of 128 (zeros when k_tiles is
        0), promoted stage by stage (see the module docstring)."""
        fmap = self.fragment_map(tiled_mma)
        tidx, _, _ = cute.arch.thread_idx()
        mma_tidx = tidx - self.threads_per_wg
        if const_expr(self.pingpong):
            mma_tidx = tidx % self.threads_per_wg
        coords = tiled_mma.get_slice(mma_tidx).partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n)))
        tmp = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
        n_rows = len(fmap.row_rep)

        n0 = work.n_tile * self.tile_n  # the tile's first column of the output
        # Block mode: the tile column where its second 128-column scale block starts.
        split = SCALE_BLOCK - (n0 % SCALE_BLOCK)
        sa, rows_lim, sb, cols_lim = None, None, None, None
        my_rows, nb0, nb1 = None, None, None
        if const_expr(not self.smem_scales):
            sa, rows_lim, sb, cols_lim = problems.scale_views(work)
            row0 = work.row_start + work.m_tile * self.tile_m  # the tile's first row in sa
            # This thread's rows of sa, clamped (rows past an expert's end or past T read a
            # valid scale that nothing stores).
            my_rows = [cutlass.min(row0 + coords[fmap.row_rep[s]][0], rows_lim - 1)
                       for s in range(n_rows)]
            # Block mode: the tile's first 128-column scale block and the second one
            # (two-block tiles).
            nb0 = n0 // SCALE_BLOCK
            nb1 = cutlass.min(nb0 + 1, cols_lim - 1)
        # A stage's scales: the thread's rows' A scales, then the tile's one or two B scales.
        n_sc = n_rows + (2 if self.blocks_spanned == 2 else 1)
        prod = cute.make_rmem_tensor((2 * n_rows,), Float32)

        acc.fill(0.0)
        if const_expr(self.skip_empty_half):
            # This warpgroup's 64 rows of the tile all lie past its problem's end (both
            # warpgroups' on a cluster rank past the edge): nothing of them is stored, so it
            # takes its stages off the ring without WGMMAs (its accumulator stays zeros).
            if math_wg * HALF_ROWS >= work.rows - work.m_tile * self.tile_m:
                ab_state = self._drain_stages(ab_pipe, ab_state, k_tiles)
            else:
                ab_state = self._promoted_loop(
                    ab_pipe, ab_state, tiled_mma, acc, tmp, prod, tCrA, tCrB, k_tiles,
                    num_k_blocks, work, fmap, coords, split, sa, my_rows, sb, nb0, nb1, staged,
                    n_sc)
        else:
            ab_state = self._promoted_loop(
                ab_pipe, ab_state, tiled_mma, acc, tmp, prod, tCrA, tCrB, k_tiles,
                num_k_blocks, work, fmap, coords, split, sa, my_rows, sb, nb0, nb1, staged,
                n_sc)
        if const_expr(self.pingpong):
            # Every WGMMA of this tile has retired: the other warpgroup's mainloop may start.
            cute.arch.barrier_arrive(
                barrier_id=BAR_MMA_ORDER + 1 - math_wg, number_of_threads=2 * self.threads_per_wg
            )
        if const_expr(self.scale_mode == "outer"):
            if k_tiles > 0:
                self._scale_outer(acc, fmap, coords, sa, my_rows, sb, n0, cols_lim)
        return ab_state

    @cute.jit
    def _drain_stages(self, ab_pipe, ab_state, k_tiles: Int32):
        """Take k_tiles stages off the ring without reading them (skip_empty_half). Each is
        waited for before it is released: a release before its stage's fill would count
        towards the round before, and a run ahead would arrive twice on one empty barrier."""
        for _k in cutlass.range(0, k_tiles, 1, unroll=1):
            ab_pipe.consumer_wait(ab_state)
            ab_pipe.consumer_release(ab_state)
            ab_state.advance()
        return ab_state

    @cute.jit
    def _promoted_loop(self, ab_pipe, ab_state, tiled_mma, acc, tmp, prod, tCrA, tCrB,
                       k_tiles: Int32, num_k_blocks: cutlass.Constexpr, work: WorkTile,
                       fmap: cutlass.Constexpr, coords, split, sa, my_rows, sb, nb0, nb1,
                       staged, n_sc: cutlass.Constexpr):
        """The stage loop the compile-time options pick (see the module docstring)."""
        if const_expr(self.promote_lag):
            tmp1 = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
            sc0 = cute.make_rmem_tensor((n_sc,), Float32)
            sc1 = cute.make_rmem_tensor((n_sc,), Float32)
            slots = self._staged_slots(work, fmap, coords) if const_expr(self.smem_scales) \
                else None
            ab_state = self._mainloop_lagged(
                ab_pipe, ab_state, tiled_mma, acc, tmp, tmp1, sc0, sc1, prod, tCrA, tCrB,
                k_tiles, num_k_blocks, work, fmap, sa, my_rows, sb, nb0, nb1, split, staged,
                slots, n_sc)
        elif const_expr(self.smem_scales):
            ab_state = self._mainloop_staged(
                ab_pipe, ab_state, tiled_mma, acc, tmp, prod, tCrA, tCrB, k_tiles,
                num_k_blocks, work, fmap, split, staged, self._staged_slots(work, fmap, coords),
                n_sc)
        elif const_expr(self.scale_mode == "block" and self.scale_ahead > 1):
            ab_state = self._mainloop_prefetched(
                ab_pipe, ab_state, tiled_mma, acc, tmp, prod, tCrA, tCrB, k_tiles,
                num_k_blocks, work, fmap, sa, my_rows, sb, nb0, nb1, split, n_sc)
        else:
            # Scales of the stage in use (cur) and of the next one (nxt, loaded a stage ahead).
            cur = cute.make_rmem_tensor((n_sc,), Float32)
            nxt = cute.make_rmem_tensor((n_sc,), Float32)
            if const_expr(self.scale_mode == "block"):
                if k_tiles > 0:
                    self._load_scales(cur, work.k_start, fmap, sa, my_rows, sb, nb0, nb1)
            warpgroup.fence()
            ready = self._probe(ab_pipe, ab_state)
            for k in cutlass.range(0, k_tiles, 1, unroll=1):
                if const_expr(self.scale_mode == "block"):
                    # The next stage's scales (the last stage reloads its own: branch-free).
                    self._load_scales(nxt, work.k_start + cutlass.min(k + 1, k_tiles - 1),
                                      fmap, sa, my_rows, sb, nb0, nb1)
                tiled_mma, ab_state, ready = self._stage(
                    ab_pipe, ab_state, tiled_mma, tmp, tCrA, tCrB, num_k_blocks, acc, cur,
                    prod, fmap, split, ready)
                if const_expr(self.scale_mode == "block"):
                    for s in cutlass.range_constexpr(n_sc):
                        cur[s] = nxt[s]
        return ab_state

    def _staged_slots(self, work: WorkTile, fmap: FragmentMap, coords: cute.Tensor) -> list:
        """This thread's rows' A-scale slots in a stage's staged scales: the row within the
        tile plus the box's shift (the tile's first row past a multiple of 4)."""
        shift = (work.row_start + work.m_tile * self.tile_m) & 3
        return [coords[fmap.row_rep[s]][0] + shift for s in range(len(fmap.row_rep))]

    @cute.jit
    def _read_staged(self, buf: cute.Tensor, staged: cute.Tensor, stage: Int32, slots,
                     k: Int32, n_sc: cutlass.Constexpr):
        """buf = stage `stage` (k-block k)'s staged scales: the thread's rows' A scales, then
        the B scale(s) (k's entry of the B box, which starts at k rounded down to 4)."""
        n_rows = len(slots)
        for s in cutlass.range_constexpr(n_rows):
            buf[s] = staged[slots[s], stage]
        sb = staged_sb_offset(self.tile_m) + (k & 3)
        for b in cutlass.range_constexpr(n_sc - n_rows):  # column block b
            buf[n_rows + b] = staged[sb + SB_BOX[0] * b, stage]

    def scale_tma_atoms(self, args: Fp8ProblemArgs):
        """(atom, tensor) of the A scales' and the B scales' TMA loads (smem_scales; traced
        in build_and_launch). sfa (T, KB), or (G, M, KB) in the batched form, is M-major and
        sfb (E, KB, C) k-block-major (a checkpoint's (N / 128, K / 128) blocks transposed),
        both with 16-byte aligned strides (ops/scaled_launch.py copies scales that are not).
        A batched sfa loads as (M, KB, G): the problem is the box's batch mode, as E is
        sfb's."""
        op = cpasync.CopyBulkTensorTileG2SOp()
        sa_box = (self.tile_m + SA_PAD, 1)
        sfa = batch_last(args.sfa) if self.form == "batched" else args.sfa
        atom_sa, tma_sa = cpasync.make_tiled_tma_atom(op, sfa, cute.make_layout(sa_box),
                                                      sa_box)
        atom_sb, tma_sb = cpasync.make_tiled_tma_atom(
            op, batch_last(args.sfb), cute.make_layout(SB_BOX), SB_BOX)
        return atom_sa, tma_sa, atom_sb, tma_sb

    @cute.jit
    def scale_loads(self, tma, work: WorkTile, staged: cute.Tensor) -> ScaleLoads:
        """The load warp's ScaleLoads for one tile (GroupedGemmSm90.load_role)."""
        slot = self.staged_scale_floats
        sa_box = (self.tile_m + SA_PAD, 1)
        sSA = cute.make_tensor(staged.iterator, cute.make_layout(
            (*sa_box, self.ab_stages), stride=(1, sa_box[0], slot)))
        sSB = cute.make_tensor(staged.iterator + staged_sb_offset(self.tile_m),
                               cute.make_layout((*SB_BOX, self.ab_stages),
                                                stride=(1, SB_BOX[0], slot)))
        row0 = work.row_start + work.m_tile * self.tile_m
        tma_sa = tma.tma_sa
        if const_expr(self.form == "batched"):
            tma_sa = tma_sa[None, None, work.problem]  # (rows 0.. of the problem, k blocks)
        gSA = cute.domain_offset((row0 & -4, 0), tma_sa)
        nb0 = work.n_tile * self.tile_n // SCALE_BLOCK
        gSB = cute.domain_offset((0, nb0), tma.tma_sb[None, None, work.problem])
        return ScaleLoads(tma.atom_sa, tma.atom_sb, sa_box, sSA, gSA, sSB, gSB)

    @cute.jit
    def _mainloop_prefetched(self, ab_pipe, ab_state, tiled_mma, acc, tmp, prod, tCrA, tCrB,
                             k_tiles: Int32, num_k_blocks: cutlass.Constexpr, work: WorkTile,
                             fmap: cutlass.Constexpr, sa, my_rows, sb, nb0, nb1, split,
                             n_sc: cutlass.Constexpr):
        """The plain stage loop with each stage's scales loaded scale_ahead stages before its
        promotion, into a ring of registers with static roles (the loop runs scale_ahead
        stages per iteration). A B scale is a new L2 line every stage (~0.5-1k cycles under
        load, more than a stage's WGMMAs take); loaded one stage ahead and moved into place
        at the end of the stage, the move made ptxas wait for the load before the stage's
        last WGMMA was issued. The promotions are the plain loop's, in the same order."""
        ring = self.scale_ahead
        bufs = [cute.make_rmem_tensor((n_sc,), Float32) for _ in range(ring)]
        last = work.k_start + k_tiles - 1  # later stages reload the last one: branch-free
        if k_tiles > 0:
            for r in cutlass.range_constexpr(ring):
                self._load_scales(bufs[r], cutlass.min(work.k_start + r, last), fmap, sa,
                                  my_rows, sb, nb0, nb1)
        warpgroup.fence()
        ready = self._probe(ab_pipe, ab_state)
        rounds = k_tiles // ring
        for kk in cutlass.range(0, rounds, 1, unroll=1):
            for r in cutlass.range_constexpr(ring):
                tiled_mma, ab_state, ready = self._stage(
                    ab_pipe, ab_state, tiled_mma, tmp, tCrA, tCrB, num_k_blocks, acc, bufs[r],
                    prod, fmap, split, ready)
                self._load_scales(bufs[r], cutlass.min(work.k_start + kk * ring + r + ring,
                                                       last), fmap, sa, my_rows, sb, nb0, nb1)
        rest = k_tiles - rounds * ring
        for r in cutlass.range_constexpr(ring - 1):
            if rest > r:
                tiled_mma, ab_state, ready = self._stage(
                    ab_pipe, ab_state, tiled_mma, tmp, tCrA, tCrB, num_k_blocks, acc, bufs[r],
                    prod, fmap, split, ready)
        return ab_state

    @cute.jit
    def _mainloop_staged(self, ab_pipe, ab_state, tiled_mma, acc, tmp, prod, tCrA, tCrB,
                         k_tiles: Int32, num_k_blocks: cutlass.Constexpr, work: WorkTile,
                         fmap: cutlass.Constexpr, split, staged, slots,
                         n_sc: cutlass.Constexpr):
        """The plain stage loop on staged scales (smem_scales without promote_lag): a stage's
        scales are read from shared memory once its WGMMAs are issued, the next stage's
        barrier is probed (peek_wait), then the stage's WGMMAs are waited for, its smem
        released and its partials promoted. Two accumulators where the lag holds three (the
        lagged loop's register pressure made ptxas re-read the thread index every stage).
        Slower than the lag all the same (H200: 16-23% on compute-bound shapes; under ncu 38%
        of the math warps' stall samples wait on their own WGMMAs), kept as the A/B switch
        MOE_GEMM_FP8_PROMOTE_LAG=0. The same FMAs in the same order as the lagged loop: bit
        for bit its output."""
        sc = cute.make_rmem_tensor((n_sc,), Float32)
        warpgroup.fence()
        ready = self._probe(ab_pipe, ab_state)
        for k in cutlass.range(0, k_tiles, 1, unroll=1):
            tiled_mma = self._issue_stage(ab_pipe, ab_state, tiled_mma, tmp, tCrA, tCrB,
                                          num_k_blocks, ready)
            self._read_staged(sc, staged, ab_state.index, slots, work.k_start + k, n_sc)
            ready = self._probe(ab_pipe, ab_state, ahead=True)
            warpgroup.wait_group(0)
            ab_pipe.consumer_release(ab_state)
            ab_state.advance()
            self._promote(acc, tmp, sc, prod, fmap, split)
        return ab_state

    @cute.jit
    def _stage(self, ab_pipe, ab_state, tiled_mma, tmp, tCrA, tCrB,
               num_k_blocks: cutlass.Constexpr, acc, sc, prod, fmap: cutlass.Constexpr, split,
               ready):
        """One stage of the plain loop: its WGMMAs into tmp (`ready`: the probe of its full
        barrier), the next stage's barrier probed, wait for the WGMMAs, release the stage's
        smem and promote tmp into acc with the scales sc. Returns tiled_mma, the advanced
        ab_state and the next stage's probe for the caller to rebind in its own loop or
        branch body (the tracer threads only values rebound there; see _issue_stage)."""
        tiled_mma = self._issue_stage(ab_pipe, ab_state, tiled_mma, tmp, tCrA, tCrB,
                                      num_k_blocks, ready)
        ready = self._probe(ab_pipe, ab_state, ahead=True)
        warpgroup.wait_group(0)
        ab_pipe.consumer_release(ab_state)
        ab_state.advance()
        self._promote(acc, tmp, sc, prod, fmap, split)
        return tiled_mma, ab_state, ready

    @cute.jit
    def _probe(self, ab_pipe, ab_state, ahead: cutlass.Constexpr = False):
        """peek_wait: whether the stage at ab_state (ahead: the one after it) is already full
        (kernels/sm90/stage_wait.py); else a constant False that _issue_stage ignores."""
        if const_expr(self.peek_wait):
            state = ab_state
            if const_expr(ahead):
                state = ab_state.clone()
                state.advance()
            return ab_pipe.consumer_try_wait(state)
        return cutlass.Boolean(False)

    @cute.jit
    def _mainloop_lagged(self, ab_pipe, ab_state, tiled_mma, acc, tmp0, tmp1, sc0, sc1, prod,
                         tCrA, tCrB, k_tiles: Int32, num_k_blocks: cutlass.Constexpr,
                         work: WorkTile, fmap: cutlass.Constexpr, sa, my_rows, sb, nb0, nb1,
                         split, staged, slots, n_sc: cutlass.Constexpr):
        """The stage loop with the promotion one stage behind the WGMMAs: stage k's WGMMAs
        are issued before stage k-1's partials are promoted, so the tensor cores work while
        this warpgroup promotes (in the plain loop both warpgroups of a cooperative tile wait
        for their WGMMAs, then promote, and the tensor cores idle meanwhile). Two temporary
        accumulators alternate (tmp0: even stages, tmp1: odd; the loop runs two stages per
        iteration so each has a static role), and a stage's smem is released once its WGMMAs
        retire, one stage later than in the plain loop. Costs a third accumulator
        (constants_fp8.fp8_tile_problem). The scales (sc0 / sc1 beside tmp0 / tmp1): staged
        (smem_scales), a stage's are read from shared memory right after its WGMMAs are
        issued (its smem is held until they retire); from global memory, each buffer's are
        loaded right after the promotion that used them, for the stage two later (loaded
        after their own stage's issue instead, the B scale's L2 latency was not covered)."""
        release_state = ab_state.clone()
        if k_tiles > 0:
            k0 = work.k_start
            last = k0 + k_tiles - 1  # later stages reload the last: branch-free
            self._lag_load(sc0, k0, None, fmap, sa, my_rows, sb, nb0, nb1)
            self._lag_load(sc1, k0 + 1, last, fmap, sa, my_rows, sb, nb0, nb1)
            # Stage 0 into tmp0; then pairs of stages with static roles (no branch inside the
            # loop, so that ptxas can see which WGMMA group each read waits for).
            # (peek_wait: each later issue's wait takes the probe made right after the issue
            # before it; the first waits in full)
            tiled_mma = self._issue_stage(ab_pipe, ab_state, tiled_mma, tmp0, tCrA, tCrB,
                                          num_k_blocks, cutlass.Boolean(False))
            self._lag_read(sc0, staged, ab_state.index, slots, k0, n_sc)
            ab_state.advance()
            ready = self._probe(ab_pipe, ab_state)
            for kk in cutlass.range(0, (k_tiles - 1) // 2, 1, unroll=1):
                k1 = 2 * kk + 1
                # Stage k1 into tmp1 while stage k1 - 1 (tmp0) is promoted.
                tiled_mma = self._issue_stage(ab_pipe, ab_state, tiled_mma, tmp1, tCrA,
                                              tCrB, num_k_blocks, ready)
                self._lag_read(sc1, staged, ab_state.index, slots, k0 + k1, n_sc)
                ab_state.advance()
                ready = self._probe(ab_pipe, ab_state)
                release_state = self._retire_and_promote(
                    ab_pipe, release_state, 1, acc, tmp0, sc0, prod, fmap, split)
                self._lag_load(sc0, k0 + k1 + 1, last, fmap, sa, my_rows, sb, nb0, nb1)
                # Stage k1 + 1 into tmp0 while stage k1 (tmp1) is promoted.
                tiled_mma = self._issue_stage(ab_pipe, ab_state, tiled_mma, tmp0, tCrA,
                                              tCrB, num_k_blocks, ready)
                self._lag_read(sc0, staged, ab_state.index, slots, k0 + k1 + 1, n_sc)
                ab_state.advance()
                ready = self._probe(ab_pipe, ab_state)
                release_state = self._retire_and_promote(
                    ab_pipe, release_state, 1, acc, tmp1, sc1, prod, fmap, split)
                self._lag_load(sc1, k0 + k1 + 2, last, fmap, sa, my_rows, sb, nb0, nb1)
            if k_tiles % 2 == 0:
                # The last stage into tmp1 while the one before (tmp0) is promoted.
                tiled_mma = self._issue_stage(ab_pipe, ab_state, tiled_mma, tmp1, tCrA,
                                              tCrB, num_k_blocks, ready)
                self._lag_read(sc1, staged, ab_state.index, slots, last, n_sc)
                ab_state.advance()
                release_state = self._retire_and_promote(
                    ab_pipe, release_state, 1, acc, tmp0, sc0, prod, fmap, split)
                release_state = self._retire_and_promote(
                    ab_pipe, release_state, 0, acc, tmp1, sc1, prod, fmap, split)
            else:
                release_state = self._retire_and_promote(
                    ab_pipe, release_state, 0, acc, tmp0, sc0, prod, fmap, split)
        return ab_state

    @cute.jit
    def _lag_load(self, buf: cute.Tensor, kb: Int32, last, fmap: cutlass.Constexpr,
                  sa, my_rows, sb, nb0, nb1):
        """The lagged loop's global scale load of k-block min(kb, last) (kb where last is
        None; scales not staged)."""
        if const_expr(self.scale_mode == "block" and not self.smem_scales):
            if const_expr(last is not None):
                kb = cutlass.min(kb, last)
            self._load_scales(buf, kb, fmap, sa, my_rows, sb, nb0, nb1)

    @cute.jit
    def _lag_read(self, buf: cute.Tensor, staged, stage: Int32, slots, k: Int32,
                  n_sc: cutlass.Constexpr):
        """The lagged loop's read of a stage's staged scales (smem_scales)."""
        if const_expr(self.smem_scales):
            self._read_staged(buf, staged, stage, slots, k, n_sc)

    @cute.jit
    def _retire_and_promote(self, ab_pipe, release_state, pending: cutlass.Constexpr, acc,
                            tmp, sc, prod, fmap: cutlass.Constexpr, split):
        """Wait until at most `pending` WGMMA groups are in flight (the older one, into tmp,
        has retired), release its stage's smem and promote tmp into acc."""
        warpgroup.wait_group(pending)
        ab_pipe.consumer_release(release_state)
        release_state.advance()
        self._promote(acc, tmp, sc, prod, fmap, split)
        return release_state

    @cute.jit
    def _load_scales(self, buf: cute.Tensor, kb: Int32, fmap: cutlass.Constexpr,
                     sa: cute.Tensor, my_rows, sb: cute.Tensor, nb0: Int32, nb1: Int32):
        """buf = k-block kb's scales: the thread's rows' A scales, then the B scale(s)."""
        n_rows = len(fmap.row_rep)
        for s in cutlass.range_constexpr(n_rows):
            buf[s] = sa[my_rows[s], kb]
        buf[n_rows] = sb[kb, nb0]
        if const_expr(self.blocks_spanned == 2):
            buf[n_rows + 1] = sb[kb, nb1]

    @cute.jit
    def _issue_stage(self, ab_pipe, ab_state, tiled_mma, tmp: cute.Tensor, tCrA, tCrB,
                     num_k_blocks: cutlass.Constexpr, ready):
        """Wait for a stage's A/B tiles (unless `ready`, its probe, saw them: peek_wait) and
        issue its WGMMAs into tmp (overwritten)."""
        if const_expr(self.peek_wait):
            wait_full_unless_ready(ab_pipe, ab_state, ready)
        else:
            ab_pipe.consumer_wait(ab_state)
        # The promotion read tmp: order those reads before the WGMMAs rewrite it.
        warpgroup.fence()
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        for kb_i in cutlass.range_constexpr(num_k_blocks):
            coord = (None, None, kb_i, ab_state.index)
            cute.gemm(tiled_mma, tmp, tCrA[coord], tCrB[coord], tmp)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        # Returned for the caller to rebind: the accumulate flag is a staged value, and a
        # TiledMma carried across loops and branches must be rebound there to be threaded.
        return tiled_mma

    @cute.jit
    def _promote(self, acc: cute.Tensor, tmp: cute.Tensor, sc: cute.Tensor, prod: cute.Tensor,
                 fmap: cutlass.Constexpr, split: Int32):
        """acc += tmp scaled by the stage's scales sc ("block"), or acc += tmp ("outer")."""
        n_rows = len(fmap.row_rep)
        if const_expr(self.scale_mode == "block"):
            two = self.blocks_spanned == 2
            for s in cutlass.range_constexpr(n_rows):
                prod[s] = sc[s] * sc[n_rows]
                if const_expr(two):
                    prod[n_rows + s] = sc[s] * sc[n_rows + 1]
            for i in cutlass.range_constexpr(cute.size(acc)):
                scale = prod[fmap.row_slot[i]]
                if const_expr(two):
                    scale = Float32(cutlass.select_(Int32(fmap.col8[i]) >= split,
                                                    prod[n_rows + fmap.row_slot[i]], scale))
                acc[i] = cute.math.fma(tmp[i], scale, acc[i])
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] + tmp[i]

    @cute.jit
    def _outer_col(self, fmap: cutlass.Constexpr, coords: cute.Tensor, q: cutlass.Constexpr,
                   n0: Int32, cols_lim: Int32) -> Int32:
        """The column of sb this thread's q-th accumulator column reads (clamped: columns past
        the problem's end read a valid scale that nothing stores)."""
        return cutlass.min(n0 + coords[fmap.col_rep[q]][1], cols_lim - 1)

    @cute.jit
    def _scale_outer(self, acc: cute.Tensor, fmap: cutlass.Constexpr, coords: cute.Tensor,
                     sa: cute.Tensor, my_rows, sb: cute.Tensor, n0: Int32, cols_lim: Int32):
        """acc[row, col] *= sa[row] * sb[col], once per tile (row-wise / per-tensor)."""
        n_rows = len(fmap.row_rep)
        n_cols = len(fmap.col_rep)
        ra = cute.make_rmem_tensor((n_rows,), Float32)
        cb = cute.make_rmem_tensor((n_cols,), Float32)
        for s in cutlass.range_constexpr(n_rows):
            ra[s] = sa[my_rows[s], 0]
        for q in cutlass.range_constexpr(n_cols):
            cb[q] = sb[0, self._outer_col(fmap, coords, q, n0, cols_lim)]
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] * (ra[fmap.row_slot[i]] * cb[fmap.col_slot[i]])
