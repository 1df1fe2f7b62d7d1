"""The MoE layer on FP8 experts on an sm90 GPU: our FP8 kernels and quantizer against the fp64
reference of what the layer computes and against the torch backend, the 16-bit layer it was
quantized from, a DeepSeek-V3-style FP8 checkpoint block loaded with from_state_dict,
CUDA-graph capture with new inputs per replay, and no host sync."""

from __future__ import annotations

import pytest
import torch

from moe_gemm import GemmConfig, MoE, quantize_fp8_per_block
from moe_gemm.testing_fp8 import FFN_REL_BOUND, fp8_errors, moe_fp8_reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


def _record(name, passed, **fields):
    try:
        from tests.kernels.gpu_report import record
    except ImportError:  # (run outside scripts/gpu_session.py)
        return
    record(name, passed, **fields)


def _moe(H, I, E, k, seed=0, **kw):
    torch.manual_seed(seed)
    moe = MoE(H, I, E, k, device=DEVICE, dtype=torch.bfloat16, **kw)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.normal_(0, 0.1)
    return moe.eval()


def _x(T, H, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("granularity", ["block", "row"])
@pytest.mark.parametrize("T", [1, 512])
def test_fp8_layer_matches_reference(granularity, T):
    moe = _moe(2048, 1024, 64, 8, scoring="sigmoid", n_group=8, topk_group=4,
               routed_scaling_factor=2.5, shared_intermediate_size=1024)
    x = _x(T, 2048, 1)
    with torch.no_grad():
        y16 = moe(x)
        moe.quantize_fp8(granularity)
        y = moe(x)
        ref = moe_fp8_reference(moe, x)
        moe.config = GemmConfig(backend="torch")
        yt = moe(x)
    e, et, fid = fp8_errors(y, ref), fp8_errors(yt, ref), fp8_errors(y, y16)
    ok = e["rel"] < FFN_REL_BOUND and fid["rel"] < 8e-2
    _record(f"moe-fp8/{granularity}/T={T}", ok, ours=e, torch_backend=et, vs_bf16_layer=fid)
    assert e["rel"] < FFN_REL_BOUND, (e, et)
    assert et["rel"] < FFN_REL_BOUND, et
    assert fid["rel"] < 8e-2, fid


def test_fp8_checkpoint_block_graph_and_no_sync():
    H, I, E, k = 1024, 512, 32, 4
    src = _moe(H, I, E, k, seed=2)
    sd = {"gate.weight": src.router_weight.detach()}
    for e in range(E):
        for n, w in (("gate_proj", src.gate_up_proj[e, :I]), ("up_proj", src.gate_up_proj[e, I:]),
                     ("down_proj", src.down_proj[e])):
            q, s = quantize_fp8_per_block(w.detach())
            sd[f"experts.{e}.{n}.weight"], sd[f"experts.{e}.{n}.weight_scale_inv"] = q, s
    moe = MoE.from_state_dict(sd, k).eval()
    assert moe.fp8 == "block" and moe.gate_up_proj.is_cuda
    x = _x(256, H, 3)
    with torch.no_grad():
        moe(x)  # compile, plans
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        static_x = x.clone()
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        for trial in range(2):
            static_x.copy_(_x(256, H, 10 + trial))
            graph.replay()
            torch.cuda.synchronize()
            e = fp8_errors(static_y, moe_fp8_reference(moe, static_x))
            _record(f"moe-fp8/checkpoint/graph-replay{trial}", e["rel"] < FFN_REL_BOUND, **e)
            assert e["rel"] < FFN_REL_BOUND, e
