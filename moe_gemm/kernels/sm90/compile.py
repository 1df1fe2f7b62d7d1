"""Compile GroupedGemmSm90 variants from static choices only, with fake tensors.

A compile key holds dtypes, majors, form, schedule, visitor, tile, stages and the trace flag;
sizes, group counts and grid are runtime arguments, so a new problem set never recompiles.
Compiling needs no GPU (CUTE_DSL_ARCH=sm_90a), which is how `moe-gemm check` proves every
variant builds on a CPU machine and how the PTX is inspected.
"""

from __future__ import annotations

import os
from dataclasses import astuple, dataclass

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from .constants import (  # noqa: E402
    SPLIT_WAYS,
    SWAP_ROW_UNIT,
    SWAP_TILE_COLS,
    SWAP_TILE_ROWS,
)
from .fused_moe import FusedMoeGemmSm90  # noqa: E402
from .grouped_gemm import GroupedGemmSm90  # noqa: E402
from .swapped import SwappedGemmSm90  # noqa: E402
from .swapped_fused import SwappedFusedMoeGemmSm90  # noqa: E402

DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
}


def option_parts(key) -> list[str]:
    """The name parts of the compile-time options every kernel key has (stages, trace, L2
    hints, epilogue width, cluster, whole-tile epilogue, tail split): one spelling for the
    bf16 and FP8 keys, so cache names stay comparable."""
    parts = []
    if key.stages is not None:
        parts.append(f"s{key.stages}")
    if key.trace:
        parts.append("trace")
    if key.l2_hints:
        parts.append("l2hints")
    if key.epi_n != 32:
        parts.append(f"epi{key.epi_n}")
    if (key.cluster_m, key.cluster_n) != (1, 1):
        parts.append(f"c{key.cluster_m}x{key.cluster_n}")
    if key.epi_whole:
        parts.append("ew")
    if key.tail_split:
        parts.append("ts" if key.split_ways == SPLIT_WAYS else f"ts{key.split_ways}")
    return parts


