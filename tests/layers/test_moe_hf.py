"""moe_gemm with transformers 5 on the CPU: MoE.from_hf against the real blocks, and the
"moe_gemm" experts implementation inside transformers models. Skipped without transformers
(CI installs it: pip install "transformers>=5,<6")."""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("needs transformers >= 5 (ExpertsInterface)", allow_module_level=True)

from transformers import (  # noqa: E402
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    MixtralConfig,
    MixtralForCausalLM,
    NemotronHConfig,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
)
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssMLP  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import (  # noqa: E402
    MixtralExperts,
    MixtralSparseMoeBlock,
)
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from moe_gemm.integrations import register_transformers  # noqa: E402
from moe_gemm.integrations import transformers as hf_integration  # noqa: E402
from moe_gemm.layers.gate_activations import ClampedSwiGLU, PostClampedSiLU  # noqa: E402
from moe_gemm.layers.moe import MoE  # noqa: E402
from moe_gemm.testing import assert_close_to_ref, calc_diff  # noqa: E402


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def _randomize(module: torch.nn.Module, seed: int, scale: float = 0.2) -> torch.nn.Module:
    """Random weights (transformers' init leaves several of them empty or zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return module.eval()


def _block(cls: type, config: object, seed: int) -> torch.nn.Module:
    config._experts_implementation = "eager"  # the reference: transformers' per-expert loop
    return _randomize(cls(config), seed)


BLOCKS = [
    pytest.param(
        MixtralSparseMoeBlock,
        lambda: MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8,
                              num_experts_per_tok=2),
        id="mixtral",
    ),
    pytest.param(
        MixtralSparseMoeBlock,
        lambda: MixtralConfig(hidden_size=48, intermediate_size=40, num_local_experts=4,
                              num_experts_per_tok=4, hidden_act="gelu"),
        id="mixtral-topk=E-gelu",
    ),
    pytest.param(
        Qwen2MoeSparseMoeBlock,
        lambda: Qwen2MoeConfig(hidden_size=40, moe_intermediate_size=24,
                               shared_expert_intermediate_size=48, num_experts=12,
                               num_experts_per_tok=3, norm_topk_prob=False),
        id="qwen2-moe",
    ),
    pytest.param(
        Qwen2MoeSparseMoeBlock,
        lambda: Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16,
                               shared_expert_intermediate_size=16, num_experts=4,
                               num_experts_per_tok=1, norm_topk_prob=True),
        id="qwen2-moe-top1-renorm",
    ),
    pytest.param(
        Qwen3MoeSparseMoeBlock,
        lambda: Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=16,
                               num_experts_per_tok=4, norm_topk_prob=True),
        id="qwen3-moe",
    ),
    pytest.param(
        Qwen3MoeSparseMoeBlock,
        lambda: Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=48, num_experts=6,
                               num_experts_per_tok=2, norm_topk_prob=False,
                               hidden_act="gelu_pytorch_tanh"),
        id="qwen3-moe-no-renorm-gelu-tanh",
    ),
    pytest.param(
        DeepseekV3MoE,
        lambda: DeepseekV3Config(hidden_size=64, moe_intermediate_size=16, n_routed_experts=16,
                                 num_experts_per_tok=4, n_group=4, topk_group=2,
                                 n_shared_experts=2, routed_scaling_factor=2.5),
        id="deepseek-v3",
    ),
    pytest.param(
        DeepseekV3MoE,
        lambda: DeepseekV3Config(hidden_size=32, moe_intermediate_size=24, n_routed_experts=8,
                                 num_experts_per_tok=8, n_group=1, topk_group=1,
                                 n_shared_experts=1, routed_scaling_factor=1.0,
                                 norm_topk_prob=False),
        id="deepseek-v3-topk=E-no-renorm",
    ),
    pytest.param(
        Glm4MoeMoE,
        lambda: Glm4MoeConfig(hidden_size=48, moe_intermediate_size=32, n_routed_experts=12,
                              num_experts_per_tok=3, n_group=3, topk_group=2,
                              n_shared_experts=1, routed_scaling_factor=1.8),
        id="glm4-moe",
    ),
]


class _Later:
    """A transformers block class named by module: imported when a test uses it (an older
    transformers 5 without the model skips its cases, not the file)."""

    def __init__(self, model: str, block: str, config: str):
        self.model, self.block, self.config = model, block, config
        self.__name__ = block

    def _module(self, kind: str):
        try:
            return importlib.import_module(f"transformers.models.{self.model}.{kind}_{self.model}")
        except ImportError:
            pytest.skip(f"this transformers has no {self.model}")

    def __call__(self, config):
        return getattr(self._module("modeling"), self.block)(config)

    def make_config(self, **kw):
        return lambda: getattr(self._module("configuration"), self.config)(**kw)


def _later(model: str, block: str, config: str, case: str, **kw):
    later = _Later(model, block, config)
    return pytest.param(later, later.make_config(**kw), id=case)


# Blocks that route as the ones above (HF_BLOCKS), each checked against the block itself.
BLOCKS += [
    _later("olmoe", "OlmoeSparseMoeBlock", "OlmoeConfig", "olmoe-no-renorm", hidden_size=48,
           intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    _later("flex_olmo", "FlexOlmoSparseMoeBlock", "FlexOlmoConfig", "flex-olmo", hidden_size=40,
           intermediate_size=24, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
    _later("minimax", "MiniMaxSparseMoeBlock", "MiniMaxConfig", "minimax", hidden_size=48,
           intermediate_size=32, num_local_experts=6, num_experts_per_tok=2),
    _later("qwen3_next", "Qwen3NextSparseMoeBlock", "Qwen3NextConfig", "qwen3-next",
           hidden_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
           num_experts=10, num_experts_per_tok=3, norm_topk_prob=True),
    _later("qwen3_next", "Qwen3NextSparseMoeBlock", "Qwen3NextConfig", "qwen3-next-no-renorm",
           hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
           num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    # (its router always renormalizes and has no norm_topk_prob)
    _later("qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", "Qwen3_5MoeTextConfig", "qwen3.5-moe",
           hidden_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
           num_experts=10, num_experts_per_tok=3),
    _later("dots1", "Dots1MoE", "Dots1Config", "dots1", hidden_size=64, moe_intermediate_size=16,
           n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
           n_shared_experts=2, routed_scaling_factor=2.5),
    _later("glm4_moe_lite", "Glm4MoeLiteMoE", "Glm4MoeLiteConfig", "glm4-moe-lite",
           hidden_size=48, moe_intermediate_size=32, n_routed_experts=12, num_experts_per_tok=3,
           n_group=3, topk_group=2, n_shared_experts=1, routed_scaling_factor=1.8),
    # (Qwen3-VL-MoE's router always renormalizes: it has no norm_topk_prob)
    _later("qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock", "Qwen3VLMoeTextConfig",
           "qwen3-vl-moe", hidden_size=48, moe_intermediate_size=24, num_experts=10,
           num_experts_per_tok=3),
    _later("qwen3_omni_moe", "Qwen3OmniMoeThinkerTextSparseMoeBlock", "Qwen3OmniMoeTextConfig",
           "qwen3-omni-thinker-no-renorm", hidden_size=48, moe_intermediate_size=24,
           num_experts=10, num_experts_per_tok=3, norm_topk_prob=False),
    _later("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextSparseMoeBlock",
           "Qwen3OmniMoeTalkerTextConfig", "qwen3-omni-talker", hidden_size=48,
           moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=10,
           num_experts_per_tok=3, norm_topk_prob=True),
    _later("qwen4_exp", "Qwen4ExpTextSparseMoeBlock", "Qwen4ExpTextConfig", "qwen4-exp",
           hidden_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
           num_experts=12, num_experts_per_tok=4, norm_topk_prob=False),
    _later("mellum", "MellumSparseMoeBlock", "MellumConfig", "mellum", hidden_size=48,
           moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    _later("deepseek_v32", "DeepseekV32MoE", "DeepseekV32Config", "deepseek-v3.2",
           hidden_size=64, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
           n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5),
    _later("kimi_linear", "KimiLinearMoE", "KimiLinearConfig", "kimi-linear", hidden_size=48,
           moe_intermediate_size=16, num_experts=12, num_experts_per_tok=3, n_group=3,
           topk_group=2, n_shared_experts=1, routed_scaling_factor=2.446),
    _later("dots3_note", "Dots3NoteTextMoE", "Dots3NoteTextConfig", "dots3-note", hidden_size=64,
           moe_intermediate_size=16, shared_experts_intermediate_size=24, n_routed_experts=16,
           num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
           routed_scaling_factor=2.5),
    _later("glm4v_moe", "Glm4vMoeTextMoE", "Glm4vMoeTextConfig", "glm4v-moe-no-renorm",
           hidden_size=48, moe_intermediate_size=32, n_routed_experts=12, num_experts_per_tok=3,
           n_group=3, topk_group=2, n_shared_experts=1, routed_scaling_factor=1.8,
           norm_topk_prob=False),
    _later("glm_moe_dsa", "GlmMoeDsaMoE", "GlmMoeDsaConfig", "glm-moe-dsa", hidden_size=48,
           moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=8, n_group=1,
           topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5),
    _later("mimo_v2_flash", "MiMoV2FlashMoE", "MiMoV2FlashConfig", "mimo-v2-flash-no-shared",
           hidden_size=48, moe_intermediate_size=16, n_routed_experts=12, num_experts_per_tok=3,
           n_group=3, topk_group=2, routed_scaling_factor=1.5),
    _later("lara_mini", "LaraMiniSparseMoeBlock", "LaraMiniConfig", "lara-mini-fp32-router",
           hidden_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
           num_experts=10, num_experts_per_tok=3),
    _later("minimax_m2", "MiniMaxM2SparseMoeBlock", "MiniMaxM2Config", "minimax-m2",
           hidden_size=48, intermediate_size=24, num_local_experts=16, num_experts_per_tok=4),
    _later("minicpm5_moe", "MiniCPM5MoeMoE", "MiniCPM5MoeConfig", "minicpm5-moe",
           hidden_size=48, moe_intermediate_size=16, n_routed_experts=12, num_experts_per_tok=3,
           n_group=3, topk_group=2, n_shared_experts=1, routed_scaling_factor=3.66),
    _later("solar_open", "SolarOpenMoE", "SolarOpenConfig", "solar-open", hidden_size=64,
           moe_intermediate_size=24, n_routed_experts=16, num_experts_per_tok=4, n_group=2,
           topk_group=1, n_shared_experts=1, routed_scaling_factor=1.0),
    # Group-limited top-k over softmax scores, a routed scaling factor ("softmax_grouped")
    _later("mistral4", "Mistral4MoE", "Mistral4Config", "mistral4-no-renorm", hidden_size=64,
           moe_intermediate_size=16, num_local_experts=16, num_experts_per_tok=4, n_group=4,
           topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=False),
    _later("mistral4", "Mistral4MoE", "Mistral4Config", "mistral4-one-group", hidden_size=48,
           moe_intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, n_group=1,
           topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5, norm_topk_prob=True),
    _later("mistral_large4", "MistralLarge4TextMoE", "MistralLarge4TextConfig",
           "mistral-large4-fp32-router", hidden_size=48, moe_intermediate_size=16,
           num_local_experts=12, num_experts_per_tok=3, n_group=3, topk_group=2,
           n_shared_experts=1, routed_scaling_factor=1.5),
    # DeepSeek-V3's router, experts with a swiglu_limit (ClampedSiLU): GLM-5-Next's shared
    # expert clamps too, HY-V4's does not
    _later("glm5_next", "Glm5NextTextMoE", "Glm5NextTextConfig", "glm5-next-clamped",
           hidden_size=48, moe_intermediate_size=16, num_local_experts=12,
           num_experts_per_tok=3, n_group=3, topk_group=2, n_shared_experts=1,
           routed_scaling_factor=1.5, swiglu_limit=1.0),
    _later("hy_v4", "HYV4MoE", "HYV4Config", "hy-v4-clamped", hidden_size=64,
           moe_intermediate_size=16, num_local_experts=16, num_experts_per_tok=4, n_group=4,
           topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, swiglu_limit=1.0,
           norm_topk_prob=False),
    _later("hy_v4_vl", "HYV4VLMoE", "HYV4VLTextConfig", "hy-v4-vl-clamped", hidden_size=48,
           moe_intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, n_group=1,
           topk_group=1, n_shared_experts=1, routed_scaling_factor=1.0, swiglu_limit=1.5),
]


@pytest.mark.parametrize("cls,make_config", BLOCKS)
def test_from_hf_matches_block_fp32(cls: type, make_config) -> None:
    block = _block(cls, make_config(), seed=1)
    moe = MoE.from_hf(block)
    for shape in [(2, 7), (1, 1), (1, 33)]:
        x = torch.randn(*shape, block.experts.hidden_dim)
        with torch.no_grad():
            ref = block(x)
            y = moe(x)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert rel_err(y, ref) < 1e-5, f"shape {shape}"


_MINIMAX_M3 = _Later("minimax_m3_vl", "MiniMaxM3VLSparseMoeBlock", "MiniMaxM3VLTextConfig")


def _minimax_m3_block(seed: int, **kw) -> torch.nn.Module:
    """MiniMax-M3's block: MiniMax-M2's biased sigmoid router (the bias on the router), the
    block's routed_scaling_factor, experts and a fused gate_up_proj shared expert with
    gpt-oss's clamped SwiGLU over concatenated halves (limits low enough to be reached)."""
    cfg = _MINIMAX_M3.make_config(**{
        "hidden_size": 48, "intermediate_size": 24, "num_local_experts": 12,
        "num_experts_per_tok": 3, "shared_intermediate_size": 16, "routed_scaling_factor": 2.0,
        "swiglu_limit": 1.0, "swiglu_alpha": 1.702, **kw})()
    return _block(_MINIMAX_M3, cfg, seed)


