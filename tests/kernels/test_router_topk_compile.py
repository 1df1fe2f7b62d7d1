"""The softmax router kernel (kernels/sm90/router_topk.py) compiles for sm90a without a GPU:
one warp per token (butterfly shuffles only, no shared or local memory), the exp without the
fast ex2 on a raw argument, and it refuses E and k outside its range."""

import os
import re

import pytest

from moe_gemm.capability import cutlass_dsl_problem

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")


@pytest.mark.parametrize("dtype,E,k,renormalize", [
    ("bfloat16", 128, 8, True), ("float32", 60, 4, False), ("float16", 8, 2, True),
    ("bfloat16", 256, 8, False)])
def test_compiles_to_warp_shuffles(tmp_path, dtype, E, k, renormalize):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.router_topk import RouterTopkCompileKey, compile_router_topk

    key = RouterTopkCompileKey(dtype, E, k, renormalize)
    compile_router_topk(key, keep_dir=str(tmp_path))
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    # row max and sum: 5 + 5; each of the k rounds: value and index, 5 steps each
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == 10 + 10 * k
    assert not re.search(r"\b(ld|st)\.(local|shared)", ptx)
    # two ex2 per exp (the reduced argument and the power of two): E / 32 per lane, then k
    assert len(re.findall(r"ex2\.approx", ptx)) == 2 * ((E + 31) // 32 + k)
    assert len(re.findall(r"st\.global", ptx)) == 2  # a weight and an id per lane
    assert key.name() == f"router_softmax_topk_{dtype}_e{E}_k{k}" + (
        "_renorm" if renormalize else "")


def test_refuses_sizes_beyond_its_range():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass

    from moe_gemm.kernels.sm90.router_topk import MAX_E, MAX_K, SoftmaxTopkSm90

    for E in (0, MAX_E + 1):
        with pytest.raises(ValueError, match="experts"):
            SoftmaxTopkSm90(cutlass.BFloat16, E, 1, True)
    for E, k in ((64, 0), (64, MAX_K + 1), (4, 5)):
        with pytest.raises(ValueError, match="slots"):
            SoftmaxTopkSm90(cutlass.BFloat16, E, k, True)


@pytest.mark.parametrize("dtype,E,k,n_group,topk_group,renormalize,has_bias", [
    ("float32", 256, 8, 8, 4, True, True), ("bfloat16", 64, 6, 8, 3, False, True),
    ("float32", 32, 4, 1, 1, True, False)])
def test_group_router_compiles_to_warp_shuffles(tmp_path, dtype, E, k, n_group, topk_group,
                                                renormalize, has_bias):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.router_topk import GroupTopkCompileKey, compile_group_topk

    key = GroupTopkCompileKey(dtype, E, k, n_group, topk_group, renormalize, has_bias)
    compile_group_topk(key, keep_dir=str(tmp_path))
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    grouped = n_group > 1 and topk_group < n_group
    # each group's two best (value and index, 5 steps each), then k picks plus the broadcast
    # of the pick's unbiased score
    bfly = len(re.findall(r"shfl\.sync\.bfly", ptx))
    assert bfly == (2 * 10 * n_group if grouped else 0) + 10 * k
    # (+2: the warp index made uniform)
    assert k <= len(re.findall(r"shfl\.sync\.idx", ptx)) <= k + 2
    assert not re.search(r"\b(ld|st)\.(local|shared)", ptx)
    assert key.name().startswith(f"router_sigmoid_group_topk_{dtype}_e{E}_k{k}_g{n_group}")


def test_group_router_refuses_what_it_cannot_build():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass

    from moe_gemm.kernels.sm90.router_topk import MAX_GROUPS, SigmoidGroupTopkSm90

    bf = cutlass.BFloat16
    with pytest.raises(ValueError, match="groups"):
        SigmoidGroupTopkSm90(bf, 64, 2, 6, 2, True, True)  # 6 does not divide 64
    with pytest.raises(ValueError, match="groups"):
        SigmoidGroupTopkSm90(bf, 2 * (MAX_GROUPS + 1), 2, MAX_GROUPS + 1, 2, True, True)
    with pytest.raises(ValueError, match="two best"):
        SigmoidGroupTopkSm90(bf, 8, 2, 8, 4, True, True)
    with pytest.raises(ValueError, match="slots"):
        SigmoidGroupTopkSm90(bf, 64, 17, 8, 2, True, True)  # 2 groups of 8 hold 16
