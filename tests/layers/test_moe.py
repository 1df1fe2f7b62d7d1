"""layers/moe.py and layers/experts.py on the CPU: the layer and the functional forms against
a naive per-token loop, edge cases, the inference-only contract and the argument checks (the
loaders: test_checkpoints.py)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from moe_testutils import naive_experts, naive_moe, near_tie_sigmoid_moe, randomize, rel_err

from moe_gemm import GemmConfig
from moe_gemm.layers.moe import GatedMLP, MoE, moe_experts, moe_forward
from moe_gemm.layers.routing import sigmoid_grouped_topk, softmax_topk
from moe_gemm.testing import assert_close_to_ref, calc_diff

CONFIGS = [
    pytest.param(dict(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2), id="mixtral"),
    pytest.param(
        dict(hidden_size=48, intermediate_size=24, num_experts=6, top_k=3, renormalize=False),
        id="qwen-no-renorm",
    ),
    pytest.param(
        dict(hidden_size=64, intermediate_size=40, num_experts=16, top_k=4, scoring="sigmoid",
             n_group=4, topk_group=2, routed_scaling_factor=2.5, shared_intermediate_size=32),
        id="deepseek",
    ),
    pytest.param(
        dict(hidden_size=40, intermediate_size=48, num_experts=12, top_k=2,
             shared_intermediate_size=20, shared_expert_gate=True, activation="gelu"),
        id="qwen2-shared-gelu",
    ),
    pytest.param(
        dict(hidden_size=32, intermediate_size=16, num_experts=4, top_k=1, activation="gelu_tanh"),
        id="top1-gelu-tanh",
    ),
    pytest.param(
        dict(hidden_size=36, intermediate_size=20, num_experts=5, top_k=5, renormalize=False),
        id="topk-equals-E",
    ),
]


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_layer_matches_naive_fp32(cfg: dict, T: int) -> None:
    moe = randomize(MoE(**cfg))
    x = torch.randn(T, cfg["hidden_size"])
    y = moe(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert rel_err(y, naive_moe(moe, x)) < 1e-5


def test_layer_keeps_leading_dims() -> None:
    moe = randomize(MoE(32, 16, 8, 2))
    x = torch.randn(3, 5, 32)
    y = moe(x)
    assert y.shape == (3, 5, 32)
    assert rel_err(y, naive_moe(moe, x)) < 1e-5
    torch.testing.assert_close(y.reshape(15, 32), moe(x.reshape(15, 32)), rtol=0, atol=0)


def test_callable_activation() -> None:
    moe = randomize(MoE(32, 16, 8, 2, activation=torch.tanh))
    x = torch.randn(9, 32)
    assert rel_err(moe(x), naive_moe(moe, x)) < 1e-5
    # the repr names the function (it read activation='builtin_function_or_method')
    assert "activation='tanh'" in repr(moe)
    assert "activation='relu'" in repr(MoE(32, 16, 8, 2, activation=F.relu))
    assert "activation='GELU'" in repr(MoE(32, 16, 8, 2, activation=torch.nn.GELU()))


def test_experts_without_tokens_and_single_token() -> None:
    # 16 experts, 2 tokens, top-1: at least 14 experts are empty
    moe = randomize(MoE(32, 16, 16, 1))
    x = torch.randn(2, 32)
    _, ids = moe.route(x)
    assert len(set(ids.reshape(-1).tolist())) <= 2
    assert rel_err(moe(x), naive_moe(moe, x)) < 1e-5
    one = torch.randn(1, 32)
    assert rel_err(moe(one), naive_moe(moe, one)) < 1e-5


def test_all_tokens_to_one_expert() -> None:
    moe = randomize(MoE(32, 16, 8, 2, scoring="sigmoid", renormalize=True))
    with torch.no_grad():
        assert moe.e_score_correction_bias is not None
        moe.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 50.0, 0, 0, 50.0, 0]))
    x = torch.randn(20, 32)
    _, ids = moe.route(x)
    assert sorted(set(ids.reshape(-1).tolist())) == [3, 6]
    assert rel_err(moe(x), naive_moe(moe, x)) < 1e-5


def test_zero_tokens() -> None:
    moe = randomize(MoE(32, 16, 8, 2, shared_intermediate_size=8))
    y = moe(torch.randn(0, 32))
    assert y.shape == (0, 32)
    assert moe(torch.randn(2, 0, 32)).shape == (2, 0, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_two_x_rule(dtype: torch.dtype) -> None:
    moe32 = randomize(MoE(64, 32, 8, 2, shared_intermediate_size=16))
    moe = MoE(64, 32, 8, 2, shared_intermediate_size=16, dtype=dtype)
    moe.load_state_dict({k: v.to(dtype) for k, v in moe32.state_dict().items()})
    x = torch.randn(50, 64).to(dtype)
    y = moe(x)
    assert y.dtype == dtype
    # reference: the same (low-precision) weights and routing, in float64
    ref = naive_moe(moe, x)
    # baseline: transformers' eager arithmetic in the low precision (per expert F.linear,
    # weighted index_add_ in the output dtype)
    x2 = x.reshape(-1, 64)
    weights, ids = moe.route(x2)
    base = torch.zeros_like(x2)
    for e in range(moe.num_experts):
        tok, slot = torch.where(ids == e)
        gate, up = F.linear(x2[tok], moe.gate_up_proj[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, moe.down_proj[e]) * weights[tok, slot, None].to(dtype)
        base.index_add_(0, tok, h.to(dtype))
    base = base + moe.shared_experts(x2)
    # Two chained GEMMs round three intermediates, so even torch's own bf16 result sits above
    # the single-GEMM calc_diff ceiling of 1e-5: hold calc_diff to the same 2x rule.
    max_diff = max(1e-5, 2 * calc_diff(base, ref))
    assert_close_to_ref(y, ref, base, max_calc_diff=max_diff, name=f"MoE {dtype}")


# ---------------------------------------------------------------------------------------------
# functional forms


def test_moe_experts_matches_naive_and_drops_sentinels() -> None:
    T, H, I, E, k = 11, 32, 24, 6, 3
    x = torch.randn(T, H)
    gate_up = torch.randn(E, 2 * I, H) * 0.3
    down = torch.randn(E, H, I) * 0.3
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    ids[0, 1] = E  # expert-parallel sentinel: not a local expert
    ids[4, 0] = -1
    ids[7, 2] = E + 3
    weights = torch.rand(T, k)
    y = moe_experts(x, ids, weights, gate_up.transpose(1, 2), down.transpose(1, 2))
    assert rel_err(y, naive_experts(x, ids, weights, gate_up, down)) < 1e-5
    # int32 ids, a contiguous (E, K, N) layout and a forced torch backend give the same
    y2 = moe_experts(
        x, ids.int(), weights, gate_up.transpose(1, 2).contiguous(),
        down.transpose(1, 2).contiguous(), config=GemmConfig(backend="torch"),
    )
    torch.testing.assert_close(y2, y, rtol=1e-6, atol=1e-6)


def test_moe_forward_names_the_correction_bias_in_its_errors() -> None:
    # Checked only inside routing, whose messages spoke of 'bias' and the logits.
    x, rw = torch.randn(3, 16), torch.randn(4, 16)
    wgu, wd = torch.randn(4, 16, 16), torch.randn(4, 8, 16)
    for bias, exc, words in ((torch.randn(5), ValueError,
                              r"^correction_bias must be \(E,\) = \(4,\); got shape \(5,\)$"),
                             (torch.randn(4, device="meta"), ValueError,
                              "^correction_bias is on meta but x is on cpu$"),
                             ([0.0] * 4, TypeError, "^correction_bias must be a torch.Tensor")):
        with pytest.raises(exc, match=words):
            moe_forward(x, rw, wgu, wd, 2, scoring="sigmoid", correction_bias=bias)


def test_moe_forward_matches_module() -> None:
    moe = randomize(MoE(32, 16, 8, 3, scoring="sigmoid", n_group=4, topk_group=2,
                         routed_scaling_factor=1.7))
    x = torch.randn(13, 32)
    y = moe_forward(
        x, moe.router_weight, moe.w_gate_up, moe.w_down, 3, scoring="sigmoid", n_group=4,
        topk_group=2, routed_scaling_factor=1.7, correction_bias=moe.e_score_correction_bias,
    )
    torch.testing.assert_close(y, moe(x), rtol=0, atol=0)
    assert rel_err(y, naive_moe(moe, x)) < 1e-5
    # softmax routing, checked against the router function and the naive experts
    x = torch.randn(9, 32)
    y = moe_forward(x, moe.router_weight, moe.w_gate_up, moe.w_down, 2, renormalize=False)
    w, i = softmax_topk(F.linear(x, moe.router_weight), 2, False)
    assert rel_err(y, naive_experts(x, i, w, moe.gate_up_proj, moe.down_proj)) < 1e-5


def test_router_precision_follows_transformers() -> None:
    # bf16 Mixtral/Qwen compute logits in bf16, DeepSeek in fp32: check both paths are used
    moe = MoE(32, 16, 8, 2, dtype=torch.bfloat16)
    x = torch.randn(40, 32).to(torch.bfloat16)
    w, i = moe.route(x)
    w_ref, i_ref = softmax_topk(F.linear(x, moe.router_weight), 2)
    assert torch.equal(i, i_ref) and torch.equal(w, w_ref)
    moe = MoE(32, 16, 8, 2, scoring="sigmoid", dtype=torch.bfloat16)
    w, i = moe.route(x)
    logits = F.linear(x.float(), moe.router_weight.float())
    w_ref, i_ref = sigmoid_grouped_topk(logits, moe.e_score_correction_bias, 2)
    assert torch.equal(i, i_ref) and torch.equal(w, w_ref)


def test_route_takes_forward_input_and_names_bad_input() -> None:
    # [B, S, H] is flattened to T tokens as transformers' routers do; a wrong H or dtype is
    # named as forward names it (it failed with a message about 2-D logits, or in F.linear).
    moe = MoE(32, 16, 8, 2, scoring="sigmoid", n_group=4, topk_group=2)
    x = torch.randn(2, 5, 32)
    w, i = moe.route(x)
    logits = F.linear(x.reshape(-1, 32).double(), moe.router_weight.double())
    scores = logits.sigmoid()
    assert w.shape == i.shape == (10, 2)
    chosen = scores.gather(1, i)
    torch.testing.assert_close(w.double(), chosen / chosen.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match=r"hidden_states must be \(\.\.\., H\) = \(\.\.\., 32\)"):
        moe.route(torch.randn(4, 31))
    with pytest.raises(TypeError, match="hidden_states must be torch.bfloat16"):
        moe.route(torch.ones(4, 32, dtype=torch.long))


def test_correction_bias_keeps_float32_under_casts() -> None:
    # The selection-only bias stays float32 under module.to(dtype) / .half() (as transformers
    # keeps it): the selection then matches the float32 layer's, with the router in bf16 values.
    moe = near_tie_sigmoid_moe(64, 16)
    x = torch.randn(256, 64).bfloat16()
    _, want = moe.route(x.float())
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.float()):
        moe = cast(moe)
        assert moe.e_score_correction_bias.dtype == torch.float32
        _, ids = moe.route(x.to(moe.router_weight.dtype))
        assert torch.equal(ids.sort(-1)[0], want.sort(-1)[0])
    moe.to("meta")  # device moves still apply
    assert moe.e_score_correction_bias.device.type == "meta"


# ---------------------------------------------------------------------------------------------
# inference only


def test_backward_raises() -> None:
    moe = randomize(MoE(32, 16, 8, 2))
    assert not any(p.requires_grad for p in moe.parameters())
    x = torch.randn(5, 32, requires_grad=True)
    y = moe(x)
    assert y.requires_grad  # the forward runs; only the backward is refused
    with pytest.raises(RuntimeError, match="inference-only"):
        y.sum().backward()
    moe.requires_grad_(True)
    y = moe(torch.randn(5, 32))
    with pytest.raises(RuntimeError, match="inference-only"):
        y.sum().backward()
    with torch.no_grad():
        assert not moe(x).requires_grad
    with torch.inference_mode():
        assert rel_err(moe(x), naive_moe(moe, x.detach())) < 1e-5
    g = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference-only"):
        moe_experts(torch.randn(4, 32), torch.zeros(4, 3, dtype=torch.long), g,
                    moe.w_gate_up.detach(), moe.w_down.detach()).sum().backward()


def test_a_trainable_shared_expert_gets_its_gradients() -> None:
    """The docstring's contract: only the routed path refuses a backward; a shared expert made
    trainable (a frozen routed part, a tuned shared part) is plain torch and gets gradients,
    those of the same module in the naive layer."""
    moe = randomize(MoE(32, 16, 8, 2, shared_intermediate_size=24, dtype=torch.float32))
    moe.shared_experts.requires_grad_(True)
    x, g = torch.randn(5, 32), torch.randn(5, 32)
    moe(x).backward(g)
    got = [p.grad.clone() for p in moe.shared_experts.parameters()]
    moe.zero_grad(set_to_none=True)
    naive_moe(moe, x).backward(g)
    want = [p.grad for p in moe.shared_experts.parameters()]
    assert len(got) == 3
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5
    with pytest.raises(RuntimeError, match="inference-only"):  # the routed path still refuses
        moe(x.clone().requires_grad_(True)).sum().backward()


def test_backward_raises_under_torch_func() -> None:
    """Under torch.vmap the result went unlinked (a BatchedTensor reports requires_grad=False):
    a backward ran through torch's ops and left a gradient in x.grad; with the weights
    requiring grad, and under grad / vjp / jacrev, the forward failed with torch's complaint
    about an autograd.Function without setup_context. Now each raises the layer's own error,
    and vmap's values are the layer's."""
    moe = randomize(MoE(32, 16, 8, 2)).eval()
    x = torch.randn(3, 5, 32)
    want = naive_moe(moe, x.reshape(-1, 32)).reshape(3, 5, 32)
    xr = x.clone().requires_grad_(True)
    y = torch.func.vmap(moe)(xr)
    assert_close_to_ref(y.detach(), want, name="vmap, x requires grad")
    with pytest.raises(RuntimeError, match="inference-only"):
        y.sum().backward()
    assert xr.grad is None
    for transform in (torch.func.grad, torch.func.jacrev):
        with pytest.raises(RuntimeError, match="inference-only"):
            transform(lambda t: moe(t).sum())(x[0])
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.func.vjp(moe, x[0])
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.func.vmap(torch.func.grad(lambda t: moe(t).sum()))(x)
    moe.requires_grad_(True)
    y = torch.func.vmap(moe)(x)
    assert_close_to_ref(y.detach(), want, name="vmap, weights require grad")
    with pytest.raises(RuntimeError, match="inference-only"):
        y.sum().backward()
    assert all(p.grad is None for p in moe.parameters())
    with torch.no_grad():
        assert not torch.func.vmap(moe)(xr).requires_grad
    fp8 = MoE(128, 128, 4, 2).quantize_fp8()
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.func.grad(lambda t: fp8(t).sum())(torch.randn(3, 128))
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.func.vmap(fp8)(torch.randn(2, 3, 128, requires_grad=True)).sum().backward()


def test_forward_mode_ad_raises_the_layers_error() -> None:
    """jvp / jacfwd or a forward_ad dual tensor through the layer failed inside torch with
    "_embedding_bag ... forward AD not implemented"; now with the layer's own message."""
    import torch.autograd.forward_ad as fwad

    moe = randomize(MoE(32, 16, 8, 2)).requires_grad_(False)
    x = torch.randn(5, 32)
    for call in (lambda: torch.func.jvp(moe, (x,), (torch.randn_like(x),)),
                 lambda: torch.func.jacfwd(moe)(x[:2])):
        with pytest.raises(RuntimeError, match="inference-only"):
            call()
    with fwad.dual_level():
        dual = fwad.make_dual(x, torch.randn_like(x))
        with pytest.raises(RuntimeError, match="inference-only"):
            moe(dual)
        assert moe(x).shape == (5, 32)  # (a plain tensor at an open level runs)
    fp8 = MoE(128, 128, 4, 2).quantize_fp8().requires_grad_(False)
    xf = torch.randn(3, 128)
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.func.jvp(fp8, (xf,), (torch.randn_like(xf),))