def test_from_hf_minimax_m3_matches_block_fp32() -> None:
    block = _minimax_m3_block(seed=int(torch.randint(1 << 30, ())))
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(12) * 0.1)
    moe = MoE.from_hf(block)
    assert isinstance(moe.activation, ClampedSwiGLU)
    assert (moe.activation.limit, moe.activation.alpha) == (1.0, 1.702)
    assert moe.routed_scaling_factor == 2.0 and moe.router_fp32 is False
    # the shared expert's halves are views of the block's one gate_up_proj
    w = block.shared_experts.gate_up_proj.weight
    assert moe.shared_experts.gate_proj.weight.data_ptr() == w.data_ptr()
    assert moe.shared_experts.up_proj.weight.data_ptr() == w[16:].data_ptr()
    for shape in [(2, 7), (1, 1), (1, 33)]:
        x = torch.randn(*shape, 48)
        with torch.no_grad():
            ref = block(x)
            assert rel_err(moe(x), ref) < 1e-5, f"shape {shape}"
            moe.fused = True  # the fused ops' torch backend: the same gate, fused
            assert rel_err(moe(x), ref) < 1e-5, f"shape {shape}, fused"
            moe.fused = None
    block.experts.config._experts_implementation = "grouped_mm"  # transformers' default
    x = torch.randn(3, 11, 48)
    with torch.no_grad():
        assert rel_err(moe(x), block(x)) < 1e-5


