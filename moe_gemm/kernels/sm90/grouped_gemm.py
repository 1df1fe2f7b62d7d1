"""GroupedGemmSm90: a persistent, warp-specialized grouped GEMM for sm_90a in CuTe DSL.

One launch (a single kernel) computes D_p = A_p @ B_p for every problem p of a set. Three
problem forms share the kernel body and differ only in where operands and sizes come from:

- general: G problems with separate allocations and any (M, N, K) each, described by a
  (G, 8) int64 metadata table. For each of its tiles the scheduler warp encodes the problem's
  A, B and D TMA descriptors on the GPU into a slot of a per-CTA ring in the workspace
  (DESC_RING slots, reused only after every warp is done with them), so no descriptor is ever
  modified while in use and the host never calls the driver per problem.
- varlen (MoE): x (T, K), w (E, K, N) in either major, offs (E,) int32 on the GPU. A and B use
  one descriptor each (the expert selected by coordinates); D uses a per-expert descriptor
  that the scheduler warp encodes from offs into the ring, so a partial tile at an expert
  boundary is clipped by the TMA unit and never touches the neighbour's rows. No host
  synchronisation: CUDA-graph safe.
- batched: x (G, M, K), w (G, K, N), out (G, M, N), the same (M, N, K) for every problem
  (torch.bmm's and F.grouped_mm's 3D x 3D form). Every operand is one rank-3 TMA descriptor
  whose third mode is the problem, so there is no prologue kernel, no per-problem descriptor
  and no descriptor fence: a problem switch is only a new coordinate. The scheduler finds a
  tile's problem by division (every problem has the same tile count).

Warp roles (384 threads = 3 warpgroups):
- warpgroup 0 (producer, 40 registers): warp 0 issues TMA loads of A and B into a
  `ab_stages`-deep shared-memory ring (PipelineTmaAsync); warp 1 is the scheduler: it finds
  each of the CTA's tiles (device visitor: warp-wide prefix-sum search over 32-problem
  windows; host visitor: a precomputed per-CTA table) and publishes 32-byte records through a
  small mbarrier ring that the load warp and every math warp read.
- warpgroups 1 and 2 (math, 232 registers): WGMMA from shared memory, fp32 accumulators, then
  an epilogue that converts, stores through shared memory (stmatrix) and issues TMA stores.
  * cooperative: both warpgroups split one tile_m x tile_n tile along M.
  * pingpong: each warpgroup owns whole tiles (the CTA's even and odd tiles); two named
    barriers order their mainloops, so one warpgroup's epilogue overlaps the other's WGMMAs.
    The shared A/B ring is consumed in tile order: a warpgroup skips the other's tile by
    advancing its ring state by that tile's own k-tile count (K differs per problem).

Tail split (compile-time `tail_split`; cooperative, device visitor, 1x1 cluster, varlen and
batched forms): the scheduler warp first counts all T tiles; when the last wave holds
rem = T mod grid <= grid / 2 tiles, CTA j < rem computes tail tile j over the lower half of K
and publishes its fp32 accumulators to a workspace slot (counter += 1, release), and CTA
rem + j computes the upper half, acquires the counter, adds the partial, stores the tile and
resets the counter. The last wave then takes about half a tile's time instead of a whole one.

Constraints: bf16/fp16 inputs, fp32 accumulation, bf16/fp16/fp32 output; A K-major; B K- or
N-major; every TMA operand 16-byte aligned with 16-byte-multiple strides (kernels/support.py
checks this before we get here); tile_k = 64 (one 128-byte swizzle row of 16-bit data).
"""

from __future__ import annotations

from typing import Literal

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from .constants import (
    DESC_BYTES,
    DESC_RING,
    SCHED_STAGES,
    SLOT_BYTES,
    SPLIT_COUNTER_BYTES,
    SPLIT_MAX_CTAS,
    SPLIT_MIN_K_TILES,
    TILE_K,
)
from .tile_scheduler import RECORD_INTS, WARP, ceil_div_i32, raster_tile, warp_inclusive_sum

Form = Literal["general", "varlen", "batched"]
Schedule = Literal["cooperative", "pingpong"]
Visitor = Literal["device", "host"]

TRACE_INTS = 4  # debug trace record: (problem, m_tile, n_tile, warpgroup)

# L2 eviction priorities for TMA loads (the createpolicy encodings CUTLASS uses, sm90).
EVICT_NORMAL = 0x1000000000000000
EVICT_FIRST = 0x12F0000000000000
EVICT_LAST = 0x14F0000000000000

# Named barrier ids (0 is __syncthreads). Each role owns its ids; see KERNEL-NOTES pitfalls.
BAR_EPI = 2  # + warpgroup index in pingpong: a warpgroup's epilogue threads
BAR_MMA_ORDER = 4  # + warpgroup index: pingpong "your mainloop may start" tokens
BAR_SPLIT = 6  # tail split: both math warpgroups, around the partial-tile handoff

# Record field 5 ("valid") of a tail-split kernel: the low 2 bits are the tile's role, the rest
# its index in the split tail (its counter and partial slot).
ROLE_SKIP = 0  # computed but not stored (a cluster's CTA past the problem's edge)
ROLE_TILE = 1  # an ordinary tile
ROLE_FINISH = 2  # the upper half of K: add the partial, then the epilogue
ROLE_PUBLISH = 3  # the lower half of K: write the fp32 partial, no epilogue


@dsl_user_op
def _desc_ptr_for_copy(address: Int64, *, loc=None, ip=None) -> cute.Pointer:
    """A workspace descriptor address as the pointer type cute.copy's tma_desc_ptr takes."""
    from cutlass._mlir.dialects import cute as _cute_ir
    from cutlass._mlir.dialects import cute_nvgpu as _cute_nvgpu_ir

    generic = cute.make_ptr(
        cutlass.Int8, address, cute.AddressSpace.generic, assumed_align=DESC_BYTES, loc=loc, ip=ip
    )
    desc_ptr_ty = _cute_ir.PtrType.get(
        _cute_nvgpu_ir.TmaDescriptorTiledType.get(), generic.memspace, generic.alignment
    )
    return _cute_ir.recast_iter(desc_ptr_ty, generic.value, loc=loc, ip=ip)


def _generic_ptr(address: Int64) -> cute.Pointer:
    return cute.make_ptr(cutlass.Int8, address, cute.AddressSpace.generic,
                         assumed_align=DESC_BYTES)


