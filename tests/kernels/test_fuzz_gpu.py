"""Randomized calls of the public ops as users make them: shapes, layouts, dtypes, routings
and optional arguments drawn fresh each run, no config (the tuned tables and the rules choose
the kernel, or the fallback takes what the kernels cannot), against float32/float64
references with NaN-poisoned outputs where an `out` is given.

The fixed-case GPU tests pin what we know to be hard; these look for what nobody thought of.
Every failure message starts with the run's seed and the drawn case, and

    MOE_GEMM_FUZZ_SEED=<seed> python3 scripts/gpu_session.py --paths \
        tests/kernels/test_fuzz_gpu.py --out $OUT

replays the run (MOE_GEMM_FUZZ_CASES: cases per op; the default 8 keeps a whole GPU test
session within its budget, the recorded runs took 24, about 2-3 minutes per group).
"""

from __future__ import annotations

import math
import os
import random
import secrets

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.layers.moe import MoE, moe_experts
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref
from moe_gemm.ops.reference import grouped_gemm_ref, grouped_mm_ref
from moe_gemm.ops.scaled_reference import scaled_grouped_mm_ref
from moe_gemm.testing import assert_close_to_ref, calc_diff, poison_, random_offs
from moe_gemm.testing_fp8 import (
    assert_fp8_close,
    make_fp8_moe_inputs,
    quantize_acts,
    quantize_weights,
)

from .gpu_report import record

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("MOE_GEMM_FUZZ_SEED") or secrets.randbits(31))
CASES = int(os.environ.get("MOE_GEMM_FUZZ_CASES") or 8)
TORCH = GemmConfig(backend="torch")
DTYPES = (torch.bfloat16, torch.float16)
# Operand elements per case at most (~64 MB of bf16 per operand): large enough for multi-wave
# grids and long K, small enough that a run of every op stays within a few minutes.
MAX_ELEMS = 1 << 25


def _rng(op: str, i: int) -> random.Random:
    return random.Random(f"{SEED}/{op}/{i}")


