"""DeepSeek-V4's routing in the MoE layer: sqrt(softplus) scores, hash routing by token id
(tid2eid, the forward's input_ids), their loaders, and MoE.from_hf of DeepSeek-V4's blocks
against transformers' own (fp32 equality, bf16 within twice transformers' error)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from moe_testutils import naive_experts, naive_moe, randomize, rel_err
from test_expert_parallel import _Local

from moe_gemm import GemmConfig
from moe_gemm.layers.expert_parallel import ExpertParallelMoE
from moe_gemm.layers.gate_activations import ClampedSiLU
from moe_gemm.layers.moe import MoE, moe_forward
from moe_gemm.testing import assert_close_to_ref, calc_diff

TORCH = GemmConfig(backend="torch")


def _hash_moe(V: int = 40, **kw) -> MoE:
    moe = randomize(MoE(24, 16, 8, 3, scoring="sqrtsoftplus", hash_vocab_size=V,
                        routed_scaling_factor=1.5, config=TORCH, **kw))
    moe.tid2eid = torch.randint(0, 8, (V, 3))
    return moe


def _hash_reference(moe: MoE, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float64, one token at a time: experts from the table, weights from sqrt(softplus) of
    the float64 logits at them, renormalised (+1e-20), scaled."""
    x2 = x.reshape(-1, moe.hidden_size).double()
    logits = x2 @ moe.router_weight.double().T
    ids = moe.tid2eid[token_ids.reshape(-1)].long()
    rows = []
    for t in range(x2.shape[0]):
        s = [math.sqrt(math.log1p(math.exp(float(logits[t, e])))) for e in ids[t].tolist()]
        tot = sum(s) + 1e-20
        rows.append([v / tot * moe.routed_scaling_factor for v in s])
    weights = torch.tensor(rows, dtype=torch.float64)
    y = naive_experts(x2, ids, weights, moe.gate_up_proj, moe.down_proj)
    return y.view(*x.shape[:-1], moe.hidden_size)


def test_sqrtsoftplus_layer_matches_reference() -> None:
    moe = randomize(MoE(24, 16, 8, 2, scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                        shared_intermediate_size=12, config=TORCH))
    # the scoring's defaults: fp32 logits and a correction bias, as for sigmoid
    assert moe.router_fp32 is True and moe.e_score_correction_bias is not None
    x = torch.randn(3, 7, 24)
    with torch.no_grad():
        y = moe(x)
        assert rel_err(y, naive_moe(moe, x)) < 1e-5
        # the routing itself against a float64 reference of the biased choice
        w, ids = moe.route(x)
        logits = x.reshape(-1, 24).double() @ moe.router_weight.double().T
        scores = F.softplus(logits).sqrt()
        want = (scores + moe.e_score_correction_bias.double()).topk(2, dim=-1).indices
        assert torch.equal(ids.sort(-1).values, want.sort(-1).values)
        picked = scores.gather(1, ids)
        torch.testing.assert_close(w.double(), picked / picked.sum(-1, keepdim=True) * 1.5,
                                   rtol=1e-5, atol=1e-6)
        # the functional form routes alike
        f = moe_forward(x.reshape(-1, 24), moe.router_weight, moe.w_gate_up, moe.w_down, 2,
                        scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                        correction_bias=moe.e_score_correction_bias, config=TORCH)
        shared = moe.shared_experts(x.reshape(-1, 24))
        torch.testing.assert_close(f + shared, y.reshape(-1, 24), rtol=1e-5, atol=1e-5)
    assert "scoring='sqrtsoftplus'" in repr(moe) and "routed_scaling_factor=1.5" in repr(moe)