class GroupedGemmSm90:
    """Persistent warp-specialized grouped GEMM (see the module docstring for the design).

    Args (all compile-time; nothing here varies with the problem set):
        ab_dtype: cutlass.BFloat16 or cutlass.Float16.
        d_dtype: cutlass.BFloat16, cutlass.Float16 or cutlass.Float32.
        b_major: "k" (B stored (N, K) K-contiguous, e.g. w.T of a Linear weight) or "n".
        form: "general" or "varlen".
        schedule: "cooperative" or "pingpong".
        visitor: "device" or "host".
        tile_mn: (tile_m, tile_n) per CTA (cooperative) or per warpgroup (pingpong).
        ab_stages: A/B ring depth; None = as many as shared memory holds.
        trace: record (problem, m_tile, n_tile, warpgroup) per executed tile (debug).
        tail_split: split a last wave of at most half the grid over K (module docstring).
    """

    def __init__(
        self,
        ab_dtype: type[cutlass.Numeric],
        d_dtype: type[cutlass.Numeric],
        b_major: Literal["k", "n"],
        form: Form,
        schedule: Schedule,
        visitor: Visitor,
        tile_mn: tuple[int, int],
        ab_stages: int | None = None,
        trace: bool = False,
        l2_hints: bool = False,
        epi_n: int = 32,
        cluster_m: int = 1,
        cluster_n: int = 1,
        epi_whole: bool = False,
        tail_split: bool = False,
    ):
        self.ab_dtype = ab_dtype
        self.d_dtype = d_dtype
        self.acc_dtype = cutlass.Float32
        self.b_major = b_major
        self.form = form
        self.schedule = schedule
        self.visitor = visitor
        self.tile_m, self.tile_n = tile_mn
        self.tile_shape_mnk = (self.tile_m, self.tile_n, TILE_K)
        self.requested_stages = ab_stages
        self.trace = trace
        # TMA loads carry the runtime a_policy / b_policy L2 eviction hints only when built
        # with l2_hints: without them the loads use the default policy, which measured as
        # fast or faster on every suite shape (H200, 2026-11-21; AGENTS.md).
        self.l2_hints = l2_hints
        self.pingpong = schedule == "pingpong"
        # Thread-block cluster of two CTAs on adjacent tiles of one problem. 2x1 (along M):
        # they share B's tile_n x 64 slice per k-step; each loads half and TMA multicasts it
        # to both, cutting the L2->SM bytes per CTA from (tile_m + tile_n) to
        # (tile_m + tile_n / 2) rows per k-step (128x256: 48 -> 32 KiB). 1x2 (along N): the
        # same for A (48 -> 40 KiB), and each A tile is fetched once for both n-tiles.
        if (cluster_m, cluster_n) not in ((1, 1), (2, 1), (1, 2)):
            raise ValueError(f"cluster {cluster_m}x{cluster_n} unsupported (1x1, 2x1, 1x2)")
        if cluster_m * cluster_n > 1 and (schedule != "cooperative" or visitor != "device"):
            raise ValueError("clusters are built for the cooperative schedule and the device "
                             "visitor")
        self.cluster_m = cluster_m
        self.cluster_n = cluster_n
        self.cluster_size = cluster_m * cluster_n
        # Tail split (constants.py): a last wave that fills at most half the grid runs each
        # tile as two half-K units on two CTAs, joined through an fp32 workspace slot.
        if tail_split and (schedule != "cooperative" or visitor != "device"
                           or self.cluster_size > 1 or form == "general"):
            raise ValueError("the tail split is built for the varlen and batched forms, "
                             "cooperative schedule, device visitor and 1x1 cluster")
        self.tail_split = tail_split

        if self.pingpong:
            if self.tile_m not in (64, 128) or self.tile_n not in (64, 128, 192, 256):
                raise ValueError(f"pingpong tile {tile_mn} unsupported")
            if self.tile_m * self.tile_n > 128 * 192:
                raise ValueError(f"pingpong tile {tile_mn} needs too many accumulator registers")
            self.atom_layout_mnk = (1, 1, 1)
            self.mma_tiler_mn = (64, self.tile_n)
            self.epi_tile = (64, 32)
            self.num_epi_groups = 2  # each math warpgroup has its own epilogue buffers
        else:
            if self.tile_m != 128 or self.tile_n not in (64, 128, 192, 256):
                raise ValueError(f"cooperative tile {tile_mn} unsupported")
            self.atom_layout_mnk = (2, 1, 1)
            self.mma_tiler_mn = (64, self.tile_n)
            if epi_n not in (32, 64):
                raise ValueError(f"cooperative epilogue subtile width {epi_n} unsupported")
            self.epi_tile = (128, epi_n)
            self.num_epi_groups = 1

        self.threads_per_wg = 128
        self.num_math_wgs = 2
        self.threads = (1 + self.num_math_wgs) * self.threads_per_wg
        self.load_warp = 0
        self.sched_warp = 1
        # 40 + 2 x 232 registers/thread x 128 threads = 64,512 of the SM's 65,536.
        self.load_regs = 40
        self.math_regs = 232
        # Epilogue staging: 4 x (128 x 32) subtiles cooperative (32 KiB at bf16), 2 per
        # warpgroup in ping-pong; a 64-wide cooperative subtile halves the barriers per tile.
        self.epi_stages = (4 * 32 // self.epi_tile[1]) if self.num_epi_groups == 1 else 2
        # Whole-tile epilogue (cooperative, 16-bit output): a staging buffer for every subtile
        # (128 x 256 bf16 = 64 KiB), so the warpgroups write the whole tile to shared memory
        # between two barriers and one warp issues all its TMA stores: 2 named-barrier syncs
        # per tile instead of 2 per subtile (16 at 128x256).
        self.epi_whole = epi_whole
        if epi_whole:
            if self.pingpong or d_dtype.width != 16:
                raise ValueError("the whole-tile epilogue is built for cooperative 16-bit output")
            self.epi_stages = self.tile_n // self.epi_tile[1]
        self.buffer_align = 1024  # 128-byte swizzle atoms need 1 KiB aligned buffers

    # ------------------------------------------------------------------------------------------
    # Setup (trace time, host side)

    def _setup(self) -> None:
        a_major = warpgroup.OperandMajorMode.K
        b_major = (
            warpgroup.OperandMajorMode.K if self.b_major == "k" else warpgroup.OperandMajorMode.MN
        )
        self.a_layout = LayoutEnum.ROW_MAJOR  # (M, K), K contiguous
        self.b_layout = LayoutEnum.ROW_MAJOR if self.b_major == "k" else LayoutEnum.COL_MAJOR
        self.d_layout = LayoutEnum.ROW_MAJOR
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            a_major,
            b_major,
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=self.mma_tiler_mn,
        )
        ab_bytes = (self.tile_m + self.tile_n) * TILE_K * self.ab_dtype.width // 8
        d_bytes = (
            self.epi_tile[0] * self.epi_tile[1] * self.d_dtype.width // 8
            * self.epi_stages * self.num_epi_groups
        )
        smem = utils.get_smem_capacity_in_bytes("sm_90")
        reserved = 2048 + d_bytes + SCHED_STAGES * RECORD_INTS * 4
        fit = (smem - reserved) // ab_bytes
        if self.requested_stages is not None:
            if self.requested_stages > fit:
                raise ValueError(f"{self.requested_stages} stages do not fit; at most {fit}")
            fit = self.requested_stages
        if fit < 2:
            raise ValueError("tile too large for shared memory")
        self.ab_stages = fit

        self.a_smem_staged = self._staged_smem_layout(
            (self.tile_m, TILE_K), self.a_layout, self.ab_dtype, self.ab_stages, k_major=True
        )
        self.b_smem_staged = self._staged_smem_layout(
            (self.tile_n, TILE_K), self.b_layout, self.ab_dtype, self.ab_stages,
            k_major=self.b_major == "k",
        )
        d_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.d_layout, self.d_dtype, self.epi_tile[1]),
            self.d_dtype,
        )
        self.d_smem_staged = cute.tile_to_shape(
            d_atom,
            (*self.epi_tile, self.epi_stages * self.num_epi_groups),
            order=(0, 1, 2),
        )

    @staticmethod
    def _staged_smem_layout(shape, layout, dtype, stages, k_major: bool):
        major_size = shape[1] if k_major else shape[0]
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(layout, dtype, major_size), dtype
        )
        return cute.tile_to_shape(
            atom, (*shape, stages), order=(0, 1, 2) if k_major else (1, 0, 2)
        )

    # ------------------------------------------------------------------------------------------
    # Host entry (traced once per compile key)

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # general: seed (rows, K) of ab_dtype; varlen: x (T, K);
        #                   batched: x (G, M, K)
        mW: cute.Tensor,  # general: seed (K, N); varlen/batched: w (E|G, K, N); either major
        mD: cute.Tensor,  # general: seed (rows, N) of d_dtype; varlen: out (T, N);
        #                   batched: out (G, M, N)
        meta: cute.Tensor,  # general: (G, 8) int64 per problem; varlen: unused (1, 8)
        meta32: cute.Tensor,  # the same bytes as (G, 16) int32 (M, N, K at columns 12..14)
        offs: cute.Tensor,  # varlen: (E,) int32 cumulative end rows; general: unused (1,)
        table: cute.Tensor,  # host visitor: (num_ctas, entries, 2) int32; else (1, 1, 2)
        workspace: cute.Tensor,  # (num_ctas * DESC_RING * 3 * 16,) int64: descriptor rings
        trace: cute.Tensor,  # debug: (num_ctas, max_tiles, 4) int32; else (1, 1, 4)
        num_problems: Int32,  # general: G; varlen: E + 1 if the zero tail is on, else E
        num_ctas: Int32,
        swizzle: Int32,
        a_policy: Int64,  # L2 eviction priority for A loads (EVICT_* above)
        b_policy: Int64,  # and for B loads
        pdl: Int32,  # 1: launch the main kernel with programmatic dependent launch
        d_base: Int64,  # general: added to every row's D address (the host's output block,
        #                 so one metadata upload serves calls whose outputs are new); else 0
        stream: cuda.CUstream,
    ):
        self._setup()
        # B in the (N, K[, E]) order the MMA and TMA atoms expect; a view, no copy.
        mA_tma, mD_tma = mA, mD
        if const_expr(self.form == "general"):
            mB = cute.make_tensor(
                mW.iterator,
                cute.make_layout((mW.shape[1], mW.shape[0]), stride=(mW.stride[1], mW.stride[0])),
            )
        else:
            mB = cute.make_tensor(
                mW.iterator,
                cute.make_layout(
                    (mW.shape[2], mW.shape[1], mW.shape[0]),
                    stride=(mW.stride[2], mW.stride[1], mW.stride[0]),
                ),
            )
        if const_expr(self.form == "batched"):
            # (G, M, K) -> (M, K, G) and (G, M, N) -> (M, N, G): the problem is TMA mode 2.
            mA_tma = cute.make_tensor(
                mA.iterator,
                cute.make_layout(
                    (mA.shape[1], mA.shape[2], mA.shape[0]),
                    stride=(mA.stride[1], mA.stride[2], mA.stride[0]),
                ),
            )
            mD_tma = cute.make_tensor(
                mD.iterator,
                cute.make_layout(
                    (mD.shape[1], mD.shape[2], mD.shape[0]),
                    stride=(mD.stride[1], mD.stride[2], mD.stride[0]),
                ),
            )

        op_g2s = cpasync.CopyBulkTensorTileG2SOp()
        op_s2g = cpasync.CopyBulkTensorTileS2GOp()
        a_smem = cute.slice_(self.a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(self.b_smem_staged, (None, None, 0))
        d_smem = cute.slice_(self.d_smem_staged, (None, None, 0))
        op_a = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(
            self.cluster_n > 1) else op_g2s
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            op_a, mA_tma, a_smem, (self.tile_m, TILE_K), num_multicast=self.cluster_n
        )
        op_b = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(
            self.cluster_m > 1) else op_g2s
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
            op_b, mB, b_smem, (self.tile_n, TILE_K), num_multicast=self.cluster_m
        )
        tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(op_s2g, mD_tma, d_smem, self.epi_tile)

        @cute.struct
        class SharedStorage:
            ab_bars: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sched_bars: cute.struct.MemRange[cutlass.Int64, SCHED_STAGES * 2]
            sched: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int32, SCHED_STAGES * RECORD_INTS], 16
            ]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_staged)],
                self.buffer_align,
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_smem_staged)],
                self.buffer_align,
            ]
            sD: cute.struct.Align[
                cute.struct.MemRange[self.d_dtype, cute.cosize(self.d_smem_staged)],
                self.buffer_align,
            ]

        self.shared_storage = SharedStorage

        self.kernel(
            tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_d, tma_d,
            mA, mD, meta, meta32, offs, table, workspace, trace, num_problems, swizzle,
            a_policy, b_policy, d_base, self.tiled_mma, self.a_smem_staged, self.b_smem_staged, self.d_smem_staged,
        ).launch(
            grid=(num_ctas, 1, 1),
            block=(self.threads, 1, 1),
            cluster=(self.cluster_size, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
            # Programmatic dependent launch (opt-in): the CTAs may become resident and run
            # their prologue (barrier init, descriptor prefetch, register reallocation) while
            # the previous kernel on the stream finishes; every thread waits on griddepcontrol
            # before it touches global memory.
            use_pdl=pdl,
        )

    @staticmethod
    def _gmem_desc(ws_base: Int64, slot: int) -> cute.Pointer:
        return cute.make_ptr(
            cutlass.Int64, ws_base + slot * DESC_BYTES, cute.AddressSpace.gmem,
            assumed_align=DESC_BYTES,
        )

    @cute.jit
    def _expert_rows(self, p: Int32, offs: cute.Tensor, T: Int32, E: Int32) -> tuple[Int32, Int32]:
        """(first row, row count) of expert p; p == E is the zero tail [offs[-1], T).

        Offsets are clamped into [0, T] and a decreasing entry gives an empty expert, so
        unchecked offsets on the GPU can never address rows outside x or out.
        """
        start = Int32(0)
        if p > 0:
            start = cutlass.max(cutlass.min(offs[p - 1], T), Int32(0))
        end = T
        if p < E:
            end = cutlass.max(cutlass.min(offs[p], T), Int32(0))
        return start, cutlass.max(end - start, Int32(0))

    # ------------------------------------------------------------------------------------------
    # Main kernel

    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        tma_a: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        tma_b: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        tma_d: cute.Tensor,
        mA: cute.Tensor,
        mD: cute.Tensor,
        meta: cute.Tensor,
        meta32: cute.Tensor,
        offs: cute.Tensor,
        table: cute.Tensor,
        workspace: cute.Tensor,
        trace: cute.Tensor,
        num_problems: Int32,
        swizzle: Int32,
        a_policy: Int64,
        b_policy: Int64,
        d_base: Int64,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        d_smem_staged: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # A/B ring: TMA-filled, released by one warpgroup (pingpong) or both (cooperative).
        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.ab_dtype, a_smem) + cute.size_in_bytes(
            self.ab_dtype, b_smem
        )
        consumer_warps = 4 if const_expr(self.pingpong) else 8
        # A stage is free once every consumer warp of every CTA it is multicast to is done
        # with it: lane r of each consumer warp arrives on CTA r's empty barrier.
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_bars.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, consumer_warps * self.cluster_size
            ),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )
        # Scheduler ring: one producer arrive (the scheduler warp's lane 0), one consumer
        # arrive per reading warp (the load warp + 8 math warps).
        sched_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.sched_bars.data_ptr(),
            num_stages=SCHED_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + 8),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, self.cluster_n),
                                      is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sD.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        sched = storage.sched.get_tensor(cute.make_layout((RECORD_INTS, SCHED_STAGES)))

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, self.cluster_n))
        # Under PDL the previous grid (the producer of our inputs) may still be running:
        # nothing above touched global memory; everything below may.
        cute.arch.griddepcontrol_wait()

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            if warp_idx == self.sched_warp:
                self.scheduler_warp(sched_pipe, sched, meta, meta32, offs, table, mA, mD,
                                    num_problems, swizzle, d_base, workspace,
                                    cute.slice_(a_smem_staged, (None, None, 0)),
                                    cute.slice_(b_smem_staged, (None, None, 0)),
                                    cute.slice_(d_smem_staged, (None, None, 0)))
            if warp_idx == self.load_warp:
                self.load_warp_role(
                    ab_pipe, sched_pipe, sched, tma_atom_a, tma_a, tma_atom_b, tma_b,
                    sA, sB, workspace, a_policy, b_policy,
                )
        else:
            cute.arch.setmaxregister_increase(self.math_regs)
            self.math_role(
                ab_pipe, sched_pipe, sched, tiled_mma, sA, sB, sD, tma_atom_d, tma_d,
                workspace, trace, tidx, warp_idx, wg_idx - 1,
            )

    # ------------------------------------------------------------------------------------------
    # Scheduler warp

    @cute.jit
    def _problem_dims(
        self, p: Int32, meta32: cute.Tensor, offs: cute.Tensor, mA: cute.Tensor,
        mD: cute.Tensor,
    ) -> tuple[Int32, Int32, Int32, Int32]:
        """(rows, cols, depth, row_start) of problem p (p must be a valid problem)."""
        rows = Int32(0)
        cols = Int32(0)
        depth = Int32(0)
        row_start = Int32(0)
        if const_expr(self.form == "general"):
            rows = meta32[p, 12]
            cols = meta32[p, 13]
            depth = meta32[p, 14]
        elif const_expr(self.form == "batched"):
            rows = mA.shape[1]
            cols = mD.shape[2]
            depth = mA.shape[2]
        else:
            E = offs.shape[0]
            row_start, rows = self._expert_rows(p, offs, mA.shape[0], E)
            cols = mD.shape[1]
            depth = mA.shape[1]
            if p >= E:
                depth = Int32(0)  # the zero tail: store zeros, load nothing
        return rows, cols, depth, row_start

    @cute.jit
    def _tile_count(
        self, p: Int32, num_problems: Int32, meta32: cute.Tensor, offs: cute.Tensor,
        mA: cute.Tensor, mD: cute.Tensor,
    ) -> Int32:
        count = Int32(0)
        if p < num_problems:
            rows, cols, _, _ = self._problem_dims(p, meta32, offs, mA, mD)
            count = ceil_div_i32(rows, self.tile_m * self.cluster_m) * ceil_div_i32(
                cols, self.tile_n * self.cluster_n
            )
        return count

    @cute.jit
    def scheduler_warp(
        self,
        sched_pipe: pipeline.PipelineAsync,
        sched: cute.Tensor,
        meta: cute.Tensor,
        meta32: cute.Tensor,
        offs: cute.Tensor,
        table: cute.Tensor,
        mA: cute.Tensor,
        mD: cute.Tensor,
        num_problems: Int32,
        swizzle: Int32,
        d_base: Int64,
        workspace: cute.Tensor,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        d_smem: cute.ComposedLayout,
    ):
        lane = cute.arch.lane_idx()
        cta, _, _ = cute.arch.block_idx()
        ring = self._ring_base(workspace, cta)
        records = Int32(0)
        grid, _, _ = cute.arch.grid_dim()
        # With a cluster the unit of work is a cluster tile (cluster_m vertically adjacent
        # tiles); the cluster walks the linear cluster tiles and each CTA takes its row.
        rank = Int32(0)
        if const_expr(self.cluster_size > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cta = cta // self.cluster_size
        grid = grid // self.cluster_size
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SCHED_STAGES)
        base_problem = Int32(0)  # device visitor window start (forward only)
        base_tile = Int32(0)  # linear index of base_problem's first tile
        t = Int32(cta)  # this CTA's current linear tile
        slot = Int32(0)  # host visitor: row of this CTA's table
        working = cutlass.Boolean(True)
        per_problem = Int32(0)  # batched: every problem has the same tile count
        if const_expr(self.form == "batched"):
            per_problem = ceil_div_i32(
                mA.shape[1], self.tile_m * self.cluster_m
            ) * ceil_div_i32(mD.shape[2], self.tile_n * self.cluster_n)
        # Tail split: with T tiles on `grid` CTAs, the last wave holds rem = T mod grid tiles.
        # When 2 * rem <= grid, unit j of the last wave (linear index full + j) is half of
        # tail tile j mod rem: j < rem the lower half of K (publisher), else the upper
        # (finisher). The publisher CTA has the lower index, so it is launched first: a
        # finisher never waits on a CTA that is not yet resident.
        total = Int32(0)
        full = Int32(0)
        rem = Int32(0)
        split = cutlass.Boolean(False)
        if const_expr(self.tail_split):
            if const_expr(self.form == "batched"):
                total = num_problems * per_problem
            else:
                p0 = Int32(0)
                while p0 < num_problems:
                    cnt = self._tile_count(p0 + lane, num_problems, meta32, offs, mA, mD)
                    total = total + cute.arch.shuffle_sync(warp_inclusive_sum(cnt, lane),
                                                           WARP - 1)
                    p0 = p0 + WARP
            full = (total // grid) * grid
            rem = total - full
            if rem > 0:
                if 2 * rem <= grid:
                    if grid <= SPLIT_MAX_CTAS:
                        split = True
        while working:
            problem = Int32(-1)
            start = Int32(0)
            lin = t  # the linear tile this record computes (all of it, or half of its K)
            part = Int32(0)  # tail split: 0 whole tile, 1 publisher, 2 finisher
            tail_i = Int32(0)
            if const_expr(self.tail_split):
                if split:
                    if t >= full:
                        j = t - full
                        if j < 2 * rem:
                            part = Int32(1)
                            tail_i = j
                            if j >= rem:
                                part = Int32(2)
                                tail_i = j - rem
                            lin = full + tail_i
                        else:
                            lin = total  # past the last tile: the search ends this CTA
            if const_expr(self.form == "batched"):
                if per_problem > 0:
                    if lin < num_problems * per_problem:
                        problem = lin // per_problem
                        start = problem * per_problem
            elif const_expr(self.visitor == "host"):
                if slot < table.shape[1]:
                    problem = table[cta, slot, 0]
                    start = table[cta, slot, 1]
            else:
                searching = cutlass.Boolean(True)
                while searching:
                    cnt = self._tile_count(base_problem + lane, num_problems, meta32, offs, mA, mD)
                    end = base_tile + warp_inclusive_sum(cnt, lane)
                    window_end = cute.arch.shuffle_sync(end, WARP - 1)
                    if lin < window_end:
                        hit = cute.arch.popc(cute.arch.vote_ballot_sync(end <= lin))
                        start = cute.arch.shuffle_sync(end - cnt, hit)
                        problem = base_problem + hit
                        base_problem = problem
                        base_tile = start
                        searching = False
                    else:
                        if base_problem + WARP >= num_problems:
                            searching = False
                        else:
                            base_problem = base_problem + WARP
                            base_tile = window_end
            m_tile = Int32(0)
            n_tile = Int32(0)
            k_tiles = Int32(0)
            k_start = Int32(0)
            row_start = Int32(0)
            valid = Int32(0)
            expert_rows = Int32(0)
            if problem >= 0:
                rows, cols, depth, row_start = self._problem_dims(problem, meta32, offs, mA, mD)
                expert_rows = rows
                tiles_m = ceil_div_i32(rows, self.tile_m)
                tiles_n = ceil_div_i32(cols, self.tile_n)
                if const_expr(self.cluster_size > 1):
                    units_m = ceil_div_i32(rows, self.tile_m * self.cluster_m)
                    units_n = ceil_div_i32(cols, self.tile_n * self.cluster_n)
                    m_unit, n_unit = raster_tile(t - start, units_m, units_n, swizzle)
                    m_tile = m_unit * self.cluster_m
                    n_tile = n_unit * self.cluster_n
                    if const_expr(self.cluster_m > 1):
                        m_tile = m_tile + rank
                    if const_expr(self.cluster_n > 1):
                        n_tile = n_tile + rank
                    # An odd last row (column) of tiles: this CTA still loads (its peer needs
                    # its half of the shared operand) and computes, but stores nothing.
                    if m_tile < tiles_m:
                        if n_tile < tiles_n:
                            valid = Int32(1)
                else:
                    m_tile, n_tile = raster_tile(lin - start, tiles_m, tiles_n, swizzle)
                    valid = Int32(ROLE_TILE)
                k_tiles = ceil_div_i32(depth, TILE_K)
                if const_expr(self.tail_split):
                    if part != 0:
                        if k_tiles >= SPLIT_MIN_K_TILES:
                            half = k_tiles // 2
                            if part == 1:
                                k_tiles = half
                                valid = ROLE_PUBLISH | (tail_i << 2)
                            else:
                                k_start = half
                                k_tiles = k_tiles - half
                                valid = ROLE_FINISH | (tail_i << 2)
                        elif part == 2:
                            problem = Int32(-1)  # too short to split: the publisher's CTA
                            #                      computes it whole
            if problem < 0:
                working = False
            sched_pipe.producer_acquire(state)
            if lane == 0:
                sched[0, state.index] = problem
                sched[1, state.index] = m_tile
                sched[2, state.index] = n_tile
                sched[3, state.index] = k_tiles
                sched[4, state.index] = row_start
                sched[5, state.index] = valid
                sched[6, state.index] = records % DESC_RING
                sched[7, state.index] = k_start
            if const_expr(self.form != "batched"):
                slot_addr = ring + Int64(records % DESC_RING) * SLOT_BYTES
                if problem >= 0:
                    if const_expr(self.form == "general"):
                        self._write_general_descs(slot_addr, problem, meta, d_base, a_smem,
                                                  b_smem, d_smem)
                    else:
                        # The expert's D view [row_start, row_start + rows), so a partial tile
                        # at the expert's end is clipped by the TMA unit.
                        self._write_d_desc(slot_addr + 2 * DESC_BYTES, mD, row_start,
                                           expert_rows, d_smem)
                    # Publish the descriptors to the tensormap proxy (the TMA unit reads them
                    # there); the load and store warps acquire them per record.
                    cpasync.fence_tma_desc_release()
                # Every lane's writes are fenced before lane 0 publishes the record.
                cute.arch.sync_warp()
            if lane == 0:
                sched_pipe.producer_commit(state)
            state.advance()
            t = t + grid
            slot = slot + 1
            records = records + 1
        sched_pipe.producer_tail(state)

    @staticmethod
    def _ring_base(workspace: cute.Tensor, cta: Int32) -> Int64:
        """This CTA's descriptor ring in the workspace (DESC_RING slots of SLOT_BYTES)."""
        return workspace.iterator.toint() + Int64(cute.arch.make_warp_uniform(cta)) * (
            DESC_RING * SLOT_BYTES
        )

    @cute.jit
    def _write_d_desc(self, address: Int64, mD: cute.Tensor, row_start: Int32, count: Int32,
                      d_smem: cute.ComposedLayout):
        """The TMA store descriptor of out rows [row_start, row_start + count), at `address`
        (global memory)."""
        op_s2g = cpasync.CopyBulkTensorTileS2GOp()
        d_ptr = mD.iterator + Int64(row_start) * mD.stride[0]
        tD = cute.make_tensor(d_ptr, cute.make_layout((count, mD.shape[1]),
                                                      stride=(mD.stride[0], 1)))
        atom_d, _ = cpasync.make_tiled_tma_atom(op_s2g, tD, d_smem, self.epi_tile)
        cpasync.copy_tensormap(atom_d, self._gmem_desc(address, 0))

    @cute.jit
    def _write_general_descs(self, address: Int64, p: Int32, meta: cute.Tensor, d_base: Int64,
                             a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
                             d_smem: cute.ComposedLayout):
        """Problem p's A, B (when K > 0) and D descriptors at address + 0 / 128 / 256, from
        its metadata row: [a_ptr, b_ptr, d_ptr - d_base, a_ld, b_ld, d_ld, M | N << 32, K]."""
        # Under a cluster the shared operand's descriptor has the multicast box (each CTA
        # loads 1 / cluster of the tile's rows for both), as the host-made atoms have.
        op_a = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(
            self.cluster_n > 1) else cpasync.CopyBulkTensorTileG2SOp()
        op_b = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(
            self.cluster_m > 1) else cpasync.CopyBulkTensorTileG2SOp()
        op_s2g = cpasync.CopyBulkTensorTileS2GOp()
        rows = Int32(meta[p, 6] & 0xFFFFFFFF)
        cols = Int32(meta[p, 6] >> 32)
        depth = Int32(meta[p, 7])
        if depth > 0:
            a_ptr = cute.make_ptr(self.ab_dtype, meta[p, 0], cute.AddressSpace.gmem,
                                  assumed_align=16)
            tA = cute.make_tensor(a_ptr, cute.make_layout((rows, depth), stride=(meta[p, 3], 1)))
            atom_a, _ = cpasync.make_tiled_tma_atom(op_a, tA, a_smem, (self.tile_m, TILE_K),
                                                    num_multicast=self.cluster_n)
            cpasync.copy_tensormap(atom_a, self._gmem_desc(address, 0))
            b_ptr = cute.make_ptr(self.ab_dtype, meta[p, 1], cute.AddressSpace.gmem,
                                  assumed_align=16)
            if const_expr(self.b_major == "k"):
                b_layout = cute.make_layout((cols, depth), stride=(meta[p, 4], 1))
            else:
                b_layout = cute.make_layout((cols, depth), stride=(1, meta[p, 4]))
            atom_b, _ = cpasync.make_tiled_tma_atom(
                op_b, cute.make_tensor(b_ptr, b_layout), b_smem, (self.tile_n, TILE_K),
                num_multicast=self.cluster_m,
            )
            cpasync.copy_tensormap(atom_b, self._gmem_desc(address, 1))
        d_ptr = cute.make_ptr(self.d_dtype, meta[p, 2] + d_base, cute.AddressSpace.gmem,
                              assumed_align=16)
        tD = cute.make_tensor(d_ptr, cute.make_layout((rows, cols), stride=(meta[p, 5], 1)))
        atom_d, _ = cpasync.make_tiled_tma_atom(op_s2g, tD, d_smem, self.epi_tile)
        cpasync.copy_tensormap(atom_d, self._gmem_desc(address, 2))

    @cute.jit
    def read_record(
        self, sched_pipe: pipeline.PipelineAsync, sched: cute.Tensor,
        state: pipeline.PipelineState,
    ):
        """Every reading warp calls this once per record, in order (lane 0 releases)."""
        sched_pipe.consumer_wait(state)
        problem = sched[0, state.index]
        m_tile = sched[1, state.index]
        n_tile = sched[2, state.index]
        k_tiles = sched[3, state.index]
        row_start = sched[4, state.index]
        valid = sched[5, state.index]
        ring_slot = sched[6, state.index]
        k_start = sched[7, state.index]
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            sched_pipe.consumer_release(state)
        state.advance()
        return problem, m_tile, n_tile, k_tiles, row_start, valid, ring_slot, k_start, state

    # ------------------------------------------------------------------------------------------
    # Load warp

    @cute.jit
    def load_warp_role(
        self,
        ab_pipe: pipeline.PipelineTmaAsync,
        sched_pipe: pipeline.PipelineAsync,
        sched: cute.Tensor,
        tma_atom_a: cute.CopyAtom,
        tma_a: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        tma_b: cute.Tensor,
        sA: cute.Tensor,
        sB: cute.Tensor,
        workspace: cute.Tensor,
        a_policy: Int64,
        b_policy: Int64,
    ):
        if const_expr(self.form != "general"):
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        cta, _, _ = cute.arch.block_idx()
        ring = self._ring_base(workspace, cta)
        # Cluster: along M this CTA loads slice `rank` of B's tile and multicasts it to both
        # CTAs (mask 0b11), A is its own; along N the same for A.
        rank_m = Int32(0)
        rank_n = Int32(0)
        a_mask = None
        b_mask = None
        if const_expr(self.cluster_m > 1):
            rank_m = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            b_mask = cutlass.Int16((1 << self.cluster_m) - 1)
        if const_expr(self.cluster_n > 1):
            rank_n = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            a_mask = cutlass.Int16((1 << self.cluster_n) - 1)
        problem, m_tile, n_tile, k_tiles, row_start, valid, ring_slot, k_start, read_state = (
            self.read_record(sched_pipe, sched, read_state)
        )
        while problem >= 0:
            if const_expr(self.form == "general"):
                # (bM, bK, RestM, RestK) coordinates; the descriptor supplies base and bounds.
                gA = cute.local_tile(tma_a, (self.tile_m, TILE_K), (None, None))
                gB = cute.local_tile(tma_b, (self.tile_n, TILE_K), (None, None))
            elif const_expr(self.form == "batched"):
                gA = cute.local_tile(
                    tma_a[None, None, problem], (self.tile_m, TILE_K), (None, None)
                )
                gB = cute.local_tile(
                    tma_b[None, None, problem], (self.tile_n, TILE_K), (None, None)
                )
            else:
                gA = cute.local_tile(
                    cute.domain_offset((row_start, 0), tma_a), (self.tile_m, TILE_K), (None, None)
                )
                gB = cute.local_tile(
                    tma_b[None, None, problem], (self.tile_n, TILE_K), (None, None)
                )
            tAsA, tAgA = cpasync.tma_partition(
                tma_atom_a, rank_n, cute.make_layout(self.cluster_n), cute.group_modes(sA, 0, 2),
                cute.group_modes(gA, 0, 2),
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma_atom_b, rank_m, cute.make_layout(self.cluster_m), cute.group_modes(sB, 0, 2),
                cute.group_modes(gB, 0, 2),
            )
            # Warp-uniform descriptor addresses, computed before any elected region so ptxas
            # never needs a predicated R2UR (illegal on sm_90a, error 715).
            # (make_warp_uniform is 32-bit: apply it to the index, never to the address.)
            desc_base = ring + Int64(cute.arch.make_warp_uniform(ring_slot)) * SLOT_BYTES
            if const_expr(self.form == "general"):
                # The ring slot was (re)written by the scheduler warp for this record (and the
                # workspace is rewritten every launch, same address under CUDA-graph replay):
                # acquire the new descriptors so no stale cached copy is used.
                cpasync.fence_tma_desc_acquire(_generic_ptr(desc_base))
                cpasync.fence_tma_desc_acquire(_generic_ptr(desc_base + DESC_BYTES))
            for kk in cutlass.range(0, k_tiles, 1, unroll=1):
                k = kk + k_start  # (0 unless this is a tail split's upper half)
                ab_pipe.producer_acquire(ab_state)
                bar = ab_pipe.producer_get_barrier(ab_state)
                if const_expr(self.form == "general"):
                    # Under a cluster both CTAs hold the same problem's descriptors (the
                    # scheduler gives a cluster one problem and m-tile); each multicasts its
                    # share of the shared operand through its own copy.
                    cute.copy(
                        tma_atom_a, tAgA[(None, m_tile, k)], tAsA[(None, ab_state.index)],
                        tma_bar_ptr=bar, tma_desc_ptr=_desc_ptr_for_copy(desc_base),
                        mcast_mask=a_mask,
                        cache_policy=a_policy if const_expr(self.l2_hints) else None,
                    )
                    cute.copy(
                        tma_atom_b, tBgB[(None, n_tile, k)], tBsB[(None, ab_state.index)],
                        tma_bar_ptr=bar,
                        tma_desc_ptr=_desc_ptr_for_copy(desc_base + DESC_BYTES),
                        mcast_mask=b_mask,
                        cache_policy=b_policy if const_expr(self.l2_hints) else None,
                    )
                else:
                    cute.copy(
                        tma_atom_a, tAgA[(None, m_tile, k)], tAsA[(None, ab_state.index)],
                        tma_bar_ptr=bar, mcast_mask=a_mask,
                        cache_policy=a_policy if const_expr(self.l2_hints) else None,
                    )
                    cute.copy(
                        tma_atom_b, tBgB[(None, n_tile, k)], tBsB[(None, ab_state.index)],
                        tma_bar_ptr=bar, mcast_mask=b_mask,
                        cache_policy=b_policy if const_expr(self.l2_hints) else None,
                    )
                ab_pipe.producer_commit(ab_state)
                ab_state.advance()
            problem, m_tile, n_tile, k_tiles, row_start, valid, ring_slot, k_start, read_state = (
                self.read_record(sched_pipe, sched, read_state)
            )
        ab_pipe.producer_tail(ab_state)

    # ------------------------------------------------------------------------------------------
    # Math warpgroups

    @cute.jit
    def math_role(
        self,
        ab_pipe: pipeline.PipelineTmaAsync,
        sched_pipe: pipeline.PipelineAsync,
        sched: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sA: cute.Tensor,
        sB: cute.Tensor,
        sD: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        tma_d: cute.Tensor,
        workspace: cute.Tensor,
        trace: cute.Tensor,
        tidx: Int32,
        warp_idx: Int32,
        math_wg: Int32,  # 0 or 1
    ):
        if const_expr(self.pingpong):
            mma_tidx = tidx % self.threads_per_wg
            epi_threads = self.threads_per_wg
            epi_group = math_wg
            is_store_warp = warp_idx % 4 == 0
        else:
            mma_tidx = tidx - self.threads_per_wg
            epi_threads = 2 * self.threads_per_wg
            epi_group = Int32(0)
            is_store_warp = warp_idx == 4
        epi_bar_id = BAR_EPI + epi_group

        thr_mma = tiled_mma.get_slice(mma_tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        tma_d_2d = tma_d[None, None, 0] if const_expr(self.form == "batched") else tma_d
        gD_shape_probe = cute.local_tile(tma_d_2d, (self.tile_m, self.tile_n), (0, 0))
        tCgD = thr_mma.partition_C(gD_shape_probe)
        acc = cute.make_rmem_tensor(tCgD.shape, self.acc_dtype)
        num_k_blocks = cute.size(tCrA, mode=[2])

        # Epilogue: registers -> smem (stmatrix for 16-bit output) -> TMA store.
        copy_atom_c = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_layout.is_m_major_c(), 4),
            cutlass.Float16,  # only fixes the thread-value layout of the source fragment
        )
        tiled_copy_c_atom = cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
        copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(
            self.d_layout, elem_ty_d=self.d_dtype, elem_ty_acc=self.acc_dtype
        )
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, tiled_copy_c_atom)
        thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
        tRS_sD = thr_copy_r2s.partition_D(sD)
        tRS_rAcc = tiled_copy_r2s.retile(acc)
        rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))
        tRS_rD = cute.make_rmem_tensor(rD_shape[:3], self.acc_dtype)
        tRS_rD_out = cute.make_rmem_tensor(rD_shape[:3], self.d_dtype)
        size_rD = cute.size(tRS_rD)
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, epi_threads),
        )

        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        cta, _, _ = cute.arch.block_idx()
        ring = self._ring_base(workspace, cta)
        tiles_done = Int32(0)

        if const_expr(self.pingpong):
            if math_wg == 0:
                # Warpgroup 0 holds the first mainloop token.
                cute.arch.barrier_arrive(
                    barrier_id=BAR_MMA_ORDER, number_of_threads=2 * self.threads_per_wg
                )
        problem, m_tile, n_tile, k_tiles, row_start, valid, ring_slot, k_start, read_state = (
            self.read_record(sched_pipe, sched, read_state)
        )
        if const_expr(self.pingpong):
            if math_wg == 1:
                # Warpgroup 1 starts at the CTA's second tile: skip the first one's stages.
                if problem >= 0:
                    ab_state.advance(k_tiles)
                    problem, m_tile, n_tile, k_tiles, row_start, valid, ring_slot, k_start, read_state = (
                        self.read_record(sched_pipe, sched, read_state)
                    )
        while problem >= 0:
            if const_expr(self.pingpong):
                cute.arch.barrier(
                    barrier_id=BAR_MMA_ORDER + math_wg, number_of_threads=2 * self.threads_per_wg
                )
            ab_state = self.mainloop(ab_pipe, ab_state, tiled_mma, acc, tCrA, tCrB, k_tiles,
                                     num_k_blocks, math_wg)
            if const_expr(self.tail_split):
                role = valid & 3
                if role == ROLE_PUBLISH:
                    self._split_publish(acc, workspace, valid >> 2, mma_tidx)
                    valid = Int32(ROLE_SKIP)
                if role == ROLE_FINISH:
                    self._split_absorb(acc, workspace, valid >> 2, mma_tidx)
            if valid != 0:  # (always, without a cluster or a tail split)
                self.epilogue(
                    acc, tRS_rAcc, tRS_rD, tRS_rD_out, size_rD, tiled_copy_r2s, tRS_sD, sD,
                    tma_atom_d, tma_d, store_pipe, ring, problem, m_tile, n_tile, ring_slot,
                    epi_group,
                    epi_bar_id, epi_threads, is_store_warp, tiles_done,
                )
                if const_expr(self.trace):
                    if mma_tidx == 0:
                        slot = cutlass.min(tiles_done * (2 if self.pingpong else 1) + math_wg,
                                           trace.shape[1] - 1)
                        trace[cta, slot, 0] = problem
                        trace[cta, slot, 1] = m_tile
                        trace[cta, slot, 2] = n_tile
                        trace[cta, slot, 3] = math_wg
                tiles_done = tiles_done + 1
            problem, m_tile, n_tile, k_tiles, row_start, valid, ring_slot, k_start, read_state = (
                self.read_record(sched_pipe, sched, read_state)
            )
            if const_expr(self.pingpong):
                # The next record is the other warpgroup's tile: skip its stages.
                if problem >= 0:
                    ab_state.advance(k_tiles)
                    problem, m_tile, n_tile, k_tiles, row_start, valid, ring_slot, k_start, read_state = (
                        self.read_record(sched_pipe, sched, read_state)
                    )
        if is_store_warp:
            store_pipe.producer_tail()

    @cute.jit
    def _split_addresses(self, workspace: cute.Tensor, tail_i: Int32):
        """(counter, partial tile) of tail tile `tail_i` (constants.split_workspace_bytes)."""
        grid, _, _ = cute.arch.grid_dim()
        base = workspace.iterator.toint() + Int64(grid) * (DESC_RING * SLOT_BYTES)
        counter = cute.make_ptr(Int32, base + Int64(tail_i) * 4, cute.AddressSpace.gmem,
                                assumed_align=4)
        partial = base + SPLIT_COUNTER_BYTES + Int64(tail_i) * (self.tile_m * self.tile_n * 4)
        return counter, partial

    @cute.jit
    def _partial_tensor(self, acc: cute.Tensor, partial: Int64) -> cute.Tensor:
        """The slot as (accumulator index, math thread): each thread's fragment element i at
        i * 256 + thread, so a warp's stores and loads of one element are one 128-byte line."""
        n = cute.size(acc)
        threads = 2 * self.threads_per_wg
        return cute.make_tensor(
            cute.make_ptr(cutlass.Float32, partial, cute.AddressSpace.gmem, assumed_align=16),
            cute.make_layout((n, threads), stride=(threads, 1)),
        )

    @cute.jit
    def _split_publish(self, acc: cute.Tensor, workspace: cute.Tensor, tail_i: Int32,
                       mma_tidx: Int32):
        """Lower half of a split tile: fp32 accumulators to the slot, then counter += 1
        (release: every math thread's stores are fenced and joined at a barrier first)."""
        counter, partial = self._split_addresses(workspace, tail_i)
        part = self._partial_tensor(acc, partial)
        for i in cutlass.range_constexpr(cute.size(acc)):
            part[i, mma_tidx] = acc[i]
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=BAR_SPLIT, number_of_threads=2 * self.threads_per_wg)
        if mma_tidx == 0:
            cute.arch.atomic_add(counter, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _split_absorb(self, acc: cute.Tensor, workspace: cute.Tensor, tail_i: Int32,
                      mma_tidx: Int32):
        """Upper half of a split tile: wait for the publisher's counter (acquire), add its
        partial into acc, reset the counter to 0 for the next launch."""
        counter, partial = self._split_addresses(workspace, tail_i)
        if mma_tidx == 0:
            seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
            while seen == 0:
                seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
        cute.arch.barrier(barrier_id=BAR_SPLIT, number_of_threads=2 * self.threads_per_wg)
        cute.arch.fence_acq_rel_gpu()
        part = self._partial_tensor(acc, partial)
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] + part[i, mma_tidx]
        if mma_tidx == 0:
            cute.arch.atomic_exch(counter, Int32(0), sem="relaxed", scope="gpu")

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
    ) -> pipeline.PipelineState:
        """acc = A_tile @ B_tile over k_tiles stages (zeros when k_tiles == 0)."""
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.fence()
        release_state = ab_state.clone()
        # One WGMMA batch stays in flight (wait_group(1)): stage s is released once the
        # batch reading it has retired, i.e. one iteration later.
        if k_tiles > 0:
            ab_pipe.consumer_wait(ab_state)
            for kb in cutlass.range_constexpr(num_k_blocks):
                coord = (None, None, kb, ab_state.index)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            warpgroup.commit_group()
            ab_state.advance()
        for k in cutlass.range(1, k_tiles, 1, unroll=1):
            ab_pipe.consumer_wait(ab_state)
            for kb in cutlass.range_constexpr(num_k_blocks):
                coord = (None, None, kb, ab_state.index)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
            ab_pipe.consumer_release(release_state)
            release_state.advance()
            ab_state.advance()
        if const_expr(self.pingpong):
            # Every WGMMA of this tile is issued: the other warpgroup's mainloop may start
            # while this one drains and runs its epilogue.
            cute.arch.barrier_arrive(
                barrier_id=BAR_MMA_ORDER + 1 - math_wg, number_of_threads=2 * self.threads_per_wg
            )
        warpgroup.wait_group(0)
        if k_tiles > 0:
            ab_pipe.consumer_release(release_state)
        return ab_state

    @cute.jit
    def epilogue(
        self,
        acc: cute.Tensor,
        tRS_rAcc: cute.Tensor,
        tRS_rD: cute.Tensor,
        tRS_rD_out: cute.Tensor,
        size_rD: cutlass.Constexpr,
        tiled_copy_r2s: cute.TiledCopy,
        tRS_sD: cute.Tensor,
        sD: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        tma_d: cute.Tensor,
        store_pipe: pipeline.PipelineTmaStore,
        ring: Int64,
        problem: Int32,
        m_tile: Int32,
        n_tile: Int32,
        ring_slot: Int32,
        epi_group: Int32,
        epi_bar_id: Int32,
        epi_threads: cutlass.Constexpr,
        is_store_warp: cutlass.Boolean,
        tiles_done: Int32,
    ):
        if const_expr(self.form == "batched"):
            gD = cute.local_tile(tma_d[None, None, problem], (self.tile_m, self.tile_n),
                                 (m_tile, n_tile))
        else:
            gD = cute.local_tile(tma_d, (self.tile_m, self.tile_n), (m_tile, n_tile))
        gD_epi = cute.zipped_divide(gD, self.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(
            tma_atom_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_epi
        )
        epi_count = cute.size(gD_epi, mode=[1])
        epi_shape = gD_epi.shape[1]
        epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        # This record's slot of the CTA's ring (written by the scheduler warp).
        desc_d = ring + Int64(cute.arch.make_warp_uniform(ring_slot)) * SLOT_BYTES + 2 * DESC_BYTES
        if const_expr(self.form != "batched"):
            if is_store_warp:
                cpasync.fence_tma_desc_acquire(_generic_ptr(desc_d))  # see load_warp_role
        if const_expr(self.epi_whole):
            self._epilogue_whole(tRS_rAcc, tRS_rD, tRS_rD_out, size_rD, tiled_copy_r2s, tRS_sD,
                                 tma_atom_d, bSG_sD, bSG_gD, epi_layout, epi_count, desc_d,
                                 epi_bar_id, epi_threads, is_store_warp)
        else:
            for e in cutlass.range_constexpr(epi_count):
                for v in cutlass.range_constexpr(size_rD):
                    tRS_rD[v] = tRS_rAcc[e * size_rD + v]
                tRS_rD_out.store(tRS_rD.load().to(self.d_dtype))
                buf = epi_group * self.epi_stages + (tiles_done * epi_count + e) % self.epi_stages
                cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, buf)])
                # stmatrix writes go through the generic proxy; the TMA store reads through the
                # async proxy.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
                if is_store_warp:
                    if const_expr(self.form == "batched"):
                        cute.copy(
                            tma_atom_d, bSG_sD[(None, buf)],
                            bSG_gD[(None, epi_layout.get_hier_coord(e))],
                        )
                    else:
                        cute.copy(
                            tma_atom_d, bSG_sD[(None, buf)],
                            bSG_gD[(None, epi_layout.get_hier_coord(e))],
                            tma_desc_ptr=_desc_ptr_for_copy(desc_d),
                        )
                    store_pipe.producer_commit()
                    store_pipe.producer_acquire()
                cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)

    @cute.jit
    def _epilogue_whole(self, tRS_rAcc, tRS_rD, tRS_rD_out, size_rD: cutlass.Constexpr,
                        tiled_copy_r2s, tRS_sD, tma_atom_d, bSG_sD, bSG_gD, epi_layout,
                        epi_count: cutlass.Constexpr, desc_d: Int64, epi_bar_id: Int32,
                        epi_threads: cutlass.Constexpr, is_store_warp: cutlass.Boolean):
        """The whole tile to shared memory, then all its TMA stores (see __init__)."""
        if is_store_warp:
            # The previous tile's stores have read their buffers (issued a mainloop ago).
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
        for e in cutlass.range_constexpr(epi_count):
            for v in cutlass.range_constexpr(size_rD):
                tRS_rD[v] = tRS_rAcc[e * size_rD + v]
            tRS_rD_out.store(tRS_rD.load().to(self.d_dtype))
            cute.copy(tiled_copy_r2s, tRS_rD_out, tRS_sD[(None, None, None, e)])
        # stmatrix writes go through the generic proxy; the TMA store reads through the async
        # proxy.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=epi_bar_id, number_of_threads=epi_threads)
        if is_store_warp:
            for e in cutlass.range_constexpr(epi_count):
                if const_expr(self.form == "batched"):
                    cute.copy(tma_atom_d, bSG_sD[(None, e)],
                              bSG_gD[(None, epi_layout.get_hier_coord(e))])
                else:
                    cute.copy(tma_atom_d, bSG_sD[(None, e)],
                              bSG_gD[(None, epi_layout.get_hier_coord(e))],
                              tma_desc_ptr=_desc_ptr_for_copy(desc_d))
            cute.arch.cp_async_bulk_commit_group()

