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
from moe_gemm.testing_fp8 import (
    FFN_REL_BOUND,
    LargestFloat32,
    fp8_errors,
    moe_fp8_reference,
)

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
    # The shared expert is dequantized on load: each weight is its FP8 values times their
    # scale (a 128x128 block's, or the row's), rounded once to bf16. Checked exactly here,
    # since the reference below runs the layer's own shared expert.
    for n in ("gate_proj", "up_proj", "down_proj"):
        q = sd[f"shared_experts.{n}.weight"].float()
        if fmt == "inv":
            s = sd[f"shared_experts.{n}.weight_scale_inv"]
            s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:q.shape[0], :q.shape[1]]
        else:
            s = sd[f"shared_experts.{n}.weight_scale"]
        want = (q * s).to(torch.bfloat16)
        got = getattr(moe.shared_experts, n).weight
        assert torch.equal(got, want), n
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
    # vLLM's per-shard scales before its own merge: w13_weight_scale [E, 2], the gate half's
    # scale and the up half's (it was refused as fitting no granularity)
    halves = [[quantize_fp8_per_tensor(h) for h in w.chunk(2, 0)]
              for w in moe16.gate_up_proj.detach()]
    sd["experts.w13_weight"] = torch.stack([torch.cat([q for q, _ in e]) for e in halves])
    sd["experts.w13_weight_scale"] = torch.stack([torch.stack([s for _, s in e])
                                                  for e in halves])
    assert sd["experts.w13_weight_scale"].shape == (8, 2)
    moe = MoE.from_state_dict(sd, 2)
    assert moe.fp8 == "row" and moe.gate_up_proj_scale_inv.shape == (8, 256)
    want = sd["experts.w13_weight_scale"].repeat_interleave(128, dim=1)
    assert torch.equal(moe.gate_up_proj_scale_inv, want)
    with torch.no_grad():
        y = moe(x)
        assert fp8_errors(y, moe_fp8_reference(moe, x))["rel"] < FFN_REL_BOUND
        assert fp8_errors(y, moe16(x))["rel"] < 8e-2
    sd["experts.w13_weight_scale"] = torch.ones(8, 3)  # 3 does not divide 2I = 256
    with pytest.raises(ValueError, match="fits no granularity"):
        MoE.from_state_dict(sd, 2)


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


def _deepseek_block(n_shared: int, seed: int):
    """A small transformers DeepseekV3MoE with random weights and correction bias, and its
    config (transformers >= 5, else the test is skipped)."""
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers >= 5")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=256, moe_intermediate_size=128, n_routed_experts=8,
                           num_experts_per_tok=2, n_group=4, topk_group=2,
                           n_shared_experts=n_shared, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    torch.manual_seed(seed)
    block = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
        block.gate.e_score_correction_bias.normal_(0, 0.1)
    return block, cfg


def test_from_hf_fp8_experts():
    from transformers.integrations.finegrained_fp8 import FP8Experts

    block, cfg = _deepseek_block(n_shared=1, seed=10)
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


