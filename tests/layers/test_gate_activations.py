"""layers/gate_activations.py: ClampedSiLU (a swiglu_limit's gate of both halves) and
ClampedSwiGLU (gpt-oss's, MiniMax-M3's) on their own and as an MoE layer's activation, against
float64 references written out here."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from moe_testutils import randomize, rel_err

from moe_gemm.layers.fused_experts import FusedGate, fused_gate_for
from moe_gemm.layers.gate_activations import (
    ClampedSiLU,
    ClampedSwiGLU,
    PostClampedSiLU,
    apply_gate,
)
from moe_gemm.layers.moe import MoE, moe_experts
from moe_gemm.layers.routing import softmax_topk


def _clamped_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    g = torch.minimum(gate.double(), torch.tensor(limit, dtype=torch.float64))
    u = torch.maximum(torch.minimum(up.double(), torch.tensor(limit, dtype=torch.float64)),
                      torch.tensor(-limit, dtype=torch.float64))
    return g / (1 + torch.exp(-g)) * u


def test_clamped_silu_matches_float64() -> None:
    gate, up = torch.randn(7, 33) * 4, torch.randn(7, 33) * 4
    act = ClampedSiLU(1.25)
    got = act(gate, up)
    assert float(gate.max()) > 1.25 and float(up.abs().max()) > 1.25  # the clamps are reached
    torch.testing.assert_close(got.double(), _clamped_ref(gate, up, 1.25), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_gate(act, gate, up), got, rtol=0, atol=0)
    # an elementwise activation keeps act(gate) * up
    torch.testing.assert_close(apply_gate(torch.tanh, gate, up), torch.tanh(gate) * up)
    assert repr(act) == "ClampedSiLU(limit=1.25)"
    assert pickle.loads(pickle.dumps(act)).limit == 1.25


@pytest.mark.parametrize("limit,error,match", [
    (0.0, ValueError, "finite float > 0"), (-1.0, ValueError, "finite float > 0"),
    (float("inf"), ValueError, "finite"), (float("nan"), ValueError, "finite"),
    (True, TypeError, "limit must be a float"), ("7", TypeError, "limit must be a float"),
    (None, TypeError, "limit must be a float"),
])
def test_clamped_silu_refuses_bad_limits(limit, error, match) -> None:
    with pytest.raises(error, match=match):
        ClampedSiLU(limit)


def test_clamped_silu_is_never_applied_to_the_gate_alone() -> None:
    # act(gate) * up would leave up unclamped: a TypeError, not a wrong answer
    with pytest.raises(TypeError, match=r"call it as act\(gate, up\)"):
        ClampedSiLU(2.0)(torch.randn(3, 4))


def test_fused_gate_of_a_clamped_silu() -> None:
    assert fused_gate_for(ClampedSiLU(7.0)) == FusedGate("clamped_silu", "concat", 0.0, 7.0)
    assert fused_gate_for(torch.nn.SiLU()) is None  # (a callable: unfused)


def _layer(limit: float, **kw) -> MoE:
    torch.manual_seed(3)
    return randomize(MoE(32, 24, 8, 2, shared_intermediate_size=16,
                         activation=ClampedSiLU(limit), **kw), scale=0.6).eval()


def _layer_ref(moe: MoE, x: torch.Tensor, gate_fn, shared_fn=None) -> torch.Tensor:
    """The layer in float64, token by token, from its own routing: gate_fn(gate, up) the
    experts' gated activation, shared_fn the shared expert's (None: plain SwiGLU)."""
    weights, ids = softmax_topk(x.double() @ moe.router_weight.double().T, 2)
    I = moe.intermediate_size
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        v = x[t].double()
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = moe.gate_up_proj[e].double() @ v
            out[t] += w * (moe.down_proj[e].double() @ gate_fn(h[:I], h[I:]))
        s = moe.shared_experts
        if s is not None:
            g, u = s.gate_proj.weight.double() @ v, s.up_proj.weight.double() @ v
            a = shared_fn(g, u) if shared_fn is not None else torch.nn.functional.silu(g) * u
            out[t] += s.down_proj.weight.double() @ a
    return out


def _reference(moe: MoE, x: torch.Tensor, limit: float, shared_limit: float | None
               ) -> torch.Tensor:
    """_layer_ref with ClampedSiLU's gate (the shared expert's at shared_limit, or none)."""
    return _layer_ref(moe, x, lambda g, u: _clamped_ref(g, u, limit),
                      None if shared_limit is None
                      else lambda g, u: _clamped_ref(g, u, shared_limit))


@pytest.mark.parametrize("fused", [False, True])
def test_layer_with_a_clamped_silu_matches_float64(fused) -> None:
    moe = _layer(1.0, fused=fused)
    x = torch.randn(11, 32)
    with torch.no_grad():
        y = moe(x)
        assert rel_err(y, _reference(moe, x, 1.0, 1.0)) < 1e-5
        # the shared expert follows the layer's activation; set apart, it keeps its own
        moe.shared_experts.activation = "silu"
        assert rel_err(moe(x), _reference(moe, x, 1.0, None)) < 1e-5
        # without the clamps the output is far off: the reference sees them
        moe.activation = "silu"
        assert rel_err(moe(x), _reference(moe, x, 1.0, 1.0)) > 1e-2


def test_layer_with_a_clamped_silu_round_trips_its_state_and_repr() -> None:
    moe = _layer(2.5)
    assert "ClampedSiLU(limit=2.5)" in repr(moe)
    assert not [k for k in moe.state_dict() if "activation" in k]  # no parameters
    back = MoE.from_state_dict(moe.state_dict(), 2, activation=ClampedSiLU(2.5))
    x = torch.randn(5, 32)
    with torch.no_grad():
        torch.testing.assert_close(back(x), moe(x), rtol=0, atol=0)
        clone = pickle.loads(pickle.dumps(moe))
        torch.testing.assert_close(clone(x), moe(x), rtol=0, atol=0)


def test_moe_experts_takes_a_clamped_silu() -> None:
    torch.manual_seed(4)
    E, H, I, T = 4, 16, 8, 9
    x = torch.randn(T, H)
    w_gate_up, w_down = torch.randn(E, H, 2 * I), torch.randn(E, I, H) * 0.3
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    weights = torch.rand(T, 2)
    y = moe_experts(x, ids, weights, w_gate_up, w_down, activation=ClampedSiLU(0.5))
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(2):
            h = x[t].double() @ w_gate_up[ids[t, j]].double()
            want[t] += weights[t, j] * (_clamped_ref(h[:I], h[I:], 0.5)
                                        @ w_down[ids[t, j]].double())
    assert rel_err(y, want) < 1e-5


# ---------------------------------------------------------------------------------------------
# ClampedSwiGLU: (clamp(up, -L, L) + 1) * g * sigmoid(alpha * g), g = min(gate, L)


def _swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float
                ) -> torch.Tensor:
    g = [min(v, limit) for v in gate.double().flatten().tolist()]
    u = [max(min(v, limit), -limit) for v in up.double().flatten().tolist()]
    out = [(b + 1) * a / (1 + math.exp(-alpha * a)) for a, b in zip(g, u)]
    return torch.tensor(out, dtype=torch.float64).view(gate.shape)


@pytest.mark.parametrize("limit,alpha", [(7.0, 1.702), (1.0, 1.702), (0.5, -0.75)])
def test_clamped_swiglu_matches_float64(limit: float, alpha: float) -> None:
    gate, up = torch.randn(6, 29) * 4, torch.randn(6, 29) * 4
    act = ClampedSwiGLU(limit, alpha)
    got = act(gate, up)
    torch.testing.assert_close(got.double(), _swiglu_ref(gate, up, limit, alpha), rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(apply_gate(act, gate, up), got, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"call it as act\(gate, up\)"):
        act(gate)
    assert repr(act) == f"ClampedSwiGLU(limit={limit:g}, alpha={alpha:g})"
    back = pickle.loads(pickle.dumps(act))
    assert (back.limit, back.alpha) == (limit, alpha)
    assert fused_gate_for(act) == FusedGate("clamped_swiglu", "concat", alpha, limit)


@pytest.mark.parametrize("limit,alpha,error,match", [
    (0.0, 1.7, ValueError, "finite float > 0"), (float("inf"), 1.7, ValueError, "finite"),
    ("7", 1.7, TypeError, "limit must be a float"), (7.0, float("nan"), ValueError,
                                                     "alpha must be finite"),
    (7.0, True, TypeError, "alpha must be a float"), (7.0, "1.7", TypeError, "alpha must be"),
])
def test_clamped_swiglu_refuses_bad_settings(limit, alpha, error, match) -> None:
    with pytest.raises(error, match=match):
        ClampedSwiGLU(limit, alpha)


@pytest.mark.parametrize("fused", [False, True])
def test_layer_with_a_clamped_swiglu_matches_float64(fused) -> None:
    torch.manual_seed(5)
    act = ClampedSwiGLU(1.0, 1.702)
    moe = randomize(MoE(32, 24, 8, 2, shared_intermediate_size=16, activation=act,
                        fused=fused), scale=0.6).eval()
    x = torch.randn(9, 32)
    fn = lambda g, u: _swiglu_ref(g, u, 1.0, 1.702)  # noqa: E731
    want = _layer_ref(moe, x, fn, fn)
    with torch.no_grad():
        assert rel_err(moe(x), want) < 1e-5


# ---------------------------------------------------------------------------------------------
# PostClampedSiLU: min(silu(gate), L) * clamp(up, -L, L) (the clamp after the activation)


def _post_clamped_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    g = [min(a / (1 + math.exp(-a)), limit) for a in gate.double().flatten().tolist()]
    u = [max(min(v, limit), -limit) for v in up.double().flatten().tolist()]
    return torch.tensor([a * b for a, b in zip(g, u)], dtype=torch.float64).view(gate.shape)


def test_post_clamped_silu_matches_float64_and_differs_from_clamped_silu() -> None:
    gate, up = torch.randn(5, 31) * 4, torch.randn(5, 31) * 4
    act = PostClampedSiLU(0.5)
    got = act(gate, up)
    torch.testing.assert_close(got.double(), _post_clamped_ref(gate, up, 0.5), rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(apply_gate(act, gate, up), got, rtol=0, atol=0)
    # silu(min(g, L)) is another function: they differ where silu(g) passes L below g = L
    assert not torch.allclose(got, ClampedSiLU(0.5)(gate, up))
    with pytest.raises(TypeError, match=r"call it as act\(gate, up\)"):
        act(gate)
    assert repr(act) == "PostClampedSiLU(limit=0.5)"
    assert fused_gate_for(act) is None  # (the fused kernel has no such gate: unfused)
    with pytest.raises(ValueError, match="finite float > 0"):
        PostClampedSiLU(0.0)


@pytest.mark.parametrize("fused", [None, True])
def test_layer_with_a_post_clamped_silu_runs_unfused_and_matches_float64(fused) -> None:
    torch.manual_seed(6)
    moe = randomize(MoE(32, 24, 8, 2, activation=PostClampedSiLU(0.5), fused=fused),
                    scale=0.6).eval()
    x = torch.randn(9, 32)
    want = _layer_ref(moe, x, lambda g, u: _post_clamped_ref(g, u, 0.5))
    with torch.no_grad():
        assert rel_err(moe(x), want) < 1e-5
