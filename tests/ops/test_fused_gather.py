"""fused_grouped_mm's routed rows gathered by row_index on the Hopper host path
(ops/fused_launch.FusedPlan), on the CPU with the compiled varlen kernel replaced by an
emulator of what it does with the arguments it is given: its launch check (the compiled call's
fake tensors, kernels/sm90/compile.py: x, w and out each with its unit stride and every other
stride, size-1 dims included, a 16-byte multiple, at 16-byte aligned addresses) and its gather
(kernels/sm90/gather.py: a routed row's x row copied 16 bytes at a time, a chunk that starts
before K copied whole; B's rows past K are zero-filled by its TMA load).

Rows of x whose K is no 16-byte multiple reach the plan where x has one row (a decode step's
token routed to its top-k experts) or a padded row stride. index_select's copy of them had rows
K elements apart, which the launch check refuses (a kernel error, not a result), and the
in-kernel gather read past each row (its padding, or past x's memory after the last row) into
products with zeros: a NaN or inf there made the row NaN.
"""

from __future__ import annotations

import pytest
import torch
from host_fakes import NSM, emulating

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops import fused as fused_ops
from moe_gemm.ops.fused_launch import fused_choice
from moe_gemm.ops.fused_reference import fused_grouped_mm_ref
from moe_gemm.ops.fused_validation import check_fused_mm
from moe_gemm.testing import assert_close_to_ref

BF16, FP64, I32 = torch.bfloat16, torch.float64, torch.int32
NAN = float("nan")
TORCH = GemmConfig(backend="torch")
# A ping-pong 128-row tile: the in-kernel gather would cap it (64 rows), so the plan gathers
# with index_select (fused_launch.fused_choice).
HOST_GATHER = GemmConfig(schedule="pingpong", tile_m=128, tile_n=192, cluster_m=1, cluster_n=1)


def _keeps_the_rule(t: torch.Tensor, unit: int) -> bool:
    align = 16 // t.element_size()
    return t.stride(unit) == 1 and all(s % align == 0 for d, s in enumerate(t.stride())
                                       if d != unit) and t.data_ptr() % 16 == 0


class FusedKernelEmulator:
    """The compiled varlen fused kernel (no row counts): refuses arguments its launch check
    refuses, reads x's rows as it reads them, and writes what it computes (float64, rounded
    once; rows past offs[-1] zeroed with the zero tail, else left as they are)."""

    def __init__(self, key) -> None:
        self.key = key
        self.calls: list[dict] = []

    def __call__(self, x, w, out, meta, meta32, offs, table, workspace, trace, num_problems,
                 num_ctas, swizzle, a_policy, b_policy, pdl, d_base, *fused):
        key = self.key
        assert key.form == "varlen" and not key.row_counts and key.visitor == "device"
        for name, t, unit in (("x", x, 1), ("w", w, 1 if key.b_major == "k" else 2),
                              ("out", out, 1)):
            if not _keeps_the_rule(t, unit):
                raise RuntimeError(f"the kernel's launch check refuses {name}: strides "
                                   f"{t.stride()}, address {t.data_ptr() % 16} bytes past 16")
        self.calls.append(dict(x=x, w=w, out=out, gather=key.gather))
        index, weight, bias = fused if fused else (None, None, None)
        T, K = x.shape
        S, E = out.shape[0], offs.shape[0]
        assert num_problems == E + (1 if num_problems > E else 0)
        if key.gather:
            assert index.dtype == I32 and index.shape == (S,)
            chunk = 16 // x.element_size()
            read = -(-K // chunk) * chunk  # whole 16-byte chunks
            flat = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage())
            starts = x.storage_offset() + index.long().clamp(0, T - 1) * x.stride(0)
            if S and int(starts.max()) + read > flat.numel():
                raise RuntimeError("the gather read past x's memory (an illegal address)")
            rows = flat[starts[:, None] + torch.arange(read)]
            a, past = rows[:, :K], rows[:, K:]
        else:
            assert x.shape[0] == S
            a, past = x, x[:, :0]
        y = fused_grouped_mm_ref(
            a, w, offs, bias=bias if key.bias else None, gate=key.gate or None,
            gate_layout=key.gate_layout or "concat",
            gate_alpha=key.gate_alpha if key.gate == "clamped_swiglu" else 1.702,
            gate_limit=key.gate_limit if key.gate == "clamped_swiglu" else 7.0,
            row_weight=weight if key.row_scale else None, dtype=FP64)
        # The chunks' values past K meet B's zero-filled rows: 0 where finite, else NaN.
        y[~torch.isfinite(past.double()).all(1)] = NAN
        end = max([0, *offs.clamp(0, S).tolist()])
        rows_written = S if num_problems > E else end
        out[:rows_written] = y[:rows_written].to(out.dtype)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> list[FusedKernelEmulator]:
    """fused_grouped_mm on the Hopper path with CPU tensors: each compile makes an emulator."""
    yield from emulating(monkeypatch, FusedKernelEmulator, fused_ops)


