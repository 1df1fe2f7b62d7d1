"""The row kernels' shared layout (the top-k combine, the token gather): rows of 16-byte
vectors, VEC 16-bit values each, as fake tensors for compiling without a GPU."""

from __future__ import annotations

import cutlass.cute as cute

from .constants import COMBINE_VEC as VEC


def fake_vector_rows(dtype):
    """A fake (rows, H) tensor of `dtype`: H a multiple of VEC and contiguous, rows 16-byte
    aligned and VEC-multiple strides apart, both sizes symbolic (Int32: ops/row_kernels.py
    keeps them in range), the row stride Int64 (offsets past 2^31 values)."""
    h = cute.sym_int(divisibility=VEC)
    return cute.runtime.make_fake_tensor(
        dtype, (cute.sym_int(), h), stride=(cute.sym_int64(divisibility=VEC), 1),
        assumed_align=16)


__all__ = ["VEC", "fake_vector_rows"]
