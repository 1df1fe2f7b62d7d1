"""Problem accessors: one per problem form, so the kernel body never branches on the form.

Each accessor answers, for problem p of a launch, everything the warps need and nothing else:
its sizes (`dims`), its tile count (`tile_count`, for the scheduler's search), the TMA
descriptors the scheduler warp encodes into the record's workspace ring slot (`write_descs`),
the global views the load warp partitions (`load_views`) and the output tile the epilogue
stores (`store_view`), with the descriptor pointers each TMA copy takes (`load_desc`,
`store_desc`: None where the launch-time descriptor serves every problem).

- general: G problems with separate allocations, any (M, N, K) each, from a (G, 8) int64
  metadata table [a_ptr, b_ptr, d_ptr - d_base, a_ld, b_ld, d_ld, M | N << 32, K]. A, B and D
  descriptors are encoded per record (the launch-time atoms only fix dtype, major and box).
- varlen: x (T, K) rows [offs[p-1], offs[p]) against w[p]; problem E is the zero tail
  [offs[-1], T) when the host asks for it (num_problems = E + 1). Every descriptor is the
  launch-time one: A and B take the expert as a coordinate, and D is out seen as a ragged
  (T, N, T) tensor (`ragged_rows`) whose coordinates put each expert's end at the TMA
  unit's row bound, so a partial tile is clipped at the expert's end with nothing encoded on
  the GPU (no ring writes, fences or descriptor fetches per tile).
- batched: x (G, M, K), w (G, K, N), out (G, M, N): the problem is the third TMA mode of every
  launch-time descriptor; nothing is encoded on the GPU.
- masked: the batched operands with only the first counts[p] rows of problem p computed and
  stored (DeepGEMM's and DeepEP's low-latency layout: a fixed row capacity M per expert, the
  valid row counts on the GPU). A and B load as in the batched form; D is out seen as a
  ragged (M, N, M, G) tensor (`ragged_batched_rows`), so a partial tile stops at row
  counts[p] and the rows past it are never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

from .constants import DESC_BYTES
from .tile_scheduler import WorkTile, ceil_div_i32


@dsl_user_op
def desc_ptr_for_copy(address: Int64, *, loc=None, ip=None) -> cute.Pointer:
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


def generic_ptr(address: Int64) -> cute.Pointer:
    return cute.make_ptr(cutlass.Int8, address, cute.AddressSpace.generic,
                         assumed_align=DESC_BYTES)


def gmem_desc(ws_base: Int64, slot: int) -> cute.Pointer:
    """Descriptor `slot` (0: A, 1: B, 2: D) of the ring slot at ws_base, as a global pointer."""
    return cute.make_ptr(
        cutlass.Int64, ws_base + slot * DESC_BYTES, cute.AddressSpace.gmem,
        assumed_align=DESC_BYTES,
    )


def batch_last(t: cute.Tensor) -> cute.Tensor:
    """A (G, X, Y) tensor viewed as (X, Y, G): the problem index as the last mode, the batch
    mode of a TMA descriptor (the batched forms' operands, the batched scales)."""
    return cute.make_tensor(t.iterator, cute.make_layout(
        (t.shape[1], t.shape[2], t.shape[0]), stride=(t.stride[1], t.stride[2], t.stride[0])))


def ragged_rows(mD: cute.Tensor) -> cute.Tensor:
    """out (T, N) as a (T, N, T) tensor whose one TMA descriptor serves every expert.

    Element (T - rows + r, n, start + rows - 1) is out[start + r, n]: the pointer is moved
    back T - 1 rows, and the third mode (out's row stride again) adds them back with the
    expert's last row. The TMA unit bounds the first coordinate by T, so r >= rows (a row past
    the expert's end) is clipped exactly as a per-expert descriptor of `rows` rows would clip
    it. Every coordinate stays in [0, T) (an expert with rows has a last row). The moved-back
    base address is only ever offset forward again by the TMA unit, never dereferenced (the
    idea of Triton's ragged TMA descriptors)."""
    rows, ld = mD.shape[0], mD.stride[0]
    base = mD.iterator + (-(Int64(rows - 1) * ld))
    return cute.make_tensor(
        base, cute.make_layout((rows, mD.shape[1], rows), stride=(ld, mD.stride[1], ld)))


def ragged_batched_rows(mD: cute.Tensor) -> cute.Tensor:
    """out (G, M, N) as an (M, N, M, G) tensor whose one TMA descriptor clips each problem at
    its own row count: `ragged_rows` per problem (element (M - rows + r, n, rows - 1, g) is
    out[g, r, n]), the problem as the fourth mode. Any strides: nothing assumes the problems
    are adjacent in memory."""
    rows, ld = mD.shape[1], mD.stride[1]
    base = mD.iterator + (-(Int64(rows - 1) * ld))
    return cute.make_tensor(
        base, cute.make_layout((rows, mD.shape[2], rows, mD.shape[0]),
                               stride=(ld, mD.stride[2], ld, mD.stride[0])))


# Frozen dataclasses: the DSL carries a mutable object that a dynamic loop calls a method of
# through the loop; a frozen one is read-only, so it stays a compile-time object.
@dataclass(frozen=True, eq=False)
class Problems:
    """What every form shares: the kernel's static tile facts (`cfg` is the kernel object)."""

    cfg: object
    num_problems: Int32

    form: ClassVar[str] = ""
    uses_ring: ClassVar[bool] = True  # descriptors encoded per record into the workspace ring
    uniform: ClassVar[bool] = False  # every problem has the same tile count (by division)

    @cute.jit
    def tile_count(self, p: Int32, unit_m: cutlass.Constexpr, unit_n: cutlass.Constexpr
                   ) -> Int32:
        """Tiles of unit_m x unit_n (a cluster's tiles) of problem p; 0 past the last one."""
        count = Int32(0)
        if p < self.num_problems:
            rows, cols, _, _ = self.dims(p)
            count = ceil_div_i32(rows, unit_m) * ceil_div_i32(cols, unit_n)
        return count

    def split_depth(self, lane: Int32) -> Int32:
        """The K the tail split sizes its shares by (tail_split.TailSplit.plan): the forms
        whose problems share one K answer it (`common_depth`); the general form overrides."""
        return self.common_depth()

    def load_desc(self, desc_base: Int64, which: int):
        """The tma_desc_ptr of a load (0: A, 1: B): None = the launch-time descriptor."""
        return None

    def store_desc(self, desc_d: Int64):
        """The tma_desc_ptr of the epilogue's stores: the record's D descriptor."""
        return desc_ptr_for_copy(desc_d)

    def acquire_load_descs(self, desc_base: Int64):
        """Make the scheduler warp's descriptors of this record visible to the load warp."""

    @cute.jit
    def acquire_store_desc(self, desc_d: Int64, is_store_warp: cutlass.Boolean):
        # The slot was (re)written by the scheduler warp for this record: acquire it so no
        # stale cached copy is used (also under CUDA-graph replay, same address).
        if is_store_warp:
            cpasync.fence_tma_desc_acquire(generic_ptr(desc_d))

    def store_view(self, tma_d: cute.Tensor, work: WorkTile) -> cute.Tensor:
        """The (tile_m, d_tile_n) output tile of `work` in the D descriptor's coordinates
        (d_tile_n = tile_n, or tile_n / 2 for a gated epilogue)."""
        return cute.local_tile(tma_d, (self.cfg.tile_m, self.cfg.d_tile_n),
                               (work.m_tile, work.n_tile))

    def _write_d(self, address: Int64, d_ptr, rows: Int32, cols: Int32, ld, d_smem):
        atom_d, _ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(),
            cute.make_tensor(d_ptr, cute.make_layout((rows, cols), stride=(ld, 1))),
            d_smem, self.cfg.epi_tile,
        )
        cpasync.copy_tensormap(atom_d, gmem_desc(address, 2))