def test_scoring_switches_to_and_from_sqrtsoftplus() -> None:
    moe = randomize(MoE(24, 16, 8, 2, scoring="sigmoid", config=TORCH))
    x = torch.randn(9, 24)
    moe.scoring = "sqrtsoftplus"
    ref = MoE(24, 16, 8, 2, scoring="sqrtsoftplus", config=TORCH)
    ref.load_state_dict(moe.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(moe(x), ref(x))
    moe.scoring = "softmax"  # a bias under softmax is refused, as before
    with pytest.raises(ValueError, match="correction bias"):
        moe(x)


@pytest.mark.parametrize("shape", [(2, 9), (1, 1), (17,)])
def test_hash_layer_matches_reference(shape: tuple[int, ...]) -> None:
    moe = _hash_moe()
    x = torch.randn(*shape, 24)
    tok = torch.randint(0, 40, shape)
    with torch.no_grad():
        y = moe(x, input_ids=tok)
        assert y.shape == x.shape
        assert rel_err(y, _hash_reference(moe, x, tok)) < 1e-5
        # the table chooses: another bias or other logits leave the experts as they were
        w, ids = moe.route(x, input_ids=tok)
        assert torch.equal(ids, moe.tid2eid[tok.reshape(-1)])
        moe.e_score_correction_bias.add_(100 * torch.randn(8))
        assert torch.equal(moe.route(x, input_ids=tok)[1], ids)


def test_hash_layer_zero_tokens() -> None:
    moe = _hash_moe()
    y = moe(torch.randn(0, 24), input_ids=torch.zeros(0, dtype=torch.int64))
    assert y.shape == (0, 24)


def test_hash_layer_input_ids_are_checked() -> None:
    moe = _hash_moe(shared_intermediate_size=8)
    x = torch.randn(2, 5, 24)
    cases = [
        (None, ValueError, "pass input_ids"),
        (torch.randint(0, 40, (2, 4)), ValueError, r"one id per token \(10\)"),
        (torch.randint(0, 40, (2, 5)).float(), TypeError, "integer tensor"),
        ([1, 2], TypeError, "input_ids must be an integer torch.Tensor"),
        (torch.full((2, 5), 40), ValueError, r"token ids in \[0, 40\)"),
        (torch.full((2, 5), -1), ValueError, r"token ids in \[0, 40\)"),
    ]
    for ids, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            moe(x, input_ids=ids)
        with pytest.raises(exc, match=pattern):
            moe.route(x, input_ids=ids)
    with pytest.raises(ValueError, match="input_ids is on meta"):
        moe(x, input_ids=torch.zeros(2, 5, dtype=torch.int64, device="meta"))
    # a layer that routes by score ignores them
    plain = randomize(MoE(24, 16, 8, 3, config=TORCH))
    with torch.no_grad():
        torch.testing.assert_close(plain(x, input_ids=torch.zeros(2, 5)), plain(x))


def test_hash_table_is_checked_when_set() -> None:
    moe = _hash_moe()
    before = moe.tid2eid.clone()
    for table, exc, pattern in [
        (torch.randint(0, 8, (40, 3)) + 8, ValueError, r"must be in \[0, num_experts=8\)"),
        (torch.randint(0, 8, (40, 3)).float(), TypeError, "expert ids"),
        (torch.randint(0, 8, (40,)), ValueError, "2-D"),
    ]:
        with pytest.raises(exc, match=pattern):
            moe.tid2eid = table
    assert torch.equal(moe.tid2eid, before)
    moe.tid2eid = torch.randint(0, 8, (60, 3))  # another vocabulary size is fine
    assert "hash_vocab_size=60" in repr(moe)
    moe.tid2eid = torch.randint(0, 8, (60, 2))  # columns that do not fit top_k: the forward
    with pytest.raises(ValueError, match=r"tid2eid must be \[vocab, top_k=3\]"):
        moe(torch.randn(4, 24), input_ids=torch.arange(4))
    with pytest.raises(ValueError, match="hash_vocab_size must be an int >= 0"):
        MoE(24, 16, 8, 3, hash_vocab_size=-1)
    with pytest.raises(TypeError, match="hash_vocab_size"):
        MoE(24, 16, 8, 3, hash_vocab_size=2.5)


def test_hash_layer_state_dict_round_trip_and_casts() -> None:
    moe = _hash_moe(shared_intermediate_size=8)
    x, tok = torch.randn(6, 24), torch.randint(0, 40, (6,))
    with torch.no_grad():
        want = moe(x, input_ids=tok)
    sd = moe.state_dict()
    assert sd["tid2eid"].dtype == torch.int64
    again = MoE.from_state_dict(sd, 3, scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                                config=TORCH)
    assert again.tid2eid.data_ptr() == moe.tid2eid.data_ptr()  # aliased, as the weights
    fresh = MoE(24, 16, 8, 3, scoring="sqrtsoftplus", hash_vocab_size=40,
                routed_scaling_factor=1.5, shared_intermediate_size=8, config=TORCH)
    fresh.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(again(x, input_ids=tok), want)
        torch.testing.assert_close(fresh(x, input_ids=tok), want)
    # HF's key name, without a bias (the hash router has none)
    hf = {"gate.weight": moe.router_weight, "gate.tid2eid": moe.tid2eid,
          "experts.gate_up_proj": moe.gate_up_proj, "experts.down_proj": moe.down_proj}
    no_bias = MoE.from_state_dict(hf, 3, scoring="sqrtsoftplus", routed_scaling_factor=1.5)
    assert no_bias.e_score_correction_bias is None and no_bias.tid2eid is not None
    with pytest.raises(ValueError, match=r"must have top_k=2 columns"):
        MoE.from_state_dict(hf, 2, scoring="sqrtsoftplus")
    with pytest.raises(TypeError, match="hash_vocab_size is not a loader option"):
        MoE.from_state_dict(hf, 3, scoring="sqrtsoftplus", hash_vocab_size=40)
    bad = dict(hf, **{"gate.tid2eid": moe.tid2eid + 8})
    with pytest.raises(ValueError, match=r"must be in \[0, num_experts=8\)"):
        MoE.from_state_dict(bad, 3, scoring="sqrtsoftplus")
    # a cast keeps the table's integers
    half = moe.to(torch.bfloat16)
    assert half.tid2eid.dtype == torch.int64


def test_expert_parallel_routes_by_hash_as_moe() -> None:
    moe = _hash_moe(shared_intermediate_size=8)
    x, tok = torch.randn(7, 24), torch.randint(0, 40, (7,))
    with torch.no_grad():
        want = moe(x, input_ids=tok)
        ep = ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False)
        assert torch.equal(ep.tid2eid, moe.tid2eid)
        torch.testing.assert_close(ep(x, input_ids=tok), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(ep.route(x, input_ids=tok)[1], moe.tid2eid[tok])
        with pytest.raises(ValueError, match="pass input_ids"):
            ep(x)
        # a checkpoint in transformers' names: the table is the router's, not the local
        # layer's (whose experts are a share of E)
        sd = {"gate.weight": moe.router_weight, "gate.tid2eid": moe.tid2eid,
              "experts.gate_up_proj": moe.gate_up_proj, "experts.down_proj": moe.down_proj,
              **{f"shared_experts.{n}.weight": getattr(moe.shared_experts, n).weight
                 for n in ("gate_proj", "up_proj", "down_proj")}}
        loaded = ExpertParallelMoE.from_state_dict(sd, 3, dispatcher=_Local(),
                                                   check_replicated=False,
                                                   scoring="sqrtsoftplus",
                                                   routed_scaling_factor=1.5, config=TORCH)
        assert loaded.local._buffers.get("tid2eid") is None
        torch.testing.assert_close(loaded(x, input_ids=tok), want, rtol=1e-5, atol=1e-6)
        # this layer's own state_dict, read back
        again = ExpertParallelMoE.from_state_dict(ep.state_dict(), 3, dispatcher=_Local(),
                                                  check_replicated=False,
                                                  scoring="sqrtsoftplus",
                                                  routed_scaling_factor=1.5, config=TORCH)
        torch.testing.assert_close(again(x, input_ids=tok), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"must be in \[0, num_experts=8\)"):
        ExpertParallelMoE.from_state_dict(dict(sd, **{"gate.tid2eid": moe.tid2eid + 8}), 3,
                                          dispatcher=_Local(), check_replicated=False,
                                          scoring="sqrtsoftplus")
    with pytest.raises(TypeError, match="hash_vocab_size is not a loader option"):
        ExpertParallelMoE.from_state_dict(sd, 3, dispatcher=_Local(), check_replicated=False,
                                          scoring="sqrtsoftplus", hash_vocab_size=40)


def test_expert_parallel_takes_sqrtsoftplus_scoring() -> None:
    moe = randomize(MoE(24, 16, 8, 2, scoring="sqrtsoftplus", config=TORCH))
    ep = ExpertParallelMoE.from_moe(moe, dispatcher=_Local(), check_replicated=False)
    x = torch.randn(5, 24)
    with torch.no_grad():
        torch.testing.assert_close(ep(x), moe(x), rtol=1e-5, atol=1e-6)
        # (input_ids, as a DeepSeek-V4 decoder layer passes them, are taken and ignored)
        torch.testing.assert_close(ep(x, input_ids=torch.arange(5)), moe(x), rtol=1e-5,
                                   atol=1e-6)


# ---------------------------------------------------------------------------------------------
# MoE.from_hf of transformers' DeepseekV4SparseMoeBlock

v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
v4_config = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")


def _v4_block(layer: int, seed: int, dtype: torch.dtype = torch.float32, **kw) -> torch.nn.Module:
    """Layer 0 routes by hash (the config's first layers), layer 3 by score."""
    cfg = v4_config.DeepseekV4Config(**{
        "hidden_size": 48, "intermediate_size": 24, "num_local_experts": 8,
        "num_experts_per_tok": 3, "vocab_size": 64, "num_hidden_layers": 4,
        "routed_scaling_factor": 1.5, "swiglu_limit": 1.0, **kw})
    cfg._experts_implementation = "eager"
    block = v4.DeepseekV4SparseMoeBlock(cfg, layer)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if block.is_hash:
            block.gate.tid2eid.copy_(torch.randint(0, 8, block.gate.tid2eid.shape, generator=g))
        else:
            block.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.2)
    return block.to(dtype).eval()


