"""ops/quantize_custom_ops.py: quantize_fp8_per_block and dequantize_fp8 under torch.compile
with inductor (the default backend) give eager's values bit for bit where a block is partial
(inductor had dropped the columns past the last whole block), with scale gradients and under
torch.vmap as eager's."""

from __future__ import annotations

import pytest
import torch

from moe_gemm import dequantize_fp8, quantize_fp8_per_block, quantize_fp8_per_token_group

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("shape,block,dtype", [
    ((2, 128, 300), 128, E4M3),   # K: two whole blocks and 44 columns
    ((5, 3, 70), 64, E5M2),       # N below one block, K partial
    ((100, 260), 128, E4M3),      # 2-D, both partial
])
def test_compiled_block_quantizer_and_dequantizer_match_eager(shape, block, dtype) -> None:
    w = torch.randn(*shape, generator=_gen(7), dtype=torch.bfloat16) * 4

    def roundtrip(t):
        q, s = quantize_fp8_per_block(t, block, dtype=dtype)
        return q, s, dequantize_fp8(q, s, "block", block)

    q0, s0, d0 = roundtrip(w)
    q, s, d = torch.compile(roundtrip, fullgraph=True)(w)
    assert torch.equal(_bits(q), _bits(q0)) and torch.equal(s, s0)
    assert torch.equal(d, d0)
    # the values themselves, not only eager's: within half an FP8 step of w (3 or 2 mantissa
    # bits), or of the subnormal grid below the smallest normal
    half_step = 2.0 ** -4 if dtype == E4M3 else 2.0 ** -3
    assert bool(((d - w.float()).abs() <= half_step * w.float().abs() + s.max()).all())


def test_compiled_group_dequantizer_matches_eager_on_a_partial_group() -> None:
    q, s = quantize_fp8_per_token_group(torch.randn(6, 384, generator=_gen(8)), 128)
    q, s = q[:, :300], s.contiguous()  # K = 300: the third group covers 44 columns
    d0 = dequantize_fp8(q, s, "group", 128)
    d = torch.compile(lambda a, b: dequantize_fp8(a, b, "group", 128), fullgraph=True)(q, s)
    assert torch.equal(d, d0)
    assert torch.equal(d[:, 256:], q[:, 256:].float() * s[:, 2:3])


@pytest.mark.parametrize("granularity,shape", [("block", (2, 130, 200)), ("group", (3, 5, 300))])
def test_compiled_dequantizer_scale_gradient_matches_eager(granularity, shape) -> None:
    q = (torch.randn(*shape, generator=_gen(9)) * 50).to(E4M3)
    sshape = ((*shape[:-2], 2, 2) if granularity == "block" else (*shape[:-1], 3))
    scale = torch.rand(*sshape, generator=_gen(10)) + 0.5
    grad_out = torch.randn(*shape, generator=_gen(11))

    def grads(fn):
        s = scale.clone().requires_grad_(True)
        fn(q, s).backward(grad_out)
        return s.grad

    g0 = grads(lambda a, b: dequantize_fp8(a, b, granularity, 128))
    g = grads(torch.compile(lambda a, b: dequantize_fp8(a, b, granularity, 128), fullgraph=True))
    torch.testing.assert_close(g, g0, rtol=1e-6, atol=1e-6)
    # fp64 reference: grad * q summed over each scale's block
    ref = torch.zeros(sshape, dtype=torch.float64)
    qd, gd = q.double(), grad_out.double()
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in sshape]).tolist():
        if granularity == "block":
            *lead, i, j = idx
            blk = (*lead, slice(128 * i, 128 * i + 128), slice(128 * j, 128 * j + 128))
        else:
            *lead, j = idx
            blk = (*lead, slice(128 * j, 128 * j + 128))
        ref[tuple(idx)] = (qd[blk] * gd[blk]).sum()
    torch.testing.assert_close(g.double(), ref, rtol=1e-5, atol=1e-4)


def test_compiled_block_quantizer_keeps_the_raising_backward() -> None:
    w = torch.randn(2, 64, 100, generator=_gen(12), requires_grad=True)
    q, s = torch.compile(lambda t: quantize_fp8_per_block(t, 64), fullgraph=True)(w)
    q0, s0 = quantize_fp8_per_block(w.detach(), 64)
    assert torch.equal(_bits(q), _bits(q0)) and torch.equal(s, s0)
    with pytest.raises(RuntimeError, match="quantizers have no backward"):
        s.sum().backward()


def test_block_ops_under_vmap_go_entry_by_entry() -> None:
    """The ops' vmap rule (compiled code called under torch.vmap)."""
    w = torch.randn(3, 2, 70, 90, generator=_gen(13))
    out = torch.vmap(lambda t: torch.ops.moe_gemm._quantize_fp8_per_block(t, 64, E4M3))(w)
    for i in range(3):
        qi, si = quantize_fp8_per_block(w[i], 64)
        assert torch.equal(_bits(out[0][i]), _bits(qi)) and torch.equal(out[1][i], si)
    d = torch.vmap(lambda a, b: torch.ops.moe_gemm._dequantize_fp8(a, b, "block", 64))(*out)
    for i in range(3):
        assert torch.equal(d[i], dequantize_fp8(out[0][i], out[1][i], "block", 64))
