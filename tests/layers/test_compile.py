"""torch.compile(fullgraph=True) of the MoE layer and of a transformers model whose experts run
on moe_gemm, on the CPU (aot_eager: the traced graph run by eager kernels, to keep CI fast; the
GPU file compiles with inductor): no graph break, the same output as eager, and the
inference-only contract kept (a model whose weights require grad compiles; its backward
raises)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from moe_testutils import naive_moe, randomize, rel_err

from moe_gemm import GemmConfig, MoE


@pytest.fixture
def dynamo():
    """A fresh torch._dynamo with its counters cleared; yields the counters."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


LAYERS = [
    pytest.param(dict(hidden_size=32, intermediate_size=16, num_experts=8, top_k=2),
                 id="mixtral"),
    pytest.param(dict(hidden_size=64, intermediate_size=24, num_experts=16, top_k=4,
                      scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                      shared_intermediate_size=32, shared_expert_gate=True,
                      activation="gelu_tanh", config=GemmConfig(backend="torch")),
                 id="deepseek-shared-gate-gelu"),
    pytest.param(dict(hidden_size=48, intermediate_size=16, num_experts=12, top_k=3,
                      n_group=3, topk_group=2, routed_scaling_factor=1.5,
                      shared_intermediate_size=24, config=GemmConfig(backend="torch")),
                 id="mistral4-softmax-groups"),
    pytest.param(dict(hidden_size=48, intermediate_size=16, num_experts=8, top_k=3,
                      scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                      shared_intermediate_size=24, config=GemmConfig(backend="torch")),
                 id="deepseek-v4-sqrtsoftplus"),
]


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("kwargs", LAYERS)
def test_moe_layer_compiles_whole(dynamo, kwargs: dict, dynamic) -> None:
    # (dynamic=True: the routed scaling factor is traced as a symbol, not checked as a number)
    moe = randomize(MoE(**kwargs)).eval()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    H = moe.hidden_size
    with torch.no_grad():
        for shape in [(2, 9, H), (23, H)]:  # a new token count: a dynamic graph, no break
            x = torch.randn(*shape)
            y = compiled(x)
            torch.testing.assert_close(y, moe(x), rtol=0, atol=0)
            assert rel_err(y, naive_moe(moe, x)) < 1e-5
    assert dynamo["graph_break"] == {}
    assert dynamo["stats"]["unique_graphs"] >= 1


@pytest.mark.parametrize("dynamic", [None, True])
def test_hash_routed_layer_compiles_whole(dynamo, dynamic) -> None:
    # DeepSeek-V4's first layers: experts from a token id table, the forward's input_ids
    moe = randomize(MoE(48, 16, 8, 3, scoring="sqrtsoftplus", hash_vocab_size=30,
                        config=GemmConfig(backend="torch"))).eval()
    moe.tid2eid = torch.randint(0, 8, (30, 3))
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    with torch.no_grad():
        for shape in [(2, 9), (23,)]:
            x, tok = torch.randn(*shape, 48), torch.randint(0, 30, shape)
            torch.testing.assert_close(compiled(x, input_ids=tok), moe(x, input_ids=tok),
                                       rtol=0, atol=0)
    assert dynamo["graph_break"] == {}


def test_moe_layer_compiled_with_grad_keeps_inference_only(dynamo) -> None:
    moe = randomize(MoE(32, 16, 8, 2))
    x = torch.randn(5, 32, requires_grad=True)
    y = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(y, moe(x), rtol=0, atol=0)
    assert y.requires_grad and dynamo["graph_break"] == {}
    with pytest.raises(RuntimeError, match="inference-only"):
        y.sum().backward()


def test_fp8_layer_compiled_with_grad_keeps_inference_only(dynamo) -> None:
    # Only the router requires grad: the experts' FP8 GEMMs see no tracked input, so the
    # compiled graph differentiated the combine alone (a partial router gradient) where the
    # eager layer raises; both raise now.
    moe = randomize(MoE(32, 16, 8, 2)).quantize_fp8("row")
    moe.router_weight.requires_grad_(True)
    x = torch.randn(5, 32)
    y = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(y, moe(x), rtol=0, atol=0)
    assert y.requires_grad and dynamo["graph_break"] == {}
    with pytest.raises(RuntimeError, match="FP8 MoE layer is inference-only"):
        y.sum().backward()
    assert moe.router_weight.grad is None