def test_from_hf_minimax_m3_bf16_two_x_rule() -> None:
    seed = int(torch.randint(1 << 30, ()))
    block32 = _minimax_m3_block(seed)
    block = _minimax_m3_block(seed).to(torch.bfloat16)
    block.experts.config._experts_implementation = "grouped_mm"
    moe = MoE.from_hf(block)
    x = torch.randn(4, 16, 48).to(torch.bfloat16)
    with torch.no_grad():
        y = moe(x)
        base = block(x)
        flat = x.view(-1, 48)
        _, w16, i16 = block.gate(flat)
        x32 = flat.float()
        ref = (block32.experts(x32, i16, w16.float()) * 2.0 + block32.shared_experts(x32))
        ref = ref.view(x.shape)
    assert_close_to_ref(y, ref, base, max_calc_diff=max(1e-5, 2 * calc_diff(base, ref)),
                        name="MiniMax-M3")


def test_from_hf_minimax_m3_refuses_limits_it_cannot_fuse() -> None:
    block = _minimax_m3_block(seed=1)
    block.shared_experts.swiglu_limit = 0.0
    with pytest.raises(ValueError, match="MiniMaxM3VLDenseMLP's clamped SwiGLU"):
        MoE.from_hf(block)
    block = _minimax_m3_block(seed=1)
    block.experts.swiglu_limit = float("inf")
    with pytest.raises(ValueError, match="MiniMaxM3VLExperts's clamped gate"):
        MoE.from_hf(block)


def _post_clamped_block(model: str, layer: int, seed: int) -> torch.nn.Module:
    """Step-3.7's or Bailing-Hybrid's block at layer 0 (experts clamped after their SiLU at
    0.5, the shared expert at 0.7) or layer 1 (no limits: the plain SwiGLU)."""
    if model == "step3p7":
        later = _Later("step3p7", "Step3p7SparseMoeBlock", "Step3p7TextConfig")
        extra = {"share_expert_dim": 16}
    else:
        later = _Later("bailing_hybrid", "BailingHybridMoE", "BailingHybridConfig")
        extra = {"n_group": 2, "topk_group": 1, "n_shared_experts": 1,
                 "routed_scaling_factor": 2.5}
    cfg = later.make_config(hidden_size=32, moe_intermediate_size=24, num_local_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=2, swiglu_limits=[0.5, 0.0],
                            swiglu_limits_shared=[0.7, 0.0], **extra)()
    cfg._experts_implementation = "eager"
    block = getattr(later._module("modeling"), later.block)(cfg, layer)
    return _randomize(block, seed, scale=0.6)


@pytest.mark.parametrize("model", ["step3p7", "bailing_hybrid"])
@pytest.mark.parametrize("layer", [0, 1], ids=["clamped", "no-limit"])
def test_from_hf_post_activation_clamp_matches_block_fp32(model: str, layer: int) -> None:
    block = _post_clamped_block(model, layer, seed=int(torch.randint(1 << 30, ())))
    moe = MoE.from_hf(block)
    if layer == 0:
        assert isinstance(moe.activation, PostClampedSiLU) and moe.activation.limit == 0.5
        assert moe.shared_experts.activation.limit == 0.7  # (its own limit, set apart)
    else:
        assert moe.activation == "silu" and moe.shared_experts.activation == "silu"
    for shape in [(2, 7), (1, 1), (1, 33)]:
        x = torch.randn(*shape, 32)
        with torch.no_grad():
            ref = block(x)
            y = moe(x)
        assert rel_err(y, ref) < 1e-5, f"shape {shape}"
        if layer == 0:  # the clamps are reached: without them the output is far off
            moe.activation = "silu"
            with torch.no_grad():
                assert rel_err(moe(x), ref) > 1e-3
            moe.activation = PostClampedSiLU(0.5)
            moe.shared_experts.activation = PostClampedSiLU(0.7)


