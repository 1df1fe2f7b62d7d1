"""GPU tests of the token gather kernel (kernels/sm90/token_gather.py through
ops/token_gather.py) against index_select, the path it replaces: row widths from one vector
to 7168 and to the launch grid's limit (and one vector past it: index_select), bf16 and fp16,
int32 and int64 rows, row counts that are not a multiple of the CTA's rows, repeated rows, a
strided or expanded x and rows, an x of more than 2^31 values (64-bit addresses) and of 2^31
rows (index_select, int32 rows clamped), rows out of range (clamped, int64 ones past int32's
range too, never a fault, on the index_select path too), rows on another device (refused), an
x on a GPU that is not the current one, fake and traced tensors, a subclass and a dual tensor
(index_select), other dtypes (index_select, fp8 bit for bit), nothing to copy, autograd,
vmap, torch.compile and CUDA-graph replay with new indices."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.ops import row_kernels, token_gather

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.fixture(autouse=True)
def _kernel_on(monkeypatch):
    monkeypatch.delenv(token_gather.TOKEN_GATHER_ENV, raising=False)  # the default: the kernel


def _case(T, S, H, dtype=torch.bfloat16, index=torch.int64, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, H, device=DEV, generator=gen).to(dtype)
    rows = torch.randint(0, T, (S,), device=DEV, generator=gen).to(index)
    return x, rows


def _check(x, rows):
    assert token_gather._kernel_ok(x, rows), "the gather kernel did not take the case"
    out = token_gather.gather_rows(x, rows)
    assert out.dtype == x.dtype and out.shape == (rows.shape[0], x.shape[1])
    assert out.is_contiguous()
    torch.testing.assert_close(out, x.index_select(0, rows), atol=0, rtol=0)
    return out


@pytest.mark.parametrize("H", [8, 24, 1024, 1032, 2048, 2880, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_widths_and_dtypes(H, dtype):
    _check(*_case(129, 1001, H, dtype=dtype, seed=H))


@pytest.mark.parametrize("S", [1, 2, 3, 4, 5, 7, 131072])
@pytest.mark.parametrize("index", [torch.int64, torch.int32])
def test_row_counts_and_index_dtypes(S, index):
    _check(*_case(16384 if S > 100 else 3, S, 2048, index=index, seed=S))


def test_repeated_rows_and_a_strided_x():
    x, rows = _case(64, 512, 1024, seed=3)
    _check(x, torch.zeros_like(rows))  # every row the same token
    wide = torch.randn(64, 1024 + 64, device=DEV).bfloat16()
    _check(wide[:, 32:32 + 1024], rows)  # rows 1088 values apart, 64-byte offset


def test_rows_out_of_range_are_clamped():
    x, rows = _case(50, 64, 256, seed=5)
    bad = rows.clone()
    bad[0], bad[13], bad[63] = -3, 10**9, 50
    out = token_gather.gather_rows(x, bad)
    torch.cuda.synchronize()  # no fault
    torch.testing.assert_close(out, x.index_select(0, bad.clamp(0, 49)), atol=0, rtol=0)


def test_rows_out_of_range_are_clamped_on_the_index_select_path_too(monkeypatch):
    monkeypatch.setenv(token_gather.TOKEN_GATHER_ENV, "torch")
    x, rows = _case(50, 64, 256, seed=6)
    bad = rows.clone()
    bad[0], bad[1] = -3, 10**9
    assert not token_gather._kernel_ok(x, bad)
    out = token_gather.gather_rows(x, bad)
    torch.cuda.synchronize()  # no fault
    torch.testing.assert_close(out, x.index_select(0, bad.clamp(0, 49)), atol=0, rtol=0)


def test_rows_on_another_device_are_refused():
    x, rows = _case(8, 16, 64)
    with pytest.raises(ValueError, match="rows must be on x's device cuda:0; got cpu"):
        token_gather.gather_rows(x, rows.cpu())


def test_cuda_graph_replay_sees_new_rows():
    x, rows = _case(800, 2000, 1024, seed=9)
    out = token_gather.gather_rows(x, rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = token_gather.gather_rows(x, rows)
    x2, rows2 = _case(800, 2000, 1024, seed=10)
    x.copy_(x2)
    rows.copy_(rows2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x2.index_select(0, rows2), atol=0, rtol=0)


def test_fp8_rows_move_bit_for_bit_as_16_bit_words():
    # The FP8 layer gathers its quantized rows through the kernel as pairs of values
    # (gather_rows views 1-byte rows as 16-bit words): every bit pattern, NaN encodings
    # included, arrives.
    _gather_rows = token_gather.gather_rows

    gen = torch.Generator(device=DEV).manual_seed(11)
    raw = torch.randint(0, 256, (300, 7168), device=DEV, generator=gen, dtype=torch.uint8)
    rows = torch.randint(0, 300, (2400,), device=DEV, generator=gen)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = raw.view(dtype)
        assert token_gather._kernel_ok(t.view(torch.bfloat16), rows)
        got = _gather_rows(t, rows)
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), raw[rows])


def test_rows_as_wide_as_the_launch_grid_and_wider():
    # grid.y = H / 8 / 64 CTAs, at most 65535: the kernel up to there; one vector more is
    # index_select (before: a launch-configuration error from the kernel's wrapper).
    widest = row_kernels.MAX_ROW_VECS * 8
    for H, kernel in ((widest, True), (widest + 8, False)):
        x, rows = _case(3, 5, H, seed=1 + kernel)
        assert token_gather._kernel_ok(x, rows) == kernel
        out = token_gather.gather_rows(x, rows)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, x.index_select(0, rows), atol=0, rtol=0)
        del x, out


@pytest.mark.parametrize("index", [torch.int64, torch.int32])
def test_an_x_and_out_of_more_than_2_31_values(index):
    # 64-bit addresses: x's rows past its value 2^31 (4.3 GB of bf16) are read from where they
    # are, and out's rows past its value 2^31 written where they belong.
    T, H = 2**31 // 2048 + 64, 2048
    x = torch.empty(T, H, device=DEV, dtype=torch.bfloat16).normal_()
    S = T + 8
    rows = torch.randint(0, T, (S,), device=DEV).to(index)
    rows[-8:] = torch.arange(T - 8, T, device=DEV).to(index)  # the last rows of x, at the end
    rows[:4] = torch.tensor([T - 1, 2**31 // H, 2**31 // H - 1, 0], device=DEV).to(index)
    assert token_gather._kernel_ok(x, rows)
    out = token_gather.gather_rows(x, rows)
    torch.cuda.synchronize()
    assert torch.equal(out, x.index_select(0, rows))
    del x, out


def test_int64_rows_past_int32s_range_are_clamped():
    x, rows = _case(50, 16, 256, seed=12)
    bad = rows.clone()
    bad[0], bad[5], bad[15] = 2**32 + 5, -(2**40), 2**40  # (not truncated to int32)
    assert token_gather._kernel_ok(x, bad)
    out = token_gather.gather_rows(x, bad)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x.index_select(0, bad.clamp(0, 49)), atol=0, rtol=0)


def test_expanded_and_strided_x_and_rows():
    x, rows = _case(64, 300, 512, seed=13)
    _check(x[5:6].expand(64, 512), rows)  # every row of x the same memory (stride 0)
    _check(x, rows[7:8].expand(300))  # one index, stride 0
    _check(x, rows[::3])  # every third
    _check(x, torch.randint(0, 64, (300, 4), device=DEV)[:, 2])  # a column: stride 4
    _check(x, rows[:1])  # one row


def test_an_x_of_2_31_rows_and_more_takes_index_select_with_int32_rows():
    # Past the kernel's Int32 sizes: index_select, whose clamp into [0, T - 1] raised for
    # int32 rows ("value cannot be converted to type int without overflow").
    one = torch.randn(1, 16, device=DEV).bfloat16()
    x = one.expand(2**31 + 5, 16)  # (no memory: stride 0)
    rows = torch.tensor([0, 2**31 - 1, -1, 7], device=DEV, dtype=torch.int32)
    assert not token_gather._kernel_ok(x, rows)
    out = token_gather.gather_rows(x, rows)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, one.expand(4, 16), atol=0, rtol=0)


def test_fake_and_traced_tensors_never_reach_the_kernel():
    # A FakeTensor's data pointer is a placeholder (the kernel read and wrote address 0), and
    # make_fx records no kernel launch (its graph would have returned torch.empty's memory).
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        x = torch.empty(64, 256, device=DEV, dtype=torch.bfloat16)
        rows = torch.zeros(100, device=DEV, dtype=torch.long)
        out = token_gather.gather_rows(x, rows)
    assert out.shape == (100, 256)
    x, rows = _case(64, 100, 256, seed=14)
    gm = make_fx(token_gather.gather_rows)(x, rows)
    assert "index_select" in gm.code
    x2, rows2 = _case(64, 100, 256, seed=15)
    torch.testing.assert_close(gm(x2, rows2), x2.index_select(0, rows2), atol=0, rtol=0)
    torch.cuda.synchronize()


class _Tagged(torch.Tensor):
    """A subclass with torch's default __torch_function__: results keep the type."""


