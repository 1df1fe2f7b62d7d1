"""Nested tensors (torch.nested) given to the public ops: a TypeError that names the argument
and says nested tensors are not supported, in every tensor position, in both layouts.

A nested tensor of the default (strided) layout is a plain torch.Tensor to `type()` and has no
sizes or strides: without the checks, torch raised an internal error from the first shape read
(the ops' fast paths read x.shape), and where a plan of the call's x was cached, torch.compile's
C++ tensor guards, which the plan caches use, read a nested operand's strides and aborted the
process. The jagged layout is a tensor subclass with a layout of its own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from host_fakes import Recorder

import moe_gemm
from moe_gemm.testing_fp8 import (
    make_fp8_batched_inputs,
    make_fp8_grouped_inputs,
    make_fp8_moe_inputs,
)

BF16, FP32, I32 = torch.bfloat16, torch.float32, torch.int32
LAYOUTS = {"strided": torch.strided, "jagged": torch.jagged}
NOT_SUPPORTED = r"got a nested tensor \(torch\.nested\), which moe_gemm's ops do not support"


@pytest.fixture(autouse=True)
def _quiet():
    # torch warns that its strided nested tensors are a prototype, on each construction.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _nested(t: torch.Tensor, layout: torch.layout) -> torch.Tensor:
    """A nested tensor of t's components (a 1-D t: two of it), in t's dtype where torch builds
    one (not FP8 in the strided layout: bf16 there; the nested check comes before the dtype's)."""
    parts = list(t.unbind()) if t.dim() > 1 else [t, t]
    if layout is torch.strided and t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        parts = [p.to(BF16) for p in parts]
    return torch.nested.nested_tensor(parts, layout=layout)


def _dense_message(name: str) -> str:
    return rf"^{re.escape(name)} must be a dense \(strided\) tensor; {NOT_SUPPORTED}"


def _gen():
    return torch.Generator().manual_seed(5)


def _randn(*shape, dtype=BF16):
    return torch.randn(*shape, generator=_gen()).to(dtype)


# ---------------------------------------------------------------------------------------------
# The ops with cached plans: (call, tensor arguments). Shapes the Hopper path takes (bf16 / FP8,
# 16-byte rows), so that the same arguments also build and cache a plan.


def _mm():
    x, w = _randn(24, 32), _randn(3, 32, 16)
    return (lambda x, w, offs, out: moe_gemm.grouped_mm(x, w, offs, out=out),
            dict(x=x, w=w, offs=torch.tensor([8, 8, 24], dtype=I32), out=_randn(24, 16)))


def _bmm():
    return (lambda x, w, out: moe_gemm.grouped_mm(x, w, out=out),
            dict(x=_randn(3, 8, 32), w=_randn(3, 32, 16), out=_randn(3, 8, 16)))


def _masked():
    return (lambda x, w, masked_m, out: moe_gemm.grouped_mm_masked(x, w, masked_m, out=out),
            dict(x=_randn(3, 8, 32), w=_randn(3, 32, 16),
                 masked_m=torch.tensor([8, 0, 5], dtype=I32), out=_randn(3, 8, 16)))


def _fused():
    def call(x, w, offs, row_index, row_weight, bias, out):
        return moe_gemm.fused_grouped_mm(x, w, offs, row_index=row_index, row_weight=row_weight,
                                         bias=bias, gate="silu", out=out)
    # (w K-major: the concat gate layout's)
    return call, dict(x=_randn(24, 32), w=_randn(3, 32, 32).transpose(1, 2),
                      offs=torch.tensor([8, 8, 24], dtype=I32),
                      row_index=torch.randperm(24, generator=_gen()),
                      row_weight=torch.rand(24, generator=_gen()), bias=_randn(3, 32, dtype=FP32),
                      out=_randn(24, 16))


def _fused_masked():
    def call(x, w, masked_m, bias, row_weight, out):
        return moe_gemm.fused_grouped_mm_masked(x, w, masked_m, bias=bias, gate="silu",
                                                row_weight=row_weight, out=out)
    return call, dict(x=_randn(3, 8, 32), w=_randn(3, 32, 32).transpose(1, 2),
                      masked_m=torch.tensor([8, 0, 5], dtype=I32), bias=_randn(3, 32, dtype=FP32),
                      row_weight=torch.rand(3, 8, generator=_gen()), out=_randn(3, 8, 16))


def _scaled():
    x, w, sa, sb, offs = make_fp8_moe_inputs(24, 3, 128, 16, "row", seed=1)
    return (lambda x, w, scale_a, scale_b, offs: moe_gemm.scaled_grouped_mm(x, w, scale_a,
                                                                            scale_b, offs),
            dict(x=x, w=w, scale_a=sa, scale_b=sb, offs=offs))


def _scaled_bmm():
    x, w, sa, sb = make_fp8_batched_inputs(3, 8, 128, 16, "row", seed=2)
    return (lambda x, w, scale_a, scale_b: moe_gemm.scaled_grouped_mm(x, w, scale_a, scale_b),
            dict(x=x, w=w, scale_a=sa, scale_b=sb))


def _scaled_masked():
    x, w, sa, sb = make_fp8_batched_inputs(3, 8, 128, 16, "row", seed=3)
    return (lambda x, w, scale_a, scale_b, masked_m: moe_gemm.scaled_grouped_mm_masked(
                x, w, scale_a, scale_b, masked_m),
            dict(x=x, w=w, scale_a=sa, scale_b=sb, masked_m=torch.tensor([8, 0, 5], dtype=I32)))


CACHED = {"grouped_mm 2-D": _mm, "grouped_mm 3-D": _bmm, "grouped_mm_masked": _masked,
          "fused_grouped_mm": _fused, "fused_grouped_mm_masked": _fused_masked,
          "scaled_grouped_mm 2-D": _scaled, "scaled_grouped_mm 3-D": _scaled_bmm,
          "scaled_grouped_mm_masked": _scaled_masked}
CACHED_CASES = [(op, name) for op, make in CACHED.items() for name in make()[1]]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op,name", CACHED_CASES)
def test_cached_ops_name_a_nested_argument(op: str, name: str, layout: str) -> None:
    call, args = CACHED[op]()
    args[name] = _nested(args[name], LAYOUTS[layout])
    with pytest.raises(TypeError, match=_dense_message(name)):
        call(**args)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("op,name", CACHED_CASES)
def test_a_cached_plan_never_meets_a_nested_argument(cute_ops: Recorder, op: str, name: str,
                                                     layout: str) -> None:
    # The plan of these arguments is cached (two calls: the second from the cache); then the
    # same call with one argument nested must not reach the plan's signature check.
    call, args = CACHED[op]()
    for _ in range(2):
        call(**args)
    calls = len(cute_ops.calls)
    assert calls == 2, "the plain calls must run the (recorded) kernel"
    args[name] = _nested(args[name], LAYOUTS[layout])
    with pytest.raises(TypeError, match=_dense_message(name)):
        call(**args)
    assert len(cute_ops.calls) == calls


# ---------------------------------------------------------------------------------------------
# grouped_gemm and scaled_grouped_gemm: a nested tensor for a list, or in one


def _lists():
    return [_randn(5, 32), _randn(7, 32)], [_randn(32, 16), _randn(32, 16)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("op", ["grouped_gemm", "GroupedGemmPlan"])
def test_grouped_gemm_names_a_nested_tensor_given_for_a_list(op: str, which: str,
                                                             layout: str) -> None:
    a, b = _lists()
    args = {"a": a, "b": b}
    args[which] = torch.nested.nested_tensor(args[which], layout=LAYOUTS[layout])
    pattern = (rf"^{which} must be a sequence \(list or tuple\) of 2-D tensors .*; "
               rf"{NOT_SUPPORTED} \(pass list\({which}\.unbind\(\)\)\)")
    with pytest.raises(TypeError, match=pattern):
        getattr(moe_gemm, op)(args["a"], args["b"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("which", ["a", "b", "out"])
@pytest.mark.parametrize("op", ["grouped_gemm", "GroupedGemmPlan"])
def test_grouped_gemm_names_a_nested_tensor_in_a_list(op: str, which: str,
                                                      layout: str) -> None:
    a, b = _lists()
    args = {"a": a, "b": b, "out": [_randn(5, 16), _randn(7, 16)]}
    args[which][1] = _nested(args[which][1], LAYOUTS[layout])
    with pytest.raises(TypeError, match=_dense_message(f"{which}[1]")):
        getattr(moe_gemm, op)(args["a"], args["b"], out=args["out"])


def test_grouped_gemm_scan_names_a_nested_tensor_in_a_list(cute_ops: Recorder) -> None:
    # The Hopper path's one-pass scan of the lists reads every shape: a nested one, which has
    # none, goes the detailed way that names it.
    a, b = _lists()
    a[1] = _nested(a[1], torch.strided)
    with pytest.raises(TypeError, match=_dense_message("a[1]")):
        moe_gemm.grouped_gemm(a, b)
    assert cute_ops.calls == []


# Run in a child process: without the screen, grouped_gemm's cached plans (the lists' signature,
# TensorGuards over every tensor) read a nested tensor's strides inside C++ and the process
# aborted, which would take pytest down with it instead of failing one test.
_WARM_GENERAL_CHILD = """
import warnings
import pytest, torch
from host_fakes import Recorder, clear_caches, install
import moe_gemm
from moe_gemm.ops import api

warnings.simplefilter("ignore", UserWarning)  # (torch's prototype warning on nested tensors)
rec = Recorder()
clear_caches()
install(pytest.MonkeyPatch(), rec)
api.cute_problem = lambda device=None: None
g = torch.Generator().manual_seed(7)
a = [torch.randn(5, 32, generator=g).bfloat16(), torch.randn(7, 32, generator=g).bfloat16()]
b = [torch.randn(32, 16, generator=g).bfloat16() for _ in a]
for _ in range(3):  # scanned twice (the layout recurs: it gets a signature), then cached
    moe_gemm.grouped_gemm(a, b)
assert len(api._general_plans) == 1 and len(rec.calls) == 3
assert api._general_plans.find(2, (None, None, api._switches()), (*a, *b)) is not None
for layout in (torch.strided, torch.jagged):
    for which in ("a", "b"):
        lists = {"a": list(a), "b": list(b)}
        lists[which][1] = torch.nested.nested_tensor(list(lists[which][1].unbind()),
                                                     layout=layout)
        try:
            moe_gemm.grouped_gemm(lists["a"], lists["b"])
        except TypeError as exc:
            print(which, layout, "|", exc)
        else:
            print(which, layout, "| no error")
assert len(rec.calls) == 3, "a nested operand reached the kernel"
print("done")
"""


def test_a_warm_grouped_gemm_plan_never_meets_a_nested_tensor() -> None:
    # The plan of these lists is cached (grouped_gemm's warm path); then the same call with
    # a[1] or b[1] nested must raise the TypeError naming it, in both layouts.
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root / "tests" / "ops"), str(root),
         *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, "-c", _WARM_GENERAL_CHILD], capture_output=True,
                          text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, f"the child exited with {done.returncode}: {done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    assert lines[-1] == "done" and len(lines) == 5, done.stdout
    for line in lines[:-1]:
        which, _, message = line.partition(" | ")
        assert re.match(_dense_message(f"{which.split()[0]}[1]"), message), line


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("which", ["a", "b", "scale_a", "scale_b"])
def test_scaled_grouped_gemm_names_a_nested_tensor(which: str, layout: str) -> None:
    a, b, sa, sb = make_fp8_grouped_inputs([(5, 16, 128), (7, 16, 128)], "row", seed=4)
    args = {"a": a, "b": b, "scale_a": sa, "scale_b": sb}
    whole = dict(args)
    whole[which] = _nested_list(args[which], LAYOUTS[layout])
    with pytest.raises(TypeError, match=rf"^{which} must be a sequence .*{NOT_SUPPORTED}"):
        moe_gemm.scaled_grouped_gemm(*whole.values())
    one = {k: list(v) for k, v in args.items()}
    one[which][1] = _nested(one[which][1], LAYOUTS[layout])
    with pytest.raises(TypeError, match=_dense_message(f"{which}[1]")):
        moe_gemm.scaled_grouped_gemm(*one.values())


def _nested_list(ts: list[torch.Tensor], layout: torch.layout) -> torch.Tensor:
    """One nested tensor of the tensors ts (as _nested: FP8 is bf16 in the strided layout)."""
    if layout is torch.strided:
        ts = [t.to(BF16) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t
              for t in ts]
    return torch.nested.nested_tensor(ts, layout=layout)


# ---------------------------------------------------------------------------------------------
# Quantization, routing, the layer


def _moe():
    torch.manual_seed(6)
    return moe_gemm.MoE(hidden_size=32, intermediate_size=16, num_experts=4, top_k=2)


OTHERS = {
    "quantize_fp8_per_token_group": (lambda x: moe_gemm.quantize_fp8_per_token_group(x),
                                     dict(x=_randn(4, 256))),
    "quantize_fp8_per_row": (lambda x: moe_gemm.quantize_fp8_per_row(x), dict(x=_randn(4, 64))),
    "quantize_fp8_per_tensor": (lambda x: moe_gemm.quantize_fp8_per_tensor(x),
                                dict(x=_randn(4, 64))),
    "quantize_fp8_per_block": (lambda w: moe_gemm.quantize_fp8_per_block(w),
                               dict(w=_randn(256, 256))),
    "dequantize_fp8": (lambda q, scale: moe_gemm.dequantize_fp8(q, scale, "row"),
                       dict(q=torch.zeros(4, 64).to(torch.float8_e4m3fn),
                            scale=torch.ones(4, 1))),
    "interleave_gate_up": (lambda w: moe_gemm.interleave_gate_up(w), dict(w=_randn(3, 32, 32))),
    "softmax_topk": (lambda logits: moe_gemm.softmax_topk(logits, 2),
                     dict(logits=_randn(5, 4, dtype=FP32))),
    "sigmoid_grouped_topk": (lambda logits, bias: moe_gemm.sigmoid_grouped_topk(logits, bias, 2),
                             dict(logits=_randn(5, 4, dtype=FP32), bias=_randn(4, dtype=FP32))),
    "MoE.forward": (lambda hidden_states: _moe()(hidden_states),
                    dict(hidden_states=_randn(2, 5, 32, dtype=FP32))),
    "MoE.route": (lambda hidden_states: _moe().route(hidden_states),
                  dict(hidden_states=_randn(5, 32, dtype=FP32))),
    "moe_forward": (lambda x, router_weight, w_gate_up, w_down: moe_gemm.moe_forward(
                        x, router_weight, w_gate_up, w_down, 2),
                    dict(x=_randn(5, 32), router_weight=_randn(4, 32), w_gate_up=_randn(4, 32, 32),
                         w_down=_randn(4, 16, 32))),
    "moe_experts": (lambda x, topk_ids, topk_weights, w_gate_up, w_down: moe_gemm.moe_experts(
                        x, topk_ids, topk_weights, w_gate_up, w_down),
                    dict(x=_randn(5, 32), topk_ids=torch.zeros(5, 2, dtype=torch.int64),
                         topk_weights=torch.ones(5, 2), w_gate_up=_randn(4, 32, 32),
                         w_down=_randn(4, 16, 32))),
}
# (torch builds no strided FP8 nested tensor, and dequantize_fp8 refuses the bf16 stand-in
# by its dtype first: its q is tested in the jagged layout)
OTHER_CASES = [(op, name, layout) for op, (_, args) in OTHERS.items() for name in args
               for layout in LAYOUTS if (op, name, layout) != ("dequantize_fp8", "q", "strided")]


@pytest.mark.parametrize("op,name,layout", OTHER_CASES)
def test_other_public_functions_name_a_nested_argument(op: str, name: str, layout: str) -> None:
    call, args = OTHERS[op]
    args = dict(args)
    args[name] = _nested(args[name], LAYOUTS[layout])
    with pytest.raises(TypeError, match=_dense_message(name)):
        call(**args)
