"""The masked form's kernel refusals, checked on the CPU (building a kernel object traces
nothing): it reads its row counts on the GPU, so it is built for the device visitor only, and
has no tail split (whose plan needs the tile count on the host). Each refusal is a ValueError
from the constructor, for the 16-bit kernel, the FP8 kernel and their compile keys; the
host's kernel choice refuses a pinned tail split the same way."""

from __future__ import annotations

import os

import pytest

from moe_gemm.capability import cutlass_dsl_problem

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")

VISITOR = r"the masked form reads its row counts on the GPU: device visitor"
TAIL = r"the tail split is built for the general, varlen and batched forms"


@pytest.fixture(scope="module")
def dsl():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass

    from moe_gemm.kernels.sm90.grouped_gemm import GroupedGemmSm90
    from moe_gemm.kernels.sm90.grouped_gemm_fp8 import GroupedGemmFp8Sm90

    return cutlass, GroupedGemmSm90, GroupedGemmFp8Sm90


@pytest.mark.parametrize("schedule,tile", [("cooperative", (128, 128)), ("pingpong", (64, 128))])
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_masked_host_visitor_refused(dsl, schedule, tile, b_major):
    cutlass, Kernel, _ = dsl
    bf16 = cutlass.BFloat16
    with pytest.raises(ValueError, match=VISITOR):
        Kernel(bf16, bf16, b_major, "masked", schedule, "host", tile)
    # The device visitor builds (the other forms keep the host visitor).
    k = Kernel(bf16, bf16, b_major, "masked", schedule, "device", tile)
    assert k.form == "masked" and k.visitor == "device"
    assert Kernel(bf16, bf16, b_major, "batched", schedule, "host", tile).visitor == "host"


def test_masked_tail_split_refused(dsl):
    cutlass, Kernel, _ = dsl
    bf16, fp32 = cutlass.BFloat16, cutlass.Float32
    with pytest.raises(ValueError, match=TAIL):
        Kernel(bf16, bf16, "k", "masked", "cooperative", "device", (128, 128), tail_split=True)
    with pytest.raises(ValueError, match=TAIL):
        Kernel(bf16, fp32, "n", "masked", "cooperative", "device", (128, 256), tail_split=True)
    # The same build without the split, and the batched form with it, are fine.
    assert not Kernel(bf16, bf16, "k", "masked", "cooperative", "device", (128, 128)).tail_split
    assert Kernel(bf16, bf16, "k", "batched", "cooperative", "device", (128, 128),
                  tail_split=True).tail_split


@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)])
@pytest.mark.parametrize("schedule,tile", [("cooperative", (128, 256)), ("pingpong", (64, 128))])
def test_masked_clusters_build_on_the_device_visitor(dsl, cluster, schedule, tile):
    cutlass, Kernel, _ = dsl
    fp16 = cutlass.Float16
    k = Kernel(fp16, fp16, "n", "masked", schedule, "device", tile, cluster_m=cluster[0],
               cluster_n=cluster[1])
    assert k.cluster_size == 2
    with pytest.raises(ValueError):
        Kernel(fp16, fp16, "n", "masked", schedule, "host", tile, cluster_m=cluster[0],
               cluster_n=cluster[1])


@pytest.mark.parametrize("scale_mode", ["block", "outer"])
def test_fp8_masked_refusals(dsl, scale_mode):
    cutlass, _, Fp8Kernel = dsl
    e4, bf16 = cutlass.Float8E4M3FN, cutlass.BFloat16
    with pytest.raises(ValueError, match=VISITOR):
        Fp8Kernel(e4, bf16, "masked", "cooperative", "host", (128, 128), scale_mode)
    with pytest.raises(ValueError, match=TAIL):
        Fp8Kernel(e4, bf16, "masked", "cooperative", "device", (128, 128), scale_mode,
                  tail_split=True)
    k = Fp8Kernel(e4, bf16, "masked", "pingpong", "device", (64, 128), scale_mode)
    assert k.form == "masked" and k.scale_mode == scale_mode


def test_compile_keys_refuse_before_tracing(dsl):
    from moe_gemm.kernels.sm90.compile import CompileKey
    from moe_gemm.kernels.sm90.compile_fp8 import Fp8CompileKey

    with pytest.raises(ValueError, match=VISITOR):
        CompileKey("masked", "bfloat16", "bfloat16", "k", "cooperative", "host", 128,
                   128).kernel()
    with pytest.raises(ValueError, match=TAIL):
        CompileKey("masked", "bfloat16", "bfloat16", "k", "cooperative", "device", 128, 128,
                   tail_split=True).kernel()
    assert CompileKey("masked", "float16", "float32", "n", "pingpong", "device", 64,
                      256).kernel().form == "masked"
    with pytest.raises(ValueError, match=VISITOR):
        Fp8CompileKey("masked", "float8_e4m3fn", "bfloat16", "block", "cooperative", "host",
                      128, 128).kernel()
    with pytest.raises(ValueError, match=TAIL):
        Fp8CompileKey("masked", "float8_e4m3fn", "bfloat16", "block", "cooperative", "device",
                      128, 128, tail_split=True).kernel()


def test_host_choice_refuses_a_pinned_tail_split():
    from moe_gemm import GemmConfig
    from moe_gemm.ops.heuristics import choose_batched
    from moe_gemm.ops.masked_launch import _masked_choice

    choice = choose_batched(GemmConfig(), 8, 512, 512, 7168, 132)
    with pytest.raises(ValueError, match=r"the masked form has no tail split"):
        _masked_choice(choice, GemmConfig(tail_split=True))
    host = GemmConfig(visitor="host")
    fixed = _masked_choice(choose_batched(host, 8, 512, 512, 7168, 132), host)
    assert fixed.visitor == "device" and fixed.tail_split is False