@pytest.mark.parametrize("layer", [0, 3], ids=["hash", "scored"])
@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
def test_from_hf_deepseek_v4_matches_block_fp32(layer: int, scoring_func: str) -> None:
    block = _v4_block(layer, seed=int(torch.randint(1 << 30, ())), scoring_func=scoring_func)
    moe = MoE.from_hf(block)
    assert moe.scoring == scoring_func and isinstance(moe.activation, ClampedSiLU)
    assert (moe.tid2eid is not None) == bool(block.is_hash)
    assert (moe.e_score_correction_bias is None) == bool(block.is_hash)
    if block.is_hash:
        assert moe.tid2eid.data_ptr() == block.gate.tid2eid.data_ptr()  # shared, no copy
    for shape in [(2, 7), (1, 1), (1, 33)]:
        x = torch.randn(*shape, 48)
        tok = torch.randint(0, 64, shape)
        with torch.no_grad():
            ref = block(x, input_ids=tok)
            y = moe(x, input_ids=tok)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert rel_err(y, ref) < 1e-5, f"shape {shape}"


@pytest.mark.parametrize("layer", [0, 3], ids=["hash", "scored"])
def test_from_hf_deepseek_v4_bf16_two_x_rule(layer: int) -> None:
    seed = int(torch.randint(1 << 30, ()))
    block32 = _v4_block(layer, seed)
    block = _v4_block(layer, seed, torch.bfloat16)
    moe = MoE.from_hf(block)
    x = torch.randn(4, 16, 48).to(torch.bfloat16)
    tok = torch.randint(0, 64, (4, 16))
    with torch.no_grad():
        y = moe(x, input_ids=tok)
        base = block(x, input_ids=tok)  # transformers in bf16
        # the fp32 reference takes the bf16 router's choice (a near tie flipped by bf16
        # rounding is not an arithmetic error)
        flat = x.view(-1, 48)
        _, w16, i16 = (block.gate(flat, tok) if block.is_hash else block.gate(flat))
        x32 = flat.float()
        ref = block32.experts(x32, i16, w16.float()) + block32.shared_experts(x32)
        ref = ref.view(x.shape)
    assert y.dtype == torch.bfloat16
    assert_close_to_ref(y, ref, base, max_calc_diff=max(1e-5, 2 * calc_diff(base, ref)),
                        name=f"DeepSeek-V4 layer {layer}")


