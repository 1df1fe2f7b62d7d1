"""layers/checkpoints.py: every weight loader of the MoE layer (fused tensors, vLLM, state
dicts in per-expert and fused layouts, shared experts) and their checks, on the CPU."""

from __future__ import annotations

import pytest
import torch
from moe_testutils import naive_experts, naive_moe, randomize, rel_err

from moe_gemm.layers.moe import MoE
from moe_gemm.layers.routing import sigmoid_grouped_topk, softmax_topk


def _expert_tensors(E: int = 4, H: int = 32, I: int = 16):
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(E, I, H, generator=g) * 0.3
    up = torch.randn(E, I, H, generator=g) * 0.3
    down = torch.randn(E, H, I, generator=g) * 0.3
    router = torch.randn(E, H, generator=g)
    return gate, up, down, router


def test_from_fused_aliases_storage() -> None:
    gate, up, down, router = _expert_tensors()
    gate_up = torch.cat([gate, up], dim=1)
    moe = MoE.from_fused(gate_up, down, router, 2)
    assert moe.gate_up_proj.data_ptr() == gate_up.data_ptr()
    assert moe.w_gate_up.data_ptr() == gate_up.data_ptr()
    assert moe.w_gate_up.shape == (4, 32, 32) and moe.w_down.shape == (4, 16, 32)
    x = torch.randn(10, 32)
    w, i = softmax_topk(x @ router.T, 2)
    ref = naive_experts(x, i, w, gate_up, down)
    assert rel_err(moe(x), ref) < 1e-5
    # canonical (E, K, N) tensors with transposed=True, and vLLM's names
    t = MoE.from_fused(gate_up.transpose(1, 2), down.transpose(1, 2), router, 2, transposed=True)
    assert t.gate_up_proj.data_ptr() == gate_up.data_ptr()
    torch.testing.assert_close(t(x), moe(x), rtol=0, atol=0)
    v = MoE.from_vllm(gate_up, down, router, 2)
    torch.testing.assert_close(v(x), moe(x), rtol=0, atol=0)
    assert not moe.gate_up_proj.requires_grad


@pytest.mark.parametrize("naming", ["mixtral", "qwen"])
def test_from_state_dict_per_expert(naming: str) -> None:
    gate, up, down, router = _expert_tensors()
    names = ("w1", "w3", "w2") if naming == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    prefix = "model.layers.1.block_sparse_moe." if naming == "mixtral" else "model.layers.1.mlp."
    sd = {prefix + "gate.weight": router, "lm_head.weight": torch.randn(3, 3)}
    for e in range(4):
        sd[f"{prefix}experts.{e}.{names[0]}.weight"] = gate[e]
        sd[f"{prefix}experts.{e}.{names[1]}.weight"] = up[e]
        sd[f"{prefix}experts.{e}.{names[2]}.weight"] = down[e]
    moe = MoE.from_state_dict(sd, 2, prefix=prefix)
    ref = MoE.from_fused(torch.cat([gate, up], dim=1), down, router, 2)
    x = torch.randn(8, 32)
    torch.testing.assert_close(moe(x), ref(x), rtol=0, atol=0)


