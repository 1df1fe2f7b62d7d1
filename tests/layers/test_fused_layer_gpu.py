"""The MoE layer on the fused expert kernel on an sm90 GPU: against the unfused layer (cute
grouped_mm) and an fp32 reference on the same routing (the 2x rule, the unfused layer as the
low-precision baseline), transformers' blocks and GPT-OSS's experts (clamped SwiGLU, biases,
alternating columns), no host sync, CUDA-graph replay with new routing, torch.compile, and the
MOE_GEMM_FUSED=0 switch. (tests/layers/test_moe_gpu.py runs the layer's default, now the
fused path, against the torch backend too.)"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from moe_gemm import GemmConfig
from moe_gemm.layers import fused_experts
from moe_gemm.layers.experts import moe_experts
from moe_gemm.layers.fused_experts import fused_gate_for, use_fused
from moe_gemm.layers.gate_activations import ClampedSiLU, ClampedSwiGLU
from moe_gemm.layers.moe import MoE
from moe_gemm.testing import assert_close_to_ref, calc_diff

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
CUTE = GemmConfig(backend="cute")


def _moe(H, I, E, k, seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(H, I, E, k, device=DEVICE, dtype=torch.bfloat16, config=CUTE, **kw)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.normal_(0, 0.1)
    return moe


def _x(T, H, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(DEVICE, torch.bfloat16)


@contextlib.contextmanager
def no_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """fp32 experts (and shared experts) on the layer's own routing and bf16 weights."""
    w, ids = moe.route(x)
    ref = moe_experts(x.float(), ids, w, moe.w_gate_up.float(), moe.w_down.float(),
                      activation=moe.activation, config=GemmConfig(backend="torch"),
                      fused=False)
    if moe.shared_experts is not None:
        s = copy.deepcopy(moe.shared_experts).float()  # (a copy: the layer stays bf16)
        shared = s(x.float())
        if moe.shared_expert_gate is not None:
            shared = torch.sigmoid(x.float() @ moe.shared_expert_gate.weight.float().T) * shared
        ref = ref + shared
    return ref


# T, H, I, E, k, extra (the layer's model-like shapes: ragged experts, decode, shared experts)
SHAPES = [
    (1, 512, 256, 8, 2, {}),
    (300, 1024, 512, 8, 2, {}),  # Mixtral-like
    (257, 512, 128, 64, 8, {"renormalize": True}),  # Qwen3-like
    (5, 512, 256, 256, 8, {}),  # decode over many experts
    (513, 1024, 384, 32, 8, {"scoring": "sigmoid", "n_group": 8, "topk_group": 4,
                              "routed_scaling_factor": 2.5, "shared_intermediate_size": 384}),
    (96, 768, 256, 16, 4, {"activation": "gelu_tanh", "shared_intermediate_size": 256,
                           "shared_expert_gate": True}),
    (64, 512, 200, 8, 2, {"activation": "gelu"}),  # I off every tile
    # DeepSeek-V4-like: sqrt(softplus) scores, a swiglu_limit gate (reached: gate ~ N(0, 1))
    (200, 512, 256, 16, 4, {"scoring": "sqrtsoftplus", "routed_scaling_factor": 1.5,
                            "activation": ClampedSiLU(1.0), "shared_intermediate_size": 256}),
    # MiniMax-M3-like: gpt-oss's clamped SwiGLU over concatenated halves
    (150, 512, 192, 16, 4, {"scoring": "sigmoid", "routed_scaling_factor": 2.0,
                            "activation": ClampedSwiGLU(1.0, 1.702),
                            "shared_intermediate_size": 128}),
]


@pytest.mark.parametrize("T,H,I,E,k,extra", SHAPES)
def test_fused_layer_against_unfused_and_fp32(T, H, I, E, k, extra):
    moe = _moe(H, I, E, k, **extra)
    x = _x(T, H, seed=T)
    spec = fused_gate_for(moe.activation)
    assert use_fused(None, spec, x, moe.w_gate_up, moe.w_down, CUTE), "the fused path"
    with torch.inference_mode():
        y = moe(x)
        moe.fused = False
        base = moe(x)
        moe.fused = None
        ref = _reference(moe, x)
    assert y.dtype == torch.bfloat16 and y.shape == (T, H)
    scale = float(ref.abs().max())
    assert_close_to_ref(y, ref, base, atol=1e-3 * scale,
                        max_calc_diff=max(1e-5, 2 * calc_diff(base, ref)),
                        name=f"fused MoE T={T} E={E} k={k}")


def test_forward_never_syncs_and_graph_replays_route_anew():
    T, H = 96, 512
    moe = _moe(H, 256, 32, 4, shared_intermediate_size=128, fused=True)
    static_x = _x(T, H, 10)
    with torch.inference_mode():
        moe(static_x)
        xs = [_x(n, H, 20 + n) for n in (1, 100, 257)]
        torch.cuda.synchronize()
        with no_sync():
            ys = [moe(x) for x in xs]
        torch.cuda.synchronize()
        assert all(bool(torch.isfinite(y).all()) for y in ys)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        routes = []
        for trial in range(3):
            x = _x(T, H, 100 + trial) * (1 + trial)
            static_x.copy_(x)
            graph.replay()
            eager = moe(x)
            torch.cuda.synchronize()
            assert torch.equal(static_y, eager), f"replay {trial} differs from eager"
            routes.append(moe.route(x)[1])
    assert not torch.equal(routes[0], routes[1])