def test_from_hf_post_activation_clamp_refuses_another_activation() -> None:
    block = _post_clamped_block("step3p7", 0, seed=3)
    block.experts.act_fn = torch.nn.Tanh()
    with pytest.raises(ValueError, match="clamp after a SiLU"):
        MoE.from_hf(block)


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's (weights, ids) with each token's slots in expert order (the sets compared;
    the sigmoid routers return torch.topk's unsorted order)."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


def _assert_routes_as_the_block(moe: MoE, block: torch.nn.Module, x: torch.Tensor,
                                rtol: float) -> None:
    """moe.route(x) picks the block router's experts for every token, with its weights (in
    the block's dtype, within rtol)."""
    with torch.no_grad():
        _, w_ref, i_ref = block.gate(x)
        w, i = moe.route(x)
    w, i = _by_expert(w, i)
    w_ref, i_ref = _by_expert(w_ref, i_ref)
    differ = int((i != i_ref).any(-1).sum())
    assert differ == 0, f"{differ} of {x.shape[0]} tokens differ"
    torch.testing.assert_close(w.to(w_ref.dtype), w_ref, rtol=rtol, atol=0)


@pytest.mark.parametrize("cast", ["to_bf16", "half"])
def test_from_hf_cast_keeps_the_correction_bias_float32(cast: str) -> None:
    # transformers loads DeepSeek-V3 / GLM-4-MoE in bf16 with gate.weight and
    # e_score_correction_bias kept in float32 (_keep_in_fp32_modules_strict). Casting our
    # layer must not round the bias: biased sigmoid scores near 1 differ by less than bf16's
    # spacing there, so a bf16 bias chose other experts for 5-16% of the tokens.
    cfg = DeepseekV3Config(hidden_size=64, moe_intermediate_size=16, n_routed_experts=64,
                           num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                           routed_scaling_factor=2.5)
    block = _block(DeepseekV3MoE, cfg, seed=int(torch.randint(1 << 30, ())))
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    with torch.no_grad():
        # a checkpoint's router: bf16 values (lossless in either dtype); its bias: float32
        block.gate.weight.copy_(block.gate.weight.bfloat16().float())
        block.gate.e_score_correction_bias.copy_(1 + 0.05 * torch.rand(64, generator=g))
    block.experts.to(torch.bfloat16)
    block.shared_experts.to(torch.bfloat16)
    moe = MoE.from_hf(block)
    moe = moe.to(torch.bfloat16) if cast == "to_bf16" else moe.half()
    assert moe.e_score_correction_bias.dtype == torch.float32
    x = torch.randn(256, 64, generator=g).to(moe.router_weight.dtype)
    _assert_routes_as_the_block(moe, block, x, rtol=1e-6)


def test_from_hf_routes_as_a_float32_softmax_router_in_bf16() -> None:
    # LaraMini's router computes its logits in float32 from bf16 weights and tokens (Mixtral's
    # and Qwen's in bf16): routed in bf16, near ties pick other experts than the block's.
    later = _Later("lara_mini", "LaraMiniSparseMoeBlock", "LaraMiniConfig")
    cfg = later.make_config(hidden_size=64, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, num_experts=64,
                            num_experts_per_tok=8)()
    block = _block(later, cfg, seed=int(torch.randint(1 << 30, ()))).to(torch.bfloat16)
    moe = MoE.from_hf(block)
    assert moe.router_fp32 is True
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    x = torch.randn(512, 64, generator=g).to(torch.bfloat16)
    _assert_routes_as_the_block(moe, block, x, rtol=0)


@pytest.mark.parametrize("cls,make_config", [BLOCKS[0], BLOCKS[2], BLOCKS[6], *BLOCKS[9:]])
def test_from_hf_also_matches_transformers_grouped_mm(cls: type, make_config) -> None:
    block = _block(cls, make_config(), seed=2)
    moe = MoE.from_hf(block)
    block.experts.config._experts_implementation = "grouped_mm"  # transformers' default
    x = torch.randn(3, 11, block.experts.hidden_dim)
    with torch.no_grad():
        assert rel_err(moe(x), block(x)) < 1e-5


@pytest.mark.parametrize("cls,make_config", [BLOCKS[0], BLOCKS[2], BLOCKS[6], *BLOCKS[9:]])
def test_from_hf_bf16_two_x_rule(cls: type, make_config) -> None:
    block32 = _block(cls, make_config(), seed=3)
    block = _block(cls, make_config(), seed=3).to(torch.bfloat16)
    block.experts.config._experts_implementation = "grouped_mm"
    moe = MoE.from_hf(block)
    x = torch.randn(4, 16, block.experts.hidden_dim).to(torch.bfloat16)
    with torch.no_grad():
        y = moe(x)
        base = block(x)  # transformers in bf16
        # The fp32 reference routes like the bf16 model does, so that a near-tie flipped by
        # bf16 rounding of the router does not count as an arithmetic error.
        # (MiniMax-M2's router takes the block's correction bias)
        bias = getattr(block, "e_score_correction_bias", None)
        _, w_bf16, i_bf16 = block.gate(x.view(-1, x.shape[-1]), *([] if bias is None else [bias]))
        x32 = x.float().view(-1, x.shape[-1])
        ref = block32.experts(x32, i_bf16, w_bf16.float())
        if hasattr(block32, "shared_experts"):
            ref = ref + block32.shared_experts(x32)
        if hasattr(block32, "shared_expert"):
            shared = block32.shared_expert(x32)
            if hasattr(block32, "shared_expert_gate"):  # (LaraMini's is added ungated)
                shared = torch.sigmoid(block32.shared_expert_gate(x32)) * shared
            ref = ref + shared
        ref = ref.view(x.shape)
    assert y.dtype == torch.bfloat16
    assert_close_to_ref(
        y, ref, base, max_calc_diff=max(1e-5, 2 * calc_diff(base, ref)), name=cls.__name__
    )


@pytest.mark.parametrize("act", ["relu", "gelu_new"])
@pytest.mark.parametrize("cls,make_config", [BLOCKS[2], BLOCKS[6]])
def test_from_hf_shared_expert_with_an_activation_we_do_not_name(cls: type, make_config,
                                                                 act: str) -> None:
    # transformers makes a new activation module per ACT2FN lookup: the experts' and the
    # shared expert's are equal, not the same object, and must not be refused as different.
    config = make_config()
    config.hidden_act = act
    block = _block(cls, config, seed=9)
    moe = MoE.from_hf(block)
    x = torch.randn(2, 5, block.experts.hidden_dim)
    with torch.no_grad():
        assert rel_err(moe(x), block(x)) < 1e-5


@pytest.mark.parametrize("cls,make_config", [
    pytest.param(DeepseekV3MoE, lambda: DeepseekV3Config(
        hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, n_shared_experts=0, routed_scaling_factor=2.5),
        id="deepseek-v3-n_shared_experts=0"),
    pytest.param(Qwen2MoeSparseMoeBlock, lambda: Qwen2MoeConfig(
        hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=0,
        num_experts=6, num_experts_per_tok=2), id="qwen2-moe-shared_size=0"),
])
def test_from_hf_zero_width_shared_expert(cls: type, make_config) -> None:
    # transformers builds the shared MLP even at width 0 (it adds zero); from_hf failed on it
    # (an AssertionError for DeepSeek, "shared_expert_gate needs a shared expert" for Qwen2).
    block = _block(cls, make_config(), seed=12)
    moe = MoE.from_hf(block)
    assert moe.shared_experts is None and moe.shared_expert_gate is None
    block64 = copy.deepcopy(block).double()
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        y = moe(x)
        ref = block64(x.double())
        assert rel_err(block(x), ref) < 1e-5  # (the block's own fp32 result)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, ref) < 1e-5


def test_from_hf_shares_the_blocks_weights() -> None:
    block = _block(DeepseekV3MoE, BLOCKS[6].values[1](), seed=4)
    moe = MoE.from_hf(block)
    assert moe.gate_up_proj is block.experts.gate_up_proj
    assert moe.down_proj is block.experts.down_proj
    assert moe.router_weight is block.gate.weight
    assert moe.e_score_correction_bias is block.gate.e_score_correction_bias
    assert moe.shared_experts is not None
    assert moe.shared_experts.down_proj.weight is block.shared_experts.down_proj.weight
    x = torch.randn(5, 64)
    with torch.no_grad():
        block.experts.down_proj.mul_(2.0)  # a change to the block shows in the layer
        assert rel_err(moe(x), block(x)) < 1e-5


def test_from_hf_carries_mixtral_router_jitter() -> None:
    # transformers' MixtralSparseMoeBlock, in training mode with router_jitter_noise > 0,
    # multiplies its input by torch.empty_like(x).uniform_(1 - j, 1 + j) before the router
    # and the experts; from_hf dropped the option. It comes along now, with the block's mode.
    j = 0.25
    config = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8,
                           num_experts_per_tok=2, router_jitter_noise=j)
    block = _block(MixtralSparseMoeBlock, config, seed=int(torch.randint(1 << 30, ())))
    moe = MoE.from_hf(block)  # (an eval-mode block: an eval-mode layer, no jitter)
    assert moe.router_jitter_noise == j and not moe.training
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        clean = moe(x)
        assert rel_err(clean, block(x)) < 1e-5
        block.train()
        moe = MoE.from_hf(block)
        assert moe.training
        seed = int(torch.randint(1 << 30, ()))
        torch.manual_seed(seed)
        ref = block(x.clone())  # (transformers jitters its input in place)
        torch.manual_seed(seed)
        y = moe(x)
        torch.manual_seed(seed)
        noise = torch.empty_like(x).uniform_(1 - j, 1 + j)  # transformers' formula, here
        want = moe.eval()(x * noise)
    assert rel_err(y, ref) < 1e-5
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert rel_err(y, clean) > 1e-3  # (the jitter changed the result)
    # A block without jitter (transformers' default 0.0), in training mode: none here either.
    block = _block(MixtralSparseMoeBlock, BLOCKS[0].values[1](), seed=6).train()
    moe = MoE.from_hf(block)
    assert moe.router_jitter_noise == 0.0 and moe.training
    with torch.no_grad():
        assert rel_err(moe(x), block(x)) < 1e-5


def test_from_hf_module_activation_is_registered_once() -> None:
    # An activation module with a parameter, the experts' and the shared expert's (one
    # object): the layer registered it under "activation." and again under
    # "shared_experts.activation.". Once now, the block's own module; outputs unchanged.
    config = Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16,
                            shared_expert_intermediate_size=24, num_experts=6,
                            num_experts_per_tok=2)
    block = Qwen2MoeSparseMoeBlock(config)
    config._experts_implementation = "eager"
    block.experts.act_fn = block.shared_expert.act_fn = torch.nn.PReLU()
    _randomize(block, seed=int(torch.randint(1 << 30, ())))
    moe = MoE.from_hf(block)
    assert moe.activation is block.experts.act_fn
    assert [k for k in moe.state_dict() if "activation" in k] == ["activation.weight"]
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        y = moe(x)
        assert rel_err(y, block(x)) < 1e-5
        back = MoE.from_state_dict(moe.state_dict(), 2, renormalize=moe.renormalize,
                                   activation=torch.nn.PReLU())
        torch.testing.assert_close(back(x), y, rtol=0, atol=0)


