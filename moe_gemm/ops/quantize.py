"""FP8 quantization: the operands and scales the FP8 ops take (ops/scaled.py).

Every helper returns (q, scale) with x ~= q * scale, scale float32 ("decoding" scales, as
torch's scaled matmuls and DeepSeek-V3's `weight_scale_inv` use them), saturating to the FP8
range (448 for e4m3, 57344 for e5m2) with scale = max|x| / FP8_MAX per group:

    quantize_fp8_per_token_group(x)  x (..., K) -> scale (..., K/128)  activations, 1x128
    quantize_fp8_per_block(w)        w (..., N, K) -> scale (..., ceil(N/128), ceil(K/128))
    quantize_fp8_per_row(x)          x (..., K) -> scale (...)          tokens / channels
    quantize_fp8_per_tensor(x)       x -> scale ()
    dequantize_fp8(q, scale, granularity)   the inverse, in float32

x is expected finite, as the GEMMs' inputs are: in every quantizer a NaN makes its group's
(block's, row's, tensor's) scale and q NaN, an infinity its scale infinite (that group's
finite values then quantize to zero). Like the kernels, the quantizers have no backward:
where x requires grad (grad mode on) the results are tied to it by a backward that raises
(NO_BACKWARD), eager or compiled; quantize under torch.no_grad() or pass x.detach().

The per-token-group one runs on every FP8 layer call: on an sm90a GPU with the CuTe DSL it is
one kernel (kernels/sm90/quantize_fp8.py: one pass over x, ~1 launch); elsewhere (and with
MOE_GEMM_FP8_QUANT=torch) a torch op sequence that computes the same values bit for bit.
The others run once per weight (load time) and are plain torch.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable

import torch

from moe_gemm.env import env_value
from moe_gemm.ops import quantize_custom_ops
from moe_gemm.ops.autograd import inference_only_composite, needs_link
from moe_gemm.ops.validation import check_dense, shape_text
from moe_gemm.ops.vmap import functorch_active as _functorch_active

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MIN_AMAX = 1e-10  # kernels/sm90/quantize_fp8.MIN_AMAX: a zero group's scale stays finite
QUANT_ENV = "MOE_GEMM_FP8_QUANT"  # "torch": the torch op sequence even where the kernel runs
GRANULARITIES = ("group", "block", "row", "tensor")
_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The weight quantizers' fp32 working set per step: each step holds a few fp32 copies of its
# slice (the padded blocks, their magnitudes, the scaled values), ~4.5x the bf16 weight in
# one go; a 256-expert layer of 4096 x 7168 weights is 15 GB of bf16.
CHUNK_ELEMENTS = 1 << 26  # 256 MiB of fp32


NO_BACKWARD = (
    "moe_gemm's FP8 quantizers have no backward: rounding to FP8 has no useful gradient (torch's "
    "cast would round the incoming gradient to the FP8 dtype too) and the GPU kernel records "
    "none. Quantize under torch.no_grad() / torch.inference_mode(), or pass x.detach()."
)


def _untracked(run: Callable[[], tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """run() -> (q, scale), tied to x by a backward that raises NO_BACKWARD where autograd
    could ask for one (ops/autograd.py): never a gradient that is silently wrong (torch's ops)
    or silently missing (the kernel)."""
    if torch.compiler.is_compiling():
        if not needs_link([x]):
            return run()
        from moe_gemm.ops.custom_ops import mark_inference_only

        q, scale = run()
        return mark_inference_only(q, NO_BACKWARD), mark_inference_only(scale, NO_BACKWARD)
    # (under torch.func too: vmap's BatchedTensors hide requires_grad, grad's need a raise)
    q, scale = inference_only_composite(NO_BACKWARD, run, [x])
    return q, scale


def _check_input(name: str, x: object, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    check_dense(name, x)
    if x.dtype not in _IN_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32; got {x.dtype}")
    # (the isinstance first: an unhashable dtype argument, such as a list, would otherwise
    # fail the dict lookup with a message that names neither dtype nor what it must be)
    if not isinstance(dtype, torch.dtype) or dtype not in FP8_MAX:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2; got {dtype!r}")
    return x


def _check_block(name: str, size: object) -> int:
    # A non-integer (128.0, "128", a bool) is a TypeError, as every other int option of the
    # public API refuses one; numpy's integer scalars are ints (numbers.Integral).
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(f"{name} must be a positive int; got {type(size).__name__} {size!r}")
    if size <= 0:
        raise ValueError(f"{name} must be a positive int; got {size!r}")
    return int(size)


def _to_fp8(x32: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * (FP8_MAX / amax), saturated, in the FP8 dtype (amax broadcast over x)."""
    top = FP8_MAX[dtype]
    return (x32 * _ieee_div(top, amax)).clamp_(-top, top).to(dtype)


def _ieee_div(a: float | torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """a / b rounded once, as the quantization kernel's div.rn.f32 does. Written with two
    tensors on purpose: torch evaluates `scalar / t` as reciprocal(t) * scalar and, on CUDA,
    `t / scalar` as t * (1 / scalar), each rounded twice, which differs in the last bit."""
    t = a if isinstance(a, torch.Tensor) else b
    a = a if isinstance(a, torch.Tensor) else torch.full_like(t, a)
    b = b if isinstance(b, torch.Tensor) else torch.full_like(t, b)
    return torch.div(a, b)


def quantize_fp8_per_token_group(x: torch.Tensor, group_size: int = 128, *,
                                 dtype: torch.dtype = torch.float8_e4m3fn,
                                 column_major_scales: bool = False
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations in 1 x group_size groups along the last dim (DeepSeek-V3's recipe).

    Args:
        x: [..., K] bf16, fp16 or fp32, K a multiple of group_size.
        group_size: values per scale (128 for the FP8 ops' block scales).
        dtype: torch.float8_e4m3fn (default) or torch.float8_e5m2.
        column_major_scales: return the scales token-major in memory (the token axis
            contiguous, each group's column padded to a multiple of 4 tokens: 16-byte
            aligned), the layout scaled_grouped_mm's staged block scales load as they are
            (and DeepGEMM's and torch's blockwise scaled mm take); otherwise they are copied
            into it on every call.

    Returns:
        q [..., K] in dtype and scale [..., K / group_size] float32, x ~= q * scale (the
        same values in either scale layout). A group's scale is its largest magnitude over
        the dtype's largest value, that magnitude floored at MIN_AMAX (1e-10, as the GPU
        kernel does): a group of all zeros quantizes to zeros with a finite scale, and a
        group of values far below the floor (about 1e-15 and less) rounds to zeros. x is
        expected finite, as the GEMM's inputs are: a NaN makes its group's scale and q NaN,
        an infinity its group's scale infinite (the group's finite values then quantize to
        zero).
    """
    x = _check_input("x", x, dtype)
    g = _check_block("group_size", group_size)
    if not isinstance(column_major_scales, bool):
        raise TypeError("column_major_scales must be a bool; got "
                        f"{type(column_major_scales).__name__}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., K)")
    K = x.shape[-1]
    if K % g:
        raise ValueError(f"the last dim of x (K={K}) must be a multiple of group_size={g}")
    return _untracked(lambda: _per_token_group(x, g, dtype, column_major_scales), x)


def _per_token_group(x: torch.Tensor, g: int, dtype: torch.dtype, column_major_scales: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    K = x.shape[-1]
    lead = x.shape[:-1]
    T = math.prod(lead)
    if not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(x):
        # Under torch.vmap / torch.func: the torch op sequence, its scales returned as they
        # are (a preallocated buffer cannot take a batched result, and the kernel needs a
        # data pointer); the values are those of every other path.
        q, st = _per_token_group_torch(x, g, dtype)
        return q, st.reshape(*lead, K // g)
    s = _scale_buffer(T, K // g, column_major_scales, x.device)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=dtype, device=x.device), s.view(*lead, K // g)
    if g == 128 and _kernel_ok(x):
        q = _quantize_kernel(x.reshape(-1, K), dtype, s)
        return q.view(x.shape), s.view(*lead, K // g)
    q, st = _per_token_group_torch(x, g, dtype)
    s.copy_(st.reshape(T, K // g))
    return q, s.view(*lead, K // g)


def _scale_buffer(T: int, groups: int, column_major: bool, device) -> torch.Tensor:
    """(T, groups) float32, row-major or token_major_scales."""
    if not column_major:
        return torch.empty(T, groups, dtype=torch.float32, device=device)
    return token_major_scales(T, groups, device)


def token_major_scales(T: int, groups: int, device) -> torch.Tensor:
    """An empty (T, groups) float32 scale tensor laid out token-major (stride 1 along T) with
    each group's column padded to a multiple of 4 tokens (16-byte aligned): the layout the
    staged FP8 kernel's TMA loads take (ops/scaled_launch.py)."""
    pitch = -(-T // 4) * 4
    return torch.empty(groups, pitch, dtype=torch.float32, device=device)[:, :T].t()


def _per_token_group_torch(x: torch.Tensor, g: int, dtype: torch.dtype):
    K = x.shape[-1]
    xg = x.reshape(-1, K // g, g).float()
    amax = xg.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
    q = _to_fp8(xg, amax, dtype)
    scale = _ieee_div(amax.squeeze(-1), FP8_MAX[dtype])
    return q.view(x.shape), scale.view(*x.shape[:-1], K // g)


def _kernel_ok(x: torch.Tensor) -> bool:
    if x.device.type != "cuda" or env_value(QUANT_ENV) == "torch":
        return False
    from moe_gemm.capability import cute_problem

    if cute_problem(x.device) is not None:
        return False
    # One vector load per lane: K contiguous and 16-byte aligned rows.
    if x.stride(-1) != 1 or x.data_ptr() % 16:
        return False
    return all(s * x.element_size() % 16 == 0 for s, n in zip(x.stride()[:-1], x.shape[:-1])
               if n > 1)


_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
          torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


@functools.lru_cache(maxsize=16)
def _quant_kernel(in_dtype: torch.dtype, out_dtype: torch.dtype):
    from moe_gemm.kernels.sm90.compile_fp8 import QuantCompileKey, compile_quant
    from moe_gemm.ops import kernel_cache as cache

    key = QuantCompileKey(_NAMES[in_dtype], _NAMES[out_dtype])
    return cache.get_or_compile(key, key.name, lambda: compile_quant(key))


def _quantize_kernel(x2: torch.Tensor, dtype: torch.dtype, s: torch.Tensor) -> torch.Tensor:
    """q of x2 (T, K); the scales into s (T, K / 128), row- or token-major."""
    T, K = x2.shape
    q = torch.empty(T, K, dtype=dtype, device=x2.device)
    if T:
        if T == 1 and x2.stride(0) % (16 // x2.element_size()):
            x2 = x2.as_strided((1, K), (K, 1))  # (a size-1 dim's stride is never used)
        _quant_kernel(x2.dtype, dtype)(x2, q, s, T * (K // 128))
    return q


def in_leading_chunks(fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], x: torch.Tensor,
                      inner: int) -> tuple[torch.Tensor, ...]:
    """fn(x) for x [L, ...] (fn maps leading index to leading index and returns a tuple of
    tensors), run on slices of at most CHUNK_ELEMENTS // inner leading indices so that its
    fp32 temporaries stay bounded; the slices' results are written into preallocated
    outputs. inner: the values per leading index fn works on. One slice: fn(x) itself."""
    L = x.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(inner, 1))
    if L <= step:
        return fn(x)
    outs: list[torch.Tensor] = []
    for i in range(0, L, step):
        res = fn(x[i:i + step])
        if not outs:
            outs = [torch.empty((L, *r.shape[1:]), dtype=r.dtype, device=r.device) for r in res]
        for o, r in zip(outs, res):
            o[i:i + step] = r
    return tuple(outs)


def quantize_fp8_per_block(w: torch.Tensor, block_size: int = 128, *,
                           dtype: torch.dtype = torch.float8_e4m3fn
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights in block_size x block_size blocks over the last two dims (DeepSeek-V3's
    128x128 `weight_scale_inv` layout; partial edge blocks are scaled by their own values).
    A stack of weights ([E, N, K]) is quantized a few at a time (CHUNK_ELEMENTS), with the
    same values.

    Args:
        w: [..., N, K] bf16, fp16 or fp32 (a checkpoint's orientation: K last).

    Returns:
        q [..., N, K] in dtype and scale [..., ceil(N/block), ceil(K/block)] float32. For
        scaled_grouped_mm pass `q.transpose(-1, -2)` and `scale.transpose(-1, -2)`.
    """
    w = _check_input("w", w, dtype)
    b = _check_block("block_size", block_size)
    if w.dim() < 2:
        raise ValueError(f"w must have at least two dimensions (..., N, K); got {w.dim()}")
    return _untracked(lambda: per_block_values(w, b, dtype), w)


def per_block_values(w: torch.Tensor, b: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_per_block's (q, scale) of checked arguments; while traced by
    torch.compile, through its custom op (ops/quantize_custom_ops.py says why)."""
    if torch.compiler.is_compiling():
        return quantize_custom_ops.quantize_per_block(w, b, dtype)
    return _per_block_chunked(w, b, dtype)


def _per_block_chunked(w: torch.Tensor, b: int, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = w.shape[-2:]
    lead = w.shape[:-2]
    nb, kb = -(-N // b), -(-K // b)
    if not lead or (not torch.compiler.is_compiling() and _functorch_active()):
        # (under torch.vmap / torch.func in one go: the chunks' preallocated outputs cannot
        # take a batched result)
        return _per_block(w, b, dtype)
    q, scale = in_leading_chunks(lambda t: _per_block(t, b, dtype),
                                 w.reshape(math.prod(lead), N, K),
                                 nb * _covered(b, N) * kb * _covered(b, K))
    return q.view(*lead, N, K), scale.view(*lead, nb, kb)


def _covered(b: int, size: int) -> int:
    """The values one block covers along a dim of `size`: b, or the whole dim where a block
    is larger (one block, padded no further: a block_size of 65536 padded a 16 x 16 weight to
    16 GiB of fp32)."""
    return min(b, max(size, 1))


def _per_block(w: torch.Tensor, b: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = w.shape[-2:]
    lead = w.shape[:-2]
    nb, kb = -(-N // b), -(-K // b)
    bn, bk = _covered(b, N), _covered(b, K)
    # Padded out of place: under torch.vmap a batched w cannot be written into an unbatched
    # buffer.
    padded = torch.nn.functional.pad(w.float(), (0, kb * bk - K, 0, nb * bn - N))
    blocks = padded.view(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=MIN_AMAX)
    q = _to_fp8(blocks, amax, dtype).view(*lead, nb * bn, kb * bk)[..., :N, :K]
    scale = _ieee_div(amax.view(*lead, nb, kb), FP8_MAX[dtype])
    return q.contiguous(), scale


def quantize_fp8_per_row(x: torch.Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row over the last dim: per token (activations [T, K]) or per output
    channel (weights [..., N, K]). Returns q like x and scale [...] (x.shape[:-1])."""
    x = _check_input("x", x, dtype)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., K)")
    return _untracked(lambda: _per_row(x, dtype), x)


def _per_row(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    amax = (x32.abs().amax(dim=-1, keepdim=True) if x.shape[-1]
            else x32.new_zeros(*x.shape[:-1], 1)).clamp(min=MIN_AMAX)
    return _to_fp8(x32, amax, dtype), _ieee_div(amax.squeeze(-1), FP8_MAX[dtype])


def quantize_fp8_per_tensor(x: torch.Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor: q like x and a 0-d scale."""
    x = _check_input("x", x, dtype)
    return _untracked(lambda: _per_tensor(x, dtype), x)


def _per_tensor(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    amax = (x32.abs().amax() if x.numel() else x32.new_zeros(())).clamp(min=MIN_AMAX)
    return _to_fp8(x32, amax, dtype), _ieee_div(amax, FP8_MAX[dtype])


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, granularity: str,
                   block_size: int = 128) -> torch.Tensor:
    """q * scale in float32, the scale expanded over its granularity's blocks ("group":
    [..., ceil(K/block)] along the last dim; "block": [..., ceil(N/block), ceil(K/block)] over
    the last two; "row": [...] (q.shape[:-1]); "tensor": a single value, [] or [1]).

    Raises:
        TypeError: q not an FP8 tensor, scale not a float tensor.
        ValueError: an unknown granularity, a scale shape that is not the granularity's, or
            q and scale on different devices.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}; got "
                         f"{granularity!r}")
    if not isinstance(q, torch.Tensor) or q.dtype not in FP8_MAX:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise TypeError(f"q must be an FP8 tensor (torch.float8_e4m3fn or torch.float8_e5m2); got "
                        f"{got}")
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point():
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"scale must be a float tensor (decoding scales); got {got}")
    check_dense("q", q)
    check_dense("scale", scale)
    if scale.device != q.device:
        raise ValueError(f"scale is on {scale.device} but q is on {q.device}; they must be on "
                         "one device")
    b = _check_block("block_size", block_size)
    want = _scale_shape(tuple(q.shape), granularity, b)
    if want is None:
        raise ValueError(f"{granularity} scales need q with at least "
                         f"{2 if granularity == 'block' else 1} dimension(s); got shape "
                         f"{shape_text(q)}")
    got = tuple(scale.shape)
    if got != want and not (granularity == "tensor" and got == (1,)):
        shapes = f"{want} or (1,)" if granularity == "tensor" else f"{want}"
        raise ValueError(f"{granularity} scales of q {shape_text(q)} (block_size {b}) must "
                         f"have shape {shapes}; got {got}")
    if torch.compiler.is_compiling() and granularity in ("group", "block"):
        return quantize_custom_ops.dequantize(q, scale, granularity, b)
    return dequantized_values(q, scale, granularity, b)


def dequantized_values(q: torch.Tensor, scale: torch.Tensor, granularity: str, b: int
                       ) -> torch.Tensor:
    """dequantize_fp8's result for checked arguments."""
    v = q.float()
    s = scale.float()
    if granularity == "tensor":
        return v * s.reshape(())
    if granularity == "row":
        return v * s.unsqueeze(-1)
    # (each scale repeated over the values its block covers, never more: _covered)
    if granularity == "group":
        K = v.shape[-1]
        return v * s.repeat_interleave(_covered(b, K), dim=-1)[..., :K]
    N, K = v.shape[-2:]
    s = s.repeat_interleave(_covered(b, N), dim=-2)[..., :N, :]
    return v * s.repeat_interleave(_covered(b, K), dim=-1)[..., :K]


def _scale_shape(shape: tuple[int, ...], granularity: str, b: int) -> tuple[int, ...] | None:
    """The scale shape dequantize_fp8 expects for q of `shape`, None if q's rank cannot have
    one."""
    if granularity == "tensor":
        return ()
    if not shape or (granularity == "block" and len(shape) < 2):
        return None
    if granularity == "row":
        return shape[:-1]
    if granularity == "group":
        return (*shape[:-1], -(-shape[-1] // b))
    return (*shape[:-2], -(-shape[-2] // b), -(-shape[-1] // b))
