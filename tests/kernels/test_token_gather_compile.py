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


def test_the_ops_limits_fit_the_kernels():
    # ops/row_kernels.py keeps the row kernels' sizes to their Int32 shapes and launch grid:
    # its thread count must be the fewest of any row kernel's CTA, and the gather's rounding
    # of S up to ROWS must stay in Int32.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass

    from moe_gemm.kernels.sm90 import combine, token_gather
    from moe_gemm.kernels.sm90.vector_rows import fake_vector_rows
    from moe_gemm.ops import row_kernels

    assert row_kernels.ROW_THREADS <= min(token_gather.THREADS, combine.THREADS)
    assert row_kernels.MAX_ROWS + token_gather.ROWS - 1 <= 2**31 - 1
    assert row_kernels.MAX_ROW_VECS == row_kernels.MAX_GRID_Y * row_kernels.ROW_THREADS
    # 64-bit row strides: x and out of 2^31 values or more are addressed without overflow.
    t = fake_vector_rows(cutlass.BFloat16)
    assert t.stride[0].width == 64 and [s.width for s in t.shape] == [32, 32]
