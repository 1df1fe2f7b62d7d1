"""Helpers of the MoE layer tests: float64 per-token references and random weights."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moe_gemm.layers.moe import MoE

ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}
ACTS["swish"] = ACTS["silu"]


def naive_experts(
    x: torch.Tensor,  # (T, H)
    ids: torch.Tensor,  # (T, k)
    weights: torch.Tensor,  # (T, k)
    gate_up_proj: torch.Tensor,  # (E, 2I, H), transformers layout
    down_proj: torch.Tensor,  # (E, H, I)
    act=F.silu,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """One token, one slot at a time, in `dtype`; ids outside [0, E) contribute nothing."""
    E, two_i, _ = gate_up_proj.shape
    I = two_i // 2
    out = torch.zeros(x.shape, dtype=dtype)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            v = x[t].to(dtype)
            gate = gate_up_proj[e, :I].to(dtype) @ v
            up = gate_up_proj[e, I:].to(dtype) @ v
            out[t] += weights[t, j].to(dtype) * (down_proj[e].to(dtype) @ (act(gate) * up))
    return out


def naive_moe(moe: MoE, x: torch.Tensor, act=None) -> torch.Tensor:
    """The whole layer in float64 from its own routing decision (`act`: the activation as a
    float64 function, where the layer's own is a module with float32 parameters)."""
    x2 = x.reshape(-1, moe.hidden_size)
    weights, ids = moe.route(x2)
    if act is None:
        act = ACTS[moe.activation] if isinstance(moe.activation, str) else moe.activation
    y = naive_experts(x2, ids, weights, moe.gate_up_proj, moe.down_proj, act)
    if moe.shared_experts is not None:
        s = moe.shared_experts
        v = x2.double()
        h = s.down_proj.weight.double() @ (
            act(v @ s.gate_proj.weight.double().T) * (v @ s.up_proj.weight.double().T)
        ).T
        h = h.T
        if moe.shared_expert_gate is not None:
            h = torch.sigmoid(v @ moe.shared_expert_gate.weight.double().T) * h
        y = y + h
    return y.view(*x.shape[:-1], moe.hidden_size)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def randomize(moe: MoE, scale: float = 0.3) -> MoE:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.copy_(torch.randn(moe.num_experts, generator=g) * 0.2)
    return moe


def near_tie_sigmoid_moe(hidden: int, intermediate: int) -> MoE:
    """A DeepSeek-style layer (64 experts, top-8 in 4 of 8 groups) whose router weights are
    bf16 values and whose correction bias is near 1 (so its rounding to bf16 would change
    the chosen experts): the case for checking that casts keep the bias float32. Seeded from
    torch's generator, fresh per call."""
    torch.manual_seed(int(torch.randint(1 << 30, ())))
    moe = MoE(hidden, intermediate, 64, 8, scoring="sigmoid", n_group=8, topk_group=4)
    with torch.no_grad():
        moe.router_weight.copy_(moe.router_weight.bfloat16().float())
        moe.e_score_correction_bias.copy_(1 + 0.05 * torch.rand(64))
    return moe
