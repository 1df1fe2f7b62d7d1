"""The epilogue: fp32 accumulators -> (hooks) -> output dtype -> shared memory -> TMA store.

A tile is stored in subtiles of `epi_tile` (cooperative: 128 rows x epi_n, both math warp-
groups; ping-pong: 64 rows x epi_n, one warpgroup). Per subtile every math thread copies its
fragment of the accumulators, applies the hooks, converts, writes shared memory through
stmatrix (16-bit output) or st.shared (fp32), and one warp issues the subtile's TMA store once
the group has synchronized.

The accumulator fragment of subtile e is the flat slice [e * size, (e + 1) * size) of the
retiled accumulators, with e = m_sub * (tile_n / epi_n) + n_sub: the WGMMA accumulator
layout is (values of one tiled-MMA row block, M repeat, N repeat) and the epilogue subtile is
exactly one tiled-MMA row block high (64 rows per warpgroup, 128 for the pair), so subtiles go
along N inside an M repeat, then to the next repeat (two repeats for 128-row ping-pong and
256-row cooperative tiles). tests/kernels/test_tile_layouts.py proves this thread by thread
for every tile against the MMA's own partition, on the CPU.

Hooks (identity here, compiled away unless a subclass turns them on): `activation` sees one
subtile's fp32 values, `row_scale` the same with each value's row in the problem (the MoE
layer's routing weights are per row). A subclass may also replace `load_subtile` whole, which
gets the launch's problem accessor (the fused MoE epilogue, fused_epilogue.py, reads its bias
and row weights through it), and `acc_views` / `copy_mma` (a gated epilogue stores a tile of
d_tile_n = tile_n / 2 columns from pairs of accumulator columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from .constants import DESC_BYTES, SLOT_BYTES
from .tile_scheduler import WorkTile

BAR_EPI = 2  # + epilogue group (ping-pong: the warpgroup): that group's epilogue threads


@dataclass(frozen=True, eq=False)
class EpilogueFrags:
    """One math thread's epilogue partitions (made once per kernel, reused for every tile).
    Frozen: read-only inside the DSL's dynamic loops (see problems.Problems)."""

    tiled_copy_r2s: cute.TiledCopy
    thr_copy_r2s: object
    tRS_sD: cute.Tensor  # (R2S, R2S_M, R2S_N, buffer): this thread's staging targets
    tRS_rAcc: cute.Tensor  # the accumulators retiled for the copy (flat subtile slices)
    tRS_rD: cute.Tensor  # one subtile's fp32 values
    tRS_rD_out: cute.Tensor  # the same converted to the output dtype
    size_rD: int
    store_pipe: object
    tRS_rExtra: tuple = ()  # further accumulator views (a gated epilogue's up columns)


