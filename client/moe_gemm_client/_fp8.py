"""FP8 weight uploads: a float8 expert tensor plus its float32 decoding scale, checked locally.

The server (docs/HTTP-API.md, "FP8 sets") stores an F8_E4M3 / F8_E5M2 tensor "w" (E, K, N) or
"w_t" (E, N, K) with an F32 "scale" beside it, the decoding scale (value = fp8 x scale) in the
tensor's own orientation:

    granularity  "w" (E, K, N)            "w_t" (E, N, K)
    block        (E, K/128, ceil(N/128))  (E, ceil(N/128), K/128)   K a multiple of 128
    row          (E, N)                   (E, N)                    per output channel
    tensor       (E,), (1,) or ()         (E,), (1,) or ()          per expert / one value

The same shapes are checked here so that a missing, mistyped or misshapen scale is a local
TypeError / ValueError naming them, not a 422 after a multi-GB body went out. Rules that only
the kernels care about (K a multiple of 16) stay the server's. numpy FP8 is
ml_dtypes.float8_e4m3fn / float8_e5m2; torch float8 tensors travel as their raw bytes, never
through a wider dtype.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._tensors import (
    FLOAT8_E4M3,
    FLOAT8_E5M2,
    TensorEntry,
    _dense_cpu,
    _little_endian_c,
    _shape_text,
    _torch,
    as_data_array,
    is_torch_tensor,
)

__all__ = ["FP8_WIRE", "file_scale_parts", "scale_granularity", "weight_tensors"]

BLOCK = 128
FP8_WIRE = ("F8_E4M3", "F8_E5M2")
_FP8_FROM_TORCH = {"torch.float8_e4m3fn": FLOAT8_E4M3, "torch.float8_e5m2": FLOAT8_E5M2}
# Appended to the dtype error of a weight that is neither 16/32-bit nor FP8.
_WEIGHT_NOTE = ", or FP8 (float8_e4m3fn / float8_e5m2, numpy through ml_dtypes) with scale="


def _layout_hint(layout: str) -> str:
    return "(E, K, N)" if layout == "w" else "(E, N, K)"


def fp8_dtype(obj: object) -> np.dtype[Any] | None:
    """obj's FP8 numpy dtype; None when obj is not an FP8 numpy array or torch tensor."""
    if is_torch_tensor(obj):
        return _FP8_FROM_TORCH.get(str(obj.dtype))  # type: ignore[attr-defined]
    if isinstance(obj, np.ndarray) and obj.dtype in (FLOAT8_E4M3, FLOAT8_E5M2):
        return obj.dtype
    return None


