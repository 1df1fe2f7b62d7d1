"""FP8 operands and checks shared by the FP8 benchmarks (benchmarks.bench_fp8, the FP8 suite of
`moe-gemm bench --suite fp8` and `benchmarks.zoo --fp8`).

- `scaled_operands`: 16-bit inputs quantized the ways the FP8 ops take them (block: 1x128
  activation groups and 128x128 weight blocks, DeepSeek-V3's recipe; row: one scale per token
  and per output channel), weights a few experts at a time;
- `spot_error` / `checked_error`: an output against the fp64 product of its own dequantized
  operands on sampled rows (a full fp64 reference of a 32k-row prefill would take minutes);
- torch's FP8 grouped GEMMs (`torch._scaled_grouped_mm` row-wise, `F.scaled_grouped_mm`
  block-wise), or why they cannot run here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
GRANULARITIES = ("block", "row")
# Weight elements quantized at once: the quantizers' fp32 temporaries stay near 0.5 GB each
# (a 256 x 4096 x 7168 fp32 copy would be 30 GB).
CHUNK_ELEMS = 1 << 27
SPOT_ROWS = 256


@dataclass
class Scaled:
    """One FP8 call's operands, in scaled_grouped_mm's convention (torch._scaled_grouped_mm's
    too): x [T, K] or [G, M, K]; w [E, K, N] the K-major view of an [E, N, K] weight; scales
    float32 (block: sa [..., K/128], sb [E, K/128, ceil(N/128)]; row: sa [...], sb [E, N]);
    offs int32 cumulative row ends, None for the batched form."""

    x: torch.Tensor
    w: torch.Tensor
    sa: torch.Tensor
    sb: torch.Tensor
    granularity: str
    offs: torch.Tensor | None

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.x.shape[:-1], self.w.shape[-1])

    def nbytes(self) -> int:
        """Bytes the operands occupy (FP8 values and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.x, self.w, self.sa, self.sb))