def _fp8_experts_into(block, cfg):
    """transformers' FP8Experts holding the block's experts quantized in 128x128 blocks, put
    in place of the block's experts."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    fp8 = FP8Experts(cfg, block_size=(128, 128))
    for name in ("gate_up_proj", "down_proj"):
        q, sc = quantize_fp8_per_block(getattr(block.experts, name).detach())
        setattr(fp8, name, torch.nn.Parameter(q, requires_grad=False))
        setattr(fp8, name + "_scale_inv", torch.nn.Parameter(sc, requires_grad=False))
    block.experts = fp8
    return fp8


@pytest.mark.parametrize("block_size", [(128, 128), None])
def test_from_hf_fp8_block_with_an_fp8_shared_expert(block_size):
    """A transformers FP8 checkpoint quantizes the shared expert too (FP8Linear with its
    weight_scale_inv, as replace_with_fp8_linear converts DeepSeek-V3's shared_experts):
    from_hf dequantizes it, as from_state_dict does, instead of refusing its FP8 weights."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from moe_gemm import dequantize_fp8

    block, cfg = _deepseek_block(n_shared=2, seed=21)
    fp8 = _fp8_experts_into(block, cfg)
    dense = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        w = getattr(block.shared_experts, name).weight.detach() * (1 + torch.rand(()))
        if block_size is None:
            q, sc = quantize_fp8_per_tensor(w)
            dense[name] = dequantize_fp8(q, sc, "tensor")
        else:
            q, sc = quantize_fp8_per_block(w)
            dense[name] = dequantize_fp8(q, sc, "block")
        lin = FP8Linear(w.shape[1], w.shape[0], block_size=block_size)
        lin.weight = torch.nn.Parameter(q, requires_grad=False)
        lin.weight_scale_inv = torch.nn.Parameter(sc, requires_grad=False)
        setattr(block.shared_experts, name, lin)
    moe = MoE.from_hf(block)
    assert moe.fp8 == "block" and moe.gate_up_proj is fp8.gate_up_proj
    for name, want in dense.items():
        got = getattr(moe.shared_experts, name).weight
        assert got.dtype == block.gate.weight.dtype and torch.equal(got, want)
    x = _x(seed=22, dtype=torch.float32)
    with torch.no_grad():
        y = moe(x)
    # The reference's shared expert: the dequantized weights, computed here in fp64.
    xd = x.double()
    g, u = xd @ dense["gate_proj"].double().t(), xd @ dense["up_proj"].double().t()
    shared = (torch.nn.functional.silu(g) * u) @ dense["down_proj"].double().t()
    moe.shared_experts = None
    with torch.no_grad():
        routed = moe_fp8_reference(moe, x)
    assert fp8_errors(y, routed.double() + shared)["rel"] < 1e-4  # fp32 compute


def test_from_hf_fp8_shared_expert_takes_the_models_dtype_not_its_fp32_routers():
    """transformers keeps DeepSeek-V3's router in fp32 in a bf16 model
    (_keep_in_fp32_modules_strict): the FP8 shared expert is dequantized into the model's
    bf16, as from_state_dict does, not into the router's fp32 (twice the memory)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from moe_gemm import dequantize_fp8

    _, cfg = _deepseek_block(n_shared=1, seed=31)
    cfg.update(dict(vocab_size=32, num_hidden_layers=1, first_k_dense_replace=0,
                    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))
    block = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).model.layers[0].mlp
    assert block.gate.weight.dtype == torch.float32  # (what this test is about)
    dense = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        w = torch.randn(getattr(block.shared_experts, name).weight.shape) * 0.05
        q, sc = quantize_fp8_per_block(w)
        dense[name] = dequantize_fp8(q, sc, "block").bfloat16()
        lin = FP8Linear(w.shape[1], w.shape[0], block_size=(128, 128))
        lin.weight = torch.nn.Parameter(q, requires_grad=False)
        lin.weight_scale_inv = torch.nn.Parameter(sc, requires_grad=False)
        setattr(block.shared_experts, name, lin)
    moe = MoE.from_hf(block)
    for name, want in dense.items():
        got = getattr(moe.shared_experts, name).weight
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    assert moe.router_weight is block.gate.weight  # the router itself stays as it is


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


@pytest.mark.parametrize("granularity", ["block", "row"])
def test_reset_parameters_of_fp8_experts(granularity):
    # torch draws no FP8 values: reset_parameters raised NotImplementedError (the meta-device
    # recipe to_empty + reset_parameters). The experts are drawn and quantized in place.
    moe = _layer().quantize_fp8(granularity).to("meta").to_empty(device="cpu")
    params = {name: p for name, p in moe.named_parameters()}
    moe.reset_parameters()
    assert dict(moe.named_parameters()) == params  # the same Parameters, filled in
    assert moe.fp8 == granularity and moe.gate_up_proj.dtype == E4M3
    for s in (moe.gate_up_proj_scale_inv, moe.down_proj_scale_inv):
        assert s.dtype == torch.float32 and bool((s > 0).all() and s.isfinite().all())
    # nn.Linear's bound per expert, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), after decoding
    H, I = moe.hidden_size, moe.intermediate_size
    for q, s, fan_in in ((moe.gate_up_proj, moe.gate_up_proj_scale_inv, H),
                         (moe.down_proj, moe.down_proj_scale_inv, I)):
        if granularity == "row":
            w = q.float() * s[..., None]
        else:
            w = q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)
        assert float(w.abs().max()) <= fan_in ** -0.5 * 1.001
        assert float(w.std()) > 0.5 * fan_in ** -0.5 / 3 ** 0.5
    x = _x()
    with torch.no_grad():
        y = moe(x)
        e = fp8_errors(y, moe_fp8_reference(moe, x))
    assert y.shape == x.shape and bool(y.isfinite().all())
    assert e["rel"] < FFN_REL_BOUND, e


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


def test_backward_raises_where_only_expert_weights_or_scales_require_grad():
    """FP8 experts held in Parameters that require grad (torch's default for nn.Parameter, as
    transformers' FP8Experts keeps them): the forward runs; a backward raises the layer's
    inference-only error (it failed inside torch on float8 gradients), also when only the
    scales require grad (the torch backend would differentiate them silently)."""
    moe16 = _layer(seed=15)
    q1, s1 = quantize_fp8_per_block(moe16.gate_up_proj.detach())
    q2, s2 = quantize_fp8_per_block(moe16.down_proj.detach())
    router = moe16.router_weight.detach()
    x = _x(seed=16)
    with torch.no_grad():
        want = MoE.from_fused(q1, q2, router, 2, scales=(s1, s2))(x)
    P = torch.nn.Parameter
    for weights, scales in (((P(q1), P(q2)), (P(s1), P(s2))), ((q1, q2), (P(s1), P(s2)))):
        moe = MoE.from_fused(*weights, router, 2, scales=scales)
        y = moe(x)
        assert y.requires_grad and torch.equal(y, want)
        with pytest.raises(RuntimeError, match="FP8 MoE layer is inference-only"):
            y.float().sum().backward()
        assert all(p.grad is None for p in moe.parameters())


def test_checkpoint_scale_dtypes_and_devices():
    """Weight scales in a float dtype (bf16, fp16, UE8M0) are widened to float32; integer,
    bool or complex ones are a TypeError naming the key (they were taken by .float(), every
    value off by its scale); a scale on another device than its weight is a ValueError (it
    failed inside torch.cat); a 16-bit shared expert weight with a scale is refused as the
    routed experts' are (it was reported as an unused key, or ignored with strict=False)."""
    moe16 = _layer(seed=17, shared=128)
    sd = _deepseek_state_dict(moe16, "inv")
    key = "experts.1.up_proj.weight_scale_inv"
    want = MoE.from_state_dict(sd, 2).gate_up_proj_scale_inv
    pow2 = torch.exp2(torch.round(torch.log2(sd[key])))  # UE8M0 holds powers of two
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e8m0fnu):
        scale = (pow2 if dtype == torch.float8_e8m0fnu else sd[key]).to(dtype)
        got = MoE.from_state_dict({**sd, key: scale}, 2).gate_up_proj_scale_inv
        assert got.dtype == torch.float32
        assert torch.equal(got[1, 1:], scale.float()) and torch.equal(got[0], want[0])
    for bad in (torch.ones(1, 2, dtype=torch.int64), torch.ones(1, 2, dtype=torch.bool),
                torch.ones(1, 2, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="experts.1.up_proj weight scale must be a "
                                            "floating-point decoding scale"):
            MoE.from_state_dict({**sd, key: bad}, 2)
    with pytest.raises(ValueError, match="experts.1.up_proj: weight scale is on meta but its "
                                         "weight is on cpu"):
        MoE.from_state_dict({**sd, key: sd[key].to("meta")}, 2)
    shared = {**sd, "shared_experts.up_proj.weight": moe16.shared_experts.up_proj.weight}
    with pytest.raises(ValueError, match="shared_experts.up_proj has a weight scale but its "
                                         "weight is torch.bfloat16"):
        MoE.from_state_dict(shared, 2, strict=False)
    q1, s1 = quantize_fp8_per_block(moe16.gate_up_proj.detach())
    q2, s2 = quantize_fp8_per_block(moe16.down_proj.detach())
    fused = {"gate.weight": moe16.router_weight.detach(), "experts.gate_up_proj": q1,
             "experts.down_proj": q2, "experts.gate_up_proj_scale_inv": s1.int(),
             "experts.down_proj_scale_inv": s2}
    with pytest.raises(TypeError, match="experts.gate_up_proj_scale_inv must be a "
                                        "floating-point"):
        MoE.from_state_dict(fused, 2, strict=False)


def test_fused_per_tensor_chunk_scales_load():
    """transformers' FP8Experts without weight blocks keep [E, c, 1] scales (one per expert
    for each of c equal row chunks: gate half and up half); from_state_dict reads its fused
    keys as per-channel scales, as from_hf does (it refused them as fitting no
    granularity)."""
    moe16 = _layer(seed=18)
    halves = moe16.gate_up_proj.detach().float().view(8, 2, 128, 256)
    s1 = halves.abs().amax(dim=(2, 3), keepdim=True)[..., 0] / 448.0  # (E, 2, 1)
    q1 = (halves / s1[..., None]).view(8, 256, 256).to(E4M3)
    pairs = [quantize_fp8_per_tensor(w) for w in moe16.down_proj.detach()]
    q2 = torch.stack([q for q, _ in pairs])
    s2 = torch.stack([s for _, s in pairs]).view(8, 1, 1)
    sd = {"gate.weight": moe16.router_weight.detach(), "experts.gate_up_proj": q1,
          "experts.down_proj": q2, "experts.gate_up_proj_scale_inv": s1,
          "experts.down_proj_scale_inv": s2}
    moe = MoE.from_state_dict(sd, 2)
    assert moe.fp8 == "row" and moe.gate_up_proj_scale_inv.shape == (8, 256)
    assert torch.equal(moe.gate_up_proj_scale_inv[:, :128], s1[:, 0].expand(8, 128))
    assert torch.equal(moe.gate_up_proj_scale_inv[:, 128:], s1[:, 1].expand(8, 128))
    x = _x(seed=19)
    with torch.no_grad():
        y = moe(x)
        assert fp8_errors(y, moe_fp8_reference(moe, x))["rel"] < FFN_REL_BOUND
        assert fp8_errors(y, moe16(x))["rel"] < 8e-2
    with pytest.raises(ValueError, match=r"experts.gate_up_proj_scale_inv \(8, 3, 1\) fits no "
                                         "granularity"):
        MoE.from_state_dict({**sd, "experts.gate_up_proj_scale_inv": torch.ones(8, 3, 1)}, 2)


def test_quantize_fp8_row_converts_a_few_experts_at_a_time(monkeypatch):
    """MoE.quantize_fp8('row') keeps its fp32 temporaries to CHUNK_ELEMENTS values (the
    whole layer's at once took several times the weights' size), with the same values."""
    from moe_gemm.ops import quantize

    want = _layer(seed=20).quantize_fp8("row")
    monkeypatch.setattr(quantize, "CHUNK_ELEMENTS", 2 * 256 * 256, raising=False)
    moe = _layer(seed=20)
    with LargestFloat32() as seen:
        moe.quantize_fp8("row")
    assert seen.largest <= 2 * 256 * 256  # two experts' gate_up at a time, of eight
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(moe, name).view(torch.uint8),
                           getattr(want, name).view(torch.uint8))
        assert torch.equal(getattr(moe, name + "_scale_inv"), getattr(want, name + "_scale_inv"))


@pytest.mark.parametrize("H,I", [(64, 96), (128, 96), (64, 128)])
def test_fused_per_tensor_chunk_scales_of_small_experts_load(H, I):
    """A small expert's per-tensor chunk scales [E, c, 1] that also have the 128x128 block
    shape (ceil(2I/128) == 2 chunks with H <= 128; [E, 1, 1] for down) are read as row
    chunks where H or I is not a multiple of 128 (blocks cannot be meant there): they were
    refused as block-scaled experts, while the same scales written [E, 2] / [E] loaded."""
    E = 4
    g = torch.Generator().manual_seed(21)
    gu = torch.randn(E, 2, I, H, generator=g)
    s1 = gu.abs().amax(dim=(2, 3)) / 448.0  # (E, 2): the gate half's and the up half's
    q1 = (gu / s1[..., None, None]).view(E, 2 * I, H).to(E4M3)
    dn = torch.randn(E, H, I, generator=g)
    s2 = dn.abs().amax(dim=(1, 2)) / 448.0  # (E,)
    q2 = (dn / s2[:, None, None]).to(E4M3)
    base = {"gate.weight": torch.randn(E, H, generator=g), "experts.gate_up_proj": q1,
            "experts.down_proj": q2}
    three_d = MoE.from_state_dict({**base, "experts.gate_up_proj_scale_inv": s1[..., None],
                                   "experts.down_proj_scale_inv": s2.view(E, 1, 1)}, 2)
    two_d = MoE.from_state_dict({"gate.weight": base["gate.weight"], "experts.w13_weight": q1,
                                 "experts.w2_weight": q2, "experts.w13_weight_scale": s1,
                                 "experts.w2_weight_scale": s2}, 2)  # (vLLM's [E, 2] / [E])
    assert three_d.fp8 == two_d.fp8 == "row"
    want1 = s1.repeat_interleave(I, dim=1)  # (E, 2I): row r of the gate / up half
    assert torch.equal(three_d.gate_up_proj_scale_inv, want1)
    assert torch.equal(three_d.down_proj_scale_inv, s2[:, None].expand(E, H))
    x = torch.randn(9, H, generator=g)
    with torch.no_grad():
        assert torch.equal(three_d(x), two_d(x))


def test_scales_assigned_to_a_built_layer_are_checked_against_its_weights():
    """FP8 scales set on a built layer are checked by the forward as the loaders check them:
    a scale of another shape failed with an IndexError inside the GEMM, a None one with an
    AttributeError, FP8 weights left without scales were told to cast the layer (which drops
    the scales' values), a bf16 scale was refused as the op's `scale_b`; a sparse scale was
    taken by from_fused and refused by the first forward."""
    moe = _layer(seed=22).quantize_fp8()
    x = _x(seed=23)
    with torch.no_grad():
        want = moe(x)
    good = {n: getattr(moe, n) for n in ("gate_up_proj_scale_inv", "down_proj_scale_inv")}
    P = torch.nn.Parameter
    for name, value, error, pattern in (
            ("down_proj_scale_inv", P(torch.ones(8, 3), requires_grad=False), ValueError,
             r"must be block-wise gate_up \(8, 2, 2\) and down \(8, 2, 1\) .*got \(8, 2, 2\) "
             r"and \(8, 3\)"),
            ("down_proj_scale_inv", None, TypeError, "need their down scale"),
            ("gate_up_proj_scale_inv", None, TypeError, "need their gate_up scale"),
            ("gate_up_proj_scale_inv",
             P(good["gate_up_proj_scale_inv"].detach().bfloat16(), requires_grad=False),
             TypeError, "the gate_up scale must be float32")):
        setattr(moe, name, value)
        with torch.no_grad(), pytest.raises(error, match=pattern):
            moe(x)
        with pytest.raises(error, match=pattern):
            moe.route(x)
        setattr(moe, name, good[name])
    with torch.no_grad():
        assert torch.equal(moe(x), want)
    q1, q2 = moe.gate_up_proj.detach(), moe.down_proj.detach()
    s1, s2 = good["gate_up_proj_scale_inv"].detach(), good["down_proj_scale_inv"].detach()
    router = moe.router_weight.detach()
    with pytest.raises(TypeError, match="the gate_up scale must be a dense"):
        MoE.from_fused(q1, q2, router, 2, scales=(s1.to_sparse(), s2))


def test_from_hf_fp8_experts_with_one_scale_missing_names_it():
    """FP8Experts holding one scale of the two: a ValueError naming the missing one (read as
    16-bit experts, they were refused as having "a custom _apply_gate")."""

    block, cfg = _deepseek_block(n_shared=0, seed=24)
    fp8 = _fp8_experts_into(block, cfg)
    assert MoE.from_hf(block).fp8 == "block"
    fp8.down_proj_scale_inv = None
    with pytest.raises(ValueError, match="down_proj_scale_inv is None"):
        MoE.from_hf(block)


@pytest.mark.parametrize("strict", [True, False])
def test_load_state_dict_refuses_16_bit_experts_into_fp8_and_fp8_into_16_bit(strict):
    """torch's load would cast: 16-bit weights to FP8 codes under the FP8 layer's old scales,
    FP8 codes to bf16 numbers with no scale; with strict=False neither raised (the scale keys
    missing or unexpected), and the layer answered with values off by the scales' factor."""
    plain = _layer()
    fp8 = _layer(seed=3).quantize_fp8()
    before = {k: v.clone() for k, v in fp8.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"gate_up_proj: the state_dict holds a "
                       r"torch.bfloat16 tensor for the layer.s torch.float8_e4m3fn parameter; .*FP8"):
        fp8.load_state_dict(plain.state_dict(), strict=strict)
    after = fp8.state_dict()
    for k in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv"):  # left as they were
        assert after[k].dtype == before[k].dtype
        assert torch.equal(after[k].view(torch.uint8), before[k].view(torch.uint8))
    fp8_sd = _layer(seed=4).quantize_fp8().state_dict()
    plain_w = plain.gate_up_proj.detach().clone()
    with pytest.raises(RuntimeError, match=r"down_proj: the state_dict holds a "
                       r"torch.float8_e4m3fn tensor for the layer.s torch.bfloat16 parameter; .*quantize_fp8"):
        plain.load_state_dict(fp8_sd, strict=strict)
    assert torch.equal(plain.gate_up_proj, plain_w)


def test_load_state_dict_of_an_fp8_layer_into_an_fp8_layer_still_loads():
    src, dst = _layer(seed=5).quantize_fp8(), _layer(seed=6).quantize_fp8()
    dst.load_state_dict(src.state_dict())
    x = _x()
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))
    row_src = _layer(seed=7).quantize_fp8("row")
    with pytest.raises(RuntimeError, match="size mismatch"):  # torch's own check: untouched
        dst.load_state_dict(row_src.state_dict())
