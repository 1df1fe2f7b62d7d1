"""The token gather kernel (kernels/sm90/token_gather.py) compiles for sm90a without a GPU,
with the loads it is built around: ROWS independent 16-byte loads of x and ROWS 16-byte stores
per thread."""

import os
import re

import pytest

from moe_gemm.capability import cutlass_dsl_problem

pytestmark = pytest.mark.skipif(cutlass_dsl_problem() is not None,
                                reason=f"CuTe DSL: {cutlass_dsl_problem()}")


@pytest.mark.parametrize("dtype,index", [("bfloat16", "int64"), ("float16", "int32")])
def test_compiles_with_vector_loads(tmp_path, dtype, index):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.token_gather import ROWS, GatherCompileKey, compile_gather

    key = GatherCompileKey(dtype, index)
    compile_gather(key, keep_dir=str(tmp_path))
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    assert len(re.findall(r"ld\.global[.\w]*\.v4\.", ptx)) == ROWS
    assert len(re.findall(r"st\.global[.\w]*\.v4\.", ptx)) == ROWS
    assert key.name() == f"token_gather_{dtype}_{index}"