@dataclass(frozen=True)
class CompileKey:
    """Everything a compiled kernel depends on. Nothing here varies per problem set."""

    form: str  # "general" | "varlen" | "batched" | "masked"
    ab_dtype: str  # "bfloat16" | "float16"
    d_dtype: str  # "bfloat16" | "float16" | "float32"
    b_major: str  # "k" | "n"
    schedule: str  # "pingpong" | "cooperative"
    visitor: str  # "device" | "host"
    tile_m: int
    tile_n: int
    stages: int | None = None
    trace: bool = False
    l2_hints: bool = False
    epi_n: int = 32  # cooperative epilogue subtile width
    cluster_m: int = 1  # CTAs per cluster along M (B multicast)
    cluster_n: int = 1  # CTAs per cluster along N (A multicast)
    epi_whole: bool = False  # whole-tile epilogue (cooperative, 16-bit output)
    tail_split: bool = False  # split a short last wave over K (constants.py)
    # Fused MoE options (constants.fused_problem; varlen only): the FusedMoeGemmSm90 kernel.
    gate: str = ""  # "" | "silu" | "gelu" | "gelu_tanh" | "clamped_swiglu" | "clamped_silu"
    gate_layout: str = ""  # "concat" | "interleaved" (with a gate)
    gate_alpha: float = 0.0  # the clamped gates' alpha and limit (compile-time constants)
    gate_limit: float = 0.0
    bias: bool = False  # per-expert bias on the accumulators
    row_scale: bool = False  # each row times its weight
    gather: bool = False  # A's rows read through an index (gather-A)
    gather_fence: bool = True  # gather-A: a proxy fence before the WGMMAs read a stage
    fast_gate: bool = False  # a sigmoid gate from the SFU's approximate exp2 and reciprocal
    row_counts: bool = False  # varlen: offs are per-expert row counts (the masked layout)
    trim_a: bool = False  # varlen: an expert's last tile loads only its own A rows
    peek_wait: bool = False  # the math warps test the next stage's barrier a k-tile ahead
    split_ways: int = SPLIT_WAYS  # with the tail split: the most CTAs per tail tile
    swap_ab: bool = False  # varlen: the rows on the WGMMA's N side (swapped.py)
    packed_pairs: bool = False  # varlen 2x1: a cluster's CTAs take consecutive tiles

    @property
    def fused(self) -> bool:
        return bool(self.gate or self.bias or self.row_scale or self.gather)

    def name(self) -> str:
        parts = [str(v) for v in astuple(self)[:8]] + option_parts(self)
        if self.gate:
            parts.append(f"gate-{self.gate}-{self.gate_layout}")
            if self.gate in ("clamped_swiglu", "clamped_silu"):
                parts.append(f"a{self.gate_alpha:g}-l{self.gate_limit:g}")
        if self.bias:
            parts.append("bias")
        if self.row_scale:
            parts.append("rowscale")
        if self.gather:
            parts.append("gather" if self.gather_fence else "gather-nofence")
        if self.fast_gate:
            parts.append("fastgate")
        if self.row_counts:
            parts.append("counts")
        if self.trim_a:
            parts.append("trima")
        if self.packed_pairs:
            parts.append("pk")
        if self.peek_wait:
            parts.append("peek")
        if self.swap_ab:
            parts.append("swap")
        return "_".join(parts)

    def kernel(self) -> GroupedGemmSm90:
        if self.swap_ab:
            return self._swapped_kernel()
        cls = GroupedGemmSm90
        fused = {}
        if self.fused:
            cls = FusedMoeGemmSm90
            fused = {"gate": self.gate or None, "gate_layout": self.gate_layout or "concat",
                     "gate_alpha": self.gate_alpha, "gate_limit": self.gate_limit,
                     "bias": self.bias, "row_scale": self.row_scale, "gather_a": self.gather,
                     "gather_fence": self.gather_fence, "fast_gate": self.fast_gate}
        return cls(
            ab_dtype=DTYPES[self.ab_dtype],
            d_dtype=DTYPES[self.d_dtype],
            b_major=self.b_major,  # type: ignore[arg-type]
            form=self.form,  # type: ignore[arg-type]
            schedule=self.schedule,  # type: ignore[arg-type]
            visitor=self.visitor,  # type: ignore[arg-type]
            tile_mn=(self.tile_m, self.tile_n),
            ab_stages=self.stages,
            trace=self.trace,
            l2_hints=self.l2_hints,
            epi_n=self.epi_n,
            cluster_m=self.cluster_m,
            cluster_n=self.cluster_n,
            epi_whole=self.epi_whole,
            tail_split=self.tail_split,
            row_counts=self.row_counts,
            trim_a=self.trim_a,
            peek_wait=self.peek_wait,
            packed_pairs=self.packed_pairs,
            split_ways=self.split_ways,
            **fused,
        )

    def _swapped_kernel(self) -> SwappedGemmSm90:
        """The swapped kernel, for the keys it is built for (its fixed choices must match)."""
        fixed = {"form": "varlen", "schedule": "cooperative", "visitor": "device",
                 "tile_m": SWAP_TILE_ROWS, "tile_n": SWAP_TILE_COLS, "cluster_m": 1,
                 "tail_split": False, "row_counts": False,
                 "epi_whole": False, "trim_a": True, "epi_n": SWAP_ROW_UNIT,
                 "packed_pairs": False}
        # (cluster_n: 1 or 2, which SwappedGemmSm90 checks)
        wrong = {k: getattr(self, k) for k, v in fixed.items() if getattr(self, k) != v}
        if wrong or self.gather:
            raise ValueError(f"swapped tiles are built for {fixed} without gather-A; "
                             f"got {wrong or 'gather-A'}")
        common = dict(ab_stages=self.stages, trace=self.trace, l2_hints=self.l2_hints,
                      peek_wait=self.peek_wait, cluster_n=self.cluster_n)
        if self.fused:
            return SwappedFusedMoeGemmSm90(
                DTYPES[self.ab_dtype], DTYPES[self.d_dtype], self.b_major, **common,
                gate=self.gate or None, gate_layout=self.gate_layout or "concat",
                gate_alpha=self.gate_alpha, gate_limit=self.gate_limit, bias=self.bias,
                row_scale=self.row_scale, fast_gate=self.fast_gate)
        return SwappedGemmSm90(DTYPES[self.ab_dtype], DTYPES[self.d_dtype], self.b_major,
                               **common)


