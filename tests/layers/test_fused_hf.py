"""The fused expert path against transformers 5 on the CPU (the fused ops' torch backend):
MoE.from_hf layers with fused=True against the blocks, and the "moe_gemm" experts
implementation with the fused path forced, including GPT-OSS's clamped SwiGLU with biases over
alternating columns. Skipped without transformers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5 (ExpertsInterface)", allow_module_level=True)

from test_moe_hf import BLOCKS, _block, _experts_pair, _randomize, rel_err  # noqa: E402
from transformers import GptOssConfig, MixtralConfig  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # noqa: E402

from moe_gemm.integrations import register_transformers  # noqa: E402
from moe_gemm.integrations.transformers import hf_fused_gate  # noqa: E402
from moe_gemm.layers.fused_experts import FusedGate  # noqa: E402
from moe_gemm.layers.moe import MoE  # noqa: E402


@pytest.mark.parametrize("cls,make_config", BLOCKS)
def test_fused_from_hf_matches_block_fp32(cls: type, make_config) -> None:
    block = _block(cls, make_config(), seed=11)
    moe = MoE.from_hf(block)
    moe.fused = True
    for shape in [(2, 7), (1, 1)]:
        x = torch.randn(*shape, block.experts.hidden_dim)
        with torch.no_grad():
            assert rel_err(moe(x), block(x)) < 1e-5, f"shape {shape}"


def test_gpt_oss_gate_is_recognised_and_fused() -> None:
    register_transformers()
    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                          num_experts_per_tok=2, swiglu_limit=3.0)
    experts = _randomize(GptOssExperts(config), seed=12, scale=0.6)
    assert hf_fused_gate(experts) == FusedGate("clamped_swiglu", "alternating",
                                               float(experts.alpha), 3.0)
    experts.moe_gemm_fused = True
    x = torch.randn(13, 32)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(13)])
    out, ref = _experts_pair(experts, x, ids, torch.rand(13, 2))
    assert rel_err(out, ref) < 1e-5
    # Values past the clamp limit reach the gate: the clamp is exercised.
    with torch.no_grad():
        h = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert float(h.abs().max()) > 3.0


def test_default_gate_experts_fused() -> None:
    register_transformers()
    config = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2, hidden_act="gelu")
    experts = _randomize(MixtralExperts(config), seed=13)
    assert hf_fused_gate(experts) == FusedGate("gelu", "concat")
    experts.moe_gemm_fused = True
    x = torch.randn(9, 32)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    out, ref = _experts_pair(experts, x, ids, torch.rand(9, 2))
    assert rel_err(out, ref) < 1e-5


def test_unknown_gate_stays_unfused() -> None:
    class Custom(GptOssExperts):
        def _apply_gate(self, gate_up):
            return torch.tanh(gate_up[..., ::2]) * gate_up[..., 1::2]

    config = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4,
                          num_experts_per_tok=2)
    assert hf_fused_gate(Custom(config)) is None


def _limit_experts(model: str, config: str, experts: str, seed: int, **kw):
    """An experts module of a swiglu_limit model (skipped where this transformers lacks it)."""
    import importlib

    try:
        cfg_mod = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
        mod = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    except ImportError:
        pytest.skip(f"this transformers has no {model}")
    cfg = getattr(cfg_mod, config)(**kw)
    cfg._experts_implementation = "eager"
    return _randomize(getattr(mod, experts)(cfg), seed=seed, scale=0.6)


# (model, config class, experts class, the limit's config key, the fused gate's kind)
LIMIT_GATES = [
    pytest.param("deepseek_v4", "DeepseekV4Config", "DeepseekV4Experts", "clamped_silu",
                 dict(intermediate_size=24), id="deepseek-v4"),
    pytest.param("glm5_next", "Glm5NextTextConfig", "Glm5NextTextExperts", "clamped_silu",
                 dict(moe_intermediate_size=24), id="glm5-next"),
    pytest.param("hy_v4", "HYV4Config", "HYV4Experts", "clamped_silu",
                 dict(moe_intermediate_size=24), id="hy-v4"),
    pytest.param("hy_v4_vl", "HYV4VLTextConfig", "HYV4VLExperts", "clamped_silu",
                 dict(moe_intermediate_size=24), id="hy-v4-vl"),
    pytest.param("minimax_m3_vl", "MiniMaxM3VLTextConfig", "MiniMaxM3VLExperts",
                 "clamped_swiglu", dict(intermediate_size=24, swiglu_alpha=1.5),
                 id="minimax-m3-vl"),
]


@pytest.mark.parametrize("model,config,experts_cls,kind,sizes", LIMIT_GATES)
def test_swiglu_limit_gates_are_recognised_and_fused(model, config, experts_cls, kind,
                                                      sizes) -> None:
    # The clamps of these experts' own _apply_gate, as the fused kernel's gate: the fused
    # path (forced, the torch backend here) against transformers' grouped_mm experts, with
    # values past the limit reaching the gate.
    register_transformers()
    experts = _limit_experts(model, config, experts_cls, 31, hidden_size=32,
                             num_local_experts=8, num_experts_per_tok=2, swiglu_limit=2.0,
                             **sizes)
    gate = hf_fused_gate(experts)
    assert gate is not None and (gate.gate, gate.layout, gate.limit) == (kind, "concat", 2.0)
    if kind == "clamped_swiglu":
        assert gate.alpha == 1.5
    x = torch.randn(13, 32)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(13)])
    w = torch.rand(13, 2)
    for fused in (True, False):
        experts.moe_gemm_fused = fused
        out, ref = _experts_pair(experts, x, ids, w)
        assert rel_err(out, ref) < 1e-5, f"fused={fused}"
    with torch.no_grad():
        h = x @ experts.gate_up_proj[0].t()
    assert float(h.abs().max()) > 2.0  # the clamp is exercised
    # Without the clamp's limit (the unclamped gate would differ): the fused path must not
    # take the clamped gate for it.
    experts.moe_gemm_fused = True
    attr = "limit" if model == "deepseek_v4" else "swiglu_limit"
    setattr(experts, attr, 50.0)
    assert hf_fused_gate(experts).limit == 50.0
    out, ref = _experts_pair(experts, x, ids, w)
    assert rel_err(out, ref) < 1e-5


def test_swiglu_limit_gate_without_a_limit_or_overridden_stays_unfused() -> None:
    experts = _limit_experts("deepseek_v4", "DeepseekV4Config", "DeepseekV4Experts", 32,
                             hidden_size=32, intermediate_size=24, num_local_experts=4,
                             num_experts_per_tok=2, swiglu_limit=2.0)
    assert hf_fused_gate(experts) == FusedGate("clamped_silu", "concat", 0.0, 2.0)
    for bad in (None, 0.0, -1.0, float("inf"), True):
        experts.limit = bad
        assert hf_fused_gate(experts) is None, bad
    experts.limit = 2.0

    class Custom(type(experts)):
        def _apply_gate(self, gate_up):
            return torch.tanh(gate_up[..., :24]) * gate_up[..., 24:]

    experts.__class__ = Custom
    assert hf_fused_gate(experts) is None


def test_post_activation_clamp_is_not_taken_for_a_fused_gate() -> None:
    # Step-3.7 clamps act(gate), not gate: another function than clamped_silu, which its
    # experts keep (the module's own gate on the unfused path).
    register_transformers()
    try:
        from transformers.models.step3p7 import configuration_step3p7, modeling_step3p7
    except ImportError:
        pytest.skip("this transformers has no step3p7")
    cfg = configuration_step3p7.Step3p7TextConfig(
        hidden_size=32, moe_intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=1, swiglu_limits=[0.5])
    cfg._experts_implementation = "eager"
    experts = _randomize(modeling_step3p7.Step3p7Experts(cfg, 0), seed=33, scale=0.6)
    assert experts.limit == 0.5 and hf_fused_gate(experts) is None
    x = torch.randn(9, 32)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
    out, ref = _experts_pair(experts, x, ids, torch.rand(9, 2))
    assert rel_err(out, ref) < 1e-5
    # a layer without a limit (0 in swiglu_limits) gates as act_fn(gate) * up: fused
    experts.limit = None
    assert hf_fused_gate(experts) == FusedGate("silu", "concat")
    out, ref = _experts_pair(experts, x, ids, torch.rand(9, 2))
    assert rel_err(out, ref) < 1e-5
