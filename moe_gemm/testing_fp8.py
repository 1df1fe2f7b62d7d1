"""Test helpers for the FP8 ops: random quantized operands with their scales in every
granularity, and the accuracy check against the exact (fp64) product of the dequantized
operands.

The operands are made the way a model makes them: random real values quantized by
moe_gemm.ops.quantize (activations per token in 1x128 groups, weights in 128x128 blocks, or
row-wise / per-tensor), so the scales span the ranges real ones do.
"""

from __future__ import annotations

import torch

from moe_gemm.ops.quantize import (
    quantize_fp8_per_block,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
)
from moe_gemm.testing import calc_diff, random_offs

GRANULARITIES = ("block", "row", "tensor")


def quantize_acts(x: torch.Tensor, granularity: str, dtype=torch.float8_e4m3fn):
    """(q, scale_a) of activations [..., K] in the op's scale_a layout."""
    if granularity == "block":
        return quantize_fp8_per_token_group(x, dtype=dtype)
    if granularity == "row":
        return quantize_fp8_per_row(x, dtype=dtype)
    return quantize_fp8_per_tensor(x, dtype=dtype)


def quantize_weights(w_nk: torch.Tensor, granularity: str, dtype=torch.float8_e4m3fn,
                     per_expert: bool = True):
    """(w, scale_b) of weights [..., N, K] in the op's layout: w [..., K, N] K-major (a
    transposed view) and scale_b [..., K/128, ceil(N/128)] / [..., N] / per expert [...]."""
    if granularity == "block":
        q, s = quantize_fp8_per_block(w_nk, dtype=dtype)
        return q.transpose(-1, -2), s.transpose(-1, -2)
    if granularity == "row":
        q, s = quantize_fp8_per_row(w_nk, dtype=dtype)
        return q.transpose(-1, -2), s
    if per_expert and w_nk.dim() == 3:
        pairs = [quantize_fp8_per_tensor(w, dtype=dtype) for w in w_nk]
        return (torch.stack([q for q, _ in pairs]).transpose(-1, -2),
                torch.stack([s for _, s in pairs]))
    q, s = quantize_fp8_per_tensor(w_nk, dtype=dtype)
    return q.transpose(-1, -2), s


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _acts(shape, gen, device, x_scale=1.0):
    """Random activations whose rows differ in magnitude (a factor in [0.1, 10] per row), so
    per-row and per-group scales differ."""
    x = torch.randn(shape, generator=gen, device=device) * x_scale
    return x * 10.0 ** (torch.rand(*shape[:-1], 1, generator=gen, device=device) * 2 - 1)


def make_fp8_moe_inputs(T: int, E: int, K: int, N: int, granularity: str, *,
                        dtype: torch.dtype = torch.float8_e4m3fn,
                        device: torch.device | str = "cpu", empty_fraction: float = 0.0,
                        total: int | None = None, seed: int = 0, x_scale: float = 1.0,
                        skew: float = 0.0):
    """(x, w, scale_a, scale_b, offs) for scaled_grouped_mm's MoE form: x [T, K], w [E, K, N]
    K-major, scales of `granularity`, offs [E] int32 (moe_gemm.testing.random_offs), drawn
    and quantized on `device`."""
    d = torch.device(device)
    gen = _generator(seed, d)
    x = _acts((T, K), gen, d, x_scale)
    w = torch.randn(E, N, K, generator=gen, device=d) / K ** 0.5
    xq, sa = quantize_acts(x, granularity, dtype)
    wq, sb = quantize_weights(w, granularity, dtype)
    offs = random_offs(T, E, empty_fraction, _generator(seed, torch.device("cpu")), total=total,
                       skew=skew)
    return xq, wq, sa, sb, offs.to(d)


def make_fp8_batched_inputs(G: int, M: int, K: int, N: int, granularity: str, *,
                            dtype: torch.dtype = torch.float8_e4m3fn,
                            device: torch.device | str = "cpu", seed: int = 0):
    """(x [G, M, K], w [G, K, N] K-major, scale_a, scale_b) for the batched form."""
    d = torch.device(device)
    gen = _generator(seed, d)
    x = _acts((G, M, K), gen, d)
    w = torch.randn(G, N, K, generator=gen, device=d) / K ** 0.5
    if granularity == "tensor":
        xq, sa = quantize_fp8_per_tensor(x, dtype=dtype)
    else:
        xq, sa = quantize_acts(x, granularity, dtype)
    wq, sb = quantize_weights(w, granularity, dtype)
    return xq, wq, sa, sb


def make_fp8_grouped_inputs(sizes, granularity: str, *,
                            dtype: torch.dtype = torch.float8_e4m3fn,
                            device: torch.device | str = "cpu", seed: int = 0):
    """Lists (a, b, scale_a, scale_b) for scaled_grouped_gemm: a_i [M_i, K_i], b_i [K_i, N_i]
    K-major."""
    d = torch.device(device)
    gen = _generator(seed, d)
    a, b, sa, sb = [], [], [], []
    for m, n, k in sizes:
        x = _acts((m, k), gen, d)
        w = torch.randn(n, k, generator=gen, device=d) / max(1, k) ** 0.5
        xq, s1 = quantize_acts(x, granularity, dtype)
        wq, s2 = quantize_weights(w, granularity, dtype, per_expert=False)
        a.append(xq)
        b.append(wq)
        sa.append(s1)
        sb.append(s2)
    return a, b, sa, sb


