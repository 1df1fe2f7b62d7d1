"""Swapped tiles with the fused MoE options: the gate-up GEMM's gated epilogue and the down
GEMM's bias and routing weights on swapped.SwappedGemmSm90 (each expert as out^T = w^T x^T,
128 weight columns on the WGMMA's M side, up to 256 routed rows on its N side), for the
experts of 192-320 routed rows where the plain fused kernel pads an expert to two 128-row
tiles (swap_rules' window; grouped_mm's unfused GEMMs run swapped tiles there).

- gate (the "concat" layout only): the load warp fetches B's tile as the plain fused kernel
  does, as two boxes of half its rows: rows [0, 64) of the stage are 64 gate columns and rows
  [64, 128) the matching up columns. So math warpgroup 0 (M rows 0-63) accumulates the gate
  values and warpgroup 1 the up values of the same 64 output columns, thread t of one at
  exactly the (column, row) of thread t of the other (two m64 atoms stacked along M). Per
  16-row subtile, warpgroup 1 writes its 8 fp32 values a thread to shared memory
  (thread-major, conflict-free: 4 KiB, two buffers), one named barrier over both
  warpgroups, then warpgroup 0 computes act(gate + b) * (up + b) (times the row's weight),
  stages the 64 x 16 output subtile by stmatrix (transposed: out's columns are contiguous)
  and stores it by TMA, clipped at the expert's last row and at I. The interleaved and
  alternating layouts pair columns inside a warpgroup's m64 block along M, where a thread
  holds rows r and r + 8 only: not built (the plain fused kernel runs them).
- bias and row weights without a gate (the down GEMM): each accumulator value plus the bias
  of its weight column, times the weight of its routed row, in the swapped epilogue's
  subtile loop (both warpgroups, the 128 x 16 subtiles of swapped.py).
- Both load a tile's biases and row weights once, before its subtiles (`tile_inputs`): a
  thread's bias columns are the same in every subtile, and the tile's up to 256 row weights
  are spread over the warp's lanes (8 loads a lane), each value taking its row's weight from
  the lane that holds it by one shuffle. Per value they were 548 global loads in the PTX of
  the row-weighted kernel (all 16 row-count variants), 76 now.

The exchange buffers take the place of half of the swapped kernel's staging (8 x 4 KiB there;
here 8 x 2 KiB of 64 x 16 output subtiles plus 2 x 4 KiB), so the A/B stages are those of the
plain swapped kernel. tests/kernels/test_swapped_fused.py proves the pairing and the output
partition thread by thread on the CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync

from .constants import SWAP_ROW_UNIT, SWAP_TILE_COLS, SWAP_TILE_ROWS
from .epilogue import EpilogueFrags
from .fused_epilogue import _bias_at, _row_weight_at, gate_value, static_offsets
from .fused_moe import FusedMoeGemmSm90
from .problems import FusedVarlenProblems
from .swapped import SwappedEpilogue, SwappedGemmSm90, SwappedVarlenProblems, even_row_span
from .tile_scheduler import WorkTile

BAR_GATED_STORE = 7  # named barrier: math warpgroup 0 around a gated subtile's TMA store
EXCHANGE_BUFFERS = 2
GATED_COLS = SWAP_TILE_COLS // 2  # output columns of a gated tile
SUBTILE_VALUES = SWAP_TILE_COLS * SWAP_ROW_UNIT // 256  # a math thread's values per subtile
WARP_LANES = 32


def row_slots(subtiles: int) -> int:
    """Row weights a lane holds for a tile of `subtiles` 16-row subtiles: lane l holds the
    weights of the tile's rows l, l + 32, ... (one load each, once per tile)."""
    return -(-subtiles * SWAP_ROW_UNIT // WARP_LANES)


def row_lane_split(row, row_offset: int) -> tuple:
    """(lane, slot) holding the weight of a value's tile row `row` (its coordinate; row_offset:
    the static part of it, its offset from the thread's first row). The WGMMA C fragment puts
    a thread's first row at 2 (lane % 4) and its other rows 8c + {0, 1} further, so a row's
    32-row block (the slot) is its static offset's: tests/kernels/test_swapped_fused.py
    checks it for every thread."""
    return row % WARP_LANES, row_offset // WARP_LANES


@cute.jit
def row_weight_of(lane_weights: list, row, row_offset: cutlass.Constexpr):
    """The weight of tile row `row` from the lane that loaded it (tile_inputs), by one
    shuffle: every lane of the warp runs it."""
    lane, slot = row_lane_split(row, row_offset)
    return cute.arch.shuffle_sync(lane_weights[slot], lane)


@dataclass(frozen=True, eq=False)
class SwappedFusedVarlenProblems(SwappedVarlenProblems, FusedVarlenProblems):
    """The swapped tiles' row split and store view with the fused kernel's tensors."""


@dataclass(frozen=True, eq=False)
class SwappedFusedEpilogue(SwappedEpilogue):
    """The swapped epilogue with the fused options of the kernel object `cfg`."""

    def gated_copy_mma(self) -> cute.TiledMma:
        """One warpgroup's m64 x 16 MMA: the gated output subtile (64 columns x 16 rows) is
        its C fragment, held by warpgroup 0 (built inside the kernel, as every MMA the
        epilogue's copy follows)."""
        cfg = self.cfg
        w_major = OperandMajorMode.K if cfg.b_major == "k" else OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(
            cfg.ab_dtype, cfg.ab_dtype, w_major, OperandMajorMode.K, cfg.acc_dtype, (1, 1, 1),
            tiler_mn=(GATED_COLS, SWAP_ROW_UNIT))

    def partition(self, tiled_mma: cute.TiledMma, sD: cute.Tensor, acc: cute.Tensor,
                  mma_tidx, epi_threads: int) -> EpilogueFrags:
        cfg = self.cfg
        # Each accumulator value's (weight column, row) in the tile (the N = 256 variant's;
        # a smaller one's fragment is its prefix): the bias column and the routed row.
        coords = tiled_mma.get_slice(mma_tidx).partition_C(
            cute.make_identity_tensor((SWAP_TILE_COLS, SWAP_TILE_ROWS)))
        if const_expr(cfg.gate is None):
            frags = super().partition(tiled_mma, sD, acc, mma_tidx, epi_threads)
            return dataclasses.replace(frags, tRS_rExtra=(coords,))
        tiled_copy_r2s = self.tiled_copy(self.gated_copy_mma())
        thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx % cfg.threads_per_wg)
        tRS_sD = thr_copy_r2s.partition_D(sD)
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))
        tRS_rD = cute.make_rmem_tensor(rD_shape[:3], cfg.acc_dtype)
        tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], cfg.d_dtype)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=cfg.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, cfg.threads_per_wg),
        )
        return EpilogueFrags(tiled_copy_r2s, thr_copy_r2s, tRS_sD, tRS_rD, tRS_rD, tRS_rD_out,
                             cute.size(tRS_rD), store_pipe, (coords,))

    @cute.jit
    def tile_inputs(self, frags: EpilogueFrags, problems, work: WorkTile,
                    subtiles: cutlass.Constexpr):
        """The tile's biases and row weights, loaded once before its subtiles (per subtile
        they were 2-4 bias and 4 row-weight loads a thread, 16 times a tile): (biases by
        their static column offset, each a (gate or plain, up) pair; the row weights this
        lane holds, `row_weight_of`)."""
        cfg = self.cfg
        coords = frags.tRS_rExtra[0]
        offsets = static_offsets(coords)
        num_experts = problems.num_experts()
        live = work.problem < num_experts  # (not the zero tail)
        expert = cutlass.min(work.problem, num_experts - 1)
        biases = {}
        if const_expr(cfg.has_bias):
            bias_cols = problems.bias.shape[1]
            gated = cfg.gate is not None
            col0 = work.n_tile * (GATED_COLS if gated else SWAP_TILE_COLS)
            out_cols = problems.mD.shape[1]
            # A thread's columns are those of its first subtile's values, in every subtile.
            for v in cutlass.range_constexpr(SUBTILE_VALUES):
                if const_expr(offsets[v][0] not in biases):
                    col = col0 + coords[v][0]
                    if const_expr(gated):
                        # gate column col of w and its up column I further (a column past I
                        # in the last tile reads an up bias: its output is clipped at the store)
                        biases[offsets[v][0]] = (
                            _bias_at(problems.bias, expert, col, bias_cols, live, False),
                            _bias_at(problems.bias, expert, out_cols + col, bias_cols, live,
                                     False))
                    else:
                        biases[offsets[v][0]] = (
                            _bias_at(problems.bias, expert, col, bias_cols, live, True),
                            Float32(0.0))
        weights = []
        if const_expr(cfg.row_scale):
            first, _ = even_row_span(work.m_tile, work.rows)
            first_row = work.row_start + first
            last_row = problems.mD.shape[0] - 1
            lane = cute.arch.lane_idx()
            for s in cutlass.range_constexpr(row_slots(subtiles)):
                weights.append(_row_weight_at(problems.row_weight,
                                              first_row + s * WARP_LANES + lane, last_row, live))
        return biases, weights

    @cute.jit
    def subtile_values(self, frags: EpilogueFrags, acc: cute.Tensor, e: cutlass.Constexpr,
                       problems, work: WorkTile, inputs=None):
        """(no gate) value + bias[expert, weight column], times row_weight[routed row]."""
        cfg = self.cfg
        coords = frags.tRS_rExtra[0]
        offsets = static_offsets(coords)
        biases, lane_weights = inputs
        size = frags.size_rD
        weights = {}
        for v in cutlass.range_constexpr(size):
            i = e * size + v
            val = acc[i]
            if const_expr(cfg.has_bias):
                val = val + biases[offsets[i][0]][0]
            if const_expr(cfg.row_scale):
                if const_expr(offsets[i][1] not in weights):
                    weights[offsets[i][1]] = row_weight_of(lane_weights, coords[i][1],
                                                           offsets[i][1])
                val = val * weights[offsets[i][1]]
            frags.tRS_rD[v] = val
        frags.tRS_rD_out.store(frags.tRS_rD.load().to(cfg.d_dtype))

    @cute.jit
    def store_rows(self, frags: EpilogueFrags, acc: cute.Tensor, subtiles: cutlass.Constexpr,
                   sD: cute.Tensor, tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor, problems,
                   work: WorkTile, epi_bar_id: Int32, epi_threads: cutlass.Constexpr,
                   is_store_warp: cutlass.Boolean, scratch: cute.Tensor | None = None):
        if const_expr(self.cfg.gate is None):
            SwappedEpilogue.store_rows(self, frags, acc, subtiles, sD, tma_atom_d, tma_d,
                                       problems, work, epi_bar_id, epi_threads, is_store_warp,
                                       scratch)
        else:
            self._store_gated(frags, acc, subtiles, sD, tma_atom_d, tma_d, problems, work,
                              epi_bar_id, epi_threads, is_store_warp, scratch)

    @cute.jit
    def _store_gated(self, frags: EpilogueFrags, acc: cute.Tensor, subtiles: cutlass.Constexpr,
                     sD: cute.Tensor, tma_atom_d: cute.CopyAtom, tma_d: cute.Tensor, problems,
                     work: WorkTile, epi_bar_id: Int32, epi_threads: cutlass.Constexpr,
                     is_store_warp: cutlass.Boolean, scratch: cute.Tensor):
        """The gated tile (module docstring): warpgroup 1 hands its up values over, warpgroup
        0 computes and stores 64 output columns x 16u rows."""
        cfg = self.cfg
        wg_threads = cfg.threads_per_wg
        tidx, _, _ = cute.arch.thread_idx()
        mma_tidx = tidx - wg_threads
        t = mma_tidx % wg_threads
        up_group = mma_tidx >= wg_threads
        gate_group = mma_tidx < wg_threads
        # (value, thread, buffer): consecutive threads write consecutive words.
        exchange = cute.make_tensor(
            scratch.iterator,
            cute.make_layout((SUBTILE_VALUES, wg_threads, EXCHANGE_BUFFERS),
                             stride=(wg_threads, 1, SUBTILE_VALUES * wg_threads)))
        gD = problems.store_view(tma_d, work)
        gD_epi = cute.zipped_divide(gD, cfg.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(
            tma_atom_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_epi
        )
        # (both warpgroups load them, so that no value is defined under a branch; warpgroup
        # 1's go unused)
        inputs = self.tile_inputs(frags, problems, work, subtiles)
        # The previous tile's stores have read their staging (issued a mainloop ago), and
        # warpgroup 0 has read the previous tile's exchange.
        if is_store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
        for e in cutlass.range_constexpr(subtiles):
            slot = e % EXCHANGE_BUFFERS
            if up_group:
                for v in cutlass.range_constexpr(SUBTILE_VALUES):
                    exchange[v, t, slot] = acc[e * SUBTILE_VALUES + v]
            # Buffer `slot` was last read two subtiles ago, before warpgroup 0 reached the
            # previous subtile's barrier, which warpgroup 1 passed before writing it.
            cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
            if gate_group:
                self._gated_subtile(frags, acc, e, exchange, t, slot, inputs, tma_atom_d,
                                    bSG_sD, bSG_gD, is_store_warp)

    @cute.jit
    def _gated_subtile(self, frags: EpilogueFrags, acc: cute.Tensor, e: cutlass.Constexpr,
                       exchange: cute.Tensor, t: Int32, slot: cutlass.Constexpr, inputs,
                       tma_atom_d: cute.CopyAtom, bSG_sD: cute.Tensor, bSG_gD: cute.Tensor,
                       is_store_warp: cutlass.Boolean):
        """Warpgroup 0: subtile e's outputs from its gate values and the exchanged up values
        (inputs: tile_inputs'), staged and stored."""
        cfg = self.cfg
        coords = frags.tRS_rExtra[0]
        offsets = static_offsets(coords)
        biases, lane_weights = inputs
        weights = {}
        for v in cutlass.range_constexpr(SUBTILE_VALUES):
            i = e * SUBTILE_VALUES + v
            g = acc[i]
            u = exchange[v, t, slot]
            if const_expr(cfg.has_bias):
                bg, bu = biases[offsets[i][0]]
                g = g + bg
                u = u + bu
            val = gate_value(cfg.gate, g, u, cfg.gate_alpha, cfg.gate_limit, cfg.fast_gate)
            if const_expr(cfg.row_scale):
                if const_expr(offsets[i][1] not in weights):
                    weights[offsets[i][1]] = row_weight_of(lane_weights, coords[i][1],
                                                           offsets[i][1])
                val = val * weights[offsets[i][1]]
            frags.tRS_rD[v] = Float32(val)
        frags.tRS_rD_out.store(frags.tRS_rD.load().to(cfg.d_dtype))
        buf = e % cfg.epi_stages
        cute.copy(frags.tiled_copy_r2s, frags.tRS_rD_out, frags.tRS_sD[(None, None, None, buf)])
        # stmatrix writes go through the generic proxy; the TMA store reads through the async
        # proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_GATED_STORE, number_of_threads=cfg.threads_per_wg)
        if is_store_warp:
            cute.copy(tma_atom_d, bSG_sD[(None, buf)], bSG_gD[(None, (0, e))])
            frags.store_pipe.producer_commit()
            frags.store_pipe.producer_acquire()
        cute.arch.barrier(barrier_id=BAR_GATED_STORE, number_of_threads=cfg.threads_per_wg)


class SwappedFusedMoeGemmSm90(SwappedGemmSm90, FusedMoeGemmSm90):
    """SwappedGemmSm90 with the fused MoE options (module docstring); its launch is
    FusedMoeGemmSm90's (the fused kernel's tensors after the base arguments).

    Args: as SwappedGemmSm90's, plus gate (gate_layout "concat"), gate_alpha, gate_limit,
    bias, row_scale and fast_gate as GroupedGemmSm90 takes them. No gather-A: the plan
    gathers the routed rows (index_select) at the batch sizes these tiles serve.
    """

    def __init__(self, ab_dtype, d_dtype, b_major, ab_stages: int | None = None,
                 trace: bool = False, l2_hints: bool = False, peek_wait: bool = False, *,
                 gate: str | None = None, gate_layout: str = "concat", gate_alpha: float = 0.0,
                 gate_limit: float = 0.0, bias: bool = False, row_scale: bool = False,
                 fast_gate: bool = False, cluster_n: int = 1):
        if gate and gate_layout != "concat":
            raise ValueError("swapped tiles pair gate and up columns across the two math "
                             f"warpgroups: the concat gate layout only; got {gate_layout!r}")
        if not (gate or bias or row_scale):
            raise ValueError("SwappedFusedMoeGemmSm90 needs a fused option (gate, bias or "
                             "row_scale); SwappedGemmSm90 is the plain kernel")
        super().__init__(ab_dtype, d_dtype, b_major, ab_stages=ab_stages, trace=trace,
                         l2_hints=l2_hints, peek_wait=peek_wait, cluster_n=cluster_n, gate=gate,
                         gate_layout=gate_layout, gate_alpha=gate_alpha, gate_limit=gate_limit,
                         bias=bias, row_scale=row_scale, fast_gate=fast_gate)
        if self.gate is not None:
            # 64 output columns x 16 rows per subtile, and the up values' exchange, within the
            # staging the stage count was planned with (8 x 128 x 16 16-bit values).
            self.epi_tile = (GATED_COLS, SWAP_ROW_UNIT)
            self.epi_scratch_floats = EXCHANGE_BUFFERS * SUBTILE_VALUES * self.threads_per_wg
            planned = self.epi_stages * SWAP_TILE_COLS * SWAP_ROW_UNIT * self.d_dtype.width // 8
            used = (self.epi_stages * GATED_COLS * SWAP_ROW_UNIT * self.d_dtype.width // 8
                    + self.epi_scratch_floats * 4)
            assert used <= planned, (used, planned)

    def make_epilogue(self) -> SwappedFusedEpilogue:
        return SwappedFusedEpilogue(self)

    def make_problems(self, args):
        return SwappedFusedVarlenProblems(self, args.num_problems, args.mA, args.mD, args.offs,
                                          args.row_index, args.row_weight, args.bias)
