"""TokenCombineSm90: an MoE layer's top-k combine, one kernel launch.

    out[t, :] = sum_j w[t, j] * y[rows[t, j], :]     (w = 1 when the rows are already weighted)

y (S, H) holds the routed rows in expert order, rows (T, k) the row of each of a token's k
slots. Accumulated in fp32 and rounded once to out's dtype, the k rows summed in slot order
(deterministic, no atomics). Each thread owns 8 values (16 bytes) of one token's output row:
it reads the token's k row indices, issues the k 16-byte loads together (k is compile-time,
so they are independent), and stores one 16-byte vector. y is read once and out written once:
on an H200 the combine is bound by its bytes over the copy bandwidth (Qwen3-30B-A3B at 16384
tokens: 537 MB of routed rows, ~0.13 ms), where `F.embedding_bag` took 0.72 ms.

A row index outside [0, S) is clamped into it (a wrong row, never an out-of-bounds read).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .constants import COMBINE_MAX_K as MAX_K
from .vector_rows import VEC, fake_vector_rows

THREADS = 128  # threads per CTA: 1024 values of a row (H = 2048: two CTAs per token)
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
INDEX_DTYPES = {"int64": cutlass.Int64, "int32": cutlass.Int32}


class TokenCombineSm90:
    """See the module docstring. dtype: cutlass.BFloat16 or Float16 (y and out); k: slots per
    token (1 to MAX_K); weighted: whether w multiplies the rows."""

    def __init__(self, dtype, k: int, weighted: bool):
        if not 1 <= k <= MAX_K:
            raise ValueError(f"the combine kernel takes 1 to {MAX_K} slots per token; got {k}")
        self.dtype = dtype
        self.k = k
        self.weighted = weighted

    @cute.jit
    def __call__(self, mY: cute.Tensor, mRows: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor,
                 stream):
        # mY (S, H), mRows (T, k), mW (T, k) fp32 (unused unless weighted), mOut (T, H);
        # H a multiple of VEC, T > 0.
        vecs = mOut.shape[1] // VEC
        self.kernel(mY, mRows, mW, mOut).launch(
            grid=(mOut.shape[0], (vecs + THREADS - 1) // THREADS, 1), block=(THREADS, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mRows: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        t, chunk, _ = cute.arch.block_idx()
        v = chunk * THREADS + tidx  # this thread's 16-byte vector of the row
        if v < mOut.shape[1] // VEC:
            last = mY.shape[0] - 1
            frags = [cute.make_rmem_tensor((VEC,), self.dtype) for _ in range(self.k)]
            for j in cutlass.range_constexpr(self.k):
                r = cutlass.max(cutlass.min(mRows[t, j], last), 0)
                cute.autovec_copy(cute.local_tile(mY[r, None], (VEC,), (v,)), frags[j])
            acc = cute.make_rmem_tensor((VEC,), Float32)
            acc.fill(0.0)
            for j in cutlass.range_constexpr(self.k):
                part = frags[j].load().to(Float32)
                if cutlass.const_expr(self.weighted):
                    part = part * mW[t, j]
                acc.store(acc.load() + part)
            res = cute.make_rmem_tensor((VEC,), self.dtype)
            res.store(acc.load().to(self.dtype))
            cute.autovec_copy(res, cute.local_tile(mOut[t, None], (VEC,), (v,)))


@dataclass(frozen=True)
class CombineCompileKey:
    """One compiled combine: the rows' dtype, the index dtype, k and whether weighted."""

    dtype: str  # "bfloat16" | "float16"
    index_dtype: str  # "int64" | "int32"
    k: int
    weighted: bool

    def name(self) -> str:
        return (f"combine_{self.dtype}_{self.index_dtype}_k{self.k}"
                + ("_weighted" if self.weighted else ""))


def compile_combine(key: CombineCompileKey, keep_dir: str | None = None):
    """cute.compile the combine for rows of 16-byte multiples, 16-byte aligned (y and out with
    H contiguous), rows and w (T, k) with any strides."""
    dt, it = DTYPES[key.dtype], INDEX_DTYPES[key.index_dtype]
    y, out = fake_vector_rows(dt), fake_vector_rows(dt)
    t, k = cute.sym_int(), key.k
    rows = cute.runtime.make_fake_tensor(it, (t, k), stride=(cute.sym_int64(), cute.sym_int64()))
    w = cute.runtime.make_fake_tensor(Float32, (cute.sym_int(), cute.sym_int()),
                                      stride=(cute.sym_int64(), cute.sym_int64()))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    from .compile import compile_options

    return cute.compile(TokenCombineSm90(dt, key.k, key.weighted), y, rows, w, out, stream,
                        options=compile_options(keep_dir))


__all__ = ["MAX_K", "VEC", "CombineCompileKey", "TokenCombineSm90", "compile_combine"]
