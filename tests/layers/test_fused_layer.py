"""The MoE layer on the fused expert path, on the CPU (the fused ops' torch backend; the GPU
file runs the kernels): the same routing and results as the unfused path and as transformers'
blocks, expert-parallel sentinels, the transformers integration's gates (GPT-OSS's clamped
SwiGLU over alternating columns with biases), torch.compile(fullgraph=True), and when the
fused path is taken."""

from __future__ import annotations

import pytest
import torch
from moe_testutils import naive_moe, randomize, rel_err

from moe_gemm import GemmConfig, MoE
from moe_gemm.layers import fused_experts
from moe_gemm.layers.experts import expert_ffn, gated, moe_experts, resolve_activation
from moe_gemm.layers.fused_experts import FusedGate, fused_gate_for, use_fused

LAYERS = [
    dict(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2),
    dict(hidden_size=48, intermediate_size=24, num_experts=6, top_k=6, activation="gelu"),
    dict(hidden_size=64, intermediate_size=24, num_experts=16, top_k=4, scoring="sigmoid",
         n_group=4, topk_group=2, routed_scaling_factor=2.5, shared_intermediate_size=32,
         shared_expert_gate=True, activation="gelu_tanh"),
    dict(hidden_size=40, intermediate_size=8, num_experts=4, top_k=1, renormalize=False,
         activation="swish"),
]


@pytest.mark.parametrize("kwargs", LAYERS, ids=["mixtral", "topk=E-gelu", "deepseek", "top1"])
def test_fused_layer_matches_unfused_and_float64(kwargs):
    torch.manual_seed(0)
    moe = randomize(MoE(**kwargs, fused=True))
    for shape in [(1, 1), (3, 17), (64,)]:
        x = torch.randn(*shape, moe.hidden_size)
        with torch.no_grad():
            y = moe(x)
            moe.fused = False
            base = moe(x)
            moe.fused = True
        ref = naive_moe(moe, x)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert rel_err(y, ref) < 1e-5 and rel_err(y, base) < 1e-5


def test_fused_layer_bf16_close_to_float64():
    torch.manual_seed(1)
    moe = randomize(MoE(64, 32, 8, 2, fused=True)).to(torch.bfloat16)
    x = torch.randn(40, 64).to(torch.bfloat16)
    with torch.no_grad():
        y = moe(x)
        moe.fused = False
        base = moe(x)
    ref = naive_moe(moe, x)
    err, base_err = (y.double() - ref).abs().max(), (base.double() - ref).abs().max()
    assert err <= 2 * base_err + 1e-3 * ref.abs().max()


def test_expert_parallel_sentinels_contribute_nothing():
    torch.manual_seed(2)
    E, H, I, T = 6, 32, 16, 9
    x = torch.randn(T, H)
    w1, w2 = torch.randn(E, H, 2 * I) / 6, torch.randn(E, I, H) / 4
    ids = torch.randint(0, E, (T, 3))
    ids[::2, 1] = E + 3  # another rank's expert
    ids[1, 0] = -1
    weights = torch.rand(T, 3)
    y = moe_experts(x, ids, weights, w1, w2, fused=True)
    keep = (ids >= 0) & (ids < E)
    ref = moe_experts(x, torch.where(keep, ids, 0), torch.where(keep, weights, 0), w1, w2,
                      fused=False)
    assert rel_err(y, ref) < 1e-5


def test_fused_bias_and_alternating_clamped_gate_match_unfused():
    torch.manual_seed(3)
    E, H, I, T, k = 5, 32, 24, 11, 2
    x = torch.randn(T, H)
    w1, w2 = torch.randn(E, H, 2 * I) / 4, torch.randn(E, I, H) / 4
    b1, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k)

    def gate_fn(h):  # GPT-OSS's _apply_gate
        gate, up = h[..., ::2].clamp(max=7.0), h[..., 1::2].clamp(-7.0, 7.0)
        return (up + 1) * gate * torch.sigmoid(gate * 1.702)

    spec = FusedGate("clamped_swiglu", "alternating", 1.702, 7.0)
    y = expert_ffn(x, ids, weights, w1, w2, gate_fn, bias_gate_up=b1, bias_down=b2,
                   fused_gate=spec, fused=True)
    ref = expert_ffn(x, ids, weights, w1, w2, gate_fn, bias_gate_up=b1, bias_down=b2,
                     fused=False)
    assert rel_err(y, ref) < 1e-5