def test_a_subclass_keeps_its_type_and_a_dual_x_its_tangent():
    import torch.autograd.forward_ad as fwad

    x, rows = _case(64, 100, 256, seed=16)
    out = token_gather.gather_rows(x.as_subclass(_Tagged), rows)
    assert type(out) is _Tagged
    torch.testing.assert_close(out.as_subclass(torch.Tensor), x.index_select(0, rows),
                               atol=0, rtol=0)
    tangent = torch.randn_like(x)
    with fwad.dual_level():
        got = fwad.unpack_dual(token_gather.gather_rows(fwad.make_dual(x, tangent), rows))
    assert got.tangent is not None  # (the kernel's result had none)
    torch.testing.assert_close(got.tangent, tangent.index_select(0, rows), atol=0, rtol=0)


def test_an_x_that_requires_grad_gets_its_gradient():
    x, rows = _case(64, 100, 256, seed=17)
    x.requires_grad_(True)
    out = token_gather.gather_rows(x, rows)
    assert out.requires_grad
    out.float().sum().backward()
    counts = torch.bincount(rows, minlength=64).to(x.dtype)
    torch.testing.assert_close(x.grad, counts[:, None].expand(64, 256), atol=0, rtol=0)
    with torch.no_grad():
        assert not token_gather.gather_rows(x, rows).requires_grad  # (the kernel)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_x_on_a_gpu_that_is_not_the_current_one():
    dev = torch.device("cuda", 1)
    x = torch.randn(64, 256, device=dev).bfloat16()
    rows = torch.randint(0, 64, (100,), device=dev)
    assert torch.cuda.current_device() != 1 and token_gather._kernel_ok(x, rows)
    out = token_gather.gather_rows(x, rows)
    torch.cuda.synchronize(dev)
    assert out.device == dev
    torch.testing.assert_close(out, x.index_select(0, rows), atol=0, rtol=0)


