"""ops/quantize.py on the CPU: FP8 quantization round trips, scale layouts, saturation, edge
cases and errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_gemm import (
    dequantize_fp8,
    quantize_fp8_per_block,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
)
from moe_gemm.ops.quantize import FP8_MAX, MIN_AMAX

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Relative rounding error of a normal FP8 value: half a step of 3 (e4m3) or 2 (e5m2) mantissa
# bits; values below the smallest normal (2^-6 / 2^-14 of the scale unit) are rounded to the
# subnormal grid (2^-9 / 2^-16 of it).
HALF_STEP = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3}
SUBNORMAL = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _check_round_trip(x, deq, scale_per_value, dtype):
    err = (deq - x.float()).abs()
    bound = HALF_STEP[dtype] * x.float().abs() + SUBNORMAL[dtype] * scale_per_value * 0.5001
    assert bool((err <= bound + 1e-30).all()), float((err - bound).max())


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16, torch.float16])
def test_per_token_group_round_trip(dtype, src):
    x = (torch.randn(7, 3, 384, generator=_gen(1)) * 10.0 ** torch.randint(-3, 4, (7, 3, 1),
         generator=_gen(2))).to(src)
    q, s = quantize_fp8_per_token_group(x, dtype=dtype)
    assert q.shape == x.shape and q.dtype == dtype
    assert s.shape == (7, 3, 3) and s.dtype == torch.float32
    groups = x.float().view(7, 3, 3, 128)
    # The scale is the group's max magnitude over the FP8 maximum, and that value maps to
    # +-FP8_MAX exactly.
    torch.testing.assert_close(s, groups.abs().amax(-1) / FP8_MAX[dtype], rtol=0, atol=0)
    qg = q.float().view(7, 3, 3, 128)
    assert torch.equal(qg.abs().amax(-1), torch.full((7, 3, 3), FP8_MAX[dtype]))
    deq = dequantize_fp8(q, s, "group")
    _check_round_trip(x, deq, s.repeat_interleave(128, -1), dtype)


@pytest.mark.parametrize("shape", [(7, 3, 384), (1, 256), (5, 128), (0, 256), (4, 0)])
def test_per_token_group_column_major_scales(shape):
    """column_major_scales: the same values, token-major in memory (stride 1 along the
    tokens) with each group's column padded to a multiple of 4 tokens (16-byte aligned), as
    scaled_grouped_mm's staged scales load them."""
    x = torch.randn(*shape, generator=_gen(5)) * 3.0
    q, s = quantize_fp8_per_token_group(x)
    qc, sc = quantize_fp8_per_token_group(x, column_major_scales=True)
    assert torch.equal(q.view(torch.uint8), qc.view(torch.uint8))
    assert sc.shape == s.shape and torch.equal(sc, s)
    T, G = math.prod(shape[:-1]), shape[-1] // 128
    flat = sc.reshape(T, G)  # (a view: the token dims merge)
    if T > 1 and G > 1:
        assert flat.stride(0) == 1 and flat.stride(1) % 4 == 0 and flat.stride(1) >= T
        assert flat.data_ptr() % 16 == 0
        assert flat.untyped_storage().data_ptr() == sc.untyped_storage().data_ptr()
    with pytest.raises(TypeError, match="column_major_scales must be a bool"):
        quantize_fp8_per_token_group(x, column_major_scales=1)  # type: ignore[arg-type]


def test_per_token_group_zeros_small_and_saturation():
    x = torch.zeros(2, 256)
    x[1, 128:] = 1e-30  # far below any sensible scale: still finite
    q, s = quantize_fp8_per_token_group(x)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.equal(q[0].float(), torch.zeros(256))
    assert float(s[0, 0]) == pytest.approx(MIN_AMAX / 448.0)
    # Values that round above the maximum saturate (e4m3 has no infinity).
    y = torch.tensor([[448.0, -448.0] + [1.0] * 126]) * 3.0
    qy, sy = quantize_fp8_per_token_group(y)
    assert torch.isfinite(qy.float()).all()
    assert float(qy.float().abs().max()) == 448.0


