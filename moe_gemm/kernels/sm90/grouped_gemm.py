"""GroupedGemmSm90: a persistent, warp-specialized grouped GEMM for sm_90a in CuTe DSL.

One launch (a single kernel) computes D_p = A_p @ B_p for every problem p of a set. Three
problem forms share the kernel body and differ only in where operands and sizes come from
(problems.py has one accessor per form):

- general: G problems with separate allocations and any (M, N, K) each, described by a
  (G, 8) int64 metadata table. For each of its tiles the scheduler warp encodes the problem's
  A, B and D TMA descriptors on the GPU into a slot of a per-CTA ring in the workspace
  (DESC_RING slots, reused only after every warp is done with them), so no descriptor is ever
  modified while in use and the host never calls the driver per problem.
- varlen (MoE): x (T, K), w (E, K, N) in either major, offs (E,) int32 on the GPU. A and B use
  one descriptor each (the expert selected by coordinates); D is one descriptor of out seen
  as a ragged (T, N, T) tensor (problems.ragged_rows) in which each expert's rows end at
  the TMA unit's row bound, so a partial tile at an expert boundary is clipped and never
  touches the neighbour's rows, with nothing encoded on the GPU. No host synchronisation:
  CUDA-graph safe.
- batched: x (G, M, K), w (G, K, N), out (G, M, N), the same (M, N, K) for every problem
  (torch.bmm's and F.grouped_mm's 3D x 3D form). Every operand is one rank-3 TMA descriptor
  whose third mode is the problem, so there is no prologue kernel, no per-problem descriptor
  and no descriptor fence: a problem switch is only a new coordinate. The scheduler finds a
  tile's problem by division (every problem has the same tile count).
- masked: the batched operands with only the first counts[p] rows of problem p (counts (G,)
  int32 on the GPU, passed as `offs`): DeepGEMM's masked layout, as DeepEP's low-latency
  dispatch hands tokens over. D is clipped per problem at its row count (problems.py), the
  scheduler searches as for varlen; device visitor only.

Warp roles (384 threads = 3 warpgroups):
- warpgroup 0 (producer, 40 registers; 24 beside heavy accumulators): warp 0 issues TMA loads
  of A and B into an `ab_stages`-deep shared-memory ring (PipelineTmaAsync); warp 1 is the
  scheduler (tile_scheduler.TileScheduler): it finds each of the CTA's tiles and publishes
  them as WorkTile records through a small mbarrier ring that the load warp and every math
  warp read.
- warpgroups 1 and 2 (math, 232 registers; 240 beside heavy accumulators): WGMMA from shared
  memory, fp32 accumulators, then the epilogue (epilogue.py): convert, store through shared
  memory (stmatrix) and TMA.
  * cooperative: both warpgroups split one tile along M: 128 rows (one m64 WGMMA each per
    k-block) or 256 rows (two each, interleaved: warpgroup 0 has rows 0-63 and 128-191).
  * pingpong: each warpgroup owns whole tiles (the CTA's even and odd tiles) of 64 or 128
    rows; two named barriers order their mainloops, so one warpgroup's epilogue overlaps the
    other's WGMMAs. The shared A/B ring is consumed in tile order: a warpgroup skips the
    other's tile by advancing its ring state by that tile's own k-tile count (K differs per
    problem).
- Clusters (2x1: B multicast between vertically adjacent tiles; 1x2: A between horizontally
  adjacent ones), both schedules: the two CTAs take the two tiles of one cluster tile of one
  problem in lockstep; a CTA past the problem's edge loads its half of the shared operand and
  computes, but stores nothing.

Tail split (compile-time `tail_split`, `split_ways`; both schedules, any cluster, device
visitor, general, varlen and batched forms; tail_split.py): a last wave that fills at most
half the grid runs each tile (cluster tile) as up to `split_ways` shares of K on as many CTAs
(clusters), joined through fp32 workspace slots.

Trimmed A loads (compile-time `trim_a`; varlen form, A loaded by TMA: no gather-A;
trimmed_a.py): an expert's last tile loads only its expert's rows of A, rounded up to 16, as
64-, 32- and 16-row boxes, and arms its stages with those bytes (in a 1x2 cluster the first
CTA multicasts the boxes to both).

Packed pairs (compile-time `packed_pairs`; varlen form, 2x1 clusters, device visitor, no tail
split or gather-A; tile_scheduler.TileScheduler._packed_work): the cluster's two CTAs take two
consecutive tiles of the tile order, across experts, so an expert with an odd count of m-tiles
adds no tile computed past its end; B is multicast where the pair shares an expert and a column
(WorkTile.b_alone otherwise: each CTA loads B's whole box through its own atom). Every expert
has the same K, so the two CTAs' A/B rings stay in step; the zero tail runs as cluster tiles.

Swapped tiles (swapped.SwappedGemmSm90, a subclass; varlen form): each expert computed as
out^T = w^T x^T, 128 weight columns on the WGMMA's M side and up to 256 routed rows on its N
side in 16-row steps, so an expert computes fewer than 16 padding rows; the hooks it
overrides here are store_tensor (the transposed ragged D), tile_row_span (its even row split
for the trimmed A loads) and make_problems / make_epilogue / math_role. Its fused subclass
(swapped_fused.py) adds the gated epilogue over concat weights, a bias and row weights; its
math warpgroups exchange the up values through epi_scratch_floats of shared memory.

Fused MoE options (compile-time, varlen form, all off by default; constants.fused_problem,
fused_moe.FusedMoeGemmSm90 takes their tensors): a gated epilogue that stores act(gate) * up
(fused_epilogue.py; the "concat" gate layout loads B's tile as two half boxes), a per-expert
bias, per-row weights, and gather-A (gather.py: the producer warpgroup's four warps load A's
rows through an index with cp.async, completing the stage's full barrier beside B's TMA).

Constraints: bf16/fp16 inputs, fp32 accumulation, bf16/fp16/fp32 output; A K-major; B K- or
N-major; every TMA operand 16-byte aligned with 16-byte-multiple strides (ops/support.py
checks this before we get here); tile_k = 64 (one 128-byte swizzle row of 16-bit data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, Int64, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator, get_smem_capacity_in_bytes
from cutlass.tensor_utils import LayoutEnum

from .constants import (
    A_ROW_BOXES,
    GATHER_FIRST_WARP,
    GATHER_WARPS,
    REGS_GATHER,
    SCHED_STAGES,
    SIGMOID_GATES,
    SLOT_BYTES,
    SPLIT_WAYS,
    TILE_K,
    ab_stage_limit,
    epilogue_staging,
    fused_problem,
    gather_rows_in_registers,
    register_split,
    tile_problem,
)
from .epilogue import BAR_EPI, Epilogue
from .gather import RowGather, gather_role
from .problems import (
    BatchedProblems,
    GeneralProblems,
    MaskedProblems,
    VarlenProblems,
    batch_last,
    ragged_batched_rows,
    ragged_rows,
)
from .tail_split import TailSplit
from .tile_scheduler import (
    RECORD_INTS,
    ROLE_FINISH,
    ROLE_PUBLISH,
    ROLE_SKIP,
    TileScheduler,
    WorkTile,
    consume_work,
    ring_base,
)
from .trimmed_a import box_heights, trimmed_a

Form = Literal["general", "varlen", "batched", "masked"]
Schedule = Literal["cooperative", "pingpong"]
Visitor = Literal["device", "host"]

TRACE_INTS = 4  # debug trace record: (problem, m_tile, n_tile, warpgroup)

# L2 eviction priorities for TMA loads (the createpolicy encodings CUTLASS uses, sm90).
EVICT_NORMAL = 0x1000000000000000
EVICT_FIRST = 0x12F0000000000000
EVICT_LAST = 0x14F0000000000000

# Named barrier ids (0 is __syncthreads). Each role owns its ids: epilogue.BAR_EPI (2, 3),
# the ping-pong mainloop order (4, 5), tail_split.BAR_SPLIT (6; ping-pong's second
# warpgroup 8), swapped_fused.BAR_GATED_STORE (7).
BAR_MMA_ORDER = 4  # + warpgroup index: pingpong "your mainloop may start" tokens


class ArgGroup:
    """Kernel arguments that travel as one parameter: the DSL flattens every field to its
    values at the launch and rebuilds the group inside the kernel."""

    FIELDS: tuple[str, ...] = ()

    def __init__(self, *values):
        for name, value in zip(self.FIELDS, values, strict=True):
            setattr(self, name, value)

    def __extract_mlir_values__(self):
        values, self._counts = [], []
        for name in self.FIELDS:
            v = cutlass.extract_mlir_values(getattr(self, name))
            self._counts.append(len(v))
            values += v
        return values

    def __new_from_mlir_values__(self, values):
        fields, i = [], 0
        for name, n in zip(self.FIELDS, self._counts):
            fields.append(cutlass.new_from_mlir_values(getattr(self, name), values[i:i + n]))
            i += n
        return type(self)(*fields)


@dataclass(frozen=True, eq=False)
class TmaOperands:
    """The launch-time TMA atoms and tensors of A, B and D, as the roles get them. (They enter
    the kernel as separate parameters: the DSL passes a copy atom's descriptor as a kernel
    parameter of its own, which a group would hide.)"""

    atom_a: cute.CopyAtom
    tma_a: cute.Tensor
    atom_b: cute.CopyAtom
    tma_b: cute.Tensor
    atom_d: cute.CopyAtom
    tma_d: cute.Tensor
    # The staged scales' loads (staged_scale_floats); D's atom and tensor where there are none.
    atom_sa: cute.CopyAtom
    tma_sa: cute.Tensor
    atom_sb: cute.CopyAtom
    tma_sb: cute.Tensor
    # A in boxes of each A_ROW_BOXES height (trim_a: an expert's last tile, trimmed_a.py);
    # A's own atom and tensor where unused.
    atom_a64: cute.CopyAtom
    tma_a64: cute.Tensor
    atom_a32: cute.CopyAtom
    tma_a32: cute.Tensor
    atom_a16: cute.CopyAtom
    tma_a16: cute.Tensor
    # B's whole box for this CTA alone (packed pairs: a pair of tiles that do not share B's
    # columns); B's own atom and tensor where unused.
    atom_b1: cute.CopyAtom
    tma_b1: cute.Tensor

    def a_row_atoms(self) -> tuple[tuple, tuple]:
        """The A_ROW_BOXES atoms and tensors, in A_ROW_BOXES' order."""
        return ((self.atom_a64, self.atom_a32, self.atom_a16),
                (self.tma_a64, self.tma_a32, self.tma_a16))


