"""fused_grouped_mm on the CPU: the torch backend against the float64 reference for every
option, the argument checks (each error path), the registered ops (fake tensors,
torch.compile(fullgraph=True) with its backward), interleave_gate_up, and the host rules
of the kernel path that need no GPU (the config fitting, the TMA rules, the compile keys)."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.kernels.sm90.constants import (
    HEAVY_ACC_REGS,
    acc_regs,
    fused_problem,
    gather_rows_in_registers,
)
from moe_gemm.ops.fused_launch import (
    FAST_GATE_ENV,
    GATHER_WIDE_ENV,
    fit_fused,
    fused_choice,
    fused_key,
    fused_unsupported,
)
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref, fused_grouped_mm_torch
from moe_gemm.ops.fused_validation import check_fused_mm
from moe_gemm.ops.heuristics import KernelChoice

GATES = [None, "silu", "gelu", "gelu_tanh", "clamped_swiglu", "clamped_silu"]
LAYOUTS = ["concat", "interleaved", "alternating"]


def _case(seed: int, T=9, K=40, E=4, N=64, S=13, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    w = (torch.randn(E, K, N, generator=g) / 4).to(dtype)
    index = torch.randint(0, T, (S,), generator=g)
    counts = torch.tensor([3, 0, 6, 2])[:E]  # an empty expert; 2 rows past offs[-1]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return x, w, offs, index, g


@pytest.mark.parametrize("gate,layout", [(g, lay) for g in GATES for lay in LAYOUTS
                                         if g is not None or lay == "concat"])
@pytest.mark.parametrize("gather,bias,scale", list(itertools.product([False, True], repeat=3)))
def test_torch_backend_matches_float64(gate, layout, gather, bias, scale):
    x, w, offs, index, g = _case(len(str((gate, layout))))
    E, N = w.shape[0], w.shape[2]
    if not gather:
        x = x[index]  # the routed rows themselves (S = 13, offs[-1] = 11)
    S = index.shape[0]
    kw = dict(row_index=index if gather else None,
              bias=torch.randn(E, N, generator=g) if bias else None,
              row_weight=torch.rand(S, generator=g) if scale else None,
              gate=gate, gate_layout=layout, gate_limit=1.5)
    y = moe_gemm.fused_grouped_mm(x, w, offs, **kw)
    ref = fused_grouped_mm_ref(x, w, offs, dtype=torch.float64, **kw)
    assert y.shape == (S, N // 2 if gate else N) and y.dtype == x.dtype
    assert torch.allclose(y.double(), ref, atol=1e-5, rtol=1e-5)
    end = int(offs[-1])
    assert end < S and bool((y[end:] == 0).all())  # rows past offs[-1]: zero


@pytest.mark.parametrize("ends", [[6, 3, 10, 13], [10, 3, 5, 12], [4, 4, 2, 20], [-3, 5, 1, 7]])
@pytest.mark.parametrize("gate,bias,scale", [(None, True, True), ("silu", True, False),
                                             ("gelu", False, True)])
def test_torch_backend_reads_unchecked_offs_as_the_kernel_does(ends, gate, bias, scale):
    # On a GPU offs values are not checked (no host sync): a decreasing entry is an empty
    # expert and values are clamped into [0, S], for the GEMM's spans and for the expert whose
    # bias, gate and row weight each row takes alike (the float64 loop's reading of offs).
    x, w, _, index, g = _case(sum(ends) + len(str(gate)))
    E, N, S = w.shape[0], w.shape[2], index.shape[0]
    offs = torch.tensor(ends, dtype=torch.int32)
    kw = dict(row_index=index, bias=torch.randn(E, N, generator=g) if bias else None,
              row_weight=torch.rand(S, generator=g) if scale else None, gate=gate)
    args = check_fused_mm(x, w, offs, **kw, concrete=False)
    y = fused_grouped_mm_torch(args)
    ref = fused_grouped_mm_ref(x, w, offs.clamp(0, S), dtype=torch.float64, **kw)
    assert torch.allclose(y.double(), ref, atol=1e-5, rtol=1e-5)


def test_torch_backend_clamps_unchecked_row_index_into_xs_rows():
    """row_index values on a GPU are not checked (no host sync; the docstring promises wrong
    rows, never an out-of-bounds read), and the torch backend runs there too (fp32, other
    GPUs): it must clamp them into [0, T) as the kernel's gather does, since an index_select
    out of range faults the CUDA context. concrete=False skips the value check as a GPU
    tensor does."""
    x, w, offs, index, g = _case(21)
    T, S, E, N = x.shape[0], index.shape[0], w.shape[0], w.shape[2]
    bad = index.clone()
    bad[0], bad[4], bad[7] = T, -3, T + 1000
    kw = dict(bias=torch.randn(E, N, generator=g), row_weight=torch.rand(S, generator=g),
              gate="gelu")
    args = check_fused_mm(x, w, offs, row_index=bad, concrete=False, **kw)
    y = fused_grouped_mm_torch(args)
    want = fused_grouped_mm_ref(x, w, offs, row_index=bad.clamp(0, T - 1), dtype=torch.float64,
                                **kw)
    assert torch.allclose(y.double(), want, atol=1e-5, rtol=1e-5)


def test_strided_offs_take_no_copy_warning_and_match_contiguous_ones():
    # offs as a column of a larger tensor (or a slice under vmap) is valid input: the torch
    # backend's row -> expert lookup must not hand it to searchsorted strided, which warns
    # of a copy (set_warn_always: torch warns once per process otherwise).
    x, w, offs, index, g = _case(22)
    strided = torch.stack([offs, offs + 100], dim=1)[:, 0]
    assert not strided.is_contiguous()
    bias = torch.randn(w.shape[0], w.shape[2], generator=g)
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            y = moe_gemm.fused_grouped_mm(x, w, strided, row_index=index, bias=bias,
                                          gate="silu")
    finally:
        torch.set_warn_always(was)
    assert torch.equal(y, moe_gemm.fused_grouped_mm(x, w, offs, row_index=index, bias=bias,
                                                    gate="silu"))


def test_out_keeps_rows_past_offs_and_out_dtype():
    x, w, offs, index, _ = _case(3)
    S = index.shape[0]
    out = torch.full((S, 32), 7.0)
    y = moe_gemm.fused_grouped_mm(x, w, offs, row_index=index, gate="silu", out=out)
    assert y is out
    end = int(offs[-1])
    assert bool((out[end:] == 7.0).all())
    ref = fused_grouped_mm_ref(x, w, offs, row_index=index, gate="silu")
    assert torch.allclose(out[:end], ref[:end], atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    y32 = moe_gemm.fused_grouped_mm(xb, wb, offs, row_index=index, out_dtype=torch.float32)
    assert y32.dtype == torch.float32


def test_empty_and_expertless_calls():
    x, w, offs, _, _ = _case(4)
    empty = moe_gemm.fused_grouped_mm(x[:0], w, torch.zeros(4, dtype=torch.int32), gate="silu")
    assert empty.shape == (0, 32)
    none = moe_gemm.fused_grouped_mm(x, w[:0], torch.zeros(0, dtype=torch.int32))
    assert none.shape == (9, 64) and bool((none == 0).all())
    no_rows = moe_gemm.fused_grouped_mm(x, w, torch.zeros(4, dtype=torch.int32),
                                        row_index=torch.zeros(0, dtype=torch.int64))
    assert no_rows.shape == (0, 64)


def _bad(**kw):
    x, w, offs, index, _ = _case(5)
    args = dict(x=x, w=w, offs=offs, row_index=index)
    args.update(kw)
    return args


@pytest.mark.parametrize("change,error,match", [
    (dict(x=[1.0]), TypeError, "x must be a torch.Tensor"),
    (dict(x=torch.zeros(9, 40, 1)), ValueError, "x must be 2-D"),
    (dict(w=torch.zeros(40, 64)), ValueError, "w must be 3-D"),
    (dict(x=torch.zeros(9, 40, dtype=torch.int32)), TypeError, "bfloat16"),
    (dict(w=torch.zeros(4, 40, 64, dtype=torch.float64)), TypeError, "w has dtype"),
    (dict(offs=torch.zeros(4, dtype=torch.int64)), TypeError, "offs must be int32"),
    (dict(offs=torch.zeros(3, dtype=torch.int32)), ValueError, "one entry per expert"),
    (dict(w=torch.zeros(4, 41, 64)), ValueError, r"must be \(E, 40, N\)"),
    (dict(row_index=torch.zeros(3, 2, dtype=torch.int64)), ValueError, "row_index must be 1-D"),
    (dict(row_index=torch.zeros(3)), TypeError, "row_index must be int32 or int64"),
    (dict(row_index=torch.tensor([0, 9])), ValueError, r"rows of x in \[0, 9\)"),
    (dict(row_index=torch.tensor([-1, 2])), ValueError, "rows of x"),
    (dict(row_index=[0, 1]), TypeError, "row_index must be a torch.Tensor"),
    (dict(x=torch.zeros(0, 40)), ValueError, "x has no rows"),
    (dict(gate="relu"), ValueError, "gate must be one of"),
    (dict(gate=3), TypeError, "gate must be a str"),
    (dict(gate="silu", gate_layout="halves"), ValueError, "gate_layout must be one of"),
    (dict(gate="silu", gate_layout=["concat"]), ValueError, "gate_layout must be one of"),
    (dict(gate=["silu"]), TypeError, "gate must be a str"),
    (dict(gate="silu", w=torch.zeros(4, 40, 63)), ValueError, "N must be even"),
    (dict(gate="silu", gate_layout="interleaved", w=torch.zeros(4, 40, 40)), ValueError,
     "multiple of 16"),
    (dict(gate="clamped_swiglu", gate_limit=0.0), ValueError, "gate_limit must be > 0"),
    (dict(gate="clamped_silu", gate_limit=-1.0), ValueError,
     "gate_limit must be > 0 for clamped_silu"),
    (dict(gate_alpha="1"), TypeError, "gate_alpha must be a float"),
    (dict(gate_limit=float("nan")), ValueError, "gate_limit must be finite"),
    (dict(gate_alpha=10 ** 400), ValueError, "gate_alpha must be finite"),
    (dict(gate_limit=-10 ** 400), ValueError, "gate_limit must be finite"),
    (dict(row_weight=torch.zeros(5)), ValueError, r"row_weight must be \(S,\) = \(13,\)"),
    (dict(row_weight=torch.zeros(13, dtype=torch.int32)), TypeError, "row_weight must be a float"),
    (dict(row_weight=1.0), TypeError, "row_weight must be a torch.Tensor"),
    (dict(bias=torch.zeros(4, 32)), ValueError, r"bias must be \(E, N\) = \(4, 64\)"),
    (dict(bias=torch.zeros(4, 64, dtype=torch.int64)), TypeError, "bias must be a float"),
    (dict(bias="b"), TypeError, "bias must be a torch.Tensor"),
    (dict(offs=torch.tensor([3, 2, 8, 9], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(offs=torch.tensor([3, 3, 8, 14], dtype=torch.int32)), ValueError,
     r"offs\[-1\] must be <= S = 13 \(routed rows\)"),
    (dict(out=torch.zeros(13, 32)), ValueError, r"out must be \(S, N\) = \(13, 64\)"),
    (dict(out=torch.zeros(13, 64, dtype=torch.float64)), TypeError, "bfloat16"),
    (dict(out="o"), TypeError, "out must be a torch.Tensor"),
    (dict(config="fast"), TypeError, "config must be a moe_gemm.GemmConfig"),
])
def test_argument_errors_name_the_expectation(change, error, match):
    args = _bad(**change)
    with pytest.raises(error, match=match):
        moe_gemm.fused_grouped_mm(args.pop("x"), args.pop("w"), args.pop("offs"), **args)


def test_gate_constants_take_any_real_number():
    """numpy scalars (a config read with numpy) are floats to the gate: np.float32 is not a
    Python float subclass, and was refused."""
    np = pytest.importorskip("numpy")
    x, w, offs, index, _ = _case(11)
    want = moe_gemm.fused_grouped_mm(x, w, offs, row_index=index, gate="clamped_swiglu",
                                     gate_alpha=1.5, gate_limit=3.0)
    got = moe_gemm.fused_grouped_mm(x, w, offs, row_index=index, gate="clamped_swiglu",
                                    gate_alpha=np.float32(1.5), gate_limit=np.int64(3))
    assert torch.equal(got, want)


def test_an_int_past_floats_range_is_a_gate_constant_error_when_traced_too():
    # (float() of it raised OverflowError, eager and in the traced wrapper)
    from moe_gemm.ops import fused_custom_ops

    x, w, offs, index, _ = _case(11)
    for name in ("gate_alpha", "gate_limit"):
        with pytest.raises(ValueError, match=f"{name} must be finite; got an int past"):
            fused_custom_ops.fused_grouped_mm(x, w, offs, row_index=index,
                                              gate="clamped_swiglu", **{name: 10 ** 400})


@pytest.mark.parametrize("gate", [None, "silu"])
def test_out_sharing_memory_with_an_input_is_computed_as_if_cloned(gate):
    # As grouped_mm does: the same call on cloned inputs, written into out (its rows past
    # offs[-1] keep their values: here the 2 rows that no expert owns).
    x, w, offs, index, _ = _case(6)
    N = w.shape[2] // 2 if gate else w.shape[2]
    buf = torch.randn(13 * N + 9 * 40)
    x2 = buf[:9 * 40].view(9, 40).copy_(x)
    out = buf[9 * 40 - N:9 * 40 - N + 13 * N].view(13, N)
    want = moe_gemm.fused_grouped_mm(x2.clone(), w, offs, row_index=index, gate=gate,
                                     out=out.clone())
    tail = out[11:].clone()
    assert moe_gemm.fused_grouped_mm(x2, w, offs, row_index=index, gate=gate, out=out) is out
    assert torch.equal(out, want)
    assert torch.equal(out[11:], tail)


def test_forced_cute_backend_raises_off_the_gpu():
    x, w, offs, index, _ = _case(7)
    with pytest.raises(RuntimeError, match="cannot run here"):
        moe_gemm.fused_grouped_mm(x, w, offs, row_index=index,
                                  config=GemmConfig(backend="cute"))


def test_interleave_gate_up_layouts():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(3, 5, 32, generator=g)
    x = torch.randn(4, 5, generator=g)
    offs = torch.tensor([1, 3, 4], dtype=torch.int32)
    ref = moe_gemm.fused_grouped_mm(x, w, offs, gate="silu")
    packed = moe_gemm.interleave_gate_up(w)
    assert torch.allclose(moe_gemm.fused_grouped_mm(x, packed, offs, gate="silu",
                                                    gate_layout="interleaved"), ref)
    alternating = torch.stack([w[..., :16], w[..., 16:]], -1).reshape(3, 5, 32)
    assert torch.equal(moe_gemm.interleave_gate_up(alternating, "alternating"), packed)
    assert torch.allclose(moe_gemm.fused_grouped_mm(x, alternating, offs, gate="silu",
                                                    gate_layout="alternating"), ref)
    k_major = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert moe_gemm.interleave_gate_up(k_major).stride(1) == 1
    with pytest.raises(ValueError, match="multiple of 16"):
        moe_gemm.interleave_gate_up(torch.zeros(2, 24))
    with pytest.raises(ValueError, match="source must be"):
        moe_gemm.interleave_gate_up(w, "halves")
    with pytest.raises(TypeError):
        moe_gemm.interleave_gate_up([1, 2])


def test_interleave_gate_up_names_the_rank_of_a_0d_tensor():
    # A tensor with no dimension has no columns to pair: the rank is what does not fit, so
    # the error is a ValueError that says so (not a TypeError saying w must be a tensor).
    with pytest.raises(ValueError, match="at least one dimension.*0-d"):
        moe_gemm.interleave_gate_up(torch.tensor(1.0))


def test_fake_tensor_shapes_and_compiled_graph():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, w, offs, index, _ = _case(9)
    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w)
        fo, fi = mode.from_tensor(offs), mode.from_tensor(index)
        y = moe_gemm.fused_grouped_mm(fx, fw, fo, row_index=fi, gate="gelu")
        assert tuple(y.shape) == (13, 32) and y.dtype == x.dtype

    import torch._dynamo

    torch._dynamo.reset()

    def fn(x, w, offs, index, rw):
        return moe_gemm.fused_grouped_mm(x, w, offs, row_index=index, row_weight=rw,
                                         gate="silu") * 2

    rw = torch.rand(13)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(x, w, offs, index, rw), fn(x, w, offs, index, rw))
    torch._dynamo.reset()


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate,layout", [(g, lay) for g in GATES for lay in LAYOUTS
                                         if g is not None or lay == "concat"])
def test_compiled_backward_equals_eager_on_the_torch_path(gate, layout, dtype):
    """Off a Hopper GPU the forward runs torch's path, which eager autograd differentiates; the
    compiled graph's backward (one registered op, written-out gradients) gives the same
    gradients for x, w, the bias and the row weights, with and without the gather."""
    import torch._dynamo

    for gather, with_bias, scale in itertools.product([False, True], repeat=3):
        x, w, offs, index, g = _case(31 + len(str(gate)), dtype=dtype)
        if not gather:
            x = x[index]
        bias = torch.randn(4, 64, generator=g).to(dtype) if with_bias else None
        rw = torch.rand(13, generator=g).to(dtype) if scale else None
        kw = dict(row_index=index if gather else None, gate=gate, gate_layout=layout,
                  gate_limit=1.0)

        def f(x, w, bias, rw, kw=kw):
            return moe_gemm.fused_grouped_mm(x, w, offs, bias=bias, row_weight=rw, **kw)

        eager = _leaves(x, w, bias, rw)
        y = f(*eager)
        dy = torch.randn(y.shape, generator=g).to(y.dtype)
        y.backward(dy)
        torch._dynamo.reset()
        compiled = _leaves(x, w, bias, rw)
        torch.compile(f, backend="aot_eager", fullgraph=True)(*compiled).backward(dy)
        for e, c in zip(eager, compiled):
            if e is None:
                continue
            assert c.grad is not None and c.grad.dtype == e.dtype
            scale_ = e.grad.float().abs().max().item()
            tol = 1e-6 if dtype == torch.float32 else 2e-2
            assert (c.grad.float() - e.grad.float()).abs().max().item() <= tol * scale_ + 1e-7
        if not gather:  # rows past offs[-1] never reached the output
            assert not compiled[0].grad[int(offs[-1]):].any()
    torch._dynamo.reset()


def test_backward_raises_where_the_kernel_ran(monkeypatch):
    """Where the forward ran the Hopper kernel the gradient op raises (inference-only, as in
    eager); it decides from the saved inputs as the forward did."""
    from moe_gemm.ops import fused as fused_mod
    from moe_gemm.ops import fused_launch
    from moe_gemm.ops.custom_ops import encode_config

    x, w, offs, index, _ = _case(10)
    grad = torch.randn(13, 32)
    args = (grad, x, w, offs, index, None, None, "silu", "concat", 1.702, 7.0)
    gx, gw, grw, gb = torch.ops.moe_gemm._fused_grouped_mm_grad(*args, "", None)
    assert gx.shape == x.shape and gw.shape == w.shape and grw.numel() == gb.numel() == 0
    monkeypatch.setattr(fused_mod, "cute_problem", lambda device: None)
    monkeypatch.setattr(fused_launch, "fused_unsupported", lambda a: None)
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.ops.moe_gemm._fused_grouped_mm_grad(*args, "", None)
    # backend="torch" ran torch's path wherever it runs
    torch.ops.moe_gemm._fused_grouped_mm_grad(
        *args, encode_config(GemmConfig(backend="torch")), None)
    monkeypatch.setattr(fused_launch, "fused_unsupported", lambda a: "a layout it lacks")
    torch.ops.moe_gemm._fused_grouped_mm_grad(*args, "", None)


def test_eager_torch_backend_is_differentiable():
    x, w, offs, index, _ = _case(10)
    w = w.clone().requires_grad_(True)
    y = moe_gemm.fused_grouped_mm(x, w, offs, row_index=index, gate="silu",
                                  config=GemmConfig(backend="torch"))
    y.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def _choice(schedule, tm, tn, cm=1, cn=1, **kw):
    return KernelChoice(schedule, "device", tm, tn, None, False, 8, cluster_m=cm, cluster_n=cn,
                        **kw)


@pytest.mark.parametrize("choice", [
    _choice("cooperative", 128, 256), _choice("cooperative", 256, 208),
    _choice("cooperative", 256, 128, cm=2), _choice("cooperative", 128, 256, cn=2),
    _choice("pingpong", 128, 208), _choice("pingpong", 128, 192, cm=2),
    _choice("pingpong", 64, 256), _choice("pingpong", 128, 160),
    _choice("cooperative", 128, 256, epi_whole=True, tail_split=True),
])
@pytest.mark.parametrize("gate,gather", [(True, True), (True, False), (False, True),
                                         (False, False)])
@pytest.mark.parametrize("wide", [False, True])
def test_fit_fused_gives_buildable_tiles(choice, gate, gather, wide):
    fitted = fit_fused(choice, gate, gather, wide_gather=wide)
    assert fitted.visitor == "device"
    assert fused_problem("varlen", fitted.schedule, fitted.tile_m, fitted.tile_n, "k",
                         fitted.cluster_n, "silu" if gate else "", "concat", gather) is None
    assert acc_regs(fitted.schedule, fitted.tile_m, fitted.tile_n) <= 192
    if (fitted.tile_m, fitted.tile_n) == (choice.tile_m, choice.tile_n):
        assert fitted.epi_whole == choice.epi_whole
    else:
        assert not fitted.epi_whole and fitted.stages is None
    assert not fit_fused(choice, gate, gather, bias_and_scale=True).epi_whole
    if gather:
        assert fitted.cluster_n == 1
        if not wide:  # the default: the form with the rows' indices in registers
            assert gather_rows_in_registers(fitted.schedule, fitted.tile_m, fitted.tile_n)


@pytest.mark.parametrize("choice", [
    _choice("pingpong", 128, 192, cn=2, tail_split=True), _choice("pingpong", 128, 128,
                                                                  tail_split=True),
    _choice("cooperative", 128, 256, cm=2, tail_split=True),
])
def test_fit_fused_runs_a_pingpong_or_clustered_split_unsplit(choice):
    # (a tuned grouped_mm entry may pin them; the fused kernels split cooperative 1x1 only)
    for gate, gather in ((True, False), (False, False), (True, True)):
        assert not fit_fused(choice, gate, gather).tail_split
    coop = _choice("cooperative", 128, 256, tail_split=True)
    assert fit_fused(coop, True, False).tail_split


def test_wide_gather_keeps_the_tile_below_the_heavy_accumulators():
    for choice in (_choice("pingpong", 128, 192, cm=2), _choice("cooperative", 256, 128, cm=2),
                   _choice("pingpong", 128, 160)):
        fitted = fit_fused(choice, True, True, wide_gather=True)
        assert (fitted.schedule, fitted.tile_m, fitted.tile_n, fitted.cluster_m) == (
            choice.schedule, choice.tile_m, choice.tile_n, choice.cluster_m)
        narrow = fit_fused(choice, True, True)
        assert (narrow.tile_m, narrow.tile_n) != (choice.tile_m, choice.tile_n)
    # a heavy tile is fitted as before (the producer's 24 registers spill the gather)
    heavy = fit_fused(_choice("cooperative", 256, 208), False, True, wide_gather=True)
    assert acc_regs(heavy.schedule, heavy.tile_m, heavy.tile_n) < HEAVY_ACC_REGS


def test_wide_gather_switch_reaches_the_choice(monkeypatch):
    args = _meta_args(4096, 32768, 32, 3072, 2048, gate="silu")
    cfg = GemmConfig(schedule="pingpong", tile_m=128, tile_n=192, cluster_m=2, cluster_n=1)
    monkeypatch.delenv(GATHER_WIDE_ENV, raising=False)
    choice, in_kernel = fused_choice(args, cfg, 132, torch.device("meta"))
    assert not in_kernel and (choice.tile_m, choice.tile_n) == (128, 192)  # host gather
    monkeypatch.setenv(GATHER_WIDE_ENV, "1")
    choice, in_kernel = fused_choice(args, cfg, 132, torch.device("meta"))
    assert in_kernel and (choice.tile_m, choice.tile_n, choice.cluster_m) == (128, 192, 2)


def test_the_kernel_gathers_only_small_batches_by_default(monkeypatch):
    from moe_gemm.ops.fused_launch import GATHER_MAX_ROWS

    cfg = GemmConfig(schedule="pingpong", tile_m=64, tile_n=256, cluster_m=2, cluster_n=1)
    monkeypatch.delenv(GATHER_WIDE_ENV, raising=False)
    picks = {S: fused_choice(_meta_args(4096, S, 32, 4096, 7168, gate="silu"), cfg, 132,
                             torch.device("meta")) for S in (8, GATHER_MAX_ROWS - 1,
                                                              GATHER_MAX_ROWS, 131072)}
    assert [in_kernel for _, in_kernel in picks.values()] == [True, True, False, False]
    tiles = {(c.schedule, c.tile_m, c.tile_n, c.cluster_m) for c, _ in picks.values()}
    assert tiles == {("pingpong", 64, 256, 2)}  # the same tile either way
    monkeypatch.setenv(GATHER_WIDE_ENV, "1")  # the in-kernel gather at every size
    assert fused_choice(_meta_args(4096, 131072, 32, 4096, 7168, gate="silu"), cfg, 132,
                        torch.device("meta"))[1]


def test_past_decode_only_the_switch_gathers_in_the_kernel(monkeypatch):
    from moe_gemm.ops.fused_launch import GATHER_MAX_ROWS

    monkeypatch.delenv(GATHER_WIDE_ENV, raising=False)
    meta = torch.device("meta")
    # A tile the register form keeps: gathered in the kernel below GATHER_MAX_ROWS only, on
    # narrow weights (Qwen3-30B-A3B's gate-up, N = 2I = 1536) as on wide ones.
    small = GemmConfig(schedule="pingpong", tile_m=64, tile_n=128, cluster_m=1, cluster_n=1)
    for N in (1536, 4096):
        for S, expected in ((8, True), (GATHER_MAX_ROWS - 1, True), (GATHER_MAX_ROWS, False),
                            (1024, False), (131072, False)):
            args = _meta_args(max(1, S // 8), S, 128, N, 2048, gate="silu")
            assert fused_choice(args, small, 132, meta)[1] == expected, (N, S)
    # A tile past the register form: the plan gathers at every size by default (below
    # GATHER_MAX_ROWS the register form would cap it); the wide form keeps it with the switch.
    pp = GemmConfig(schedule="pingpong", tile_m=128, tile_n=192, cluster_m=1, cluster_n=1)
    for wide in (False, True):
        monkeypatch.setenv(GATHER_WIDE_ENV, "1" if wide else "0")
        for S in (GATHER_MAX_ROWS - 8, GATHER_MAX_ROWS, 2048, 131072):
            args = _meta_args(max(1, S // 8), S, 128, 1536, 2048, gate="silu")
            choice, in_kernel = fused_choice(args, pp, 132, meta)
            assert in_kernel == wide and (choice.tile_m, choice.tile_n) == (128, 192), S
        # A cluster along N still multicasts A: the plan gathers, whatever the switch.
        c1x2 = GemmConfig(schedule="pingpong", tile_m=128, tile_n=160, cluster_m=1,
                          cluster_n=2)
        choice, in_kernel = fused_choice(_meta_args(4096, 32768, 128, 1536, 2048, gate="silu"),
                                         c1x2, 132, meta)
        assert not in_kernel and choice.cluster_n == 2


def test_row_weights_alone_keep_grouped_mms_tile():
    # One weight per row needs no registers beside the accumulator worth a smaller tile.
    big = dataclasses.replace(_choice("pingpong", 128, 208), stages=4)
    assert acc_regs("pingpong", 128, 208) > 192
    kept = fit_fused(big, False, False, heavy_epilogue=False)
    assert (kept.tile_m, kept.tile_n, kept.stages) == (128, 208, 4)
    assert (fit_fused(big, False, False).tile_m, fit_fused(big, False, False).tile_n) != (
        128, 208)


def _meta_args(T, S, E, N, K, **kw):
    meta = torch.device("meta")
    return check_fused_mm(
        torch.empty(T, K, dtype=torch.bfloat16, device=meta),
        torch.empty(E, N, K, dtype=torch.bfloat16, device=meta).transpose(1, 2),
        torch.empty(E, dtype=torch.int32, device=meta),
        row_index=torch.empty(S, dtype=torch.int32, device=meta), concrete=False, **kw)


def test_the_kernel_gathers_only_where_that_keeps_the_tile():
    from moe_gemm import GemmConfig
    from moe_gemm.ops.fused_launch import fused_choice

    meta = torch.device("meta")
    # A decode batch (below fused_launch.GATHER_MAX_ROWS routed rows), where the kernel
    # gathers by default. A cluster along N multicasts A, which the gather cannot: the plan
    # gathers instead.
    pinned = GemmConfig(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=1,
                        cluster_n=2)
    choice, in_kernel = fused_choice(_meta_args(6, 24, 6, 512, 256, gate="silu"), pinned,
                                     132, meta)
    assert not in_kernel and (choice.tile_m, choice.tile_n, choice.cluster_n) == (128, 256, 2)
    # Without a cluster along N the same pinned tile gathers in the kernel.
    pinned1 = GemmConfig(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=1,
                         cluster_n=1)
    choice, in_kernel = fused_choice(_meta_args(6, 24, 6, 512, 256, gate="silu"), pinned1,
                                     132, meta)
    assert in_kernel and (choice.tile_m, choice.tile_n) == (128, 256)
    # A ping-pong 128-row tile: the gather caps it (64 rows), so the plan gathers.
    pp = GemmConfig(schedule="pingpong", tile_m=128, tile_n=192, cluster_m=1, cluster_n=1)
    choice, in_kernel = fused_choice(_meta_args(6, 24, 6, 512, 256, gate="silu"), pp, 132,
                                     meta)
    assert not in_kernel and (choice.tile_m, choice.tile_n) == (128, 192)


def test_fused_key_and_unsupported_reasons():
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    w_k = torch.zeros(4, 128, 64, dtype=torch.bfloat16).transpose(1, 2)  # K-major (E, 64, 128)
    w_n = torch.zeros(4, 64, 128, dtype=torch.bfloat16)
    offs = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    args = check_fused_mm(x, w_k, offs, gate="silu", row_index=torch.arange(8),
                          bias=torch.zeros(4, 128), row_weight=torch.ones(8))
    assert fused_unsupported(args) is None
    key = fused_key(args, _choice("cooperative", 128, 256), "k", True)
    assert (key.gate, key.gate_layout, key.bias, key.row_scale, key.gather) == (
        "silu", "concat", True, True, True)
    assert key.gate_alpha == 0.0  # only the clamped gates bake their constants in
    silu_limit = check_fused_mm(x, w_k, offs, gate="clamped_silu", gate_alpha=3.0,
                                gate_limit=2.5)
    key = fused_key(silu_limit, _choice("cooperative", 128, 256), "k", False)
    assert (key.gate, key.gate_alpha, key.gate_limit) == ("clamped_silu", 0.0, 2.5)
    assert "clamped_silu" in key.name() and "l2.5" in key.name()
    n_major = check_fused_mm(x, w_n, offs, gate="silu")
    assert "K-major" in fused_unsupported(n_major)
    assert fused_unsupported(check_fused_mm(x, w_n, offs, gate="silu",
                                            gate_layout="alternating")) is None
    odd = check_fused_mm(torch.zeros(8, 60, dtype=torch.bfloat16),
                         torch.zeros(4, 60, 128, dtype=torch.bfloat16), offs)
    assert "stride" in fused_unsupported(odd)
    f32 = check_fused_mm(x.float(), w_n.float(), offs)
    assert "bf16 or fp16" in fused_unsupported(f32)
    narrow = check_fused_mm(x, torch.zeros(4, 64, 12, dtype=torch.bfloat16), offs, gate="silu",
                            gate_layout="alternating")
    assert "16 bytes" in fused_unsupported(narrow)


@pytest.mark.parametrize("gate,fast", [("silu", True), ("clamped_swiglu", True),
                                       ("clamped_silu", True), ("gelu", False),
                                       ("gelu_tanh", False), (None, False)])
def test_sigmoid_gates_take_the_fast_gate_unless_switched_off(gate, fast, monkeypatch):
    kw = {} if gate is None else dict(gate=gate, gate_layout="interleaved")
    args = _meta_args(512, 2048, 8, 1024, 512, **kw)
    cfg = GemmConfig(schedule="pingpong", tile_m=64, tile_n=256)
    choice, gather = fused_choice(args, cfg, 132, torch.device("meta"))
    monkeypatch.delenv(FAST_GATE_ENV, raising=False)
    default = fused_key(args, choice, "k", gather)
    monkeypatch.setenv(FAST_GATE_ENV, "1")
    assert fused_key(args, choice, "k", gather) == default
    monkeypatch.setenv(FAST_GATE_ENV, "0")
    ieee = fused_key(args, choice, "k", gather)
    assert default.fast_gate == fast and not ieee.fast_gate
    assert (default.name() != ieee.name()) == fast and ("fastgate" in default.name()) == fast


def test_fast_gate_needs_a_sigmoid_gate():
    from moe_gemm.kernels.sm90.compile import CompileKey

    key = CompileKey("varlen", "bfloat16", "bfloat16", "k", "pingpong", "device", 64, 256,
                     gate="gelu", gate_layout="concat", fast_gate=True)
    with pytest.raises(ValueError, match="fast_gate needs a sigmoid gate"):
        key.kernel()
    ok = CompileKey("varlen", "bfloat16", "bfloat16", "k", "pingpong", "device", 64, 256,
                    gate="silu", gate_layout="concat", fast_gate=True).kernel()
    assert ok.fast_gate


@pytest.mark.parametrize("schedule,tile_m,tile_n,bias,fast", [
    ("pingpong", 128, 192, True, False),  # 192 accumulator registers and a bias: IEEE
    ("cooperative", 256, 192, True, False),
    ("pingpong", 128, 192, False, True),  # no bias: the SFU sigmoid
    ("pingpong", 128, 160, True, True),  # 160 registers
    ("pingpong", 64, 256, True, True),
    ("cooperative", 128, 256, True, True),  # 128 registers a thread
])
def test_biased_heavy_tiles_keep_the_ieee_sigmoid(schedule, tile_m, tile_n, bias, fast,
                                                  monkeypatch):
    monkeypatch.delenv(FAST_GATE_ENV, raising=False)
    kw = dict(gate="clamped_swiglu", gate_layout="alternating", gate_alpha=1.702,
              gate_limit=7.0)
    if bias:
        kw["bias"] = torch.empty(8, 1024, dtype=torch.float32, device="meta")
    args = _meta_args(2048, 8192, 8, 1024, 2048, **kw)
    cfg = GemmConfig(schedule=schedule, tile_m=tile_m, tile_n=tile_n)
    choice, gather = fused_choice(args, cfg, 132, torch.device("meta"))
    assert (choice.schedule, choice.tile_m, choice.tile_n) == (schedule, tile_m, tile_n)
    assert fused_key(args, choice, "k", gather).fast_gate == fast


def test_trimmed_a_follows_the_fitted_tile_and_never_gathers(monkeypatch):
    from moe_gemm.ops.fused_launch import GATHER_MAX_ROWS
    from moe_gemm.ops.heuristics import TRIM_A_ENV, trim_a_default

    monkeypatch.delenv(GATHER_WIDE_ENV, raising=False)
    monkeypatch.delenv(TRIM_A_ENV, raising=False)
    meta = torch.device("meta")
    cfg = GemmConfig(schedule="pingpong", tile_m=64, tile_n=256, cluster_m=2, cluster_n=1)
    small, gathered = fused_choice(_meta_args(4096, 8, 32, 4096, 7168, gate="silu"), cfg, 132,
                                   meta)
    assert gathered and not small.trim_a  # the kernel's gather loads A: nothing to trim
    big, gathered = fused_choice(_meta_args(4096, GATHER_MAX_ROWS, 32, 4096, 7168, gate="silu"),
                                 cfg, 132, meta)
    assert not gathered and big.trim_a == trim_a_default(big) is True
    monkeypatch.setenv(TRIM_A_ENV, "0")
    assert not fused_choice(_meta_args(4096, GATHER_MAX_ROWS, 32, 4096, 7168, gate="silu"),
                            cfg, 132, meta)[0].trim_a


@pytest.fixture
def fused_kernel(monkeypatch):
    """fused_grouped_mm (and its masked form) on the Hopper path with CPU tensors, a recorder
    as the compiled kernel."""
    from host_fakes import Recorder, clear_caches, install

    from moe_gemm.ops import fused as fused_mod
    from moe_gemm.ops import fused_launch, fused_masked

    rec = Recorder()
    clear_caches()
    install(monkeypatch, rec)
    monkeypatch.setattr(fused_launch, "sm_count", lambda device: 132)
    monkeypatch.setattr(fused_mod, "cute_problem", lambda device=None: None)
    monkeypatch.setattr(fused_masked, "cute_problem", lambda device=None: None)
    fused_mod._clear_plans()
    fused_masked._clear_plans()
    yield rec
    fused_mod._clear_plans()
    fused_masked._clear_plans()
    clear_caches()


def _strides_keep_the_rule(t: torch.Tensor, unit: int) -> bool:
    """The compiled kernels' rule for a tensor argument: unit stride on `unit`, every other
    stride (size-1 dims too: the call's argument check reads them all) a 16-byte multiple."""
    align = 16 // t.element_size()
    return t.stride(unit) == 1 and all(s % align == 0 for d, s in enumerate(t.stride())
                                       if d != unit)


@pytest.mark.parametrize("gather", [False, True], ids=["routed-rows", "row-index"])
def test_one_row_of_odd_k_reaches_the_kernel_with_aligned_strides(fused_kernel, gather):
    # One routed row of K = 20 (a decode step): x's row stride of 20 elements (40 bytes) on
    # its size-1 dim addresses nothing, but the compiled kernel's argument check refuses it;
    # likewise a (1, N) out cut from a wider buffer. The plan hands over aligned views.
    bf16 = torch.bfloat16
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 20, generator=g).to(bf16)
    # K-major (the concat gate's layout), its N stride 24 (padded storage)
    w = torch.randn(3, 16, 24, generator=g).to(bf16)[:, :, :20].transpose(1, 2)
    offs = torch.tensor([0, 1, 1], dtype=torch.int32)
    kw = {"row_index": torch.zeros(1, dtype=torch.int64)} if gather else {}
    wide = torch.full((1, 24), -7.0, dtype=bf16)
    for out in (None, wide[:, :8]):
        for _ in range(2):  # the first call and the cached plan's
            calls = len(fused_kernel.calls)
            y = moe_gemm.fused_grouped_mm(x, w, offs, gate="silu", out=out, **kw)
            assert len(fused_kernel.calls) == calls + 1
            xk, wk, yk = fused_kernel.calls[-1][:3]
            assert _strides_keep_the_rule(xk, 1), xk.stride()
            assert _strides_keep_the_rule(wk, 1), wk.stride()
            assert _strides_keep_the_rule(yk, 1), yk.stride()
            assert torch.equal(xk, x) and yk.data_ptr() == y.data_ptr() and yk.shape == y.shape
            if out is not None:
                assert y is out and bool((wide[:, 8:] == -7.0).all())


