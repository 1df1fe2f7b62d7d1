"""The MoE layer on FP8 experts, on the CPU (the torch backend): quantize_fp8, the FP8
checkpoint layouts from_state_dict reads (DeepSeek-V3 / Kimi-K2 / Qwen3-FP8 per-expert
`weight_scale_inv` blocks, compressed-tensors per-channel `weight_scale`, transformers 5 and
vLLM fused keys), MoE.from_hf over transformers' FP8Experts, against the fp64 reference of
what the layer computes and against the 16-bit layer it was quantized from, and the errors."""

from __future__ import annotations

import pytest
import torch

from moe_gemm import (
    GemmConfig,
    MoE,
    quantize_fp8_per_block,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
)
from moe_gemm.testing_fp8 import FFN_REL_BOUND, fp8_errors, moe_fp8_reference

E4M3 = torch.float8_e4m3fn


def _layer(scoring="softmax", shared=0, H=256, I=128, E=8, k=2, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    opts = {}
    if scoring == "sigmoid":
        opts = dict(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    moe = MoE(H, I, E, k, shared_intermediate_size=shared, dtype=dtype, **opts)
    if moe.e_score_correction_bias is not None:
        moe.e_score_correction_bias.normal_(0, 0.1)
    return moe.eval()


def _x(T=37, H=256, seed=1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(dtype)


@pytest.mark.parametrize("granularity", ["block", "row"])
@pytest.mark.parametrize("scoring,shared", [("softmax", 0), ("sigmoid", 256)])
def test_quantize_fp8_layer(granularity, scoring, shared):
    moe = _layer(scoring, shared)
    x = _x()
    with torch.no_grad():
        y16 = moe(x)
        moe.quantize_fp8(granularity)
        y8 = moe(x)
        ref = moe_fp8_reference(moe, x)
    assert moe.fp8 == granularity and moe.gate_up_proj.dtype == E4M3
    assert y8.dtype == x.dtype and y8.shape == x.shape
    e = fp8_errors(y8, ref)
    assert e["rel"] < FFN_REL_BOUND, e  # what the layer computes (bf16 intermediates)
    fid = fp8_errors(y8, y16)
    assert fid["rel"] < 8e-2, fid  # FP8 weights and activations against the 16-bit layer
    assert "fp8=" in repr(moe)
    with pytest.raises(ValueError, match="FP8 already"):
        moe.quantize_fp8()


def test_fp32_activations_and_3d_input():
    moe = _layer(dtype=torch.float32).quantize_fp8("block")
    x = _x(dtype=torch.float32).view(1, 37, 256)
    with torch.no_grad():
        y = moe(x)
        ref = moe_fp8_reference(moe, x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert fp8_errors(y, ref)["rel"] < 1e-4


def _deepseek_state_dict(moe16: MoE, fmt: str) -> dict[str, torch.Tensor]:
    """The block as a checkpoint stores it: per-expert FP8 weights with their scales
    (fmt "inv": DeepSeek-V3 weight_scale_inv blocks; "channel": compressed-tensors per-
    channel weight_scale + a static input_scale)."""
    sd: dict[str, torch.Tensor] = {"gate.weight": moe16.router_weight.detach().clone()}
    if moe16.e_score_correction_bias is not None:
        sd["gate.e_score_correction_bias"] = moe16.e_score_correction_bias.clone()
    I = moe16.intermediate_size

    def put(name, w):
        if fmt == "inv":
            q, s = quantize_fp8_per_block(w)
            sd[f"{name}.weight"], sd[f"{name}.weight_scale_inv"] = q, s
        else:
            q, s = quantize_fp8_per_row(w)
            sd[f"{name}.weight"], sd[f"{name}.weight_scale"] = q, s[:, None]
            sd[f"{name}.input_scale"] = torch.tensor(0.02)

    for e in range(moe16.num_experts):
        put(f"experts.{e}.gate_proj", moe16.gate_up_proj[e, :I])
        put(f"experts.{e}.up_proj", moe16.gate_up_proj[e, I:])
        put(f"experts.{e}.down_proj", moe16.down_proj[e])
    if moe16.shared_experts is not None:
        for n in ("gate_proj", "up_proj", "down_proj"):
            put(f"shared_experts.{n}", getattr(moe16.shared_experts, n).weight)
    return sd


@pytest.mark.parametrize("fmt,granularity", [("inv", "block"), ("channel", "row")])
def test_from_state_dict_per_expert_fp8(fmt, granularity):
    moe16 = _layer("sigmoid", shared=128, seed=3)
    sd = _deepseek_state_dict(moe16, fmt)
    prefix = "model.layers.3.mlp."
    moe = MoE.from_state_dict({prefix + k: v for k, v in sd.items()}, 2, prefix=prefix,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert moe.fp8 == granularity and moe.gate_up_proj.dtype == E4M3
    assert moe.shared_experts.gate_proj.weight.dtype == torch.bfloat16  # dequantized
    if granularity == "block":
        assert moe.gate_up_proj_scale_inv.shape == (8, 2, 2)
        assert moe.down_proj_scale_inv.shape == (8, 2, 1)
        # Gate rows, then up rows, in weights and in scales alike.
        q, s = quantize_fp8_per_block(moe16.gate_up_proj[3, 128:])
        assert torch.equal(moe.gate_up_proj[3, 128:].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(moe.gate_up_proj_scale_inv[3, 1:], s)
    else:
        assert moe.gate_up_proj_scale_inv.shape == (8, 256)
    x = _x(seed=4)
    with torch.no_grad():
        y = moe(x)
        ref = moe_fp8_reference(moe, x)
        y16 = moe16(x)
    assert fp8_errors(y, ref)["rel"] < FFN_REL_BOUND
    assert fp8_errors(y, y16)["rel"] < 8e-2


def test_from_state_dict_fused_fp8_keys():
    moe16 = _layer(seed=5)
    q1, s1 = quantize_fp8_per_block(moe16.gate_up_proj.detach())
    q2, s2 = quantize_fp8_per_block(moe16.down_proj.detach())
    router = moe16.router_weight.detach()
    # transformers 5 FP8Experts names: aliased, no copy.
    sd = {"gate.weight": router, "experts.gate_up_proj": q1, "experts.down_proj": q2,
          "experts.gate_up_proj_scale_inv": s1, "experts.down_proj_scale_inv": s2}
    moe = MoE.from_state_dict(sd, 2)
    assert moe.gate_up_proj.data_ptr() == q1.data_ptr()
    assert moe.gate_up_proj_scale_inv.data_ptr() == s1.data_ptr()
    x = _x(seed=6)
    with torch.no_grad():
        assert fp8_errors(moe(x), moe_fp8_reference(moe, x))["rel"] < FFN_REL_BOUND
    # vLLM names with per-tensor scales (one per expert): row-wise.
    p1 = [quantize_fp8_per_tensor(w) for w in moe16.gate_up_proj.detach()]
    p2 = [quantize_fp8_per_tensor(w) for w in moe16.down_proj.detach()]
    w13, t1 = torch.stack([q for q, _ in p1]), torch.stack([s for _, s in p1])
    w2, t2 = torch.stack([q for q, _ in p2]), torch.stack([s for _, s in p2])
    sd = {"gate.weight": router, "experts.w13_weight": w13, "experts.w2_weight": w2,
          "experts.w13_weight_scale": t1, "experts.w2_weight_scale": t2}
    moe = MoE.from_state_dict(sd, 2)
    assert moe.fp8 == "row" and moe.gate_up_proj_scale_inv.shape == (8, 256)
    with torch.no_grad():
        y = moe(x)
        assert fp8_errors(y, moe_fp8_reference(moe, x))["rel"] < FFN_REL_BOUND
        assert fp8_errors(y, moe16(x))["rel"] < 8e-2


def test_fp8_layer_errors():
    moe16 = _layer(seed=7)
    sd = _deepseek_state_dict(moe16, "inv")
    missing = {k: v for k, v in sd.items() if k != "experts.2.up_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match="no weight_scale_inv"):
        MoE.from_state_dict(missing, 2)
    bad = dict(sd)
    bad["experts.1.down_proj.weight_scale_inv"] = torch.ones(3, 3)
    with pytest.raises(ValueError, match="neither 128x128 blocks"):
        MoE.from_state_dict(bad, 2)
    mixed = dict(sd)
    q, s = quantize_fp8_per_row(moe16.down_proj[0].detach())
    mixed["experts.0.down_proj.weight_scale_inv"] = s
    with pytest.raises(ValueError, match="mix weight formats"):
        MoE.from_state_dict(mixed, 2)
    odd = MoE(256, 96, 4, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 128"):
        odd.quantize_fp8("block")
    odd.quantize_fp8("row")  # row-wise needs multiples of 16 only
    assert odd.fp8 == "row"
    q1, s1 = quantize_fp8_per_block(moe16.gate_up_proj.detach())
    q2, _ = quantize_fp8_per_block(moe16.down_proj.detach())
    with pytest.raises(TypeError, match="need their gate_up scale"):
        MoE.from_fused(q1, q2, moe16.router_weight.detach(), 2)
    with pytest.raises(TypeError, match="need their down scale"):
        MoE.from_fused(q1, q2, moe16.router_weight.detach(), 2, scales=(s1, None))
    fused = MoE.from_fused(q1, q2, moe16.router_weight.detach(), 2,
                           scales=(s1, quantize_fp8_per_block(moe16.down_proj.detach())[1]))
    assert fused.fp8 == "block" and fused.gate_up_proj.data_ptr() == q1.data_ptr()
    with pytest.raises(ValueError, match="must be block-wise gate_up"):
        from moe_gemm.layers.checkpoints import moe_from_tensors

        moe_from_tensors(MoE, q1, q2, moe16.router_weight.detach(), 2, None, None, {},
                         scales=(s1, s1))


def test_fp8_layer_backend_pins_and_graph_safety_on_cpu():
    moe = _layer(seed=8).quantize_fp8()
    moe.config = GemmConfig(backend="torch")
    x = _x(seed=9)
    with torch.no_grad():
        y = moe(x)
    assert torch.isfinite(y.float()).all()
    # A backward through the FP8 layer raises (inference only), as for the 16-bit layer.
    xg = x.float().requires_grad_()
    out = moe(xg)
    with pytest.raises(RuntimeError, match="inference-only"):
        out.float().sum().backward()


def test_from_hf_fp8_experts():
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers >= 5")
    from transformers import DeepseekV3Config
    from transformers.integrations.finegrained_fp8 import FP8Experts
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=256, moe_intermediate_size=128, n_routed_experts=8,
                           num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(10)
    block = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
        block.gate.e_score_correction_bias.normal_(0, 0.1)
    ref16 = MoE.from_hf(block)
    x = _x(seed=11, dtype=torch.float32)
    with torch.no_grad():
        y16 = ref16(x)
    fp8 = FP8Experts(cfg, block_size=(128, 128))
    q1, s1 = quantize_fp8_per_block(block.experts.gate_up_proj.detach())
    q2, s2 = quantize_fp8_per_block(block.experts.down_proj.detach())
    with torch.no_grad():
        fp8.gate_up_proj.data = q1
        fp8.gate_up_proj_scale_inv.data = s1
        fp8.down_proj.data = q2
        fp8.down_proj_scale_inv.data = s2
    block.experts = fp8
    moe = MoE.from_hf(block)
    assert moe.fp8 == "block" and moe.gate_up_proj is fp8.gate_up_proj  # shared, no copy
    assert moe.gate_up_proj_scale_inv is fp8.gate_up_proj_scale_inv
    with torch.no_grad():
        y = moe(x)
        assert fp8_errors(y, moe_fp8_reference(moe, x))["rel"] < 1e-4  # fp32 compute
        assert fp8_errors(y, y16)["rel"] < 8e-2


def test_fp8_layer_keeps_its_dtypes_under_module_casts():
    """module.to(dtype) / .half() / .float() (FP8 is floating point to torch) cast the router and
    the shared expert, never the FP8 experts or their float32 scales; device moves still apply."""
    moe = _layer(shared=128, seed=12).quantize_fp8()
    x = _x(seed=13)
    with torch.no_grad():
        want = moe_fp8_reference(moe, x)
    q_bytes = moe.gate_up_proj.detach().view(torch.uint8).clone()
    s = moe.down_proj_scale_inv.detach().clone()
    for cast, dtype in ((lambda m: m.to(torch.float16), torch.float16),
                        (lambda m: m.half(), torch.float16),
                        (lambda m: m.float(), torch.float32),
                        (lambda m: torch.nn.Sequential(m).to("cpu", torch.float32)[0],
                         torch.float32)):
        m = cast(_layer(shared=128, seed=12).quantize_fp8())
        assert m.gate_up_proj.dtype == E4M3 and m.down_proj.dtype == E4M3
        assert m.gate_up_proj_scale_inv.dtype == torch.float32
        assert isinstance(m.gate_up_proj, torch.nn.Parameter)
        assert torch.equal(m.gate_up_proj.detach().view(torch.uint8), q_bytes)
        assert torch.equal(m.down_proj_scale_inv, s)
        assert m.router_weight.dtype == dtype
        assert m.shared_experts.gate_proj.weight.dtype == dtype
        with torch.no_grad():
            y = m(x.to(dtype))
        assert y.dtype == dtype
        assert fp8_errors(y, want)["rel"] < 2e-2
    meta = _layer(seed=12).quantize_fp8().to("meta")
    assert meta.gate_up_proj.device.type == "meta" and meta.gate_up_proj.dtype == E4M3
    meta.to_empty(device="cpu")
    assert meta.down_proj.device.type == "cpu" and meta.down_proj.dtype == E4M3
    assert meta.down_proj_scale_inv.dtype == torch.float32


def test_per_expert_checkpoint_mixing_formats_within_an_expert():
    """Gate and up projections of one expert in different granularities: a clear error (their
    scales were concatenated first, failing inside torch.cat)."""
    moe16 = _layer(seed=14)
    sd = _deepseek_state_dict(moe16, "inv")
    mixed = dict(sd)
    q, s = quantize_fp8_per_tensor(moe16.gate_up_proj[0, 128:].detach())
    mixed["experts.0.up_proj.weight"], mixed["experts.0.up_proj.weight_scale_inv"] = q, s
    with pytest.raises(ValueError, match="mix weight formats .*expert 0"):
        MoE.from_state_dict(mixed, 2)