def test_when_the_fused_path_is_taken():
    x = torch.randn(4, 32)
    w1, w2 = torch.randn(3, 32, 48), torch.randn(3, 24, 32)
    silu = fused_gate_for("silu")
    assert silu == FusedGate("silu", "concat")
    assert fused_gate_for(torch.tanh) is None and fused_gate_for("relu") is None
    assert not use_fused(None, silu, x, w1, w2, None)  # the CPU: no kernel
    assert use_fused(True, silu, x, w1, w2, None)
    assert not use_fused(False, silu, x, w1, w2, None)
    assert not use_fused(True, None, x, w1, w2, None)  # a callable activation
    assert not use_fused(True, silu, x, w1, w2, None, post_fn=torch.nn.Identity())
    assert not use_fused(None, silu, x, w1, w2, GemmConfig(backend="torch"))


def test_kernel_fit_rules(monkeypatch):
    """The static checks behind fused=None on a GPU, on CPU tensors (the device check is
    replaced: the kernel counts as runnable)."""
    import moe_gemm.capability

    monkeypatch.setattr(moe_gemm.capability, "cute_problem", lambda device=None: None)

    class Cuda:
        type = "cuda"

        def __str__(self):
            return "cuda:0"

    class X:
        def __init__(self, dtype):
            self.device, self.dtype = Cuda(), dtype

    bf16 = X(torch.bfloat16)
    k_major = torch.empty(3, 48, 32).transpose(1, 2)  # (E, H=32, 2I=48), K contiguous
    n_major = torch.empty(3, 32, 48)
    w2 = torch.empty(3, 24, 32)
    silu = fused_gate_for("silu")
    assert use_fused(None, silu, bf16, k_major, w2, None)
    assert not use_fused(None, silu, bf16, n_major, w2, None)  # concat needs K-major
    assert use_fused(None, FusedGate("clamped_swiglu", "alternating"), bf16, n_major, w2, None)
    assert not use_fused(None, silu, X(torch.float32), k_major, w2, None)
    assert not use_fused(None, silu, bf16, torch.empty(3, 48, 36).transpose(1, 2),
                         torch.empty(3, 18, 32), None)  # I = 18: rows not 16-byte multiples
    monkeypatch.setenv(fused_experts.FUSED_ENV, "0")  # the switch off
    assert not use_fused(None, silu, bf16, k_major, w2, None)
    assert use_fused(True, silu, bf16, k_major, w2, None)


def test_gather_switch_gives_the_same_result(monkeypatch):
    torch.manual_seed(5)
    moe = randomize(MoE(32, 16, 8, 2, fused=True))
    x = torch.randn(7, 32)
    with torch.no_grad():
        y = moe(x)
        monkeypatch.setenv(fused_experts.GATHER_ENV, "0")
        calls = []
        real = fused_experts.fused_grouped_mm
        monkeypatch.setattr(fused_experts, "fused_grouped_mm",
                            lambda *a, **kw: calls.append(kw.get("row_index")) or real(*a, **kw))
        y2 = moe(x)
    assert calls and all(index is None for index in calls)  # no gather in the kernel
    assert torch.allclose(y, y2, atol=1e-6)


def test_fused_layer_validates_its_switch():
    with pytest.raises(TypeError, match="fused must be a bool or None"):
        MoE(16, 8, 4, 2, fused="yes")  # type: ignore[arg-type]


def test_fused_backward_raises():
    moe = MoE(16, 8, 4, 2, fused=True)
    moe.requires_grad_(True)
    y = moe(torch.randn(3, 16, requires_grad=True))
    with pytest.raises(RuntimeError, match="inference"):
        y.sum().backward()


@pytest.fixture
def dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_fused_layer_compiles_whole(dynamo):
    torch.manual_seed(4)
    moe = randomize(MoE(32, 16, 8, 2, fused=True)).eval()
    x = torch.randn(5, 32)
    compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        y = compiled(x)
        ref = moe(x)
    assert rel_err(y, ref) < 1e-6
    assert not dynamo["graph_break"]


def test_gated_and_callable_activations_agree():
    act = resolve_activation("gelu_tanh")
    h = torch.randn(5, 16)
    ref = gated(act)(h)
    from moe_gemm.ops.fused_reference import gate_torch, split_gate_up

    g, u = split_gate_up(h, "concat")
    assert torch.allclose(gate_torch("gelu_tanh", g, u, 0.0, 0.0), ref)


def test_a_swap_pin_runs_on_both_paths():
    """swap_ab=True: the unfused experts take it, and so do the fused ones over the layer's
    concat gate-up weights, with the same results either way."""
    torch.manual_seed(6)
    moe = randomize(MoE(32, 16, 8, 2, fused=True, config=GemmConfig(swap_ab=True)))
    x = torch.randn(9, 32)
    with torch.no_grad():
        y = moe(x)
        moe.fused = False
        base = moe(x)
    assert rel_err(y, naive_moe(moe, x)) < 1e-5 and rel_err(y, base) < 1e-5
