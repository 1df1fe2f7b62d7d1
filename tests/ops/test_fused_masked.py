"""fused_grouped_mm_masked (the masked layout with fused_grouped_mm's bias, gated activation
and row weights) on the CPU.

x (G, M, K) @ w (G, K, N) on each problem's first masked_m[g] rows, then the bias, the gate
(N / 2 output columns) and the row weights: the valid rows against a float64 reference of one
problem at a time (fused_grouped_mm_ref on those rows only), zeros past the counts in a new
output, a given `out` keeping its values there (viewable as (G * M, N_out) or not); every
argument check; autograd of the torch backend; the torch.library registrations (opcheck,
torch.compile(fullgraph=True)); and the Hopper host path (ops/fused_masked.py,
ops/fused_launch.FusedPlan) with the compiled kernel replaced by an emulator that computes what
the varlen fused kernel with row counts computes from the arguments it is given.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from host_fakes import NSM, emulating
from torch.library import opcheck

import moe_gemm
from moe_gemm import GemmConfig, fused_grouped_mm_masked
from moe_gemm.ops import api, fused_masked, launch_info
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref
from moe_gemm.testing import assert_close_to_ref

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
I32 = torch.int32
TORCH = GemmConfig(backend="torch")
SENTINEL = -12345.0  # exactly representable in bf16, fp16 and fp32
NAN = float("nan")
OPS = torch.ops.moe_gemm
GATES = ["silu", "gelu", "gelu_tanh", "clamped_swiglu"]
LAYOUTS = ["concat", "interleaved", "alternating"]
GATE_CASES = [(None, "concat")] + [(g, lay) for g in GATES for lay in LAYOUTS]
GATE_IDS = [f"{g or 'plain'}-{lay}" for g, lay in GATE_CASES]
# The traced ops' backward raises by design (inference-only): the AOT test is left out where
# an input requires grad.
NO_AOT = ("test_schema", "test_autograd_registration", "test_faketensor")
# A clamp the test values reach (|h| ~ 1), so clamped_swiglu's limits are exercised.
LIMIT = 1.5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _counts(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def _inputs(G: int, M: int, K: int, N: int, dtype: torch.dtype = FP32, seed: int = 0,
            w_layout: str = "kn") -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random x (G, M, K) and w (G, K, N) (w_layout "nk_view": w_nk.transpose(1, 2),
    K-major, as the concat gate layout needs on the GPU)."""
    g = _gen(seed)
    x = torch.randn(G, M, K, generator=g).to(dtype)
    scale = 1.0 / max(K, 1) ** 0.5
    if w_layout == "kn":
        w = (torch.randn(G, K, N, generator=g) * scale).to(dtype)
    else:
        w = (torch.randn(G, N, K, generator=g) * scale).to(dtype).transpose(1, 2)
    return x, w


def _options(G: int, M: int, N: int, *, gate=None, layout="concat", bias=False, scale=False,
             seed: int = 0) -> dict:
    g = _gen(seed + 1000)
    kw: dict = {}
    if gate is not None:
        kw.update(gate=gate, gate_layout=layout)
        if gate == "clamped_swiglu":
            kw.update(gate_alpha=1.702, gate_limit=LIMIT)
    if bias:
        kw["bias"] = torch.randn(G, N, generator=g) * 0.5
    if scale:
        kw["row_weight"] = torch.rand(G, M, generator=g) + 0.25
    return kw


def ref64(x: torch.Tensor, w: torch.Tensor, counts, **kw) -> torch.Tensor:
    """float64 (G, M, N_out): each problem's valid rows by fused_grouped_mm_ref on those rows
    alone, zeros past the counts."""
    G, M = x.shape[0], x.shape[1]
    gate = kw.get("gate")
    n_out = w.shape[2] // 2 if gate else w.shape[2]
    y = torch.zeros(G, M, n_out, dtype=FP64)
    bias, rw = kw.get("bias"), kw.get("row_weight")
    for g, n in enumerate(counts):
        if not n:
            continue
        y[g, :n] = fused_grouped_mm_ref(
            x[g, :n], w[g:g + 1], _counts([n]),
            bias=None if bias is None else bias[g:g + 1], gate=gate,
            gate_layout=kw.get("gate_layout", "concat"),
            gate_alpha=kw.get("gate_alpha", 1.702), gate_limit=kw.get("gate_limit", 7.0),
            row_weight=None if rw is None else rw[g, :n], dtype=FP64)
    return y


def _valid(t: torch.Tensor, counts) -> torch.Tensor:
    """The valid rows of a (G, M, N) tensor, stacked: (sum(counts), N)."""
    return torch.cat([t.new_empty((0, t.shape[2]))] + [t[g, :c] for g, c in enumerate(counts)])


def _past(t: torch.Tensor, counts) -> torch.Tensor:
    """The rows at and past the counts, stacked."""
    return torch.cat([t.new_empty((0, t.shape[2]))] + [t[g, c:] for g, c in enumerate(counts)])


def check_valid(y: torch.Tensor, ref: torch.Tensor, counts, name: str = "y") -> None:
    """y's valid rows against the float64 reference: 1e-5 in fp32, the dtype table else."""
    assert y.shape == ref.shape, (y.shape, ref.shape)
    got, want = _valid(y, counts), _valid(ref, counts)
    if y.dtype == FP32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:
        assert_close_to_ref(got, want, name=name)


# --------------------------------------------------------------------------------------------
# Numerics (the torch backend)


@pytest.mark.parametrize(("gate", "layout"), GATE_CASES, ids=GATE_IDS)
@pytest.mark.parametrize(("bias", "scale"), list(itertools.product([False, True], repeat=2)),
                         ids=["none", "scale", "bias", "bias+scale"])