def test_vmap_and_torch_compile():
    x, rows = _case(64, 100, 256, seed=18)
    xs = torch.stack([x, x * 2])
    out = torch.vmap(token_gather.gather_rows, in_dims=(0, None))(xs, rows)
    torch.testing.assert_close(out, xs[:, rows], atol=0, rtol=0)
    f = torch.compile(lambda x, r: token_gather.gather_rows(x, r) + 1, fullgraph=True,
                      backend="aot_eager")
    torch.testing.assert_close(f(x, rows), x.index_select(0, rows) + 1, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float32,
                                   torch.float64])
def test_other_floating_dtypes_keep_their_bits(dtype):
    # (fp32 / fp64: index_select; FP8: the kernel on 16-bit words, not on its own dtype)
    x, rows = _case(64, 100, 256, seed=19)
    x = x.float().to(dtype)
    assert not token_gather._kernel_ok(x, rows)
    out = token_gather.gather_rows(x, rows)
    assert out.dtype == dtype and out.shape == (100, 256) and out.is_contiguous()
    bits = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)
    assert torch.equal(bits(out), bits(x)[rows])


def test_nothing_to_copy():
    x, rows = _case(64, 100, 256, seed=20)
    assert token_gather.gather_rows(x, rows[:0]).shape == (0, 256)
    assert token_gather.gather_rows(x[:, :0], rows).shape == (100, 0)
    assert token_gather.gather_rows(x[:0], rows[:0]).shape == (0, 256)
    with pytest.raises(ValueError, match="x has no rows for the 100 indices"):
        token_gather.gather_rows(x[:0], rows)
    torch.cuda.synchronize()