def test_from_state_dict_deepseek_and_qwen2_shared() -> None:
    gate, up, down, router = _expert_tensors(E=8)
    bias = torch.randn(8) * 0.1
    sg, su, sd_ = torch.randn(24, 32) * 0.3, torch.randn(24, 32) * 0.3, torch.randn(32, 24) * 0.3
    sd = {"gate.weight": router, "gate.e_score_correction_bias": bias,
          "experts.gate_up_proj": torch.cat([gate, up], dim=1), "experts.down_proj": down,
          "shared_experts.gate_proj.weight": sg, "shared_experts.up_proj.weight": su,
          "shared_experts.down_proj.weight": sd_}
    moe = MoE.from_state_dict(sd, 2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert moe.scoring == "sigmoid" and moe.router_fp32
    assert moe.e_score_correction_bias is bias
    assert moe.shared_experts is not None and moe.shared_expert_gate is None
    x = torch.randn(12, 32)
    assert rel_err(moe(x), naive_moe(moe, x)) < 1e-5
    w, i = sigmoid_grouped_topk(x @ router.T, bias, 2, 4, 2, 2.5)
    torch.testing.assert_close(moe.route(x)[1], i, rtol=0, atol=0)

    sdq = {"gate.weight": router, "experts.w13_weight": torch.cat([gate, up], dim=1),
           "experts.w2_weight": down, "shared_expert.gate_proj.weight": sg,
           "shared_expert.up_proj.weight": su, "shared_expert.down_proj.weight": sd_,
           "shared_expert_gate.weight": torch.randn(1, 32)}
    moe = MoE.from_state_dict(sdq, 2, renormalize=False)
    assert moe.scoring == "softmax" and moe.shared_expert_gate is not None
    # Each source tensor in its place (naive_moe reads the loaded layer: a gate/up swap of the
    # shared expert passed the forward check below).
    se = moe.shared_experts
    for got, want in ((se.gate_proj.weight, sg), (se.up_proj.weight, su),
                      (se.down_proj.weight, sd_),
                      (moe.shared_expert_gate.weight, sdq["shared_expert_gate.weight"])):
        assert torch.equal(got, want)
    assert rel_err(moe(x), naive_moe(moe, x)) < 1e-5


def test_from_state_dict_errors() -> None:
    gate, up, down, router = _expert_tensors()
    sd = {"gate.weight": router}
    for e in range(4):
        sd[f"experts.{e}.w1.weight"] = gate[e]
        sd[f"experts.{e}.w3.weight"] = up[e]
        sd[f"experts.{e}.w2.weight"] = down[e]
    with pytest.raises(ValueError, match="does not use"):
        MoE.from_state_dict({**sd, "experts.0.w1.bias": torch.zeros(16)}, 2)
    MoE.from_state_dict({**sd, "experts.0.w1.bias": torch.zeros(16)}, 2, strict=False)
    # ("no" was truthy: strict where declined, then told to pass strict=False)
    with pytest.raises(TypeError, match="strict must be a bool; got 'no'"):
        MoE.from_state_dict({**sd, "experts.0.w1.bias": torch.zeros(16)}, 2, strict="no")
    missing = {k: v for k, v in sd.items() if k != "experts.2.w3.weight"}
    with pytest.raises(ValueError, match=r"expert 2 has no experts\.2\.w3\.weight"):
        MoE.from_state_dict(missing, 2)
    gap = {k: v for k, v in sd.items() if not k.startswith("experts.1.")}
    with pytest.raises(ValueError, match="numbered 0..E-1"):
        MoE.from_state_dict(gap, 2)
    with pytest.raises(KeyError, match="no router weight"):
        MoE.from_state_dict({k: v for k, v in sd.items() if k != "gate.weight"}, 2)
    with pytest.raises(KeyError, match="no expert weights"):
        MoE.from_state_dict({"gate.weight": router}, 2)
    with pytest.raises(ValueError, match="'experts.gate_up_proj' and 'experts.down_proj' go "
                                         "together"):
        MoE.from_state_dict({"gate.weight": router, "experts.gate_up_proj": gate}, 2)


def test_the_layers_own_state_dict_is_named_by_its_own_keys() -> None:
    # A layer's own state_dict without down_proj was reported as missing
    # 'experts.down_proj', a name it does not have.
    own = {"m." + k: v for k, v in MoE(16, 8, 4, 2).state_dict().items()}
    del own["m.down_proj"]
    with pytest.raises(ValueError, match=r"^'m\.gate_up_proj' and 'm\.down_proj' go together$"):
        MoE.from_state_dict(own, 2, prefix="m.")


def test_from_fused_shape_errors() -> None:
    gate, up, down, router = _expert_tensors()
    gu = torch.cat([gate, up], dim=1)
    with pytest.raises(ValueError, match=r"down_proj must be \(E, H, I\) = \(4, 32, 16\)"):
        MoE.from_fused(gu, down.transpose(1, 2), router, 2)
    with pytest.raises(ValueError, match=r"router_weight must be \(E, H\) = \(4, 32\)"):
        MoE.from_fused(gu, down, router[:3], 2)
    with pytest.raises(ValueError, match=r"gate_up_proj must be \(E, 2I, H\)"):
        MoE.from_fused(gu[:, :-1], down, router, 2)
    with pytest.raises(TypeError, match="both of one dtype.*got gate_up_proj torch.float32 "
                                        "and down_proj torch.float64"):
        MoE.from_fused(gu, down.double(), router, 2)
    with pytest.raises(TypeError, match="must be bf16, fp16 or fp32.*gate_up_proj torch.float64"):
        MoE.from_fused(gu.double(), down.double(), router.double(), 2)
    with pytest.raises(TypeError, match="prefix must be a str"):
        MoE.from_state_dict(MoE.from_fused(gu, down, router, 2).state_dict(), 2, prefix=None)
    with pytest.raises(ValueError, match="top_k must be in"):
        MoE.from_fused(gu, down, router, 5)
    with pytest.raises(ValueError, match=r"shared\['up_proj'\] must be \(8, 32\)"):
        MoE.from_fused(gu, down, router, 2, shared={
            "gate_proj": torch.zeros(8, 32), "up_proj": torch.zeros(8, 31),
            "down_proj": torch.zeros(32, 8)})


def test_state_dict_round_trip() -> None:
    moe = randomize(MoE(32, 16, 8, 2, scoring="sigmoid", n_group=2, topk_group=1,
                         shared_intermediate_size=8))
    copy = MoE(32, 16, 8, 2, scoring="sigmoid", n_group=2, topk_group=1,
               shared_intermediate_size=8)
    copy.load_state_dict(moe.state_dict())
    x = torch.randn(6, 32)
    torch.testing.assert_close(copy(x), moe(x), rtol=0, atol=0)
    assert set(moe.state_dict()) == {
        "router_weight", "gate_up_proj", "down_proj", "e_score_correction_bias",
        "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight",
    }


@pytest.mark.parametrize("options,layer_only", [
    ({}, {}),
    ({"scoring": "sigmoid", "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5},
     {"shared_intermediate_size": 8}),
    ({"renormalize": False}, {"shared_intermediate_size": 8, "shared_expert_gate": True}),
])
def test_from_state_dict_reads_the_layers_own_state_dict(options, layer_only) -> None:
    # MoE.state_dict() is a layout users have: from_state_dict builds the same layer from it
    # (the routing options passed, as for any checkpoint), aliasing its tensors.
    moe = randomize(MoE(32, 16, 8, 2, **options, **layer_only))
    prefix = "model.layers.3.mlp."
    sd = {prefix + k: v for k, v in moe.state_dict().items()}
    sd["model.layers.3.input_layernorm.weight"] = torch.ones(32)  # (outside the prefix)
    back = MoE.from_state_dict(sd, 2, prefix=prefix, **options)
    assert set(back.state_dict()) == set(moe.state_dict())
    assert back.gate_up_proj.data_ptr() == moe.gate_up_proj.data_ptr()
    x = torch.randn(6, 32, dtype=torch.float64)
    ref = naive_moe(moe, x.float()).double()
    assert rel_err(back(x.float()).double(), ref) < 1e-5
    torch.testing.assert_close(back(x.float()), moe(x.float()), rtol=0, atol=0)


@pytest.mark.parametrize("shared", [0, 8], ids=["routed-only", "shared-expert"])
def test_from_state_dict_loads_a_module_activation(shared: int) -> None:
    # A layer built with a module activation that has a parameter (nn.PReLU's slope): its
    # state_dict held the slope under "activation.weight" (and, with a shared expert, again
    # under "shared_experts.activation.weight"), which the strict loader refused as keys it
    # does not use. Loaded now into the module passed as activation=, aliased.
    moe = randomize(MoE(32, 16, 8, 2, activation=torch.nn.PReLU(),
                        shared_intermediate_size=shared))
    with torch.no_grad():
        moe.activation.weight.uniform_(0.05, 0.6)
    sd = moe.state_dict()
    back = MoE.from_state_dict(sd, 2, activation=torch.nn.PReLU())
    assert set(back.state_dict()) == set(sd)
    assert back.activation.weight.data_ptr() == moe.activation.weight.data_ptr()
    x = torch.randn(11, 32)
    torch.testing.assert_close(back(x), moe(x), rtol=0, atol=0)
    # A state dict that still has the duplicate (saved before) loads the same way.
    old = {**sd, "shared_experts.activation.weight": sd["activation.weight"].clone()}
    if shared:
        torch.testing.assert_close(MoE.from_state_dict(old, 2, activation=torch.nn.PReLU())(x),
                                   moe(x), rtol=0, atol=0)
    # Without a module to load it into: named under strict, ignored without.
    with pytest.raises(ValueError, match=r"\['activation.weight'\] are a module activation's "
                                         r"state .* pass such a module as activation="):
        MoE.from_state_dict(sd, 2)
    assert MoE.from_state_dict(sd, 2, strict=False).activation == "silu"
    with pytest.raises(ValueError, match=r"(?s)activation module PReLU does not take the state "
                                         r"under 'activation\.'.*size mismatch"):
        MoE.from_state_dict(sd, 2, activation=torch.nn.PReLU(num_parameters=16))


def test_from_state_dict_reads_an_fp8_layers_own_state_dict() -> None:
    moe = randomize(MoE(256, 128, 4, 2))
    moe.quantize_fp8("block")
    back = MoE.from_state_dict(moe.state_dict(), 2)
    assert back.fp8 == "block"
    x = torch.randn(5, 256)
    torch.testing.assert_close(back(x), moe(x), rtol=0, atol=0)


def test_from_fused_checks_the_shared_weights() -> None:
    E, H, I, Is = 4, 16, 8, 6
    gu, dn, rw = torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(E, H)
    shared = {"gate_proj": torch.randn(Is, H).half(), "up_proj": torch.randn(Is, H),
              "down_proj": torch.randn(H, Is)}
    with pytest.raises(TypeError, match="shared gate_proj, up_proj and down_proj must share"):
        MoE.from_fused(gu, dn, rw, 2, shared=shared)
    shared["gate_proj"] = torch.randn(Is, H, device="meta")
    with pytest.raises(ValueError, match=r"shared\['gate_proj'\] is on meta"):
        MoE.from_fused(gu, dn, rw, 2, shared=shared)
    shared["gate_proj"] = [[0.0]]
    with pytest.raises(TypeError, match=r"shared\['gate_proj'\] must be a torch.Tensor"):
        MoE.from_fused(gu, dn, rw, 2, shared=shared)
    # Not a mapping: set() of an int raised Python's own TypeError, of a str named its letters.
    for bad in (5, "gate_proj", ["gate_proj"]):
        with pytest.raises(TypeError, match="shared must be a mapping of names to tensors"):
            MoE.from_fused(gu, dn, rw, 2, shared=bad)  # type: ignore[arg-type]


def test_from_fused_refuses_sparse_and_nested_expert_weights() -> None:
    # A sparse expert weight was accepted and refused only by the first forward, as the
    # grouped GEMM's operand `w`; a nested one raised torch's internal RuntimeError when
    # its shape was read. Both are a TypeError naming the loader's argument now.
    E, H, I = 4, 16, 8
    gu, dn, rw = torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(E, H)
    with pytest.raises(TypeError, match=r"gate_up_proj must be a dense \(strided\) tensor; "
                                        r"got layout torch.sparse_coo"):
        MoE.from_fused(gu.to_sparse(), dn, rw, 2)
    with pytest.raises(TypeError, match=r"down_proj must be a dense \(strided\) tensor; "
                                        r"got layout torch.sparse_coo"):
        MoE.from_vllm(gu, dn.to_sparse(), rw, 2)
    nested = torch.nested.nested_tensor(list(gu), layout=torch.jagged)
    with pytest.raises(TypeError, match=r"gate_up_proj must be a dense \(strided\) tensor; "
                                        r"got a nested tensor"):
        MoE.from_fused(nested, dn, rw, 2)
    Is = 6
    shared = {"gate_proj": torch.nested.nested_tensor(list(torch.randn(2, Is // 2, H)),
                                                      layout=torch.jagged),
              "up_proj": torch.randn(Is, H), "down_proj": torch.randn(H, Is)}
    with pytest.raises(TypeError, match=r"shared\['gate_proj'\] must be a dense \(strided\) "
                                        r"tensor; got a nested tensor"):
        MoE.from_fused(gu, dn, rw, 2, shared=shared)


def _per_expert_sd(E: int = 4, H: int = 32, I: int = 16) -> dict:
    gate, up, down, router = _expert_tensors(E, H, I)
    sd = {"gate.weight": router}
    for e in range(E):
        sd[f"experts.{e}.w1.weight"] = gate[e]
        sd[f"experts.{e}.w3.weight"] = up[e]
        sd[f"experts.{e}.w2.weight"] = down[e]
    return sd


@pytest.mark.parametrize(
    "key,value,exc,pattern",
    [
        # one expert of another size: torch.stack's bare RuntimeError before
        ("experts.3.w1.weight", torch.zeros(17, 32), ValueError,
         r"inconsistent shapes: experts\.3\.w1\.weight is \(17, 32\), expected \(16, 32\)"),
        ("experts.3.w2.weight", torch.zeros(32, 17), ValueError,
         r"inconsistent shapes: experts\.3\.w2\.weight is \(32, 17\), expected \(32, 16\)"),
        # gate and up of one expert disagreeing: torch.cat gave a wrong 2I silently
        ("experts.0.w3.weight", torch.zeros(15, 32), ValueError,
         r"inconsistent shapes: experts\.0\.w3\.weight is \(15, 32\)"),
        ("experts.0.w1.weight", torch.zeros(16, 32, 1), ValueError,
         r"experts\.0\.w1\.weight must be 2-D \(I, H\)"),
        # mixed dtypes: torch.cat / stack promoted them silently
        ("experts.2.w3.weight", torch.zeros(16, 32, dtype=torch.float16), ValueError,
         r"inconsistent dtypes: experts\.2\.w3\.weight is torch\.float16 but "
         r"experts\.0\.w1\.weight is torch\.float32"),
        # one expert, or one projection of an expert, on another device (a partly moved
        # checkpoint): torch.stack / torch.cat's RuntimeError before
        ("experts.2.w2.weight", torch.zeros(32, 16, device="meta"), ValueError,
         r"inconsistent devices: experts\.2\.w2\.weight is on meta but experts\.0\.w1\.weight "
         r"is on cpu"),
        ("experts.0.w3.weight", torch.zeros(16, 32, device="meta"), ValueError,
         r"inconsistent devices: experts\.0\.w3\.weight is on meta"),
        ("experts.3.w1.weight", [[0.0] * 32] * 16, TypeError,
         r"state_dict\['experts\.3\.w1\.weight'\] must be a torch\.Tensor; got list"),
        ("gate.weight", [[0.0] * 32] * 4, TypeError,
         r"state_dict\['gate\.weight'\] must be a torch\.Tensor; got list"),
        ("gate.weight", torch.zeros(4, 32, dtype=torch.int32), TypeError,
         "router_weight must be a floating-point tensor"),
    ],
)
def test_from_state_dict_rejects_inconsistent_experts(key: str, value: object,
                                                      exc: type[Exception], pattern: str) -> None:
    sd = _per_expert_sd()
    sd[key] = value
    with pytest.raises(exc, match=pattern):
        MoE.from_state_dict(sd, 2)


@pytest.mark.parametrize("strict", [True, False])
def test_from_state_dict_names_an_experts_missing_gate_weight(strict: bool) -> None:
    # The experts were counted by their gate weights alone: the last expert's up and down
    # weights were refused as unused keys (strict) or the router as of another size.
    sd = _per_expert_sd()
    del sd["experts.3.w1.weight"]
    with pytest.raises(ValueError, match=r"expert 3 has no experts\.3\.w1\.weight"):
        MoE.from_state_dict(sd, 2, strict=strict)


def test_from_state_dict_names_the_full_key() -> None:
    sd = {"mlp." + k: v for k, v in _per_expert_sd().items()}
    sd["mlp.experts.1.w2.weight"] = torch.zeros(32, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"mlp\.experts\.1\.w2\.weight is torch\.bfloat16 "
                                         r"but mlp\.experts\.0\.w1\.weight is torch\.float32"):
        MoE.from_state_dict(sd, 2, prefix="mlp.")


def test_from_state_dict_rejects_two_shared_expert_prefixes() -> None:
    sd = _per_expert_sd()
    for base in ("shared_experts.", "shared_expert."):
        sd[base + "gate_proj.weight"] = torch.zeros(8, 32)
        sd[base + "up_proj.weight"] = torch.zeros(8, 32)
        sd[base + "down_proj.weight"] = torch.zeros(32, 8)
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"both 'shared_experts\.' .* and "
                                             r"'shared_expert\.' .* keys are present"):
            MoE.from_state_dict(sd, 2, strict=strict)


def test_from_fused_validates_bias_scales_and_router() -> None:
    gate, up, down, router = _expert_tensors()
    gu = torch.cat([gate, up], dim=1)
    kw = {"scoring": "sigmoid"}
    with pytest.raises(TypeError, match="e_score_correction_bias must be a torch.Tensor"):
        MoE.from_fused(gu, down, router, 2, e_score_correction_bias=[0.0] * 4, **kw)
    with pytest.raises(TypeError, match="e_score_correction_bias must be a float tensor"):
        MoE.from_fused(gu, down, router, 2, e_score_correction_bias=torch.zeros(4).long(), **kw)
    with pytest.raises(ValueError, match=r"e_score_correction_bias must be \(E,\) = \(4,\)"):
        MoE.from_fused(gu, down, router, 2, e_score_correction_bias=torch.zeros(5), **kw)
    with pytest.raises(ValueError, match="e_score_correction_bias is on meta"):
        MoE.from_fused(gu, down, router, 2, **kw,
                       e_score_correction_bias=torch.zeros(4, device="meta"))
    pair = "scales must be None or a pair of tensors"
    s1, s2 = torch.ones(4, 32), torch.ones(4, 32)
    for scales, exc in ((s1, TypeError), ((s1,), ValueError), ((s1, s2, s2), ValueError),
                        ((None, None), TypeError), ((s1, "s"), TypeError)):
        for transposed in (False, True):
            g, d = (gu.transpose(1, 2), down.transpose(1, 2)) if transposed else (gu, down)
            with pytest.raises(exc, match=pair):
                MoE.from_fused(g, d, router, 2, scales=scales, transposed=transposed)
    with pytest.raises(TypeError, match="transposed must be a bool"):
        MoE.from_fused(gu, down, router, 2, transposed="yes")
    for dtype in (torch.int64, torch.bool, torch.complex64):
        with pytest.raises(TypeError, match="router_weight must be a floating-point tensor"):
            MoE.from_fused(gu, down, router.to(dtype), 2)
    # what stays accepted: a half-precision bias, an fp64 router
    moe = MoE.from_fused(gu, down, router.double(), 2, e_score_correction_bias=torch.zeros(4).half(),
                         **kw)
    assert moe(torch.randn(3, 32)).shape == (3, 32)


def test_a_correction_bias_given_as_a_parameter_stays_a_buffer() -> None:
    # Ernie-4.5-MoE and Laguna keep e_score_correction_bias as an nn.Parameter: the layer
    # filed it under its parameters (in an optimizer over moe.parameters(), trained by
    # requires_grad_()), where the class documents a buffer as the loaders otherwise make.
    gate, up, down, router = _expert_tensors()
    gu = torch.cat([gate, up], dim=1)
    bias = torch.nn.Parameter(torch.randn(4) * 0.1, requires_grad=False)
    sd = {"gate.weight": router, "gate.e_score_correction_bias": bias,
          "experts.gate_up_proj": gu, "experts.down_proj": down}
    for moe in (MoE.from_fused(gu, down, router, 2, e_score_correction_bias=bias),
                MoE.from_state_dict(sd, 2)):
        assert [n for n, _ in moe.named_buffers()] == ["e_score_correction_bias"]
        assert "e_score_correction_bias" not in dict(moe.named_parameters())
        assert moe.e_score_correction_bias.data_ptr() == bias.data_ptr()  # still aliased
        moe.requires_grad_(True)
        assert not moe.e_score_correction_bias.requires_grad
        x = torch.randn(6, 32)
        with torch.no_grad():
            bias[1] = 5.0  # an in-place update of the source shows in the layer
            _, ids = moe.route(x)
        assert bool((ids == 1).any(dim=-1).all())
        with torch.no_grad():
            assert rel_err(moe(x), naive_moe(moe, x)) < 1e-5
        assert set(moe.state_dict()) == {"router_weight", "e_score_correction_bias",
                                         "gate_up_proj", "down_proj"}


@pytest.mark.parametrize("option", [{"dtype": torch.bfloat16}, {"dtype": torch.float32},
                                    {"device": "cpu"}, {"shared_intermediate_size": 8},
                                    {"shared_expert_gate": True}])
def test_loaders_refuse_options_the_tensors_decide(option: dict) -> None:
    # The loaders alias the given tensors: a dtype or device asked for would be silently
    # ignored (the layer keeping the tensors' own), and the shared expert's sizes come from
    # `shared`; each is a TypeError naming what decides instead.
    gate, up, down, router = _expert_tensors()
    gu = torch.cat([gate, up], dim=1)
    name = next(iter(option))
    with pytest.raises(TypeError, match=f"{name} .*given tensors"):
        MoE.from_fused(gu, down, router, 2, **option)
    sd = {"gate.weight": router, "experts.gate_up_proj": gu, "experts.down_proj": down}
    with pytest.raises(TypeError, match=f"{name} .*given tensors"):
        MoE.from_state_dict(sd, 2, **option)
    # what the loaders do take: the layer cast or moved after loading
    moe = MoE.from_fused(gu, down, router, 2).to(torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    assert moe.gate_up_proj.dtype == torch.bfloat16 and moe(x).dtype == torch.bfloat16
