"""DeepSeek-V4's routing on an sm90 GPU: sqrt(softplus) scores and hash routing by token id in
the MoE layer, against the torch backend and a float64 reference, with no host sync, in a
CUDA graph replayed with new token ids, and ids outside the table clamped (never an
out-of-bounds read)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from moe_testutils import naive_experts
from test_moe_gpu import _moe, _x, no_sync
from test_routing import _as_dicts, _assert_routing_equal, _hash_ref, _sigmoid_grouped_ref

from moe_gemm.layers.routing import hash_topk, sqrtsoftplus_grouped_topk
from moe_gemm.testing import assert_close_to_ref, calc_diff

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
UNDER_TEST = os.environ.get("MOE_GEMM_TEST_MOE_BACKEND", "cute")
V = 1000


def _hash_moe(backend: str, seed: int = 0, **kw):
    moe = _moe(512, 256, 16, 4, backend, seed, scoring="sqrtsoftplus", hash_vocab_size=V,
               routed_scaling_factor=1.5, **kw)
    g = torch.Generator().manual_seed(seed)
    moe.tid2eid = torch.randint(0, 16, (V, 4), generator=g).to(DEVICE)
    return moe


def _ids(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (T,), generator=g).to(DEVICE)


@pytest.mark.parametrize("E,k,n_group,topk_group", [(8, 2, 1, 1), (64, 6, 1, 1),
                                                    (256, 8, 8, 4)])
def test_sqrtsoftplus_router_on_the_gpu_matches_reference(E, k, n_group, topk_group) -> None:
    logits = torch.randn(41, E, device=DEVICE, dtype=torch.bfloat16) * 3
    bias = torch.randn(E, device=DEVICE) * 0.3
    with no_sync():
        weights, ids = sqrtsoftplus_grouped_topk(logits, bias, k, n_group, topk_group, 1.5)
    want = _sigmoid_grouped_ref(logits.float().cpu(), bias.cpu(), k, n_group, topk_group, 1.5,
                                True, scoring="sqrtsoftplus")
    _assert_routing_equal(_as_dicts(weights.cpu(), ids.cpu()), want)


def test_hash_router_on_the_gpu_matches_reference_and_clamps() -> None:
    logits = torch.randn(37, 16, device=DEVICE) * 2
    table = torch.randint(0, 16, (V, 4), device=DEVICE)
    tok = _ids(37, 3)
    with no_sync():
        weights, ids = hash_topk(logits, table, tok, "sqrtsoftplus", 1.5)
    want = _hash_ref(logits.cpu(), table.cpu(), tok.cpu(), "sqrtsoftplus", 1.5, True)
    assert ids.cpu().tolist() == [[e for e, _ in row] for row in want]
    ref = torch.tensor([[v for _, v in row] for row in want], dtype=torch.float64)
    torch.testing.assert_close(weights.double().cpu(), ref, rtol=1e-6, atol=1e-7)
    # ids outside the table and a table entry outside [0, E) are clamped, not read out of
    # bounds (nothing on a GPU reads them on the host)
    bad_tok = tok.clone()
    bad_tok[:3] = torch.tensor([V, -5, 10**9], device=DEVICE)
    bad_table = table.clone()
    bad_table[tok[5]] = torch.tensor([16, -1, 99, 3], device=DEVICE)
    with no_sync():
        w2, i2 = hash_topk(logits, bad_table, bad_tok, "sqrtsoftplus", 1.5)
    torch.cuda.synchronize()
    assert int(i2.min()) >= 0 and int(i2.max()) < 16
    assert torch.equal(i2[0], table[V - 1]) and torch.equal(i2[1], table[0])
    assert i2[5].tolist() == [15, 0, 15, 3]


@pytest.mark.parametrize("T", [1, 77, 1024])
def test_hash_layer_matches_torch_backend_and_fp32(T: int) -> None:
    moe = _hash_moe(UNDER_TEST, shared_intermediate_size=128)
    ref_layer = _hash_moe("torch", shared_intermediate_size=128)
    x, tok = _x(T, 512, T), _ids(T, T)
    with torch.no_grad(), no_sync():
        y = moe(x, input_ids=tok)
        base = ref_layer(x, input_ids=tok)
    with torch.no_grad():
        w, ids = moe.route(x, input_ids=tok)
        assert torch.equal(ids, moe.tid2eid[tok])
        xc = x.cpu()
        ref = naive_experts(xc, ids.cpu(), w.cpu(), moe.gate_up_proj.cpu(), moe.down_proj.cpu(),
                            dtype=torch.float32)
        s = moe.shared_experts
        v = xc.float()
        h = F.silu(v @ s.gate_proj.weight.float().cpu().T) * (v @ s.up_proj.weight.float().cpu().T)
        ref = ref + h @ s.down_proj.weight.float().cpu().T
    assert_close_to_ref(y.float().cpu(), ref, base.float().cpu(),
                        max_calc_diff=max(1e-4, 2 * calc_diff(base.float().cpu(), ref)),
                        name=f"hash layer T={T}")


def test_hash_layer_in_a_cuda_graph_with_new_token_ids() -> None:
    moe = _hash_moe(UNDER_TEST)
    T = 96
    static_x, static_tok = _x(T, 512, 1), _ids(T, 1)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                moe(static_x, input_ids=static_tok)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = moe(static_x, input_ids=static_tok)
        for trial in range(3):
            tok = _ids(T, 100 + trial)
            static_tok.copy_(tok)
            graph.replay()
            eager = moe(static_x, input_ids=tok)
            torch.cuda.synchronize()
            assert torch.equal(static_y, eager), f"replay {trial} differs from eager"
