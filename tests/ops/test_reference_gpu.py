"""The torch backend's grouped_mm on a CUDA GPU (reference.grouped_mm_torch): fp32 inputs, which
the Hopper kernels do not take, and fp16 / bf16 with backend="torch", run through torch's own
grouped_mm (its loop for fp16 and fp32). Checked against fp64 on fresh random data, with empty
experts, rows past offs[-1] (zero, or left as they were in `out`) and offsets that decrease
(an empty expert, as the kernels read them)."""

from __future__ import annotations

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops import reference
from moe_gemm.ops.reference import grouped_mm_ref
from moe_gemm.testing import assert_close_to_ref, poison_

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
TORCH = GemmConfig(backend="torch")


def _case(dtype: torch.dtype, seed: int, T: int = 300, E: int = 6, K: int = 136, N: int = 200):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(E, N, K, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    # expert 2 empty, rows 280.. routed to none
    offs = torch.tensor([50, 120, 120, 200, 251, 280], dtype=torch.int32, device=DEVICE)
    return x, w, offs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_backend_grouped_mm_on_cuda(dtype):
    x, w, offs = _case(dtype, seed=1)
    config = None if dtype == torch.float32 else TORCH  # fp32: the torch backend by itself
    y = moe_gemm.grouped_mm(x, w, offs, config=config)
    assert y.dtype == dtype and y.shape == (300, 200)
    ref = grouped_mm_ref(x, w, offs, torch.float64)
    low = grouped_mm_ref(x, w, offs, dtype).double()  # plain torch in the inputs' precision
    assert_close_to_ref(y.double(), ref, low)
    assert torch.equal(y[280:], torch.zeros_like(y[280:]))
    # into out: the rows past offs[-1] keep their values
    out = poison_(torch.empty(300, 200, dtype=dtype, device=DEVICE))  # NaN
    assert moe_gemm.grouped_mm(x, w, offs, out=out, config=config) is out
    assert_close_to_ref(out[:280].double(), ref[:280], low[:280])
    assert torch.isnan(out[280:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offsets_read_as_the_kernels_read_them(dtype):
    x, w, offs = _case(dtype, seed=2)
    config = None if dtype == torch.float32 else TORCH
    # offs[2] = 90 < 120: expert 2 is empty and expert 3 starts at 120, as with offs.
    bad = torch.tensor([50, 120, 90, 200, 251, 280], dtype=torch.int32, device=DEVICE)
    y = moe_gemm.grouped_mm(x, w, bad, config=config)
    ref = grouped_mm_ref(x, w, offs, torch.float64)
    assert_close_to_ref(y.double(), ref, grouped_mm_ref(x, w, offs, dtype).double())
    # a last entry below an earlier one: the rows up to the largest belong to their expert
    drop = torch.tensor([50, 120, 120, 200, 280, 251], dtype=torch.int32, device=DEVICE)
    y = moe_gemm.grouped_mm(x, w, drop, config=config)
    ref = grouped_mm_ref(x, w, torch.tensor([50, 120, 120, 200, 280, 280], dtype=torch.int32,
                                            device=DEVICE), torch.float64)
    assert_close_to_ref(y.double(), ref, grouped_mm_ref(
        x, w, drop.clamp(0, 300).cummax(0).values, dtype).double())
    # offsets past T stop at T (nothing read or written out of bounds)
    past = torch.tensor([50, 120, 120, 200, 251, 900], dtype=torch.int32, device=DEVICE)
    y = moe_gemm.grouped_mm(x, w, past, config=config)
    clamped = torch.tensor([50, 120, 120, 200, 251, 300], dtype=torch.int32, device=DEVICE)
    assert_close_to_ref(y.double(), grouped_mm_ref(x, w, clamped, torch.float64),
                        grouped_mm_ref(x, w, clamped, dtype).double())


def test_fp32_on_cuda_takes_torch_grouped_mm(monkeypatch):
    x, w, offs = _case(torch.float32, seed=3)
    calls = []
    real = reference.F.grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(reference.F, "grouped_mm", counting)
    y = moe_gemm.grouped_mm(x, w, offs)
    assert calls == [torch.float32]
    assert_close_to_ref(y.double(), grouped_mm_ref(x, w, offs, torch.float64),
                        grouped_mm_ref(x, w, offs, torch.float32).double())


def test_fp32_falls_back_to_the_loop_where_torch_refuses(monkeypatch):
    x, w, offs = _case(torch.float32, seed=4)

    def refuses(*args, **kwargs):
        raise RuntimeError("grouped_mm: this dtype is not supported")

    monkeypatch.setattr(reference.F, "grouped_mm", refuses)
    y = moe_gemm.grouped_mm(x, w, offs)
    assert_close_to_ref(y.double(), grouped_mm_ref(x, w, offs, torch.float64),
                        grouped_mm_ref(x, w, offs, torch.float32).double())
    assert torch.equal(y[280:], torch.zeros_like(y[280:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rows_past_offs_get_zero_gradients(dtype):
    # torch's grouped_mm backward leaves x's gradient past offs[-1] unwritten.
    x, w, offs = _case(dtype, seed=5)
    x, w = x.requires_grad_(), w.detach().requires_grad_()
    poison_(torch.empty(300, 136, dtype=dtype, device=DEVICE))  # (freed: its memory NaN)
    config = None if dtype == torch.float32 else TORCH
    moe_gemm.grouped_mm(x, w, offs, config=config).float().square().sum().backward()
    assert torch.equal(x.grad[280:], torch.zeros_like(x.grad[280:]))
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
