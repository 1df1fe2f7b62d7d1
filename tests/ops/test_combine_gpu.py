"""GPU tests of the top-k combine kernel (kernels/sm90/combine.py through ops/combine.py)
against an fp64 reference and against F.embedding_bag, the path it replaces: every k from 1 to
16, row widths from one vector to 7168, weights absent / bf16 / fp32, int32 and int64 rows,
repeated rows, one token, one routed row, rows out of range (clamped, never a fault, on the
embedding_bag path too), rows or weights on another device (refused) and CUDA-graph replay
with new indices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_gemm.ops import combine

pytestmark = pytest.mark.gpu

DEV = "cuda"


@pytest.fixture(autouse=True)
def _kernel_on(monkeypatch):
    monkeypatch.delenv(combine.COMBINE_ENV, raising=False)  # the default: the kernel


def _reference(y, rows, weights):
    w = torch.ones(rows.shape, dtype=torch.float64, device=y.device) if weights is None \
        else weights.double()
    return (y.double()[rows.long()] * w.unsqueeze(-1)).sum(1)


def _case(T, S, H, k, dtype=torch.bfloat16, weights=None, index=torch.int64, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    y = torch.randn(S, H, device=DEV, generator=gen).to(dtype)
    rows = torch.randint(0, S, (T, k), device=DEV, generator=gen).to(index)
    w = None
    if weights is not None:
        w = torch.rand(T, k, device=DEV, generator=gen).to(weights)
    return y, rows, w


def _check(y, rows, w):
    ran = combine._kernel_ok(y, rows, w)
    assert ran, "the combine kernel did not take the case"
    out = combine.combine_rows(y, rows, w)
    assert out.dtype == y.dtype and out.shape == (rows.shape[0], y.shape[1])
    ref = _reference(y, rows, w)
    # One rounding of an fp32 sum: within half an ulp of bf16/fp16 plus fp32 summation error.
    eps = torch.finfo(y.dtype).eps
    bound = eps * ref.abs() + 1e-6 * (y.double().abs().max() * rows.shape[1])
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"
    if w is None or w.dtype == y.dtype:  # the same products as embedding_bag's
        eb = F.embedding_bag(rows, y, per_sample_weights=w, mode="sum")
        gap = (out.double() - eb.double()).abs()
        assert bool((gap <= 2 * eps * eb.double().abs() + 1e-6).all()), (
            f"{gap.max().item():.3g} from embedding_bag")
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 8, 16])
def test_every_k(k):
    _check(*_case(300, 1000, 2048, k, seed=k))


@pytest.mark.parametrize("H", [8, 24, 1024, 1032, 2880, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_widths_and_dtypes(H, dtype):
    _check(*_case(37, 129, H, 8, dtype=dtype, seed=H))


@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("index", [torch.int64, torch.int32])
def test_weights_and_index_dtypes(weights, index):
    _check(*_case(513, 4096, 2048, 8, weights=weights, index=index, seed=7))


def test_edges_one_token_one_row_repeated_rows():
    _check(*_case(1, 1, 2048, 4))  # every slot the same single row
    y, rows, _ = _case(64, 3, 512, 8, seed=3)
    _check(y, rows, None)
    assert combine.combine_rows(y, rows[:0]).shape == (0, 512)


def test_rows_out_of_range_are_clamped():
    y, rows, _ = _case(16, 50, 256, 4, seed=5)
    bad = rows.clone()
    bad[0, 0], bad[1, 1] = -3, 10**9
    out = combine.combine_rows(y, bad)
    torch.cuda.synchronize()  # no fault
    fixed = bad.clamp(0, 49)
    torch.testing.assert_close(out, combine.combine_rows(y, fixed), atol=0, rtol=0)


def test_rows_out_of_range_are_clamped_on_the_embedding_bag_path_too(monkeypatch):
    # The torch path (MOE_GEMM_COMBINE=torch, torch.compile, shapes the kernel does not take)
    # handed them to embedding_bag: a device assert, and the process's CUDA context with it.
    monkeypatch.setenv(combine.COMBINE_ENV, "torch")
    y, rows, w = _case(16, 50, 256, 4, weights=torch.bfloat16, seed=6)
    bad = rows.clone()
    bad[0, 0], bad[1, 1] = -3, 10**9
    out = combine.combine_rows(y, bad, w)
    torch.cuda.synchronize()  # no fault
    want = F.embedding_bag(bad.clamp(0, 49), y, per_sample_weights=w, mode="sum")
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_rows_or_weights_on_another_device_are_refused():
    # A CPU rows passed the kernel's checks (they read y alone) and reached it as a host pointer.
    y, rows, w = _case(8, 16, 64, 4, weights=torch.float32)
    with pytest.raises(ValueError, match="rows must be on y's device cuda:0; got cpu"):
        combine.combine_rows(y, rows.cpu(), w)
    with pytest.raises(ValueError, match="weights must be on y's device cuda:0; got cpu"):
        combine.combine_rows(y, rows, w.cpu())


def test_cuda_graph_replay_sees_new_rows():
    y, rows, w = _case(200, 800, 1024, 8, weights=torch.float32, seed=9)
    out = combine.combine_rows(y, rows, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = combine.combine_rows(y, rows, w)
    y2, rows2, w2 = _case(200, 800, 1024, 8, weights=torch.float32, seed=10)
    y.copy_(y2)
    rows.copy_(rows2)
    w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, combine.combine_rows(y, rows, w), atol=0, rtol=0)


def test_torch_switch_and_unsupported_shapes_take_embedding_bag(monkeypatch):
    y, rows, _ = _case(8, 16, 64, 17)  # k beyond the kernel's 16
    assert not combine._kernel_ok(y, rows, None)
    torch.testing.assert_close(combine.combine_rows(y, rows),
                               F.embedding_bag(rows, y, mode="sum"), atol=0, rtol=0)
    assert combine._kernel_ok(*_case(8, 16, 64, 4)[:2], None)  # the default
    monkeypatch.setenv(combine.COMBINE_ENV, "torch")
    assert not combine._kernel_ok(*_case(8, 16, 64, 4)[:2], None)