def _one_token(K: int, g: torch.Generator, after: float | None) -> torch.Tensor:
    """x (1, K): the whole of its memory (after=None), or followed by `after` values."""
    if after is None:
        return torch.randn(1, K, generator=g).to(BF16)
    buf = torch.full((2 * K,), after, dtype=BF16)
    buf[:K] = torch.randn(K, generator=g).to(BF16)
    return buf[:K].view(1, K)


def _padded(T: int, K: int, g: torch.Generator) -> torch.Tensor:
    """x (T, K) with a row stride of K rounded up to 16 bytes, NaN in the padding."""
    buf = torch.full((T, -(-K // 8) * 8), NAN, dtype=BF16)
    buf[:, :K] = torch.randn(T, K, generator=g).to(BF16)
    return buf[:, :K]


XS = {"one token, its own memory": lambda g: _one_token(20, g, None),
      "one token, NaN after it": lambda g: _one_token(20, g, NAN),
      "padded rows, NaN padding": lambda g: _padded(6, 20, g)}
GATES = [(None, "concat"), ("silu", "interleaved")]


@pytest.mark.parametrize("gate,layout", GATES, ids=[g or "plain" for g, _ in GATES])
@pytest.mark.parametrize("config", [None, HOST_GATHER], ids=["auto", "pinned-tile"])
@pytest.mark.parametrize("x_kind", list(XS))
def test_rows_of_k_off_16_bytes_routed_to_several_rows(emulated, x_kind, config, gate,
                                                       layout) -> None:
    g = torch.Generator().manual_seed(20 + list(XS).index(x_kind))
    x = XS[x_kind](g)
    T, K, E, N, S = x.shape[0], x.shape[1], 3, 32, 7
    w = (torch.randn(E, K, N, generator=g) / 4).to(BF16)
    row_index = torch.randint(0, T, (S,), generator=g)
    offs = torch.tensor([2, 2, 6], dtype=I32)  # an empty expert; a row past offs[-1]
    kw = dict(row_index=row_index, gate=gate, gate_layout=layout,
              bias=torch.randn(E, N, generator=g), row_weight=torch.rand(S, generator=g))
    for _ in range(2):  # the first call and the cached plan's
        y = moe_gemm.fused_grouped_mm(x, w, offs, config=config, **kw)
        ref = fused_grouped_mm_ref(x.double(), w.double(), offs, dtype=FP64, **kw)
        low = moe_gemm.fused_grouped_mm(x, w, offs, config=TORCH, **kw)
        assert_close_to_ref(y, ref, low)
        assert bool((y[6:] == 0).all())
        call = emulated[-1].calls[-1]
        assert not call["gather"], "x's rows are no whole 16-byte chunks: the plan gathers"
        assert call["x"].shape == (S, K) and call["x"].stride() == (24, 1)
    assert len(emulated) == 1 and len(emulated[0].calls) == 2


def test_whole_chunk_rows_keep_the_in_kernel_gather(emulated) -> None:
    # The emulated gather itself, where it applies: K = 24 (48-byte rows), one token.
    g = torch.Generator().manual_seed(21)
    x = _one_token(24, g, NAN)
    w = (torch.randn(2, 24, 32, generator=g) / 4).to(BF16)
    row_index, offs = torch.zeros(5, dtype=torch.int64), torch.tensor([3, 5], dtype=I32)
    y = moe_gemm.fused_grouped_mm(x, w, offs, row_index=row_index)
    assert emulated[-1].calls[-1]["gather"]
    ref = fused_grouped_mm_ref(x.double(), w.double(), offs, row_index=row_index, dtype=FP64)
    assert_close_to_ref(y, ref, moe_gemm.fused_grouped_mm(x, w, offs, row_index=row_index,
                                                          config=TORCH))


@pytest.mark.parametrize("K,gathers", [(8, True), (20, False), (24, True), (36, False)])
def test_the_kernel_gathers_whole_16_byte_rows_only(K, gathers) -> None:
    x = torch.empty(1, K, dtype=BF16, device="meta")
    w = torch.empty(4, K, 64, dtype=BF16, device="meta")
    args = check_fused_mm(x, w, torch.empty(4, dtype=I32, device="meta"),
                          row_index=torch.empty(16, dtype=torch.int64, device="meta"),
                          concrete=False)
    _, in_kernel = fused_choice(args, GemmConfig(), NSM, torch.device("meta"))
    assert in_kernel == gathers