def test_transformers_model_with_moe_gemm_experts_compiles_whole(dynamo) -> None:
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers >= 5 (ExpertsInterface)")
    from transformers import MixtralConfig, MixtralForCausalLM

    from moe_gemm.integrations import register_transformers

    assert register_transformers()
    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.set_experts_implementation("moe_gemm")
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        got = compiled(ids, use_cache=False).logits
        model.set_experts_implementation("eager")
        loop = model(ids, use_cache=False).logits  # transformers' own per-expert loop
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    assert rel_err(got, loop) < 1e-5
    assert dynamo["graph_break"] == {}


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: ~20 s on 2 cores
def test_transformers_model_compiled_before_any_eager_call_compiles_once() -> None:
    # A fresh interpreter, so that nothing has run the experts forward eagerly before: the
    # integration's lookups of transformers' gate functions filled a cache inside the first
    # trace, whose guard failed on the second call (the whole model compiled twice).
    pytest.importorskip("transformers")
    code = textwrap.dedent(
        """
        import torch
        from torch._dynamo.utils import counters
        from transformers import MixtralConfig, MixtralForCausalLM
        from moe_gemm.integrations import register_transformers
        assert register_transformers()
        cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=8, num_experts_per_tok=2,
                            max_position_embeddings=64)
        model = MixtralForCausalLM(cfg).eval()
        model.set_experts_implementation("moe_gemm")
        compiled = torch.compile(model, fullgraph=True, backend="eager", dynamic=True)
        with torch.no_grad():
            for S in (5, 9, 13):
                compiled(torch.randint(0, 64, (1, S)), use_cache=False)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == 1, f"{graphs} graphs for one dynamic shape"
        print("ok")
        """
    )
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=root, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


@pytest.mark.parametrize("granularity,dims", [("row", (32, 16)), ("block", (128, 128))])
def test_fp8_layer_compiles_on_tracked_hidden_states(dynamo, granularity, dims) -> None:
    # Hidden states that require grad (an earlier layer's output in grad mode): the layer's
    # activation quantizers clamped their amax in place, which failed the compiled graph's
    # autograd before any backward was asked for; eager ran.
    H, I = dims
    moe = randomize(MoE(H, I, 8, 2)).quantize_fp8(granularity)
    x = torch.randn(5, H, requires_grad=True)
    y = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    with torch.no_grad():
        torch.testing.assert_close(y, moe(x), rtol=0, atol=0)
    assert y.requires_grad and dynamo["graph_break"] == {}
    with pytest.raises(RuntimeError, match="FP8 MoE layer is inference-only"):
        y.sum().backward()
    assert x.grad is None


@pytest.mark.parametrize("how", ["automatic", "dynamic"])
def test_a_wrong_hidden_size_is_named_under_dynamic_shapes(dynamo, how) -> None:
    """A compiled layer that has seen two token counts traces the count as a symbol: the
    refusal's message used to be lost (fullgraph: Unsupported on str() of a symbolic shape,
    no cause; without fullgraph: a TypeError from the resumed frame). Now it is ours, with the
    sizes the call has, as in eager."""
    m = MoE(16, 8, 4, 2, dtype=torch.float32).eval()
    bad = torch.randn(5, 15)
    with pytest.raises(ValueError) as eager:
        m(bad)
    assert str(eager.value) == "hidden_states must be (..., H) = (..., 16); got (5, 15)"
    kw = {"dynamic": True} if how == "dynamic" else {}
    f = torch.compile(m, fullgraph=True, backend="aot_eager", **kw)
    with torch.no_grad():
        for t in (5, 7):
            x = torch.randn(t, 16)
            torch.testing.assert_close(f(x), m(x))
        with pytest.raises(torch._dynamo.exc.Unsupported) as info:
            f(bad)
    assert str(eager.value) in str(info.value.__cause__)
    torch._dynamo.reset()
    g = torch.compile(m, backend="aot_eager", dynamic=True)
    with torch.no_grad(), pytest.raises(ValueError) as plain:
        g(bad)
    assert str(plain.value) == str(eager.value)