def _dim(r: random.Random, lo: int, hi: int, aligned: float = 0.85) -> int:
    """A log-uniform size in [lo, hi]; a multiple of 8 (16-byte rows, what the kernels take)
    with probability `aligned`, else anything (the fallback's side)."""
    v = int(math.exp(r.uniform(math.log(lo), math.log(hi))))
    if r.random() < aligned:
        v = max(8, v // 8 * 8)
    return max(lo, min(hi, v))


def _fit(n: int, budget: int) -> int:
    """n halved until it is at most the budget (and at least 1 where it was)."""
    while n > max(1, budget):
        n //= 2
    return n


def _tag(op: str, i: int, **case) -> str:
    return f"fuzz seed={SEED} {op}[{i}] " + " ".join(f"{k}={v}" for k, v in case.items())


def _finish(name: str, check) -> None:
    """Run the check, record the case for the GPU record, re-raise its failure."""
    try:
        check()
    except AssertionError as exc:
        record(name, False, error=str(exc)[:400])
        raise AssertionError(f"{name}: {exc}") from None
    record(name, True)


@pytest.mark.parametrize("i", range(CASES))
def test_fuzz_grouped_mm(i):
    """grouped_mm(x, w, offs): the MoE form, skewed routings, empty experts, tail rows."""
    r = _rng("grouped_mm", i)
    E = r.choice([1, 2, 3, 5, 8, 16, 32, 60, 64, 128, 160, 256, 384])
    K = _dim(r, 8, 8192)
    N = _dim(r, 8, 8192)
    T = r.choice([0, 1, r.randint(1, 64), r.randint(1, 4096), r.randint(1, 40000)])
    T = _fit(T, MAX_ELEMS // K)
    E = min(E, max(1, MAX_ELEMS // (K * N)))
    total = T if r.random() < 0.8 else r.randint(0, T)
    dtype = r.choice(DTYPES)
    w_nk = r.random() < 0.7  # the nn.Linear layout, w = w_t.transpose(1, 2)
    out_dtype = r.choice([None, None, torch.float32])
    strided_x = r.random() < 0.2
    give_out = r.random() < 0.25
    name = _tag("grouped_mm", i, E=E, T=T, total=total, N=N, K=K, dtype=dtype, w_nk=w_nk,
                out_dtype=out_dtype, strided_x=strided_x, out=give_out)
    gen = torch.Generator().manual_seed(r.randrange(1 << 31))
    offs = random_offs(T, E, r.choice([0.0, 0.1, 0.5]), gen, skew=r.uniform(0, 1.5),
                       total=total).cuda()
    xs = torch.randn(T, K + (8 if strided_x else 0), generator=gen).to(dtype).cuda()
    x = xs[:, :K]
    if w_nk:
        w = (torch.randn(E, N, K, generator=gen) / K ** 0.5).to(dtype).cuda().transpose(1, 2)
    else:
        w = (torch.randn(E, K, N, generator=gen) / K ** 0.5).to(dtype).cuda()
    out = None
    if give_out:
        out = poison_(torch.empty(T, N, dtype=out_dtype or dtype, device="cuda"))
        tail_before = out[total:].clone()
    y = moe_gemm.grouped_mm(x, w, offs, out=out, out_dtype=out_dtype)
    base = moe_gemm.grouped_mm(x, w, offs, config=TORCH, out_dtype=out_dtype)
    ref = grouped_mm_ref(x, w, offs)

    def check():
        assert y.shape == (T, N) and y.dtype == (out_dtype or dtype)
        if out is not None:
            assert y.data_ptr() == out.data_ptr(), "the result is not `out`"
            # rows past offs[-1] keep what they held (NaN here, which equal_nan accepts)
            assert torch.equal(y[total:].isnan(), tail_before.isnan())
            live = slice(0, total)
            assert_close_to_ref(y[live], ref[live], base[live], atol=1e-3, name="y")
        else:
            assert_close_to_ref(y, ref, base, atol=1e-3, name="y")
            assert not y[total:].any(), "rows past offs[-1] are not zero"

    _finish(name, check)


@pytest.mark.parametrize("i", range(CASES))
def test_fuzz_grouped_mm_batched(i):
    """grouped_mm(x, w): the 3-D x 3-D form."""
    r = _rng("batched", i)
    K = _dim(r, 8, 8192)
    N = _dim(r, 8, 4096)
    G = r.choice([1, 2, 4, 7, 16, 64, 256])
    M = r.choice([0, 1, r.randint(1, 128), r.randint(1, 2048)])
    G = _fit(G, MAX_ELEMS // max(1, max(M, 1) * K + K * N))
    dtype = r.choice(DTYPES)
    out_dtype = r.choice([None, None, torch.float32])
    w_nk = r.random() < 0.6
    name = _tag("batched", i, G=G, M=M, N=N, K=K, dtype=dtype, w_nk=w_nk, out_dtype=out_dtype)
    gen = torch.Generator().manual_seed(r.randrange(1 << 31))
    x = torch.randn(G, M, K, generator=gen).to(dtype).cuda()
    if w_nk:
        w = (torch.randn(G, N, K, generator=gen) / K ** 0.5).to(dtype).cuda().transpose(1, 2)
    else:
        w = (torch.randn(G, K, N, generator=gen) / K ** 0.5).to(dtype).cuda()
    y = moe_gemm.grouped_mm(x, w, out_dtype=out_dtype)
    base = moe_gemm.grouped_mm(x, w, config=TORCH, out_dtype=out_dtype)
    ref = torch.bmm(x.float(), w.float())

    def check():
        assert y.shape == (G, M, N) and y.dtype == (out_dtype or dtype)
        assert_close_to_ref(y, ref, base, atol=1e-3, name="y")

    _finish(name, check)


@pytest.mark.parametrize("i", range(CASES))
def test_fuzz_grouped_gemm(i):
    """grouped_gemm(a, b): lists of any sizes, some empty, B in either layout or mixed."""
    r = _rng("grouped_gemm", i)
    G = r.choice([1, 2, 3, 8, 33, 128, 300])
    dtype = r.choice(DTYPES)
    layout = r.choice(["row", "col", "mixed"])
    aligned = r.choice([1.0, 0.9])
    sizes = []
    for _ in range(G):
        m = r.choice([0, 1, r.randint(1, 300), r.randint(1, 3000)])
        n = _dim(r, 8, 4096, aligned)
        k = r.choice([0, _dim(r, 8, 8192, aligned)]) if r.random() < 0.05 else _dim(
            r, 8, 8192, aligned)
        sizes.append((m, n, k))
    budget = MAX_ELEMS
    while sum(m * k + k * n for m, n, k in sizes) > budget:
        sizes = [(max(0, m // 2), n, max(1, k // 2) if k else 0) for m, n, k in sizes]
    out_dtype = r.choice([None, None, torch.float32])
    name = _tag("grouped_gemm", i, G=G, dtype=dtype, layout=layout, out_dtype=out_dtype,
                sizes=sizes[:4] + (["..."] if G > 4 else []))
    gen = torch.Generator().manual_seed(r.randrange(1 << 31))
    a, b = [], []
    for j, (m, n, k) in enumerate(sizes):
        a.append(torch.randn(m, k, generator=gen).to(dtype).cuda())
        col = layout == "col" or (layout == "mixed" and j % 2)
        bb = torch.randn(n, k, generator=gen).T if col else torch.randn(k, n, generator=gen)
        b.append((bb / max(1, k) ** 0.5).to(dtype).cuda())
    ys = moe_gemm.grouped_gemm(a, b, out_dtype=out_dtype)
    base = moe_gemm.grouped_gemm(a, b, config=TORCH, out_dtype=out_dtype)
    refs = grouped_gemm_ref(a, b)

    def check():
        assert len(ys) == G
        for j, (y, bl, rf) in enumerate(zip(ys, base, refs)):
            assert y.shape == (sizes[j][0], sizes[j][1]), f"problem {j}: shape {y.shape}"
            assert y.dtype == (out_dtype or dtype)
            assert_close_to_ref(y, rf, bl, atol=1e-3, name=f"problem {j}")

    _finish(name, check)


@pytest.mark.parametrize("i", range(CASES))
def test_fuzz_grouped_mm_masked(i):
    """grouped_mm_masked(x, w, masked_m): each problem's first masked_m[g] rows."""
    r = _rng("masked", i)
    G = r.choice([1, 2, 8, 32, 64, 256])
    M = r.choice([1, 16, 64, 128, 256, r.randint(1, 512)])
    K = _dim(r, 64, 8192, 1.0)
    N = _dim(r, 64, 4096, 1.0)
    G = _fit(G, MAX_ELEMS // (M * K + K * N))
    dtype = r.choice(DTYPES)
    name = _tag("masked", i, G=G, M=M, N=N, K=K, dtype=dtype)
    gen = torch.Generator().manual_seed(r.randrange(1 << 31))
    counts = [r.choice([0, M, r.randint(0, M)]) for _ in range(G)]
    masked_m = torch.tensor(counts, dtype=torch.int32).cuda()
    x = torch.randn(G, M, K, generator=gen).to(dtype).cuda()
    w = (torch.randn(G, N, K, generator=gen) / K ** 0.5).to(dtype).cuda().transpose(1, 2)
    out = poison_(torch.empty(G, M, N, dtype=dtype, device="cuda"))
    y = moe_gemm.grouped_mm_masked(x, w, masked_m, expected_m=max(1, sum(counts) // G),
                                   out=out)
    base = torch.bmm(x, w)
    ref = torch.bmm(x.float(), w.float())

    def check():
        assert y.data_ptr() == out.data_ptr()
        for g, m in enumerate(counts):
            assert_close_to_ref(y[g, :m], ref[g, :m], base[g, :m], atol=1e-3,
                                name=f"problem {g}")
            assert bool(y[g, m:].isnan().all()), f"problem {g}: rows past masked_m written"

    _finish(name, check)


@pytest.mark.parametrize("i", range(CASES))
def test_fuzz_scaled_grouped_mm(i):
    """scaled_grouped_mm: FP8 block-wise, row-wise and per-tensor scales, the MoE form."""
    r = _rng("scaled", i)
    gran = r.choice(["block", "block", "row", "tensor"])
    E = r.choice([1, 4, 8, 12, 32, 128, 256])
    K = 128 * r.randint(1, 64) if gran == "block" else _dim(r, 16, 8192, 1.0) // 16 * 16 or 16
    N = _dim(r, 16, 7168, 1.0) // 16 * 16 or 16
    T = r.choice([0, 1, r.randint(1, 256), r.randint(1, 16384)])
    T = _fit(T, MAX_ELEMS // K)
    E = min(E, max(1, MAX_ELEMS // (K * N)))
    total = T if r.random() < 0.8 else r.randint(0, T)
    out_dtype = r.choice([None, torch.float32])
    name = _tag("scaled", i, granularity=gran, E=E, T=T, total=total, N=N, K=K,
                out_dtype=out_dtype)
    x, w, sa, sb, offs = make_fp8_moe_inputs(
        T, E, K, N, gran, device="cuda", seed=r.randrange(1 << 31), total=total,
        empty_fraction=r.choice([0.0, 0.3]), skew=r.uniform(0, 1.2))
    y = moe_gemm.scaled_grouped_mm(x, w, sa, sb, offs, out_dtype=out_dtype)
    ref = scaled_grouped_mm_ref(x, w, sa, sb, offs)

    def check():
        assert y.shape == (T, N) and y.dtype == (out_dtype or torch.bfloat16)
        assert_fp8_close(y[:total], ref[:total])
        assert not y[total:].any(), "rows past offs[-1] are not zero"

    _finish(name, check)


@pytest.mark.parametrize("i", range(CASES))
def test_fuzz_fused_grouped_mm(i):
    """fused_grouped_mm: gather, bias, every gate and layout, row weights, in any mix."""
    r = _rng("fused", i)
    E = r.choice([1, 4, 8, 32, 128])
    K = _dim(r, 16, 4096, 1.0)
    gate = r.choice([None, "silu", "gelu", "gelu_tanh", "clamped_swiglu"])
    layout = r.choice(["concat", "interleaved", "alternating"]) if gate else "concat"
    N = _dim(r, 16, 4096, 1.0) // 16 * 16 or 16
    T = r.choice([1, r.randint(1, 64), r.randint(1, 4096)])
    gather = r.random() < 0.6
    S = T * r.choice([1, 2, 8]) if gather else T
    S = _fit(S, MAX_ELEMS // K)
    E = min(E, max(1, MAX_ELEMS // (K * N)))
    total = S if r.random() < 0.8 else r.randint(0, S)
    bias = r.random() < 0.3
    weight = r.random() < 0.5
    name = _tag("fused", i, E=E, T=T, S=S, total=total, N=N, K=K, gate=gate, layout=layout,
                gather=gather, bias=bias, row_weight=weight)
    gen = torch.Generator().manual_seed(r.randrange(1 << 31))
    offs = random_offs(S, E, r.choice([0.0, 0.3]), gen, skew=r.uniform(0, 1.2),
                       total=total).cuda()
    x = (torch.randn(T if gather else S, K, generator=gen) * 0.5).to(torch.bfloat16).cuda()
    w = (torch.randn(E, N, K, generator=gen) * 2 / K ** 0.5).to(torch.bfloat16).cuda()
    w = w.transpose(1, 2)
    kw = {}
    if gather:
        kw["row_index"] = torch.randint(0, T, (S,), generator=gen).cuda()
    if bias:
        kw["bias"] = (torch.randn(E, N, generator=gen) * 0.5).cuda()
    if weight:
        kw["row_weight"] = torch.rand(S, generator=gen).cuda()
    if gate:
        kw.update(gate=gate, gate_layout=layout)
    y = moe_gemm.fused_grouped_mm(x, w, offs, **kw)
    base = moe_gemm.fused_grouped_mm(x, w, offs, config=TORCH, **kw)
    ref = fused_grouped_mm_ref(x, w, offs, **kw)

    def check():
        cols = N // 2 if gate else N
        assert y.shape == (S, cols) and y.dtype == torch.bfloat16
        scale = float(ref.abs().max()) if ref.numel() else 1.0
        assert_close_to_ref(y[:total], ref[:total], base[:total], atol=1e-3 * scale + 1e-3,
                            name="y")
        assert not y[total:].any(), "rows past offs[-1] are not zero"

    _finish(name, check)


@pytest.mark.parametrize("i", range(max(4, CASES // 3)))
def test_fuzz_moe_layer(i):
    """MoE layers of random model-like configurations, fp32 experts on the layer's own
    routing as the reference."""
    r = _rng("moe", i)
    E = r.choice([4, 8, 16, 32, 64, 128])
    k = r.choice([kk for kk in (1, 2, 4, 6, 8) if kk <= E])
    H = r.choice([256, 512, 1024, 2048, 2880, 4096])
    I = r.choice([128, 192, 256, 384, 768, 1408, 2048])
    T = r.choice([1, 3, 16, r.randint(1, 512), r.randint(1, 4096)])
    extra = {}
    if r.random() < 0.3 and E >= 8 and k <= 2 * (E // 4):  # (4 groups of 2 or more; k in 2)
        extra.update(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    if r.random() < 0.3:
        extra["shared_intermediate_size"] = r.choice([128, 256, 512])
    activation = r.choice(["silu", "silu", "gelu", "gelu_tanh"])
    name = _tag("moe", i, E=E, k=k, H=H, I=I, T=T, activation=activation, **extra)
    torch.manual_seed(r.randrange(1 << 31))
    moe = MoE(H, I, E, k, activation=activation, device="cuda", dtype=torch.bfloat16, **extra)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    with torch.inference_mode():
        y = moe(x)
        wts, ids = moe.route(x)
        base = moe_experts(x, ids, wts, moe.w_gate_up, moe.w_down, activation=activation,
                           config=TORCH, fused=False)
        ref = moe_experts(x.float(), ids, wts, moe.w_gate_up.float(), moe.w_down.float(),
                          activation=activation, config=TORCH, fused=False)
        if moe.shared_experts is not None:
            s, x32 = moe.shared_experts, x.float()
            h = (_act(activation, x32 @ s.gate_proj.weight.float().T)
                 * (x32 @ s.up_proj.weight.float().T))
            ref = ref + h @ s.down_proj.weight.float().T
            base = base + s(x)

    def check():
        assert y.shape == (T, H) and y.dtype == torch.bfloat16
        scale = float(ref.abs().max())
        assert_close_to_ref(y, ref, base, atol=2e-3 * scale,
                            max_calc_diff=max(1e-5, 2 * calc_diff(base, ref)), name="y")

    _finish(name, check)


def _act(name: str, v: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return torch.nn.functional.silu(v)
    return torch.nn.functional.gelu(v, approximate="tanh" if name == "gelu_tanh" else "none")


def test_fuzz_fp8_weights_quantized_as_checkpoints():
    """quantize_weights' K-major views of random weights feed scaled_grouped_mm unchanged
    (the checkpoint layout), for one random shape per run."""
    i = 0
    r = _rng("fp8-layout", i)
    E, N, K = r.choice([2, 8]), 128 * r.randint(1, 16), 128 * r.randint(1, 16)
    T = r.randint(1, 2048)
    gen = torch.Generator(device="cuda").manual_seed(r.randrange(1 << 31))
    xq, sa = quantize_acts(torch.randn(T, K, generator=gen, device="cuda"), "block")
    wq, sb = quantize_weights(torch.randn(E, N, K, generator=gen, device="cuda") / K ** 0.5,
                              "block")
    offs = random_offs(T, E, 0.0, torch.Generator().manual_seed(r.randrange(1 << 31))).cuda()
    name = _tag("fp8-layout", i, E=E, N=N, K=K, T=T)
    y = moe_gemm.scaled_grouped_mm(xq, wq, sa, sb, offs)
    _finish(name, lambda: assert_fp8_close(y, scaled_grouped_mm_ref(xq, wq, sa, sb, offs)))
