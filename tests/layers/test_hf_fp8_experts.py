"""moe_gemm as the experts implementation of transformers' FP8 experts (FineGrained FP8
checkpoints): integrations/transformers_fp8.py, on the CPU through the torch backend."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("transformers.integrations.finegrained_fp8")

from transformers.integrations.finegrained_fp8 import (  # noqa: E402
    ALL_FP8_EXPERTS_FUNCTIONS,
    FP8Experts,
)
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

from moe_gemm.integrations import register_transformers  # noqa: E402
from moe_gemm.integrations.transformers_fp8 import moe_gemm_fp8_experts_forward  # noqa: E402
from moe_gemm.ops.quantize import (  # noqa: E402
    dequantize_fp8,
    quantize_fp8_per_block,
    quantize_fp8_per_row,
    quantize_fp8_per_token_group,
)
from moe_gemm.testing_fp8 import FFN_REL_BOUND, assert_fp8_close, fp8_errors  # noqa: E402

H, I, E = 256, 128, 4


def _experts(seed: int, block=(128, 128), **config) -> torch.nn.Module:
    """A transformers FP8Experts (dispatching on its config) with random FP8 weights."""
    cfg = types.SimpleNamespace(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                hidden_act="silu", _experts_implementation="moe_gemm", **config)
    cls = use_experts_implementation(experts_class=FP8Experts,
                                     experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    m = cls(config=cfg, block_size=block)
    g = torch.Generator().manual_seed(seed)
    for name in ("gate_up_proj", "down_proj"):
        w = torch.randn(getattr(m, name).shape, generator=g) * 0.05
        scale_shape = getattr(m, name + "_scale_inv").shape
        if block is None:  # (E, c, 1): one scale per expert for each of c equal row chunks
            chunks = w.reshape(E, scale_shape[1], -1)
            s = chunks.abs().amax(dim=2, keepdim=True) / 448.0
            q = (chunks / s).reshape(w.shape).to(torch.float8_e4m3fn)
        else:
            q, s = quantize_fp8_per_block(w)
        getattr(m, name).data = q
        getattr(m, name + "_scale_inv").data = s.reshape(scale_shape)
    return m


def _inputs(seed: int, T: int, k: int, dtype=torch.bfloat16):
    """Tokens (T, H), expert ids (T, k) and routing weights (T, k)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    return x, torch.randint(0, E, (T, k), generator=g), torch.rand(T, k, generator=g)


def _weight(m: torch.nn.Module, name: str, e: int) -> torch.Tensor:
    q, s = getattr(m, name)[e], getattr(m, name + "_scale_inv")[e].float()
    if m.block_size is None:  # s (c, 1): c equal row chunks
        return (q.double().reshape(s.shape[0], -1) * s.double()).reshape(q.shape)
    return dequantize_fp8(q, s, "block").double()


def _reference(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor,
               w: torch.Tensor) -> torch.Tensor:
    """fp64 of what the path computes: tokens quantized as the path does (1x128 groups for
    block scales, per token for per-tensor ones), dequantized weights, the GEMM output rounded
    to x's dtype, the module's own gate, requantized, down, summed."""
    def fake_quant(v):
        if m.block_size is None:
            q, s = quantize_fp8_per_row(v)
            return dequantize_fp8(q, s, "row").double()
        q, s = quantize_fp8_per_token_group(v)
        return dequantize_fp8(q, s, "group").double()

    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    xq = fake_quant(x)
    for e in range(E):
        t, j = torch.nonzero(ids == e, as_tuple=True)
        if t.numel():
            h = (xq[t] @ _weight(m, "gate_up_proj", e).t()).to(x.dtype)
            y = (fake_quant(m._apply_gate(h)) @ _weight(m, "down_proj", e).t()).to(x.dtype)
            out.index_add_(0, t, y.double() * w[t, j].double()[:, None])
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gate", [{}, {"swiglu_limit": 0.05}])
def test_fp8_experts_run_on_moe_gemm(dtype, gate):
    register_transformers()
    m = _experts(3, **gate)
    x, ids, w = _inputs(4, 37, 2, dtype)
    ids[5] = E  # an expert-parallel sentinel: contributes nothing
    y = m(x, ids, w)  # dispatched by transformers to "moe_gemm"
    assert y.dtype == dtype and y.shape == (37, H)
    assert_fp8_close(y, _reference(m, x, ids, w).to(dtype))
    assert torch.equal(y, moe_gemm_fp8_experts_forward(m, x, ids, w))


def test_fp8_experts_with_one_scale_per_expert_and_no_tokens():
    register_transformers()
    m = _experts(5, block=None)
    x, ids, w = _inputs(6, 9, 3)
    y = m(x, ids, w)
    assert_fp8_close(y, _reference(m, x, ids, w).to(x.dtype))
    assert m(x[:0], ids[:0], w[:0]).shape == (0, H)


