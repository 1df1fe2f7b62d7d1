"""The launch plans called directly (signature.BuiltFor), on the CPU with the compiled kernels
recorded: a plan is built for its tensors' shapes, dtypes and devices (its kernel choice,
grid, workspace and allocated output follow from them), so a call with other tensors is a
ValueError naming the expectation, before anything launches. Without the check such a call
launched the kernel on the build's sizes: a wrong or truncated result. The ops' caches call
the plans' launch instead, after their own signature check (tests/ops/test_plan_cache.py).
"""

from __future__ import annotations

import re

import pytest
import torch
from host_fakes import Recorder

from moe_gemm import GemmConfig
from moe_gemm.ops.fused_launch import FusedPlan
from moe_gemm.ops.fused_validation import check_fused_mm
from moe_gemm.ops.masked_launch import Fp8MaskedPlan, MaskedPlan
from moe_gemm.ops.masked_validation import (
    check_grouped_mm_masked,
    check_scaled_grouped_mm_masked,
)
from moe_gemm.ops.mm_launch import BmmPlan, MmPlan
from moe_gemm.ops.scaled_launch import Fp8BmmPlan, Fp8MmPlan
from moe_gemm.ops.scaled_validation import check_scaled_grouped_mm
from moe_gemm.ops.signature import BuiltFor
from moe_gemm.ops.validation import check_grouped_bmm, check_grouped_mm
from moe_gemm.testing_fp8 import make_fp8_batched_inputs, make_fp8_moe_inputs

BF16, I32 = torch.bfloat16, torch.int32
CFG = GemmConfig()


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _mm():
    x, w, offs = _randn(24, 32, seed=1), _randn(3, 32, 16, seed=2), torch.tensor([8, 8, 24],
                                                                                 dtype=I32)
    return MmPlan(check_grouped_mm(x, w, offs, None, None), CFG), dict(x=x, w=w, offs=offs,
                                                                       out=None)


def _bmm():
    x, w = _randn(3, 8, 32, seed=3), _randn(3, 32, 16, seed=4)
    return BmmPlan(check_grouped_bmm(x, w, None, None), CFG), dict(x=x, w=w, out=None)


def _fused():
    x, w = _randn(24, 32, seed=5), _randn(3, 32, 32, seed=6).transpose(1, 2)
    offs = torch.tensor([8, 8, 30], dtype=I32)
    row_index = torch.randint(0, 24, (30,), generator=torch.Generator().manual_seed(7))
    row_weight = torch.rand(30, generator=torch.Generator().manual_seed(8))
    args = check_fused_mm(x, w, offs, row_index=row_index, row_weight=row_weight, gate="silu")
    return FusedPlan(args, CFG), dict(x=x, w=w, offs=offs, row_index=row_index,
                                      row_weight=row_weight, bias=None, out=None)


def _masked():
    x, w, mm = _randn(3, 8, 32, seed=9), _randn(3, 32, 16, seed=10), torch.tensor([8, 0, 5],
                                                                                   dtype=I32)
    return (MaskedPlan(check_grouped_mm_masked(x, w, mm, None, None, None), CFG),
            dict(x=x, w=w, masked_m=mm, out=None))


def _fp8_mm():
    x, w, sa, sb, offs = make_fp8_moe_inputs(24, 3, 128, 16, "row", seed=11)
    args = check_scaled_grouped_mm(x, w, sa, sb, offs, None, None)
    return Fp8MmPlan(args, CFG), dict(x=x, w=w, scale_a=sa, scale_b=sb, offs=offs, out=None)


def _fp8_bmm():
    x, w, sa, sb = make_fp8_batched_inputs(3, 8, 128, 16, "row", seed=12)
    args = check_scaled_grouped_mm(x, w, sa, sb, None, None, None)
    return Fp8BmmPlan(args, CFG), dict(x=x, w=w, scale_a=sa, scale_b=sb, out=None)


def _fp8_masked():
    x, w, sa, sb = make_fp8_batched_inputs(3, 8, 128, 16, "row", seed=13)
    mm = torch.tensor([8, 0, 5], dtype=I32)
    args = check_scaled_grouped_mm_masked(x, w, sa, sb, mm, None, None, None)
    return Fp8MaskedPlan(args, CFG), dict(x=x, w=w, scale_a=sa, scale_b=sb, masked_m=mm,
                                          out=None)


PLANS = {"MmPlan": _mm, "BmmPlan": _bmm, "FusedPlan": _fused, "MaskedPlan": _masked,
         "Fp8MmPlan": _fp8_mm, "Fp8BmmPlan": _fp8_bmm, "Fp8MaskedPlan": _fp8_masked}


def _twice_the_rows(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t], dim=-2)


@pytest.mark.parametrize("name", list(PLANS))
def test_a_direct_call_refuses_other_tensors(cute_ops: Recorder, name: str) -> None:
    plan, args = PLANS[name]()
    plan(*args.values())  # the tensors it was built for: one launch
    assert len(cute_ops.calls) == 1
    x = args["x"]
    cases = {
        "x": (_twice_the_rows(x), re.escape(
            f"x of shape {tuple(x.shape)}, {x.dtype} on cpu; got shape "
            f"{tuple(_twice_the_rows(x).shape)}, {x.dtype} on cpu")),
        "w": (args["w"].to(torch.float16) if x.dtype == BF16 else args["w"].float(),
              r"w of shape .*; got shape .*, torch\.(float16|float32) on cpu"),
        "out": (torch.zeros(1), r"out of None; got shape \(1,\), torch\.float32 on cpu"),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(ValueError, match=rf"^{name} was built for {message} \(build a new "
                                             r"plan for other tensors\)$"):
            plan(*{**args, key: value}.values())
    assert len(cute_ops.calls) == 1, "a refused call must launch nothing"
    assert plan.built_for.names == tuple(args)


def test_built_for_names_a_missing_tensor_and_a_non_tensor() -> None:
    x = _randn(4, 8)
    built = BuiltFor("SomePlan", x=x, bias=None)
    built.check(x.clone(), None)
    with pytest.raises(ValueError, match=r"^SomePlan was built for x of shape \(4, 8\), "
                                         r"torch\.bfloat16 on cpu; got None"):
        built.check(None, None)
    with pytest.raises(TypeError, match=r"^SomePlan: bias must be a torch.Tensor or None; got "
                                        r"list"):
        built.check(x, [1.0])
