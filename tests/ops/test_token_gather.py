"""ops/token_gather.py on the CPU: the index_select path, the kernel path's plumbing with the
compiled kernel replaced by an emulator (what it is given: x as it is, the indices as they are,
a fresh (S, H) output), which layouts the kernel takes, and bad input refused by name."""

from __future__ import annotations

import pytest
import torch

from moe_gemm.ops import token_gather


def _inputs(T, S, H, dtype=torch.bfloat16, index=torch.int64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    rows = torch.randint(0, T, (S,), generator=gen).to(index)
    return x, rows


@pytest.mark.parametrize("index", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_index_select_path_copies_the_rows(index, dtype):
    x, rows = _inputs(33, 70, 48, dtype=dtype, index=index)
    out = token_gather.gather_rows(x, rows)
    assert out.shape == (70, 48) and out.dtype == dtype
    for r in (0, 17, 69):
        assert torch.equal(out[r], x[int(rows[r])])


def test_out_of_range_rows_are_refused_on_the_cpu():
    x, rows = _inputs(5, 8, 16)
    rows[3] = 5
    with pytest.raises(IndexError):
        token_gather.gather_rows(x, rows)


class _Emulator:
    """Computes what the kernel computes from the arguments it is given."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, rows, out):
        self.calls.append((x, rows, out))
        out.copy_(x[rows.long().clamp(0, x.shape[0] - 1)])


@pytest.fixture
def kernel(monkeypatch):
    made = {}

    def fake_kernel(dtype, index_dtype):
        return made.setdefault((dtype, index_dtype), _Emulator())

    monkeypatch.setattr(token_gather, "_kernel_ok", lambda x, rows: True)
    monkeypatch.setattr(token_gather, "_kernel", fake_kernel)
    return made


def test_kernel_path_arguments(kernel):
    x, rows = _inputs(40, 17, 64, index=torch.int32, seed=2)
    out = token_gather.gather_rows(x, rows)
    (key, emu), = kernel.items()
    assert key == (torch.bfloat16, torch.int32)
    xk, rk, ok = emu.calls[0]
    assert xk is x and rk is rows and ok is out and out.shape == (17, 64)
    assert torch.equal(out, x[rows.long()])


def test_inputs_that_need_a_gradient_take_index_select(kernel):
    x, rows = _inputs(40, 17, 64, dtype=torch.float32)
    x.requires_grad_(True)
    out = token_gather.gather_rows(x, rows)
    assert not any(e.calls for e in kernel.values()) and out.requires_grad
    out.sum().backward()
    assert torch.equal(x.grad.sum(1), torch.bincount(rows, minlength=40).float() * 64)
    with torch.no_grad():
        token_gather.gather_rows(x, rows)  # untracked: the kernel
    assert sum(len(e.calls) for e in kernel.values()) == 1


def test_what_the_kernel_takes():
    x, rows = _inputs(8, 4, 16)
    assert not token_gather._kernel_ok(x, rows)  # a CPU tensor: index_select
    ok = token_gather._layout_ok
    assert ok(x, rows) and ok(x, rows.int()) and ok(x.half(), rows)
    assert not ok(x.float(), rows)  # fp32 rows
    assert not ok(x[:, :12], rows)  # H not a multiple of 8
    assert not ok(x.t().contiguous().t(), rows)  # H not contiguous
    assert not ok(torch.zeros(8, 24, dtype=torch.bfloat16)[:, 1:17], rows)  # unaligned
    assert ok(torch.zeros(8, 32, dtype=torch.bfloat16)[:, 8:24], rows)  # a strided, aligned view
    assert not ok(x[:0], rows[:0]) and not ok(x, rows[:0])  # nothing to copy


def test_no_rows_give_an_empty_result():
    x, rows = _inputs(5, 0, 16)
    out = token_gather.gather_rows(x, rows)
    assert out.shape == (0, 16) and out.dtype == x.dtype
    assert token_gather.gather_rows(x[:0], rows).shape == (0, 16)


def _bad_inputs():
    x, rows = _inputs(6, 10, 16)
    return [
        ((x[0], rows), TypeError, "x must be a 2-D (T, H) floating tensor"),
        ((x.long(), rows), TypeError, "x must be a 2-D (T, H) floating tensor"),
        ((x, rows[None]), TypeError, "rows must be a 1-D (S,) int64 or int32"),
        ((x, rows.float()), TypeError, "rows must be a 1-D (S,) int64 or int32"),
        ((x, rows.short()), TypeError, "rows must be a 1-D (S,) int64 or int32"),
        ((x, rows.tolist()), TypeError, "must be torch.Tensors; got Tensor, list"),
        # (meta stands in for another device: a CPU rows beside a GPU x reached the kernel)
        ((x, rows.to("meta")), ValueError, "rows must be on x's device cpu; got meta"),
        ((x[:0], rows), ValueError, "x has no rows for the 10 indices"),
    ]


@pytest.mark.parametrize("args, error, words", _bad_inputs())
def test_bad_inputs_are_refused_by_name(args, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        token_gather.gather_rows(*args)


def test_the_torch_switch(monkeypatch):
    class OnCuda:
        device = torch.device("cuda")

    monkeypatch.setenv(token_gather.TOKEN_GATHER_ENV, "torch")
    assert not token_gather._kernel_ok(OnCuda(), None)