def test_from_hf_deepseek_v4_refuses_what_it_cannot_route() -> None:
    block = _v4_block(3, seed=1)
    block.gate.score_fn = torch.nn.Tanh()
    with pytest.raises(ValueError, match="scoring with Sigmoid or SqrtSoftplusActivation"):
        MoE.from_hf(block)
    block = _v4_block(0, seed=1)
    del block.gate.tid2eid
    with pytest.raises(ValueError, match="without tid2eid"):
        MoE.from_hf(block)
    block = _v4_block(3, seed=1, swiglu_limit=0.0)
    with pytest.raises(ValueError, match="swiglu_limit > 0"):
        MoE.from_hf(block)


def test_expert_parallel_from_hf_of_a_hash_block() -> None:
    block = _v4_block(0, seed=2)
    ep = ExpertParallelMoE.from_hf(block, dispatcher=_Local(), check_replicated=False)
    x, tok = torch.randn(2, 6, 48), torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        assert rel_err(ep(x, input_ids=tok), block(x, input_ids=tok)) < 1e-5


def test_deepseek_v4_model_with_our_layers_gives_its_logits() -> None:
    # The decoder layers pass input_ids to their MoE blocks: the hash layers (the first three
    # of four here) route by them, the last by score; every block replaced by MoE.from_hf.
    cfg = v4_config.DeepseekV4Config(
        hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=100, num_hidden_layers=4, routed_scaling_factor=1.5, swiglu_limit=1.0,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    model = v4.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if layer.mlp.is_hash:
                gate.tid2eid.copy_(torch.randint(0, 8, gate.tid2eid.shape, generator=g))
            else:
                gate.e_score_correction_bias.copy_(torch.randn(8, generator=g))
    assert [layer.mlp.is_hash for layer in model.model.layers] == [True, True, True, False]
    ids = torch.randint(0, 100, (2, 9), generator=g)
    with torch.no_grad():
        ref = model(ids).logits
        for layer in model.model.layers:
            layer.mlp = MoE.from_hf(layer.mlp)
        out = model(ids).logits
    assert rel_err(out, ref) < 1e-5
