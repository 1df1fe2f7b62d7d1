"""The routed experts as functions: activation, the expert FFN for a given routing, checks.

On a Hopper GPU the experts of a named activation (or a ClampedSiLU, a ClampedSwiGLU) run on
the fused kernel by default (layers/fused_experts.py: the gather, gated activation and routing
weights inside the two GEMMs). The unfused path below is the reference, the torch backend's path and the one for
callable activations and post-expert norms:

    perm = permute_by_expert(ids)                    stable sort on the device, int32 offs
    h = grouped_mm(x[perm.token_index], w_gate_up)   (S, 2I), S = T * k, one launch
    a = act(h[:, :I]) * h[:, I:]                     (S, I), SwiGLU by default
    y = grouped_mm(a, w_down)                        (S, H), one launch
    out[t] = sum_j weights[t, j] * y[row of (t, j)]  (T, H), fp32 accumulation

Why the pieces are chosen as they are:
- Every shape is fixed by T and k (S = T * k routed rows, whatever the routing), so on CUDA the
  forward never waits for the host and can be captured in a CUDA graph, as long as the
  grouped GEMMs run on the cute backend or torch's native bf16 grouped_mm (the torch backend's
  fp32/fp16 loop reads offs on the host). For the same reason there is no data-dependent
  Python control flow: torch.compile(fullgraph=True) traces it whole.
- Weights live in the layout transformers and vLLM store: gate_up_proj (E, 2I, H) and
  down_proj (E, H, I). The GEMMs take their transposed views (E, H, 2I) and (E, I, H), with no
  copy; that K-major B operand is also the one WGMMA reads natively.
- The gather is one pass too (ops/token_gather.gather_rows: a kernel on Hopper, index_select
  elsewhere).
- The combine is one pass (ops/combine.combine_rows: a kernel on Hopper, embedding_bag
  elsewhere): a gather by the inverse permutation fused with the weighted sum over the k
  slots, accumulated in fp32 and rounded once, deterministic (no atomics) and reading the
  (S, H) expert output only once.

Inference only: there is no backward. Calling with gradients enabled on inputs or weights
works, but `.backward()` through the result raises a RuntimeError.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_gemm.config import GemmConfig
from moe_gemm.layers.fused_experts import FusedGate, fused_expert_ffn, fused_gate_for, use_fused
from moe_gemm.layers.gate_activations import apply_gate
from moe_gemm.layers.routing import check_flag, permute_by_expert
from moe_gemm.ops.api import grouped_mm
from moe_gemm.ops.autograd import inference_only_composite, needs_link
from moe_gemm.ops.combine import combine_rows
from moe_gemm.ops.custom_ops import mark_inference_only
from moe_gemm.ops.token_gather import gather_rows
from moe_gemm.ops.validation import check_dense, shape_text

__all__ = ["ACTIVATIONS", "FLOAT_DTYPES", "INFERENCE_ONLY_MESSAGE", "Activation",
           "canonical_activation", "check_gemm_options", "check_tokens", "expert_ffn", "gated",
           "moe_experts",
           "resolve_activation"]

Activation = str | Callable[[torch.Tensor], torch.Tensor]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU: silu(gate) * up
    "gelu": F.gelu,  # GEGLU with the exact (erf) GELU
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),  # GEGLU, tanh approximation
}
_ACTIVATION_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

INFERENCE_ONLY_MESSAGE = (
    "moe_gemm's MoE layer is inference-only: it has no backward. Run it under "
    "torch.no_grad() / torch.inference_mode(), or use transformers' 'grouped_mm' experts "
    "implementation for training."
)


# ---------------------------------------------------------------------------------------------
# Activations


def resolve_activation(activation: Activation) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise function for a name ("silu", "gelu", "gelu_tanh") or a callable."""
    if isinstance(activation, str):
        name = _ACTIVATION_ALIASES.get(activation, activation)
        if name not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(map(repr, ACTIVATIONS))} or a callable; "
                f"got {activation!r}"
            )
        return ACTIVATIONS[name]
    if callable(activation):
        return activation
    raise TypeError(f"activation must be a str or a callable; got {type(activation).__name__}")


def canonical_activation(activation: Activation) -> Activation:
    """A name with its aliases resolved ("swish" -> "silu"); callables unchanged."""
    if isinstance(activation, str):
        return _ACTIVATION_ALIASES.get(activation, activation)
    return activation


def gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """(S, 2I) [gate | up] -> (S, I) act(gate) * up, transformers' concatenated layout
    (act(gate, up) for a gate of both halves: layers/gate_activations.py)."""

    def gate_fn(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return apply_gate(act, gate, up)

    return gate_fn


# ---------------------------------------------------------------------------------------------
# The routed experts, given a routing


def expert_ffn(
    x: torch.Tensor,  # (T, H)
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k)
    w_gate_up: torch.Tensor,  # (E, H, N1)
    w_down: torch.Tensor,  # (E, I, H)
    gate_fn: Callable[[torch.Tensor], torch.Tensor],  # (S, N1) -> (S, I)
    *,
    bias_gate_up: torch.Tensor | None = None,  # (E, N1)
    bias_down: torch.Tensor | None = None,  # (E, H)
    post_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,  # (S, H) -> (S, H)
    config: GemmConfig | None = None,
    fused_gate: FusedGate | None = None,
    fused: bool | None = None,
    ids_in_range: bool = False,
) -> torch.Tensor:
    """The routed experts for checked arguments: sort, two grouped GEMMs, combine.

    What moe_experts, the MoE layer and the transformers integration run once their own
    checks are done. With `fused_gate` (what gate_fn computes, as the fused kernel does it)
    they run on the fused kernel where layers/fused_experts.use_fused says so (`fused`: None
    = where the Hopper kernel runs, True = always, False = never), else on the grouped GEMMs
    below. Inference only: when autograd could ask for a gradient (grad mode on and an input
    or weight requires grad) the result is linked so that a backward raises (under
    torch.compile through a registered op, custom_ops.mark_inference_only). ids_in_range:
    every id is known to be in [0, E) (the layer's own router): routing.permute_by_expert
    skips the mask of dropped slots.

    Returns:
        (T, H) in the GEMMs' dtype.
    """
    if use_fused(fused, fused_gate, x, w_gate_up, w_down, config, post_fn):
        run = functools.partial(fused_expert_ffn, x, topk_ids, topk_weights, w_gate_up, w_down,
                                fused_gate, bias_gate_up=bias_gate_up, bias_down=bias_down,
                                config=config, ids_in_range=ids_in_range)
    else:
        run = functools.partial(_expert_ffn, x, topk_ids, topk_weights, w_gate_up, w_down,
                                gate_fn, bias_gate_up=bias_gate_up, bias_down=bias_down,
                                post_fn=post_fn, config=config, ids_in_range=ids_in_range)
    linked = (x, topk_weights, w_gate_up, w_down, bias_gate_up, bias_down)
    if torch.compiler.is_compiling():
        # Traced: the grouped GEMMs' registered ops are differentiable where torch's path runs
        # them (the CPU), so the layer's result carries its own raising backward.
        y = run()
        return mark_inference_only(y, INFERENCE_ONLY_MESSAGE) if needs_link(linked) else y
    return inference_only_composite(INFERENCE_ONLY_MESSAGE, run, linked)


def _expert_ffn(x, topk_ids, topk_weights, w_gate_up, w_down, gate_fn, *, bias_gate_up,
                bias_down, post_fn, config, ids_in_range=False) -> torch.Tensor:
    E = w_gate_up.shape[0]
    perm = permute_by_expert(topk_ids, E, ids_in_range=ids_in_range)
    xs = gather_rows(x, perm.token_index)  # (S, H), rows grouped by expert
    h = grouped_mm(xs, w_gate_up, perm.offs, config=config)  # (S, N1)
    if bias_gate_up is not None or bias_down is not None:
        # dropped slots sort last with expert id E: clamp so the bias gather stays in bounds
        # (their rows are past offs[-1] and carry weight 0 below).
        expert = perm.sorted_expert.clamp(max=E - 1).int()
    if bias_gate_up is not None:
        h = h + bias_gate_up.index_select(0, expert).to(h.dtype)
    a = gate_fn(h)  # (S, I)
    y = grouped_mm(a, w_down, perm.offs, config=config)  # (S, H)
    if bias_down is not None:
        b = bias_down.index_select(0, expert).to(y.dtype)
        if not perm.all_valid:  # (dropped slots' rows: no bias, see below)
            b = b.masked_fill((perm.sorted_expert >= E).unsqueeze(1), 0)
        y = y + b
    if post_fn is not None:
        y = post_fn(y)
    # Dropped slots (ids outside [0, E)) get weight 0. Their rows of y are finite (grouped_mm
    # leaves rows past offs[-1] zero and no bias reaches them, so a non-finite bias of expert
    # E - 1 cannot make 0 * inf = NaN; a norm keeps zeros finite), so they add nothing.
    w = perm.drop_masked(topk_weights).to(y.dtype)
    return combine_rows(y, perm.row_of_slot, w)


def check_gemm_options(config: object, fused: object) -> None:
    """The GEMM options every expert entry point takes (moe_experts, moe_forward, MoE): a
    string config would fail deep in the GEMM dispatch, and a non-bool `fused` would be
    silently truthy (the fused path forced on)."""
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a moe_gemm.GemmConfig or None; got "
                        f"{type(config).__name__}")
    check_flag("fused", fused, none_ok=True)


