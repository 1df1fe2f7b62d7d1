"""The FP8 rows of `moe-gemm bench --suite fp8` and `python -m benchmarks.zoo --fp8`.

An fp8 shape (`ShapeSpec(dtype="fp8")`) draws bf16 inputs and quantizes them once per input
set (benchmarks.suite.make_inputs). Its implementations, checked and timed interleaved as
every other row (benchmarks.runner):

- `ours-fp8-block` (the default row): scaled_grouped_mm, 1x128 activation / 128x128 weight
  scales, config=None;
- `ours-fp8-row`: the same with row-wise scales (per token, per output channel);
- `ours-fp8-block-ring`: the block-scaled default with the scales loaded by the math
  threads three stages ahead instead of staged in shared memory (MOE_GEMM_FP8_SMEM_SCALES=0;
  the varlen default before 2026-11-29, the batched form's default);
- `torch-scaled-grouped-mm-row` (peer): torch._scaled_grouped_mm, row-wise;
- `torch-scaled-grouped-mm-block` (peer): F.scaled_grouped_mm with BlockWise1x128 /
  BlockWise128x128, where the installed torch has it;
- `ours-bf16`: our grouped_mm on the bf16 inputs, config=None (for reference, not a peer);
- `dense-fp8-row (ceiling)`: torch._scaled_mm of the shape's total M x N x K against one
  weight, where the shape is compute-bound (a bound, not a peer).

Each FP8 row is checked against the fp64 product of its own dequantized operands on sampled
rows, after all its outputs (ours: into a NaN-filled `out`) were found finite; a torch op that
is missing or raises is `n/a` with torch's message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from benchmarks.fp8_operands import (
    BF16,
    Scaled,
    checked_error,
    smem_scales,
    torch_blockwise_grouped_mm,
    torch_scaled_grouped_mm,
)
from benchmarks.suite import (
    FP8,
    TOLERANCE,
    GeneralInputs,
    Impl,
    Inputs,
    NotApplicable,
    Prepared,
    ShapeSpec,
    _ours,
    _ours_batched,
    short_error,
)

OURS_BLOCK = "ours-fp8-block"
OURS_ROW = "ours-fp8-row"
OURS_BLOCK_RING = "ours-fp8-block-ring"
TORCH_ROW = "torch-scaled-grouped-mm-row"
TORCH_BLOCK = "torch-scaled-grouped-mm-block"
OURS_BF16 = "ours-bf16"
DENSE = "dense-fp8-row (ceiling)"


def fp8_suite() -> list[ShapeSpec]:
    """The suite's FP8 shapes: the bf16 headline, decode and prefill shapes in FP8."""
    return [
        ShapeSpec("uniform-fp8", "general", FP8,
                  "the headline in FP8, batched: 256 x (M=128, N=512, K=7168), each problem "
                  "its own weights", problems=((128, 512, 7168),) * 256, headline=True),
        ShapeSpec("decode-fp8", "varlen", FP8,
                  "E=256 decode routing in FP8: 1024 rows Zipf-routed, N=512, K=7168",
                  experts=256, rows=1024, n=512, k=7168),
        ShapeSpec("prefill-fp8", "varlen", FP8,
                  "DeepSeek-V3 EP8 shard (32 of 256 experts) gate_up prefill in FP8: 32768 "
                  "rows Zipf-routed, N=4096, K=7168", experts=32, rows=32768, n=4096, k=7168),
    ]


def fp8_smoke_suite() -> list[ShapeSpec]:
    """Tiny stand-ins (K a multiple of the 128-wide scale blocks): the harness on a CPU."""
    return [
        ShapeSpec("uniform-fp8", "general", FP8, "smoke: 8 x (16, 32, 128)",
                  problems=((16, 32, 128),) * 8, headline=True),
        ShapeSpec("decode-fp8", "varlen", FP8, "smoke: E=16, 24 rows Zipf, N=32, K=128",
                  experts=16, rows=24, n=32, k=128),
        ShapeSpec("prefill-fp8", "varlen", FP8, "smoke: E=4, 128 rows Zipf, N=64, K=256",
                  experts=4, rows=128, n=64, k=256),
    ]


def _operands(inp: Inputs, granularity: str) -> Scaled:
    if not inp.fp8:
        raise NotApplicable("these inputs carry no FP8 operands (not an fp8 shape)")
    return inp.fp8[granularity]


def _checked(run: Callable[[], object], check: Callable[[], object], s: Scaled) -> Prepared:
    return Prepared(run, check, error=lambda out: checked_error(out, s),
                    tolerance=TOLERANCE[FP8])