def test_k_zero_runs_no_kernel_and_keeps_bias_and_weights(fused_kernel):
    # K = 0: each routed row's product is an empty sum, so h = its expert's bias, times the
    # row's weight (gated where a gate is asked). No kernel launch (its TMA descriptors cannot
    # have an empty K extent), in the masked form too.
    g = torch.Generator().manual_seed(12)
    T, E, N = 7, 3, 16
    x = torch.empty(T, 0, dtype=torch.bfloat16)
    w = torch.empty(E, 0, 2 * N, dtype=torch.bfloat16)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    bias = torch.randn(E, 2 * N, generator=g)
    rw = torch.rand(T, generator=g)
    for gate in (None, "silu"):
        y = moe_gemm.fused_grouped_mm(x, w, offs, bias=bias, gate=gate, row_weight=rw)
        ref = fused_grouped_mm_ref(x.float(), w.float(), offs, bias=bias, gate=gate,
                                   row_weight=rw, dtype=torch.float64)
        assert y.shape == ref.shape and bool((ref[:2].abs() > 0).any())
        torch.testing.assert_close(y[:5].double(), ref[:5], atol=2e-2, rtol=2e-2)
        assert bool((y[5:] == 0).all())  # rows past offs[-1]: zeros in an output we allocate
    xm = torch.empty(E, 4, 0, dtype=torch.bfloat16)
    counts = torch.tensor([1, 0, 4], dtype=torch.int32)
    ym = moe_gemm.fused_grouped_mm_masked(xm, w, counts, bias=bias)
    for e, c in enumerate(counts.tolist()):
        for r in range(c):
            torch.testing.assert_close(ym[e, r].double(), bias[e].double(), atol=2e-2,
                                       rtol=2e-2)
    assert fused_kernel.calls == []


def test_clamped_silu_is_silu_of_the_clamped_halves():
    # Written out independently of the reference's gate_torch: silu(min(gate, L)) times up
    # clamped into [-L, L] (GLM-5-Next's, HY-V4's and DeepSeek-V4's experts gate).
    x, w, offs, _, g = _case(41)
    S = 13
    x = torch.randn(S, x.shape[1], generator=g) * 3
    y = moe_gemm.fused_grouped_mm(x, w, offs, gate="clamped_silu", gate_limit=0.75)
    end, I = int(offs[-1]), w.shape[2] // 2
    ids = torch.repeat_interleave(torch.arange(w.shape[0]), torch.diff(offs, prepend=offs[:1] * 0))
    h = torch.einsum("sk,skn->sn", x[:end].double(), w[ids].double())
    assert float(h.abs().max()) > 0.75  # the clamps are reached
    gate, up = h[:, :I].clamp(max=0.75), h[:, I:].clamp(-0.75, 0.75)
    want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(y[:end].double(), want, rtol=1e-5, atol=1e-5)
