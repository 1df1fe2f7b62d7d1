"""GPU tests of the token gather kernel (kernels/sm90/token_gather.py through
ops/token_gather.py) against index_select, the path it replaces: row widths from one vector
to 7168, bf16 and fp16, int32 and int64 rows, row counts that are not a multiple of the CTA's
rows, repeated rows, a strided x, rows out of range (clamped, never a fault, on the
index_select path too), rows on another device (refused) and CUDA-graph replay with new
indices."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.ops import token_gather

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
    # (layers/experts_fp8._gather_rows): every bit pattern, NaN encodings included, arrives.
    from moe_gemm.layers.experts_fp8 import _gather_rows

    gen = torch.Generator(device=DEV).manual_seed(11)
    raw = torch.randint(0, 256, (300, 7168), device=DEV, generator=gen, dtype=torch.uint8)
    rows = torch.randint(0, 300, (2400,), device=DEV, generator=gen)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = raw.view(dtype)
        assert token_gather._kernel_ok(t.view(torch.bfloat16), rows)
        got = _gather_rows(t, rows)
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), raw[rows])