def test_from_hf_rejects_unknown_blocks() -> None:
    config = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                          num_experts_per_tok=2)
    with pytest.raises(ValueError, match="does not know GptOssMLP.*set_experts_implementation"):
        MoE.from_hf(GptOssMLP(config))
    with pytest.raises(ValueError, match="does not know Linear"):
        MoE.from_hf(torch.nn.Linear(3, 3))


def _remote_code_deepseek_block() -> torch.nn.Module:
    """A block named as transformers' DeepseekV3MoE but laid out as DeepSeek-V3's remote code
    (trust_remote_code=True): per-expert MLPs in a ModuleList, an MoEGate router."""

    class MoEGate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 8))
            self.top_k = 2
            self.n_group, self.topk_group, self.routed_scaling_factor = 1, 1, 2.5

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(8, 4, bias=False)
            self.up_proj = torch.nn.Linear(8, 4, bias=False)
            self.down_proj = torch.nn.Linear(4, 8, bias=False)
            self.act_fn = torch.nn.SiLU()

    class DeepseekV3MoE(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate = MoEGate()
            self.experts = torch.nn.ModuleList(MLP() for _ in range(4))
            self.shared_experts = MLP()

    return DeepseekV3MoE()


def test_from_hf_names_what_a_same_named_block_lacks() -> None:
    # A remote-code block of a known class name failed with "AttributeError: 'ModuleList'
    # object has no attribute 'act_fn'" from inside from_hf.
    with pytest.raises(ValueError, match=r"(?s)transformers 5's DeepseekV3MoE.*no 3-D "
                       r"experts\.gate_up_proj \(ModuleList\).*MoEGate\) without "
                       r"norm_topk_prob.*e_score_correction_bias"):
        MoE.from_hf(_remote_code_deepseek_block())
    block = _block(MixtralSparseMoeBlock, BLOCKS[0].values[1](), seed=5)
    block.gate = torch.nn.Linear(32, 8, bias=False)  # transformers 4's router: no top_k
    with pytest.raises(ValueError, match=r"a router \(Linear\) without top_k"):
        MoE.from_hf(block)


def test_from_hf_backward_raises() -> None:
    block = _block(MixtralSparseMoeBlock, BLOCKS[0].values[1](), seed=5)
    moe = MoE.from_hf(block)
    assert block.experts.gate_up_proj.requires_grad  # shared Parameters keep their flags
    y = moe(torch.randn(3, 32))
    with pytest.raises(RuntimeError, match="inference-only"):
        y.sum().backward()


# ---------------------------------------------------------------------------------------------
# the "moe_gemm" experts implementation


def test_register_is_idempotent() -> None:
    assert register_transformers()
    assert register_transformers()
    hf_integration.register()
    assert hf_integration.is_registered()
    assert list(ALL_EXPERTS_FUNCTIONS.keys()).count("moe_gemm") == 1
    assert ALL_EXPERTS_FUNCTIONS["moe_gemm"] is hf_integration.moe_gemm_experts_forward


def _tiny(model_cls: type, config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return _randomize(model_cls(config), seed=6, scale=0.1)


@pytest.mark.parametrize(
    "model_cls,config",
    [
        pytest.param(
            MixtralForCausalLM,
            MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          num_local_experts=8, num_experts_per_tok=2,
                          max_position_embeddings=64),
            id="mixtral",
        ),
        pytest.param(
            Qwen2MoeForCausalLM,
            Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                           moe_intermediate_size=16, shared_expert_intermediate_size=24,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_experts=8, num_experts_per_tok=2, max_position_embeddings=64),
            id="qwen2-moe",
        ),
    ],
)
def test_set_experts_implementation_whole_model(model_cls: type, config: object) -> None:
    register_transformers()
    model = _tiny(model_cls, config)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        model.set_experts_implementation("grouped_mm")
        ref = model(ids).logits
        model.set_experts_implementation("moe_gemm")
        assert model.config._experts_implementation == "moe_gemm"
        out = model(ids).logits
        model.set_experts_implementation("eager")
        eager = model(ids).logits
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, eager) < 1e-5
    model.set_experts_implementation("moe_gemm")
    with pytest.raises(RuntimeError, match="inference-only"):
        model(ids).logits.sum().backward()


def _experts_pair(module: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    with torch.no_grad():
        module.config._experts_implementation = "grouped_mm"
        ref = module(x, ids, w)
        module.config._experts_implementation = "moe_gemm"
        out = module(x, ids, w)
    return out, ref


def test_moe_gemm_fused_attribute_is_checked() -> None:
    # (a string such as "no" was truthy: the fused path forced on, silently)
    register_transformers()
    experts = _block(MixtralSparseMoeBlock, BLOCKS[0].values[1](), seed=23).experts
    x = torch.randn(7, 32)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(7)])
    w = torch.rand(7, 2)
    experts.moe_gemm_fused = "no"
    with pytest.raises(TypeError, match="moe_gemm_fused must be a bool or None; got 'no'"):
        hf_integration.moe_gemm_experts_forward(experts, x, ids, w)
    for fused in (False, True, None):
        experts.moe_gemm_fused = fused
        out, ref = _experts_pair(experts, x, ids, w)
        assert rel_err(out, ref) < 1e-5


def test_gpt_oss_experts_bias_transposed_custom_gate() -> None:
    register_transformers()
    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                          num_experts_per_tok=2)
    experts = _randomize(GptOssExperts(config), seed=7, scale=0.3)
    assert experts.has_bias and experts.is_transposed and not experts.is_concatenated
    x = torch.randn(13, 32)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(13)])
    out, ref = _experts_pair(experts, x, ids, torch.rand(13, 2))
    assert rel_err(out, ref) < 1e-5


def test_non_gated_experts() -> None:
    register_transformers()
    config = NemotronHConfig(hidden_size=32, moe_intermediate_size=24, n_routed_experts=6,
                             num_experts_per_tok=2)
    experts = _randomize(NemotronHExperts(config), seed=8, scale=0.3)
    assert not experts.has_gate
    x = torch.randn(10, 32)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(10)])
    out, ref = _experts_pair(experts, x, ids, torch.rand(10, 2))
    assert rel_err(out, ref) < 1e-5


def test_expert_parallel_sentinels_are_dropped() -> None:
    register_transformers()
    block = _block(MixtralSparseMoeBlock, BLOCKS[0].values[1](), seed=9)
    experts = block.experts
    experts._is_expert_parallel = True
    x = torch.randn(12, 32)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(12)])
    ids[::3, 0] = 8  # off-rank experts, as transformers' EP dispatch marks them
    w = torch.rand(12, 2)
    out, ref = _experts_pair(experts, x, ids, w)
    assert rel_err(out, ref) < 1e-5
    keep = ids < 8
    out_masked, _ = _experts_pair(experts, x, torch.where(keep, ids, 0), torch.where(keep, w, 0))
    assert rel_err(out, out_masked) < 1e-5