def _expected(layout: str, shape: Sequence[int]) -> str:
    E = shape[0]
    K, N = (shape[1], shape[2]) if layout == "w" else (shape[2], shape[1])
    block = [E, K // BLOCK, -(-N // BLOCK)] if layout == "w" else [E, -(-N // BLOCK), K // BLOCK]
    return (f"128x128 blocks {block} (K a multiple of {BLOCK}), per channel [{E}, {N}] or per "
            f"expert [{E}] / one value")


def scale_granularity(layout: str, shape: Sequence[int], scale_shape: Sequence[int]) -> str:
    """"block" | "row" | "tensor": what a scale of `scale_shape` means for FP8 weights of
    `shape` in `layout` (module docstring); ValueError naming the shapes that would fit."""
    E = shape[0]
    K, N = (shape[1], shape[2]) if layout == "w" else (shape[2], shape[1])
    block = (E, K // BLOCK, -(-N // BLOCK)) if layout == "w" else (E, -(-N // BLOCK), K // BLOCK)
    got = tuple(int(s) for s in scale_shape)
    if got == block:
        if K % BLOCK:
            raise ValueError(f"block scales need K a multiple of {BLOCK}; got K={K}")
        return "block"
    if got == (E, N):
        return "row"
    if got in ((E,), (1,), ()):
        return "tensor"
    raise ValueError(f"scale {list(got)} fits no granularity of {layout!r} "
                     f"{_shape_text(shape)}: expected {_expected(layout, shape)}")


def _fp8_array(obj: Any, dtype: np.dtype[Any], layout: str) -> np.ndarray:
    if is_torch_tensor(obj):
        torch = _torch()
        t = _dense_cpu(obj, "w")
        # numpy cannot take a torch float8 tensor; its bytes are the same FP8 values.
        arr = t.contiguous().view(torch.uint8).numpy().view(dtype)
    else:
        arr = _little_endian_c(obj)
    if arr.ndim != 3:
        raise ValueError(f"w must be 3-D {_layout_hint(layout)}; got shape "
                         f"{_shape_text(arr.shape)}")
    return arr


def _scale_array(obj: object) -> np.ndarray:
    if is_torch_tensor(obj):
        torch = _torch()
        t = obj.detach()  # type: ignore[attr-defined]
        if t.dtype != torch.float32:
            raise TypeError(f"scale must be float32 (FP8 decoding scales); got {t.dtype} "
                            "(convert with .float())")
        return _little_endian_c(_dense_cpu(t, "scale").numpy())
    if isinstance(obj, np.generic):  # np.float32(0.01): a per-tensor scale, dtype and all
        obj = np.asarray(obj)
    if not isinstance(obj, np.ndarray):
        raise TypeError(f"scale must be a float32 numpy array or torch tensor; got "
                        f"{type(obj).__name__}")
    if obj.dtype.kind != "f" or obj.dtype.itemsize != 4:
        raise TypeError(f"scale must be float32 (FP8 decoding scales); got {obj.dtype} "
                        "(convert with .astype(np.float32))")
    return _little_endian_c(obj)


def weight_tensors(w: object, scale: object, layout: str) -> dict[str, np.ndarray]:
    """The tensors of a weight upload: {layout: w}, or {layout: w, "scale": scale} for FP8.

    Raises:
        TypeError: w is not float32/float16/bfloat16/FP8, or scale is not float32.
        ValueError: w is not 3-D; FP8 w without scale (or scale with 16/32-bit w); a scale
            whose shape fits no granularity, or that holds a value not finite and > 0.
    """
    f8 = fp8_dtype(w)
    if f8 is None:
        arr, _ = as_data_array(w, "w", _layout_hint(layout), 3, note=_WEIGHT_NOTE)
        if scale is not None:
            raise ValueError("scale= goes with FP8 weights only (float8_e4m3fn / float8_e5m2); "
                             f"w is {arr.dtype}")
        return {layout: arr}
    arr = _fp8_array(w, f8, layout)
    if scale is None:
        raise ValueError(f"FP8 weights need their float32 decoding scale (w = fp8 * scale): "
                         f"pass scale=, {_expected(layout, arr.shape)}")
    s = _scale_array(scale)
    scale_granularity(layout, arr.shape, s.shape)
    # The server's rule (fp8_weights.check_scale_values): a zero decoding scale erases what it
    # scales, a negative one flips its signs, a NaN or infinite one makes every product NaN / inf.
    bad = ~(np.isfinite(s) & (s > 0))
    if bad.any():
        at = [int(i) for i in np.argwhere(bad)[0]]
        raise ValueError(f"scale must hold finite decoding scales > 0 (w = fp8 * scale); got "
                         f"{s[tuple(at)].item():g} at {at} ({int(bad.sum())} of its {s.size} "
                         "values are not)")
    return {layout: arr, "scale": s}


def file_scale_parts(path: str | os.PathLike[str], entries: Mapping[str, TensorEntry],
                     tensor: str, layout: str,
                     scale_tensor: str | None) -> list[tuple[TensorEntry, str]]:
    """What travels beside file tensor `tensor`: [(its scale's entry, "scale")] when it is FP8,
    [] otherwise. TypeError / ValueError as `weight_tensors` (shapes only: the data stays on
    disk)."""
    entry = entries[tensor]
    where = os.fspath(path)
    if entry.dtype not in FP8_WIRE:
        if scale_tensor is not None:
            raise ValueError(f"scale_tensor goes with FP8 tensors only; {tensor!r} in {where} "
                             f"is {entry.dtype}")
        return []
    key = "scale" if scale_tensor is None else scale_tensor
    if key not in entries:
        raise ValueError(
            f"FP8 tensor {tensor!r} needs its float32 decoding scale, but {where} has no "
            f"tensor {key!r} (it holds {sorted(entries)}); store it as 'scale' or name it "
            f"(scale_tensor=...): {_expected(layout, entry.shape)}")
    scale = entries[key]
    if scale.dtype != "F32":
        raise TypeError(f"scale {key!r} in {where} must be F32; got {scale.dtype}")
    scale_granularity(layout, entry.shape, scale.shape)
    return [(scale, "scale")]
