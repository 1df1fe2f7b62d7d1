"""Packed pairs (GroupedGemmSm90 packed_pairs) on the CPU: which kernels build them. (The
kernels themselves run in test_packed_pairs_gpu.py.)"""

from __future__ import annotations

import os

import pytest

from moe_gemm.capability import cutlass_dsl_problem

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")

REFUSED = r"packed pairs are built for the varlen form in 2x1 clusters"


@pytest.fixture(scope="module")
def dsl():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass

    from moe_gemm.kernels.sm90.fused_moe import FusedMoeGemmSm90
    from moe_gemm.kernels.sm90.grouped_gemm import GroupedGemmSm90

    return cutlass.BFloat16, GroupedGemmSm90, FusedMoeGemmSm90


def test_the_varlen_2x1_kernels_build_them(dsl):
    bf16, Kernel, Fused = dsl
    for major in ("k", "n"):
        assert Kernel(bf16, bf16, major, "varlen", "cooperative", "device", (128, 256),
                      cluster_m=2, trim_a=True, packed_pairs=True).packed_pairs
    # B's whole box per CTA: the interleaved gate layout, a bias and row weights too.
    assert Fused(bf16, bf16, "k", "varlen", "pingpong", "device", (128, 192), cluster_m=2,
                 gate="silu", gate_layout="interleaved", packed_pairs=True).packed_pairs
    assert Fused(bf16, bf16, "k", "varlen", "cooperative", "device", (128, 256), cluster_m=2,
                 bias=True, row_scale=True, packed_pairs=True).packed_pairs


@pytest.mark.parametrize("options", [
    dict(form="batched", cluster_m=2), dict(form="varlen", cluster_n=2),
    dict(form="varlen"), dict(form="varlen", cluster_m=2, tail_split=True)],
    ids=["batched", "1x2", "1x1", "tail-split"])
def test_other_kernels_refuse_them(dsl, options):
    bf16, Kernel, _ = dsl
    form = options.pop("form")
    with pytest.raises(ValueError, match=REFUSED):
        Kernel(bf16, bf16, "k", form, "cooperative", "device", (128, 256), packed_pairs=True,
               **options)


def test_the_concat_gate_layout_refuses_them(dsl):
    """Its up half of B is loaded by the multicast atom whatever the pair: a pair of two
    experts (or columns) would read half of the other tile's up weights."""
    bf16, _, Fused = dsl
    with pytest.raises(ValueError, match=REFUSED):
        Fused(bf16, bf16, "k", "varlen", "pingpong", "device", (128, 192), cluster_m=2,
              gate="silu", gate_layout="concat", packed_pairs=True)
    with pytest.raises(ValueError, match=REFUSED):
        Fused(bf16, bf16, "k", "varlen", "pingpong", "device", (64, 128), cluster_m=2,
              gather_a=True, packed_pairs=True)