def test_expert_parallel_sentinels_never_take_a_bias() -> None:
    # A dropped slot's row (past offs[-1]) must not get expert E - 1's down bias: a non-finite
    # value there made 0 * inf = NaN in tokens that never visited that expert.
    register_transformers()
    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                          num_experts_per_tok=2)
    experts = _randomize(GptOssExperts(config), seed=7, scale=0.3)
    experts._is_expert_parallel = True
    with torch.no_grad():
        experts.down_proj_bias[7, 3] = float("inf")  # no token is routed to expert 7
    x = torch.randn(4, 32)
    ids = torch.tensor([[0, 8], [1, 2], [3, 8], [4, 5]])  # 8: an off-rank expert
    w = torch.rand(4, 2)
    for fused in (False, True):
        experts.moe_gemm_fused = fused
        out, ref = _experts_pair(experts, x, ids, w)
        assert torch.isfinite(ref).all()
        assert torch.isfinite(out).all(), f"fused={fused}"
        assert rel_err(out, ref) < 1e-5


TRANSFORMERS_MODELS = pathlib.Path(transformers.__file__).parent / "models"
USAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "USAGE.md"
DOCUMENTED_TRANSFORMERS = "5.25."  # the release docs/USAGE.md counts the families of


def _experts_classes() -> list[tuple[str, str, str]]:
    """(family, modeling module, class) of every experts class transformers dispatches
    through its experts implementations (decorated with @use_experts_implementation)."""
    found = []
    for path in sorted(TRANSFORMERS_MODELS.glob("*/modeling_*.py")):
        src = path.read_text(encoding="utf-8")
        for cls in re.findall(r"@use_experts_implementation(?:\([^)]*\))?\nclass (\w+)", src):
            found.append((path.parent.name, path.stem, cls))
    return found


def test_usage_counts_the_families_the_switch_reaches() -> None:
    # transformers 5.25 dispatches the experts of 72 families (73 experts classes); the MoE
    # families it does not are named in docs/USAGE.md.
    text = " ".join(USAGE.read_text(encoding="utf-8").split())
    m = re.search(r"\((\d+) MoE families on transformers (\d+)\.(\d+)", text)
    assert m, "docs/USAGE.md no longer counts the families as this test expects"
    if tuple(int(v) for v in transformers.__version__.split(".")[:2]) != (int(m[2]), int(m[3])):
        pytest.skip(f"USAGE.md counts transformers {m[2]}.{m[3]}'s families; this is "
                    f"{transformers.__version__}")
    families = sorted({family for family, _, _ in _experts_classes()})
    assert int(m[1]) == len(families), f"transformers dispatches the experts of {families}"
    # The MoE families named as not reached run their experts on their own.
    named = {"Llama-4": "llama4", "DBRX": "dbrx", "JetMoE": "jetmoe",
             "Switch Transformers": "switch_transformers"}
    exclusions = re.search(r"; not (.*?), whose experts transformers runs on its own", text)
    assert exclusions, "docs/USAGE.md no longer names the families the switch does not reach"
    for label, family in named.items():
        assert label in exclusions[1], f"USAGE.md does not name {label} as not reached"
        assert (TRANSFORMERS_MODELS / family).is_dir() and family not in families


# Sizes for a tiny experts module of any family: odd hidden and intermediate sizes, 6 experts
# (each family's config reads some of these names).
_TINY = dict(hidden_size=37, moe_hidden_size=37, intermediate_size=23, moe_intermediate_size=23,
             num_experts=6, num_local_experts=6, n_routed_experts=6, moe_num_experts=6,
             moe_latent_size=None)


def _tiny_experts(family: str, module: str, cls_name: str) -> torch.nn.Module:
    """The family's experts class built from its default config with _TINY's sizes."""
    modeling = importlib.import_module(f"transformers.models.{family}.{module}")
    configs = importlib.import_module(
        f"transformers.models.{family}.{module.replace('modeling_', 'configuration_')}")
    candidates = sorted(
        (c for c in vars(configs).values() if isinstance(c, type)
         and issubclass(c, transformers.PreTrainedConfig) and c.__module__ == configs.__name__),
        key=lambda c: ("Text" not in c.__name__, c.__name__))  # text configs first
    errors = []
    for config_cls in candidates:
        config = config_cls()
        for name, value in _TINY.items():
            if hasattr(config, name):
                try:
                    setattr(config, name, value)
                except Exception:  # noqa: BLE001 (a field of another form, e.g. per-layer lists)
                    pass
        cls = getattr(modeling, cls_name)
        # (Ernie-4.5-VL's experts take their width from the block: the config holds a list)
        params = inspect.signature(cls.__init__).parameters
        kwargs = ({"intermediate_size": _TINY["intermediate_size"]}
                  if "intermediate_size" in params else {})
        if "layer_idx" in params:  # (Step-3.7's experts: per-layer clamp limits)
            kwargs["layer_idx"] = 0
        try:
            experts = cls(config, **kwargs)
        except Exception as exc:  # noqa: BLE001 (another config class of the family may fit)
            errors.append(f"{config_cls.__name__}: {exc!r}")
            continue
        return _randomize(experts, seed=int(torch.randint(1 << 30, ())), scale=0.3)
    if transformers.__version__.startswith(DOCUMENTED_TRANSFORMERS):
        pytest.fail(f"could not build {cls_name}: {errors}")
    # A family a later transformers added may need a config this builder does not know.
    pytest.skip(f"{cls_name} not built from its default config on transformers "
                f"{transformers.__version__}: {errors[:1]}")


def _routes_per_row(ref: torch.nn.Module, x: torch.Tensor, E: int) -> int:
    """Top-k routes per token the class's own eager forward takes: 3, or 1 where the class is
    a per-route projection (Ergo's takes one unit-weight route per row, squeezing the last
    dim; its subclass, the model's experts, spreads the routes and weighs them itself)."""
    for k in (3, 1):
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(x.shape[0])])
        try:
            with torch.no_grad():
                ref(x, ids, torch.rand(x.shape[0], k, dtype=x.dtype))
        except (IndexError, RuntimeError):
            continue
        return k
    message = f"{type(ref).__name__}'s eager forward takes neither 3 nor 1 route per row"
    if transformers.__version__.startswith(DOCUMENTED_TRANSFORMERS):
        pytest.fail(message)
    # A family a later transformers added may call its experts another way.
    pytest.skip(f"{message} on transformers {transformers.__version__}")


@pytest.mark.parametrize("family,module,cls_name",
                         [pytest.param(*c, id=f"{c[0]}.{c[2]}") for c in _experts_classes()])
def test_switch_matches_transformers_on_every_experts_class(family, module, cls_name) -> None:
    # Each class's own eager forward (float64) is the reference: default and custom gates
    # (clamped, soft-capped, GPT-OSS's interleaved), biases, transposed weights, no gate, a
    # post-expert norm. bf16 keeps the 2x rule against transformers' batched_mm in bf16.
    register_transformers()
    experts = _tiny_experts(family, module, cls_name)
    w_in = experts.gate_up_proj if experts.has_gate else experts.up_proj
    H = w_in.shape[1] if experts.is_transposed else w_in.shape[2]
    E = experts.num_experts
    ref = copy.deepcopy(experts).double()
    ref.config._experts_implementation = "eager"
    x = torch.randn(17, H)
    k = _routes_per_row(ref, x.double(), E)
    ids = torch.stack([torch.randperm(E - 2)[:k] for _ in range(17)])  # 2 experts get none
    # A per-route projection's routes have unit weight (its caller weighs them after a norm).
    w = torch.rand(17, k) if k > 1 else torch.ones(17, 1)
    for T in (17, 1):
        with torch.no_grad():
            want = ref(x[:T].double(), ids[:T], w[:T].double())
            experts.config._experts_implementation = "moe_gemm"
            got = experts(x[:T], ids[:T], w[:T])
        assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5, f"T={T}"
    low = copy.deepcopy(experts).bfloat16()
    xb, wb = x.bfloat16(), w.bfloat16()
    ref_b = copy.deepcopy(low).double()
    ref_b.config._experts_implementation = "eager"
    with torch.no_grad():
        want = ref_b(xb.double(), ids, wb.double())
        low.config._experts_implementation = "batched_mm"
        base = low(xb, ids, wb)
        low.config._experts_implementation = "moe_gemm"
        got = low(xb, ids, wb)
    assert got.dtype == torch.bfloat16
    assert_close_to_ref(got, want, base, max_calc_diff=max(1e-5, 2 * calc_diff(base, want)),
                        name=cls_name)


