"""TokenGatherSm90: an MoE layer's routed rows gathered from its tokens, one kernel launch.

    out[r, :] = x[rows[r], :]

rows (S,) holds the token of each routed row (the layer's permutation). Each thread owns one
16-byte vector of a row and ROWS rows of the CTA: it issues the ROWS loads together (they are
independent), then the ROWS stores. x's rows are read through L2 (a top-k token is read k
times) and out written once, so the gather is bound by out's bytes over the copy bandwidth.
On an H200 (2026-12-04), Qwen3-30B-A3B's 131072 routed rows of 2048 at 16384 tokens (537 MB
written): 0.196 ms, where torch's index_select took 0.256 ms; DeepSeek-V3 EP8's of 7168 0.673
against 0.924 ms. Of the CTA shapes tried (2, 4, 8 or 16 rows; 64, 128 or 256 threads), 8 rows
of 64 threads ran 10-12% faster than 4 of 128 and 16 of 64 no faster.

A row index outside [0, T) is clamped into it (a wrong row, never an out-of-bounds read).
Addresses are 64-bit (x's and out's row strides are Int64, an int64 index stays Int64), so x
and out may hold 2^31 values or more; the sizes are Int32: T and S at most
ops/row_kernels.MAX_ROWS (the grid's rounding of S up to ROWS and a CTA's rows past the last
stay in range) and H / VEC at most 65535 * THREADS (the grid's y dimension), which the caller
(ops/token_gather.py) keeps to, taking index_select past them.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from .vector_rows import VEC, fake_vector_rows

THREADS = 64  # threads per CTA: 512 values of a row
ROWS = 8  # routed rows per CTA: eight 16-byte loads in flight per thread before its stores
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
INDEX_DTYPES = {"int64": cutlass.Int64, "int32": cutlass.Int32}


class TokenGatherSm90:
    """See the module docstring. dtype: cutlass.BFloat16 or Float16 (x and out); rows and
    threads: routed rows and threads per CTA."""

    def __init__(self, dtype, rows: int = ROWS, threads: int = THREADS):
        self.dtype = dtype
        self.rows = rows
        self.threads = threads

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRows: cute.Tensor, mOut: cute.Tensor, stream):
        # mX (T, H), mRows (S,), mOut (S, H); H a multiple of VEC; T and S in [1, MAX_ROWS];
        # H / VEC <= 65535 * threads (the module docstring).
        vecs = mOut.shape[1] // VEC
        self.kernel(mX, mRows, mOut).launch(
            grid=((mOut.shape[0] + self.rows - 1) // self.rows,
                  (vecs + self.threads - 1) // self.threads, 1),
            block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRows: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        block, chunk, _ = cute.arch.block_idx()
        v = chunk * self.threads + tidx  # this thread's 16-byte vector of each row
        if v < mOut.shape[1] // VEC:
            last_token = mX.shape[0] - 1
            last_row = mOut.shape[0] - 1
            first = block * self.rows
            frags = [cute.make_rmem_tensor((VEC,), self.dtype) for _ in range(self.rows)]
            for j in cutlass.range_constexpr(self.rows):
                # (a CTA's rows past the last one load the last row again and store nothing)
                r = cutlass.min(first + j, last_row)
                t = cutlass.max(cutlass.min(mRows[r], last_token), 0)
                cute.autovec_copy(cute.local_tile(mX[t, None], (VEC,), (v,)), frags[j])
            for j in cutlass.range_constexpr(self.rows):
                if first + j <= last_row:
                    cute.autovec_copy(frags[j], cute.local_tile(mOut[first + j, None], (VEC,),
                                                                (v,)))


@dataclass(frozen=True)
class GatherCompileKey:
    """One compiled gather: the rows' dtype and the index dtype."""

    dtype: str  # "bfloat16" | "float16"
    index_dtype: str  # "int64" | "int32"

    def name(self) -> str:
        return f"token_gather_{self.dtype}_{self.index_dtype}"


def compile_gather(key: GatherCompileKey, keep_dir: str | None = None):
    """cute.compile the gather for rows of 16-byte multiples, 16-byte aligned (x and out with
    H contiguous), rows (S,) with any stride."""
    dt, it = DTYPES[key.dtype], INDEX_DTYPES[key.index_dtype]
    x, out = fake_vector_rows(dt), fake_vector_rows(dt)
    rows = cute.runtime.make_fake_tensor(it, (cute.sym_int(),), stride=(cute.sym_int64(),))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    from .compile import compile_options

    return cute.compile(TokenGatherSm90(dt), x, rows, out, stream,
                        options=compile_options(keep_dir))


__all__ = ["ROWS", "VEC", "GatherCompileKey", "TokenGatherSm90", "compile_gather"]
