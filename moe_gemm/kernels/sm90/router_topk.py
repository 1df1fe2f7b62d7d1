"""SoftmaxTopkSm90 and SigmoidGroupTopkSm90: the routers' top-k, one kernel launch each.

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
from .constants import ROUTER_MAX_GROUPS as MAX_GROUPS
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


@cute.jit
def _warp_argmax(best_v: Float32, best_i: Int32):
    """The warp's best (value, index) of the lanes' candidates: the larger value, the lower
    index on a tie; a NONE index loses. Every lane gets the same pair."""
    for off in (16, 8, 4, 2, 1):
        other_v = _bfly(best_v, off)
        other_i = _bfly(best_i, off)
        wins = other_v > best_v or (other_v == best_v and other_i < best_i)
        if other_i != NONE and (best_i == NONE or wins):
            best_v = other_v
            best_i = other_i
    return best_v, best_i


@cute.jit
def _pick_next(vals: cute.Tensor, taken: Int32, kept: Int32, lane: Int32,
               E: cutlass.Constexpr, V: cutlass.Constexpr, per: cutlass.Constexpr):
    """(value, index, taken): the warp's best value not yet taken among the experts whose
    group (e // per) has its bit set in `kept`; the lane holding it marks it taken."""
    best_v = Float32(-float("inf"))
    best_i = Int32(NONE)
    for i in cutlass.range_constexpr(V):
        e = lane + 32 * i
        free = ((taken >> i) & 1) == 0 and e < E and ((kept >> (e // per)) & 1) == 1
        if free and (vals[i] > best_v or best_i == NONE):
            best_v = vals[i]
            best_i = e
    best_v, best_i = _warp_argmax(best_v, best_i)
    if lane == best_i % 32:
        taken = taken | (Int32(1) << (best_i // 32))
    return best_v, best_i, taken


@cute.jit
def _store_slots(mWeights: cute.Tensor, mIds: cute.Tensor, t: Int32, lane: Int32,
                 weight: Float32, expert: Int32, kept_sum: Float32, scale: Float32,
                 K: cutlass.Constexpr, renormalize: cutlass.Constexpr, eps: cutlass.Constexpr):
    """Lane j < K writes slot j: its weight (over kept_sum [+ eps] when renormalize) times
    scale, and its expert."""
    if lane < K:
        w = weight
        if cutlass.const_expr(renormalize):
            denominator = kept_sum
            if cutlass.const_expr(eps):
                denominator = kept_sum + Float32(eps)
            w = weight / denominator
        mWeights[t, lane] = w * scale
        mIds[t, lane] = Int64(expert)


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
                best_v, best_i, taken = _pick_next(vals, taken, Int32(-1), lane, E, V, E)
                p = _exp(best_v - row_max) / total
                kept_sum = kept_sum + p
                if lane == j:
                    my_weight = p
                    my_id = best_i
            _store_slots(mWeights, mIds, t, lane, my_weight, my_id, kept_sum, Float32(1.0), K,
                         self.renormalize, 0.0)


class SigmoidGroupTopkSm90:
    """The sigmoid router with a selection bias and group-limited top-k (DeepSeek-V3;
    layers/routing.sigmoid_grouped_topk's contract), a warp per token like SoftmaxTopkSm90:

        s = sigmoid(logits[t]) in fp32;  c = s + bias (selection only)
        grouped (1 < n_group, topk_group < n_group): a group scores the sum of its two best c,
            the topk_group best groups stay eligible
        ids[t] = the k best eligible c, best first; weights[t] = s[ids], divided by
            (their sum + 1e-20) when renormalize, times scale

    n_group <= 32 (a bit each in one register). A group's two best are two warp argmax rounds
    restricted to it; ties go to the lower index everywhere (torch.topk leaves them open)."""

    def __init__(self, dtype, E: int, k: int, n_group: int, topk_group: int,
                 renormalize: bool, has_bias: bool):
        if not 1 <= E <= MAX_E:
            raise ValueError(f"the router kernel takes 1 to {MAX_E} experts; got {E}")
        if not 1 <= n_group <= MAX_GROUPS or E % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"the router kernel takes 1 to {MAX_GROUPS} groups dividing E and "
                             f"1 <= topk_group <= n_group; got E={E}, n_group={n_group}, "
                             f"topk_group={topk_group}")
        self.per_group = E // n_group
        self.grouped = n_group > 1 and topk_group < n_group
        if self.grouped and self.per_group < 2:
            raise ValueError("a group scores its two best experts: E / n_group must be >= 2")
        eligible = topk_group * self.per_group if self.grouped else E
        if not 1 <= k <= min(eligible, MAX_K):
            raise ValueError(f"the router kernel takes 1 to min({eligible}, {MAX_K}) slots; "
                             f"got {k}")
        self.dtype, self.E, self.k = dtype, E, k
        self.n_group, self.topk_group = n_group, topk_group
        self.renormalize, self.has_bias = renormalize, has_bias
        self.V = (E + 31) // 32

    @cute.jit
    def __call__(self, mLogits: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor,
                 mIds: cute.Tensor, scale: Float32, stream):
        # mLogits (T, E) unit stride along E; mBias (E,) fp32 (unused without a bias);
        # mWeights (T, k) fp32; mIds (T, k) int64; scale: routed_scaling_factor.
        T = mLogits.shape[0]
        self.kernel(mLogits, mBias, mWeights, mIds, scale).launch(
            grid=((T + WARPS - 1) // WARPS, 1, 1), block=(32 * WARPS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mLogits: cute.Tensor, mBias: cute.Tensor, mWeights: cute.Tensor,
               mIds: cute.Tensor, scale: Float32):
        E, K, V, per = self.E, self.k, self.V, self.per_group
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * WARPS + warp
        if t < mLogits.shape[0]:
            score = cute.make_rmem_tensor((V,), Float32)  # s
            choice = cute.make_rmem_tensor((V,), Float32)  # s + bias; NaN ranks first
            for i in cutlass.range_constexpr(V):
                s = Float32(0.0)
                c = Float32(-float("inf"))
                if lane + 32 * i < E:
                    x = Float32(mLogits[t, lane + 32 * i])
                    s = Float32(1.0) / (Float32(1.0) + _exp(-x))
                    c = s
                    if cutlass.const_expr(self.has_bias):
                        c = s + mBias[lane + 32 * i]
                    if c != c:
                        c = Float32(float("inf"))
                score[i] = s
                choice[i] = c
            kept = Int32(-1)  # eligible groups, a bit each
            if cutlass.const_expr(self.grouped):
                group_score = []
                for g in cutlass.range_constexpr(self.n_group):
                    first_v = Float32(-float("inf"))
                    first_i = Int32(NONE)
                    for i in cutlass.range_constexpr(V):
                        e = lane + 32 * i
                        if e < E and e // per == g and (choice[i] > first_v or first_i == NONE):
                            first_v = choice[i]
                            first_i = e
                    first_v, first_i = _warp_argmax(first_v, first_i)
                    second_v = Float32(-float("inf"))
                    second_i = Int32(NONE)
                    for i in cutlass.range_constexpr(V):
                        e = lane + 32 * i
                        if e < E and e // per == g and e != first_i and (
                                choice[i] > second_v or second_i == NONE):
                            second_v = choice[i]
                            second_i = e
                    second_v, second_i = _warp_argmax(second_v, second_i)
                    group_score.append(first_v + second_v)
                kept = Int32(0)
                for _ in cutlass.range_constexpr(self.topk_group):
                    best = Float32(-float("inf"))
                    best_g = Int32(NONE)
                    for g in cutlass.range_constexpr(self.n_group):
                        free = ((kept >> g) & 1) == 0
                        if free and (group_score[g] > best or best_g == NONE):
                            best = group_score[g]
                            best_g = Int32(g)
                    kept = kept | (Int32(1) << best_g)

            taken = Int32(0)
            kept_sum = Float32(0.0)
            my_weight = Float32(0.0)
            my_id = Int32(0)
            for j in cutlass.range_constexpr(K):
                _, best_i, taken = _pick_next(choice, taken, kept, lane, E, V, per)
                mine = Float32(0.0)  # the pick's unbiased score, from the lane that holds it
                for i in cutlass.range_constexpr(V):
                    if lane + 32 * i == best_i:
                        mine = score[i]
                w = cute.arch.shuffle_sync(mine, offset=best_i % 32)
                kept_sum = kept_sum + w
                if lane == j:
                    my_weight = w
                    my_id = best_i
            _store_slots(mWeights, mIds, t, lane, my_weight, my_id, kept_sum, scale, K,
                         self.renormalize, 1e-20)

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


@dataclass(frozen=True)
class GroupTopkCompileKey:
    """One compiled sigmoid router: the logits' dtype, E, k, the groups, the options."""

    dtype: str
    E: int
    k: int
    n_group: int
    topk_group: int
    renormalize: bool
    has_bias: bool

    def name(self) -> str:
        return (f"router_sigmoid_group_topk_{self.dtype}_e{self.E}_k{self.k}"
                f"_g{self.n_group}x{self.topk_group}" + ("_renorm" if self.renormalize else "")
                + ("_bias" if self.has_bias else ""))


def compile_group_topk(key: GroupTopkCompileKey, keep_dir: str | None = None):
    """cute.compile the sigmoid router for (T, E) logits with unit stride along E."""
    dt = DTYPES[key.dtype]
    t = cute.sym_int()
    logits = cute.runtime.make_fake_tensor(dt, (t, key.E), stride=(cute.sym_int64(), 1))
    bias = cute.runtime.make_fake_compact_tensor(Float32, (cute.sym_int(),))
    weights = cute.runtime.make_fake_tensor(Float32, (t, key.k), stride=(cute.sym_int64(), 1))
    ids = cute.runtime.make_fake_tensor(cutlass.Int64, (t, key.k), stride=(cute.sym_int64(), 1))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    from .compile import compile_options

    kernel = SigmoidGroupTopkSm90(dt, key.E, key.k, key.n_group, key.topk_group,
                                  key.renormalize, key.has_bias)
    return cute.compile(kernel, logits, bias, weights, ids, Float32(1.0), stream,
                        options=compile_options(keep_dir))


__all__ = ["MAX_E", "MAX_GROUPS", "MAX_K", "GroupTopkCompileKey", "RouterTopkCompileKey",
           "SigmoidGroupTopkSm90", "SoftmaxTopkSm90", "compile_group_topk",
           "compile_router_topk"]
