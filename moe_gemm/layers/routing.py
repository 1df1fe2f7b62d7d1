"""Routers and the token -> expert permutation, all on the device and free of host syncs.

Why this module exists: an MoE layer decides on the GPU which experts each token visits, and
everything after that decision (sorting rows by expert, the int32 offsets `grouped_mm` reads,
the way back to token order) must stay on the GPU too. A single `.item()`, `.tolist()`,
`nonzero()` or `bincount()` (which reads its input's max) would stall the CPU on every layer
and make the forward impossible to capture in a CUDA graph. Every function here therefore
works on tensors whose shapes are known on the host: T tokens with k slots each always give
S = T * k routed rows, whatever the routing.

Routers (pure functions, matching transformers 5 exactly, but for the weights' dtype: always
float32 here, where Qwen2/Qwen3-MoE and OLMoE round them to a bf16 / fp16 model's dtype, a
difference within that rounding; and, on a GPU, DeepSeek's fp32 logits summed by the tensor
cores: `router_logits_fp32`):
- `softmax_topk`: Mixtral (always renormalised) and Qwen2/Qwen3-MoE (renormalised iff
  `norm_topk_prob`): softmax in float32, top-k, then divide by the top-k sum (on a
  Hopper GPU one kernel, ops/router_topk.py; MOE_GEMM_ROUTER=torch keeps the torch ops).
- `softmax_grouped_topk`: Mistral 4 / Mistral Large 4: DeepSeek-V3's group-limited choice
  (below) over float32 softmax scores, weights renormalised (+1e-20) and scaled by
  `routed_scaling_factor` (torch ops; without groups it is `softmax_topk`).
- `sigmoid_grouped_topk`: DeepSeek-V3 / GLM-4-MoE: float32 sigmoid scores; a correction bias
  added for the *selection* only; group-limited choice (group score = sum of its two best
  biased scores, keep `topk_group` groups); weights gathered from the unbiased scores,
  renormalised with +1e-20, times `routed_scaling_factor` (on a Hopper GPU one kernel,
  ops/router_topk.py).
- `sqrtsoftplus_grouped_topk`: DeepSeek-V4: the same selection and weights over float32
  sqrt(softplus(logits)) scores (torch ops).
- `hash_topk`: DeepSeek-V4's hash-routed layers: the experts of each token come from a fixed
  token id -> expert ids table; the weights are the chosen experts' scores (any scoring),
  renormalised with +1e-20, times `routed_scaling_factor` (torch ops).

Router jitter (`router_jitter`): Mixtral's training-time noise on the router's input
(transformers' MixtralSparseMoeBlock with config.router_jitter_noise > 0), which the MoE layer
applies in training mode.

Permutation (`permute_by_expert`): a stable sort of the S (token, slot) pairs by expert id,
the token of every sorted row, the sorted row of every slot (the inverse, for the combine) and
int32 cumulative offsets from `searchsorted` on the sorted ids (sync-free and deterministic,
unlike `bincount` on CUDA). Expert ids outside [0, E) are expert-parallel sentinels: they sort
to the tail, past offs[-1], so the grouped GEMMs never compute them, and `valid` marks them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_gemm.ops import router_topk
from moe_gemm.ops.validation import check_dense, shape_text

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# Router weights: the layer's float dtypes, and fp64 (the logits are upcast to fp32 anyway).
ROUTER_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# torch.mm(..., out_dtype=) (aten::mm.dtype): 16-bit operands, fp32 output, on CUDA.
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()

__all__ = [
    "ExpertPermutation",
    "check_correction_bias",
    "check_flag",
    "check_jitter_noise",
    "check_router_weight",
    "check_scaling_factor",
    "check_token_expert_table",
    "check_token_ids",
    "hash_topk",
    "permute_by_expert",
    "route_tokens",
    "router_jitter",
    "router_logits_fp32",
    "sigmoid_grouped_topk",
    "softmax_grouped_topk",
    "softmax_topk",
    "sqrtsoftplus_grouped_topk",
]

# The router's score functions. The biased ones take a selection-only correction bias
# (DeepSeek-V3's e_score_correction_bias) and route as DeepSeek-V3 (sigmoid) or DeepSeek-V4
# (sqrt(softplus)); softmax routes as Mixtral / Qwen / Mistral 4.
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
BIASED_SCORINGS = ("sigmoid", "sqrtsoftplus")


def _check_logits(logits: object) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor (T, E); got {type(logits).__name__}")
    check_dense("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (T, E); got shape {shape_text(logits)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be a floating-point tensor (T, E); got {logits.dtype}")
    return logits


def check_int(name: str, value: object) -> int:
    """An int argument as a Python int: numpy's integer scalars pass (numbers.Integral, as a
    config read from numpy gives them); a bool, a float or anything else is a TypeError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {value!r}")
    return int(value)


