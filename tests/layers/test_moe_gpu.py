"""The MoE layer on an sm90 GPU: the cute backend against the torch backend and an fp32
reference, CUDA-graph capture with new inputs and routing per replay, and no host sync.

Tests run on both backends: "cute" (our kernels) and "torch" (bf16 through torch's native
grouped_mm, which is sync-free too), so a failure says which side broke. Setting
MOE_GEMM_TEST_MOE_BACKEND=torch puts the torch backend in cute's place (to check the tests
themselves, or the layer around the GEMMs, where the kernels are not available).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

from moe_gemm import GemmConfig
from moe_gemm.layers.moe import MoE, moe_experts
from moe_gemm.testing import assert_close_to_ref, calc_diff

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
UNDER_TEST = os.environ.get("MOE_GEMM_TEST_MOE_BACKEND", "cute")
BACKENDS = list(dict.fromkeys([UNDER_TEST, "torch"]))


def _moe(H: int, I: int, E: int, k: int, backend: str, seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(H, I, E, k, device=DEVICE, dtype=torch.bfloat16,
              config=GemmConfig(backend=backend), **kw)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.normal_(0, 0.1)
    return moe


def _x(T: int, H: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(DEVICE, torch.bfloat16)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Any host<->device synchronization inside raises (torch's sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


SHAPES = [
    # T, H, I, E, k, extra
    (1, 256, 128, 8, 2, {}),
    (77, 512, 256, 16, 4, {}),
    (300, 1024, 512, 64, 8, {}),
    (5, 512, 256, 256, 8, {}),  # decode: most of 256 experts get no token
    (513, 1024, 384, 32, 8, {"scoring": "sigmoid", "n_group": 8, "topk_group": 4,
                              "routed_scaling_factor": 2.5, "shared_intermediate_size": 384}),
    (64, 768, 256, 8, 8, {"shared_intermediate_size": 512, "shared_expert_gate": True}),
]


@pytest.mark.parametrize("T,H,I,E,k,extra", SHAPES)
def test_backend_matches_torch_backend_and_fp32(T: int, H: int, I: int, E: int, k: int,
                                             extra: dict) -> None:
    cute = _moe(H, I, E, k, UNDER_TEST, **extra)
    torch_ = _moe(H, I, E, k, "torch", **extra)
    torch_.load_state_dict(cute.state_dict())
    x = _x(T, H, seed=T)
    with torch.inference_mode():
        y = cute(x)
        y_torch = torch_(x)
        # fp32 reference on the same routing and the same bf16 weights
        w, ids = cute.route(x)
        ref = moe_experts(x.float(), ids, w, cute.w_gate_up.float(), cute.w_down.float(),
                          config=GemmConfig(backend="torch"))
        if cute.shared_experts is not None:
            s, xf = cute.shared_experts, x.float()
            shared = (torch.nn.functional.silu(xf @ s.gate_proj.weight.float().T)
                      * (xf @ s.up_proj.weight.float().T)) @ s.down_proj.weight.float().T
            if cute.shared_expert_gate is not None:
                shared = torch.sigmoid(xf @ cute.shared_expert_gate.weight.float().T) * shared
            ref = ref + shared
    assert y.dtype == torch.bfloat16 and y.shape == (T, H)
    assert_close_to_ref(y, ref, y_torch, max_calc_diff=max(1e-5, 2 * calc_diff(y_torch, ref)),
                        name=f"MoE {UNDER_TEST} T={T}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_and_one_token(backend: str) -> None:
    moe = _moe(256, 128, 16, 4, backend)
    with torch.inference_mode():
        assert moe(_x(0, 256, 1)).shape == (0, 256)
        x = _x(1, 256, 2)
        y = moe(x)
        w, ids = moe.route(x)
        ref = moe_experts(x.float(), ids, w, moe.w_gate_up.float(), moe.w_down.float(),
                          config=GemmConfig(backend="torch"))
        base = moe_experts(x, ids, w, moe.w_gate_up, moe.w_down,
                           config=GemmConfig(backend="torch"))
    assert_close_to_ref(y, ref, base, max_calc_diff=max(1e-5, 2 * calc_diff(base, ref)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_never_syncs(backend: str) -> None:
    moe = _moe(512, 256, 64, 8, backend, scoring="sigmoid", n_group=8, topk_group=4,
               shared_intermediate_size=256)
    with torch.inference_mode():
        moe(_x(100, 512, 3))  # compile / warm up outside the check
        xs = [_x(T, 512, 4 + T) for T in (1, 100, 257)]  # host->device copies stay outside too
        torch.cuda.synchronize()
        with no_sync():
            ys = [moe(x) for x in xs]
        torch.cuda.synchronize()
    assert all(torch.isfinite(y).all() for y in ys)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_capture_and_replay_with_new_routing(backend: str) -> None:
    T, H = 96, 512
    moe = _moe(H, 256, 32, 4, backend, shared_intermediate_size=128)
    static_x = _x(T, H, 10)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                moe(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        seen = []
        for trial in range(3):
            x = _x(T, H, 100 + trial) * (1 + trial)
            static_x.copy_(x)
            graph.replay()
            eager = moe(x)
            torch.cuda.synchronize()
            assert torch.equal(static_y, eager), f"replay {trial} differs from eager"
            seen.append(moe.route(x)[1])
    assert not torch.equal(seen[0], seen[1]), "the replays should route differently"


def test_hf_block_on_gpu_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("needs transformers >= 5")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from moe_gemm.integrations import transformers as hf

    cfg = DeepseekV3Config(hidden_size=1024, moe_intermediate_size=256, n_routed_experts=64,
                           num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                           routed_scaling_factor=2.5)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = DeepseekV3MoE(cfg).to(DEVICE, torch.bfloat16).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
        block32 = DeepseekV3MoE(cfg).to(DEVICE).eval()
        block32.load_state_dict({k: v.float() for k, v in block.state_dict().items()})
    moe = MoE.from_hf(block, config=GemmConfig(backend=UNDER_TEST))  # type: ignore[arg-type]
    x = _x(200, 1024, 11)
    with torch.inference_mode():
        y = moe(x)
        base = block(x)
        _, w, ids = block.gate(x)
        ref = block32.experts(x.float(), ids, w.float()) + block32.shared_experts(x.float())
        # the registered experts implementation, on the same module, without a host sync
        torch.cuda.synchronize()
        with no_sync():
            y_experts = hf.moe_gemm_experts_forward(block.experts, x, ids, w)
        torch.cuda.synchronize()
    assert_close_to_ref(y, ref, base, max_calc_diff=max(1e-5, 2 * calc_diff(base, ref)),
                        name="from_hf DeepseekV3MoE")
    ref_experts = block32.experts(x.float(), ids, w.float())
    base_experts = block.experts(x, ids, w)
    assert_close_to_ref(y_experts, ref_experts, base_experts,
                        max_calc_diff=max(1e-5, 2 * calc_diff(base_experts, ref_experts)),
                        name="moe_gemm experts forward")


@pytest.mark.parametrize("extra", [{"shared_intermediate_size": 384},
                                   {"shared_intermediate_size": 512, "shared_expert_gate": True}])
def test_shared_expert_on_a_side_stream_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch,
                                                            extra: dict) -> None:
    # The default: the same kernels on the same inputs as MOE_GEMM_SHARED_STREAM=0, the shared
    # expert issued on a second stream; eager and in a CUDA graph (two branches), from a
    # caller's stream.
    from moe_gemm.layers import shared_stream

    T, H = 200, 768
    moe = _moe(H, 256, 16, 4, UNDER_TEST, **extra)
    xs = [_x(T, H, 30 + i) for i in range(3)]
    with torch.inference_mode():
        monkeypatch.setenv(shared_stream.SHARED_STREAM_ENV, "0")
        want = [moe(x) for x in xs]
        monkeypatch.delenv(shared_stream.SHARED_STREAM_ENV)
        calls = []
        real = shared_stream.routed_beside_shared
        monkeypatch.setattr("moe_gemm.layers.moe.routed_beside_shared",
                            lambda *a: calls.append(1) or real(*a))
        for x, w in zip(xs, want):
            assert torch.equal(moe(x), w)
        assert len(calls) == len(xs)
        caller = torch.cuda.Stream()
        caller.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(caller):
            got = moe(xs[0])
        torch.cuda.current_stream().wait_stream(caller)
        assert torch.equal(got, want[0])
        static_x = xs[0].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        for x, w in zip(xs, want):
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_y, w)