def check_tokens(x: object) -> torch.Tensor:
    """x must be a (T, H) float tensor (TypeError / ValueError naming the expectation)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor (T, H); got {type(x).__name__}")
    check_dense("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (T, H); got shape {shape_text(x)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be torch.bfloat16, torch.float16 or torch.float32; got {x.dtype}")
    return x


def _check_experts(
    x: object,
    topk_ids: object,
    topk_weights: object,
    w_gate_up: object,
    w_down: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    hints = (
        ("x", x, "(T, H)"),
        ("topk_ids", topk_ids, "(T, k)"),
        ("topk_weights", topk_weights, "(T, k)"),
        ("w_gate_up", w_gate_up, "(E, H, 2I)"),
        ("w_down", w_down, "(E, I, H)"),
    )
    for name, t, hint in hints:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {hint}; got {type(t).__name__}")
    assert isinstance(x, torch.Tensor) and isinstance(topk_ids, torch.Tensor)
    assert isinstance(topk_weights, torch.Tensor) and isinstance(w_gate_up, torch.Tensor)
    assert isinstance(w_down, torch.Tensor)
    for name, t, _ in hints:
        check_dense(name, t)
    check_tokens(x)
    T, H = x.shape
    if H < 1:  # (as MoE's hidden_size; the combine cannot gather zero-width rows)
        raise ValueError(f"x must be (T, H) with H >= 1; got {shape_text(x)}")
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] != H or w_gate_up.shape[2] % 2:
        raise ValueError(
            f"w_gate_up must be (E, H, 2I) = (E, {H}, 2I) (for transformers' (E, 2I, H) "
            f"gate_up_proj pass gate_up_proj.transpose(1, 2)); got {shape_text(w_gate_up)}"
        )
    E, _, two_i = w_gate_up.shape
    if E < 1:
        raise ValueError(f"w_gate_up must hold at least one expert; got {shape_text(w_gate_up)}")
    I = two_i // 2
    if w_down.dim() != 3 or tuple(w_down.shape) != (E, I, H):
        raise ValueError(
            f"w_down must be (E, I, H) = ({E}, {I}, {H}) (for transformers' (E, H, I) down_proj "
            f"pass down_proj.transpose(1, 2)); got {shape_text(w_down)}"
        )
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but x has {x.dtype}; they must match")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device} but x is on {x.device}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be (T, k) = ({T}, k >= 1); got {shape_text(topk_ids)}")
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_ids must be int64 or int32; got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights must match topk_ids {shape_text(topk_ids)}; got "
            f"{shape_text(topk_weights)}"
        )
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be a float tensor; got {topk_weights.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return x, topk_ids, topk_weights, w_gate_up, w_down


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    activation: Activation = "silu",
    config: GemmConfig | None = None,
    fused: bool | None = None,
) -> torch.Tensor:
    """The routed expert FFN for a given routing (what vLLM's fused_experts computes).

    out[t] = sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t]), with
    FFN_e(v) = (act(v @ Wg_e) * (v @ Wu_e)) @ Wd_e, as two grouped GEMMs over all experts.
    Inference only (no backward). Never synchronizes with the host on CUDA (see the module
    docstring for the backend condition).

    Args:
        x: [T, H] tokens; bf16, fp16 or fp32.
        topk_ids: [T, k] int64/int32 expert per slot. Ids outside [0, E) are dropped
            (expert-parallel sentinels): they contribute nothing.
        topk_weights: [T, k] float weight per slot (cast to x's dtype for the combine).
        w_gate_up: [E, H, 2I] fused gate then up weights, same dtype and device as x; any
            layout with one unit stride in the last two dims, e.g.
            `gate_up_proj.transpose(1, 2)` of transformers' / vLLM's (E, 2I, H) weight.
        w_down: [E, I, H] down weights, e.g. `down_proj.transpose(1, 2)` of an (E, H, I) one.
        activation: "silu" (SwiGLU, default), "gelu", "gelu_tanh" or a callable applied to
            the gate half.
        config: GemmConfig for both grouped GEMMs; None = automatic.
        fused: run on the fused kernel (gather, gated activation and routing weights inside
            the GEMMs; layers/fused_experts.py): None = where the Hopper kernel runs (named
            activations), True = always (the fused ops' torch backend elsewhere), False =
            the unfused grouped GEMMs. An activation the kernel has no gate for (a callable,
            a PostClampedSiLU) runs unfused whatever `fused` says.

    Returns:
        [T, H] in x's dtype (fp32 accumulation, one final rounding). T = 0 gives (0, H).

    Raises:
        TypeError: non-tensors or wrong dtypes; config not a GemmConfig, fused not a bool.
        ValueError: shapes or devices that do not fit.
    """
    x, topk_ids, topk_weights, w_gate_up, w_down = _check_experts(
        x, topk_ids, topk_weights, w_gate_up, w_down
    )
    check_gemm_options(config, fused)
    gate_fn = gated(resolve_activation(activation))
    return expert_ffn(x, topk_ids, topk_weights, w_gate_up, w_down, gate_fn, config=config,
                      fused_gate=fused_gate_for(canonical_activation(activation)), fused=fused)