def _check_k(k: object, E: int) -> int:
    k = check_int("k (experts per token)", k)
    if not 1 <= k <= E:
        raise ValueError(f"k (experts per token) must be in [1, E={E}]; got {k}")
    return k


# The checks below are shared by the routers, the functional MoE and the MoE layer and its
# loaders (layers/moe.py, layers/checkpoints.py), so that every entry point refuses the same
# values with the same message, on the host and before any tensor work.


def check_flag(name: str, value: object, *, none_ok: bool = False) -> bool | None:
    """A bool option (0 / 1 pass too); None where `none_ok`. A string such as "no" or any
    other object would be silently truthy, so it is a TypeError."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be a bool{' or None' if none_ok else ''}; got {value!r}")


def check_scaling_factor(value: object) -> float:
    """routed_scaling_factor: a finite real number (a NaN or inf would turn every routing
    weight into NaN / inf without any error at the forward)."""
    if isinstance(value, torch.SymFloat) or torch.compiler.is_compiling():
        # torch.compile(dynamic=True) traces a float as a symbol, whose value is known only
        # at run time; comparisons keep it one (a guard, not a specialisation). A factor set
        # to NaN or inf after the layer was made is refused here too (it made every output
        # NaN where eager refused it).
        if value != value or value == math.inf or value == -math.inf:
            raise ValueError(f"routed_scaling_factor must be finite; got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a float; got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"routed_scaling_factor must be finite; got {value!r}")
    return float(value)


def check_jitter_noise(value: object) -> float:
    """router_jitter_noise: a finite real number >= 0 (0 = off). A negative one would make
    uniform_'s range empty (torch's RuntimeError at the first training-mode forward), a NaN
    or inf turn the tokens into NaN / inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"router_jitter_noise must be a float >= 0; got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"router_jitter_noise must be a finite float >= 0; got {value!r}")
    return float(value)


def router_jitter(x: torch.Tensor, noise: float) -> torch.Tensor:
    """Mixtral's router jitter: x times uniform noise in [1 - noise, 1 + noise], elementwise.

    transformers' MixtralSparseMoeBlock (config.router_jitter_noise > 0, training mode) draws
    `torch.empty_like(hidden_states).uniform_(1 - noise, 1 + noise)` from torch's default
    generator, in the input's dtype and shape, and multiplies the block's input by it before
    anything else: the jittered tokens feed the router and the experts alike. The same draw
    here, so a seeded generator gives the same noise; the product is out of place
    (transformers' `*=` also rewrites the caller's tensor).

    Args:
        x: [..., H] the layer's input, as the caller passed it.
        noise: the jitter, > 0.

    Returns:
        x * noise in x's shape and dtype.
    """
    return x * torch.empty_like(x).uniform_(1.0 - noise, 1.0 + noise)