def ours_fp8(granularity: str, ring: bool = False
              ) -> Callable[[ShapeSpec, Inputs, torch.device], Prepared]:
    def build(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
        import moe_gemm

        s = _operands(inp, granularity)
        switch = (lambda: smem_scales(False)) if ring else contextlib.nullcontext

        def run() -> object:
            with switch():
                return moe_gemm.scaled_grouped_mm(s.x, s.w, s.sa, s.sb, s.offs)

        def check() -> object:
            out = torch.full(s.out_shape, float("nan"), dtype=BF16, device=device)
            with switch():
                return moe_gemm.scaled_grouped_mm(s.x, s.w, s.sa, s.sb, s.offs, out=out)

        return _checked(run, check, s)

    return build


def _torch_peer(granularity: str) -> Callable[[ShapeSpec, Inputs, torch.device], Prepared]:
    lookup = torch_scaled_grouped_mm if granularity == "row" else torch_blockwise_grouped_mm

    def build(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
        fn, why = lookup(device)
        if fn is None:
            raise NotApplicable(why or "unavailable")
        s = _operands(inp, granularity)
        if granularity == "row":
            run = lambda: fn(s.x, s.w, s.sa, s.sb, offs=s.offs, out_dtype=BF16)  # noqa: E731
        else:
            run = lambda: fn(s.x, s.w, s.sa, s.sb, offs=s.offs)  # noqa: E731
        try:  # torch refuses some layouts, scale shapes or GPUs: say so, as n/a
            run()
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
            raise NotApplicable(f"torch raised {short_error(exc, 300)}") from exc
        return _checked(run, run, s)

    return build


def _ours_bf16(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
    if isinstance(inp, GeneralInputs):
        return _ours_batched(spec, inp, device)
    return _ours(None)(spec, inp, device)


def _dense(compute_bound: bool) -> Callable[[ShapeSpec, Inputs, torch.device], Prepared]:
    def build(spec: ShapeSpec, inp: Inputs, device: torch.device) -> Prepared:
        if not compute_bound:
            raise NotApplicable("memory-bound (or no FP8 matmul rate measured): the copy "
                                "bandwidth bounds this shape, not a dense FP8 GEMM")
        if not hasattr(torch, "_scaled_mm"):
            raise NotApplicable(f"torch {torch.__version__} has no torch._scaled_mm")
        s = _operands(inp, "row")
        K = s.w.shape[1]
        a, sa = s.x.reshape(-1, K), s.sa.reshape(-1)
        b, sb = s.w[0], s.sb[0]  # one expert's (K, N) column-major weight for every row
        rows = torch.tensor([a.shape[0]], dtype=torch.int32, device=device)
        one = Scaled(a, s.w[:1], sa, s.sb[:1], "row", rows)
        sa2, sb2 = sa.unsqueeze(1), sb.unsqueeze(0)

        def run() -> object:
            return torch._scaled_mm(a, b, sa2, sb2, out_dtype=BF16)

        return _checked(run, run, one)

    return build


def implementations(spec: ShapeSpec, compute_bound: bool) -> list[Impl]:
    """An fp8 shape's rows: ours block-scaled (the default) and row-wise, torch's FP8 grouped
    GEMMs (the peers), our bf16 default for reference and, where `compute_bound`, the dense
    FP8 ceiling."""
    notes = f"scaled_grouped_mm(x, w, scale_a, scale_b{', offs' if spec.form == 'varlen' else ''}"
    return [
        Impl(OURS_BLOCK, False, ours_fp8("block"), default=True, dtype=FP8, scale="block",
             notes=f"{notes}), 1x128 / 128x128 block scales, config=None"),
        Impl(OURS_ROW, False, ours_fp8("row"), dtype=FP8, scale="row",
             notes=f"{notes}), per-token / per-channel scales, config=None"),
        Impl(OURS_BLOCK_RING, False, ours_fp8("block", ring=True), dtype=FP8, scale="block",
             notes=f"{notes}), block scales, config=None, MOE_GEMM_FP8_SMEM_SCALES=0"),
        Impl(TORCH_ROW, True, _torch_peer("row"), dtype=FP8, scale="row",
             notes="torch._scaled_grouped_mm(x, w, scale_a, scale_b, offs=..., "
             "out_dtype=bf16), row-wise"),
        Impl(TORCH_BLOCK, True, _torch_peer("block"), dtype=FP8, scale="block",
             notes="F.scaled_grouped_mm(..., BlockWise1x128, ..., BlockWise128x128, offs=...)"),
        Impl(OURS_BF16, False, _ours_bf16, dtype="bf16",
             notes="our bf16 grouped_mm on the unquantized inputs, config=None (reference)"),
        Impl(DENSE, False, _dense(compute_bound), dtype=FP8, scale="row", ceiling=True,
             notes="torch._scaled_mm of the total M x N x K against one weight, row-wise: "
             "the dense FP8 rate the grouped GEMM is bounded by"),
    ]