def test_gates_and_layouts_match_fp64(gate, layout, bias, scale) -> None:
    G, M, K, N = 5, 9, 24, 32  # N a multiple of 16 (the interleaved layout's blocks)
    seed = len(str((gate, layout, bias, scale)))
    x, w = _inputs(G, M, K, N, seed=seed)
    kw = _options(G, M, N, gate=gate, layout=layout, bias=bias, scale=scale, seed=seed)
    counts = [0, M, 3, 1, M - 1]  # an empty and a full problem in one call
    y = fused_grouped_mm_masked(x, w, _counts(counts), **kw)
    assert y.shape == (G, M, N // 2 if gate else N) and y.dtype == FP32
    check_valid(y, ref64(x, w, counts, **kw), counts)
    assert not _past(y, counts).any(), "rows past masked_m must be zero in a new output"


def test_gate_aliases() -> None:
    x, w = _inputs(3, 6, 16, 32, seed=1)
    mm = _counts([6, 0, 2])
    for alias, name in (("swish", "silu"), ("gelu_pytorch_tanh", "gelu_tanh")):
        assert torch.equal(fused_grouped_mm_masked(x, w, mm, gate=alias),
                           fused_grouped_mm_masked(x, w, mm, gate=name))


@pytest.mark.parametrize(("dtype", "out_dtype"),
                         [(BF16, None), (FP16, None), (BF16, FP32), (FP16, BF16), (FP32, FP16)])
def test_dtypes(dtype: torch.dtype, out_dtype: torch.dtype | None) -> None:
    G, M, K, N = 4, 12, 40, 48
    x, w = _inputs(G, M, K, N, dtype, seed=2)
    kw = _options(G, M, N, gate="silu", layout="alternating", bias=True, scale=True, seed=2)
    counts = [12, 0, 5, 1]
    y = fused_grouped_mm_masked(x, w, _counts(counts), out_dtype=out_dtype, **kw)
    assert y.dtype == (out_dtype or dtype) and y.shape == (G, M, N // 2)
    # (the reference from the same rounded operands: one rounding of the fp32 result)
    check_valid(y, ref64(x, w, counts, **kw), counts)
    assert not _past(y, counts).any()


def test_counts_zero_and_full_in_one_call() -> None:
    G, M, K, N = 6, 11, 20, 32
    x, w = _inputs(G, M, K, N, seed=3)
    kw = _options(G, M, N, gate="gelu", layout="interleaved", bias=True, scale=True, seed=3)
    counts = [0, M, 0, M, M, 0]
    y = fused_grouped_mm_masked(x, w, _counts(counts), **kw)
    check_valid(y, ref64(x, w, counts, **kw), counts)
    assert not y[[0, 2, 5]].any()
    # The full problems equal fused_grouped_mm over the same rows.
    full = [1, 3, 4]
    xs = x[full].reshape(len(full) * M, K)
    offs = torch.arange(1, len(full) + 1, dtype=I32) * M
    flat = moe_gemm.fused_grouped_mm(
        xs, w[full], offs, bias=kw["bias"][full], gate="gelu", gate_layout="interleaved",
        row_weight=kw["row_weight"][full].reshape(-1), config=TORCH)
    torch.testing.assert_close(y[full].reshape(-1, N // 2), flat, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_dtype", [FP32, BF16])
def test_out_keeps_its_rows_past_the_counts(out_dtype: torch.dtype) -> None:
    G, M, K, N = 4, 10, 16, 32
    x, w = _inputs(G, M, K, N, seed=4)
    kw = _options(G, M, N, gate="clamped_swiglu", layout="concat", bias=True, scale=True, seed=4)
    counts = [10, 0, 4, 1]
    out = torch.full((G, M, N // 2), SENTINEL, dtype=out_dtype)
    ptr = out.data_ptr()
    y = fused_grouped_mm_masked(x, w, _counts(counts), out=out, **kw)
    assert y is out and out.data_ptr() == ptr
    check_valid(out, ref64(x, w, counts, **kw), counts)
    assert (_past(out, counts) == SENTINEL).all(), "rows past masked_m were written"


def test_out_column_slice_of_a_wider_tensor() -> None:
    """A column slice (viewable as (G * M, N_out) with a longer row stride): only its valid
    elements are written."""
    G, M, K, N = 3, 7, 16, 32
    x, w = _inputs(G, M, K, N, seed=5)
    kw = _options(G, M, N, gate="silu", layout="alternating", bias=True, scale=True, seed=5)
    counts = [2, 7, 0]
    buf = torch.full((G, M, 40), SENTINEL)
    out = buf[:, :, 8:24]
    assert fused_grouped_mm_masked(x, w, _counts(counts), out=out, **kw) is out
    check_valid(out, ref64(x, w, counts, **kw), counts)
    written = torch.zeros(G, M, 40, dtype=torch.bool)
    for g, c in enumerate(counts):
        written[g, :c, 8:24] = True
    assert (buf[~written] == SENTINEL).all()


def test_out_not_viewable_as_rows() -> None:
    """out whose problems are not one row stride apart (rows of a taller buffer): the result is
    copied in on the valid rows; rows past the counts and the buffer's margin are kept."""
    G, M, K, N = 4, 6, 16, 32
    x, w = _inputs(G, M, K, N, seed=6)
    kw = _options(G, M, N, gate="gelu_tanh", layout="interleaved", bias=True, scale=True, seed=6)
    counts = [6, 1, 0, 3]
    buf = torch.full((G, M + 2, N // 2), SENTINEL)
    out = buf[:, 1:M + 1]
    with pytest.raises(RuntimeError):
        out.view(G * M, N // 2)
    assert fused_grouped_mm_masked(x, w, _counts(counts), out=out, **kw) is out
    check_valid(out, ref64(x, w, counts, **kw), counts)
    assert (_past(out, counts) == SENTINEL).all()
    assert (buf[:, 0] == SENTINEL).all() and (buf[:, M + 1] == SENTINEL).all()


@pytest.mark.parametrize("target", ["x", "w", "bias", "row_weight"])
def test_out_overlapping_an_input_is_computed_as_if_cloned(target: str) -> None:
    # As grouped_mm does: the result of the same call on cloned inputs, written into out
    # (its rows past the counts keep their values).
    G, M, K, N = 3, 8, 16, 16
    x, w = _inputs(G, M, K, N, seed=7)
    bias = torch.randn(G, M * N)  # (wide enough to hold an out; used as bias where (G, N))
    rw = torch.rand(G, M * N)
    out = {"x": x, "w": w.reshape(G, K * N)[:, :M * N].reshape(G, M, N),
           "bias": bias.view(G, M, N), "row_weight": rw.view(G, M, N)}[target]
    kw = dict(bias=bias[:, :N] if target == "bias" else None,
              row_weight=rw[:, :M] if target == "row_weight" else None)
    counts = _counts([8, 0, 3])
    want = fused_grouped_mm_masked(
        x.clone(), w.clone(), counts, out=out.clone(),
        **{k: None if v is None else v.clone() for k, v in kw.items()})
    got = fused_grouped_mm_masked(x, w, counts, out=out, **kw)
    assert got is out
    assert torch.equal(out, want)


@pytest.mark.parametrize(("G", "M", "N"), [(0, 4, 32), (3, 0, 32), (3, 4, 0), (0, 0, 0)])
@pytest.mark.parametrize("gate", [None, "silu"])
def test_empty_dims(G: int, M: int, N: int, gate: str | None) -> None:
    K = 16
    x, w = _inputs(G, M, K, N, BF16, seed=8)
    kw = _options(G, M, N, gate=gate, bias=True, scale=True, seed=8)
    mm = _counts([min(M, 2)] * G)
    n_out = N // 2 if gate else N
    for out_dtype in (None, FP32):
        y = fused_grouped_mm_masked(x, w, mm, out_dtype=out_dtype, **kw)
        assert tuple(y.shape) == (G, M, n_out) and y.numel() == 0
        assert y.dtype == (out_dtype or BF16)
    out = torch.empty(G, M, n_out, dtype=BF16)
    assert fused_grouped_mm_masked(x, w, mm, out=out, **kw) is out


def test_k_zero_valid_rows_are_the_epilogue_of_zeros() -> None:
    G, M, N = 3, 4, 32
    x, w = _inputs(G, M, 0, N, seed=9)
    kw = _options(G, M, N, gate="silu", layout="concat", bias=True, scale=True, seed=9)
    counts = [4, 1, 0]
    y = fused_grouped_mm_masked(x, w, _counts(counts), **kw)
    check_valid(y, ref64(x, w, counts, **kw), counts)
    assert not _past(y, counts).any()


def test_masked_m_strided_view_and_expected_m_hint() -> None:
    G, M, K, N = 4, 8, 16, 32
    x, w = _inputs(G, M, K, N, seed=10)
    kw = _options(G, M, N, gate="silu", bias=True, seed=10)
    base = _counts([3, 99, 8, 99, 0, 99, 5, 99])
    counts = [3, 8, 0, 5]
    y = fused_grouped_mm_masked(x, w, base[::2], **kw)
    check_valid(y, ref64(x, w, counts, **kw), counts)
    for expected_m in (1, 4, 1000):
        assert torch.equal(fused_grouped_mm_masked(x, w, base[::2], expected_m=expected_m, **kw),
                           y)


def test_nan_rows_past_the_counts_do_not_reach_the_valid_rows() -> None:
    G, M, K, N = 3, 6, 16, 32
    x, w = _inputs(G, M, K, N, seed=11)
    kw = _options(G, M, N, gate="silu", layout="interleaved", bias=True, scale=True, seed=11)
    counts = [2, 6, 0]
    clean = x.clone()
    x[0, 2:] = NAN
    x[2] = float("inf")
    y = fused_grouped_mm_masked(x, w, _counts(counts), **kw)
    check_valid(y, ref64(clean, w, counts, **kw), counts)
    assert not _past(y, counts).any()


def test_does_not_modify_inputs() -> None:
    G, M, K, N = 3, 8, 16, 32
    x, w = _inputs(G, M, K, N, BF16, seed=12, w_layout="nk_view")
    kw = _options(G, M, N, gate="silu", bias=True, scale=True, seed=12)
    mm = _counts([1, 8, 0])
    before = [t.clone() for t in (x, w, mm, kw["bias"], kw["row_weight"])]
    fused_grouped_mm_masked(x, w, mm, out_dtype=FP32, **kw)
    for t, b in zip((x, w, mm, kw["bias"], kw["row_weight"]), before):
        assert torch.equal(t, b)


def test_public_name() -> None:
    assert "fused_grouped_mm_masked" in moe_gemm.__all__
    assert moe_gemm.fused_grouped_mm_masked is fused_masked.fused_grouped_mm_masked


# --------------------------------------------------------------------------------------------
# Errors


def _err_args(dtype: torch.dtype = FP32) -> dict:
    x, w = _inputs(3, 5, 8, 32, dtype, seed=20)
    return dict(x=x, w=w, masked_m=_counts([0, 5, 2]))


def _call(a: dict):
    a = dict(a)
    return fused_grouped_mm_masked(a.pop("x"), a.pop("w"), a.pop("masked_m"), **a)


ERRORS = [
    # ranks, G and K
    ("x-2d", lambda a: a.update(x=a["x"][0]), ValueError,
     r"x must be 3-D \(G, M, K\): M rows of capacity per problem; got shape \(5, 8\)"),
    ("x-4d", lambda a: a.update(x=a["x"][None]), ValueError, r"x must be 3-D \(G, M, K\)"),
    ("w-2d", lambda a: a.update(w=a["w"][0]), ValueError,
     r"w must be 3-D \(G, K, N\) \(for a \(G, N, K\) weight pass w\.transpose\(1, 2\)\)"),
    ("w-4d", lambda a: a.update(w=a["w"][None]), ValueError, r"w must be 3-D \(G, K, N\)"),
    ("w-G", lambda a: a.update(w=a["w"][:2]), ValueError,
     r"x is \(G, M, K\) = \(3, 5, 8\), so w must be \(3, 8, N\); got \(2, 8, 32\)"),
    ("w-K", lambda a: a.update(w=torch.randn(3, 7, 32)), ValueError,
     r"so w must be \(3, 8, N\); got \(3, 7, 32\)"),
    ("x-list", lambda a: a.update(x=[[1.0]]), TypeError, r"x must be a torch\.Tensor"),
    ("w-list", lambda a: a.update(w=[[1.0]]), TypeError, r"w must be a torch\.Tensor"),
    ("w-dtype", lambda a: a.update(w=a["w"].to(BF16)), TypeError,
     r"w has dtype torch\.bfloat16 but x has torch\.float32"),
    ("x-fp64", lambda a: a.update(x=a["x"].double(), w=a["w"].double()), TypeError,
     r"x must be torch\.bfloat16, torch\.float16 or torch\.float32; got torch\.float64"),
    # masked_m
    ("mm-list", lambda a: a.update(masked_m=[0, 5, 2]), TypeError,
     r"masked_m must be a torch\.Tensor \(3,\) of int32 row counts; got list"),
    ("mm-int64", lambda a: a.update(masked_m=a["masked_m"].long()), TypeError,
     r"masked_m must be int32 row counts \(3,\); got dtype torch\.int64"),
    ("mm-float", lambda a: a.update(masked_m=a["masked_m"].float()), TypeError,
     r"masked_m must be int32"),
    ("mm-short", lambda a: a.update(masked_m=a["masked_m"][:2]), ValueError,
     r"masked_m must have one row count per problem: \(3,\); got"),
    ("mm-2d", lambda a: a.update(masked_m=a["masked_m"][None]), ValueError,
     r"masked_m must have one row count per problem"),
    ("mm-meta", lambda a: a.update(masked_m=a["masked_m"].to("meta")), ValueError,
     r"masked_m is on meta but x is on cpu; it must live with x"),
    ("mm-negative", lambda a: a.update(masked_m=_counts([0, -1, 2])), ValueError,
     r"masked_m values must be in \[0, M\] = \[0, 5\] \(valid rows of each problem\); got "
     r"masked_m\[1\]=-1$"),
    ("mm-past-M", lambda a: a.update(masked_m=_counts([0, 5, 6])), ValueError,
     r"masked_m values must be in \[0, M\] = \[0, 5\].*masked_m\[2\]=6$"),
    ("mm-int-max", lambda a: a.update(masked_m=_counts([2**31 - 1, 0, 0])), ValueError,
     r"masked_m\[0\]=2147483647"),
    # row_weight
    ("rw-flat", lambda a: a.update(row_weight=torch.rand(15)), ValueError,
     r"row_weight must be \(G, M\) = \(3, 5\): one weight per row; got \(15,\)"),
    ("rw-3d", lambda a: a.update(row_weight=torch.rand(3, 5, 1)), ValueError,
     r"row_weight must be \(G, M\) = \(3, 5\)"),
    ("rw-list", lambda a: a.update(row_weight=[1.0]), TypeError,
     r"row_weight must be a torch\.Tensor \(3, 5\) or None; got list"),
    ("rw-int", lambda a: a.update(row_weight=torch.ones(3, 5, dtype=I32)), TypeError,
     r"row_weight must be a float tensor"),
    # bias
    # (the op's vocabulary, G groups: the flattened check named them E, as grouped_mm's)
    ("bias-N", lambda a: a.update(bias=torch.randn(3, 31)), ValueError,
     r"^bias must be \(G, N\) = \(3, 32\), in w's column order; got \(3, 31\)$"),
    ("bias-G", lambda a: a.update(bias=torch.randn(2, 32)), ValueError,
     r"^bias must be \(G, N\) = \(3, 32\)"),
    ("bias-gated-N/2", lambda a: a.update(bias=torch.randn(3, 16), gate="silu"), ValueError,
     r"^bias must be \(G, N\) = \(3, 32\)"),
    ("bias-list", lambda a: a.update(bias=[1.0]), TypeError,
     r"^bias must be a torch\.Tensor \(G, N\) or None; got list$"),
    ("bias-int", lambda a: a.update(bias=torch.ones(3, 32, dtype=I32)), TypeError,
     r"^bias must be a float tensor; got torch\.int32$"),
    ("bias-nested", lambda a: a.update(bias=torch.nested.nested_tensor([torch.ones(32)] * 3)),
     TypeError, r"^bias must be a dense"),
    # gate, layout, alpha and limit
    ("gate-unknown", lambda a: a.update(gate="relu"), ValueError,
     r"gate must be one of 'silu', 'gelu', 'gelu_tanh', 'clamped_swiglu', 'clamped_silu' or None; got 'relu'"),
    ("gate-int", lambda a: a.update(gate=3), TypeError, r"gate must be a str or None; got int"),
    ("layout-unknown", lambda a: a.update(gate="silu", gate_layout="blocked"), ValueError,
     r"gate_layout must be one of \('concat', 'interleaved', 'alternating'\); got 'blocked'"),
    ("odd-N", lambda a: a.update(w=a["w"][:, :, :31], gate="silu"), ValueError,
     r"a gated w holds gate and up columns: N must be even; got \(3, 8, 31\)"),
    ("interleaved-N", lambda a: a.update(w=a["w"][:, :, :24], gate="silu",
                                         gate_layout="interleaved"), ValueError,
     r"the interleaved gate layout alternates blocks of 8 gate and up columns: N must be a "
     r"multiple of 16"),
    ("alpha-nan", lambda a: a.update(gate="clamped_swiglu", gate_alpha=NAN), ValueError,
     r"gate_alpha must be finite"),
    ("alpha-str", lambda a: a.update(gate_alpha="1.7"), TypeError, r"gate_alpha must be a float"),
    ("alpha-past-float", lambda a: a.update(gate_alpha=10 ** 400), ValueError,
     r"gate_alpha must be finite; got an int past float's range"),
    ("limit-zero", lambda a: a.update(gate="clamped_swiglu", gate_limit=0.0), ValueError,
     r"gate_limit must be > 0 for clamped_swiglu"),
    # expected_m
    ("expected-float", lambda a: a.update(expected_m=1.5), TypeError,
     r"expected_m must be an int \(typical valid rows per problem\) or None; got float"),
    ("expected-bool", lambda a: a.update(expected_m=True), TypeError,
     r"expected_m must be an int .*; got bool"),
    ("expected-tensor", lambda a: a.update(expected_m=torch.tensor(3)), TypeError,
     r"expected_m must be an int .*; got Tensor"),
    ("expected-zero", lambda a: a.update(expected_m=0), ValueError,
     r"expected_m must be >= 1 \(typical valid rows per problem\); got 0$"),
    ("expected-negative", lambda a: a.update(expected_m=-4), ValueError,
     r"expected_m must be >= 1 .*; got -4$"),
    # out
    ("out-G", lambda a: a.update(out=torch.empty(4, 5, 32)), ValueError,
     r"out must be \(G, M, N\) = \(3, 5, 32\); got \(4, 5, 32\)"),
    ("out-2d", lambda a: a.update(out=torch.empty(15, 32)), ValueError,
     r"out must be \(G, M, N\) = \(3, 5, 32\); got \(15, 32\)"),
    ("out-N", lambda a: a.update(out=torch.empty(3, 5, 31)), ValueError,
     r"out must be \(G, M, N\) = \(3, 5, 32\); got \(3, 5, 31\)"),
    ("out-ungated-N/2", lambda a: a.update(out=torch.empty(3, 5, 16)), ValueError,
     r"out must be"),
    ("out-gated-N", lambda a: a.update(out=torch.empty(3, 5, 32), gate="silu"), ValueError,
     r"out must be"),
    ("out-dtype", lambda a: a.update(out=torch.empty(3, 5, 32, dtype=BF16), out_dtype=FP32),
     TypeError, r"out must have dtype torch\.float32; got torch\.bfloat16"),
    ("out-fp64", lambda a: a.update(out=torch.empty(3, 5, 32, dtype=FP64)), TypeError,
     r"out must be torch\.bfloat16, torch\.float16 or torch\.float32; got torch\.float64"),
    ("out-requires-grad", lambda a: a.update(out=torch.zeros(3, 5, 32, requires_grad=True)),
     ValueError, r"out requires grad"),
    ("out_dtype-int", lambda a: a.update(out_dtype=I32), TypeError, r"out_dtype must be"),
    # config
    ("config-str", lambda a: a.update(config="torch"), TypeError,
     r"config must be a moe_gemm\.GemmConfig or None; got str"),
    ("config-tail-split", lambda a: a.update(config=GemmConfig(tail_split=True)), ValueError,
     r"the masked form has no tail split"),
    ("config-tail-split-torch", lambda a: a.update(config=GemmConfig(backend="torch",
                                                                     tail_split=True)),
     ValueError, r"the masked form has no tail split"),
    ("config-cute", lambda a: a.update(config=GemmConfig(backend="cute")), RuntimeError,
     r"backend='cute' cannot run here: tensors are on cpu"),
]


@pytest.mark.parametrize(("change", "error", "match"), [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_argument_errors(change, error, match) -> None:
    a = _err_args()
    change(a)
    with pytest.raises(error, match=match):
        _call(a)


def test_a_gate_constant_past_floats_range_is_refused_when_traced() -> None:
    # (the traced wrapper's float() raised OverflowError)
    from moe_gemm.ops import masked_custom_ops

    a = _err_args()
    with pytest.raises(ValueError, match=r"gate_limit must be finite; got an int past"):
        masked_custom_ops.fused_grouped_mm_masked(a["x"], a["w"], a["masked_m"],
                                                  gate="clamped_swiglu", gate_limit=10 ** 400)


@pytest.mark.parametrize("gate", ["relu", "", 3])
def test_a_bad_gate_is_named_before_outs_shape(gate) -> None:
    # An out of w's N columns fits the ungated call: a gate that is no gate must be named as
    # such, not reported as an out that should have N / 2 columns.
    a = _err_args()
    G, M, N = a["x"].shape[0], a["x"].shape[1], a["w"].shape[2]
    error = TypeError if isinstance(gate, int) else ValueError
    with pytest.raises(error, match="gate must be"):
        fused_grouped_mm_masked(a["x"], a["w"], a["masked_m"], gate=gate,
                                out=torch.zeros(G, M, N))


def test_refused_counts_leave_out_untouched() -> None:
    a = _err_args()
    out = torch.full((3, 5, 32), SENTINEL)
    with pytest.raises(ValueError, match=r"masked_m\[1\]=9"):
        fused_grouped_mm_masked(a["x"], a["w"], _counts([0, 9, 0]), out=out)
    assert (out == SENTINEL).all()
    # the arguments are checked before the backend is chosen
    with pytest.raises(ValueError, match=r"masked_m\[1\]=9"):
        fused_grouped_mm_masked(a["x"], a["w"], _counts([0, 9, 0]),
                                config=GemmConfig(backend="cute"))


def test_out_not_a_tensor_is_a_type_error() -> None:
    a = _err_args()
    with pytest.raises(TypeError, match=r"out must be a torch\.Tensor"):
        _call({**a, "out": [[0.0]]})


def test_expanded_out_is_a_value_error() -> None:
    a = _err_args()
    out = torch.zeros(1, 5, 32).expand(3, 5, 32)
    with pytest.raises(ValueError, match=r"out has elements that share memory"):
        _call({**a, "out": out})


# --------------------------------------------------------------------------------------------
# Autograd (the torch backend is differentiable)


def _grad_reference(x, w, counts, r, **kw):
    """float64 autograd through ref64's per-problem reference: gradients of sum(y * r) over
    the valid rows for x, w, bias and row_weight (None where not given)."""
    leaves = {"x": x.detach().double().requires_grad_(), "w": w.detach().double().requires_grad_()}
    for name in ("bias", "row_weight"):
        if kw.get(name) is not None:
            leaves[name] = kw[name].detach().double().requires_grad_()
    kw64 = {**kw, **{k: v for k, v in leaves.items() if k in ("bias", "row_weight")}}
    y = ref64(leaves["x"], leaves["w"], counts, **kw64)
    (_valid(y, counts) * _valid(r.double(), counts)).sum().backward()
    return {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize(("gate", "layout"),
                         [(None, "concat"), ("silu", "concat"), ("gelu", "interleaved"),
                          ("clamped_swiglu", "alternating"), ("gelu_tanh", "alternating")])
def test_autograd_matches_fp64(gate, layout) -> None:
    G, M, K, N = 4, 7, 12, 32
    x, w = _inputs(G, M, K, N, seed=30)
    kw = _options(G, M, N, gate=gate, layout=layout, bias=True, scale=True, seed=30)
    counts = [0, 7, 3, 1]
    leaves = {"x": x.clone().requires_grad_(), "w": w.clone().requires_grad_(),
              "bias": kw["bias"].clone().requires_grad_(),
              "row_weight": kw["row_weight"].clone().requires_grad_()}
    opts = {k: v for k, v in kw.items() if k not in ("bias", "row_weight")}
    y = fused_grouped_mm_masked(leaves["x"], leaves["w"], _counts(counts),
                                bias=leaves["bias"], row_weight=leaves["row_weight"], **opts)
    r = torch.randn(y.shape, generator=_gen(31))
    (y * r).sum().backward()
    want = _grad_reference(x, w, counts, r, **kw)
    for name, t in leaves.items():
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert torch.isfinite(t.grad).all(), name
        torch.testing.assert_close(t.grad.double(), want[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert not _past(leaves["x"].grad, counts).any(), "rows past masked_m got a gradient"
    assert not _past(leaves["row_weight"].grad[..., None], counts).any()


def test_autograd_bf16_dtypes() -> None:
    G, M, K, N = 3, 6, 16, 32
    x, w = _inputs(G, M, K, N, BF16, seed=32)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fused_grouped_mm_masked(xg, wg, _counts([6, 0, 2]), gate="silu", out_dtype=FP32)
    y.sum().backward()
    assert xg.grad.dtype == BF16 and wg.grad.dtype == BF16
    assert torch.isfinite(wg.grad).all() and not xg.grad[1].any() and not xg.grad[2, 2:].any()


def test_autograd_w_ignores_what_the_rows_past_the_counts_hold() -> None:
    G, M, K, N = 3, 5, 8, 32
    x, w = _inputs(G, M, K, N, seed=33)
    kw = _options(G, M, N, gate="silu", layout="alternating", bias=True, scale=True, seed=33)
    counts = [2, 5, 0]
    clean = x.clone()
    x[0, 2:] = NAN
    x[2] = float("inf")
    grads = []
    for xs in (x, clean):
        wg = w.clone().requires_grad_()
        bg = kw["bias"].clone().requires_grad_()
        fused_grouped_mm_masked(xs, wg, _counts(counts), bias=bg, gate="silu",
                                gate_layout="alternating", row_weight=kw["row_weight"]
                                ).sum().backward()
        grads.append((wg.grad, bg.grad))
    for got, want in zip(grads[0], grads[1]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_autograd_w_ignores_row_weights_past_the_counts() -> None:
    G, M, K, N = 3, 5, 8, 32
    x, w = _inputs(G, M, K, N, seed=34)
    counts = [2, 5, 0]
    rw = torch.rand(G, M)
    rw[0, 2:] = NAN
    rw[2] = NAN
    wg = w.clone().requires_grad_()
    y = fused_grouped_mm_masked(x, wg, _counts(counts), gate="silu", row_weight=rw)
    assert torch.isfinite(y).all()
    y.sum().backward()
    assert torch.isfinite(wg.grad).all(), "NaN row weights past masked_m reached w's gradient"


# --------------------------------------------------------------------------------------------
# torch.library registrations: opcheck and torch.compile


def _op_args(dtype: torch.dtype = FP32, seed: int = 40):
    x, w = _inputs(3, 5, 16, 32, dtype, seed=seed)
    kw = _options(3, 5, 32, bias=True, scale=True, seed=seed)
    return x, w, _counts([0, 5, 2]), kw["bias"], kw["row_weight"]


def test_opcheck_fused_grouped_mm_masked() -> None:
    x, w, mm, bias, rw = _op_args()
    op, op_out = OPS._fused_grouped_mm_masked.default, OPS._fused_grouped_mm_masked_out.default
    opcheck(op, (x, w, mm, bias, rw, "silu", "concat", 1.702, 7.0, None, "", None))
    xb, wb = x.to(BF16), w.to(BF16)
    opcheck(op, (xb, wb, mm, bias, None, "clamped_swiglu", "alternating", 1.5, 2.0, None,
                 "{'backend': 'torch'}", FP32))
    out = torch.full((3, 5, 16), 7.0, dtype=BF16)
    opcheck(op_out, (xb, wb, mm, bias, rw, "gelu", "interleaved", 1.702, 7.0, None, out, "",
                     None))
    opcheck(op, (x.clone().requires_grad_(), w.clone().requires_grad_(), mm,
                 bias.clone().requires_grad_(), rw.clone().requires_grad_(), "silu",
                 "concat", 1.702, 7.0, None, "", None), test_utils=NO_AOT)


def test_traced_backward_is_inference_only() -> None:
    x, w, mm, bias, rw = _op_args()
    wg = w.clone().requires_grad_()
    y = OPS._fused_grouped_mm_masked(x, wg, mm, bias, rw, "silu", "concat", 1.702, 7.0, None,
                                     "", None)
    with pytest.raises(RuntimeError, match="_fused_grouped_mm_masked"):
        y.sum().backward()


@pytest.fixture
def dynamo():
    """A fresh torch._dynamo with its counters cleared."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_compile_fullgraph_equals_eager(dynamo) -> None:
    G, M, K, N = 4, 9, 16, 32
    x, w = _inputs(G, M, K, N, BF16, seed=42, w_layout="nk_view")
    kw = _options(G, M, N, bias=True, scale=True, seed=42)
    bias, rw = kw["bias"], kw["row_weight"]
    counts = [9, 0, 4, 1]
    mm = _counts(counts)

    def f(x, w, mm, bias, rw, out):
        y = fused_grouped_mm_masked(x, w, mm, bias=bias, gate="silu", row_weight=rw,
                                    expected_m=2)
        fused_grouped_mm_masked(x, w, mm, bias=bias, gate="clamped_swiglu",
                                gate_layout="alternating", gate_limit=LIMIT, row_weight=rw,
                                out=out, config=TORCH)  # the mutating op
        return y * 2, fused_grouped_mm_masked(x, w, mm, out_dtype=FP32)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)
    out_c = torch.full((G, M, N // 2), SENTINEL, dtype=BF16)
    out_e = out_c.clone()
    got, want = compiled(x, w, mm, bias, rw, out_c), f(x, w, mm, bias, rw, out_e)
    for g, r in zip((*got, out_c), (*want, out_e)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    assert (_past(out_c, counts) == SENTINEL).all()
    check_valid(got[1], ref64(x, w, counts), counts)
    assert dynamo["graph_break"] == {}
    # New counts, same shapes: no recompile, new rows.
    counts2 = [1, 9, 0, 5]
    mm2 = _counts(counts2)
    got2 = compiled(x, w, mm2, bias, rw, out_c)
    torch.testing.assert_close(got2[1], f(x, w, mm2, bias, rw, out_e)[1], rtol=0, atol=0)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    check_valid(got2[1], ref64(x, w, counts2), counts2)
    assert dynamo["stats"]["unique_graphs"] == 1


# --------------------------------------------------------------------------------------------
# The Hopper host path, the compiled kernel emulated


class FusedCountsKernelEmulator:
    """Takes exactly the arguments FusedPlan passes the compiled varlen fused kernel with
    row_counts and computes what it computes from them: x (T, K) and out (T, N_out) hold
    E = len(offs) problems of T / E rows each; expert p's rows start at p * T / E, the first
    clamp(offs[p], 0, T / E) of them valid: x's rows @ w[p] (+ bias[p]), the gate and the row
    weights (float64, rounded once); nothing else written. A new output's other rows (one the
    plan allocated: not a view) are filled with NaN, as unspecified as the kernel leaves them."""

    def __init__(self, key) -> None:
        self.key = key
        self.calls: list[dict] = []

    def __call__(self, x, w, out, meta, meta32, offs, table, workspace, trace, num_problems,
                 num_ctas, swizzle, a_policy, b_policy, pdl, d_base, *fused):
        key = self.key
        self.calls.append(dict(x=x, w=w, out=out, offs=offs, num_problems=num_problems,
                               num_ctas=num_ctas, fused=fused))
        assert key.form == "varlen" and key.row_counts and not key.gather
        assert key.visitor == "device" and not key.tail_split
        assert len(fused) == (3 if key.fused else 0)
        assert offs.dtype == I32 and offs.dim() == 1 and offs.is_contiguous()
        E = offs.shape[0]
        assert num_problems == E == w.shape[0], "no zero tail with row counts"
        assert 1 <= num_ctas <= NSM
        assert x.dim() == 2 and out.dim() == 2 and x.shape[0] == out.shape[0]
        assert x.stride(1) == 1 and out.stride(1) == 1
        assert (w.stride(1) == 1) == (key.b_major == "k")
        for name, t in (("x", x), ("w", w), ("out", out)):
            assert t.data_ptr() % 16 == 0, f"{name}'s pointer is not 16-byte aligned (TMA)"
        weight = bias = None
        if fused:
            index, weight, bias = fused
            assert index.dtype == I32
            if key.row_scale:
                assert weight.dtype == FP32 and weight.shape == (x.shape[0],)
            if key.bias:
                assert bias.dtype == FP32 and bias.shape == (E, w.shape[2])
        cap = out.shape[0] // E
        clamped = key.gate == "clamped_swiglu"
        fresh = out._base is None
        for p in range(E):
            start = p * cap
            rows = max(0, min(int(offs[p]), cap))
            if fresh:
                out[start + rows:start + cap] = NAN
            if not rows:
                continue
            y = fused_grouped_mm_ref(
                x[start:start + rows], w[p:p + 1], _counts([rows]),
                bias=bias[p:p + 1] if key.bias else None, gate=key.gate or None,
                gate_layout=key.gate_layout or "concat",
                gate_alpha=key.gate_alpha if clamped else 1.702,
                gate_limit=key.gate_limit if clamped else 7.0,
                row_weight=weight[start:start + rows] if key.row_scale else None, dtype=FP64)
            out[start:start + rows] = y.to(out.dtype)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> list[FusedCountsKernelEmulator]:
    """fused_grouped_mm_masked on the Hopper path with CPU tensors: each compile makes an
    emulator."""
    yield from emulating(monkeypatch, FusedCountsKernelEmulator, fused_masked)


def _w_layout(gate, layout) -> str:
    return "nk_view" if gate is not None and layout == "concat" else "kn"


@pytest.mark.parametrize(("gate", "layout"), GATE_CASES, ids=GATE_IDS)
def test_host_path_gates_and_layouts(emulated, gate, layout) -> None:
    G, M, K, N = 5, 40, 32, 64
    x, w = _inputs(G, M, K, N, BF16, seed=60, w_layout=_w_layout(gate, layout))
    kw = _options(G, M, N, gate=gate, layout=layout, bias=True, scale=True, seed=60)
    counts = [0, 1, 40, 17, 39]
    mm = _counts(counts)
    y = fused_grouped_mm_masked(x, w, mm, **kw)
    assert len(emulated) == 1 and len(emulated[0].calls) == 1
    key, call = emulated[0].key, emulated[0].calls[0]
    assert key.row_counts and not key.gather and not key.tail_split and key.visitor == "device"
    assert (key.gate, key.gate_layout) == ((gate, layout) if gate else ("", ""))
    assert key.bias and key.row_scale
    if gate == "clamped_swiglu":
        assert (key.gate_alpha, key.gate_limit) == (1.702, LIMIT)
    assert call["offs"] is mm, "masked_m must reach the kernel as its offs"
    assert call["x"].shape == (G * M, K) and call["x"].data_ptr() == x.data_ptr()
    assert y.shape == (G, M, N // 2 if gate else N) and y.dtype == BF16
    ref = ref64(x, w, counts, **kw)
    check_valid(y, ref, counts)  # rows past the counts: unspecified (NaN here)
    out = torch.full(y.shape, SENTINEL, dtype=BF16)
    assert fused_grouped_mm_masked(x, w, mm, out=out, **kw) is out
    assert emulated[-1].calls[-1]["out"].data_ptr() == out.data_ptr(), "written in place"
    check_valid(out, ref, counts)
    assert (_past(out, counts) == SENTINEL).all()


def test_host_path_concat_needs_k_major_w(emulated, monkeypatch) -> None:
    """A row-major w with the concat layout: the kernel cannot take it, the torch backend runs
    (or, forced, a ValueError naming the fix)."""
    x, w = _inputs(3, 16, 32, 64, BF16, seed=61)
    mm = _counts([16, 0, 5])
    monkeypatch.setattr(api, "_warned", set())  # (the warning is given once per process)
    with pytest.warns(RuntimeWarning, match=r"concat gate layout needs a K-major w"):
        y = fused_grouped_mm_masked(x, w, mm, gate="silu")
    assert emulated == []
    check_valid(y, ref64(x, w, [16, 0, 5], gate="silu"), [16, 0, 5])
    with pytest.raises(ValueError, match=r"concat gate layout needs a K-major w"):
        fused_grouped_mm_masked(x, w, mm, gate="silu", config=GemmConfig(backend="cute"))


def test_host_path_non_viewable_out_is_filled_after_the_launch(emulated) -> None:
    G, M, K, N = 4, 24, 32, 64
    x, w = _inputs(G, M, K, N, BF16, seed=62, w_layout="nk_view")
    kw = _options(G, M, N, gate="silu", bias=True, scale=True, seed=62)
    counts = [24, 0, 7, 1]
    buf = torch.full((G, M + 2, N // 2), SENTINEL, dtype=BF16)
    out = buf[:, 1:M + 1]
    assert fused_grouped_mm_masked(x, w, _counts(counts), out=out, **kw) is out
    launched = emulated[-1].calls[-1]["out"]
    assert launched.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    check_valid(out, ref64(x, w, counts, **kw), counts)
    assert (_past(out, counts) == SENTINEL).all(), "only the valid rows may be copied in"
    assert (buf[:, 0] == SENTINEL).all() and (buf[:, M + 1] == SENTINEL).all()
    # The cached plan does the same.
    counts = [3, 24, 0, 2]
    buf.fill_(SENTINEL)
    fused_grouped_mm_masked(x, w, _counts(counts), out=out, **kw)
    assert len(emulated) == 1 and len(emulated[0].calls) == 2
    check_valid(out, ref64(x, w, counts, **kw), counts)
    assert (_past(out, counts) == SENTINEL).all()
    assert (buf[:, 0] == SENTINEL).all() and (buf[:, M + 1] == SENTINEL).all()


def test_host_path_column_slice_out_written_in_place(emulated) -> None:
    G, M, K, N = 3, 16, 32, 64
    x, w = _inputs(G, M, K, N, BF16, seed=63)
    counts = [16, 2, 0]
    buf = torch.full((G, M, N + 16), SENTINEL, dtype=BF16)
    out = buf[:, :, 8:N + 8]
    assert fused_grouped_mm_masked(x, w, _counts(counts), out=out) is out
    launched = emulated[-1].calls[-1]["out"]
    assert launched.data_ptr() == out.data_ptr() and launched.stride() == (N + 16, 1)
    check_valid(out, ref64(x, w, counts), counts)
    written = torch.zeros(buf.shape, dtype=torch.bool)
    for g, c in enumerate(counts):
        written[g, :c, 8:N + 8] = True
    assert (buf[~written] == SENTINEL).all()


def test_host_path_expected_m_changes_the_choice(emulated) -> None:
    G, M, K, N = 4, 512, 64, 256
    x, w = _inputs(G, M, K, N, BF16, seed=64, w_layout="nk_view")
    counts = [8, 0, 512, 3]
    mm = _counts(counts)
    y_small = fused_grouped_mm_masked(x, w, mm, gate="silu", expected_m=8)
    small = launch_info.last_launch().choice
    y_full = fused_grouped_mm_masked(x, w, mm, gate="silu")
    full = launch_info.last_launch().choice
    for c in (small, full):
        assert c.visitor == "device" and not c.tail_split
    assert (small.schedule, small.tile_m, small.tile_n) != (full.schedule, full.tile_m,
                                                            full.tile_n)
    assert small.tile_m <= full.tile_m
    assert len(emulated) == 2 and all(e.key.row_counts for e in emulated)
    ref = ref64(x, w, counts, gate="silu")
    check_valid(y_small, ref, counts)
    check_valid(y_full, ref, counts)


def test_host_path_pinned_configs(emulated) -> None:
    G, M, K, N = 4, 128, 64, 256
    x, w = _inputs(G, M, K, N, BF16, seed=65, w_layout="nk_view")
    counts = [128, 0, 65, 1]
    mm = _counts(counts)
    ref = ref64(x, w, counts, gate="silu")
    for schedule, tm, tn in (("pingpong", 64, 128), ("cooperative", 128, 256)):
        cfg = GemmConfig(backend="cute", schedule=schedule, tile_m=tm, tile_n=tn)
        y = fused_grouped_mm_masked(x, w, mm, gate="silu", config=cfg)
        key = emulated[-1].key
        assert (key.schedule, key.tile_m, key.tile_n) == (schedule, tm, tn) and key.row_counts
        check_valid(y, ref, counts)
    # The visitor and a host-side sort do not apply; a pinned tail split is refused.
    fused_grouped_mm_masked(x, w, mm, gate="silu",
                            config=GemmConfig(visitor="host", sort_by_k=True))
    assert emulated[-1].key.visitor == "device" and not emulated[-1].key.tail_split
    with pytest.raises(ValueError, match=r"the masked form has no tail split"):
        fused_grouped_mm_masked(x, w, mm, gate="silu", config=GemmConfig(tail_split=True))


def test_host_path_plan_is_cached_and_reads_new_counts(emulated) -> None:
    G, M, K, N = 4, 64, 32, 64
    x, w = _inputs(G, M, K, N, BF16, seed=66)
    kw = _options(G, M, N, gate="gelu", layout="interleaved", bias=True, scale=True, seed=66)
    mm = _counts([64, 0, 3, 40])
    fused_grouped_mm_masked(x, w, mm, **kw)
    counts = [1, 64, 0, 33]
    mm.copy_(_counts(counts))  # in place, as a CUDA graph's replay sees them
    out = torch.full((G, M, N // 2), SENTINEL, dtype=BF16)
    fused_grouped_mm_masked(x, w, mm, out=out, **kw)
    y = fused_grouped_mm_masked(x, w, mm, **kw)
    # One plan per output mode (a new output or `out`), both of one kernel; the third call
    # found the first's plan.
    assert len(emulated) == 2 and emulated[0].key == emulated[1].key
    calls = emulated[0].calls
    assert len(calls) == 2 and calls[-1]["offs"] is mm
    ref = ref64(x, w, counts, **kw)
    check_valid(y, ref, counts)
    check_valid(out, ref, counts)
    assert (_past(out, counts) == SENTINEL).all()
    # New values in the other operands reach the cached plan too.
    x2 = torch.randn(x.shape, generator=_gen(67)).to(BF16)
    kw2 = {**kw, "row_weight": torch.rand(G, M, generator=_gen(68))}
    y2 = fused_grouped_mm_masked(x2, w, mm, **kw2)
    assert len(emulated) == 2 and len(emulated[0].calls) == 3
    check_valid(y2, ref64(x2, w, counts, **kw2), counts)


def test_host_path_strided_counts_are_copied(emulated) -> None:
    x, w = _inputs(3, 16, 16, 32, BF16, seed=69)
    base = _counts([16, -7, 0, -7, 9, -7])
    y = fused_grouped_mm_masked(x, w, base[::2], gate="gelu", gate_layout="alternating")
    passed = emulated[0].calls[-1]["offs"]
    assert passed.is_contiguous() and torch.equal(passed, base[::2])
    check_valid(y, ref64(x, w, [16, 0, 9], gate="gelu", gate_layout="alternating"), [16, 0, 9])


def test_host_path_trivial_shapes_launch_nothing(emulated) -> None:
    for G, M, N in ((0, 8, 32), (3, 0, 32), (3, 8, 0)):
        x, w = _inputs(G, M, 16, N, BF16, seed=70)
        y = fused_grouped_mm_masked(x, w, _counts([min(M, 2)] * G))
        assert y.shape == (G, M, N)
    assert all(not e.calls for e in emulated), "nothing to launch"


def test_host_path_out_overlapping_an_input_is_computed_as_if_cloned(emulated) -> None:
    x, w = _inputs(3, 16, 32, 32, BF16, seed=71)
    mm = _counts([16, 0, 5])
    fused_grouped_mm_masked(x, w, mm, out=torch.empty(3, 16, 32, dtype=BF16))  # a cached plan
    want = fused_grouped_mm_masked(x.clone(), w, mm, out=x.clone())
    assert fused_grouped_mm_masked(x, w, mm, out=x) is x
    assert torch.equal(x, want)


def test_host_path_cached_plan_checks_alignment(emulated) -> None:
    G, M, K, N = 3, 16, 32, 64
    x, w = _inputs(G, M, K, N, BF16, seed=72, w_layout="nk_view")
    mm = _counts([16, 0, 5])
    fused_grouped_mm_masked(x, w, mm, gate="silu")  # the plan, cached
    storage = torch.empty(G * M * K + 1, dtype=BF16)
    shifted = storage[1:].view(G, M, K)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 and shifted.stride() == x.stride()
    y = fused_grouped_mm_masked(shifted, w, mm, gate="silu")  # the emulator asserts alignment
    check_valid(y, ref64(x, w, [16, 0, 5], gate="silu"), [16, 0, 5])


def test_fake_tensors_take_an_out_that_is_not_one_row_stride() -> None:
    # An out whose problems are not one row stride apart (written after the launch, eagerly)
    # must trace too: fake tensors raise ValueError where real ones raise RuntimeError.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(3, 6, 16), torch.empty(3, 16, 32)
        out = torch.empty(6, 3, 16).transpose(0, 1)
        y = fused_grouped_mm_masked(x, w, torch.empty(3, dtype=torch.int32), gate="silu",
                                    out=out)
    assert y is out and y.shape == (3, 6, 16)
