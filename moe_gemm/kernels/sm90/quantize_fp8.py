"""Fp8GroupQuantSm90: activations to FP8 in 1x128 groups per token, one kernel launch.

x (T, K) bf16 / fp16 / fp32 (K contiguous, K a multiple of 128) -> q (T, K) FP8 and scales
s (T, K/128) fp32, with x ~= q * s per group: s = max(|x_group|) / FP8_MAX, q = x / s
saturated to +-FP8_MAX (448 for e4m3, 57344 for e5m2). It runs on every FP8 layer call, so
it is one pass: each warp takes one 128-value group (32 lanes x 4 contiguous values, one 8-
or 16-byte load per lane), reduces the group's absolute maximum across the warp with five
butterfly shuffles, and each lane stores its 4 FP8 bytes (one 32-bit store); lane 0 stores the
scale. A torch op sequence reads x three times and launches ~6 kernels; this reads it once.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

GROUP = 128
LANE_VALUES = GROUP // 32  # 4 values per lane
WARPS = 8  # groups per CTA (256 threads)
# A group of zeros still gets a finite, nonzero scale (its values stay 0).
MIN_AMAX = 1e-10
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


class Fp8GroupQuantSm90:
    """One warp per 1x128 group (see the module docstring). in_dtype: cutlass.BFloat16,
    Float16 or Float32; out_dtype: cutlass.Float8E4M3FN or Float8E5M2."""

    def __init__(self, in_dtype, out_dtype):
        self.in_dtype = in_dtype
        self.out_dtype = out_dtype
        name = "float8_e4m3fn" if out_dtype is cutlass.Float8E4M3FN else "float8_e5m2"
        self.fp8_max = FP8_MAX[name]

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, groups: Int32,
                 stream):
        # mX (T, K), mQ (T, K), mS (T, K / 128); groups = T * K / 128 (> 0).
        self.kernel(mX, mQ, mS, groups).launch(
            grid=((groups + WARPS - 1) // WARPS, 1, 1), block=(WARPS * 32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, groups: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        g = bid * WARPS + warp
        if g < groups:  # (warp-uniform: the shuffles below see the whole warp)
            kbs = mS.shape[1]
            row = g // kbs
            kb = g - row * kbs
            chunk = kb * (GROUP // LANE_VALUES) + lane  # this lane's 4-value chunk in the row
            src = cute.local_tile(mX[row, None], (LANE_VALUES,), (chunk,))
            dst = cute.local_tile(mQ[row, None], (LANE_VALUES,), (chunk,))
            v = cute.make_rmem_tensor((LANE_VALUES,), self.in_dtype)
            cute.autovec_copy(src, v)
            f = cute.make_rmem_tensor((LANE_VALUES,), Float32)
            f.store(v.load().to(Float32))
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(LANE_VALUES):
                amax = cute.arch.fmax(amax, cute.math.abs(f[i]))
            amax = cute.arch.warp_reduction_max(amax)
            amax = cute.arch.fmax(amax, Float32(MIN_AMAX))
            inv = Float32(self.fp8_max) / amax
            for i in cutlass.range_constexpr(LANE_VALUES):
                # |x| * (max / amax) can round a hair past max: saturate explicitly (e4m3 has
                # no infinity; an overflowing conversion would give NaN).
                y = f[i] * inv
                y = cute.arch.fmax(y, Float32(-self.fp8_max))
                f[i] = -cute.arch.fmax(-y, Float32(-self.fp8_max))
            q = cute.make_rmem_tensor((LANE_VALUES,), self.out_dtype)
            q.store(f.load().to(self.out_dtype))
            cute.autovec_copy(q, dst)
            if lane == 0:
                mS[row, kb] = amax / Float32(self.fp8_max)