def _fake(dtype, shape, leading_dim: int):
    """A fake tensor whose `leading_dim` has unit stride and every other stride is a runtime
    value that is a multiple of 16 bytes (the TMA rule kernels/support.py enforces)."""
    align_elems = max(1, 128 // dtype.width)
    stride = tuple(
        1 if i == leading_dim else cute.sym_int64(divisibility=align_elems)
        for i in range(len(shape))
    )
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)


def fake_launch_arguments() -> tuple[tuple, tuple, object]:
    """The launch arguments every kernel form takes after its operands, as fake tensors and
    placeholder scalars: (meta, meta32, offs, table, workspace, trace), (num_problems,
    num_ctas, swizzle, a_policy, b_policy, pdl, d_base), stream."""
    g = cute.sym_int()
    meta = cute.runtime.make_fake_compact_tensor(cutlass.Int64, (g, 8), stride_order=(1, 0))
    meta32 = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (g, 16), stride_order=(1, 0))
    offs = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),))
    table = cute.runtime.make_fake_compact_tensor(
        cutlass.Int32, (cute.sym_int(), cute.sym_int(), 2), stride_order=(2, 1, 0)
    )
    workspace = cute.runtime.make_fake_compact_tensor(
        cutlass.Int64, (cute.sym_int(),), assumed_align=128
    )
    trace = cute.runtime.make_fake_compact_tensor(
        cutlass.Int32, (cute.sym_int(), cute.sym_int(), 4), stride_order=(2, 1, 0)
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    scalars = (cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(8), cutlass.Int64(0),
               cutlass.Int64(0), cutlass.Int32(1), cutlass.Int64(0))
    return (meta, meta32, offs, table, workspace, trace), scalars, stream


def fake_arguments(key: CompileKey) -> tuple:
    ab = DTYPES[key.ab_dtype]
    d = DTYPES[key.d_dtype]
    rows, k, n = cute.sym_int(), cute.sym_int(), cute.sym_int()
    # w in torch order: general (K, N); varlen/batched (E|G, K, N). "k"-major = K contiguous.
    if key.form == "general":
        w = _fake(ab, (k, n), leading_dim=0 if key.b_major == "k" else 1)
    else:
        w = _fake(ab, (cute.sym_int(), k, n), leading_dim=1 if key.b_major == "k" else 2)
    if key.form in ("batched", "masked"):
        batch = cute.sym_int()
        a = _fake(ab, (batch, rows, k), leading_dim=2)
        out = _fake(d, (batch, rows, n), leading_dim=2)
    else:
        a = _fake(ab, (rows, k), leading_dim=1)
        # Gather-A: out has the routed rows, x the tokens (two sizes); a gated output has
        # its own width (half of w's N).
        out_rows = cute.sym_int() if key.gather else rows
        out = _fake(d, (out_rows, cute.sym_int() if key.gate else n), leading_dim=1)
    (meta, meta32, offs, table, workspace, trace), scalars, stream = fake_launch_arguments()
    if not key.fused:
        return (a, w, out, meta, meta32, offs, table, workspace, trace, *scalars, stream)
    # The fused kernel's tensors: (S,) int32 row index, (S,) fp32 row weights, (E, N) fp32
    # bias, each of any size (one-element placeholders where an option is off).
    row_index = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),))
    row_weight = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),))
    bias = cute.runtime.make_fake_compact_tensor(cutlass.Float32,
                                                 (cute.sym_int(), cute.sym_int()),
                                                 stride_order=(1, 0))
    return (a, w, out, meta, meta32, offs, table, workspace, trace, *scalars, row_index,
            row_weight, bias, stream)


def compile_options(keep_dir: str | None = None) -> str:
    """cute.compile's options for every kernel of the package (TVM-FFI calls, -O3); with
    keep_dir, PTX and cubin are written there."""
    options = "--enable-tvm-ffi --opt-level 3"
    if keep_dir is not None:
        os.makedirs(keep_dir, exist_ok=True)
        options += f" --keep-ptx --keep-cubin --dump-dir {keep_dir}"
    return options


def compile_variant(key: CompileKey, keep_dir: str | None = None):
    """cute.compile the variant; with keep_dir, PTX and cubin are written there."""
    return cute.compile(key.kernel(), *fake_arguments(key), options=compile_options(keep_dir))
