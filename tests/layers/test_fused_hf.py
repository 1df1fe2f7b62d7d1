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