@dataclass(frozen=True, eq=False)
class GeneralProblems(Problems):
    meta: cute.Tensor  # (G, 8) int64
    meta32: cute.Tensor  # the same bytes as (G, 16) int32: M, N, K at columns 12..14
    d_base: Int64  # added to every row's D address

    form: ClassVar[str] = "general"

    @cute.jit
    def dims(self, p: Int32) -> tuple[Int32, Int32, Int32, Int32]:
        """(rows, cols, depth, row_start) of problem p (p must be a valid problem)."""
        return self.meta32[p, 12], self.meta32[p, 13], self.meta32[p, 14], Int32(0)

    @cute.jit
    def split_depth(self, lane: Int32) -> Int32:
        """The deepest problem's K, reduced by the warp: the split's ways are sized by it and
        each tile's shares divide its own K (a tile of fewer than SPLIT_MIN_K_TILES k-tiles,
        a K = 0 problem's among them, is not split; ways <= SPLIT_MIN_K_TILES, so every
        share of a split tile has a k-tile)."""
        deepest = Int32(0)
        p0 = Int32(0)
        while p0 < self.num_problems:
            depth = Int32(0)
            if p0 + lane < self.num_problems:
                depth = self.meta32[p0 + lane, 14]
            for step in cutlass.range_constexpr(5):
                depth = cutlass.max(depth, cute.arch.shuffle_sync_bfly(depth, offset=1 << step))
            deepest = cutlass.max(deepest, depth)
            p0 = p0 + 32
        return deepest

    @cute.jit
    def write_descs(self, address: Int64, p: Int32, rows_: Int32, row_start: Int32,
                    a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
                    d_smem: cute.ComposedLayout):
        """Problem p's A, B (when K > 0) and D descriptors at address + 0 / 128 / 256."""
        cfg = self.cfg
        meta = self.meta
        # Under a cluster the shared operand's descriptor has the multicast box (each CTA
        # loads 1 / cluster of the tile's rows for both), as the host-made atoms have.
        op_a = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(
            cfg.cluster_n > 1) else cpasync.CopyBulkTensorTileG2SOp()
        op_b = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(
            cfg.cluster_m > 1) else cpasync.CopyBulkTensorTileG2SOp()
        rows = Int32(meta[p, 6] & 0xFFFFFFFF)
        cols = Int32(meta[p, 6] >> 32)
        depth = Int32(meta[p, 7])
        if depth > 0:
            a_ptr = cute.make_ptr(cfg.ab_dtype, meta[p, 0], cute.AddressSpace.gmem,
                                  assumed_align=16)
            tA = cute.make_tensor(a_ptr, cute.make_layout((rows, depth), stride=(meta[p, 3], 1)))
            atom_a, _ = cpasync.make_tiled_tma_atom(op_a, tA, a_smem, (cfg.tile_m, cfg.tile_k),
                                                    num_multicast=cfg.cluster_n)
            cpasync.copy_tensormap(atom_a, gmem_desc(address, 0))
            b_ptr = cute.make_ptr(cfg.ab_dtype, meta[p, 1], cute.AddressSpace.gmem,
                                  assumed_align=16)
            if const_expr(cfg.b_major == "k"):
                b_layout = cute.make_layout((cols, depth), stride=(meta[p, 4], 1))
            else:
                b_layout = cute.make_layout((cols, depth), stride=(1, meta[p, 4]))
            atom_b, _ = cpasync.make_tiled_tma_atom(
                op_b, cute.make_tensor(b_ptr, b_layout), b_smem, (cfg.tile_n, cfg.tile_k),
                num_multicast=cfg.cluster_m,
            )
            cpasync.copy_tensormap(atom_b, gmem_desc(address, 1))
        d_ptr = cute.make_ptr(cfg.d_dtype, meta[p, 2] + self.d_base, cute.AddressSpace.gmem,
                              assumed_align=16)
        self._write_d(address, d_ptr, rows, cols, meta[p, 5], d_smem)

    def load_views(self, tma_a: cute.Tensor, tma_b: cute.Tensor, work: WorkTile):
        # (bM, bK, RestM, RestK) coordinates; the record's descriptors supply base and bounds.
        cfg = self.cfg
        return (cute.local_tile(tma_a, (cfg.tile_m, cfg.tile_k), (None, None)),
                cute.local_tile(tma_b, (cfg.tile_n, cfg.tile_k), (None, None)))

    def load_desc(self, desc_base: Int64, which: int):
        # Under a cluster both CTAs hold the same problem's descriptors (the scheduler gives
        # a cluster one problem); each multicasts its share of the shared operand through its
        # own copy.
        return desc_ptr_for_copy(desc_base + which * DESC_BYTES)

    def acquire_load_descs(self, desc_base: Int64):
        # The ring slot was (re)written by the scheduler warp for this record (and the
        # workspace is rewritten every launch, same address under CUDA-graph replay): acquire
        # the new descriptors so no stale cached copy is used.
        cpasync.fence_tma_desc_acquire(generic_ptr(desc_base))
        cpasync.fence_tma_desc_acquire(generic_ptr(desc_base + DESC_BYTES))


