"""Gather-A: the fused MoE kernel's A operand loaded row by row through an index.

The MoE layer's gate-up GEMM multiplies each routed row r (sorted by expert) by its token's
row x[row_index[r]]. Hopper's TMA copies boxes of consecutive rows, so instead of a permuted
copy of x (S x H elements written and read again) the four warps of the producer warpgroup
load the tile's rows with cp.async, 16 bytes a copy: warps 2 and 3 only that, warp 0 beside B's
TMA, warp 1 right after publishing each record as the scheduler. (Two warps alone, 8 rows x 2
copies a thread per stage of a 128-row tile, starved the math warpgroups on an H200: ping-pong
128x192 2x1 at 0.57-0.80x the speed of index_select + TMA; four warps: 0.86-0.95x.) Four threads
share a row's 128-byte K slice, two 16-byte chunks each (one warp instruction reads 64
contiguous bytes of 8 rows); a thread has tile_m / 32 rows. Their indices are read once per
tile and kept in registers (constants.REGS_GATHER), or, for tiles past 128 rows or 128
accumulator registers, in shared memory (s_rows: the row of x of each of the tile's rows), so
the gather threads fit the default 40-register producer (constants.gather_rows_in_registers).
Eight lanes a row, one 16-byte copy each (whole 128-byte lines a warp instruction, but twice
the rows a thread), was no faster (0.53-0.62x with two warps): the gather threads are bound by
their instructions per stage, not by L1 requests. So a copy's addresses take a few adds
(fill_stage: per-thread swizzled offsets, one source address a row and k-tile): the stage's
fill fell from 112 to 62 PTX instructions (eight copies), and the gathered Qwen3-30B-A3B
gate-up GEMM at 4096 tokens (ping-pong 64x256 2x1) from 76.3M to 70.7M warp instructions and
473 to 457 us under ncu (the TMA-loaded one: 42.7M, 405 us; H200, base clocks), its tensor
pipe 79% -> 82% busy (94%); 0.93-1.06x index_select + TMA on four models' gate-up GEMMs.

Completion: every gather thread arrives on the stage's full barrier once its copies of the
stage have landed (cp.async.mbarrier.arrive.noinc: the barrier was initialised expecting those
arrivals beside the TMA thread's), so the math warpgroups wait on one barrier as before; they
fence the async proxy before their WGMMAs read the rows (GroupedGemmSm90._acquire_gathered;
without the fence, as CUTLASS's cp.async mainloop runs, times moved 0.98-1.03x with no
consistent sign: MOE_GEMM_GATHER_FENCE=0).

Bounds: a row past out's rows (S) or a K chunk past K is not read and its 16 bytes are zero
filled (cp.async with a source size of 0); an index outside [0, T) of x is clamped into it, so
unchecked indices on the GPU can give wrong rows but never read outside x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync

from .constants import GATHER_WARPS, SCHED_STAGES, TILE_K
from .tile_scheduler import consume_work

CHUNK = 8  # 16-bit elements per 16-byte cp.async
THREADS_PER_ROW = 4  # each copies 2 of the row's 8 chunks: 64 contiguous bytes a warp step
CHUNKS_PER_THREAD = TILE_K // CHUNK // THREADS_PER_ROW
GATHER_THREADS = GATHER_WARPS * 32  # the whole producer warpgroup
ROWS_PER_PASS = GATHER_THREADS // THREADS_PER_ROW  # rows the gather threads cover in one pass


# A's stages are K-major with the 128-byte swizzle (TILE_K = 64 16-bit values: one 128-byte row
# per tile row), which the TMA unit applies when it writes them and the WGMMA descriptors
# assume when they read them: in each 1024-byte block (8 rows), the 16-byte chunk index (byte
# address bits 4-6) is XORed with the row within the block (bits 7-9). The gather writes the
# same bytes the TMA load would have.
SWIZZLE_MASK = 0x7 << 4


def swizzle_128b(offset):
    """Byte offset (from a 1024-byte aligned base) -> its 128-byte-swizzled offset."""
    return offset ^ ((offset >> 3) & SWIZZLE_MASK)


# The byte offsets of a thread's chunks in a stage. A's stages are row-major 128-byte rows
# (tile row r, column col of stage s at (s * tile_m + r) * TILE_K + col elements); the swizzle
# XORs bits 4-6 with bits 7-9, i.e. the row modulo 8. A thread's rows r0 + i * ROWS_PER_PASS
# all share r0 modulo 8 (ROWS_PER_PASS is a multiple of 8), and a stage or a pass of rows moves
# the offset by multiples of 1024 bytes, which the swizzle leaves alone: so the swizzled
# offset of (row r0 + i * ROWS_PER_PASS, chunk c + j * THREADS_PER_ROW, stage s) is
# swizzle_128b(offset of (r0, chunk, 0)) + i * PASS_BYTES + s * stage bytes, a per-thread
# constant plus compile-time ones (and fill_stage's address arithmetic a few adds a copy).
ROW_BYTES = TILE_K * 2  # (16-bit values)
PASS_BYTES = ROWS_PER_PASS * ROW_BYTES
assert ROWS_PER_PASS % 8 == 0 and PASS_BYTES % 1024 == 0


@dataclass(frozen=True)
class RowGather:
    """One producer thread's share of the gather (gtid in [0, GATHER_THREADS)): it copies the
    tile rows r0, r0 + ROWS_PER_PASS, ... (chunks c and c + THREADS_PER_ROW of each) into A's
    stages. Made once per thread at kernel start (create); start_tile reads the rows of a new
    record, fill_stage copies one k-tile's chunks and arrives on the stage's full barrier.
    Frozen: the DSL's dynamic loops then read it without carrying it."""

    cfg: Any
    r0: Any  # this thread's first row of the tile
    c: Any  # its first 16-byte chunk of the 128-byte K slice
    x_base: Any  # x's address, its row pitch in bytes, K, T, and out's rows S
    row_bytes: Any
    K: Any
    T: Any
    S: Any
    index: cute.Tensor  # row_index (S,)
    s_base: Any  # A's staging in shared memory (1024-byte aligned)
    s_offs: tuple  # per chunk j of a row: its swizzled byte offset in stage 0 at row r0
    c_bytes: Any  # the byte offset of chunk c in a row of x
    s_rows: cute.Tensor  # (tile_m,) int32 in shared memory (cfg.gather_rows_in_smem)
    rows: cute.Tensor  # register form: per row of the thread, the row of x or -1
    pred: cute.Tensor
    atom: Any

    @staticmethod
    def create(cfg, problems, s_base, s_rows: cute.Tensor, gtid: Int32) -> RowGather:
        dtype = cfg.ab_dtype
        if dtype.width != 16:
            raise ValueError("the gather copies 16-bit operands")
        mA = problems.mA  # x (T, K)
        r0, c = gtid // THREADS_PER_ROW, gtid % THREADS_PER_ROW
        s_offs = tuple(swizzle_128b(r0 * ROW_BYTES + (c + j * THREADS_PER_ROW) * 16)
                       for j in range(CHUNKS_PER_THREAD))
        return RowGather(
            cfg=cfg, r0=r0, c=c,
            x_base=mA.iterator.toint(), row_bytes=Int64(mA.stride[0]) * (dtype.width // 8),
            K=mA.shape[1], T=mA.shape[0], S=problems.mD.shape[0], index=problems.row_index,
            s_base=s_base, s_offs=s_offs, c_bytes=Int64(c * 16), s_rows=s_rows,
            rows=cute.make_rmem_tensor(cute.make_layout((cfg.tile_m // ROWS_PER_PASS,)), Int32),
            pred=cute.make_rmem_tensor(cute.make_layout(((CHUNK,), 1), stride=((0,), 1)),
                                       cutlass.Boolean),
            atom=cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                     dtype, num_bits_per_copy=128))

    @property
    def rows_per_thread(self) -> int:
        return self.cfg.tile_m // ROWS_PER_PASS

    @property
    def stage_bytes(self) -> int:
        return self.cfg.tile_m * ROW_BYTES

    @cute.jit
    def start_tile(self, work):
        """Read the record's rows of x (once per tile)."""
        cfg = self.cfg
        first = work.row_start + work.m_tile * cfg.tile_m + self.r0
        if cutlass.const_expr(cfg.gather_rows_in_smem):
            # The four lanes sharing a row (one warp) write the same value and each reads back
            # only rows it wrote; the warp sync keeps a lane from overwriting a row another
            # lane still reads for the previous tile.
            cute.arch.sync_warp()
        for i in cutlass.range_constexpr(self.rows_per_thread):
            r = first + i * ROWS_PER_PASS
            t = Int32(-1)
            if r < self.S:
                t = cutlass.max(cutlass.min(self.index[r], self.T - 1), Int32(0))
            if cutlass.const_expr(cfg.gather_rows_in_smem):
                self.s_rows[self.r0 + i * ROWS_PER_PASS] = t
            else:
                self.rows[i] = t

    @cute.jit
    def fill_stage(self, work, kk: Int32, ab_pipe: pipeline.PipelineTmaAsync, ab_state):
        """Copy this thread's chunks of k-tile kk of the record into stage ab_state.index (its
        empty barrier already waited on) and arrive on its full barrier when they land. A
        chunk of a row past out's rows, or past K in the last k-tile, is zero filled."""
        k0 = (kk + work.k_start) * TILE_K
        dtype = self.cfg.ab_dtype
        stage_base = self.s_base + ab_state.index * self.stage_bytes
        k_bytes = Int64(k0) * 2 + self.c_bytes
        whole = k0 + TILE_K <= self.K
        for i in cutlass.range_constexpr(self.rows_per_thread):
            row = Int32(0)
            if cutlass.const_expr(self.cfg.gather_rows_in_smem):
                row = self.s_rows[self.r0 + i * ROWS_PER_PASS]  # one shared read a row
            else:
                row = self.rows[i]
            src_row = self.x_base + Int64(cutlass.max(row, Int32(0))) * self.row_bytes + k_bytes
            for j in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                dst = cute.make_tensor(
                    cute.make_ptr(dtype, stage_base + self.s_offs[j] + i * PASS_BYTES,
                                  cute.AddressSpace.smem, assumed_align=16),
                    cute.make_layout(((CHUNK,), 1)))
                src = cute.make_tensor(
                    cute.make_ptr(dtype, src_row + j * THREADS_PER_ROW * 16,
                                  cute.AddressSpace.gmem, assumed_align=16),
                    cute.make_layout(((CHUNK,), 1)))
                self.pred[0] = row >= 0 and (
                    whole or k0 + (self.c + j * THREADS_PER_ROW) * CHUNK < self.K)
                cute.copy(self.atom, src, dst, pred=self.pred)
        cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipe.producer_get_barrier(ab_state))

    @cute.jit
    def fill_tile(self, work, ab_pipe: pipeline.PipelineTmaAsync, ab_state):
        """A record's every k-tile, each stage waited for (the warps that only gather, and the
        scheduler warp after publishing the record); returns the advanced ring state."""
        self.start_tile(work)
        for kk in cutlass.range(0, work.k_tiles, 1, unroll=1):
            ab_pipe.sync_object_empty.wait(ab_state.index, ab_state.phase)
            self.fill_stage(work, kk, ab_pipe, ab_state)
            ab_state.advance()
        return ab_state


@cute.jit
def gather_role(cfg, ab_pipe: pipeline.PipelineTmaAsync, sched_pipe: pipeline.PipelineAsync,
                sched: cute.Tensor, gather: RowGather):
    """A warp that only gathers (warps 2 and 3): for every record of the CTA, in order, fill
    A's stages of its k-tiles with its share of the tile's rows of x."""
    read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
    ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.ab_stages)
    work, read_state = consume_work(sched_pipe, sched, read_state)
    while work.has_work():
        ab_state = gather.fill_tile(work, ab_pipe, ab_state)
        work, read_state = consume_work(sched_pipe, sched, read_state)