def check_router_weight(w: object, E: int, H: int) -> torch.Tensor:
    """router_weight: a float (E, H) tensor (an integer, bool or complex one would only fail
    inside F.linear at the first forward)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"router_weight must be a torch.Tensor (E, H); got {type(w).__name__}")
    check_dense("router_weight", w)
    if w.dtype not in ROUTER_DTYPES:
        raise TypeError(f"router_weight must be a floating-point tensor (bf16, fp16, fp32 or "
                        f"fp64); got {w.dtype}")
    if tuple(w.shape) != (E, H):
        raise ValueError(f"router_weight must be (E, H) = ({E}, {H}); got {shape_text(w)}")
    return w


def check_correction_bias(bias: object, E: int, device: torch.device, name: str = "bias",
                          other: str = "logits are") -> torch.Tensor:
    """The selection-only correction bias: a float (E,) tensor on `device` (`other` names
    what lives there, for the message)."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (E,) or None; got {type(bias).__name__}")
    check_dense(name, bias)
    if tuple(bias.shape) != (E,):
        raise ValueError(f"{name} must be (E,) = ({E},); got shape {shape_text(bias)}")
    if bias.device != device:
        raise ValueError(f"{name} is on {bias.device} but {other} on {device}")
    if not bias.is_floating_point():
        raise TypeError(f"{name} must be a float tensor; got {bias.dtype}")
    return bias


