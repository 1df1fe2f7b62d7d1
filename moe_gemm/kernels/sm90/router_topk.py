"""SoftmaxTopkSm90: the softmax router's top-k, one kernel launch.

    p = softmax(logits[t]) in fp32;  ids[t] = the k largest p, best first;
    weights[t] = p[ids[t]] (divided by their sum when renormalize)

One warp per token: lane l holds the row's values l, l + 32, ... (E is compile-time, at most
MAX_E = 1024: 32 values a lane). The row max and the sum of exp(x - max) are butterfly
reductions over the warp; then k rounds each take the largest value not yet taken, a lane's
own candidate first, then a butterfly over (value, index) pairs (larger value, or the lower
index on a tie: every lane ends with the same winner). torch.softmax + torch.topk take two
kernels and a sort of the k results (0.16 ms at 16384 tokens of 128 experts on an H200), where
this reads the row once.

NaN logits count as +inf for the choice (torch.topk ranks NaN above every number); their
rows' weights come out NaN, as torch's softmax gives them. A row of -inf gives NaN weights
and the lowest ids not yet taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .constants import ROUTER_MAX_E as MAX_E
from .constants import ROUTER_MAX_K as MAX_K

WARPS = 4  # tokens per CTA
NONE = 1 << 30  # "no candidate" index: loses every comparison
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


# exp(x) for x <= 0 to ~2e-7 relative (torch's softmax uses expf): the hardware ex2 alone, on
# x * log2(e) rounded to fp32, loses |x| * 6e-8 (1e-6 at x = -20). So x = n ln2 + r with n an
# integer (ln2 in two parts: n * LN2_HI is exact for |n| < 2^8) and exp(x) = 2^r' * 2^n, both
# factors from ex2 (exact at integers, 2^-22 relative on |r'| <= 1/2). x is clamped at -104
# (exp underflows to 0 there), so -inf gives 0, not NaN.
LOG2E = 1.4426950408889634
LN2_HI = 0.693145751953125
LN2_LO = 1.4286068203094173e-06
EXP_MIN = -104.0


@cute.jit
def _exp(x: Float32) -> Float32:
    x = cutlass.max(x, Float32(EXP_MIN))
    n = cute.math.round(x * LOG2E)
    r = (x - n * LN2_HI) - n * LN2_LO
    return cute.math.exp2(r * LOG2E) * cute.math.exp2(n)


def _bfly(x, offset: int):
    return cute.arch.shuffle_sync_bfly(x, offset=offset)


class SoftmaxTopkSm90:
    """See the module docstring. E experts, k slots, renormalize: divide by the k weights' sum."""

    def __init__(self, dtype, E: int, k: int, renormalize: bool):
        if not 1 <= E <= MAX_E:
            raise ValueError(f"the router kernel takes 1 to {MAX_E} experts; got {E}")
        if not 1 <= k <= min(E, MAX_K):
            raise ValueError(f"the router kernel takes 1 to min(E, {MAX_K}) slots; got {k}")
        self.dtype, self.E, self.k, self.renormalize = dtype, E, k, renormalize
        self.V = (E + 31) // 32

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mWeights: cute.Tensor, mIds: cute.Tensor,
                 stream):
        # mLogits (T, E) with unit stride along E; mWeights (T, k) fp32; mIds (T, k) int64.
        T = mLogits.shape[0]
        self.kernel(mLogits, mWeights, mIds).launch(
            grid=((T + WARPS - 1) // WARPS, 1, 1), block=(32 * WARPS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mWeights: cute.Tensor, mIds: cute.Tensor):
        E, K, V = self.E, self.k, self.V
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * WARPS + warp
        if t < mLogits.shape[0]:
            vals = cute.make_rmem_tensor((V,), Float32)
            for i in cutlass.range_constexpr(V):
                x = Float32(-float("inf"))
                if cutlass.const_expr(32 * i + 31 < E):
                    x = Float32(mLogits[t, lane + 32 * i])
                elif lane + 32 * i < E:
                    x = Float32(mLogits[t, lane + 32 * i])
                if x != x:  # NaN ranks first, as in torch.topk
                    x = Float32(float("inf"))
                vals[i] = x
            row_max = vals[0]
            for i in cutlass.range_constexpr(1, V):
                row_max = cutlass.max(row_max, vals[i])
            for off in (16, 8, 4, 2, 1):
                row_max = cutlass.max(row_max, _bfly(row_max, off))
            total = Float32(0.0)
            for i in cutlass.range_constexpr(V):
                if lane + 32 * i < E:
                    total = total + _exp(vals[i] - row_max)
            for off in (16, 8, 4, 2, 1):
                total = total + _bfly(total, off)

            taken = Int32(0)
            kept_sum = Float32(0.0)
            my_weight = Float32(0.0)
            my_id = Int32(0)
            for j in cutlass.range_constexpr(K):
                best_v = Float32(-float("inf"))
                best_i = Int32(NONE)
                for i in cutlass.range_constexpr(V):
                    e = lane + 32 * i
                    free = ((taken >> i) & 1) == 0 and e < E
                    if free and (vals[i] > best_v or best_i == NONE):
                        best_v = vals[i]
                        best_i = e
                for off in (16, 8, 4, 2, 1):
                    other_v = _bfly(best_v, off)
                    other_i = _bfly(best_i, off)
                    wins = other_v > best_v or (other_v == best_v and other_i < best_i)
                    if other_i != NONE and (best_i == NONE or wins):
                        best_v = other_v
                        best_i = other_i
                if lane == best_i % 32:
                    taken = taken | (Int32(1) << (best_i // 32))
                p = _exp(best_v - row_max) / total
                kept_sum = kept_sum + p
                if lane == j:
                    my_weight = p
                    my_id = best_i
            if lane < K:
                w = my_weight
                if cutlass.const_expr(self.renormalize):
                    w = my_weight / kept_sum
                mWeights[t, lane] = w
                mIds[t, lane] = Int64(my_id)


@dataclass(frozen=True)
class RouterTopkCompileKey:
    """One compiled router: the logits' dtype, E, k and whether the weights are renormalised."""

    dtype: str  # "bfloat16" | "float16" | "float32"
    E: int
    k: int
    renormalize: bool

    def name(self) -> str:
        return (f"router_softmax_topk_{self.dtype}_e{self.E}_k{self.k}"
                + ("_renorm" if self.renormalize else ""))


def compile_router_topk(key: RouterTopkCompileKey, keep_dir: str | None = None):
    """cute.compile the router for (T, E) logits with unit stride along E, any row stride."""
    dt = DTYPES[key.dtype]
    t = cute.sym_int()
    logits = cute.runtime.make_fake_tensor(dt, (t, key.E), stride=(cute.sym_int64(), 1))
    weights = cute.runtime.make_fake_tensor(Float32, (t, key.k), stride=(cute.sym_int64(), 1))
    ids = cute.runtime.make_fake_tensor(cutlass.Int64, (t, key.k), stride=(cute.sym_int64(), 1))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    from .compile import compile_options

    return cute.compile(SoftmaxTopkSm90(dt, key.E, key.k, key.renormalize), logits, weights,
                        ids, stream, options=compile_options(keep_dir))


__all__ = ["MAX_E", "MAX_K", "RouterTopkCompileKey", "SoftmaxTopkSm90", "compile_router_topk"]