def fp8_errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """{"rel": ||out - ref|| / ||ref|| (Frobenius), "max_rel": max |out - ref| / max |ref|,
    "calc_diff": DeepGEMM's similarity distance}, in float64."""
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    norm = float(r.norm())
    top = float(r.abs().max()) if r.numel() else 0.0
    return {
        "rel": float((o - r).norm()) / norm if norm else float((o - r).norm()),
        "max_rel": float((o - r).abs().max()) / top if top else 0.0,
        "calc_diff": calc_diff(o, r),
    }


# Accuracy bars against the fp64 product of the dequantized operands. The output's own rounding
# dominates in 16 bits: bf16 keeps 8 significant bits (relative error up to 2^-9, ~1e-3 rms),
# fp16 11. With fp32 output the kernel's own error shows: Hopper's FP8 tensor cores keep ~14
# accumulator bits inside a WGMMA chain (DeepSeek-V3's measurement), so a 128-K block's partial
# is good to ~1e-4 and the promotion into fp32 keeps it there for any K; without it, long K
# drifts to ~1e-2 (DeepSeek-V3: up to 2% at K = 4096).
REL_BOUND = {torch.bfloat16: 4e-3, torch.float16: 1e-3, torch.float32: 5e-4}

# Two FP8 GEMMs with the gated intermediate quantized again between them (an FP8 expert FFN)
# against an fp64 reference that rounds and quantizes that intermediate itself: where the
# kernel's fp32-accumulated intermediate rounds to a neighbouring bf16 value, an element near
# an e4m3 rounding boundary (3 mantissa bits: codes 6-12% apart) lands on the other code, so
# a few percent of the down GEMM's inputs differ by one FP8 step; that puts the output's
# Frobenius error near 0.5% (the GPU measured 0.58% on 300 tokens), above a single GEMM's bar.
FFN_REL_BOUND = 1e-2


def assert_fp8_close(out: torch.Tensor, ref: torch.Tensor, name: str = "out") -> None:
    """out within REL_BOUND[out.dtype] of ref (Frobenius) and no element off by more than
    2% of ref's largest magnitude; NaN anywhere (a poisoned output never written) fails."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    if out.numel() == 0:
        return
    bad = ~torch.isfinite(out.detach().double().cpu())
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} non-finite values"
    e = fp8_errors(out, ref)
    bound = REL_BOUND.get(out.dtype, 5e-4)
    assert e["rel"] <= bound, f"{name}: relative error {e['rel']:.3g} > {bound:g} ({e})"
    assert e["max_rel"] <= 2e-2, f"{name}: max error {e['max_rel']:.3g} of max|ref| ({e})"


def moe_fp8_reference(layer, hidden_states: torch.Tensor) -> torch.Tensor:
    """What an FP8 MoE layer computes, in fp64 where the layer accumulates: the layer's own
    routing; per slot, the token quantized as the layer quantizes it (1x128 groups for block
    scales, per token otherwise) and multiplied by its expert's dequantized weights; the
    intermediate rounded to the compute dtype, gated, quantized again, through the down
    weights; the slots summed with their weights; plus the layer's shared expert."""
    from moe_gemm.layers.experts import gated, resolve_activation
    from moe_gemm.ops.quantize import dequantize_fp8

    H = layer.hidden_size
    x = hidden_states.reshape(-1, H)
    dt = x.dtype
    weights, ids = layer.route(x)
    g = layer.fp8
    fp8 = layer.gate_up_proj.dtype

    def fake_quant(v: torch.Tensor) -> torch.Tensor:
        if g == "block":
            q, s = quantize_fp8_per_token_group(v, dtype=fp8)
            return dequantize_fp8(q, s, "group").double()
        q, s = quantize_fp8_per_row(v, dtype=fp8)
        return dequantize_fp8(q, s, "row").double()

    def weight(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return dequantize_fp8(q, s, "block" if g == "block" else "row").double()

    gate_fn = gated(resolve_activation(layer.activation))
    xq = fake_quant(x)
    out = torch.zeros(x.shape[0], H, dtype=torch.float64, device=x.device)
    for e in range(layer.num_experts):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        if t.numel() == 0:
            continue
        w1 = weight(layer.gate_up_proj[e], layer.gate_up_proj_scale_inv[e])  # (2I, H)
        w2 = weight(layer.down_proj[e], layer.down_proj_scale_inv[e])  # (H, I)
        h = (xq[t] @ w1.t()).to(dt)
        a = gate_fn(h)
        y = (fake_quant(a) @ w2.t()).to(dt)
        out.index_add_(0, t, y.double() * weights[t, j].to(dt).double()[:, None])
    if layer.shared_experts is not None:
        xs = x.to(layer.shared_experts.gate_proj.weight.dtype)
        shared = layer.shared_experts(xs)
        if layer.shared_expert_gate is not None:
            shared = torch.sigmoid(layer.shared_expert_gate(xs)) * shared
        out += shared.double()
    return out.view(*hidden_states.shape[:-1], H)


class LargestFloat32:
    """A context manager recording the largest float32 tensor (in values) that torch ops
    make while it is open: the fp32 working set of a quantizer, for tests that bound it."""

    largest = 0

    def __enter__(self) -> LargestFloat32:
        from torch.utils._python_dispatch import TorchDispatchMode

        owner = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                        owner.largest = max(owner.largest, t.numel())
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
