"""FP8 weight sets: an FP8 (e4m3 / e5m2) expert tensor with its float32 decoding scale.

A weight set uploaded as FP8 stays FP8 on the device; requests keep sending bfloat16, float16
or float32 activations, which the engine quantizes on the device per request batch (1x128
groups per token for block scales, one scale per token otherwise) before
moe_gemm.scaled_grouped_mm. The upload carries the scale beside the tensor, in the tensor's
own orientation (safetensors "w" or "w_t" plus "scale", F32):

    granularity  "w" (E, K, N)            "w_t" (E, N, K)         what checkpoints have
    block        (E, K/128, ceil(N/128))  (E, ceil(N/128), K/128)  DeepSeek-V3 weight_scale_inv
    row          (E, N)                   (E, N)                   per output channel
    tensor       (E,), (1,) or ()         (E,), (1,) or ()         per expert / one value

Every scale value is finite and > 0 (check_scale_values).
"""

from __future__ import annotations

import torch

from moe_gemm.config import GemmConfig
from moe_gemm.ops.validation import shape_text

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK = 128


def check_fp8_scale(tensor: torch.Tensor, layout: str, scale: object) -> str | None:
    """The granularity of an FP8 tensor's scale (module docstring), None for a 16/32-bit
    tensor without one. TypeError / ValueError naming the expected shapes."""
    if tensor.dtype not in FP8_DTYPES:
        if scale is not None:
            raise ValueError(f"a 'scale' goes with FP8 weights only; {layout!r} is "
                             f"{str(tensor.dtype).removeprefix('torch.')}")
        return None
    if not isinstance(scale, torch.Tensor):
        raise ValueError(f"FP8 weights {layout!r} need their float32 'scale' tensor (decoding "
                         "scales: w = fp8 * scale)")
    if scale.dtype != torch.float32:
        raise TypeError(f"'scale' must be float32 (F32 decoding scales: w = fp8 * scale); got "
                        f"{str(scale.dtype).removeprefix('torch.')}{_scale_hint(scale.dtype)}")
    E = tensor.shape[0]
    if layout == "w":
        K, N = tensor.shape[1], tensor.shape[2]
        block = (E, K // BLOCK, -(-N // BLOCK))
    else:
        N, K = tensor.shape[1], tensor.shape[2]
        block = (E, -(-N // BLOCK), K // BLOCK)
    got = tuple(scale.shape)
    check_scale_values(scale, layout)
    if K % 16:
        raise ValueError(f"FP8 weights need K a multiple of 16 (16-byte rows); got K={K}")
    if got == block:
        if K % BLOCK:
            raise ValueError(f"block scales need K a multiple of {BLOCK}; got K={K}")
        return "block"
    if got == (E, N):
        return "row"
    if got in ((E,), (1,), ()):
        return "tensor"
    # (the block shape with its condition: for a K not a multiple of 128 it is refused too)
    raise ValueError(
        f"'scale' {list(got)} fits no granularity of {layout!r} {shape_text(tensor)}: expected "
        f"128x128 blocks {list(block)} (K a multiple of {BLOCK}), per channel [{E}, {N}] or per "
        f"expert [{E}]")


def _scale_hint(dtype: torch.dtype) -> str:
    """How to turn a scale of `dtype` into the float32 one the API takes, where that is exact.

    The API keeps to float32 scales (docs/HTTP-API.md) rather than widening UE8M0 ones on
    arrival: a set is stored as uploaded, and a file with an F8_E8M0 scale would not load on a
    server of an earlier version sharing the data directory (or after a rollback)."""
    if dtype == torch.float8_e8m0fnu:
        return (": UE8M0 scales are powers of two, 2^(e - 127), which float32 holds exactly: "
                "widen them before the upload")
    return ""


def check_scale_values(scale: torch.Tensor, layout: str) -> None:
    """ValueError unless every decoding scale is finite and > 0, naming the first that is not.

    Decoding scales are amax / the FP8 maximum, which quantizers keep above zero (an all-zero
    block's too: ops/quantize.MIN_AMAX here). A zero scale decodes its block, channel or
    expert to zeros and a negative one flips its signs, both then served as if right; a NaN or
    an infinity turns every product it touches into NaN / inf. One pass over the scale on the
    CPU, at upload and at load, never per request (the ops never read scale values)."""
    bad = ~(torch.isfinite(scale) & (scale > 0))  # (-0.0 > 0 is False: refused with 0.0)
    if not bool(bad.any()):
        return
    at = [int(i) for i in bad.nonzero()[0]]
    raise ValueError(
        f"'scale' of {layout!r} must hold finite decoding scales > 0 (w = fp8 * scale); got "
        f"{scale[tuple(at)].item():g} at {at} ({int(bad.sum())} of its {scale.numel()} values "
        "are not)")


def _op_scales(ws, x: torch.Tensor):
    """(quantized x, scale_a, scale_b) for scaled_grouped_mm."""
    from moe_gemm import quantize_fp8_per_row, quantize_fp8_per_token_group

    if ws.granularity == "block":
        # token-major scales: what the kernel's staged scales load with no copy
        xq, sa = quantize_fp8_per_token_group(x, dtype=ws.dtype, column_major_scales=True)
        return xq, sa, ws.scale
    xq, sa = quantize_fp8_per_row(x, dtype=ws.dtype)
    sb = ws.scale
    if ws.granularity == "tensor":  # per expert (or one value) as per channel (E, N)
        sb = sb.reshape(-1, 1).expand(ws.E, ws.N)
    return xq, sa, sb


def fp8_mm(ws, x: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype,
           config: GemmConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """One FP8 launch: x (T, K) bf16/fp16/fp32 quantized on its device, then
    scaled_grouped_mm against the set's FP8 weights (no host synchronisation)."""
    from moe_gemm import scaled_grouped_mm

    xq, sa, sb = _op_scales(ws, x)
    if out is not None:
        return scaled_grouped_mm(xq, ws.w, sa, sb, offs, out=out, config=config)
    return scaled_grouped_mm(xq, ws.w, sa, sb, offs, out_dtype=out_dtype, config=config)


def fp8_warm_choices(ws, config: GemmConfig, candidates) -> tuple[tuple[int, ...],
                                                                  tuple[dict[str, object], ...]]:
    """(row counts, report): the first of `candidates` for each distinct FP8 kernel choice
    (moe_gemm.ops.heuristics_fp8), and per one {"rows", "config", "source": "rules"}."""
    from moe_gemm.ops.heuristics_fp8 import choose_fp8

    g = "block" if ws.granularity == "block" else "row"
    first: dict[object, int] = {}
    for T in candidates:
        if T <= 0:
            continue
        c = choose_fp8("varlen", config, T / ws.E, ws.N, ws.K, 2, g)
        key = (c.schedule, c.tile_m, c.tile_n, c.stages, c.cluster_m, c.cluster_n,
               c.tail_split, c.epi_whole)
        first.setdefault(key, T)
    report = tuple(
        {"rows": T, "config": (f"fp8 {key[0]} {key[1]}x{key[2]} c{key[4]}x{key[5]}"
                               + (" ts" if key[6] else "")), "source": "rules"}
        for key, T in sorted(first.items(), key=lambda kv: kv[1]))
    return tuple(sorted(first.values())), report
