"""layers/experts_fp8.py: the checks of FP8 expert weights against each other and their
scales, on the CPU."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.layers.experts import gated, resolve_activation
from moe_gemm.layers.experts_fp8 import check_fp8_experts, expert_ffn_fp8, quantize_experts
from moe_gemm.ops.quantize import dequantize_fp8, quantize_fp8_per_token_group

E, H, I = 3, 256, 128


@pytest.mark.parametrize("granularity", ["block", "row"])
def test_a_down_projection_that_does_not_fit_gate_up_is_refused_by_the_check(granularity):
    """The scale shapes are derived from gate_up's: a down projection of another intermediate
    size whose scale still has the derived shape (row-wise (E, H); block-wise the same
    ceil(I/128)) is refused by the check, naming the (E, H, I) it must be, not later inside
    the second GEMM with a message about that op's operands."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(E, H, I, generator=g) / I ** 0.5
    q1, s1, q2, s2 = quantize_experts(gate_up, down, granularity)
    assert check_fp8_experts(q1, q2, s1, s2) == granularity
    short = q2[..., :I - 16]  # (E, H, 112): same block count along I, row scale (E, H) too
    _, _, _, s_short = quantize_experts(gate_up, down[..., :I - 16].contiguous(), granularity)
    assert s_short.shape == s2.shape
    with pytest.raises(ValueError, match=rf"down weights must be \(E, H, I\) = \({E}, {H}, {I}\)"):
        check_fp8_experts(q1, short, s1, s_short)
    with pytest.raises(ValueError, match=r"gate_up weights must be \(E, 2I, H\)"):
        check_fp8_experts(q1[0], q2[0], s1[0], s2[0])
    with pytest.raises(ValueError, match=r"gate_up weights must be \(E, 2I, H\)"):
        check_fp8_experts(q1[:, 1:], q2, s1, s2)

    # The checked pair computes the experts: against the fp64 product of the dequantized
    # weights on the layer's own quantized tokens (block scales here).
    if granularity != "block":
        return
    T, k = 10, 2
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, k), generator=g)
    w = torch.rand(T, k, generator=g)
    gate_fn = gated(resolve_activation("silu"))
    y = expert_ffn_fp8(x, ids, w, q1, s1, q2, s2, gate_fn)

    def fq(v):
        q, s = quantize_fp8_per_token_group(v)
        return dequantize_fp8(q, s, "group").double()

    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            h = (fq(x[t:t + 1]) @ dequantize_fp8(q1[e], s1[e], "block").double().t()).float()
            a = gate_fn(h)
            ref[t] += w[t, j].double() * (fq(a) @ dequantize_fp8(q2[e], s2[e], "block")
                                          .double().t())[0]
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < 1e-2, err