def softmax_topk(
    logits: torch.Tensor, k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router (Mixtral, Qwen2-MoE, Qwen3-MoE).

    probs = softmax(logits) in float32; the k largest per token; if `renormalize`, divided by
    their sum (transformers' `norm_topk_prob`; Mixtral always renormalises).

    Args:
        logits: [T, E] router logits, any float dtype (upcast to float32 before the softmax).
        k: experts per token, 1 <= k <= E.
        renormalize: divide the k weights by their sum.

    Returns:
        (weights, ids): weights [T, k] float32, ids [T, k] int64, best expert first.

    Raises:
        TypeError: logits not a float tensor, k not an int, renormalize not a bool.
        ValueError: logits not 2-D, k out of range.
    """
    logits = _check_logits(logits)
    k = _check_k(k, logits.shape[1])
    renormalize = check_flag("renormalize", renormalize)
    fused = router_topk.softmax_topk(logits, k, renormalize)  # (None: torch ops below)
    if fused is not None:
        return fused
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _check_groups(E: int, k: int, n_group: object, topk_group: object) -> tuple[int, int, bool]:
    """(n_group, topk_group, grouped) of group-limited routing over E experts choosing k:
    `grouped` is False where every expert stays eligible (one group, or every group kept)."""
    n_group, topk_group = check_int("n_group", n_group), check_int("topk_group", topk_group)
    if n_group < 1 or E % n_group:
        raise ValueError(f"n_group must be >= 1 and divide E={E}; got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}]; got {topk_group}")
    per_group = E // n_group
    grouped = n_group > 1 and topk_group < n_group
    if grouped and per_group < 2:
        raise ValueError(
            f"group-limited routing scores a group by its two best experts, so E / n_group must "
            f"be >= 2; got E={E}, n_group={n_group}"
        )
    if k > topk_group * per_group:
        raise ValueError(
            f"k={k} experts cannot be chosen from topk_group={topk_group} groups of "
            f"{per_group} experts"
        )
    return n_group, topk_group, grouped


def _group_router_args(logits: object, k: object, n_group: object, topk_group: object,
                       routed_scaling_factor: object, renormalize: object) -> tuple:
    """The group-limited routers' arguments checked: (logits, k, n_group, topk_group,
    grouped, routed_scaling_factor, renormalize)."""
    logits = _check_logits(logits)
    k = _check_k(k, logits.shape[1])
    n_group, topk_group, grouped = _check_groups(logits.shape[1], k, n_group, topk_group)
    return (logits, k, n_group, topk_group, grouped, check_scaling_factor(routed_scaling_factor),
            check_flag("renormalize", renormalize))


def _grouped_choice(scores: torch.Tensor, choice: torch.Tensor, k: int, n_group: int,
                    topk_group: int, grouped: bool, routed_scaling_factor: float,
                    renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The group-limited top-k of `choice` [T, E] (transformers' order exactly: top-2 sum per
    group, keep topk_group groups, the k best of their experts), weights gathered from
    `scores`, renormalised with +1e-20, times the factor."""
    if grouped:
        # Groups not kept are masked with -inf (transformers' 0.0 would let a masked expert
        # beat an eligible one whose biased score is negative).
        T, E = choice.shape
        group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only bias and group-limited top-k (DeepSeek-V3).

    scores = sigmoid(logits) in float32. Selection uses scores + bias: experts are split into
    `n_group` equal groups, a group scores the sum of its two best biased scores, the
    `topk_group` best groups stay eligible and the k best eligible experts are chosen. The
    weights are the *unbiased* scores of the chosen experts, divided by (their sum + 1e-20)
    if `renormalize`, then multiplied by `routed_scaling_factor`.

    Args:
        logits: [T, E] router logits, any float dtype (upcast to float32).
        bias: [E] `e_score_correction_bias`, or None for no correction.
        k: experts per token, 1 <= k <= topk_group * E / n_group.
        n_group: expert groups; E must be a multiple, with >= 2 experts per group when
            n_group > 1 (the group score sums two).
        topk_group: groups kept per token, 1 <= topk_group <= n_group.
        routed_scaling_factor: multiplies the final weights; a finite float.
        renormalize: divide the weights by their sum (+1e-20) before scaling.

    Returns:
        (weights, ids): weights [T, k] float32, ids [T, k] int64 (in torch.topk's unsorted
        order, as transformers).

    Raises:
        TypeError: wrong argument types.
        ValueError: shapes, group settings or a routed_scaling_factor (NaN, inf) that do
            not fit.
    """
    return _biased_topk("sigmoid", logits, bias, k, n_group, topk_group, routed_scaling_factor,
                        renormalize)


def sqrtsoftplus_grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's router: `sigmoid_grouped_topk` with scores = sqrt(softplus(logits)) in
    float32 (transformers' DeepseekV4TopKRouter: a selection-only correction bias, top-k,
    weights renormalised with +1e-20, times `routed_scaling_factor`). Same arguments, returns
    and errors as sigmoid_grouped_topk; torch ops (the router kernel scores with sigmoid)."""
    return _biased_topk("sqrtsoftplus", logits, bias, k, n_group, topk_group,
                        routed_scaling_factor, renormalize)


def _biased_topk(scoring: str, logits: object, bias: torch.Tensor | None, k: object,
                 n_group: object, topk_group: object, routed_scaling_factor: object,
                 renormalize: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The biased routers' body (sigmoid_grouped_topk, sqrtsoftplus_grouped_topk): checked
    arguments, then the router kernel (sigmoid scores only) or the torch ops."""
    logits, k, n_group, topk_group, grouped, routed_scaling_factor, renormalize = (
        _group_router_args(logits, k, n_group, topk_group, routed_scaling_factor, renormalize))
    if bias is not None:
        check_correction_bias(bias, logits.shape[1], logits.device)
    if scoring == "sigmoid":
        fused = router_topk.sigmoid_grouped_topk(logits, bias, k, n_group, topk_group,
                                                 routed_scaling_factor, renormalize)
        if fused is not None:  # (None: torch ops below)
            return fused
    scores = _scores(logits, scoring)
    choice = scores if bias is None else scores + bias
    return _grouped_choice(scores, choice, k, n_group, topk_group, grouped,
                           routed_scaling_factor, renormalize)


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The router's float32 scores [T, E] of logits under a scoring (check_scoring's)."""
    x = logits.float()
    if scoring == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring == "sigmoid":
        return x.sigmoid()
    return F.softplus(x).sqrt()


def check_token_expert_table(table: object, num_experts: int, top_k: int | None = None,
                             name: str = "tid2eid", *, values: bool = True) -> torch.Tensor:
    """A hash router's token id -> expert ids table: an integer tensor [V, k] whose entries
    are expert ids in [0, num_experts). values=False skips reading the entries (a GPU table
    per call: that read would synchronize; layers check a table where it is set)."""
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor [vocab, top_k]; got "
                        f"{type(table).__name__}")
    if table.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must hold integer expert ids; got {table.dtype}")
    if table.dim() != 2 or table.shape[0] < 1 or table.shape[1] < 1:
        raise ValueError(f"{name} must be 2-D [vocab, top_k] with vocab, top_k >= 1; got "
                         f"{shape_text(table)}")
    if top_k is not None and table.shape[1] != top_k:
        raise ValueError(f"{name} must have top_k={top_k} columns (one expert per slot); got "
                         f"{shape_text(table)}")
    if values and table.device.type != "meta":
        lo, hi = int(table.min()), int(table.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{name} holds expert ids in [{lo}, {hi}]; they must be in "
                             f"[0, num_experts={num_experts})")
    return table


def check_token_ids(token_ids: object, tokens: int, device: torch.device) -> torch.Tensor:
    """A hash-routed call's token ids: an integer tensor of `tokens` elements (any shape,
    flattened as the hidden states are) on the layer's device."""
    if token_ids is None:
        raise ValueError("this layer routes by token id (a hash router: tid2eid is set): pass "
                         "input_ids, the token ids of the hidden states")
    if not isinstance(token_ids, torch.Tensor):
        raise TypeError(f"input_ids must be an integer torch.Tensor; got "
                        f"{type(token_ids).__name__}")
    if token_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"input_ids must be an integer tensor; got {token_ids.dtype}")
    if token_ids.numel() != tokens:
        raise ValueError(f"input_ids must hold one id per token ({tokens}); got "
                         f"{shape_text(token_ids)}")
    if token_ids.device != device:
        raise ValueError(f"input_ids is on {token_ids.device} but the layer is on {device}")
    return token_ids.reshape(-1)