# ---------------------------------------------------------------------------------------------
# argument checks


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        ({"top_k": 9}, ValueError, r"top_k must be in \[1, num_experts=8\]"),
        ({"top_k": 0}, ValueError, "top_k must be in"),
        ({"num_experts": 0}, ValueError, "num_experts must be >= 1"),
        ({"scoring": "relu"}, ValueError, "scoring must be 'softmax', 'sigmoid' or 'sqrtsoftplus'"),
        ({"n_group": 3}, ValueError, "divide E=8"),
        ({"n_group": 8, "topk_group": 2}, ValueError, "E / n_group must be >= 2"),
        ({"n_group": 4, "topk_group": 1, "top_k": 3}, ValueError, "cannot be chosen"),
        ({"scoring": "sigmoid", "n_group": 3}, ValueError, "divide E=8"),
        ({"scoring": "sigmoid", "n_group": 4, "topk_group": 5}, ValueError, "topk_group"),
        ({"correction_bias": True}, ValueError, "correction_bias is used by scoring='sigmoid'"),
        ({"activation": "relu3"}, ValueError, "activation must be one of"),
        ({"activation": 3}, TypeError, "activation must be a str or a callable"),
        ({"shared_expert_gate": True}, ValueError, "needs a shared expert"),
        ({"config": {"backend": "torch"}}, TypeError, "config must be a moe_gemm.GemmConfig"),
        ({"hidden_size": 0}, ValueError, "hidden_size must be an int >= 1; got 0"),
        ({"intermediate_size": -1}, ValueError, "intermediate_size must be an int >= 1"),
        ({"dtype": torch.float64}, TypeError, "dtype must be"),
        ({"hidden_size": 32.0}, TypeError, "hidden_size must be an int"),
        ({"top_k": 2.0}, TypeError, "top_k must be an int"),
        ({"routed_scaling_factor": float("nan")}, ValueError,
         "routed_scaling_factor must be finite; got nan"),
        ({"renormalize": "no"}, TypeError, "renormalize must be a bool"),
        ({"router_fp32": "no"}, TypeError, "router_fp32 must be a bool or None; got 'no'"),
        ({"fused": "x"}, TypeError, "fused must be a bool or None; got 'x'"),
        ({"scoring": "sigmoid", "routed_scaling_factor": float("nan")}, ValueError,
         "routed_scaling_factor must be finite; got nan"),
        ({"scoring": "sigmoid", "routed_scaling_factor": float("inf")}, ValueError,
         "routed_scaling_factor must be finite"),
        ({"scoring": "sigmoid", "routed_scaling_factor": "2.5"}, TypeError,
         "routed_scaling_factor must be a float"),
        # moe_forward's correction_bias is the [E] tensor: bool() of one raised inside torch
        ({"scoring": "sigmoid", "correction_bias": torch.zeros(8)}, TypeError,
         r"correction_bias must be a bool or None \(whether the layer keeps an "
         r"e_score_correction_bias buffer\); got a tensor"),
        # strings were truthy: the buffer, or a shared-expert gate of random weights, kept
        ({"scoring": "sigmoid", "correction_bias": "no"}, TypeError,
         "correction_bias must be a bool or None; got 'no'"),
        ({"shared_intermediate_size": 8, "shared_expert_gate": "no"}, TypeError,
         "shared_expert_gate must be a bool; got 'no'"),
        ({"router_jitter_noise": -0.01}, ValueError,
         "router_jitter_noise must be a finite float >= 0; got -0.01"),
        ({"router_jitter_noise": float("nan")}, ValueError,
         "router_jitter_noise must be a finite float >= 0; got nan"),
        ({"router_jitter_noise": "0.01"}, TypeError,
         "router_jitter_noise must be a float >= 0; got '0.01'"),
        ({"router_jitter_noise": True}, TypeError,
         "router_jitter_noise must be a float >= 0; got True"),
    ],
)
def test_constructor_rejects(kwargs: dict, exc: type[Exception], pattern: str) -> None:
    args = dict(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2)
    args.update(kwargs)
    with pytest.raises(exc, match=pattern):
        MoE(**args)