@dataclass(frozen=True, eq=False)
class VarlenProblems(Problems):
    mA: cute.Tensor  # x (T, K)
    mD: cute.Tensor  # out (T, N)
    offs: cute.Tensor  # (E,) int32 cumulative end rows, on the GPU

    form: ClassVar[str] = "varlen"
    uses_ring: ClassVar[bool] = False  # the launch-time descriptors serve every expert

    @cute.jit
    def expert_rows(self, p: Int32) -> tuple[Int32, Int32]:
        """(first row, row count) of expert p; p == E is the zero tail [offs[-1], T). With row
        counts (cfg.row_counts): [p * T / E, p * T / E + offs[p]).

        Offsets are clamped into [0, T] and a decreasing entry gives an empty expert, so
        unchecked offsets on the GPU can never address rows outside x or out. T is out's row
        count (x's too, except under gather-A, where x has the tokens and out the routed rows).
        """
        offs = self.offs
        T = self.mD.shape[0]
        E = offs.shape[0]
        start = Int32(0)
        rows = Int32(0)
        if const_expr(self.cfg.row_counts):
            # The masked layout: T / E rows of capacity per expert, offs[p] of them valid
            # (clamped into [0, T / E]); no zero tail.
            cap = T // E
            start = p * cap
            rows = cutlass.max(cutlass.min(offs[p], cap), Int32(0))
        else:
            if p > 0:
                start = cutlass.max(cutlass.min(offs[p - 1], T), Int32(0))
            end = T
            if p < E:
                end = cutlass.max(cutlass.min(offs[p], T), Int32(0))
            rows = cutlass.max(end - start, Int32(0))
        return start, rows

    def common_depth(self) -> Int32:
        """K of every expert (the zero tail's tiles load nothing whatever it is)."""
        return self.mA.shape[1]

    @cute.jit
    def dims(self, p: Int32) -> tuple[Int32, Int32, Int32, Int32]:
        """(rows, accumulator columns, depth, first row): a gated epilogue stores one output
        column per two accumulator columns, so tiles are counted over 2 * out's width."""
        row_start, rows = self.expert_rows(p)
        depth = self.mA.shape[1]
        if p >= self.offs.shape[0]:
            depth = Int32(0)  # the zero tail: store zeros, load nothing
        cols = self.mD.shape[1]
        if const_expr(self.cfg.gate is not None):
            cols = cols * 2
        return rows, cols, depth, row_start

    def store_desc(self, desc_d: Int64):
        return None

    @cute.jit
    def acquire_store_desc(self, desc_d: Int64, is_store_warp: cutlass.Boolean):
        pass

    def store_view(self, tma_d: cute.Tensor, work: WorkTile) -> cute.Tensor:
        """The tile in the ragged D (`ragged_rows`): the expert's rows end at the TMA unit's
        row bound T, so its row r is coordinate T - rows + r of the slice at its last row."""
        cfg = self.cfg
        last = work.row_start + work.rows - 1
        expert = cute.domain_offset((self.mD.shape[0] - work.rows, 0), tma_d[None, None, last])
        return cute.local_tile(expert, (cfg.tile_m, cfg.d_tile_n), (work.m_tile, work.n_tile))

    def load_views(self, tma_a: cute.Tensor, tma_b: cute.Tensor, work: WorkTile):
        cfg = self.cfg
        return (cute.local_tile(cute.domain_offset((work.row_start, 0), tma_a),
                                (cfg.tile_m, cfg.tile_k), (None, None)),
                cute.local_tile(tma_b[None, None, work.problem], (cfg.tile_n, cfg.tile_k),
                                (None, None)))

    def a_row_boxes(self, tma_a_rows: cute.Tensor, work: WorkTile, height: int, first: Int32
                    ) -> cute.Tensor:
        """The tile's A rows in (height, tile_k) boxes (trimmed A loads, trimmed_a.py): box
        b holds rows [first + b * height, ...) of the expert, `first` the tile's first row in
        it. Rows past x's end are zero filled by the TMA unit."""
        cfg = self.cfg
        return cute.local_tile(cute.domain_offset((work.row_start + first, 0), tma_a_rows),
                               (height, cfg.tile_k), (None, None))

    def b_halves(self, tma_b: cute.Tensor, work: WorkTile):
        """The concat gate layout's two B views, (tile_n / 2, tile_k) boxes: n-tile j loads
        gate rows [j * tile_n / 2, ...) and up rows [N / 2 + j * tile_n / 2, ...) of w's N.
        A last gate box past N / 2 reads up rows (their outputs are past out's width, clipped
        at the store); an up box past N is zero-filled by the TMA unit."""
        cfg = self.cfg
        half = (cfg.tile_n // 2, cfg.tile_k)
        b = tma_b[None, None, work.problem]
        return (cute.local_tile(b, half, (None, None)),
                cute.local_tile(cute.domain_offset((self.mD.shape[1], 0), b), half,
                                (None, None)))


@dataclass(frozen=True, eq=False)
class FusedVarlenProblems(VarlenProblems):
    """The varlen form with the fused MoE kernel's extra tensors (fused_moe.py): placeholders
    of one element where an option is off."""

    row_index: cute.Tensor  # (T,) int32: the row of x each routed row is (gather-A)
    row_weight: cute.Tensor  # (T,) fp32: each row's factor (row_scale)
    bias: cute.Tensor  # (E, N) fp32 in w's column order (bias)

    def num_experts(self) -> Int32:
        return self.offs.shape[0]


@dataclass(frozen=True, eq=False)
class BatchedProblems(Problems):
    mA: cute.Tensor  # x (G, M, K)
    mD: cute.Tensor  # out (G, M, N)

    form: ClassVar[str] = "batched"
    uses_ring: ClassVar[bool] = False
    uniform: ClassVar[bool] = True

    @cute.jit
    def dims(self, p: Int32) -> tuple[Int32, Int32, Int32, Int32]:
        return self.mA.shape[1], self.mD.shape[2], self.mA.shape[2], Int32(0)

    def common_depth(self) -> Int32:
        """K of every problem."""
        return self.mA.shape[2]

    @cute.jit
    def tiles_each(self, unit_m: cutlass.Constexpr, unit_n: cutlass.Constexpr) -> Int32:
        """Every problem's tile count (one (M, N, K) for all)."""
        return ceil_div_i32(self.mA.shape[1], unit_m) * ceil_div_i32(self.mD.shape[2], unit_n)

    def load_views(self, tma_a: cute.Tensor, tma_b: cute.Tensor, work: WorkTile):
        cfg = self.cfg
        return (cute.local_tile(tma_a[None, None, work.problem], (cfg.tile_m, cfg.tile_k),
                                (None, None)),
                cute.local_tile(tma_b[None, None, work.problem], (cfg.tile_n, cfg.tile_k),
                                (None, None)))

    def store_desc(self, desc_d: Int64):
        return None

    @cute.jit
    def acquire_store_desc(self, desc_d: Int64, is_store_warp: cutlass.Boolean):
        pass

    def store_view(self, tma_d: cute.Tensor, work: WorkTile) -> cute.Tensor:
        return cute.local_tile(tma_d[None, None, work.problem],
                               (self.cfg.tile_m, self.cfg.tile_n), (work.m_tile, work.n_tile))


@dataclass(frozen=True, eq=False)
class MaskedProblems(BatchedProblems):
    """The batched operands, problem p's rows limited to counts[p] (clamped into [0, M], so
    unchecked counts on the GPU never address rows outside the problem). Tile counts differ
    per problem, so the scheduler searches (device visitor) instead of dividing."""

    counts: cute.Tensor  # (G,) int32 valid rows per problem, on the GPU

    form: ClassVar[str] = "masked"
    uniform: ClassVar[bool] = False

    @cute.jit
    def dims(self, p: Int32) -> tuple[Int32, Int32, Int32, Int32]:
        M = self.mA.shape[1]
        rows = cutlass.max(cutlass.min(self.counts[p], M), Int32(0))
        return rows, self.mD.shape[2], self.mA.shape[2], Int32(0)

    def store_view(self, tma_d: cute.Tensor, work: WorkTile) -> cute.Tensor:
        """The tile in the ragged D (`ragged_batched_rows`): the problem's rows end at the TMA
        unit's row bound M, so its row r is coordinate M - rows + r of the slice at its last
        row (a tile exists only where rows > 0)."""
        cfg = self.cfg
        M = self.mD.shape[1]
        problem = cute.domain_offset((M - work.rows, 0),
                                     tma_d[None, None, work.rows - 1, work.problem])
        return cute.local_tile(problem, (cfg.tile_m, cfg.tile_n), (work.m_tile, work.n_tile))