def _experts_subclasses() -> list[tuple[str, str, str, str]]:
    """(family, module, decorated class, subclass) where a model's experts module subclasses
    a dispatched class and calls it from its own forward (Ergo's per-route projection)."""
    found = []
    for family, module, cls_name in _experts_classes():
        modeling = importlib.import_module(f"transformers.models.{family}.{module}")
        base = getattr(modeling, cls_name)
        found += [(family, module, cls_name, c.__name__) for c in vars(modeling).values()
                  if isinstance(c, type) and c is not base and issubclass(c, base)
                  and c.__module__ == modeling.__name__]
    return found


@pytest.mark.parametrize("family,module,cls_name,sub_name",
                         [pytest.param(*c, id=f"{c[0]}.{c[3]}") for c in _experts_subclasses()])
def test_switch_inside_a_subclassed_experts_module(family, module, cls_name, sub_name) -> None:
    # The model's own experts module (top-k routes, real weights) with the switch on matches
    # its eager forward: the dispatched projection inside sees the routes the subclass makes.
    register_transformers()
    built = _tiny_experts(family, module, cls_name)
    modeling = importlib.import_module(f"transformers.models.{family}.{module}")
    try:
        experts = getattr(modeling, sub_name)(built.config)
    except Exception as exc:  # noqa: BLE001 (a subclass taking more than the config)
        pytest.skip(f"{sub_name} not built from {type(built.config).__name__}: {exc!r}")
    experts = _randomize(experts, seed=int(torch.randint(1 << 30, ())), scale=0.3)
    w_in = built.gate_up_proj if built.has_gate else built.up_proj
    H = w_in.shape[1] if built.is_transposed else w_in.shape[2]
    E = experts.num_experts
    x = torch.randn(17, H)
    ids = torch.stack([torch.randperm(E - 2)[:3] for _ in range(17)])
    w = torch.rand(17, 3)
    ref = copy.deepcopy(experts).double()
    ref.config._experts_implementation = "eager"
    with torch.no_grad():
        want = ref(x.double(), ids, w.double())
        experts.config._experts_implementation = "moe_gemm"
        got = experts(x, ids, w)
    assert rel_err(got, want) < 1e-5


def _mixtral_experts_with(**weights: torch.Tensor) -> torch.nn.Module:
    """A random MixtralExperts (H=32, I=16, E=8) with some of its tensors replaced."""
    experts = _randomize(MixtralExperts(BLOCKS[0].values[1]()), seed=int(torch.randint(1 << 30, ())))
    for name, t in weights.items():
        setattr(experts, name, torch.nn.Parameter(t, requires_grad=False))
    return experts


def _gpt_oss_experts_with(**weights: torch.Tensor) -> torch.nn.Module:
    """A random GptOssExperts (H=32, I=24, E=8, transposed, with biases), some tensors replaced."""
    config = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=8,
                          num_experts_per_tok=2)
    experts = _randomize(GptOssExperts(config), seed=int(torch.randint(1 << 30, ())))
    for name, t in weights.items():
        setattr(experts, name, torch.nn.Parameter(t, requires_grad=False))
    return experts


@pytest.mark.parametrize("make,error,pattern", [
    # a down projection to another width: the result was (T, 30), where transformers' own
    # implementations raise (and a (T, 1) result would broadcast into the residual stream)
    (lambda: _mixtral_experts_with(down_proj=torch.randn(8, 30, 16)), ValueError,
     r"MixtralExperts.down_proj must be \(E, H, I\) = \(8, 32, 16\) to match gate_up_proj "
     r"\(8, 32, 32\); got \(8, 30, 16\)"),
    # (was "offs must have one entry per expert: (7,); got (8,)")
    (lambda: _mixtral_experts_with(down_proj=torch.randn(7, 32, 16)), ValueError,
     r"MixtralExperts.down_proj must be \(E, H, I\) = \(8, 32, 16\)"),
    # (was "x is (T, K) = (14, 16), so w must be (E, 16, N)": names neither tensor)
    (lambda: _mixtral_experts_with(down_proj=torch.randn(8, 32, 12)), ValueError,
     r"MixtralExperts.down_proj must be \(E, H, I\) = \(8, 32, 16\)"),
    # (was a RuntimeError from chunk's unequal halves inside the gate)
    (lambda: _mixtral_experts_with(gate_up_proj=torch.randn(8, 31, 32)), ValueError,
     r"MixtralExperts.gate_up_proj must be \(E, 2I, H\).*got \(8, 31, 32\)"),
    # (was "x must be torch.bfloat16, torch.float16 or torch.float32; got torch.float64")
    (lambda: _mixtral_experts_with(gate_up_proj=torch.randn(8, 32, 32).double(),
                                   down_proj=torch.randn(8, 32, 16).double()), TypeError,
     r"MixtralExperts.gate_up_proj is torch.float64; .* bf16, fp16 or fp32"),
    # (was "w has dtype torch.float16 but x has torch.float32")
    (lambda: _mixtral_experts_with(down_proj=torch.randn(8, 32, 16).half()), TypeError,
     r"MixtralExperts.down_proj is torch.float16 but gate_up_proj is torch.float32"),
    # transposed storage is named as stored: (E, I, H)
    (lambda: _gpt_oss_experts_with(down_proj=torch.randn(8, 24, 31)), ValueError,
     r"GptOssExperts.down_proj must be \(E, I, H\) = \(8, 24, 32\) to match gate_up_proj "
     r"\(8, 32, 48\); got \(8, 24, 31\)"),
    # (was "IndexError: index out of range in self" from the bias gather)
    (lambda: _gpt_oss_experts_with(gate_up_proj_bias=torch.randn(7, 48)), ValueError,
     r"GptOssExperts.gate_up_proj_bias must be \(E, 2I\) = \(8, 48\); got \(7, 48\)"),
    # (was a RuntimeError from broadcasting the bias onto the rows)
    (lambda: _gpt_oss_experts_with(down_proj_bias=torch.randn(8, 31)), ValueError,
     r"GptOssExperts.down_proj_bias must be \(E, H\) = \(8, 32\); got \(8, 31\)"),
], ids=["down-to-other-width", "down-other-experts", "down-other-intermediate",
        "odd-gate-up-rows", "float64-weights", "mixed-weight-dtypes", "transposed-down",
        "gate-up-bias-experts", "down-bias-width"])
def test_experts_weights_that_do_not_fit_are_named(make, error, pattern) -> None:
    register_transformers()
    experts = make()
    H = 32
    x = torch.randn(7, H)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(7)])
    w = torch.rand(7, 2)
    for fused in (None, False, True):  # the unfused and the fused paths check alike
        experts.moe_gemm_fused = fused
        with torch.no_grad(), pytest.raises(error, match=pattern):
            hf_integration.moe_gemm_experts_forward(experts, x, ids, w)


