"""The routed experts on FP8 weights: the FP8 counterpart of layers/experts.expert_ffn.

    xq, sx = quantize(x)                              (T, H) FP8 + scales, one pass
    h = scaled_grouped_mm(xq[perm], w_gate_up, ...)   (S, 2I) in the compute dtype
    a = act(h[:, :I]) * h[:, I:]                      (S, I)
    aq, sa = quantize(a)
    y = scaled_grouped_mm(aq, w_down, ...)            (S, H)
    out[t] = sum_j weights[t, j] * y[row of (t, j)]   (T, H), fp32 accumulation

The weights stay FP8 (never dequantized): e4m3 expert weights with their decoding scales, as
FP8 checkpoints store them, in one of two granularities:
- "block": 128x128 weight blocks (DeepSeek-V3, Kimi-K2, Qwen3-FP8 `weight_scale_inv`,
  transformers' FP8Experts), activations quantized per token in 1x128 groups;
- "row": one scale per output channel or per expert (compressed-tensors FP8 dynamic, per-
  tensor checkpoints), activations quantized per token.
Activations are quantized on the fly on the GPU (ops/quantize.py), tokens once before the
gather (T rows, not T * k). Like expert_ffn: no host synchronisation on CUDA, no data-
dependent Python control flow, inference only.

Weight layouts (transformers 5 / vLLM orientation, views taken here):
    gate_up_proj [E, 2I, H] FP8, gate_up_scale: block [E, 2I/128, H/128] or row [E, 2I]
    down_proj    [E, H, I]  FP8, down_scale:    block [E, H/128, I/128] or row [E, H]
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moe_gemm.config import GemmConfig
from moe_gemm.layers.routing import permute_by_expert
from moe_gemm.ops.autograd import inference_only_composite, needs_link
from moe_gemm.ops.combine import combine_rows
from moe_gemm.ops.custom_ops import mark_inference_only
from moe_gemm.ops.quantize import (
    FP8_MAX,
    dequantize_fp8,
    in_leading_chunks,
    quantize_fp8_per_block,
    quantize_fp8_per_row,
    quantize_fp8_per_token_group,
)
from moe_gemm.ops.scaled import scaled_grouped_mm
from moe_gemm.ops.token_gather import gather_rows
from moe_gemm.ops.validation import check_dense, shape_text

FP8_DTYPES = tuple(FP8_MAX)
SCALE_BLOCK = 128

INFERENCE_ONLY_MESSAGE = (
    "moe_gemm's FP8 MoE layer is inference-only: it has no backward. Run it under "
    "torch.no_grad() / torch.inference_mode()."
)


def scale_granularity(scale: torch.Tensor) -> str:
    """"block" for an [E, rows/128, cols/128] weight scale, "row" for [E, rows]."""
    return "block" if scale.dim() == 3 else "row"


def check_fp8_experts(gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: object,
                      down_scale: object) -> str:
    """Check FP8 expert weights [E, 2I, H] / [E, H, I] against their scales; returns the
    granularity. ValueError / TypeError naming the expected shapes."""
    # The weights' own shapes first: the scale shapes below are derived from gate_up's, so a
    # down projection that does not fit it would pass them and only fail inside the second
    # GEMM, with a message about that op's operands.
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"FP8 gate_up weights must be (E, 2I, H); got {shape_text(gate_up)}")
    E, two_i, H = gate_up.shape
    I = two_i // 2
    if tuple(down.shape) != (E, H, I):
        raise ValueError(f"FP8 down weights must be (E, H, I) = ({E}, {H}, {I}) to match gate_up "
                         f"{shape_text(gate_up)}; got {shape_text(down)}")
    if gate_up.dtype not in FP8_DTYPES or down.dtype != gate_up.dtype:
        raise TypeError(f"FP8 expert weights must share one dtype among float8_e4m3fn and "
                        f"float8_e5m2; got {gate_up.dtype} and {down.dtype}")
    for name, s in (("gate_up scale", gate_up_scale), ("down scale", down_scale)):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"FP8 expert weights need their {name} (a float32 tensor); got "
                            f"{type(s).__name__}")
        check_dense(f"the {name}", s)  # (else refused by the first forward as scale_b)
        if s.dtype != torch.float32:
            raise TypeError(f"the {name} must be float32 (decoding scales); got {s.dtype}")
        if s.device != gate_up.device:
            raise ValueError(f"the {name} is on {s.device} but the weights are on "
                             f"{gate_up.device}")
    assert isinstance(gate_up_scale, torch.Tensor) and isinstance(down_scale, torch.Tensor)
    g = scale_granularity(gate_up_scale)
    if g == "block":
        want_gu = (E, -(-two_i // SCALE_BLOCK), -(-H // SCALE_BLOCK))
        want_d = (E, -(-H // SCALE_BLOCK), -(-I // SCALE_BLOCK))
        if H % SCALE_BLOCK or I % SCALE_BLOCK:
            raise ValueError(
                f"128x128 block-scaled experts need hidden ({H}) and intermediate ({I}) sizes "
                "that are multiples of 128: the FP8 GEMMs' scale blocks tile K (a 16-bit layer "
                "of these sizes quantizes row-wise: MoE.quantize_fp8(granularity='row'))")
    else:
        want_gu, want_d = (E, two_i), (E, H)
        if H % 16 or I % 16:
            raise ValueError(f"FP8 experts need hidden ({H}) and intermediate ({I}) sizes that "
                             "are multiples of 16 (16-byte FP8 rows)")
    if tuple(gate_up_scale.shape) != want_gu or tuple(down_scale.shape) != want_d:
        raise ValueError(
            f"FP8 expert scales must be {g}-wise gate_up {want_gu} and down {want_d} for "
            f"weights {shape_text(gate_up)} and {shape_text(down)}; got "
            f"{shape_text(gate_up_scale)} and "
            f"{shape_text(down_scale)}")
    return g


def expert_ffn_fp8(
    x: torch.Tensor,  # (T, H) float
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k)
    gate_up: torch.Tensor,  # (E, 2I, H) FP8
    gate_up_scale: torch.Tensor,  # (E, 2I/128, H/128) or (E, 2I)
    down: torch.Tensor,  # (E, H, I) FP8
    down_scale: torch.Tensor,  # (E, H/128, I/128) or (E, H)
    gate_fn: Callable[[torch.Tensor], torch.Tensor],  # (S, 2I) -> (S, I)
    *,
    config: GemmConfig | None = None,
    ids_in_range: bool = False,
    num_valid_slots: int | None = None,
) -> torch.Tensor:
    """The routed experts on FP8 weights for checked arguments (module docstring;
    ids_in_range as layers/experts.expert_ffn; num_valid_slots as
    layers/fused_experts.fused_expert_ffn: the exact count of slots with an id in [0, E),
    known on the host, so that only those rows are gathered and computed).

    Inference only, as expert_ffn: when autograd could ask for a gradient (grad mode on and
    the tokens, the routing weights, the expert weights or their scales require grad, as
    transformers' FP8Experts parameters do by default) the result is linked so that a
    backward raises, eager or traced (the torch backend would otherwise differentiate the
    combine alone, a silently partial gradient of the router, or fail inside torch on the
    FP8 weights).

    Returns:
        (T, H) in x's dtype.
    """
    run = functools.partial(_expert_ffn_fp8, x, topk_ids, topk_weights, gate_up, gate_up_scale,
                            down, down_scale, gate_fn, config, ids_in_range, num_valid_slots)
    linked = (x, topk_weights, gate_up, gate_up_scale, down, down_scale)
    if torch.compiler.is_compiling():
        y = run()
        return mark_inference_only(y, INFERENCE_ONLY_MESSAGE) if needs_link(linked) else y
    return inference_only_composite(INFERENCE_ONLY_MESSAGE, run, linked)


def _quantize_acts(x: torch.Tensor, granularity: str, dtype: torch.dtype):
    if granularity == "block":
        # token-major scales: the grouped GEMM's staged block scales load them with no copy
        return quantize_fp8_per_token_group(x, dtype=dtype, column_major_scales=True)
    return quantize_fp8_per_row(x, dtype=dtype)


def _gather_scales(s: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """s[index] for (T, G) token-major block scales: token-major too where the gathered rows'
    columns stay 16-byte aligned (a multiple of 4 rows, as T x top-8 always is), else
    row-major (the GEMM copies those into its layout); row-wise scales (T,) as they are."""
    if s.dim() == 2 and s.stride(0) == 1 and index.numel() % 4 == 0:
        return s.t().index_select(1, index).t()
    return s.index_select(0, index)


def _expert_ffn_fp8(x, topk_ids, topk_weights, gate_up, gate_up_scale, down, down_scale,
                    gate_fn, config, ids_in_range=False, num_valid_slots=None) -> torch.Tensor:
    E = gate_up.shape[0]
    g = scale_granularity(gate_up_scale)
    perm = permute_by_expert(topk_ids, E, ids_in_range=ids_in_range)
    # The valid slots sort first: with their count known, rows [0, S) are all the GEMMs
    # compute (offs[-1] = S); else every slot gets a row, the dropped ones past offs[-1].
    S = perm.token_index.shape[0] if num_valid_slots is None else num_valid_slots
    index = perm.token_index[:S]
    xq, sx = _quantize_acts(x, g, gate_up.dtype)  # T rows, before the gather
    xs = gather_rows(xq, index)  # (S, H), rows grouped by expert (FP8 moved as bits)
    ss = _gather_scales(sx, index)
    # (E, K, N) K-major views of the (E, N, K) weights and of their block scales: no copy.
    s1, s2 = gate_up_scale, down_scale
    if g == "block":
        s1, s2 = s1.transpose(1, 2), s2.transpose(1, 2)
    h = scaled_grouped_mm(xs, gate_up.transpose(1, 2), ss, s1, perm.offs, out_dtype=x.dtype,
                          config=config)
    a = gate_fn(h)  # (S, I)
    aq, sa = _quantize_acts(a, g, gate_up.dtype)
    w = perm.drop_masked(topk_weights)
    if num_valid_slots is None:
        y = scaled_grouped_mm(aq, down.transpose(1, 2), sa, s2, perm.offs, out_dtype=x.dtype,
                              config=config)
        return combine_rows(y, perm.row_of_slot, w.to(y.dtype))
    # One zero row past the S computed ones, which the dropped slots gather (weight 0 times
    # a row never written could be NaN).
    y = torch.empty(S + 1, down.shape[1], dtype=x.dtype, device=x.device)
    y[S:].zero_()
    scaled_grouped_mm(aq, down.transpose(1, 2), sa, s2, perm.offs, out=y[:S],
                      out_dtype=x.dtype, config=config)
    return combine_rows(y, perm.row_of_slot.clamp(max=S), w.to(y.dtype))


# ---------------------------------------------------------------------------------------------
# Converting weights


def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor, granularity: str = "block",
                     dtype: torch.dtype = torch.float8_e4m3fn):
    """16-bit expert weights [E, 2I, H] / [E, H, I] to FP8 with scales (block: 128x128
    blocks; row: one scale per output channel). Returns (gate_up, gate_up_scale, down,
    down_scale)."""
    if granularity == "block":
        q1, s1 = quantize_fp8_per_block(gate_up, dtype=dtype)
        q2, s2 = quantize_fp8_per_block(down, dtype=dtype)
    elif granularity == "row":
        # a few experts at a time (in_leading_chunks): the fp32 temporaries of a whole layer's
        # weights would be several times their size
        def per_row(w: torch.Tensor):
            return in_leading_chunks(lambda t: quantize_fp8_per_row(t, dtype=dtype), w,
                                     w[0].numel() if w.shape[0] else 0)

        q1, s1 = per_row(gate_up)
        q2, s2 = per_row(down)
    else:
        raise ValueError(f"granularity must be 'block' or 'row'; got {granularity!r}")
    return q1, s1, q2, s2


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint's FP8 weight [..., N, K] with its scale (128x128 blocks, per channel or per
    tensor, told by the scale's shape) in `dtype`: for the parts the layer keeps dense (the
    shared expert)."""
    N, K = q.shape[-2:]
    blocks = (-(-N // SCALE_BLOCK), -(-K // SCALE_BLOCK))
    if scale.numel() == 1:
        return dequantize_fp8(q, scale.reshape(()), "tensor").to(dtype)
    if scale.numel() == q.shape[:-1].numel() and (scale.dim() < 2 or scale.shape[-1] == 1):
        return dequantize_fp8(q, scale.reshape(q.shape[:-1]), "row").to(dtype)
    if scale.dim() >= 2 and tuple(scale.shape[-2:]) == blocks:
        return dequantize_fp8(q, scale, "block").to(dtype)
    raise ValueError(f"weight scale {shape_text(scale)} fits no granularity of weight "
                     f"{shape_text(q)}")


def expert_weight_kind_errors(layer_weights: dict[str, torch.Tensor | None],
                              state_dict: dict, prefix: str) -> dict[str, str]:
    """For load_state_dict: each expert weight key whose tensor in `state_dict` is FP8 where
    the layer's is not, or the other way round, with the message that says so. torch's
    load would copy the values with a dtype cast (FP8 codes read as numbers, or 16-bit values
    cast to FP8 codes) under the layer's old scales, or none: a layer answering with values
    off by the scales' factor, without a word (strict=False, where the scale keys are missing
    or unexpected, raised nothing)."""
    errors = {}
    for name, mine in layer_weights.items():
        theirs = state_dict.get(prefix + name)
        if mine is None or not isinstance(theirs, torch.Tensor):
            continue
        if (theirs.dtype in FP8_DTYPES) == (mine.dtype in FP8_DTYPES):
            continue
        if mine.dtype in FP8_DTYPES:
            how = ("this layer's experts are FP8 with decoding scales: load an FP8 "
                   "checkpoint with its scales, or load the 16-bit one into a 16-bit layer "
                   "and call quantize_fp8()")
        else:
            how = ("this layer's experts are 16-bit: call quantize_fp8() with the "
                   "checkpoint's granularity before loading an FP8 state_dict (its scales "
                   "too), or build the layer from the FP8 checkpoint")
        errors[prefix + name] = (f"{prefix + name}: the state_dict holds a {theirs.dtype} "
                                 f"tensor for the layer's {mine.dtype} parameter; {how}")
    return errors


def keep_dtypes(fn: Callable[[torch.Tensor], torch.Tensor], keep: tuple[torch.Tensor, ...]
                ) -> Callable[[torch.Tensor], torch.Tensor]:
    """nn.Module._apply's `fn`, changed for the tensors in `keep`: where fn would change their
    dtype (module.to(torch.bfloat16), .half(), .float()), they only follow fn's device. The
    FP8 experts stay FP8 with float32 scales (FP8 counts as floating point to torch), and the
    routers' selection-only correction bias stays float32 (layers/moe.py); every other
    tensor, and every other conversion (device moves, to_empty, share_memory), is fn's."""
    ids = {id(t) for t in keep}

    def apply(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in ids:
            return fn(t)
        probe = fn(t.new_empty(0))  # (where and as what fn would put it, without a copy)
        if probe.dtype == t.dtype:
            return fn(t)
        if t.device == probe.device:
            return t
        if t.is_meta:
            return torch.empty_like(t, device=probe.device)
        return t.to(probe.device)

    return apply


def decoding_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    """A checkpoint's weight scale as float32: float32 as it is, other floating dtypes (bf16,
    fp16, UE8M0's float8_e8m0fnu: powers of two) widened. An integer, bool or complex scale is
    a TypeError: `.float()` would take it silently (complex with a warning) and every value
    of the experts would be off by its scale."""
    if not scale.is_floating_point():
        raise TypeError(f"{name} must be a floating-point decoding scale (float32, bfloat16, "
                        f"float16 or float8_e8m0fnu); got {scale.dtype}")
    return scale if scale.dtype == torch.float32 else scale.float()


def row_scale(scale: torch.Tensor, rows: int, name: str = "weight scale") -> torch.Tensor:
    """A per-channel ([N], [N, 1]) or per-tensor ([], [1]) weight scale as [N] float32."""
    s = decoding_scale(name, scale)
    if s.numel() == 1:
        return s.reshape(()).expand(rows).clone()
    if s.numel() == rows:
        return s.reshape(rows)
    raise ValueError(f"weight scale {shape_text(scale)} is neither per channel ({rows},) nor per "
                     "tensor")


def hf_fp8_scales(experts) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The scales of transformers' FP8Experts (gate_up_proj_scale_inv [E, 2I/128, H/128],
    down_proj_scale_inv) as the layer keeps them, or None for 16-bit experts (neither scale;
    one without the other is a ValueError naming the missing one). Blocks are
    shared (no copy); per-tensor scales (block_size None: [E, c, 1], one scale for each of c
    equal row chunks: c = 2 for gate_up, a scale per half, 1 for down) become per channel;
    UE8M0 scales (powers of two) are widened to float32 exactly (decoding_scale)."""
    s1 = getattr(experts, "gate_up_proj_scale_inv", None)
    s2 = getattr(experts, "down_proj_scale_inv", None)
    if s1 is None and s2 is None:
        return None
    if s1 is None or s2 is None:
        # (read as 16-bit experts, FP8 weights with one scale were refused as "a custom
        # _apply_gate" by from_hf, and failed an assert in the experts implementation)
        missing = "gate_up_proj_scale_inv" if s1 is None else "down_proj_scale_inv"
        raise ValueError(f"FP8 experts need both gate_up_proj_scale_inv and "
                         f"down_proj_scale_inv; {missing} is None")
    block = getattr(experts, "block_size", None)
    if block is not None and tuple(block) != (SCALE_BLOCK, SCALE_BLOCK):
        raise ValueError(f"FP8 experts with weight blocks {tuple(block)} are not supported "
                         f"(128x128 blocks or per-tensor scales)")

    s1 = decoding_scale("gate_up_proj_scale_inv", s1)
    s2 = decoding_scale("down_proj_scale_inv", s2)
    if block is None:  # one value per expert and row chunk
        s1 = per_channel(s1, experts.gate_up_proj, "gate_up_proj_scale_inv")
        s2 = per_channel(s2, experts.down_proj, "down_proj_scale_inv")
    return s1, s2


def per_channel(s: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
    """[E, c, 1] per-tensor scales of c equal row chunks of w [E, rows, cols] as [E, rows]."""
    E, rows = w.shape[0], w.shape[1]
    c = s.numel() // max(E, 1)
    if s.dim() != 3 or s.shape[0] != E or s.shape[2] != 1 or c < 1 or rows % c:
        raise ValueError(f"{name} must be (E, c, 1) per-tensor scales of c equal row chunks of "
                         f"the {shape_text(w)} weights; got {shape_text(s)}")
    return s.reshape(E, c, 1).expand(E, c, rows // c).reshape(E, rows).contiguous()


def hf_fp8_gate_is_default(experts) -> bool:
    """Whether transformers' FP8Experts gate is plain act(gate) * up (no soft caps, no SwiGLU
    limit, no custom alpha)."""
    return all(getattr(experts, n, None) is None
               for n in ("gate_softcap", "up_softcap", "limit", "swiglu_limit", "swiglu_alpha"))
