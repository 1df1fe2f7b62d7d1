"""torch.compile(fullgraph=True) of the MoE layer and of a transformers MoE model on an sm90 GPU
with our kernels: the layer with inductor against an fp32 reference (the 2x rule against
eager's error), no graph break, no host sync, captured in a CUDA graph and replayed with new
routing, and with mode="reduce-overhead" (torch's own CUDA graphs); the transformers model with
aot_eager against eager.

backend="cute" is forced, so a GEMM our kernels could not take would raise instead of falling
back. MOE_GEMM_TEST_MOE_BACKEND=torch puts the torch backend in its place (to check the tests
themselves where the kernels are not available).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

from moe_gemm import GemmConfig, MoE, moe_experts
from moe_gemm.ops import launch_info
from moe_gemm.testing import assert_close_to_ref, calc_diff

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BACKEND = os.environ.get("MOE_GEMM_TEST_MOE_BACKEND", "cute")
CFG = GemmConfig(backend=BACKEND)  # type: ignore[arg-type]
TORCH = GemmConfig(backend="torch")


@pytest.fixture
def dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Any host<->device synchronization inside raises (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _moe(H: int, I: int, E: int, k: int, seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(H, I, E, k, device=DEVICE, dtype=torch.bfloat16, config=CFG, **kw)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.normal_(0, 0.1)
    return moe.eval()


def _x(T: int, H: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(DEVICE, torch.bfloat16)


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """fp32 experts (and shared expert) on the layer's own routing and bf16 weights."""
    w, ids = moe.route(x)
    ref = moe_experts(x.float(), ids, w, moe.w_gate_up.float(), moe.w_down.float(),
                      config=TORCH)
    if moe.shared_experts is not None:
        s, xf = moe.shared_experts, x.float()
        ref = ref + (torch.nn.functional.silu(xf @ s.gate_proj.weight.float().T)
                     * (xf @ s.up_proj.weight.float().T)) @ s.down_proj.weight.float().T
    return ref


def _check(y: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """Compiled output against fp32, as close as eager's own bf16 result is (2x rule):
    inductor fuses the activation in fp32 where eager rounds it to bf16 first."""
    assert y.dtype == eager.dtype and y.shape == eager.shape
    assert_close_to_ref(y, ref, eager, max_calc_diff=max(1e-5, 2 * calc_diff(eager, ref)),
                        name=name)


def test_compiled_moe_matches_reference_without_breaks_or_syncs(dynamo) -> None:
    moe = _moe(1024, 384, 32, 8, scoring="sigmoid", n_group=8, topk_group=4,
               routed_scaling_factor=2.5, shared_intermediate_size=384)
    compiled = torch.compile(moe, fullgraph=True)
    with torch.no_grad():
        for T in (1, 77, 513):
            x = _x(T, 1024, T)
            before = launch_info.last_launch()
            y = compiled(x)
            torch.cuda.synchronize()
            assert BACKEND == "torch" or launch_info.last_launch() is not before
            _check(y, moe(x), _reference(moe, x), f"compiled MoE T={T}")
        x = _x(77, 1024, 5)
        torch.cuda.synchronize()
        with no_sync():  # the compiled graph (already built for this shape) never syncs
            compiled(x)
        torch.cuda.synchronize()
    assert dynamo["graph_break"] == {}


def test_compiled_moe_in_a_cuda_graph_with_new_routing(dynamo) -> None:
    T, H = 96, 512
    moe = _moe(H, 256, 32, 4, shared_intermediate_size=128)
    compiled = torch.compile(moe, fullgraph=True)
    static_x = _x(T, H, 10)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and warm up outside the capture
                compiled(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = compiled(static_x)
        seen = []
        for trial in range(3):
            x = _x(T, H, 100 + trial) * (1 + trial)
            static_x.copy_(x)
            graph.replay()
            again = compiled(x)  # the same compiled graph, run eagerly
            torch.cuda.synchronize()
            assert torch.equal(static_y, again), f"replay {trial} differs from the compiled call"
            _check(static_y, moe(x), _reference(moe, x), f"replay {trial}")
            seen.append(moe.route(x)[1])
    assert not torch.equal(seen[0], seen[1]), "the replays should route differently"
    assert dynamo["graph_break"] == {}


def test_compiled_moe_reduce_overhead(dynamo) -> None:
    T, H = 64, 512
    moe = _moe(H, 256, 16, 2)
    compiled = torch.compile(moe, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for trial in range(4):  # warm-up, recording, then replays of torch's CUDA graph
            x = _x(T, H, 200 + trial)
            y = compiled(x).clone()  # (the graph's output is rewritten by the next replay)
            _check(y, moe(x), _reference(moe, x), f"reduce-overhead call {trial}")
    assert dynamo["graph_break"] == {}


def test_compiled_transformers_model_with_moe_gemm_experts(dynamo) -> None:
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers >= 5")
    from transformers import MixtralConfig, MixtralForCausalLM

    from moe_gemm.integrations import register_transformers

    assert register_transformers()
    config = MixtralConfig(vocab_size=256, hidden_size=256, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=128)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).to(DEVICE, torch.bfloat16).eval()
    model.set_experts_implementation("moe_gemm")
    ids = torch.randint(0, 256, (2, 33), device=DEVICE)
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        before = launch_info.last_launch()
        # aot_eager: the rest of the model runs the same kernels as eager, so the logits must
        # agree (inductor's own fusions are the MoE layer tests' business, above).
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids,
                                                                        use_cache=False).logits
        torch.cuda.synchronize()
        assert BACKEND == "torch" or launch_info.last_launch() is not before
    torch.testing.assert_close(got, eager)
    assert dynamo["graph_break"] == {}
