"""Compile GroupedGemmFp8Sm90 variants from static choices only, with fake tensors (as
compile.py does for the 16-bit kernel; no GPU needed with CUTE_DSL_ARCH=sm_90a)."""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from .compile import (  # noqa: E402
    DTYPES,
    _fake,
    compile_options,
    fake_launch_arguments,
    option_parts,
)
from .constants import SPLIT_WAYS  # noqa: E402
from .grouped_gemm_fp8 import SMETA_INTS, GroupedGemmFp8Sm90  # noqa: E402

FP8_DTYPES = {"float8_e4m3fn": cutlass.Float8E4M3FN, "float8_e5m2": cutlass.Float8E5M2}


@dataclass(frozen=True)
class Fp8CompileKey:
    """Everything a compiled FP8 kernel depends on (B is always K-major). Nothing here varies
    per problem set."""

    form: str  # "general" | "varlen" | "batched" | "masked"
    ab_dtype: str  # "float8_e4m3fn" | "float8_e5m2"
    d_dtype: str  # "bfloat16" | "float16" | "float32"
    scale_mode: str  # "block" | "outer"
    schedule: str  # "pingpong" | "cooperative"
    visitor: str  # "device" | "host"
    tile_m: int
    tile_n: int
    stages: int | None = None
    trace: bool = False
    l2_hints: bool = False
    epi_n: int = 32
    cluster_m: int = 1
    cluster_n: int = 1
    epi_whole: bool = False
    tail_split: bool = False
    promote_lag: bool = False  # the promotion one stage behind the WGMMAs
    scale_ahead: int = 1  # block scales: stages ahead of their promotion the scales load
    smem_scales: bool = False  # block scales staged in shared memory by TMA (varlen, batched)
    split_ways: int = SPLIT_WAYS  # with the tail split: the most CTAs per tail tile
    peek_wait: bool = False  # the next stage's barrier probed a stage ahead (stage_wait.py)
    skip_empty_half: bool = False  # a warpgroup whose 64 rows are past the end skips its MMAs

    def name(self) -> str:
        return "_".join(["fp8", self.form, self.ab_dtype, self.d_dtype, self.scale_mode,
                         self.schedule, self.visitor, str(self.tile_m), str(self.tile_n)]
                        + option_parts(self)
                        + (["halfskip"] if self.skip_empty_half else [])
                        + (["lag"] if self.promote_lag else [])
                        + ([f"ahead{self.scale_ahead}"] if self.scale_ahead != 1 else [])
                        + (["sscales"] if self.smem_scales else [])
                        + (["peek"] if self.peek_wait else []))

    def kernel(self) -> GroupedGemmFp8Sm90:
        return GroupedGemmFp8Sm90(
            FP8_DTYPES[self.ab_dtype], DTYPES[self.d_dtype], self.form, self.schedule,
            self.visitor, (self.tile_m, self.tile_n), self.scale_mode, ab_stages=self.stages,
            trace=self.trace, l2_hints=self.l2_hints, epi_n=self.epi_n,
            cluster_m=self.cluster_m, cluster_n=self.cluster_n, epi_whole=self.epi_whole,
            tail_split=self.tail_split, promote_lag=self.promote_lag,
            scale_ahead=self.scale_ahead, smem_scales=self.smem_scales,
            split_ways=self.split_ways, peek_wait=self.peek_wait,
            skip_empty_half=self.skip_empty_half,
        )


def _fake_scales(shape):
    """fp32 scales with any strides (the math threads load them one by one)."""
    return cute.runtime.make_fake_tensor(
        cutlass.Float32, shape, stride=tuple(cute.sym_int64() for _ in shape), assumed_align=4)


def _fake_tma_scales(shape, unit_dim: int):
    """fp32 scales as the staged kernel's TMA loads take them (scaled_launch.py lays them out
    so): unit stride along `unit_dim`, every other stride its own multiple of 4 floats, a
    16-byte aligned base."""
    stride = tuple(1 if i == unit_dim else cute.sym_int64(divisibility=4)
                   for i in range(len(shape)))
    return cute.runtime.make_fake_tensor(cutlass.Float32, shape, stride=stride,
                                         assumed_align=16)