class ProblemArgs(ArgGroup):
    """Where the problems come from (each form reads its own; problems.py)."""

    FIELDS = ("mA", "mD", "meta", "meta32", "offs", "table", "num_problems", "d_base")


class RunArgs(ArgGroup):
    """Per-launch choices and buffers: workspace (descriptor rings, tail-split slots), the debug
    trace, the raster code and the L2 policies of the loads."""

    FIELDS = ("workspace", "trace", "raster", "a_policy", "b_policy")


class GroupedGemmSm90:
    """Persistent warp-specialized grouped GEMM (see the module docstring for the design).

    Args (all compile-time; nothing here varies with the problem set):
        ab_dtype: cutlass.BFloat16 or cutlass.Float16.
        d_dtype: cutlass.BFloat16, cutlass.Float16 or cutlass.Float32.
        b_major: "k" (B stored (N, K) K-contiguous, e.g. w.T of a Linear weight) or "n".
        form: "general", "varlen", "batched" or "masked".
        schedule: "cooperative" or "pingpong".
        visitor: "device" or "host".
        tile_mn: (tile_m, tile_n) per CTA (cooperative) or per warpgroup (pingpong); the
            rules are constants.tile_problem's.
        ab_stages: A/B ring depth; None = as many as shared memory holds.
        trace: record (problem, m_tile, n_tile, warpgroup) per executed tile (debug).
        l2_hints: TMA loads carry the run-time a_policy / b_policy L2 eviction hints.
        epi_n: cooperative epilogue subtile width; gcd(epi_n, tile_n) columns are used.
        cluster_m, cluster_n: (1, 1), (2, 1) or (1, 2); the device visitor.
        epi_whole: whole-tile epilogue (cooperative 128-row tiles, 16-bit output).
        tail_split: split a last wave of at most half the grid over K (tail_split.py).
        split_ways: the most CTAs one tail tile is split over (2 to 16).
        row_counts: varlen form: `offs` holds per-expert row counts and expert p's rows are
            [p * T / E, p * T / E + offs[p]) (the masked layout with the fused options).
        gate, gate_layout, gate_alpha, gate_limit, bias, row_scale, gather_a, fast_gate: the
            fused MoE options (varlen form; constants.fused_problem; all off by default). The
            fused epilogue (fused_epilogue.py) and the extra tensors they read come with
            fused_moe.FusedMoeGemmSm90, whose launch takes them.

    Every refusal is a ValueError raised here, before anything is traced.
    """

    # K per pipeline stage: one 128-byte swizzle row of the input dtype (64 16-bit values;
    # the FP8 subclass, grouped_gemm_fp8.py, takes 128).
    tile_k: int = TILE_K
    # fp32 values per A/B stage (a slot) that the load warp's TMA copies beside the operands,
    # and their bytes, which the stage's full barrier also waits for (the FP8 subclass's staged
    # block scales; none here). A subclass that sets them provides scale_tma_atoms(args) (two
    # extra TMA loads, traced in build_and_launch) and scale_loads(tma, work, staged), an
    # object whose fill_stage(k, stage, barrier) issues k-tile k's copies.
    staged_scale_floats: int = 0
    staged_tx_bytes: int = 0
    # fp32 values of shared memory the math warpgroups exchange in the epilogue (the swapped
    # gated kernel's up accumulators, swapped_fused.py; none here). A subclass that sets it
    # keeps them within the epilogue staging its stage count was planned with.
    epi_scratch_floats: int = 0

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
        split_ways: int = SPLIT_WAYS,
        gate: str | None = None,
        gate_layout: str = "concat",
        gate_alpha: float = 0.0,
        gate_limit: float = 0.0,
        bias: bool = False,
        row_scale: bool = False,
        gather_a: bool = False,
        gather_fence: bool = True,
        fast_gate: bool = False,
        row_counts: bool = False,
        trim_a: bool = False,
        peek_wait: bool = False,
        packed_pairs: bool = False,
    ):
        self.ab_dtype = ab_dtype
        self.d_dtype = d_dtype
        self.acc_dtype = cutlass.Float32
        self.b_major = b_major
        self.form = form
        self.schedule = schedule
        self.visitor = visitor
        self.tile_m, self.tile_n = tile_mn
        self.tile_shape_mnk = (self.tile_m, self.tile_n, self.tile_k)
        self.trace = trace
        # TMA loads carry the runtime a_policy / b_policy L2 eviction hints only when built
        # with l2_hints: without them the loads use the default policy, which measured as
        # fast or faster on every suite shape (H200, 2026-11-21; AGENTS.md).
        self.l2_hints = l2_hints
        self.pingpong = schedule == "pingpong"
        if form not in ("general", "varlen", "batched", "masked"):
            raise ValueError(f"unknown problem form {form!r}")
        if visitor not in ("device", "host"):
            raise ValueError(f"unknown visitor {visitor!r}")
        if form == "masked" and visitor != "device":
            raise ValueError("the masked form reads its row counts on the GPU: device visitor")
        if b_major not in ("k", "n"):
            raise ValueError(f"b_major must be 'k' or 'n'; got {b_major!r}")
        why = tile_problem(schedule, self.tile_m, self.tile_n)
        if why is not None:
            raise ValueError(why)
        # Thread-block cluster of two CTAs on adjacent tiles of one problem. 2x1 (along M):
        # they share B's tile_n x 64 slice per k-step; each loads half and TMA multicasts it
        # to both, cutting the L2->SM bytes per CTA from (tile_m + tile_n) to
        # (tile_m + tile_n / 2) rows per k-step (128x256: 48 -> 32 KiB). 1x2 (along N): the
        # same for A (48 -> 40 KiB), and each A tile is fetched once for both n-tiles.
        if (cluster_m, cluster_n) not in ((1, 1), (2, 1), (1, 2)):
            raise ValueError(f"cluster {cluster_m}x{cluster_n} unsupported (1x1, 2x1, 1x2)")
        if cluster_m * cluster_n > 1 and visitor != "device":
            raise ValueError("clusters are built for the device visitor")
        self.cluster_m = cluster_m
        self.cluster_n = cluster_n
        self.cluster_size = cluster_m * cluster_n
        # Tail split (constants.py): a last wave that fills at most half the grid runs each
        # tile as shares of K on several CTAs, joined through fp32 workspace slots.
        if not 2 <= split_ways <= 16:
            raise ValueError(f"split_ways must be 2 to 16; got {split_ways!r}")
        self.split_ways = split_ways
        if tail_split and (visitor != "device" or form == "masked"):
            raise ValueError("the tail split is built for the general, varlen and batched "
                             "forms and the device visitor")
        self.tail_split = tail_split
        # Row counts (varlen form): offs holds each expert's row count and expert p's rows
        # start at p * (T / E), the masked layout seen as one (E * M, K) x (problems.py).
        if row_counts and (form != "varlen" or tail_split or gather_a):
            raise ValueError("row counts are built for the varlen form, without the tail split "
                             "and gather-A")
        self.row_counts = row_counts
        # Fused MoE options (constants.py): a gated epilogue stores one output column per
        # gate/up pair of accumulator columns, so the stored tile is half as wide.
        self.gate = gate or None
        self.gate_layout = gate_layout
        self.gate_alpha = float(gate_alpha)
        self.gate_limit = float(gate_limit)
        self.has_bias = bias
        self.row_scale = row_scale
        self.gather_a = gather_a
        self.gather_fence = gather_fence  # (see _acquire_gathered)
        # The sigmoid of SiLU / gpt-oss's clamped SwiGLU from MUFU.EX2 and MUFU.RCP
        # (fused_epilogue.sigmoid_fast), the library's default (MOE_GEMM_FUSED_FAST_GATE=0:
        # the IEEE exp and divide, ~22 instructions a value with a slow-path call).
        if fast_gate and self.gate not in SIGMOID_GATES:
            raise ValueError(f"fast_gate needs a sigmoid gate ({', '.join(SIGMOID_GATES)}); "
                             f"got {self.gate!r}")
        self.fast_gate = fast_gate
        self.fused = bool(self.gate or bias or row_scale or gather_a)
        if self.fused:
            why = fused_problem(form, schedule, self.tile_m, self.tile_n, b_major, cluster_n,
                                self.gate or "", gate_layout, gather_a)
            if why is not None:
                raise ValueError(why)
        self.gate_halves = self.gate is not None and gate_layout == "concat"
        # Trimmed A (varlen, trimmed_a.py): an expert's last tile loads only the A rows it
        # has, rounded up to 16. Needs A loaded by TMA (no gather).
        if trim_a and (form != "varlen" or gather_a):
            raise ValueError("trimmed A loads are built for the varlen form, without gather-A")
        self.trim_a = trim_a
        # Packed pairs (varlen, 2x1 cluster, device visitor; the scheduler's run): the two
        # CTAs of a cluster take two consecutive tiles of the tile order, across experts, so
        # an expert with an odd count of m-tiles costs no extra tile; B is multicast where the
        # pair shares an expert and a column of tiles, loaded by each CTA alone where not.
        # (The concat gate layout's up half is always multicast: not with them.)
        if packed_pairs and (form != "varlen" or (cluster_m, cluster_n) != (2, 1)
                             or visitor != "device" or tail_split or gather_a
                             or self.gate_halves):
            raise ValueError("packed pairs are built for the varlen form in 2x1 clusters with "
                             "the device visitor, without the tail split, gather-A or the "
                             "concat gate layout")
        self.packed_pairs = packed_pairs
        # Peeked stage waits: the math warps test the next stage's full barrier (try_wait)
        # right after releasing the current one, so the WGMMAs of the next k-tile issue without
        # a blocking wait when its operands have landed. QuACK's mainloop does this; ours waited
        # at the top of every k-tile (ncu, Kimi-K2 gate/up: 56% of the math warps' stall
        # samples asleep in that wait, with 3 stages where QuACK ran 4).
        self.peek_wait = peek_wait
        self.d_tile_n = self.tile_n // 2 if self.gate else self.tile_n

        # Ping-pong: each warpgroup's m64 row block, its own epilogue buffers; cooperative:
        # the two warpgroups' row blocks stacked, one set of buffers.
        self.atom_layout_mnk = (1, 1, 1) if self.pingpong else (2, 1, 1)
        self.mma_tiler_mn = (64, self.tile_n)
        if epi_n not in (16, 32, 64):
            raise ValueError(f"epilogue subtile width {epi_n} unsupported (16, 32, 64)")

        self.threads_per_wg = 128
        self.num_math_wgs = 2
        self.threads = (1 + self.num_math_wgs) * self.threads_per_wg
        self.load_warp = 0
        self.sched_warp = 1
        self.load_regs, self.math_regs = register_split(schedule, self.tile_m, self.tile_n)
        # Gather-A: the rows' indices in registers (and the 56 / 224 split) or in shared
        # memory (constants.gather_rows_in_registers).
        self.gather_rows_in_smem = gather_a and not gather_rows_in_registers(
            schedule, self.tile_m, self.tile_n)
        if gather_a and not self.gather_rows_in_smem:
            self.load_regs, self.math_regs = REGS_GATHER
        # Epilogue staging (constants.epilogue_staging): 4 x (128 x 32) subtiles cooperative
        # (32 KiB at bf16), 2 x (64 x 32) per warpgroup in ping-pong. The whole-tile epilogue
        # (cooperative 128-row tiles, 16-bit output) has a buffer for every subtile (128 x 256
        # bf16 = 64 KiB), so the warpgroups write the whole tile to shared memory between two
        # barriers and one warp issues all its TMA stores: 2 named-barrier syncs per tile
        # instead of 2 per subtile (16 at 128x256).
        self.epi_whole = epi_whole
        if epi_whole and (self.pingpong or d_dtype.width != 16 or self.tile_m != 128):
            raise ValueError("the whole-tile epilogue is built for cooperative 128-row "
                             "tiles with 16-bit output")
        self.epi_tile, self.epi_stages, self.num_epi_groups = epilogue_staging(
            schedule, self.d_tile_n, epi_n, epi_whole)
        self.buffer_align = 1024  # 128-byte swizzle atoms need 1 KiB aligned buffers
        self.ab_stages = self._stage_count(ab_stages)
        self.epi = self.make_epilogue()

    def make_epilogue(self) -> Epilogue:
        """The epilogue object (fused_moe.FusedMoeGemmSm90 makes the fused one)."""
        return Epilogue(self)

    def _stage_count(self, requested: int | None) -> int:
        """A/B ring depth in the shared memory an sm90 CTA may use (constants.ab_stage_limit,
        which may shrink the epilogue staging to make room for 3 stages, or for a pinned
        depth the default staging cannot hold)."""
        stages, self.epi_stages = ab_stage_limit(
            self.tile_m, self.tile_n, self.tile_k, self.ab_dtype.width, self.d_dtype.width,
            self.epi_tile, self.epi_stages, self.num_epi_groups, self.epi_whole,
            get_smem_capacity_in_bytes("sm_90"), want=requested,
            extra_bytes=self.tile_m * 4 if self.gather_rows_in_smem else 0,
            stage_extra_bytes=self.staged_scale_floats * 4)
        if requested is not None:
            if requested > stages:
                raise ValueError(f"{requested} A/B stages of {self.tile_m}x{self.tile_n} do not "
                                 f"fit in shared memory; at most {stages}")
            stages = requested
        if stages < 2:
            raise ValueError(f"tile {self.tile_m}x{self.tile_n} is too large for shared memory")
        return stages

    # ------------------------------------------------------------------------------------------
    # Setup (trace time, host side)

    def _setup(self) -> None:
        self.a_layout = LayoutEnum.ROW_MAJOR  # (M, K), K contiguous
        self.b_layout = LayoutEnum.ROW_MAJOR if self.b_major == "k" else LayoutEnum.COL_MAJOR
        self.d_layout = LayoutEnum.ROW_MAJOR
        self.tiled_mma = self.make_tiled_mma()
        # The epilogue's copy is laid out as the C fragment of this MMA: the kernel's own, or
        # for a gated epilogue one of half the width (the output tile; fused_epilogue.py).
        self.epi_mma = self.make_tiled_mma(self.d_tile_n) if self.gate else self.tiled_mma
        self.a_smem_staged = self._staged_smem_layout(
            (self.tile_m, self.tile_k), self.a_layout, self.ab_dtype, self.ab_stages, k_major=True
        )
        self.b_smem_staged = self._staged_smem_layout(
            (self.tile_n, self.tile_k), self.b_layout, self.ab_dtype, self.ab_stages,
            k_major=self.b_major == "k",
        )
        if self.trim_a:
            self.a_box_smem = {h: self._staged_smem_layout(
                (h, self.tile_k), self.a_layout, self.ab_dtype, 1, k_major=True)
                for h in box_heights(self.tile_m)}
        if self.gate_halves:
            # One half of B's tile (K-major): tile_n / 2 rows of 128 bytes, a multiple of the
            # 8-row swizzle atom, so the half at row tile_n / 2 has the same swizzle phase.
            self.b_half_smem = self._staged_smem_layout(
                (self.tile_n // 2, self.tile_k), self.b_layout, self.ab_dtype, 1, k_major=True)
        d_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.d_layout, self.d_dtype, self.epi_tile[1]),
            self.d_dtype,
        )
        self.d_smem_staged = cute.tile_to_shape(
            d_atom,
            (*self.epi_tile, self.epi_stages * self.num_epi_groups),
            order=(0, 1, 2),
        )

    def make_tiled_mma(self, tile_n: int | None = None) -> cute.TiledMma:
        """WGMMA m64 x tile_n per warpgroup; cooperative stacks the two warpgroups along M."""
        b_major = OperandMajorMode.K if self.b_major == "k" else OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            OperandMajorMode.K,
            b_major,
            self.acc_dtype,
            self.atom_layout_mnk,
            tiler_mn=self.mma_tiler_mn if tile_n is None else (64, tile_n),
        )

    @staticmethod
    def _staged_smem_layout(shape, layout, dtype, stages, k_major: bool):
        # The swizzle atom follows the operand's contiguous extent: 128 B (64 16-bit values)
        # where it divides it, else 64 B or 32 B (N-major B of 160 / 224 or 208 columns).
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
        offs: cute.Tensor,  # varlen: (E,) int32 cumulative end rows; masked: (G,) int32 row
        #                   counts; general, batched: unused (1,)
        table: cute.Tensor,  # host visitor: (num_ctas, entries, 2) int32; else (1, 1, 2)
        workspace: cute.Tensor,  # (num_ctas * DESC_RING * 3 * 16,) int64: descriptor rings
        trace: cute.Tensor,  # debug: (num_ctas, max_tiles, 4) int32; else (1, 1, 4)
        num_problems: Int32,  # general: G; varlen: E + 1 if the zero tail is on, else E
        num_ctas: Int32,
        swizzle: Int32,  # the raster code (constants.raster_code)
        a_policy: Int64,  # L2 eviction priority for A loads (EVICT_* above)
        b_policy: Int64,  # and for B loads
        pdl: Int32,  # 1: launch the main kernel with programmatic dependent launch
        d_base: Int64,  # general: added to every row's D address (the host's output block,
        #                 so one metadata upload serves calls whose outputs are new); else 0
        stream: cuda.CUstream,
    ):
        self.build_and_launch(
            mA, mW, mD, ProblemArgs(mA, mD, meta, meta32, offs, table, num_problems, d_base),
            RunArgs(workspace, trace, swizzle, a_policy, b_policy), num_ctas, pdl, stream)

    @cute.jit
    def build_and_launch(self, mA: cute.Tensor, mW: cute.Tensor, mD: cute.Tensor,
                         args: ProblemArgs, run: RunArgs, num_ctas: Int32, pdl: Int32,
                         stream: cuda.CUstream):
        """The body of __call__ (traced inside it), shared with the fused kernel's entry,
        whose `args` carry its extra tensors (fused_moe.FusedMoeGemmSm90)."""
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
        if const_expr(self.form in ("batched", "masked")):
            # (G, M, K) -> (M, K, G) and (G, M, N) -> (M, N, G): the problem is TMA mode 2.
            mA_tma = batch_last(mA)
            mD_tma = batch_last(mD)
        if const_expr(self.form == "varlen"):
            mD_tma = self.store_tensor(mD)  # one descriptor for every expert's rows
        if const_expr(self.form == "masked"):
            mD_tma = ragged_batched_rows(mD)  # each problem clipped at its row count

        op_g2s = cpasync.CopyBulkTensorTileG2SOp()
        op_s2g = cpasync.CopyBulkTensorTileS2GOp()
        a_smem = cute.slice_(self.a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(self.b_smem_staged, (None, None, 0))
        d_smem = cute.slice_(self.d_smem_staged, (None, None, 0))
        op_a = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(
            self.cluster_n > 1) else op_g2s
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(
            op_a, mA_tma, a_smem, (self.tile_m, self.tile_k), num_multicast=self.cluster_n
        )
        op_b = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(
            self.cluster_m > 1) else op_g2s
        b_box = self.tile_n
        if const_expr(self.gate_halves):
            # The concat gate layout loads B's tile as two boxes of half its rows.
            b_box = self.tile_n // 2
            b_smem = cute.slice_(self.b_half_smem, (None, None, 0))
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(
            op_b, mB, b_smem, (b_box, self.tile_k), num_multicast=self.cluster_m
        )
        tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(op_s2g, mD_tma, d_smem, self.epi_tile)
        atom_b1, tma_b1 = tma_atom_b, tma_b
        if const_expr(self.packed_pairs):
            atom_b1, tma_b1 = cpasync.make_tiled_tma_atom(op_g2s, mB, b_smem,
                                                          (b_box, self.tile_k))
        a_boxes = []  # (atom, tensor) per A_ROW_BOXES height
        for h in A_ROW_BOXES:
            if const_expr(self.trim_a and h < self.tile_m):
                # (1x2 cluster: one CTA issues a whole box, multicast to both)
                a_boxes.append(cpasync.make_tiled_tma_atom(
                    op_a, mA_tma, cute.slice_(self.a_box_smem[h], (None, None, 0)),
                    (h, self.tile_k)))
            else:
                a_boxes.append((tma_atom_a, tma_a))
        atom_sa, tma_sa, atom_sb, tma_sb = tma_atom_d, tma_d, tma_atom_d, tma_d
        if const_expr(self.staged_scale_floats > 0):
            atom_sa, tma_sa, atom_sb, tma_sb = self.scale_tma_atoms(args)

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
            # Gather-A with the rows in shared memory: the tile's row of x for each row.
            gather_rows: cute.struct.Align[
                cute.struct.MemRange[cutlass.Int32,
                                     self.tile_m if self.gather_rows_in_smem else 1], 16
            ]
            if const_expr(self.staged_scale_floats > 0):
                # Per A/B stage, the fp32 values the load warp stages beside the operands (the
                # FP8 kernel's block scales; see staged_scale_floats). Kernels without them
                # keep their shared memory as it was.
                stage_scales: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float32,
                                         self.ab_stages * self.staged_scale_floats], 128
                ]
            if const_expr(self.epi_scratch_floats > 0):
                epi_scratch: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float32, self.epi_scratch_floats], 128
                ]

        self.shared_storage = SharedStorage

        self.kernel(
            tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_d, tma_d, atom_sa, tma_sa, atom_sb,
            tma_sb, *a_boxes[0], *a_boxes[1], *a_boxes[2], atom_b1, tma_b1, args, run,
            self.tiled_mma,
            self.a_smem_staged, self.b_smem_staged, self.d_smem_staged,
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

    def make_problems(self, args: ProblemArgs):
        """The launch's problem accessor (problems.py)."""
        if const_expr(self.form == "general"):
            return GeneralProblems(self, args.num_problems, args.meta, args.meta32, args.d_base)
        if const_expr(self.form == "varlen"):
            return VarlenProblems(self, args.num_problems, args.mA, args.mD, args.offs)
        if const_expr(self.form == "masked"):
            return MaskedProblems(self, args.num_problems, args.mA, args.mD, args.offs)
        return BatchedProblems(self, args.num_problems, args.mA, args.mD)

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
        atom_sa: cute.CopyAtom,
        tma_sa: cute.Tensor,
        atom_sb: cute.CopyAtom,
        tma_sb: cute.Tensor,
        atom_a64: cute.CopyAtom,
        tma_a64: cute.Tensor,
        atom_a32: cute.CopyAtom,
        tma_a32: cute.Tensor,
        atom_a16: cute.CopyAtom,
        tma_a16: cute.Tensor,
        atom_b1: cute.CopyAtom,
        tma_b1: cute.Tensor,
        args: ProblemArgs,
        run: RunArgs,
        tiled_mma: cute.TiledMma,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        d_smem_staged: cute.ComposedLayout,
    ):
        tma = TmaOperands(tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_d, tma_d, atom_sa,
                          tma_sa, atom_sb, tma_sb, atom_a64, tma_a64, atom_a32, tma_a32,
                          atom_a16, tma_a16, atom_b1, tma_b1)
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = warp_idx // 4

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # A/B ring: TMA-filled, released by one warpgroup (pingpong) or both (cooperative).
        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tx_bytes = cute.size_in_bytes(self.ab_dtype, b_smem)
        # Gather-A: A's stage is filled by the gather warps' cp.async, each of whose threads
        # arrives on the full barrier when its copies land (cp.async.mbarrier.arrive.noinc):
        # the barrier expects those arrivals, and the TMA bytes of B only.
        gather_threads = GATHER_WARPS * 32 if const_expr(self.gather_a) else 0
        # Trimmed A: the load warp arms each stage with the bytes its tile loads (load_role).
        if const_expr(not self.gather_a and not self.trim_a):
            tx_bytes = tx_bytes + cute.size_in_bytes(self.ab_dtype, a_smem)
        tx_bytes = tx_bytes + self.staged_tx_bytes
        consumer_warps = 4 if const_expr(self.pingpong) else 8
        # A stage is free once every consumer warp of every CTA it is multicast to is done
        # with it: lane r of each consumer warp arrives on CTA r's empty barrier. (Ping-pong
        # under a cluster: both CTAs' stage s belongs to the same cluster tile, so the same
        # warpgroup index consumes it in each.)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_bars.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                      1 + gather_threads),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, consumer_warps * self.cluster_size
            ),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )
        # Scheduler ring: one producer arrive (the scheduler warp's lane 0), one consumer
        # arrive per reading warp (the load warp + 8 math warps [+ the warps that only
        # gather; the scheduler warp gathers from the records it writes]).
        sched_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.sched_bars.data_ptr(),
            num_stages=SCHED_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, 1 + 8 + (GATHER_WARPS - GATHER_FIRST_WARP
                                                if const_expr(self.gather_a) else 0)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, self.cluster_n),
                                      is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sD = storage.sD.get_tensor(d_smem_staged.outer, swizzle=d_smem_staged.inner)
        sched = storage.sched.get_tensor(cute.make_layout((RECORD_INTS, SCHED_STAGES)))
        staged = None  # the staged scales' ring (FP8 smem_scales), (floats, stage)
        if const_expr(self.staged_scale_floats > 0):
            staged = storage.stage_scales.get_tensor(
                cute.make_layout((self.staged_scale_floats, self.ab_stages)))
        scratch = None  # the epilogue's exchange (epi_scratch_floats)
        if const_expr(self.epi_scratch_floats > 0):
            scratch = storage.epi_scratch.get_tensor(cute.make_layout(self.epi_scratch_floats))
        problems = self.make_problems(args)

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, self.cluster_n))
        # Under PDL the previous grid (the producer of our inputs) may still be running:
        # nothing above touched global memory; everything below may.
        cute.arch.griddepcontrol_wait()

        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(self.load_regs)
            # Gather-A: every producer thread copies its share of A's rows (gather.py); the
            # load and scheduler warps beside their own roles.
            gather = None
            if const_expr(self.gather_a):
                s_rows = storage.gather_rows.get_tensor(cute.make_layout(
                    self.tile_m if const_expr(self.gather_rows_in_smem) else 1))
                gather = RowGather.create(self, problems, storage.sA.data_ptr().toint(),
                                          s_rows, tidx)
            if warp_idx == self.sched_warp:
                cta, _, _ = cute.arch.block_idx()
                scheduler = TileScheduler(self, problems,
                                          TailSplit(self) if const_expr(self.tail_split)
                                          else None)
                scheduler.run(sched_pipe, sched, args.table, run.raster,
                              ring_base(run.workspace, cta),
                              cute.slice_(a_smem_staged, (None, None, 0)),
                              cute.slice_(b_smem_staged, (None, None, 0)),
                              cute.slice_(d_smem_staged, (None, None, 0)),
                              gather, ab_pipe)
            if warp_idx == self.load_warp:
                self.load_role(ab_pipe, sched_pipe, sched, tma, problems, sA, sB, run, gather,
                               staged)
            if const_expr(self.gather_a):
                if warp_idx >= GATHER_FIRST_WARP:
                    gather_role(self, ab_pipe, sched_pipe, sched, gather)
        else:
            cute.arch.setmaxregister_increase(self.math_regs)
            self.math_role(ab_pipe, sched_pipe, sched, tiled_mma, sA, sB, sD, tma,
                           problems, run, tidx, warp_idx, wg_idx - 1, staged, scratch)

    # ------------------------------------------------------------------------------------------
    # Load warp

    @cute.jit
    def load_role(
        self,
        ab_pipe: pipeline.PipelineTmaAsync,
        sched_pipe: pipeline.PipelineAsync,
        sched: cute.Tensor,
        tma: TmaOperands,
        problems,
        sA: cute.Tensor,
        sB: cute.Tensor,
        run: RunArgs,
        gather: RowGather | None,
        staged: cute.Tensor | None,
    ):
        if const_expr(problems.form != "general"):
            cpasync.prefetch_descriptor(tma.atom_a)
            cpasync.prefetch_descriptor(tma.atom_b)
            if const_expr(self.trim_a):
                for h, atom in zip(A_ROW_BOXES, tma.a_row_atoms()[0]):
                    if const_expr(h < self.tile_m):
                        cpasync.prefetch_descriptor(atom)
            if const_expr(self.staged_scale_floats > 0):
                cpasync.prefetch_descriptor(tma.atom_sa)
                cpasync.prefetch_descriptor(tma.atom_sb)
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        cta, _, _ = cute.arch.block_idx()
        ring = ring_base(run.workspace, cta)
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
        # A stage's bytes of B (both boxes of a concat gate) and staged scales.
        b_bytes = self.tile_n * self.tile_k * self.ab_dtype.width // 8 + self.staged_tx_bytes
        a_policy = run.a_policy if const_expr(self.l2_hints) else None
        b_policy = run.b_policy if const_expr(self.l2_hints) else None
        sB_load = sB
        if const_expr(self.gate_halves):
            # The concat gate layout: rows [0, tile_n / 2) of the B stage take the gate box,
            # the rest the up box (fused_epilogue.py pairs accumulator chunk c with
            # c + tile_n / 16).
            sB_halves = cute.flat_divide(sB, (self.tile_n // 2, self.tile_k))
            sB_load = sB_halves[None, None, 0, 0, None]
            sB_up = sB_halves[None, None, 1, 0, None]
        work, read_state = consume_work(sched_pipe, sched, read_state)
        while work.has_work():
            gA, gB = problems.load_views(tma.tma_a, tma.tma_b, work)
            if const_expr(self.gate_halves):
                gB, gB_up = problems.b_halves(tma.tma_b, work)
                tBsB_up, tBgB_up = cpasync.tma_partition(
                    tma.atom_b, rank_m, cute.make_layout(self.cluster_m),
                    cute.group_modes(sB_up, 0, 2), cute.group_modes(gB_up, 0, 2),
                )
            tAsA, tAgA = cpasync.tma_partition(
                tma.atom_a, rank_n, cute.make_layout(self.cluster_n),
                cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2),
            )
            tBsB, tBgB = cpasync.tma_partition(
                tma.atom_b, rank_m, cute.make_layout(self.cluster_m),
                cute.group_modes(sB_load, 0, 2), cute.group_modes(gB, 0, 2),
            )
            tB1sB, tB1gB = tBsB, tBgB  # packed pairs: B's whole box, this CTA's alone
            if const_expr(self.packed_pairs):
                tB1sB, tB1gB = cpasync.tma_partition(
                    tma.atom_b1, 0, cute.make_layout(1), cute.group_modes(sB_load, 0, 2),
                    cute.group_modes(problems.load_views(tma.tma_a, tma.tma_b1, work)[1], 0, 2),
                )
            trimmed = None
            if const_expr(self.trim_a):
                trimmed = trimmed_a(self, *tma.a_row_atoms(), problems, sA, work, tAgA, tAsA)
            # Warp-uniform descriptor addresses, computed before any elected region so ptxas
            # never needs a predicated R2UR (illegal on sm_90a, error 715).
            # (make_warp_uniform is 32-bit: apply it to the index, never to the address.)
            desc_base = ring + Int64(cute.arch.make_warp_uniform(work.ring_slot)) * SLOT_BYTES
            problems.acquire_load_descs(desc_base)
            if const_expr(self.gather_a):
                gather.start_tile(work)
            scale_loads = None
            if const_expr(self.staged_scale_floats > 0):
                scale_loads = self.scale_loads(tma, work, staged)
            for kk in cutlass.range(0, work.k_tiles, 1, unroll=1):
                k = kk + work.k_start  # (0 unless this is a tail split's upper half)
                bar = ab_pipe.producer_get_barrier(ab_state)
                if const_expr(self.trim_a):
                    # Armed with this tile's bytes (B's and the A rows it loads) in place of
                    # producer_acquire's fixed count.
                    ab_pipe.sync_object_empty.wait(ab_state.index, ab_state.phase)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(bar, b_bytes + trimmed.a_bytes)
                    trimmed.fill_stage(tma.atom_a, k, ab_state.index, bar, a_policy, a_mask,
                                       rank_n)
                else:
                    ab_pipe.producer_acquire(ab_state)
                    if const_expr(not self.gather_a):  # (gather-A: the gather warps load A)
                        cute.copy(
                            tma.atom_a, tAgA[(None, work.m_tile, k)],
                            tAsA[(None, ab_state.index)], tma_bar_ptr=bar,
                            tma_desc_ptr=problems.load_desc(desc_base, 0), mcast_mask=a_mask,
                            cache_policy=a_policy,
                        )
                if const_expr(self.packed_pairs):
                    if work.b_alone():
                        cute.copy(
                            tma.atom_b1, tB1gB[(None, work.n_tile, k)],
                            tB1sB[(None, ab_state.index)], tma_bar_ptr=bar,
                            cache_policy=b_policy,
                        )
                    else:
                        cute.copy(
                            tma.atom_b, tBgB[(None, work.n_tile, k)],
                            tBsB[(None, ab_state.index)], tma_bar_ptr=bar, mcast_mask=b_mask,
                            cache_policy=b_policy,
                        )
                else:
                    cute.copy(
                        tma.atom_b, tBgB[(None, work.n_tile, k)], tBsB[(None, ab_state.index)],
                        tma_bar_ptr=bar, tma_desc_ptr=problems.load_desc(desc_base, 1),
                        mcast_mask=b_mask, cache_policy=b_policy,
                    )
                if const_expr(self.gate_halves):
                    cute.copy(
                        tma.atom_b, tBgB_up[(None, work.n_tile, k)],
                        tBsB_up[(None, ab_state.index)],
                        tma_bar_ptr=bar, tma_desc_ptr=problems.load_desc(desc_base, 1),
                        mcast_mask=b_mask, cache_policy=b_policy,
                    )
                if const_expr(self.gather_a):  # this warp's share of A's rows
                    gather.fill_stage(work, kk, ab_pipe, ab_state)
                if const_expr(self.staged_scale_floats > 0):
                    scale_loads.fill_stage(k, ab_state.index, bar)
                ab_pipe.producer_commit(ab_state)
                ab_state.advance()
            work, read_state = consume_work(sched_pipe, sched, read_state)
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
        tma: TmaOperands,
        problems,
        run: RunArgs,
        tidx: Int32,
        warp_idx: Int32,
        math_wg: Int32,  # 0 or 1
        staged: cute.Tensor | None,
        scratch: cute.Tensor | None = None,
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
        # The operands' shared-memory slices depend only on the warpgroup (a WGMMA's 128
        # threads read one descriptor): slicing by a warp-uniform warpgroup's first thread
        # keeps the descriptors in uniform registers. Sliced by the thread index, the
        # cooperative A descriptor lived in vector registers and every WGMMA paid R2UR
        # moves (+27% math-warp instructions on 128x256). Time: even (the zoo's 28
        # cooperative picks on an H200, median 1.001x).
        wg_first = cute.arch.make_warp_uniform(mma_tidx // self.threads_per_wg)
        thr_ab = tiled_mma.get_slice(wg_first * self.threads_per_wg)
        tCsA = thr_ab.partition_A(sA)
        tCsB = thr_ab.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        tile = cute.make_identity_tensor((self.tile_m, self.tile_n))
        acc_coords = thr_mma.partition_C(tile)
        acc = cute.make_rmem_tensor(acc_coords.shape, self.acc_dtype)
        num_k_blocks = cute.size(tCrA, mode=[2])
        frags = self.epi.partition(tiled_mma, sD, acc, mma_tidx, epi_threads)
        tail = TailSplit(self)

        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SCHED_STAGES)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        cta, _, _ = cute.arch.block_idx()
        ring = ring_base(run.workspace, cta)
        tiles_done = Int32(0)  # tiles this warpgroup stored (rotates the staging buffers)
        seen = Int32(0)  # tiles this warpgroup computed, stored or not (the trace slot)

        if const_expr(self.pingpong):
            if math_wg == 0:
                # Warpgroup 0 holds the first mainloop token.
                cute.arch.barrier_arrive(
                    barrier_id=BAR_MMA_ORDER, number_of_threads=2 * self.threads_per_wg
                )
        work, read_state = consume_work(sched_pipe, sched, read_state)
        if const_expr(self.pingpong):
            if math_wg == 1:
                # Warpgroup 1 starts at the CTA's second tile: skip the first one's stages.
                if work.has_work():
                    ab_state.advance(work.k_tiles)
                    work, read_state = consume_work(sched_pipe, sched, read_state)
        while work.has_work():
            if const_expr(self.pingpong):
                cute.arch.barrier(
                    barrier_id=BAR_MMA_ORDER + math_wg, number_of_threads=2 * self.threads_per_wg
                )
            ab_state = self.mainloop(ab_pipe, ab_state, tiled_mma, acc, tCrA, tCrB,
                                     work.k_tiles, num_k_blocks, math_wg, work, problems,
                                     staged)
            role = work.role
            if const_expr(self.tail_split):
                kind = work.kind()
                live = tail.live_rows(acc_coords[0][0], work)
                if kind == ROLE_PUBLISH:
                    tail.publish(acc, run.workspace, work.role, mma_tidx, live, math_wg)
                    role = Int32(ROLE_SKIP)
                if kind == ROLE_FINISH:
                    tail.absorb(acc, run.workspace, work.role, mma_tidx, live, math_wg)
            if role != ROLE_SKIP:  # (always, without a cluster or a tail split)
                self.epi.store(frags, sD, tma.atom_d, tma.tma_d, problems, work, ring, epi_group,
                               epi_bar_id, epi_threads, is_store_warp, tiles_done)
                if const_expr(self.trace):
                    if mma_tidx == 0:
                        # Slot = the tile's index among the CTA's tiles (ping-pong: the
                        # warpgroups alternate), so a tile that stores nothing (a cluster
                        # rank past the edge, a publisher) leaves its slot at -1 and the
                        # stored ones stay in order.
                        trace = run.trace
                        slot = cutlass.min(seen * (2 if self.pingpong else 1) + math_wg,
                                           trace.shape[1] - 1)
                        trace[cta, slot, 0] = work.problem
                        trace[cta, slot, 1] = work.m_tile
                        trace[cta, slot, 2] = work.n_tile
                        trace[cta, slot, 3] = math_wg
                tiles_done = tiles_done + 1
            seen = seen + 1
            work, read_state = consume_work(sched_pipe, sched, read_state)
            if const_expr(self.pingpong):
                # The next record is the other warpgroup's tile: skip its stages.
                if work.has_work():
                    ab_state.advance(work.k_tiles)
                    work, read_state = consume_work(sched_pipe, sched, read_state)
        if is_store_warp:
            frags.store_pipe.producer_tail()

    def store_tensor(self, mD: cute.Tensor) -> cute.Tensor:
        """The varlen form's D as the store descriptor sees it (problems.ragged_rows)."""
        return ragged_rows(mD)

    def tile_row_span(self, work: WorkTile):
        """(first row in the expert, rows of the expert) of a varlen tile: the trimmed A
        loads' span (swapped.py splits an expert's rows evenly instead)."""
        first = work.m_tile * self.tile_m
        rows = cutlass.max(cutlass.min(work.rows - first, self.tile_m), Int32(0))
        return first, rows

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
        """acc = A_tile @ B_tile over k_tiles stages (zeros when k_tiles == 0). (work,
        problems and staged: the tile, its accessor and the staged scales, for subclasses
        whose mainloop needs them.)"""
        if k_tiles == 0:
            acc.fill(0.0)  # (an empty K: the tile is zeros)
        # The first k-block's WGMMAs overwrite the accumulators (scale-d 0) instead of adding
        # to zeros written by the math threads: register writes between the WGMMAs of a tile
        # with two m64 blocks made ptxas inject a warpgroup.wait into every tile (C7517).
        warpgroup.fence()
        release_state = ab_state.clone()
        # One WGMMA batch stays in flight (wait_group(1)): stage s is released once the
        # batch reading it has retired, i.e. one iteration later.
        if k_tiles > 0:
            ab_pipe.consumer_wait(ab_state)
            self._acquire_gathered()
            for kb in cutlass.range_constexpr(num_k_blocks):
                tiled_mma.set(warpgroup.Field.ACCUMULATE, kb > 0)
                coord = (None, None, kb, ab_state.index)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            warpgroup.commit_group()
            ab_state.advance()
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        peek = cutlass.Boolean(False)  # (peek_wait: whether the next stage is known full)
        if const_expr(self.peek_wait):
            if k_tiles > 1:
                peek = ab_pipe.consumer_try_wait(ab_state)
        for k in cutlass.range(1, k_tiles, 1, unroll=1):
            if const_expr(self.peek_wait):
                ab_pipe.consumer_wait(ab_state, peek)
            else:
                ab_pipe.consumer_wait(ab_state)
            self._acquire_gathered()
            for kb in cutlass.range_constexpr(num_k_blocks):
                coord = (None, None, kb, ab_state.index)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
            ab_pipe.consumer_release(release_state)
            release_state.advance()
            ab_state.advance()
            if const_expr(self.peek_wait):
                if k + 1 < k_tiles:
                    peek = ab_pipe.consumer_try_wait(ab_state)
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
    def _acquire_gathered(self):
        """Gather-A: the stage's A rows were written by cp.async (the generic proxy) and the
        WGMMAs read shared memory through the async proxy. The full barrier, which the copies
        arrive on once they land, made the writes visible to this thread; gather_fence adds a
        proxy fence before its WGMMAs (the TMA-only kernels need none: TMA writes through the
        async proxy). CUTLASS's cp.async GMMA mainloop and QuACK's gather-A kernel issue
        none there and rely on the barrier alone; MOE_GEMM_GATHER_FENCE picks (ops/fused_launch)."""
        if const_expr(self.gather_a and self.gather_fence):
            cute.arch.fence_proxy("async.shared", space="cta")
