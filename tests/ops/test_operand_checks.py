"""The MoE-form ops check their shared operands with one set of messages (ops/validation.py's
check_varlen_operands, check_batched_operands and check_out): grouped_mm, fused_grouped_mm
and scaled_grouped_mm name each fault of x, w, offs and out alike (fresh random data, the
CPU; each fault alone on otherwise valid arguments, which pass)."""

from __future__ import annotations

import re

import pytest
import torch

from moe_gemm import fused_grouped_mm, grouped_mm, scaled_grouped_mm
from moe_gemm.testing_fp8 import make_fp8_batched_inputs, make_fp8_moe_inputs

T, E, K, N = 37, 4, 128, 48


def _offs() -> torch.Tensor:
    cuts = torch.sort(torch.randint(0, T + 1, (E,))).values
    return cuts.to(torch.int32)


def _plain():
    x, w = torch.randn(T, K, dtype=torch.bfloat16), torch.randn(E, K, N, dtype=torch.bfloat16)
    return (lambda **a: grouped_mm(a["x"], a["w"], a["offs"], out=a.get("out")),
            dict(x=x, w=w, offs=_offs()), "(T, N)")


def _fused():
    x, w = torch.randn(T, K, dtype=torch.bfloat16), torch.randn(E, K, N, dtype=torch.bfloat16)
    return (lambda **a: fused_grouped_mm(a["x"], a["w"], a["offs"], out=a.get("out")),
            dict(x=x, w=w, offs=_offs()), "(S, N)")


def _scaled():
    x, w, sa, sb, offs = make_fp8_moe_inputs(T, E, K, N, "row",
                                             seed=int(torch.randint(1 << 30, ())))
    return (lambda **a: scaled_grouped_mm(a["x"], a["w"], sa, sb, a["offs"], out=a.get("out")),
            dict(x=x, w=w, offs=offs), "(T, N)")


OPS = {"grouped_mm": _plain, "fused_grouped_mm": _fused, "scaled_grouped_mm": _scaled}

FAULTS = [
    ("w on another device", lambda a: a.update(w=a["w"].to("meta")), ValueError,
     "w is on meta but x is on cpu; they must be on one device"),
    ("offs on another device", lambda a: a.update(offs=a["offs"].to("meta")), ValueError,
     "offs is on meta but x is on cpu; offs must live with x"),
    ("int64 offs", lambda a: a.update(offs=a["offs"].long()), TypeError,
     "offs must be int32 cumulative end rows (E,); got dtype torch.int64"),
    ("2-D offs", lambda a: a.update(offs=a["offs"][None]), ValueError,
     f"offs must be 1-D (E,) = ({E},); got shape (1, {E})"),
    ("offs of another length", lambda a: a.update(offs=a["offs"][:-1]), ValueError,
     f"offs must have one entry per expert: ({E},); got ({E - 1},)"),
    ("w of another K", lambda a: a.update(w=a["w"][:, :-16]), ValueError,
     f"x is (T, K) = ({T}, {K}), so w must be (E, {K}, N)"),
    ("2-D w", lambda a: a.update(w=a["w"][0]), ValueError,
     "w must be 3-D (E, K, N) (for an (E, N, K) weight pass w.transpose(1, 2))"),
    ("w of another dtype", lambda a: a.update(w=a["w"].float()), TypeError,
     "but x has"),
    ("offs a list", lambda a: a.update(offs=a["offs"].tolist()), TypeError,
     "offs must be a torch.Tensor (E,)"),
    ("out of another shape", lambda a: a.update(out=torch.empty(T, N + 1)), ValueError,
     "out must be {dims} = ({T}, {N}); got ({T}, {N1})"),
    ("out on another device", lambda a: a.update(out=torch.empty(T, N, device="meta")),
     ValueError, "out is on meta but x is on cpu"),
    ("out a list", lambda a: a.update(out=[]), TypeError, "out must be a torch.Tensor {dims}"),
]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("fault,break_,exc,message", FAULTS, ids=[f[0] for f in FAULTS])
def test_each_operand_fault_is_named_alike(op, fault, break_, exc, message):
    call, args, dims = OPS[op]()
    call(**args)  # valid as made
    if fault.startswith("out"):
        args["out"] = torch.empty(T, N, dtype=torch.float32)
        call(**args)  # (an fp32 out of the right shape is accepted: it sets the dtype)
    break_(args)
    text = message.format(dims=dims, T=T, N=N, N1=N + 1)
    with pytest.raises(exc, match=re.escape(text)):
        call(**args)


def test_batched_forms_name_their_faults_alike():
    x16, w16 = torch.randn(3, 5, K, dtype=torch.bfloat16), torch.randn(3, K, N,
                                                                       dtype=torch.bfloat16)
    x8, w8, sa, sb = make_fp8_batched_inputs(3, 5, K, N, "row",
                                             seed=int(torch.randint(1 << 30, ())))
    calls = {"grouped_mm": lambda x, w, out=None: grouped_mm(x, w, out=out),
             "scaled_grouped_mm": lambda x, w, out=None: scaled_grouped_mm(x, w, sa, sb,
                                                                           out=out)}
    for name, (x, w) in (("grouped_mm", (x16, w16)), ("scaled_grouped_mm", (x8, w8))):
        call = calls[name]
        call(x, w)
        with pytest.raises(ValueError, match=re.escape(
                "w must be 3-D (G, K, N) (for a (G, N, K) weight pass w.transpose(1, 2))")):
            call(x, w[0])
        with pytest.raises(ValueError, match=re.escape(
                f"x is (G, M, K) = (3, 5, {K}), so w must be (3, {K}, N)")):
            call(x, w[:2])
        with pytest.raises(ValueError, match=re.escape("(2-D x (T, K) is the MoE form")):
            call(x[0], w)
        with pytest.raises(ValueError, match=re.escape(f"out must be (G, M, N) = (3, 5, {N})")):
            call(x, w, out=torch.empty(3, 5, N + 1))
