"""Every op on meta tensors (shape inference without memory, as `torch.device("meta")` model
construction and shape checks use it): the registered op's fake implementation answers with
the output's shape, dtype and device, and bad arguments are refused as on real tensors."""

from __future__ import annotations

import pytest
import torch

import moe_gemm

META = torch.device("meta")
F8 = torch.float8_e4m3fn


def _m(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device=META)


def _offs(E):
    return _m(E, dtype=torch.int32)


def test_grouped_ops_on_meta():
    y = moe_gemm.grouped_mm(_m(20, 256), _m(3, 256, 64), _offs(3))
    assert (y.shape, y.dtype, y.device) == ((20, 64), torch.bfloat16, META)
    y = moe_gemm.grouped_mm(_m(2, 5, 256), _m(2, 256, 64), out_dtype=torch.float32)
    assert (y.shape, y.dtype, y.device) == ((2, 5, 64), torch.float32, META)
    d = moe_gemm.grouped_gemm([_m(3, 128), _m(0, 64)], [_m(128, 16), _m(64, 32)])
    assert [t.shape for t in d] == [(3, 16), (0, 32)] and d[0].device == META
    with pytest.raises(ValueError, match="w must be"):
        moe_gemm.grouped_mm(_m(20, 256), _m(3, 128, 64), _offs(3))


def test_scaled_ops_on_meta():
    x, w = _m(20, 256, dtype=F8), _m(3, 64, 256, dtype=F8).transpose(1, 2)
    y = moe_gemm.scaled_grouped_mm(x, w, _m(20, 2, dtype=torch.float32),
                                   _m(3, 2, 1, dtype=torch.float32), _offs(3))
    assert (y.shape, y.dtype, y.device) == ((20, 64), torch.bfloat16, META)
    y = moe_gemm.scaled_grouped_mm(_m(2, 7, 256, dtype=F8), _m(2, 256, 48, dtype=F8),
                                   _m(2, 7, dtype=torch.float32), _m(2, 48, dtype=torch.float32),
                                   out_dtype=torch.float32)
    assert (y.shape, y.dtype, y.device) == ((2, 7, 48), torch.float32, META)
    d = moe_gemm.scaled_grouped_gemm([_m(3, 128, dtype=F8)], [_m(128, 16, dtype=F8)],
                                     [_m(dtype=torch.float32)], [_m(dtype=torch.float32)])
    assert d[0].shape == (3, 16) and d[0].device == META
    with pytest.raises(ValueError, match="match no granularity"):
        moe_gemm.scaled_grouped_mm(x, w, _m(20, 1, dtype=torch.float32),
                                   _m(3, 2, 1, dtype=torch.float32), _offs(3))
    with pytest.raises(TypeError, match="float32"):
        moe_gemm.scaled_grouped_mm(x, w, _m(20, 2), _m(3, 2, 1, dtype=torch.float32), _offs(3))


def test_fused_op_on_meta():
    x, w = _m(13, 64), _m(4, 96, 64).transpose(1, 2)
    a = moe_gemm.fused_grouped_mm(x, w, _offs(4), row_index=_m(20, dtype=torch.int64),
                                  gate="silu", bias=_m(4, 96, dtype=torch.float32),
                                  row_weight=_m(20, dtype=torch.float32))
    assert (a.shape, a.dtype, a.device) == ((20, 48), torch.bfloat16, META)
    with pytest.raises(ValueError, match="bias must be"):
        moe_gemm.fused_grouped_mm(x, w, _offs(4), gate="silu", bias=_m(4, 3))
    with pytest.raises(ValueError, match="on cpu but x is on meta"):
        moe_gemm.fused_grouped_mm(x, w, torch.zeros(4, dtype=torch.int32))