@pytest.fixture
def default_float64():
    """torch's default dtype set to float64 for the test, and restored whatever happens."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def test_default_float64_is_refused_naming_dtype(default_float64) -> None:
    # dtype=None follows torch's default dtype, as nn.Linear does: under float64 the layer
    # made float64 weights, and its forward then raised a TypeError about the caller's
    # input. The grouped GEMMs take bf16, fp16 and fp32 only, so the constructor refuses,
    # naming the dtypes and the dtype= argument; an explicit dtype works as under float32.
    with pytest.raises(TypeError, match=r"default dtype when dtype=None, which is torch\.float64;"
                                        r" .*bfloat16, torch\.float16 or torch\.float32: pass "
                                        r"one as dtype="):
        MoE(32, 16, 8, 2)
    kw = dict(scoring="sigmoid", n_group=2, topk_group=1, shared_intermediate_size=24,
              shared_expert_gate=True, dtype=torch.float32)
    moe = randomize(MoE(32, 16, 8, 2, **kw))
    assert {t.dtype for t in [*moe.parameters(), *moe.buffers()]} == {torch.float32}
    x = torch.randn(37, 32, dtype=torch.float32)
    y = moe(x)
    assert y.dtype == torch.float32
    assert_close_to_ref(y, naive_moe(moe, x), name="fp32 layer under a float64 default")
    torch.set_default_dtype(torch.float32)
    torch.testing.assert_close(moe(x), y, rtol=0, atol=0)  # (the default changes nothing)
    torch.set_default_dtype(torch.float64)
    # The caller's float64 tokens are refused, not rounded to float32.
    with pytest.raises(TypeError, match="hidden_states must be .* got torch.float64"):
        moe(x.double())
    # The loaders build on the meta device: the tensors decide the dtype, whatever the default.
    back = MoE.from_state_dict(moe.state_dict(), 2, scoring="sigmoid", n_group=2, topk_group=1)
    torch.testing.assert_close(back(x), y, rtol=0, atol=0)
    fused = MoE.from_fused(moe.gate_up_proj, moe.down_proj, moe.router_weight, 2)
    assert fused.gate_up_proj.dtype == torch.float32 and fused(x).dtype == torch.float32


def test_router_jitter_in_training_mode_only() -> None:
    # Mixtral's router jitter (transformers' config.router_jitter_noise): in training mode
    # the input is multiplied by U(1 - j, 1 + j) drawn as torch.empty_like(x).uniform_ from
    # torch's default generator, and the jittered tokens feed the router and every expert.
    # Eval mode, and j = 0, leave the forward and the generator as they were.
    j = 0.3
    moe = randomize(MoE(32, 16, 8, 2, router_jitter_noise=j, shared_intermediate_size=24))
    assert moe.training and moe.router_jitter_noise == j and f"router_jitter_noise={j}" in repr(
        moe)
    x = torch.randn(3, 13, 32)
    x_before = x.clone()
    seed = int(torch.randint(1 << 30, ()))
    torch.manual_seed(seed)
    y = moe(x)
    torch.manual_seed(seed)
    noise = torch.empty_like(x).uniform_(1 - j, 1 + j)  # transformers' formula
    assert torch.equal(x, x_before)  # (transformers' `*=` rewrites its input; not here)
    moe.eval()
    state = torch.get_rng_state()
    clean = moe(x)
    assert torch.equal(torch.get_rng_state(), state)  # eval draws nothing
    torch.testing.assert_close(y, moe(x * noise), rtol=0, atol=0)
    assert_close_to_ref(y, naive_moe(moe, x * noise), name="jittered forward")
    assert rel_err(y, clean) > 1e-3  # (the jitter changed the result)
    # route() is the router alone: never jittered (transformers' routers do not jitter)
    moe.train()
    w, i = moe.route(x)
    w0, i0 = moe.eval().route(x)
    assert torch.equal(i, i0) and torch.equal(w, w0)
    # 0 = off in training mode too; the attribute is checked as the constructor checks it
    moe.train()
    moe.router_jitter_noise = 0
    state = torch.get_rng_state()
    torch.testing.assert_close(moe(x), clean, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert "router_jitter_noise" not in repr(moe)
    with pytest.raises(ValueError, match="router_jitter_noise must be a finite float >= 0"):
        moe.router_jitter_noise = -1.0
    assert moe.router_jitter_noise == 0.0


def test_forward_rejects() -> None:
    moe = MoE(32, 16, 8, 2)
    with pytest.raises(ValueError, match=re.escape("(..., H) = (..., 32); got (4, 31)")):
        moe(torch.randn(4, 31))
    with pytest.raises(TypeError, match="hidden_states must be torch.bfloat16"):
        moe(torch.randn(4, 32).double())
    with pytest.raises(TypeError, match="hidden_states must be a torch.Tensor"):
        moe([[0.0] * 32])
    with pytest.raises(ValueError, match="hidden_states is on meta"):
        moe(torch.randn(4, 32, device="meta"))
    # A layer cast to float64: its weights are named, not the (valid) input's dtype.
    with pytest.raises(TypeError, match="the layer's weights are torch.float64"):
        MoE(32, 16, 8, 2).double()(torch.randn(4, 32))


def test_functional_rejects() -> None:
    x = torch.randn(4, 32)
    wg = torch.randn(8, 32, 48)
    wd = torch.randn(8, 24, 32)
    ids = torch.zeros(4, 2, dtype=torch.long)
    w = torch.rand(4, 2)
    cases = [
        ((x, ids, w, wg.transpose(1, 2), wd), ValueError, r"w_gate_up must be \(E, H, 2I\)"),
        ((x, ids, w, wg, wd.transpose(1, 2)), ValueError, r"w_down must be \(E, I, H\) = \(8, 24, 32\)"),
        ((x, ids[:3], w, wg, wd), ValueError, r"topk_ids must be \(T, k\) = \(4, k >= 1\)"),
        ((x, ids.float(), w, wg, wd), TypeError, "topk_ids must be int64 or int32"),
        ((x, ids, w[:, :1], wg, wd), ValueError, "topk_weights must match topk_ids"),
        ((x, ids, w.long(), wg, wd), TypeError, "topk_weights must be a float tensor"),
        ((x.bfloat16(), ids, w, wg, wd), TypeError, "w_gate_up has dtype torch.float32 but x has"),
        ((x[None], ids, w, wg, wd), ValueError, r"x must be 2-D \(T, H\)"),
        ((x.long(), ids, w, wg, wd), TypeError, "x must be torch.bfloat16"),
        ((x, ids, w, wg, "w"), TypeError, r"w_down must be a torch.Tensor \(E, I, H\)"),
        ((x, ids, w, wg.to("meta"), wd), ValueError, "w_gate_up is on meta"),
        ((x[:, :0], ids, w, wg[:, :0], wd[..., :0]), ValueError, r"x must be \(T, H\) with H >= 1"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            moe_experts(*args)
    with pytest.raises(ValueError, match=r"router_weight must be \(E, H\) = \(8, 32\)"):
        moe_forward(x, torch.randn(8, 31), wg, wd, 2)
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_forward(x, torch.randn(8, 32), wg, wd, 9)
    with pytest.raises(ValueError, match="correction_bias is used by scoring='sigmoid'"):
        moe_forward(x, torch.randn(8, 32), wg, wd, 2, correction_bias=torch.zeros(8))


def test_gemm_config_is_used() -> None:
    moe = MoE(32, 16, 8, 2, config=GemmConfig(backend="cute"))
    with pytest.raises(RuntimeError, match="backend='cute' cannot run here"):
        moe(torch.randn(3, 32))
    moe.config = GemmConfig(backend="torch")
    assert moe(torch.randn(3, 32)).shape == (3, 32)


def test_fused_and_config_attributes_are_checked() -> None:
    # Both are documented as attributes to set on a built layer; a string "no" was silently
    # truthy (the fused path forced on) and a string config failed deep in the GEMM dispatch.
    moe = randomize(MoE(32, 16, 8, 2))
    for bad in ("no", 2, torch.tensor(False)):
        with pytest.raises(TypeError, match="fused must be a bool or None"):
            moe.fused = bad
    with pytest.raises(TypeError, match="config must be a moe_gemm.GemmConfig or None; got str"):
        moe.config = "torch"
    assert moe.fused is None and moe.config is None  # (the refused values are not kept)
    x = torch.randn(9, 32)
    for fused in (False, True, 0, 1, None):
        moe.fused = fused
        assert moe.fused is (None if fused is None else bool(fused))
        assert rel_err(moe(x), naive_moe(moe, x)) < 1e-5
    moe.config = GemmConfig(backend="torch")
    assert rel_err(copy.deepcopy(moe)(x), naive_moe(moe, x)) < 1e-5


def test_activation_attribute_switches_routed_and_shared_experts() -> None:
    # The layer has one activation (transformers' hidden_act, the shared expert's too). A
    # reassigned `moe.activation` switched the routed experts only: the shared expert kept the
    # constructor's, so the layer ran two activations (and ExpertParallelMoE.from_moe, which
    # builds its shared expert from the attribute, disagreed with it).
    moe = randomize(MoE(32, 16, 8, 2, shared_intermediate_size=24, shared_expert_gate=True))
    x = torch.randn(37, 32)
    for act in ("gelu", "gelu_tanh", torch.tanh, "swish"):
        moe.activation = act
        assert moe.activation is act and moe.shared_experts.activation is act
        assert_close_to_ref(moe(x), naive_moe(moe, x), name=f"activation {act!r}")
    # Checked on assignment as in the constructor; a refused value is not kept by either part.
    with pytest.raises(ValueError, match="activation must be one of"):
        moe.activation = "relu3"
    with pytest.raises(TypeError, match="activation must be a str or a callable; got int"):
        moe.activation = 3
    with pytest.raises(TypeError, match="activation must be a str or a callable; got int"):
        moe.shared_experts.activation = 3
    assert moe.activation == moe.shared_experts.activation == "swish"
    # A module activation and back (torch refused a str over the child module it made).
    for act in (torch.nn.GELU(approximate="tanh"), "silu"):
        moe.activation = act
        assert moe.activation is act and moe.shared_experts.activation is act
        assert_close_to_ref(moe(x), naive_moe(moe, x), name=f"activation {act!r}")


def test_shared_expert_applies_its_current_activation() -> None:
    # GatedMLP resolved its activation once, at construction: setting the attribute later
    # changed what it reported, not what it computed.
    mlp = GatedMLP(16, 12)
    mlp.activation = "gelu_tanh"
    x = torch.randn(9, 16)
    g, u, d = (getattr(mlp, n).weight.double() for n in ("gate_proj", "up_proj", "down_proj"))
    v = x.double()
    want = (F.gelu(v @ g.T, approximate="tanh") * (v @ u.T)) @ d.T
    assert_close_to_ref(mlp(x), want)


def _prelu_moe(**kw) -> MoE:
    """A layer whose activation is a module with a parameter (nn.PReLU's slope), shared
    expert and gate included, all weights random."""
    moe = randomize(MoE(32, 16, 8, 2, activation=torch.nn.PReLU(), shared_intermediate_size=24,
                        shared_expert_gate=True, **kw))
    with torch.no_grad():  # (randomize draws the slope too: a fresh one, away from 0.25)
        moe.activation.weight.uniform_(0.05, 0.6)
    return moe


def _prelu_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """naive_moe for a PReLU layer: the slope in float64, routed and shared experts alike."""
    slope = moe.activation.weight.detach().double()
    return naive_moe(moe, x, act=lambda t: F.prelu(t, slope))


def test_module_activation_is_registered_once() -> None:
    # The layer and its shared expert both registered a module activation: its parameter was
    # in state_dict() twice ("activation.weight", "shared_experts.activation.weight") and the
    # layer's own loader refused the checkpoint. One key now; both parts still apply it.
    moe = _prelu_moe()
    act = moe.activation
    assert [k for k in moe.state_dict() if "activation" in k] == ["activation.weight"]
    names = [n for n, _ in moe.named_parameters(remove_duplicate=False)]
    assert names.count("activation.weight") == 1 and len(names) == len(set(names))
    assert moe.shared_experts.activation is act
    x = torch.randn(37, 32)
    y = moe(x)
    assert_close_to_ref(y, _prelu_reference(moe, x), name="PReLU layer")
    # The repr lists the module once, under the layer; the shared expert names it.
    text = repr(moe)
    assert text.count("PReLU(num_parameters=1)") == 1 and "activation='PReLU'" in text
    assert re.search(r"GatedMLP\(\s*activation='PReLU'", text)
    # A strict load of the state dict into an equal layer: the same slope, the same output.
    back = MoE(32, 16, 8, 2, activation=torch.nn.PReLU(), shared_intermediate_size=24,
               shared_expert_gate=True)
    assert not back.load_state_dict(moe.state_dict(), strict=True).missing_keys
    assert torch.equal(back.activation.weight, act.weight)
    torch.testing.assert_close(back(x), y, rtol=0, atol=0)
    # Another module and back to a name: the shared expert follows, nothing registered twice.
    moe.activation = torch.nn.PReLU(init=0.1)
    assert moe.shared_experts.activation is moe.activation
    assert [k for k in moe.state_dict() if "activation" in k] == ["activation.weight"]
    moe.activation = "silu"
    assert not [k for k in moe.state_dict() if "activation" in k]
    assert "activation" not in moe._modules and "activation" not in moe.shared_experts._modules
    assert_close_to_ref(moe(x), naive_moe(moe, x), name="back to silu")


def test_state_dict_with_the_activation_twice_still_loads() -> None:
    # A checkpoint saved while the shared expert registered the module activation too carries
    # its slope under "shared_experts.activation.weight" as well: a strict load takes it.
    moe = _prelu_moe()
    sd = dict(moe.state_dict())
    sd["shared_experts.activation.weight"] = sd["activation.weight"].clone()
    back = MoE(32, 16, 8, 2, activation=torch.nn.PReLU(), shared_intermediate_size=24,
               shared_expert_gate=True)
    result = back.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(back.activation.weight, moe.activation.weight)
    x = torch.randn(9, 32)
    torch.testing.assert_close(back(x), moe(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "name,value,pattern",
    [
        # a router of another E: its ids past the experts were dropped silently (or some
        # experts never chosen), a wrong output without an error
        ("router_weight", torch.zeros(9, 32), r"router_weight must be \(E, H\) = \(8, 32\)"),
        ("router_weight", torch.zeros(7, 32), r"router_weight must be \(E, H\) = \(8, 32\)"),
        # another H: F.linear's RuntimeError
        ("router_weight", torch.zeros(8, 31), r"router_weight must be \(E, H\) = \(8, 32\)"),
        # on the meta device: garbage routing, a CPU output without an error
        ("router_weight", torch.zeros(8, 32, device="meta"),
         "the layer's router_weight is on meta but its expert weights are on cpu"),
        # experts of two E: a message about the grouped GEMM's offs
        ("down_proj", torch.zeros(7, 32, 16),
         r"the layer's down_proj must be \(E, H, I\) = \(8, 32, 16\)"),
        ("gate_up_proj", torch.zeros(8, 32, 31),
         r"the layer's gate_up_proj must be \(E, 2I, H\) = \(E, 2I, 32\)"),
    ],
)
def test_weights_assigned_after_construction_are_checked(name: str, value: torch.Tensor,
                                                         pattern: str) -> None:
    moe = randomize(MoE(32, 16, 8, 2))
    setattr(moe, name, torch.nn.Parameter(value, requires_grad=False))
    with pytest.raises(ValueError, match=pattern):
        moe(torch.randn(3, 32))
    with pytest.raises(ValueError, match=pattern):
        moe.route(torch.randn(3, 32))


def test_expert_weights_of_two_dtypes_or_devices_are_named() -> None:
    # A load_state_dict(..., assign=True) of a mixed checkpoint or a functional_call with one
    # expert weight replaced: the GEMM's message blamed x, the caller's valid input.
    moe = randomize(MoE(32, 16, 8, 2))
    sd = moe.state_dict()
    sd["down_proj"] = sd["down_proj"].half()
    moe.load_state_dict(sd, assign=True)
    x = torch.randn(3, 32)
    with pytest.raises(TypeError, match="the layer's down_proj is torch.float16 but its "
                                        "gate_up_proj is torch.float32"):
        moe(x)
    moe = randomize(MoE(32, 16, 8, 2))
    with pytest.raises(TypeError, match="the layer's down_proj is torch.float32 but its "
                                        "gate_up_proj is torch.bfloat16"):
        torch.func.functional_call(moe, {"gate_up_proj": moe.gate_up_proj.bfloat16()}, (x,))
    with pytest.raises(ValueError, match="the layer's down_proj is on meta but its "
                                         "gate_up_proj is on cpu"):
        torch.func.functional_call(moe, {"down_proj": moe.down_proj.to("meta")}, (x,))
    # (weights of one dtype, the caller's input in another: cast, as documented)
    y = torch.func.functional_call(
        moe, {"gate_up_proj": moe.gate_up_proj.bfloat16(), "down_proj": moe.down_proj.bfloat16()},
        (x,))
    assert y.dtype == torch.float32


def test_weights_assigned_after_construction_with_new_sizes_run() -> None:
    # New weights that fit one another (another E or I, the router to match) are a valid layer.
    moe = randomize(MoE(32, 16, 8, 2))
    moe.router_weight = torch.nn.Parameter(torch.randn(4, 32), requires_grad=False)
    moe.gate_up_proj = torch.nn.Parameter(torch.randn(4, 12, 32) / 6, requires_grad=False)
    moe.down_proj = torch.nn.Parameter(torch.randn(4, 32, 6) / 3, requires_grad=False)
    moe.num_experts, moe.intermediate_size = 4, 6
    x = torch.randn(5, 32)
    assert rel_err(moe(x), naive_moe(moe, x)) < 1e-5


def test_sizes_follow_the_weights_and_disagreeing_assignments_raise() -> None:
    # E and I are the weights' sizes: new weights update them, and an assignment that
    # disagrees with the weights (silently ignored by the forward before) names them.
    moe = randomize(MoE(32, 16, 8, 2))
    moe.router_weight = torch.nn.Parameter(torch.randn(4, 32), requires_grad=False)
    moe.gate_up_proj = torch.nn.Parameter(torch.randn(4, 12, 32) / 6, requires_grad=False)
    moe.down_proj = torch.nn.Parameter(torch.randn(4, 32, 6) / 3, requires_grad=False)
    assert (moe.num_experts, moe.intermediate_size) == (4, 6)
    assert "intermediate_size=6, num_experts=4" in repr(moe)
    with pytest.raises(ValueError, match=r"num_experts is the expert weights' E \(4\); got 8"):
        moe.num_experts = 8
    with pytest.raises(ValueError, match=r"intermediate_size is the expert weights' I \(6\)"):
        moe.intermediate_size = 16
    assert (moe.num_experts, moe.intermediate_size) == (4, 6)
    # a layer on the meta device, and a copy, report the constructor's sizes
    meta = MoE(32, 16, 8, 2, device="meta")
    assert (meta.num_experts, meta.intermediate_size) == (8, 16)
    assert copy.deepcopy(moe).num_experts == 4


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_router_fp32_assignment_is_checked(scoring: str) -> None:
    torch.manual_seed(0)
    moe = randomize(MoE(32, 16, 8, 2, scoring=scoring))
    assert moe.router_fp32 is (scoring == "sigmoid")
    for bad in ("yes", 2, 1.0):
        with pytest.raises(TypeError, match="router_fp32 must be a bool or None"):
            moe.router_fp32 = bad
    assert moe.router_fp32 is (scoring == "sigmoid")
    moe.router_fp32 = not moe.router_fp32
    moe.router_fp32 = None  # the scoring's default again
    assert moe.router_fp32 is (scoring == "sigmoid")
    other = "softmax" if scoring == "sigmoid" else "sigmoid"
    moe.scoring = other  # (None follows the scoring assigned later; a pinned value stays)
    assert moe.router_fp32 is (other == "sigmoid")
    moe.router_fp32 = False
    moe.scoring = scoring
    assert moe.router_fp32 is False
    moe.router_fp32 = True  # fp32 logits: the same routing as a layer built with it
    built = randomize(MoE(32, 16, 8, 2, scoring=scoring, router_fp32=True))
    built.load_state_dict(moe.state_dict())
    x = torch.randn(7, 32, dtype=torch.bfloat16)
    moe, built = moe.bfloat16(), built.bfloat16()
    torch.testing.assert_close(moe.route(x), built.route(x), rtol=0, atol=0)


@pytest.mark.slow  # CPU timings of 3 token counts x 4 implementations: a few seconds
def test_benchmark_smoke(tmp_path) -> None:
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "moe.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["shape"]["E"] == 8 and report["shape"]["top_k"] == 2
    impls = {r["impl"] for r in report["results"]}
    assert "moe_gemm" in impls
    assert {r["tokens"] for r in report["results"]} == {1, 7, 33}
    assert all(r["us"] > 0 for r in report["results"])
    assert all(r["ratio"] is None or r["ratio"] > 0 for r in report["results"])
    for check in report["checks"]:  # present when transformers is installed
        assert check["calc_diff_vs_transformers"] < 1e-4


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_shared_expert_runs_in_its_own_dtype(x_dtype: torch.dtype) -> None:
    # A layer cast to fp16 (shared expert and gate included) fed another dtype: experts and
    # shared expert both compute in fp16, the result comes back in the input's dtype.
    torch.manual_seed(0)
    moe = randomize(MoE(16, 8, 4, 2, shared_intermediate_size=6, shared_expert_gate=True))
    ref_layer = copy.deepcopy(moe).float()
    moe = moe.half()
    x = torch.randn(5, 16, dtype=x_dtype)
    y = moe(x)
    assert y.dtype == x_dtype and y.shape == x.shape
    want = ref_layer(x.float())
    err = ((y.float() - want).abs().max() / want.abs().max()).item()
    assert err < 2e-2, err


def test_functional_correction_bias_on_another_device_is_a_clear_error() -> None:
    x, wg, wd, rw = torch.randn(4, 32), torch.randn(8, 32, 48), torch.randn(8, 24, 32), \
        torch.randn(8, 32)
    with pytest.raises(ValueError, match="bias is on meta"):
        moe_forward(x, rw, wg, wd, 2, scoring="sigmoid",
                    correction_bias=torch.zeros(8, device="meta"))


def test_functional_rejects_bad_options() -> None:
    # config / fused as the constructor checks them, before any routing or GEMM work
    x, rw = torch.randn(4, 32), torch.randn(8, 32)
    wg, wd = torch.randn(8, 32, 48), torch.randn(8, 24, 32)
    ids, w = torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2)
    for kw, pattern in (({"config": "torch"}, "config must be a moe_gemm.GemmConfig or None"),
                        ({"fused": "x"}, "fused must be a bool or None; got 'x'")):
        with pytest.raises(TypeError, match=pattern):
            moe_experts(x, ids, w, wg, wd, **kw)
        with pytest.raises(TypeError, match=pattern):
            moe_forward(x, rw, wg, wd, 2, **kw)
    with pytest.raises(TypeError, match="router_fp32 must be a bool or None"):
        moe_forward(x, rw, wg, wd, 2, router_fp32="no")
    with pytest.raises(TypeError, match=r"w_gate_up must be a torch.Tensor \(E, H, 2I\); got "
                                        "NoneType"):
        moe_forward(x, rw, None, wd, 2)
    with pytest.raises(ValueError, match=r"w_gate_up must be a 3-D tensor"):
        moe_forward(x, rw, wg[0], wd, 2)
    with pytest.raises(TypeError, match="router_weight must be a floating-point tensor"):
        moe_forward(x, rw.long(), wg, wd, 2)
    with pytest.raises(ValueError, match="routed_scaling_factor must be finite"):
        moe_forward(x, rw, wg, wd, 2, scoring="sigmoid", routed_scaling_factor=float("nan"))
    # the valid spellings still run
    cfg = GemmConfig(backend="torch")
    y = moe_forward(x, rw, wg, wd, 2, config=cfg, fused=False, router_fp32=True)
    torch.testing.assert_close(moe_experts(x, *reversed(softmax_topk(
        F.linear(x, rw), 2)), wg, wd, config=cfg, fused=False), y)


@pytest.mark.parametrize("scoring", ["Softmax", "sigmoid ", "topk", None, 1])
def test_a_reassigned_unknown_scoring_raises_at_the_assignment(scoring):
    # The constructor checks `scoring`; an assignment afterwards reached the router, which
    # routed any value but "softmax" as sigmoid, and later the forward refused it.
    moe = randomize(MoE(32, 16, 8, 2))
    x = torch.randn(5, 32)
    with pytest.raises(ValueError, match="scoring must be 'softmax', 'sigmoid' or 'sqrtsoftplus'"):
        moe.scoring = scoring
    assert moe.scoring == "softmax"
    assert moe(x).shape == (5, 32)


@pytest.mark.parametrize("name, bad, error, match", [
    ("top_k", 0, ValueError, r"top_k must be an int >= 1; got 0"),
    ("top_k", 9, ValueError, r"top_k must be in \[1, num_experts=8\]; got 9"),
    ("top_k", 2.0, TypeError, "top_k must be an int"),
    ("top_k", "2", TypeError, "top_k must be an int"),
    ("top_k", True, TypeError, "top_k must be an int"),
    ("renormalize", "no", TypeError, "renormalize must be a bool"),
    ("renormalize", None, TypeError, "renormalize must be a bool"),
    ("n_group", 0, ValueError, "n_group must be an int >= 1"),
    ("topk_group", -1, ValueError, "topk_group must be an int >= 1"),
    ("topk_group", 1.5, TypeError, "topk_group must be an int"),
    ("routed_scaling_factor", float("inf"), ValueError, "routed_scaling_factor must be finite"),
    ("hidden_size", 0, ValueError, r"hidden_size must be an int >= 1; got 0"),
    ("hidden_size", "32", TypeError, "hidden_size must be an int"),
])
def test_routing_option_assignments_are_checked(name, bad, error, match) -> None:
    # Each option is checked on its own when assigned (a bad value failed only in the next
    # forward, or not at all: "no" for renormalize was truthy); the layer keeps its value.
    torch.manual_seed(0)
    moe = randomize(MoE(32, 16, 8, 2, scoring="sigmoid", n_group=2, topk_group=2))
    x = torch.randn(5, 32)
    before, y = getattr(moe, name), moe(x)
    with pytest.raises(error, match=match):
        setattr(moe, name, bad)
    assert getattr(moe, name) == before
    torch.testing.assert_close(moe(x), y, rtol=0, atol=0)


def test_routing_options_assigned_one_by_one_reach_the_router() -> None:
    # Combinations pass through invalid states (n_group before topk_group); the forward
    # checks how the options combine and routes with the values assigned.
    torch.manual_seed(0)
    moe = randomize(MoE(32, 16, 8, 2))
    built = randomize(MoE(32, 16, 8, 3, scoring="sigmoid", renormalize=False, n_group=4,
                          topk_group=2, routed_scaling_factor=2.5, correction_bias=False))
    built.load_state_dict(moe.state_dict())
    moe.scoring, moe.n_group, moe.topk_group = "sigmoid", 4, 2
    moe.top_k, moe.renormalize, moe.routed_scaling_factor = np_int(3), 0, 2.5
    assert type(moe.top_k) is int and moe.renormalize is False
    x = torch.randn(7, 32)
    torch.testing.assert_close(moe(x), built(x), rtol=0, atol=0)
    moe.n_group = 3  # groups that do not divide E: refused by the forward
    with pytest.raises(ValueError, match="divide E=8"):
        moe(x)
    with pytest.raises(ValueError, match="divide E=8"):
        moe.route(x)
    moe.scoring, moe.n_group = "softmax", 4  # group-limited softmax (Mistral 4)
    soft = randomize(MoE(32, 16, 8, 3, renormalize=False, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5))
    soft.load_state_dict(moe.state_dict())
    torch.testing.assert_close(moe(x), soft(x), rtol=0, atol=0)


def test_a_correction_bias_under_reassigned_softmax_scoring_is_refused() -> None:
    # The constructor refuses correction_bias with softmax; a sigmoid layer whose scoring is
    # reassigned keeps its buffer, which softmax would ignore: the forward refuses it until
    # the buffer is set to None, then routes as a softmax layer built so.
    torch.manual_seed(1)
    moe = randomize(MoE(32, 16, 8, 2, scoring="sigmoid"))
    with torch.no_grad():
        moe.e_score_correction_bias.normal_()
    x = torch.randn(5, 32)
    moe.scoring, moe.renormalize = "softmax", False
    with pytest.raises(ValueError, match="e_score_correction_bias.*'sqrtsoftplus' only"):
        moe(x)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        moe.route(x)
    moe.e_score_correction_bias = None
    plain = MoE(32, 16, 8, 2, renormalize=False, router_fp32=True)
    plain.load_state_dict(moe.state_dict())
    torch.testing.assert_close(moe(x), plain(x), rtol=0, atol=0)


def np_int(value: int):
    np = pytest.importorskip("numpy")
    return np.int64(value)


def test_numpy_integer_sizes_are_taken_as_python_ints() -> None:
    """Sizes read from numpy (a config array) build the same layer as Python ints; bools,
    floats and strings stay TypeErrors."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    moe = MoE(np.int64(32), np.int32(16), np.int64(4), np.int64(2), n_group=np.int64(1),
              topk_group=np.int64(1), shared_intermediate_size=np.int64(8))
    for name in ("hidden_size", "intermediate_size", "num_experts", "top_k", "n_group",
                 "topk_group"):
        assert type(getattr(moe, name)) is int, name
    torch.manual_seed(0)
    plain = MoE(32, 16, 4, 2, shared_intermediate_size=8)
    x = torch.randn(5, 32)
    torch.testing.assert_close(moe(x), plain(x), rtol=0, atol=0)
    for bad in (True, 2.0, "2", np.float64(2)):
        with pytest.raises(TypeError, match="top_k must be an int"):
            MoE(32, 16, 4, bad)