def fake_arguments(key: Fp8CompileKey) -> tuple:
    ab = FP8_DTYPES[key.ab_dtype]
    d = DTYPES[key.d_dtype]
    rows, k, n = cute.sym_int(), cute.sym_int(), cute.sym_int()
    # w in torch order, K contiguous: general (K, N); varlen / batched (E|G, K, N).
    if key.form == "general":
        w = _fake(ab, (k, n), leading_dim=0)
    else:
        w = _fake(ab, (cute.sym_int(), k, n), leading_dim=1)
    kb, cols = cute.sym_int(), cute.sym_int()
    if key.form in ("batched", "masked"):
        batch = cute.sym_int()
        a = _fake(ab, (batch, rows, k), leading_dim=2)
        out = _fake(d, (batch, rows, n), leading_dim=2)
        if key.smem_scales:  # sfa M-major within each problem, sfb k-block-major
            sfa = _fake_tma_scales((batch, rows, kb), 1)
            sfb = _fake_tma_scales((batch, kb, cols), 1)
        else:
            sfa = _fake_scales((batch, rows, kb))
            sfb = _fake_scales((batch, kb, cols))
    else:
        a = _fake(ab, (rows, k), leading_dim=1)
        out = _fake(d, (rows, n), leading_dim=1)
        if key.form == "varlen" and key.smem_scales:  # sfa M-major, sfb k-block-major
            sfa = _fake_tma_scales((rows, kb), 0)
            sfb = _fake_tma_scales((cute.sym_int(), kb, cols), 1)
        elif key.form == "varlen":
            sfa = _fake_scales((rows, kb))
            sfb = _fake_scales((cute.sym_int(), kb, cols))
        else:
            sfa = _fake_scales((1, 1))
            sfb = _fake_scales((1, 1, 1))
    smeta = cute.runtime.make_fake_compact_tensor(cutlass.Int64, (cute.sym_int(), SMETA_INTS),
                                                  stride_order=(1, 0))
    launch, scalars, stream = fake_launch_arguments()
    return (a, w, out, sfa, sfb, smeta, *launch, *scalars, stream)


def compile_fp8_variant(key: Fp8CompileKey, keep_dir: str | None = None):
    """cute.compile the FP8 variant; with keep_dir, PTX and cubin are written there."""
    options = compile_options(keep_dir)
    return cute.compile(key.kernel(), *fake_arguments(key), options=options)


@dataclass(frozen=True)
class QuantCompileKey:
    """The 1x128 activation quantizer (quantize_fp8.Fp8GroupQuantSm90) for one dtype pair."""

    in_dtype: str  # "bfloat16" | "float16" | "float32"
    out_dtype: str  # "float8_e4m3fn" | "float8_e5m2"

    def name(self) -> str:
        return f"fp8quant_{self.in_dtype}_{self.out_dtype}"