def test_fused_layer_is_deterministic():
    moe = _moe(1024, 256, 64, 8, fused=True)
    x = _x(400, 1024, 5)
    with torch.inference_mode():
        first = moe(x)
        again = [moe(x) for _ in range(3)]
    assert all(torch.equal(first, y) for y in again)


def test_compiled_layer_matches_eager():
    import torch._dynamo

    torch._dynamo.reset()
    moe = _moe(512, 256, 16, 4, fused=None).eval()
    x = _x(77, 512, 6)
    compiled = torch.compile(moe, fullgraph=True)
    with torch.inference_mode():
        y = compiled(x)
        ref = moe(x)
    torch._dynamo.reset()
    # (inductor may fuse the router's fp32 math differently: equal up to bf16 rounding)
    torch.testing.assert_close(y, ref, atol=3e-2, rtol=3e-2)


def test_switch_off_runs_the_unfused_path(monkeypatch):
    moe = _moe(512, 256, 8, 2)
    x = _x(20, 512, 7)

    def refuse(*args, **kwargs):
        raise AssertionError("the fused path ran with MOE_GEMM_FUSED=0")

    monkeypatch.setenv(fused_experts.FUSED_ENV, "0")
    monkeypatch.setattr("moe_gemm.layers.experts.fused_expert_ffn", refuse)
    with torch.inference_mode():
        y = moe(x)
    assert bool(torch.isfinite(y).all())


def _hf():
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers >= 5")
    return transformers


@pytest.mark.parametrize("model", ["mixtral", "qwen3", "deepseek"])
def test_from_hf_fused_matches_transformers(model):
    _hf()
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls, cfg = {
        "mixtral": (MixtralSparseMoeBlock, MixtralConfig(
            hidden_size=1024, intermediate_size=512, num_local_experts=8,
            num_experts_per_tok=2)),
        "qwen3": (Qwen3MoeSparseMoeBlock, Qwen3MoeConfig(
            hidden_size=512, moe_intermediate_size=128, num_experts=64, num_experts_per_tok=8,
            norm_topk_prob=True)),
        "deepseek": (DeepseekV3MoE, DeepseekV3Config(
            hidden_size=1024, moe_intermediate_size=256, n_routed_experts=64,
            num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
            routed_scaling_factor=2.5)),
    }[model]
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(1)
    block = cls(cfg).to(DEVICE, torch.bfloat16).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
        block32 = cls(cfg).to(DEVICE).eval()
        block32.load_state_dict({k: v.float() for k, v in block.state_dict().items()})
    moe = MoE.from_hf(block, config=CUTE)
    x = _x(300, cfg.hidden_size, 12)
    with torch.inference_mode():
        y = moe(x)
        base = block(x[None])  # transformers' grouped_mm experts in bf16; (batch, seq, H)
        base = (base[0] if isinstance(base, tuple) else base).reshape(x.shape)
        _, w, ids = block.gate(x)
        ref = block32.experts(x.float(), ids, w.float())
        if hasattr(block32, "shared_experts"):
            ref = ref + block32.shared_experts(x.float())
    assert_close_to_ref(y, ref, base, atol=1e-3 * float(ref.abs().max()),
                        max_calc_diff=max(1e-5, 2 * calc_diff(base, ref)),
                        name=f"fused from_hf {model}")


def test_gpt_oss_experts_on_the_fused_kernel():
    _hf()
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from moe_gemm.integrations import register_transformers
    from moe_gemm.integrations.transformers import hf_fused_gate, moe_gemm_experts_forward

    register_transformers()
    cfg = GptOssConfig(hidden_size=512, intermediate_size=256, num_local_experts=32,
                       num_experts_per_tok=4)
    torch.manual_seed(2)
    experts = GptOssExperts(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 3.0 / p.shape[-1] ** 0.5)  # gate-up values past the 7.0 clamp occur
    experts32 = experts
    experts = GptOssExperts(cfg).to(DEVICE, torch.bfloat16).eval()
    experts.load_state_dict({k: v.bfloat16() for k, v in experts32.state_dict().items()})
    # the fp32 reference computes with the bf16-rounded weights
    experts32.load_state_dict({k: v.float() for k, v in experts.state_dict().items()})
    spec = hf_fused_gate(experts)
    assert spec is not None and spec.layout == "alternating"
    T = 200
    x = _x(T, 512, 13)
    ids = torch.stack([torch.randperm(32)[:4] for _ in range(T)]).to(DEVICE)
    w = torch.softmax(torch.randn(T, 4), -1).to(DEVICE)
    assert use_fused(None, spec, x, experts.gate_up_proj, experts.down_proj, None)
    with torch.inference_mode():
        moe_gemm_experts_forward(experts, x, ids, w)  # plans and kernels outside the check
        torch.cuda.synchronize()
        with no_sync():
            y = moe_gemm_experts_forward(experts, x, ids, w)
        torch.cuda.synchronize()
        experts.config._experts_implementation = "grouped_mm"
        base = experts(x, ids, w)
        experts32.config._experts_implementation = "eager"
        ref = experts32(x.float(), ids, w)
        h = x.float() @ experts32.gate_up_proj[0]
    assert float(h.abs().max()) > 7.0, "the test should reach the clamp"
    assert_close_to_ref(y, ref, base, atol=1e-3 * float(ref.abs().max()),
                        max_calc_diff=max(1e-5, 2 * calc_diff(base, ref)),
                        name="fused GPT-OSS experts")
