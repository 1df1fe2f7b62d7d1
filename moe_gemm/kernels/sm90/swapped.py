"""Swapped tiles for few large experts: the routed rows on the WGMMA's N side.

The plain kernel puts an expert's rows on the WGMMA's M side, which comes in m64 blocks: an
expert of 137 rows fills 256 rows of tiles (25% of the multiply-adds on padding over the
zoo's prefill routings; benchmarks/mma_waste.py). Computing D^T = W^T x^T instead puts the
weight columns on M (128 per tile, one m64 block per math warpgroup) and the rows on N, which
WGMMA takes in steps of 8 up to 256: each expert's rows are split evenly over
ceil(rows / 256) tiles in 16-row units (137 -> one tile of 144; 257 -> 144 + 128), so an
expert computes fewer than 16 padding rows and the tiles that share its weight panels stay
within 16 rows of each other (a tile that finishes early and moves on makes the panel be read
from DRAM again: docs/measurements.md, the skipped row blocks). cuBLAS runs these experts the
same way (its nvjet 128 x {144..248} kernels, one per expert's row count).

The kernel is GroupedGemmSm90's cooperative varlen form with 256-row x 128-column tiles in
the problem's terms, so the scheduler, the raster, the grid and the tile counts are the plain
kernel's; the load warp loads A (x, the tile's rows) in 64/32/16-row boxes from the tile's
first row and B (the weights) as ever. What changes:

- the math warpgroups' WGMMA takes the B stage (weights) as its A operand (M = 128 weight
  columns, K- or MN-major) and the first 16u rows of the A stage (x) as its B operand (N =
  16u, K-major): one compile-time variant per u = 1..16, chosen per tile before its k-loop,
  each with an accumulator of its own; one set of smem descriptors and one epilogue
  partition serve them all (a smaller N's C fragment is a prefix of the N = 256 one: the
  WGMMA orders its values by n8 block last; tests/kernels/test_swapped.py);
- the epilogue stores the accumulator tile transposed (M-major: stmatrix .trans) through a
  transposed ragged view of out, in 128 x 16 subtiles, only those with live rows, the last
  clipped at the expert's end like the plain kernel's stores.

In a 1x2 cluster the pair takes two adjacent weight-column tiles of one expert and the same
rows: the load warps multicast each stage's rows of x to both CTAs, as the plain kernel's 1x2
pair does (a tile loads 256 rows and 128 weight columns a k-step: a CTA then fetches 128 +
256 / 2 units instead of 384, a third less L2 -> SM traffic). A pair whose second tile lies
past the expert's last weight column (an odd column-tile count) computes that tile for the
multicast and stores nothing.

Constraints beyond the plain kernel's: varlen form, cooperative, device visitor, 1x1 or 1x2
cluster, 16-bit output, no tail split. The fused MoE options (a concat-layout gate, bias,
row weights; no gather-A) are swapped_fused.py's subclass.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .constants import SCHED_STAGES, SWAP_ROW_UNIT, SWAP_TILE_COLS, SWAP_TILE_ROWS
from .epilogue import BAR_EPI, Epilogue, EpilogueFrags
from .grouped_gemm import GroupedGemmSm90
from .problems import VarlenProblems
from .tile_scheduler import WorkTile, consume_work

SWAP_VARIANTS = SWAP_TILE_ROWS // SWAP_ROW_UNIT  # N = 16, 32, ..., 256


@cute.jit
def even_row_span(m_tile: Int32, rows: Int32) -> tuple[Int32, Int32]:
    """(first row, units) of tile m_tile of an expert of `rows` rows: the expert's
    ceil(rows / 16) units of 16 rows split as evenly as they go over its ceil(rows / 256)
    tiles, the larger shares first (mirrors schedule.even_row_span)."""
    unit = SWAP_ROW_UNIT
    units = (rows + unit - 1) // unit
    tiles = cutlass.max((rows + SWAP_TILE_ROWS - 1) // SWAP_TILE_ROWS, Int32(1))
    share = units // tiles
    extra = units - share * tiles
    mine = share
    if m_tile < extra:
        mine = share + 1
    first = m_tile * share + cutlass.min(m_tile, extra)
    return first * unit, mine


def transposed_ragged_rows(mD: cute.Tensor) -> cute.Tensor:
    """out (T, N) seen as an (N, T, T) tensor: problems.ragged_rows with its first two modes
    exchanged, so the epilogue's M-major subtiles (weight columns contiguous) store through one
    descriptor, clipped at each expert's last row (element (n, T - rows + r, start + rows - 1)
    is out[start + r, n])."""
    rows, ld = mD.shape[0], mD.stride[0]
    base = mD.iterator + (-(Int64(rows - 1) * ld))
    return cute.make_tensor(
        base, cute.make_layout((mD.shape[1], rows, rows), stride=(mD.stride[1], ld, ld)))


@dataclass(frozen=True, eq=False)
class SwappedVarlenProblems(VarlenProblems):
    """The varlen form with the even row split: a tile's rows start at its span's first row,
    and its output tile is (weight columns, rows) in the transposed ragged view."""

    @cute.jit
    def store_view(self, tma_d: cute.Tensor, work: WorkTile) -> cute.Tensor:
        first, _ = even_row_span(work.m_tile, work.rows)
        last = work.row_start + work.rows - 1
        expert = cute.domain_offset((0, self.mD.shape[0] - work.rows + first),
                                    tma_d[None, None, last])
        # (d_tile_n: the stored columns of a tile, 128; 64 for a gated one)
        return cute.local_tile(expert, (self.cfg.d_tile_n, SWAP_TILE_ROWS), (work.n_tile, 0))


@dataclass(frozen=True, eq=False)
class SwappedEpilogue(Epilogue):
    """Stores one variant's transposed accumulator tile (128 weight columns x 16u rows) in u
    M-major 128 x 16 subtiles along the rows."""

    @cute.jit
    def store_rows(self, frags: EpilogueFrags, acc: cute.Tensor, subtiles: cutlass.Constexpr,
                   sD: cute.Tensor,
                   tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor, problems, work: WorkTile,
                   epi_bar_id: Int32, epi_threads: cutlass.Constexpr,
                   is_store_warp: cutlass.Boolean, scratch: cute.Tensor | None = None):
        """Subtiles 0..subtiles-1 of the tile from `acc` (scratch: swapped_fused.py's)."""
        cfg = self.cfg
        gD = problems.store_view(tma_d, work)
        gD_epi = cute.zipped_divide(gD, cfg.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(
            tma_atom_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_epi
        )
        # (issued before the barrier: their latency overlaps the wait)
        inputs = self.tile_inputs(frags, problems, work, subtiles)
        # The subtiles go out in chunks of one staging buffer each (8 of 4 KiB): the chunk's
        # stmatrix writes, one fence and barrier, then its TMA stores in one bulk group, which
        # the next chunk (or tile) waits to have read the staging. Two named-barrier syncs a
        # chunk, 2 or 4 a tile, where a barrier before and after each subtile's store made
        # 2u + 1 (33 for 256 rows), all of them time the math warpgroups spend away from the
        # tensor pipe (the cooperative tile does not overlap its epilogue with a mainloop).
        for c in cutlass.range_constexpr(-(-subtiles // cfg.epi_stages)):
            first = c * cfg.epi_stages
            count = min(cfg.epi_stages, subtiles - first)
            # The staging is free once the stores issued before it (the previous chunk's, or
            # the previous tile's, a whole mainloop ago) have read it.
            if is_store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
            for i in cutlass.range_constexpr(count):
                # Subtile e of the tile is the accumulator's values [e * 8, e * 8 + 8) (the
                # WGMMA C fragment orders them by n8 block last; tests/kernels/test_swapped.py).
                self.subtile_values(frags, acc, first + i, problems, work, inputs)
                cute.copy(frags.tiled_copy_r2s, frags.tRS_rD_out,
                          frags.tRS_sD[(None, None, None, i)])
            # stmatrix writes go through the generic proxy; the TMA stores read through the
            # async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
            if is_store_warp:
                for i in cutlass.range_constexpr(count):
                    cute.copy(tma_atom_d, bSG_sD[(None, i)], bSG_gD[(None, (0, first + i))])
                frags.store_pipe.producer_commit()

    def tile_inputs(self, frags: EpilogueFrags, problems, work: WorkTile,
                    subtiles: cutlass.Constexpr):
        """What the tile's subtiles read besides the accumulators, loaded once per tile (a
        fused subclass's biases and row weights; none here)."""
        return None

    @cute.jit
    def subtile_values(self, frags: EpilogueFrags, acc: cute.Tensor, e: cutlass.Constexpr,
                       problems, work: WorkTile, inputs=None):
        """Subtile e's values, converted, into frags.tRS_rD_out (a fused subclass adds its
        bias and row weights from `inputs`, tile_inputs')."""
        for v in cutlass.range_constexpr(frags.size_rD):
            frags.tRS_rD[v] = acc[e * frags.size_rD + v]
        frags.tRS_rD_out.store(frags.tRS_rD.load().to(self.cfg.d_dtype))


class SwappedGemmSm90(GroupedGemmSm90):
    """GroupedGemmSm90's varlen form with the rows on the WGMMA's N side (module docstring).

    Args: as GroupedGemmSm90's, less those fixed here (form varlen, cooperative, tile 256 rows
    x 128 columns, device visitor, trimmed A loads, 16-row epilogue subtiles); cluster_n 1 or
    2 (a 1x2 cluster multicasts the rows of x to two adjacent weight-column tiles).
    """

    def __init__(self, ab_dtype, d_dtype, b_major, ab_stages: int | None = None,
                 trace: bool = False, l2_hints: bool = False, peek_wait: bool = False,
                 cluster_n: int = 1, **fused):
        """fused: the fused MoE options swapped_fused.SwappedFusedMoeGemmSm90 builds."""
        if d_dtype.width != 16:
            raise ValueError("swapped tiles store 16-bit output (bf16 or fp16)")
        if cluster_n not in (1, 2):
            raise ValueError(f"swapped tiles run in a 1x1 or 1x2 cluster; got 1x{cluster_n}")
        super().__init__(ab_dtype, d_dtype, b_major, "varlen", "cooperative", "device",
                         (SWAP_TILE_ROWS, SWAP_TILE_COLS), ab_stages=ab_stages, trace=trace,
                         l2_hints=l2_hints, epi_n=SWAP_ROW_UNIT, trim_a=True,
                         peek_wait=peek_wait, cluster_n=cluster_n, **fused)
        # The epilogue's subtile is (128 weight columns, 16 rows): the plain kernel's
        # cooperative staging for 16-wide subtiles has that size (8 buffers of 4 KiB).
        assert self.epi_tile == (SWAP_TILE_COLS, SWAP_ROW_UNIT), self.epi_tile

    def make_epilogue(self) -> Epilogue:
        return SwappedEpilogue(self)

    def make_problems(self, args):
        return SwappedVarlenProblems(self, args.num_problems, args.mA, args.mD, args.offs)

    def store_tensor(self, mD: cute.Tensor) -> cute.Tensor:
        return transposed_ragged_rows(mD)

    def tile_row_span(self, work: WorkTile):
        first, units = even_row_span(work.m_tile, work.rows)
        live = cutlass.max(cutlass.min(units * SWAP_ROW_UNIT, work.rows - first), Int32(0))
        return first, live

    def _setup(self) -> None:
        super()._setup()
        # D^T: the weight columns (the WGMMA's M) are out's contiguous dimension.
        self.d_layout = LayoutEnum.COL_MAJOR
        self.tiled_mma = self.swapped_mma(SWAP_TILE_ROWS)
        self.epi_mma = self.tiled_mma
        d_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.d_layout, self.d_dtype, self.epi_tile[0]),
            self.d_dtype,
        )
        self.d_smem_staged = cute.tile_to_shape(
            d_atom, (*self.epi_tile, self.epi_stages), order=(1, 0, 2))

    def swapped_mma(self, rows: int) -> cute.TiledMma:
        """WGMMA m64 x `rows` per warpgroup, the two warpgroups stacked along the weight
        columns: A = the weights (K- or MN-major), B = the rows of x (K-major)."""
        w_major = OperandMajorMode.K if self.b_major == "k" else OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, w_major, OperandMajorMode.K, self.acc_dtype,
            (2, 1, 1), tiler_mn=(64, rows))

    @cute.jit
    def math_role(self, ab_pipe, sched_pipe, sched, tiled_mma, sA, sB, sD, tma, problems, run,
                  tidx, warp_idx, math_wg, staged, scratch=None):
        """Per tile: the variant of its rows (N = 16u) runs the plain mainloop into an
        accumulator of its own and stores u subtiles. (Each variant owns its accumulator: one
        register tensor shared by variants of different N made ptxas serialize the WGMMAs.)"""
        mma_tidx = tidx - self.threads_per_wg
        epi_threads = 2 * self.threads_per_wg
        is_store_warp = warp_idx == 4
        epi_bar_id = BAR_EPI
        # Operand slices by the warpgroup's first thread (uniform registers; grouped_gemm.py).
        wg_first = cute.arch.make_warp_uniform(mma_tidx // self.threads_per_wg)
        thr_w = tiled_mma.get_slice(wg_first * self.threads_per_wg)
        tCrW = tiled_mma.make_fragment_A(thr_w.partition_A(sB))
        num_k_blocks = cute.size(tCrW, mode=[2])
        # One descriptor per k-block and stage serves every variant: a WGMMA's smem descriptor
        # holds the stage's address, strides and swizzle; N is the instruction's.
        tCrX = tiled_mma.make_fragment_B(thr_w.partition_B(sA))
        # Likewise the epilogue's staging partition (the subtiles are 128 x 16 in every
        # variant); each variant's accumulator is read by its flat index (store_rows).
        frags = self.epi.partition(tiled_mma, sD, cute.make_rmem_tensor(
            tiled_mma.get_slice(mma_tidx).partition_C(
                cute.make_identity_tensor((SWAP_TILE_COLS, SWAP_TILE_ROWS))).shape,
            self.acc_dtype), mma_tidx, epi_threads)
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                  SCHED_STAGES)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                self.ab_stages)
        cta, _, _ = cute.arch.block_idx()
        seen = Int32(0)
        work, read_state = consume_work(sched_pipe, sched, read_state)
        while work.has_work():
            _, units = even_row_span(work.m_tile, work.rows)
            for u in cutlass.range_constexpr(1, SWAP_VARIANTS + 1):
                if units == u:
                    n = u * SWAP_ROW_UNIT
                    mma = self.swapped_mma(n)
                    acc = cute.make_rmem_tensor(
                        mma.get_slice(mma_tidx).partition_C(
                            cute.make_identity_tensor((SWAP_TILE_COLS, n))).shape,
                        self.acc_dtype)
                    # Defined afresh each tile: the WGMMAs read their accumulators (in-out
                    # registers), so without this every variant's values stay live around the
                    # tile loop (16 accumulators, 1088 registers: spilled).
                    acc.fill(0.0)
                    ab_state = self.mainloop(ab_pipe, ab_state, mma, acc, tCrW, tCrX,
                                             work.k_tiles, num_k_blocks, math_wg, work,
                                             problems, staged)
                    # (a 1x2 pair's tile past the expert's last weight column computed for
                    # the multicast: nothing to store; uniform over the tile's threads)
                    if work.stores():
                        self.epi.store_rows(frags, acc, u, sD, tma.atom_d, tma.tma_d, problems,
                                            work, epi_bar_id, epi_threads, is_store_warp,
                                            scratch)
            if const_expr(self.trace):
                # (a tile that stores nothing leaves its slot at -1, as in the plain kernel)
                if mma_tidx == 0 and work.stores():
                    trace = run.trace
                    slot = cutlass.min(seen, trace.shape[1] - 1)
                    trace[cta, slot, 0] = work.problem
                    trace[cta, slot, 1] = work.m_tile
                    trace[cta, slot, 2] = work.n_tile
                    trace[cta, slot, 3] = math_wg
            seen = seen + 1
            work, read_state = consume_work(sched_pipe, sched, read_state)
        if is_store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
