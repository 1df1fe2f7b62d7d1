"""The combine kernel (kernels/sm90/combine.py) compiles for sm90a without a GPU, with the
loads it is built around: k independent 16-byte loads of y and one 16-byte store per thread."""

import os
import re

import pytest

from moe_gemm.capability import cutlass_dsl_problem

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")


@pytest.mark.parametrize("dtype,index,k,weighted", [
    ("bfloat16", "int64", 8, False), ("float16", "int32", 3, True), ("bfloat16", "int32", 1, True),
    ("bfloat16", "int64", 16, False)])
def test_compiles_with_vector_loads(tmp_path, dtype, index, k, weighted):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.combine import CombineCompileKey, compile_combine

    key = CombineCompileKey(dtype, index, k, weighted)
    compile_combine(key, keep_dir=str(tmp_path))
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert len(re.findall(r"ld\.global[.\w]*\.v4\.", ptx)) == k
    assert len(re.findall(r"st\.global[.\w]*\.v4\.", ptx)) == 1
    assert key.name() == f"combine_{dtype}_{index}_k{k}" + ("_weighted" if weighted else "")


def test_refuses_k_beyond_its_range():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass

    from moe_gemm.kernels.sm90.combine import MAX_K, TokenCombineSm90

    for k in (0, MAX_K + 1):
        with pytest.raises(ValueError, match="slots per token"):
            TokenCombineSm90(cutlass.BFloat16, k, False)