def _experts_call(experts: torch.nn.Module, T: int = 7) -> torch.Tensor:
    x = torch.randn(T, 32)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(T)])
    with torch.no_grad():
        return hf_integration.moe_gemm_experts_forward(experts, x, ids, torch.rand(T, 2))


@pytest.mark.parametrize("make", [_mixtral_experts_with, _gpt_oss_experts_with],
                         ids=["mixtral", "gpt-oss-biases"])
def test_experts_weights_are_checked_once_per_layout(monkeypatch: pytest.MonkeyPatch,
                                                     make) -> None:
    # The weights' checks ran on every forward (~3.3 us of Python per layer and forward on
    # the CPU). They read the weights' layout alone, never values or addresses: a layout
    # seen before has passed them, and new values or a new tensor of that layout need no
    # new check.
    register_transformers()
    calls: list[int] = []
    real = hf_integration._check_weights
    monkeypatch.setattr(hf_integration, "_check_weights",
                        lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(hf_integration, "_CHECKED_LAYOUTS", {})
    experts = make()
    for _ in range(3):
        _experts_call(experts)
    assert len(calls) == 1
    with torch.no_grad():
        experts.down_proj.mul_(2)
    experts.down_proj = torch.nn.Parameter(torch.randn_like(experts.down_proj),
                                           requires_grad=False)
    _experts_call(experts)
    assert len(calls) == 1
    experts.down_proj.data = experts.down_proj.data.half()  # a new layout: checked (refused)
    with pytest.raises(TypeError, match="down_proj is torch.float16"):
        _experts_call(experts)
    assert len(calls) == 2


def _replace_down(experts: torch.nn.Module, t: torch.Tensor) -> None:
    experts.down_proj = torch.nn.Parameter(t, requires_grad=False)


def _set_down_data(experts: torch.nn.Module, t: torch.Tensor) -> None:
    experts.down_proj.data = t  # the same Parameter object, another tensor inside


def _resize_down(experts: torch.nn.Module, t: torch.Tensor) -> None:
    # in place: the same object and data pointer, another shape
    experts.down_proj.requires_grad_(False).resize_(t.shape)


@pytest.mark.parametrize("change", [_replace_down, _set_down_data, _resize_down],
                         ids=["new-parameter", "data-swap", "resize-in-place"])
@pytest.mark.parametrize("bad,error,pattern", [
    (torch.randn(8, 30, 16), ValueError, r"down_proj must be \(E, H, I\) = \(8, 32, 16\)"),
    (torch.randn(8, 32, 12), ValueError, r"down_proj must be \(E, H, I\) = \(8, 32, 16\)"),
    (torch.randn(8, 32, 16).half(), TypeError, "down_proj is torch.float16 but gate_up_proj"),
    (torch.randn(8, 32, 16, device="meta"), ValueError, "down_proj is on meta but"),
], ids=["other-width", "other-intermediate", "other-dtype", "other-device"])
def test_experts_weights_changed_after_a_forward_are_refused(change, bad, error,
                                                             pattern) -> None:
    # Whatever the checks' cache, a weight that no longer fits after forwards that passed is
    # refused as on a first call (an in-place resize_ keeps the tensor and its data pointer).
    register_transformers()
    experts = _mixtral_experts_with()
    _experts_call(experts)
    if change is _resize_down and (bad.dtype != torch.float32 or bad.device.type != "cpu"):
        pytest.skip("resize_ changes the shape only")
    if change is _set_down_data and bad.device.type != "cpu":
        pytest.skip("torch refuses .data of another device type")
    change(experts, bad)
    with pytest.raises(error, match=pattern):
        _experts_call(experts)


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: ~20 s on 2 cores
def test_lazy_registration_on_transformers_import() -> None:
    # A fresh interpreter: the hook must register "moe_gemm" when transformers loads its MoE
    # module, without the user importing moe_gemm.integrations.transformers.
    code = textwrap.dedent(
        """
        import sys
        import moe_gemm.integrations as integrations
        integrations.register_transformers_lazily()
        integrations.register_transformers_lazily()
        assert "transformers.integrations.moe" not in sys.modules
        from transformers import MixtralConfig, MixtralForCausalLM
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        assert "moe_gemm" in ALL_EXPERTS_FUNCTIONS, list(ALL_EXPERTS_FUNCTIONS)
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
        assert "moe_gemm" in FP8ExpertsInterface._global_mapping  # FP8 checkpoints' experts
        assert not any(type(f).__name__ == "_PostImportHook" for f in sys.meta_path)
        cfg = MixtralConfig(vocab_size=16, hidden_size=16, intermediate_size=8,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            num_local_experts=4, num_experts_per_tok=2,
                            experts_implementation="moe_gemm")
        model = MixtralForCausalLM(cfg)
        assert model.config._experts_implementation == "moe_gemm"
        print("ok")
        """
    )
    _run_fresh(code)


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: ~20 s on 2 cores
def test_registration_when_the_integration_imports_transformers_first() -> None:
    # `import moe_gemm`, then the integration module before transformers: its import of
    # transformers' MoE module fires the hook while the integration is half-made; "moe_gemm"
    # must still end up registered.
    code = textwrap.dedent(
        """
        import sys
        import moe_gemm
        assert "transformers.integrations.moe" not in sys.modules
        from moe_gemm.integrations.transformers import is_registered
        assert is_registered()
        print("ok")
        """
    )
    _run_fresh(code)


def _run_fresh(code: str) -> None:
    """Run `code` in a fresh interpreter (this checkout first on the path); it prints ok."""
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root,
        env=env,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


@pytest.mark.parametrize("change,error,pattern", [
    (lambda x, i, w: (x[None], i, w), ValueError, r"hidden_states must be \(T, H\)"),
    (lambda x, i, w: (x, i.float(), w), TypeError, "top_k_index must hold integer expert ids"),
    (lambda x, i, w: (x, i, w[:, :1]), ValueError, "top_k_weights must match top_k_index"),
    (lambda x, i, w: (x, i[:, :0], w[:, :0]), ValueError, r"\(9, k >= 1\); got \(9, 0\)"),
], ids=["3d-hidden", "float-ids", "weights-shape", "no-slots"])  # (every case: inputs.py's test)
def test_experts_inputs_that_do_not_fit_are_named(change, error, pattern) -> None:
    # (a 3-D input failed inside an index op; routing of another token count gave a result of
    # that count; (T, 1) weights for (T, 2) ids were broadcast; float ids were truncated;
    # (T, 0) ids failed inside the combine with "step must be nonzero")
    register_transformers()
    block = _block(MixtralSparseMoeBlock, BLOCKS[0].values[1](), seed=21)
    experts = block.experts
    x = torch.randn(9, 32)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(9)])
    w = torch.rand(9, 2)
    with pytest.raises(error, match=pattern):
        hf_integration.moe_gemm_experts_forward(experts, *change(x, ids, w))
    with torch.no_grad():  # integer ids of any width; fp64 tokens run in the weights' dtype
        small = hf_integration.moe_gemm_experts_forward(experts, x, ids.to(torch.uint8), w)
        assert torch.equal(small, hf_integration.moe_gemm_experts_forward(experts, x, ids, w))
        assert hf_integration.moe_gemm_experts_forward(experts, x.double(), ids, w).dtype == (
            torch.float64)
