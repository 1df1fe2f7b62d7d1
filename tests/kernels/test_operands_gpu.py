"""Operands and outputs whose memory is not plainly their value: an `out` that shares memory
with an operand (computed through a temporary, ops/aliasing.py), stride-0 (expanded) dims,
lazily negated views, a K == 1 B whose N stride is not 16-byte aligned. Each op must return
the right values (on our kernels where they can take the layout, else on the torch backend).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig

from .gpu_report import record
from .helpers import check, check_mm, rand

pytestmark = pytest.mark.gpu


def test_aliasing_out_sharing_memory_with_operands():
    # The kernels read A and B while other CTAs store D: an out overlapping an operand runs
    # through a temporary and must equal the result on clones.
    cfg = GemmConfig(backend="cute")
    g = torch.Generator(device="cuda").manual_seed(21)
    E, T, K = 4, 300, 256
    buf = rand((T + 64, K), torch.bfloat16, g)
    x = buf[:T]
    w = rand((E, K, K), torch.bfloat16, g)
    offs = torch.tensor([50, 120, 120, 290], dtype=torch.int32, device="cuda")
    want = moe_gemm.grouped_mm(x.clone(), w.clone(), offs, config=cfg)
    tail = buf[64 + 290:64 + T].clone()
    y = moe_gemm.grouped_mm(x, w, offs, out=buf[64:], config=cfg)  # out 64 rows past x
    torch.cuda.synchronize()
    ok = bool(torch.equal(y[:290], want[:290])) and bool(torch.equal(y[290:], tail))
    record("aliasing/grouped_mm-out-over-x", ok)
    assert ok
    xb = rand((3, 128, K), torch.bfloat16, g)
    wb = rand((3, K, K), torch.bfloat16, g)
    want = moe_gemm.grouped_mm(xb.clone(), wb, config=cfg)
    y = moe_gemm.grouped_mm(xb, wb, out=xb, config=cfg)  # batched, in place over x
    torch.cuda.synchronize()
    ok = y is xb and bool(torch.equal(y, want))
    record("aliasing/batched-out-is-x", ok)
    assert ok
    a = [rand((96, K), torch.bfloat16, g) for _ in range(3)]
    b = [rand((K, K), torch.bfloat16, g) for _ in range(3)]
    want = moe_gemm.grouped_gemm([t.clone() for t in a], [t.clone() for t in b], config=cfg)
    out = [torch.empty(96, K, device="cuda", dtype=torch.bfloat16), a[0][:, :K], a[2]]
    res = moe_gemm.grouped_gemm(a, b, out=out, config=cfg)
    torch.cuda.synchronize()
    ok = all(r is o and torch.equal(r, w_) for r, o, w_ in zip(res, out, want))
    record("aliasing/grouped_gemm-out-is-a", ok)
    assert ok


def test_column_major_outs_in_one_buffer():
    # Row blocks of one transposed buffer share no element: grouped_gemm and a plan write them
    # (on our kernels or torch's path, whichever takes a column-major out) with right values.
    g = torch.Generator(device="cuda").manual_seed(23)
    K, N = 128, 96
    a = [rand((m, K), torch.bfloat16, g) for m in (64, 37)]
    b = [rand((K, N), torch.bfloat16, g) for _ in range(2)]
    want = moe_gemm.grouped_gemm(a, b, config=GemmConfig(backend="torch"))
    ref = [ai.float() @ bi.float() for ai, bi in zip(a, b)]
    for call in (lambda outs: moe_gemm.grouped_gemm(a, b, out=outs),
                 lambda outs: moe_gemm.GroupedGemmPlan(a, b, out=outs)()):
        buf = torch.full((N, 101), float("nan"), dtype=torch.bfloat16, device="cuda").t()
        outs = [buf[:64], buf[64:]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (a torch-path notice, if any)
            res = call(outs)
        torch.cuda.synchronize()
        for r, o, r32, low in zip(res, outs, ref, want):
            assert r.data_ptr() == o.data_ptr()
            check("aliasing/column-major-outs", r, r32, low)
        assert not torch.isnan(buf).any()


def test_aliasing_out_of_the_fused_ops():
    # fused_grouped_mm and its masked form, as the plain ops: an out over an operand equals
    # the result on clones, and the rows the call does not write keep their values.
    cfg = GemmConfig(backend="cute")
    g = torch.Generator(device="cuda").manual_seed(22)
    E, T, K, N = 4, 300, 256, 512
    buf = rand((T + 64, K), torch.bfloat16, g)
    x = buf[:T]
    # (the concat gate's kernel takes gate_up_proj (E, 2I, H) transposed: K-major w)
    w = rand((E, N, K), torch.bfloat16, g).transpose(1, 2)
    offs = torch.tensor([50, 120, 120, 290], dtype=torch.int32, device="cuda")
    want = moe_gemm.fused_grouped_mm(x.clone(), w, offs, gate="silu", config=cfg)
    tail = buf[64 + 290:64 + T].clone()
    y = moe_gemm.fused_grouped_mm(x, w, offs, gate="silu", out=buf[64:], config=cfg)
    torch.cuda.synchronize()
    ok = bool(torch.equal(y[:290], want[:290])) and bool(torch.equal(y[290:], tail))
    record("aliasing/fused_grouped_mm-out-over-x", ok)
    assert ok
    xm = rand((3, 128, K), torch.bfloat16, g)
    counts = torch.tensor([128, 0, 77], dtype=torch.int32, device="cuda")
    wm = rand((3, K, K), torch.bfloat16, g)
    before = xm.clone()
    want = moe_gemm.fused_grouped_mm_masked(xm.clone(), wm, counts, out=xm.clone(),
                                            config=cfg)
    y = moe_gemm.fused_grouped_mm_masked(xm, wm, counts, out=xm, config=cfg)
    torch.cuda.synchronize()
    ok = y is xm and bool(torch.equal(y, want)) and bool(torch.equal(y[2, 77:], before[2, 77:]))
    record("aliasing/fused_masked-out-is-x", ok)
    assert ok


def test_expanded_or_negated_operands_general():
    gen = torch.Generator(device="cuda").manual_seed(70)
    bf = torch.bfloat16
    row = rand((1, 256), bf, gen)
    cols = rand((1, 128), bf, gen)
    w = rand((256, 128), bf, gen)
    w33 = rand((128, 33), bf, gen)
    cases = {
        "a-expanded-rows": ([row.expand(64, 256)], [w]),
        "b-expanded-k": ([rand((64, 256), bf, gen)], [cols.expand(256, 128)]),
        "b-neg-view": ([rand((64, 256), bf, gen)], [torch._neg_view(w)]),
        "a-neg-view": ([torch._neg_view(rand((64, 256), bf, gen))], [w]),
        "b-k1-odd-n-stride": ([rand((64, 1), bf, gen)], [w33[:, :1].t()]),
    }
    for name, (a, b) in cases.items():
        for rep in range(2):  # the second call on the same operands (cached metadata)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                res = moe_gemm.grouped_gemm(a, b)
            torch.cuda.synchronize()
            for i, (ai, bi) in enumerate(zip(a, b)):
                ref = ai.float() @ bi.float()
                check(f"expanded/general/{name}/{rep}[{i}]", res[i], ref,
                      (ai.resolve_neg() @ bi.resolve_neg()))


def test_expanded_or_negated_operands_grouped_mm():
    gen = torch.Generator(device="cuda").manual_seed(71)
    bf = torch.bfloat16
    E, K, N, T = 4, 256, 128, 300
    offs = torch.tensor([50, 50, 170, 300], dtype=torch.int32, device="cuda")
    x = rand((T, K), bf, gen)
    w1 = rand((1, K, N), bf, gen)
    w = rand((E, K, N), bf, gen)
    cases = {
        "w-expanded-experts": (x, w1.expand(E, K, N)),
        "x-expanded-rows": (rand((1, K), bf, gen).expand(T, K), w),
        "w-neg-view": (x, torch._neg_view(w)),
        "x-neg-view": (torch._neg_view(x), w),
    }
    for name, (xi, wi) in cases.items():
        for rep in range(2):  # the second call from the cached plan where one was made
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                y = moe_gemm.grouped_mm(xi, wi, offs)
            torch.cuda.synchronize()
            check_mm(f"expanded/grouped_mm/{name}/{rep}", y, xi.resolve_neg(),
                     wi.resolve_neg(), offs)
    # The batched form.
    G, M = 3, 64
    xb = rand((1, M, K), bf, gen)
    wb = rand((G, K, N), bf, gen)
    for name, (xi, wi) in {"x-expanded-batch": (xb.expand(G, M, K), wb),
                           "w-expanded-batch": (rand((G, M, K), bf, gen),
                                                wb[:1].expand(G, K, N)),
                           "w-neg-view": (rand((G, M, K), bf, gen), torch._neg_view(wb))}.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            y = moe_gemm.grouped_mm(xi, wi)
        torch.cuda.synchronize()
        ref = xi.float() @ wi.resolve_neg().float()
        check(f"expanded/batched/{name}", y, ref, torch.bmm(xi.resolve_neg(), wi.resolve_neg()))