@pytest.mark.parametrize("change,pattern", [
    ({"activation_scheme": "static"}, "activation_scheme='static'"),
    ({"block_size": (64, 64)}, r"weight blocks \(64, 64\)"),
])
def test_what_the_fp8_path_cannot_run_is_named(change, pattern):
    m = _experts(7)
    for k, v in change.items():
        setattr(m, k, v)
    x = torch.randn(3, H).bfloat16()
    with pytest.raises(ValueError, match=pattern):
        moe_gemm_fp8_experts_forward(m, x, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


def test_experts_without_a_gate_are_refused_for_that_alone():
    # (the refusal also blamed "weights that are not FP8 [E, 2I, H]", which they may well be)
    m = _experts(8)
    m.has_gate = False
    m.up_proj, m.up_proj_scale_inv = m.gate_up_proj, m.gate_up_proj_scale_inv
    del m.gate_up_proj, m.gate_up_proj_scale_inv
    x = torch.randn(3, H).bfloat16()
    with pytest.raises(ValueError, match=r"with has_gate=False \(no gate projection\)$"):
        moe_gemm_fp8_experts_forward(m, x, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


@pytest.mark.parametrize("change,error,pattern", [
    (lambda x, i, w: (x[None], i, w), ValueError, r"hidden_states must be \(T, H\)"),
    (lambda x, i, w: (x, i.float(), w), TypeError, "top_k_index must hold integer expert ids"),
    (lambda x, i, w: (x, i, w[:, :1]), ValueError, "top_k_weights must match top_k_index"),
], ids=["3d-hidden", "float-ids", "weights-shape"])  # (every case: integrations/inputs.py's test)
def test_inputs_that_do_not_fit_are_named(change, error, pattern):
    # (a 3-D input failed inside an index op; routing of another token count gave a result
    # of that count; (T, 1) weights for (T, 2) ids were broadcast; float ids were truncated)
    m = _experts(11)
    x, ids, w = _inputs(12, 9, 2)
    with pytest.raises(error, match=pattern):
        moe_gemm_fp8_experts_forward(m, *change(x, ids, w))
    small = moe_gemm_fp8_experts_forward(m, x, ids.to(torch.uint8), w)  # integer ids of any width
    assert torch.equal(small, moe_gemm_fp8_experts_forward(m, x, ids, w))


def test_backward_through_fp8_experts_raises_as_inference_only():
    # FP8Experts' weights and scales are Parameters that require grad (transformers' default):
    # a forward with grad enabled runs; a backward raised from inside torch (no addition for
    # float8 gradients) rather than the path's own inference-only error.
    m = _experts(13)
    assert m.gate_up_proj.requires_grad and m.down_proj_scale_inv.requires_grad
    x, ids, w = _inputs(14, 9, 2)
    y = moe_gemm_fp8_experts_forward(m, x, ids, w)
    with torch.no_grad():
        assert torch.equal(y, moe_gemm_fp8_experts_forward(m, x, ids, w))
    with pytest.raises(RuntimeError, match="FP8 MoE layer is inference-only"):
        y.float().sum().backward()


def test_scales_that_are_not_floating_point_are_refused():
    # (integer scales were widened by .float() and every output was off by their values)
    m = _experts(15)
    m.down_proj_scale_inv = torch.nn.Parameter(torch.ones(E, 2, 1, dtype=torch.int32),
                                               requires_grad=False)
    x, ids, w = _inputs(16, 5, 2)
    with pytest.raises(TypeError, match="down_proj_scale_inv must be a floating-point"):
        moe_gemm_fp8_experts_forward(m, x, ids, w)


@pytest.mark.parametrize("missing", ["gate_up_proj_scale_inv", "down_proj_scale_inv"])
def test_a_missing_scale_is_named(missing):
    # (a missing down_proj_scale_inv failed an assert inside the path)
    m = _experts(17)
    setattr(m, missing, None)
    x, ids, w = _inputs(18, 5, 2)
    with pytest.raises(ValueError, match="scale_inv"):
        moe_gemm_fp8_experts_forward(m, x, ids, w)


@pytest.mark.parametrize("block", [(128, 128), None])
def test_fp4_experts_are_refused_by_name(block):
    # FP4 experts hold int8 bytes (one byte per element, like FP8): refused as FP4, not
    # taken for FP8 and failing later on the dtype or the scale shapes.
    cfg = types.SimpleNamespace(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                                hidden_act="silu", _experts_implementation="moe_gemm")
    m = FP8Experts(cfg, block_size=block, expert_dtype="fp4")
    x = torch.randn(3, H).bfloat16()
    with pytest.raises(ValueError, match="FP4 experts"):
        moe_gemm_fp8_experts_forward(m, x, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


@pytest.mark.parametrize("first", ["moe_gemm", "transformers"])
def test_registered_whichever_is_imported_first(first):
    # transformers' FP8 module imports its MoE module first: the registration must not be
    # attempted while it is half-loaded (a fresh interpreter for each order).
    imports = ["import moe_gemm", "import transformers.integrations.finegrained_fp8 as f"]
    if first == "transformers":
        imports.reverse()
    code = "; ".join([*imports, "import transformers.integrations.finegrained_fp8 as f",
                      "print('moe_gemm' in f.FP8ExpertsInterface._global_mapping)"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), None])
def test_fp8_experts_on_the_gpu_kernels(block):
    # The same dispatch on an sm90 GPU: our FP8 quantizer and grouped GEMMs, against the fp64
    # reference computed on the CPU from the same weights and tokens. The GPU's intermediate
    # is rounded and quantized from its own fp32 accumulators, so the whole FFN is held to the
    # FP8 FFN bar (testing_fp8.FFN_REL_BOUND), as the MoE layer's FP8 GPU tests are.
    register_transformers()
    m = _experts(8, block=block)
    x, ids, w = _inputs(9, 300, 2)
    ref = _reference(m, x, ids, w).to(torch.bfloat16)
    m = m.to("cuda")
    xc, idc, wc = x.cuda(), ids.cuda(), w.cuda()
    y = m(xc, idc, wc)
    assert torch.equal(y, moe_gemm_fp8_experts_forward(m, xc, idc, wc))  # the dispatch is ours
    e = fp8_errors(y, ref)
    assert torch.isfinite(y).all()
    assert e["rel"] <= FFN_REL_BOUND and e["max_rel"] <= 2e-2, e