def hash_topk(
    logits: torch.Tensor,
    table: torch.Tensor,
    token_ids: torch.Tensor,
    scoring: str = "sqrtsoftplus",
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing (DeepSeek-V4's first layers, transformers' DeepseekV4HashRouter): token t
    goes to the experts table[token_ids[t]]; their weights are the token's float32 scores
    (`scoring` of its logits) at those experts, divided by (their sum + 1e-20) if
    `renormalize`, times `routed_scaling_factor`.

    Args:
        logits: [T, E] router logits (any float dtype; upcast to float32).
        table: [V, k] integer expert ids in [0, E).
        token_ids: T integer token ids (any shape). On the CPU an id outside [0, V), or a
            table entry outside [0, E), is a ValueError; on a GPU neither is read on the host
            (the call never synchronizes), nor under torch.compile: both are clamped into
            range, so a bad value picks a wrong expert but never reads out of bounds.
        scoring: "sqrtsoftplus" (DeepSeek-V4), "sigmoid" or "softmax".
        routed_scaling_factor: multiplies the final weights; finite.
        renormalize: divide the weights by their sum (+1e-20) before scaling.

    Returns:
        (weights [T, k] float32, ids [T, k] int64).

    Raises:
        TypeError, ValueError: arguments that do not fit.
    """
    logits = _check_logits(logits)
    T, E = logits.shape
    check_scoring(scoring)
    # The values are read on the CPU alone, eagerly (a traced graph cannot branch on them):
    # elsewhere they are clamped into range instead.
    on_cpu = logits.device.type == "cpu" and not torch.compiler.is_compiling()
    table = check_token_expert_table(table, E, values=on_cpu)
    if table.device != logits.device:
        raise ValueError(f"table is on {table.device} but the logits are on {logits.device}")
    token_ids = check_token_ids(token_ids, T, logits.device)
    routed_scaling_factor = check_scaling_factor(routed_scaling_factor)
    renormalize = check_flag("renormalize", renormalize)
    V = table.shape[0]
    if on_cpu:
        if T and (int(token_ids.min()) < 0 or int(token_ids.max()) >= V):
            raise ValueError(f"input_ids must be token ids in [0, {V}) (the table's rows); got "
                             f"values in [{int(token_ids.min())}, {int(token_ids.max())}]")
        ids = table[token_ids.long()].long()
    else:
        ids = table[token_ids.long().clamp(0, V - 1)].long().clamp(0, E - 1)
    weights = _scores(logits, scoring).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def softmax_grouped_topk(
    logits: torch.Tensor,
    k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router with group-limited top-k and a routed scaling factor (Mistral 4,
    Mistral Large 4: DeepSeek-V3's selection over softmax scores, without a bias).

    scores = softmax(logits) in float32; experts are split into `n_group` equal groups, a
    group scores the sum of its two best scores, the `topk_group` best groups stay eligible
    and the k best eligible experts are chosen; their scores are divided by (their sum +
    1e-20) if `renormalize`, then multiplied by `routed_scaling_factor`. With one group (or
    every group kept) this is `softmax_topk` times the factor.

    Args:
        logits: [T, E] router logits, any float dtype (upcast to float32 before the softmax).
        k: experts per token, 1 <= k <= topk_group * E / n_group.
        n_group: expert groups; E must be a multiple, with >= 2 experts per group when
            n_group > 1 (the group score sums two).
        topk_group: groups kept per token, 1 <= topk_group <= n_group.
        routed_scaling_factor: multiplies the final weights; a finite float.
        renormalize: divide the weights by their sum (+1e-20) before scaling.

    Returns:
        (weights, ids): weights [T, k] float32, ids [T, k] int64 (best expert first with one
        group; in torch.topk's unsorted order, as transformers, with several).

    Raises:
        TypeError: wrong argument types.
        ValueError: shapes, group settings or a routed_scaling_factor (NaN, inf) that do
            not fit.
    """
    logits, k, n_group, topk_group, grouped, routed_scaling_factor, renormalize = (
        _group_router_args(logits, k, n_group, topk_group, routed_scaling_factor, renormalize))
    if not grouped:
        # (the top-k sum of a softmax is at least 1 / E: the +1e-20 is below fp32's rounding)
        weights, ids = softmax_topk(logits, k, renormalize)
        return weights * routed_scaling_factor, ids
    # Group-limited: torch ops (the router kernel scores with sigmoid only).
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    return _grouped_choice(scores, scores, k, n_group, topk_group, grouped,
                           routed_scaling_factor, renormalize)


def _sort_key_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype holding 0..num_experts: the radix sort makes one pass per
    8 key bits, so uint8 keys take one pass where int64 keys took eight."""
    if num_experts <= 255:
        return torch.uint8
    return torch.int16 if num_experts <= 32767 else torch.int32


@dataclass(frozen=True)
class ExpertPermutation:
    """Where each routed (token, slot) pair goes when rows are grouped by expert.

    S = T * k rows; row r of the expert-sorted order holds slot `slot_order[r]` (flat index
    t * k + j), i.e. token `token_index[r]`. Rows of expert e are offs[e-1]:offs[e]; rows past
    offs[-1] belong to dropped slots (ids outside [0, E)).

    Attributes:
        token_index: [S] int64, the token of each sorted row (gather x with it).
        slot_order: [S] int64, the flat slot of each sorted row.
        row_of_slot: [T, k] int64, the sorted row of each slot (the inverse, for the combine).
        sorted_expert: [S] the expert of each sorted row (E for dropped slots), in the
            narrowest integer dtype that holds E (uint8, int16 or int32: the sort's key).
        offs: [E] int32 cumulative end rows, offs[-1] = number of valid slots.
        valid: [T, k] bool, False for dropped slots.
        all_valid: True when the caller vouched that every id is in [0, E) (no slot is
            dropped: `valid` is all True and a consumer may skip masking with it).
    """

    token_index: torch.Tensor  # (S,)
    slot_order: torch.Tensor  # (S,)
    row_of_slot: torch.Tensor  # (T, k)
    sorted_expert: torch.Tensor  # (S,)
    offs: torch.Tensor  # (E,)
    valid: torch.Tensor  # (T, k)
    all_valid: bool = False

    @property
    def num_experts(self) -> int:
        return self.offs.shape[0]

    def counts(self) -> torch.Tensor:
        """[E] int32 rows per expert (on the device; no sync)."""
        return torch.diff(self.offs, prepend=self.offs.new_zeros(1))

    def drop_masked(self, weights: torch.Tensor) -> torch.Tensor:
        """[T, k] routing weights with the dropped slots' set to 0 (`weights` itself when no
        slot is dropped: all_valid)."""
        return weights if self.all_valid else torch.where(self.valid, weights, 0)


def permute_by_expert(topk_ids: torch.Tensor, num_experts: int, *,
                      ids_in_range: bool = False) -> ExpertPermutation:
    """Group the T * k routed slots by expert, on the device, without a host sync.

    A stable sort keeps rows of one expert in (token, slot) order, so the result is
    deterministic. Ids outside [0, num_experts) (expert-parallel sentinels, -1 padding) are
    moved past every valid row and excluded from offs.

    Args:
        topk_ids: [T, k] integer expert ids (int32 or int64).
        num_experts: E >= 1.
        ids_in_range: the caller guarantees every id is in [0, num_experts) (a router's own
            top-k): the mask of dropped slots is not computed (four small kernels fewer, a few
            microseconds of a layer's time at decode sizes). Pass it only for ids that cannot
            be out of range: one that is then gives wrong results.

    Returns:
        An ExpertPermutation on topk_ids' device.

    Raises:
        TypeError: topk_ids not a dense integer tensor, ids_in_range not a bool.
        ValueError: topk_ids not 2-D, num_experts < 1.
    """
    # (a string such as "no" would be truthy: every slot, out-of-range ones included, marked
    # valid, the wrong results the flag warns of)
    ids_in_range = check_flag("ids_in_range", ids_in_range)
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor (T, k); got {type(topk_ids).__name__}")
    # (a sparse or nested topk_ids failed inside torch's reshape with a RuntimeError)
    check_dense("topk_ids", topk_ids)
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D (T, k); got shape {shape_text(topk_ids)}")
    if topk_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"topk_ids must be an integer tensor (int32 or int64); got {topk_ids.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, numbers.Integral):
        raise TypeError(f"num_experts must be an int >= 1; got {type(num_experts).__name__} "
                        f"{num_experts!r}")
    num_experts = int(num_experts)
    if num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1; got {num_experts!r}")
    T, k = topk_ids.shape
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    if ids_in_range:
        valid = torch.ones(ids.shape, dtype=torch.bool, device=device)
        key = ids.to(_sort_key_dtype(num_experts))
    else:
        ids = ids.long()
        valid = (ids >= 0) & (ids < num_experts)
        key = torch.where(valid, ids, num_experts).to(_sort_key_dtype(num_experts))
    sorted_expert, slot_order = torch.sort(key, stable=True)
    S = ids.shape[0]
    token_index = torch.div(slot_order, k, rounding_mode="floor") if k > 1 else slot_order
    row_of_slot = torch.empty_like(slot_order).scatter_(
        0, slot_order, torch.arange(S, device=device, dtype=slot_order.dtype)
    )
    # offs[e] = number of sorted ids <= e: cumulative ends straight from the sorted keys, with
    # no atomics (deterministic) and no read of the data on the host.
    experts = torch.arange(num_experts, device=device, dtype=sorted_expert.dtype)
    offs = torch.searchsorted(sorted_expert, experts, right=True, out_int32=True)
    return ExpertPermutation(
        token_index=token_index,
        slot_order=slot_order,
        row_of_slot=row_of_slot.view(T, k),
        sorted_expert=sorted_expert,
        offs=offs,
        valid=valid.view(T, k),
        all_valid=ids_in_range,
    )


def router_logits_fp32(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ router_weight [E, H]^T in float32, as DeepSeek-V3's router computes it
    (transformers: F.linear(x.float(), weight.float())).

    For 16-bit x and weight of one dtype on a GPU, one GEMM on the 16-bit operands with fp32
    accumulation and fp32 output (torch.mm's out_dtype): every product of two bf16 (8-bit
    significands) or fp16 (11-bit) values is exact in fp32's 24 bits, so this sums the same
    products as the fp32 GEMM, without the two widening copies (x alone at 16384 tokens x 7168
    is 470 MB written in fp32 and read back) and on the tensor cores instead of the fp32 FMA
    units: 9-19x faster from 4096 tokens on an H200. The tensor cores' fp32 sums truncate
    (max error ~8e-5 against the fp32 GEMM's 1e-5 on unit-scale logits; the same top-8 for all
    but 2 of 16384 tokens, docs/measurements.md 2026-12-03): the difference of two fp32 GEMM
    algorithms. Elsewhere (CPU, mixed or 32-bit dtypes, or a graph that records gradients:
    torch.mm's out_dtype form has no derivative) the fp32 GEMM itself.

    Outside autocast: inside torch.autocast the fp32 GEMM would run in the autocast dtype
    (logits rounded to bf16, other experts chosen at near ties), where the routers that ask
    for fp32 logits (MiniCPM5's disables autocast for them) keep fp32."""
    grads = torch.is_grad_enabled() and (x.requires_grad or router_weight.requires_grad)
    with torch.autocast(x.device.type, enabled=False):
        if (_MM_OUT_DTYPE and x.is_cuda and x.dtype == router_weight.dtype and not grads
                and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2):
            return torch.mm(x, router_weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), router_weight.float())


def check_scoring(value: object) -> str:
    """scoring: "softmax", "sigmoid" or "sqrtsoftplus" (a layer's reassigned value reached the
    router, which routed anything but "softmax" as sigmoid)."""
    if not isinstance(value, str) or value not in SCORINGS:
        raise ValueError(f"scoring must be 'softmax', 'sigmoid' or 'sqrtsoftplus'; got "
                         f"{value!r}")
    return value


def check_softmax_options(correction_bias: torch.Tensor | None = None) -> None:
    """A correction bias is the biased routers' alone (a layer built for sigmoid routing
    keeps its e_score_correction_bias buffer when its scoring is reassigned: ignoring it
    under softmax would route without the bias the layer was given)."""
    if correction_bias is not None:
        raise ValueError(
            "a correction bias (e_score_correction_bias) is used by scoring='sigmoid' or "
            "'sqrtsoftplus' only; "
            "got one with softmax (set the layer's e_score_correction_bias to None to route "
            "without it)")


def route_tokens(
    x: torch.Tensor,  # (T, H)
    router_weight: torch.Tensor,  # (E, H)
    top_k: int,
    scoring: str,
    renormalize: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None,
    router_fp32: bool,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64) of tokens x [T, H] under the router
    weight [E, H]: the logits (in float32 with router_fp32, else in the weight's dtype), then
    softmax_topk, softmax_grouped_topk, sigmoid_grouped_topk or sqrtsoftplus_grouped_topk;
    with a hash_table, hash_topk of token_ids (the groups and the bias do not apply)."""
    check_scoring(scoring)
    if hash_table is not None:
        # (checked before the logits: a missing input_ids fails before any work)
        token_ids = check_token_ids(token_ids, x.shape[0], x.device)
        if hash_table.dim() != 2 or hash_table.shape[1] != top_k:
            raise ValueError(f"tid2eid must be [vocab, top_k={top_k}] (one expert per slot); "
                             f"got {shape_text(hash_table)}")
    if router_fp32:
        logits = router_logits_fp32(x, router_weight)  # DeepSeek-V3 / GLM-4-MoE
    else:
        logits = F.linear(x.to(router_weight.dtype), router_weight)  # Mixtral / Qwen
    if hash_table is not None:
        return hash_topk(logits, hash_table, token_ids, scoring, routed_scaling_factor,
                         renormalize)  # DeepSeek-V4's hash layers
    if scoring == "sqrtsoftplus":  # DeepSeek-V4
        return sqrtsoftplus_grouped_topk(logits, correction_bias, top_k, n_group, topk_group,
                                         routed_scaling_factor, renormalize)
    if scoring == "softmax":
        check_softmax_options(correction_bias)
        if n_group == 1 and topk_group == 1 and routed_scaling_factor == 1.0:
            return softmax_topk(logits, top_k, renormalize)  # Mixtral, Qwen: one kernel
        return softmax_grouped_topk(logits, top_k, n_group, topk_group, routed_scaling_factor,
                                    renormalize)  # Mistral 4
    return sigmoid_grouped_topk(
        logits, correction_bias, top_k, n_group, topk_group, routed_scaling_factor, renormalize
    )