def test_per_token_group_errors():
    with pytest.raises(ValueError, match="multiple of group_size=128"):
        quantize_fp8_per_token_group(torch.randn(4, 100))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize_fp8_per_token_group(torch.zeros(4, 128, dtype=torch.int32))
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.float8_e5m2"):
        quantize_fp8_per_token_group(torch.zeros(4, 128), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        quantize_fp8_per_token_group(torch.zeros(4, 128), group_size=0)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        quantize_fp8_per_token_group([1.0] * 128)  # type: ignore[arg-type]
    q, s = quantize_fp8_per_token_group(torch.zeros(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    q, s = quantize_fp8_per_token_group(torch.randn(5, 64), group_size=32)
    assert s.shape == (5, 2)


def test_numpy_integer_sizes_are_ints():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    for want, got in zip(quantize_fp8_per_token_group(x),
                         quantize_fp8_per_token_group(x, group_size=np.int64(128))):
        assert torch.equal(want.float(), got.float())


@pytest.mark.parametrize("size", [128.0, "128", True, None])
def test_a_group_or_block_size_that_is_not_an_int_is_a_type_error(size):
    # (as every int option of the public API: it was a ValueError saying "positive int")
    with pytest.raises(TypeError, match=r"^group_size must be a positive int; got "):
        quantize_fp8_per_token_group(torch.zeros(4, 128), group_size=size)
    with pytest.raises(TypeError, match=r"^block_size must be a positive int; got "):
        quantize_fp8_per_block(torch.zeros(128, 128), block_size=size)
    with pytest.raises(TypeError, match=r"^block_size must be a positive int; got "):
        dequantize_fp8(torch.zeros(4, 128, dtype=E4M3), torch.ones(4, 1), "group",
                       block_size=size)


@pytest.mark.parametrize("fn", [quantize_fp8_per_token_group, quantize_fp8_per_block,
                                quantize_fp8_per_row, quantize_fp8_per_tensor])
@pytest.mark.parametrize("dtype", [[E4M3], "float8_e4m3fn", torch.int8])
def test_a_dtype_that_is_not_an_fp8_dtype_is_named(fn, dtype):
    """dtype of any kind other than the two FP8 dtypes (an unhashable list among them, which
    failed the lookup with "unhashable type: 'list'"): a TypeError naming what it must be."""
    with pytest.raises(TypeError, match="dtype must be torch.float8_e4m3fn or torch.float8_e5m2"):
        fn(torch.randn(4, 128), dtype=dtype)


@pytest.mark.parametrize("shape", [(256, 384), (3, 200, 300), (1, 128, 128), (2, 1, 1)])
def test_per_block_round_trip(shape):
    w = torch.randn(*shape, generator=_gen(3))
    w[..., : min(shape[-2], 5), :] *= 100.0  # one block row much larger: its own scale
    q, s = quantize_fp8_per_block(w)
    N, K = shape[-2:]
    assert q.shape == w.shape and s.shape == (*shape[:-2], -(-N // 128), -(-K // 128))
    # Each scale is its block's own max (partial edge blocks included) over 448.
    for idx in [(0, 0), (s.shape[-2] - 1, s.shape[-1] - 1)]:
        r, c = idx
        block = w[..., r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
        want = block.abs().flatten(-2).amax(-1) / 448.0
        torch.testing.assert_close(s[..., r, c], want, rtol=0, atol=0)
    deq = dequantize_fp8(q, s, "block")
    per_value = s.repeat_interleave(128, -2)[..., :N, :].repeat_interleave(128, -1)[..., :K]
    _check_round_trip(w, deq, per_value, E4M3)


@pytest.mark.parametrize("shape", [(6, 200, 300), (2, 3, 130, 128), (5, 0, 7)])
def test_per_block_bounds_its_fp32_working_set(monkeypatch, shape):
    """A stack of weights is quantized a few at a time (quantize.CHUNK_ELEMENTS fp32 values
    per step; the whole stack at once took ~4.5x a bf16 weight's size in fp32 temporaries:
    tens of GB for a large MoE layer), with the values of one weight at a time."""
    from moe_gemm.ops import quantize
    from moe_gemm.testing_fp8 import LargestFloat32

    w = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=_gen(9)).bfloat16()
    w = w.transpose(-1, -2)  # a strided view, as a checkpoint's transposed weight
    N, K = shape[-2:]
    per_weight = -(-N // 128) * 128 * -(-K // 128) * 128
    monkeypatch.setattr(quantize, "CHUNK_ELEMENTS", 2 * per_weight, raising=False)
    with LargestFloat32() as seen:
        q, s = quantize_fp8_per_block(w)
    assert seen.largest <= 2 * per_weight
    assert q.shape == w.shape and s.shape == (*shape[:-2], -(-N // 128), -(-K // 128))
    L = math.prod(shape[:-2])
    flat_q, flat_s = q.reshape(L, N, K), s.reshape(L, *s.shape[-2:])
    for i, wi in enumerate(w.reshape(L, N, K)):
        qi, si = quantize_fp8_per_block(wi)
        assert torch.equal(flat_q[i].view(torch.uint8), qi.view(torch.uint8))
        assert torch.equal(flat_s[i], si)


@pytest.mark.parametrize("block", [4096, 1 << 40])
def test_a_block_larger_than_the_weight_pads_no_further(block):
    """A block past a weight's dims is one block over the whole weight, quantized and
    dequantized within the weight's own size (each dim was padded to block_size: a 16 x 16
    weight took 16 GiB of fp32 at 65536, and the process was killed)."""
    from moe_gemm.testing_fp8 import LargestFloat32

    w = torch.randn(2, 12, 16, generator=_gen(11))
    with LargestFloat32() as seen:  # (on meta: the sizes, no memory)
        qm, sm = quantize_fp8_per_block(w.to("meta"), block)
        dequantize_fp8(qm, sm, "block", block)
        dequantize_fp8(qm[:, 0], sm[:, 0], "group", block)
    assert seen.largest <= w.numel()
    q, s = quantize_fp8_per_block(w, block)
    q16, s16 = quantize_fp8_per_block(w, 16)  # (one block over each weight too)
    assert torch.equal(q.view(torch.uint8), q16.view(torch.uint8)) and torch.equal(s, s16)
    assert torch.equal(dequantize_fp8(q, s, "block", block), dequantize_fp8(q16, s16, "block", 16))


def test_per_row_and_per_tensor_round_trip():
    x = torch.randn(9, 300, generator=_gen(4)) * torch.logspace(-2, 2, 9)[:, None]
    q, s = quantize_fp8_per_row(x)
    assert s.shape == (9,)
    torch.testing.assert_close(s, x.abs().amax(-1) / 448.0, rtol=0, atol=0)
    _check_round_trip(x, dequantize_fp8(q, s, "row"), s[:, None].expand_as(x), E4M3)
    q, s = quantize_fp8_per_tensor(x, dtype=E5M2)
    assert s.shape == () and q.dtype == E5M2
    _check_round_trip(x, dequantize_fp8(q, s, "tensor"), s.expand_as(x), E5M2)
    # Empty tensors and an empty last dim keep finite scales.
    q, s = quantize_fp8_per_row(torch.zeros(3, 0))
    assert q.shape == (3, 0) and torch.isfinite(s).all()
    q, s = quantize_fp8_per_tensor(torch.zeros(0))
    assert torch.isfinite(s)


def test_dequantize_errors():
    q = torch.zeros(2, 128, dtype=E4M3)
    with pytest.raises(ValueError, match="granularity must be one of"):
        dequantize_fp8(q, torch.ones(2, 1), "channel")
    with pytest.raises(TypeError, match="FP8"):
        dequantize_fp8(q.float(), torch.ones(2, 1), "group")
    with pytest.raises(ValueError, match="scale is on meta but q is on cpu"):
        dequantize_fp8(q, torch.ones(2, 1, device="meta"), "group")
    with pytest.raises(ValueError, match="scale is on cpu but q is on meta"):
        dequantize_fp8(q.to("meta"), torch.ones(2, 1), "group")
    with pytest.raises(ValueError, match="at least two dimensions"):
        quantize_fp8_per_block(torch.randn(128))


def test_torch_path_matches_the_kernel_formula():
    """The torch path computes q = sat(x * (448 / amax)) and s = amax / 448 in fp32, the
    formula of kernels/sm90/quantize_fp8.py, so the GPU kernel can be checked bit for bit."""
    x = torch.randn(4, 256, generator=_gen(5)).bfloat16()
    q, s = quantize_fp8_per_token_group(x)
    g = x.float().view(4, 2, 128)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX)
    want = (g * (448.0 / amax)).clamp(-448, 448).to(E4M3).view(4, 256)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(s, (amax / 448.0).view(4, 2))


def test_dequantize_checks_the_scale_shape():
    """A scale that is not its granularity's shape is refused: too many groups were cut off and
    too few broadcast, giving a silently wrong tensor or a bare broadcast error."""
    q, s = quantize_fp8_per_token_group(torch.randn(2, 256))
    for granularity, bad in (("group", torch.ones(2, 3)), ("group", torch.ones(2, 1)),
                             ("row", torch.ones(1)), ("row", torch.ones(3)),
                             ("block", torch.ones(5, 5)), ("block", torch.ones(1, 1)),
                             ("tensor", torch.ones(2))):
        with pytest.raises(ValueError, match=f"{granularity} scales of q"):
            dequantize_fp8(q, bad, granularity)
    # (the message names every shape it takes: () and (1,) for one scale)
    with pytest.raises(ValueError, match=r"must have shape \(\) or \(1,\); got \(2,\)"):
        dequantize_fp8(q, torch.ones(2), "tensor")
    assert torch.equal(dequantize_fp8(q, torch.ones(1), "tensor"), q.float())
    with pytest.raises(TypeError, match="q must be"):
        dequantize_fp8([1.0], torch.ones(()), "tensor")
    with pytest.raises(TypeError, match="scale must be a float tensor"):
        dequantize_fp8(q, 2.0, "tensor")
    with pytest.raises(TypeError, match="scale must be a float tensor"):
        dequantize_fp8(q, torch.ones(2, 2, dtype=torch.int32), "group")
    with pytest.raises(ValueError, match="at least 2 dimension"):
        dequantize_fp8(q[0], torch.ones(1, 2), "block")
    # The shapes the quantizers return (ceil for partial blocks) and [1] per tensor pass.
    w = torch.randn(3, 200, 300)
    qw, sw = quantize_fp8_per_block(w)
    ref = qw.float() * sw.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)[:, :, :300]
    assert torch.equal(dequantize_fp8(qw, sw, "block"), ref)
    assert torch.equal(dequantize_fp8(q, torch.full((1,), 2.0), "tensor"), q.float() * 2)


def test_dequantize_refuses_sparse_operands():
    q = torch.ones(3, 4).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="scale must be a dense"):
        dequantize_fp8(q, torch.tensor([1.0, 2.0, 3.0]).to_sparse(), "row")
    with pytest.raises(TypeError, match="q must be a dense"):
        dequantize_fp8(torch.ones(3, 4).to_sparse().to(torch.float8_e4m3fn),
                       torch.tensor([1.0, 2.0, 3.0]), "row")


def test_per_token_group_under_vmap_matches_the_unbatched_call() -> None:
    """Under torch.vmap the quantizer cannot fill its preallocated scale buffer with a batched
    result: it returns the torch sequence's values, the same as calls on each entry."""
    x = torch.randn(3, 5, 256) * torch.rand(3, 5, 1) * 10
    q, s = torch.func.vmap(quantize_fp8_per_token_group)(x)
    for i in range(3):
        qi, si = quantize_fp8_per_token_group(x[i])
        assert torch.equal(q[i].float(), qi.float()) and torch.equal(s[i], si)
    deq = q.double() * s.double().repeat_interleave(128, -1)
    assert ((deq - x.double()).abs() <= x.double().abs().amax(-1, keepdim=True) / 16).all()


@pytest.mark.parametrize("shape,chunk", [((3, 200, 300), None), ((2, 4, 130, 128), 2)])
def test_per_block_under_vmap_matches_the_unbatched_call(monkeypatch, shape, chunk) -> None:
    """torch.vmap over a stack of weights (partial edge blocks, and a stack past the chunked
    working set) gives each entry's own call: the padding and the chunked outputs must not be
    written in place into tensors the batch dimension does not reach."""
    from moe_gemm.ops import quantize

    if chunk is not None:
        per_weight = -(-shape[-2] // 128) * 128 * -(-shape[-1] // 128) * 128
        monkeypatch.setattr(quantize, "CHUNK_ELEMENTS", chunk * per_weight, raising=False)
    w = torch.randn(*shape, generator=_gen(31)) * torch.rand(shape[0], *[1] * (len(shape) - 1),
                                                               generator=_gen(32)) * 10
    q, s = torch.func.vmap(quantize_fp8_per_block)(w)
    assert q.shape == w.shape and q.dtype == E4M3
    for i in range(shape[0]):
        qi, si = quantize_fp8_per_block(w[i])
        assert torch.equal(q[i].view(torch.uint8), qi.view(torch.uint8))
        assert torch.equal(s[i], si)


QUANTIZERS = [
    pytest.param(quantize_fp8_per_token_group, (6, 256), "group", id="per_token_group"),
    pytest.param(quantize_fp8_per_block, (2, 200, 300), "block", id="per_block"),
    pytest.param(quantize_fp8_per_row, (6, 200), "row", id="per_row"),
    pytest.param(quantize_fp8_per_tensor, (6, 200), "tensor", id="per_tensor"),
]


@pytest.mark.parametrize("fn,shape,granularity", QUANTIZERS)
def test_quantizers_have_no_backward(fn, shape, granularity) -> None:
    """x that requires grad (hidden states, an nn.Parameter in grad mode): the same values, and
    a backward through q or the scale raises saying what to do. torch's ops failed it with
    an unrelated in-place error (the amax clamped in place), and would otherwise hand back a
    gradient rounded to FP8 on its way through the cast."""
    x = torch.randn(*shape, generator=_gen(41)) * 3
    q0, s0 = fn(x)
    xr = x.clone().requires_grad_(True)
    q, s = fn(xr)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    assert q.requires_grad and s.requires_grad
    with pytest.raises(RuntimeError, match="quantizers have no backward"):
        s.sum().backward()
    q, s = fn(xr)
    with pytest.raises(RuntimeError, match="quantizers have no backward"):
        dequantize_fp8(q, s, granularity).sum().backward()
    with pytest.raises(RuntimeError, match="quantizers have no backward"):
        torch.func.grad(lambda t: fn(t)[1].sum())(x)
    # Under torch.vmap the scale went unlinked (a BatchedTensor reports requires_grad=False):
    # its backward ran through torch's ops and left a gradient in x.grad.
    q, s = torch.func.vmap(fn)(torch.stack([xr, 2 * xr]))
    assert torch.equal(q[0].view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s[0], s0)
    with pytest.raises(RuntimeError, match="quantizers have no backward"):
        s.sum().backward()
    assert xr.grad is None
    with torch.no_grad():
        q, s = fn(xr)
    assert not q.requires_grad and not s.requires_grad


@pytest.mark.parametrize("fn,shape,granularity", QUANTIZERS)
def test_quantizers_compile_on_a_tracked_input(fn, shape, granularity) -> None:
    """torch.compile(fullgraph=True) of a quantizer on an input that requires grad: it
    compiles (the in-place amax clamp failed the joint graph before any backward was asked
    for), gives eager's values, and its backward raises as eager's does."""
    import torch._dynamo

    torch._dynamo.reset()
    x = torch.randn(*shape, generator=_gen(42)) * 3
    q0, s0 = fn(x)
    q, s = torch.compile(fn, fullgraph=True, backend="aot_eager")(x.clone().requires_grad_(True))
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    with pytest.raises(RuntimeError, match="quantizers have no backward"):
        s.sum().backward()
    torch._dynamo.reset()


@pytest.mark.parametrize("fn,shape,granularity", QUANTIZERS)
def test_non_finite_inputs_give_the_documented_scales(fn, shape, granularity) -> None:
    """The module docstring's contract for every quantizer: a NaN makes its group's scale and q
    NaN, an infinity its scale infinite; the other groups are untouched."""
    x = torch.randn(*shape, generator=_gen(43))
    for bad, scale_is in ((float("nan"), torch.isnan), (float("inf"), torch.isinf)):
        xb = x.clone()
        xb.view(-1)[0] = bad
        q, s = fn(xb)
        q0, s0 = fn(x)
        hit = torch.zeros_like(s, dtype=torch.bool)
        hit.view(-1)[0] = True
        assert scale_is(s[hit]).all() and torch.equal(s[~hit], s0[~hit])
        assert torch.isnan(q.float().view(-1)[0])