@dataclass(frozen=True, eq=False)
class Epilogue:
    """Static configuration from the kernel (`cfg`): tile, epi_tile, staging, dtypes."""

    cfg: object

    has_activation: ClassVar[bool] = False
    has_row_scale: ClassVar[bool] = False

    # -- hooks ---------------------------------------------------------------------------------

    @cute.jit
    def activation(self, values: cute.Tensor):
        """Elementwise on one subtile's fp32 values (in place). Identity."""

    @cute.jit
    def row_scale(self, values: cute.Tensor, rows: cute.Tensor, work: WorkTile):
        """Scale each value by a factor of its row (rows[i][0]: the problem's row of values[i];
        the varlen form's row in x is work.row_start + that). Identity."""

    # -- partitions ----------------------------------------------------------------------------

    def tiled_copy(self, tiled_mma: cute.TiledMma) -> cute.TiledCopy:
        """Registers -> shared memory: stmatrix (four 8x8 matrices per warp) for 16-bit output,
        laid out as the MMA's C fragment."""
        cfg = self.cfg
        copy_atom_c = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(cfg.d_layout.is_m_major_c(), 4),
            cutlass.Float16,  # only fixes the thread-value layout of the source fragment
        )
        tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
        copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(
            cfg.d_layout, elem_ty_d=cfg.d_dtype, elem_ty_acc=cfg.acc_dtype
        )
        return cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)

    def copy_mma(self, tiled_mma: cute.TiledMma) -> cute.TiledMma:
        """The MMA whose C fragment the epilogue copy follows: the kernel's own."""
        return tiled_mma

    def acc_views(self, acc: cute.Tensor) -> tuple:
        """The accumulator tensors the epilogue reads, each shaped like copy_mma's C
        fragment: the accumulators themselves."""
        return (acc,)

    def partition(self, tiled_mma: cute.TiledMma, sD: cute.Tensor, acc: cute.Tensor,
                  mma_tidx, epi_threads: int) -> EpilogueFrags:
        cfg = self.cfg
        tiled_copy_r2s = self.tiled_copy(self.copy_mma(tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
        tRS_sD = thr_copy_r2s.partition_D(sD)
        views = self.acc_views(acc)
        tRS_rAcc = tiled_copy_r2s.retile(views[0])
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))
        tRS_rD = cute.make_rmem_tensor(rD_shape[:3], cfg.acc_dtype)
        tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], cfg.d_dtype)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=cfg.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, epi_threads),
        )
        extra = tuple(tiled_copy_r2s.retile(v) for v in views[1:])
        return EpilogueFrags(tiled_copy_r2s, thr_copy_r2s, tRS_sD, tRS_rAcc, tRS_rD, tRS_rD_out,
                             cute.size(tRS_rD), store_pipe, extra)

    def subtile_layout(self):
        """e -> (m_sub, n_sub): subtiles along N first, then the next M block."""
        cfg = self.cfg
        shape = (cfg.tile_m // cfg.epi_tile[0], cfg.d_tile_n // cfg.epi_tile[1])
        return cute.make_layout(shape, stride=(shape[1], 1))

    def subtile_coords(self, thr_copy_r2s, e: int) -> cute.Tensor:
        """The (row, col) in the tile of each value of subtile e's fragment (tRS_rD's order),
        for the thread whose slice of the epilogue copy `thr_copy_r2s` is."""
        cfg = self.cfg
        m_sub, n_sub = self.subtile_layout().get_hier_coord(e)
        tile = cute.make_identity_tensor((cfg.tile_m, cfg.d_tile_n))
        sub = cute.local_tile(tile, cfg.epi_tile, (m_sub, n_sub))
        return thr_copy_r2s.partition_S(sub)

    # -- per tile ------------------------------------------------------------------------------

    @cute.jit
    def load_subtile(self, frags: EpilogueFrags, e: cutlass.Constexpr, work: WorkTile,
                     problems):
        """Subtile e's fp32 values into tRS_rD, hooks applied."""
        for v in cutlass.range_constexpr(frags.size_rD):
            frags.tRS_rD[v] = frags.tRS_rAcc[e * frags.size_rD + v]
        if const_expr(self.has_row_scale):
            self.row_scale(frags.tRS_rD, self.subtile_coords(frags.thr_copy_r2s, e), work)
        if const_expr(self.has_activation):
            self.activation(frags.tRS_rD)
        frags.tRS_rD_out.store(frags.tRS_rD.load().to(self.cfg.d_dtype))

    @cute.jit
    def store(self, frags: EpilogueFrags, sD: cute.Tensor, tma_atom_d: cute.CopyAtom,
              tma_d: cute.Tensor, problems, work: WorkTile, ring: Int64, epi_group: Int32,
              epi_bar_id: Int32, epi_threads: cutlass.Constexpr,
              is_store_warp: cutlass.Boolean, tiles_done: Int32):
        """The tile of `work` from the accumulators to global memory."""
        cfg = self.cfg
        gD = problems.store_view(tma_d, work)
        gD_epi = cute.zipped_divide(gD, cfg.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(
            tma_atom_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_epi
        )
        epi_count = cute.size(gD_epi, mode=[1])
        epi_layout = self.subtile_layout()
        # This record's slot of the CTA's ring (written by the scheduler warp).
        desc_d = ring + Int64(cute.arch.make_warp_uniform(work.ring_slot)) * SLOT_BYTES + (
            2 * DESC_BYTES)
        problems.acquire_store_desc(desc_d, is_store_warp)
        if const_expr(cfg.epi_whole):
            self._store_whole(frags, tma_atom_d, bSG_sD, bSG_gD, epi_layout, epi_count, problems,
                              desc_d, work, epi_bar_id, epi_threads, is_store_warp)
        else:
            for e in cutlass.range_constexpr(epi_count):
                self.load_subtile(frags, e, work, problems)
                buf = epi_group * cfg.epi_stages + (tiles_done * epi_count + e) % cfg.epi_stages
                cute.copy(frags.tiled_copy_r2s, frags.tRS_rD_out,
                          frags.tRS_sD[(None, None, None, buf)])
                # stmatrix writes go through the generic proxy; the TMA store reads through the
                # async proxy.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
                if is_store_warp:
                    cute.copy(
                        tma_atom_d, bSG_sD[(None, buf)],
                        bSG_gD[(None, epi_layout.get_hier_coord(e))],
                        tma_desc_ptr=problems.store_desc(desc_d),
                    )
                    frags.store_pipe.producer_commit()
                    frags.store_pipe.producer_acquire()
                cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)

    @cute.jit
    def _store_whole(self, frags: EpilogueFrags, tma_atom_d, bSG_sD, bSG_gD, epi_layout,
                     epi_count: cutlass.Constexpr, problems, desc_d: Int64, work: WorkTile,
                     epi_bar_id: Int32, epi_threads: cutlass.Constexpr,
                     is_store_warp: cutlass.Boolean):
        """Whole-tile epilogue: every subtile staged between two barriers, then one warp issues
        all the tile's TMA stores (2 named-barrier syncs per tile instead of 2 per subtile)."""
        if is_store_warp:
            # The previous tile's stores have read their buffers (issued a mainloop ago).
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
        for e in cutlass.range_constexpr(epi_count):
            self.load_subtile(frags, e, work, problems)
            cute.copy(frags.tiled_copy_r2s, frags.tRS_rD_out, frags.tRS_sD[(None, None, None, e)])
        # stmatrix writes go through the generic proxy; the TMA store reads through the async
        # proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
        if is_store_warp:
            for e in cutlass.range_constexpr(epi_count):
                cute.copy(tma_atom_d, bSG_sD[(None, e)],
                          bSG_gD[(None, epi_layout.get_hier_coord(e))],
                          tma_desc_ptr=problems.store_desc(desc_d))
            cute.arch.cp_async_bulk_commit_group()