def quantize_acts(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] 16-bit -> (q, scale): 1x128 groups ("block") or one scale per row."""
    from moe_gemm import quantize_fp8_per_row, quantize_fp8_per_token_group

    if granularity == "block":
        return quantize_fp8_per_token_group(x)
    return quantize_fp8_per_row(x)


def quantize_weights(w_nk: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w_nk [G, N, K] (any strides) -> (q [G, K, N] K-major view, scale in the ops' layout),
    CHUNK_ELEMS weights at a time."""
    from moe_gemm import quantize_fp8_per_block, quantize_fp8_per_row

    G, N, K = w_nk.shape
    q = torch.empty(G, N, K, dtype=E4M3, device=w_nk.device)
    if granularity == "block":
        s = torch.empty(G, -(-N // 128), -(-K // 128), device=w_nk.device)
    else:
        s = torch.empty(G, N, device=w_nk.device)
    quantize = quantize_fp8_per_block if granularity == "block" else quantize_fp8_per_row
    step = max(1, CHUNK_ELEMS // max(N * K, 1))
    for g in range(0, G, step):
        q[g:g + step], s[g:g + step] = quantize(w_nk[g:g + step])
    if granularity == "block":
        return q.transpose(1, 2), s.transpose(1, 2)
    return q.transpose(1, 2), s


def scaled_operands(x: torch.Tensor, w_nk: torch.Tensor, offs: torch.Tensor | None,
                    granularities: tuple[str, ...] = GRANULARITIES) -> dict[str, Scaled]:
    """x [T, K] (with offs) or [G, M, K] and weights w_nk [E, N, K] quantized per
    granularity."""
    out = {}
    for g in granularities:
        xq, sa = quantize_acts(x, g)
        wq, sb = quantize_weights(w_nk, g)
        out[g] = Scaled(xq, wq, sa, sb, g, offs)
    return out


# ---------------------------------------------------------------------------------------------
# checks


def spot_error(y: torch.Tensor, x, w, sa, sb, offs, granularity: str,
               rows: int = SPOT_ROWS) -> float:
    """Relative (Frobenius) error of `rows` sampled output rows against the fp64 product of
    the dequantized operands (16-bit operands when sa is None), each problem's weight
    dequantized once."""
    from moe_gemm.ops.scaled_validation import a_scale_view, b_scale_view

    gen = torch.Generator().manual_seed(5)
    batched = offs is None
    if batched:
        G, M = x.shape[0], x.shape[1]
        pick = torch.randint(0, G * M, (min(rows, G * M),), generator=gen)
        pairs = list(zip((pick // M).tolist(), (pick % M).tolist()))
    else:
        bounds = offs.cpu().tolist()
        picked = torch.randperm(bounds[-1], generator=gen)[:rows].tolist() if bounds else []
        edges = torch.tensor(bounds)
        pairs = [(int(torch.searchsorted(edges, r, right=True)), r) for r in picked]
    if sa is not None:
        lead = (x.shape[0],) if batched else ()
        sav = a_scale_view(sa, granularity, lead, x.shape[-2])
        sbv = b_scale_view(sb, granularity, (w.shape[0],), w.shape[2])
    by_problem: dict[int, list[int]] = {}
    for p, r in pairs:
        by_problem.setdefault(p, []).append(r)
    errs = norms = 0.0
    for p, rs in by_problem.items():
        idx = torch.tensor(rs, device=x.device)
        xs = (x[p] if batched else x).index_select(0, idx).double()
        ys = (y[p] if batched else y).index_select(0, idx).double()
        b = w[p].double()
        if sa is not None:
            s_a = (sav[p] if batched else sav).index_select(0, idx).double()
            s_b = sbv[p].double()
            if granularity == "block":
                xs = xs * s_a.repeat_interleave(128, 1)[:, : xs.shape[1]]
                K, N = b.shape
                b = b * s_b.repeat_interleave(128, 0)[:K].repeat_interleave(128, 1)[:, :N]
            else:
                xs, b = xs * s_a, b * s_b
        ref = xs @ b
        errs += float((ys - ref).pow(2).sum())
        norms += float(ref.pow(2).sum())
    return (errs / norms) ** 0.5 if norms else 0.0


def checked_error(out: object, s: Scaled, rows: int = SPOT_ROWS) -> float:
    """NaN when any output value is not finite (an unwritten row of a NaN-filled `out`), else
    spot_error on `rows` sampled rows."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != s.out_shape:
        raise RuntimeError(f"output {getattr(out, 'shape', type(out).__name__)} is not the "
                           f"expected {list(s.out_shape)}")
    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return spot_error(out, s.x, s.w, s.sa, s.sb, s.offs, s.granularity, rows)


# ---------------------------------------------------------------------------------------------
# torch's FP8 grouped GEMMs


def torch_scaled_grouped_mm(device: torch.device) -> tuple[Callable | None, str | None]:
    """torch._scaled_grouped_mm (row-wise scales), or why it cannot run here."""
    fn = getattr(torch, "_scaled_grouped_mm", None)
    if fn is None:
        return None, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if torch.device(device).type != "cuda":
        return None, "torch._scaled_grouped_mm has CUDA kernels only"
    return fn, None


def torch_blockwise_grouped_mm(device: torch.device) -> tuple[Callable | None, str | None]:
    """F.scaled_grouped_mm with 1x128 / 128x128 block scales bound to its recipes, or why it
    cannot run here."""
    import torch.nn.functional as F

    fn = getattr(F, "scaled_grouped_mm", None)
    scaling = getattr(F, "ScalingType", None)
    if fn is None or scaling is None or not hasattr(scaling, "BlockWise1x128"):
        return None, f"torch {torch.__version__} has no block-scaled F.scaled_grouped_mm"
    if torch.device(device).type != "cuda":
        return None, "F.scaled_grouped_mm has CUDA kernels only"

    def call(x, w, sa, sb, offs=None):
        return fn(x, w, sa, scaling.BlockWise1x128, sb, scaling.BlockWise128x128, offs=offs,
                  output_dtype=BF16)

    return call, None


@contextlib.contextmanager
def _switched(name: str, value: str) -> Iterator[None]:
    """The environment switch `name` set to `value` inside the block. Plans key on our FP8
    switches, so a call inside and one outside never share a plan; a CUDA graph captured
    inside keeps the kernel it captured."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def promote_lag(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Our FP8 kernels with the lagged promotion (MOE_GEMM_FP8_PROMOTE_LAG=1) inside the block:
    the benchmarks' `ours-fp8-block-lag` rows (with smem_scales(False): the lag on scales
    loaded from global memory); on=False (0): staged scales promoted in the plain loop, the
    `-staged-plain` rows."""
    from moe_gemm.ops.heuristics_fp8 import PROMOTE_LAG_ENV

    return _switched(PROMOTE_LAG_ENV, "1" if on else "0")


def scale_ahead(stages: int) -> contextlib.AbstractContextManager[None]:
    """Our block-scaled FP8 kernels with the scales loaded `stages` ahead
    (MOE_GEMM_FP8_SCALE_AHEAD) inside the block: the `ours-fp8-block-ahead<n>` rows."""
    from moe_gemm.ops.heuristics_fp8 import SCALE_AHEAD_ENV

    return _switched(SCALE_AHEAD_ENV, str(stages))


def peek_wait(on: bool) -> contextlib.AbstractContextManager[None]:
    """Our FP8 kernels with each stage's wait taking a probe of its barrier made a stage
    earlier (MOE_GEMM_FP8_PEEK_WAIT=1, the varlen default: the `-peek` rows) or waiting in
    full (0: the `-nopeek` rows) inside the block."""
    from moe_gemm.ops.heuristics_fp8 import PEEK_WAIT_FP8_ENV

    return _switched(PEEK_WAIT_FP8_ENV, "1" if on else "0")


def half_skip(on: bool) -> contextlib.AbstractContextManager[None]:
    """Our FP8 kernels with (MOE_GEMM_FP8_HALF_SKIP=1: the `-halfskip` rows) or without (0:
    the `-nohalfskip` rows) the idle second warpgroup on cooperative 128-row tiles whose last
    64 rows are past the problem's end, on every such tile, inside the block (the default
    takes it from heuristics_fp8.HALF_SKIP_MIN_ROWS rows per problem)."""
    from moe_gemm.ops.heuristics_fp8 import HALF_SKIP_ENV

    return _switched(HALF_SKIP_ENV, "1" if on else "0")


def smem_scales(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Our block-scaled FP8 kernels with the scales staged in shared memory by TMA
    (MOE_GEMM_FP8_SMEM_SCALES=1, the varlen default) or loaded by the math threads (0) inside
    the block: the `ours-fp8-block-ring` and `-lag` rows switch it off."""
    from moe_gemm.ops.heuristics_fp8 import SMEM_SCALES_ENV

    return _switched(SMEM_SCALES_ENV, "1" if on else "0")