def compile_quant(key: QuantCompileKey, keep_dir: str | None = None):
    """cute.compile the quantizer: x (T, K) with K a multiple of 128 and 16-byte aligned rows,
    q (T, K) likewise, s (T, K/128) with any strides (row-major, or token-major for the
    staged FP8 kernels' TMA loads)."""
    from .quantize_fp8 import Fp8GroupQuantSm90

    ind, outd = DTYPES[key.in_dtype], FP8_DTYPES[key.out_dtype]
    x = cute.runtime.make_fake_tensor(
        ind, (cute.sym_int(), cute.sym_int(divisibility=128)),
        stride=(cute.sym_int64(divisibility=128 // ind.width), 1), assumed_align=16)
    q = cute.runtime.make_fake_tensor(
        outd, (cute.sym_int(), cute.sym_int(divisibility=128)),
        stride=(cute.sym_int64(divisibility=16), 1), assumed_align=16)
    s = cute.runtime.make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                                      stride=(cute.sym_int64(), cute.sym_int64()))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    options = compile_options(keep_dir)
    return cute.compile(Fp8GroupQuantSm90(ind, outd), x, q, s, cutlass.Int32(1), stream,
                        options=options)


def compile_any(key, keep_dir: str | None = None):
    """Compile a CompileKey (16-bit kernel), an Fp8CompileKey, a QuantCompileKey or a router's
    key (RouterTopkCompileKey, GroupTopkCompileKey)."""
    if isinstance(key, Fp8CompileKey):
        return compile_fp8_variant(key, keep_dir)
    if isinstance(key, QuantCompileKey):
        return compile_quant(key, keep_dir)
    from . import router_topk

    if isinstance(key, router_topk.RouterTopkCompileKey):
        return router_topk.compile_router_topk(key, keep_dir)
    if isinstance(key, router_topk.GroupTopkCompileKey):
        return router_topk.compile_group_topk(key, keep_dir)
    from .compile import compile_variant

    return compile_variant(key, keep_dir)


def fp8_check_variants() -> list[Fp8CompileKey]:
    """The FP8 variants `moe-gemm check` compiles (a few seconds each, so a handful): each
    form, both scale modes, both schedules, a two-scale-block tile, a cluster, the tail split,
    e5m2, every output dtype, the lagged promotion, the prefetched and the staged scales at
    least once; each with the probed stage waits (the varlen default), and the
    compute-bound default once without them and once with its empty halves skipped."""
    def key(form, ab, d, mode, schedule, tile, **extra):
        extra.setdefault("peek_wait", True)
        return Fp8CompileKey(form, ab, d, mode, schedule, "device", *tile, **extra)

    e4, e5 = "float8_e4m3fn", "float8_e5m2"
    return [
        key("varlen", e4, "bfloat16", "block", "cooperative", (128, 128), tail_split=True,
            skip_empty_half=True),  # (MOE_GEMM_FP8_HALF_SKIP=1 on any cooperative 128-row tile)
        key("varlen", e4, "bfloat16", "block", "pingpong", (64, 128)),
        key("varlen", e4, "float32", "outer", "cooperative", (128, 192), cluster_m=2,
            skip_empty_half=True),
        key("batched", e4, "bfloat16", "block", "cooperative", (128, 160)),
        key("masked", e4, "bfloat16", "block", "cooperative", (128, 128)),
        key("masked", e4, "bfloat16", "outer", "pingpong", (64, 128), cluster_n=2),
        key("general", e5, "float16", "block", "pingpong", (128, 96)),
        key("general", e4, "bfloat16", "outer", "cooperative", (128, 128), cluster_n=2),
        key("varlen", e4, "bfloat16", "block", "cooperative", (128, 128), cluster_n=2,
            promote_lag=True),
        key("varlen", e4, "bfloat16", "block", "cooperative", (128, 128), cluster_n=2,
            scale_ahead=2),
        key("varlen", e4, "bfloat16", "block", "pingpong", (64, 128), scale_ahead=3),
        key("varlen", e4, "bfloat16", "block", "pingpong", (64, 128), smem_scales=True,
            promote_lag=True),
        key("varlen", e4, "bfloat16", "block", "cooperative", (128, 128), cluster_n=2,
            smem_scales=True, promote_lag=True),
        # the compute-bound default: the same with the whole-tile epilogue
        key("varlen", e4, "bfloat16", "block", "cooperative", (128, 128), cluster_n=2,
            smem_scales=True, promote_lag=True, epi_whole=True),
        # ... with the empty halves skipped (its default from 768 rows per problem)
        key("varlen", e4, "bfloat16", "block", "cooperative", (128, 128), cluster_n=2,
            smem_scales=True, promote_lag=True, epi_whole=True, skip_empty_half=True),
        # ... with the staged scales promoted in the plain loop (MOE_GEMM_FP8_PROMOTE_LAG=0)
        key("varlen", e4, "bfloat16", "block", "cooperative", (128, 128), cluster_n=2,
            smem_scales=True, epi_whole=True),
        # ... and with every stage waited for in full (MOE_GEMM_FP8_PEEK_WAIT=0)
        key("varlen", e4, "bfloat16", "block", "cooperative", (128, 128), cluster_n=2,
            smem_scales=True, promote_lag=True, epi_whole=True, peek_wait=False),
        # the batched form's staged scales (its default waits in full)
        key("batched", e4, "bfloat16", "block", "cooperative", (128, 128), cluster_n=2,
            smem_scales=True, promote_lag=True, peek_wait=False),
    ]
