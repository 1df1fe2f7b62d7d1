"""kernels/sm90/trimmed_a.py on the CPU: which kernels build trimmed A loads (the varlen
form, A loaded by TMA), the compile key that names them, and the box heights a tile uses.
(The loads themselves run in test_trimmed_a_gpu.py.)"""

from __future__ import annotations

import os

import pytest

from moe_gemm.capability import cutlass_dsl_problem

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")

REFUSED = r"trimmed A loads are built for the varlen form, without gather-A"


@pytest.fixture(scope="module")
def dsl():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass

    from moe_gemm.kernels.sm90.grouped_gemm import GroupedGemmSm90

    return cutlass, GroupedGemmSm90


@pytest.mark.parametrize("form", ["general", "batched", "masked"])
def test_only_the_varlen_form_trims(dsl, form):
    cutlass, Kernel = dsl
    bf16 = cutlass.BFloat16
    with pytest.raises(ValueError, match=REFUSED):
        Kernel(bf16, bf16, "k", form, "cooperative", "device", (128, 256), trim_a=True)
    assert Kernel(bf16, bf16, "k", "varlen", "cooperative", "device", (128, 256),
                  trim_a=True).trim_a


def test_no_trim_with_gather_a_and_both_clusters_build(dsl):
    cutlass, Kernel = dsl
    bf16 = cutlass.BFloat16
    from moe_gemm.kernels.sm90.fused_moe import FusedMoeGemmSm90

    with pytest.raises(ValueError, match=REFUSED):
        FusedMoeGemmSm90(bf16, bf16, "k", "varlen", "pingpong", "device", (64, 128),
                         gather_a=True, trim_a=True)
    # B multicast (2x1) keeps A the CTA's own; A multicast (1x2): the first CTA issues the
    # boxes of a trimmed tile to both.
    for cm, cn in ((2, 1), (1, 2)):
        assert Kernel(bf16, bf16, "k", "varlen", "pingpong", "device", (128, 128),
                      cluster_m=cm, cluster_n=cn, trim_a=True).trim_a


def test_box_heights_stay_below_the_tile():
    from moe_gemm.kernels.sm90.constants import A_ROW_BOXES
    from moe_gemm.kernels.sm90.trimmed_a import box_heights

    assert box_heights(64) == (32, 16)
    assert box_heights(128) == box_heights(256) == (64, 32, 16)
    # Each height a multiple of the 8-row swizzle atom and every tile a multiple of each, so
    # a box lands where the whole box would have put its rows.
    for h in A_ROW_BOXES:
        assert h % 8 == 0 and all(t % h == 0 for t in (64, 128, 192, 256))


def test_compile_key_names_the_trimmed_kernel():
    from moe_gemm.kernels.sm90.compile import CompileKey

    plain = CompileKey("varlen", "bfloat16", "bfloat16", "k", "cooperative", "device", 128, 256)
    trimmed = CompileKey("varlen", "bfloat16", "bfloat16", "k", "cooperative", "device", 128,
                         256, trim_a=True)
    assert trimmed.name() == plain.name() + "_trima" and trimmed != plain
    assert trimmed.kernel().trim_a and not plain.kernel().trim_a
