"""Size-1 dimensions whose strides break the kernels' 16-byte rule, on the CPU (the compiled
kernel replaced by a recorder): support.tma_views, and every launch plan that hands the kernel
its views (grouped_mm's 2-D form and the fused plan: test_plan_cache.py, test_fused_ops.py).

A size-1 dimension's stride never addresses memory, so the kernels can take any, but the
compiled kernel's argument check reads every stride: the plan must pass views whose strides
keep the rule, of the same elements (never a copy, so that a given `out` is written in place).
"""

from __future__ import annotations

import pytest
import torch
from host_fakes import Recorder

from moe_gemm import grouped_mm, grouped_mm_masked, scaled_grouped_mm, scaled_grouped_mm_masked
from moe_gemm.ops.support import TmaViews, tma_view, tma_views
from moe_gemm.testing_fp8 import make_fp8_batched_inputs, make_fp8_moe_inputs

BF16 = torch.bfloat16
SENTINEL = -7.0  # exactly representable in bf16
ODD = 3  # a stride (elements) that is no 16-byte multiple at any element size


def _odd(t: torch.Tensor) -> torch.Tensor:
    """t's elements with every size-1 dimension's stride set to ODD (what a slice or a
    reshape may leave there)."""
    return t.as_strided(t.shape, [ODD if n == 1 else s for n, s in zip(t.shape, t.stride())])


def _keeps_the_rule(t: torch.Tensor, unit: int) -> bool:
    """The compiled kernels' contract for a tensor argument: unit stride on `unit`, every
    other stride (size-1 dims included) a 16-byte multiple."""
    align = 16 // t.element_size()
    return t.stride(unit) == 1 and all(s % align == 0 for d, s in enumerate(t.stride())
                                       if d != unit)


# ---------------------------------------------------------------------------------------------
# tma_views


def test_tma_views_is_none_when_no_operand_needs_a_view() -> None:
    x = torch.randn(4, 16).to(BF16)
    w = torch.randn(2, 16, 8).to(BF16)
    assert tma_views((x, 1), (w, 2), (None, 1)) is None
    # (a size-1 dim whose stride keeps the rule needs none either)
    assert tma_views((torch.randn(1, 16).to(BF16), 1)) is None


def test_tma_views_views_only_the_operands_that_need_one() -> None:
    x = _odd(torch.randn(1, 20).to(BF16))
    w = torch.randn(2, 20, 8).to(BF16)
    out = _odd(torch.randn(1, 8).to(BF16))
    views = tma_views((x, 1), (w, 2), (out, 1))
    assert isinstance(views, TmaViews) and views.fixes == ((0, 1), (2, 1))
    xv, wv, ov = views(x, w, out)
    assert wv is w
    for given, seen in ((x, xv), (out, ov)):
        assert _keeps_the_rule(seen, 1), seen.stride()
        assert seen.data_ptr() == given.data_ptr() and torch.equal(seen, given)
        assert seen.stride() == tma_view(given, 1).stride()


def test_tma_views_never_views_an_output_the_launch_allocates() -> None:
    x = _odd(torch.randn(1, 20).to(BF16))
    views = tma_views((x, 1), (None, 1))
    assert views is not None and views.fixes == ((0, 1),)


# ---------------------------------------------------------------------------------------------
# The plans


def _bf16_batched(G: int, M: int, K: int, N: int):
    g = torch.Generator().manual_seed(G * 100 + M)
    return (torch.randn(G, M, K, generator=g).to(BF16),
            torch.randn(G, K, N, generator=g).to(BF16))


def _bmm(G, M, K, N):
    x, w = _bf16_batched(G, M, K, N)
    return x, w, lambda x, w, out: grouped_mm(x, w, out=out)


def _masked(G, M, K, N):
    x, w = _bf16_batched(G, M, K, N)
    counts = torch.full((G,), M, dtype=torch.int32)
    return x, w, lambda x, w, out: grouped_mm_masked(x, w, counts, out=out)


def _fp8_mm(G, M, K, N):
    # the varlen form: G experts, G * M routed rows
    x, w, sa, sb, offs = make_fp8_moe_inputs(G * M, G, K, N, "row", seed=G + M,
                                             empty_fraction=0.0)
    return x, w, lambda x, w, out: scaled_grouped_mm(x, w, sa, sb, offs, out=out)


def _fp8_bmm(G, M, K, N):
    x, w, sa, sb = make_fp8_batched_inputs(G, M, K, N, "row", seed=G + M)
    return x, w, lambda x, w, out: scaled_grouped_mm(x, w, sa, sb, out=out)


def _fp8_masked(G, M, K, N):
    x, w, sa, sb = make_fp8_batched_inputs(G, M, K, N, "block", seed=G + M)
    counts = torch.full((G,), M, dtype=torch.int32)
    return x, w, lambda x, w, out: scaled_grouped_mm_masked(x, w, sa, sb, counts, out=out)


FORMS = {"grouped_mm 3-D": _bmm, "grouped_mm_masked": _masked,
         "scaled_grouped_mm 2-D": _fp8_mm, "scaled_grouped_mm 3-D": _fp8_bmm,
         "scaled_grouped_mm_masked": _fp8_masked}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("given_out", [False, True], ids=["new-out", "given-out"])
def test_size_one_dims_reach_the_kernel_as_aligned_views(cute_ops: Recorder, form: str,
                                                         given_out: bool) -> None:
    # One problem of one row: every operand has size-1 dims, each given an odd stride.
    x, w, call = FORMS[form](1, 1, 128, 16)
    x, w = _odd(x), _odd(w)
    w_unit = 1 if w.stride(1) == 1 else 2  # (FP8: K-major; 16-bit here: N-major)
    wide = None
    for _ in range(2):  # the first call and the cached plan's
        out = None
        if given_out:
            wide = torch.full((*x.shape[:-1], 24), SENTINEL, dtype=BF16)
            out = _odd(wide[..., :16])
        calls = len(cute_ops.calls)
        y = call(x, w, out)
        assert len(cute_ops.calls) == calls + 1, "the kernel must run, once"
        xk, wk, yk = cute_ops.calls[-1][:3]
        unit = x.dim() - 1
        assert _keeps_the_rule(xk, unit), xk.stride()
        assert _keeps_the_rule(wk, w_unit), wk.stride()
        assert _keeps_the_rule(yk, unit), yk.stride()
        # The same elements: views of the operands and of the result, never copies.
        for given, seen in ((x, xk), (w, wk), (y, yk)):
            assert seen.shape == given.shape and seen.data_ptr() == given.data_ptr()
        assert torch.equal(xk.view(torch.uint8), x.view(torch.uint8))
        assert torch.equal(wk.view(torch.uint8), w.view(torch.uint8))
        if given_out:
            assert y is out and bool((wide[..., 16:] == SENTINEL).all())


@pytest.mark.parametrize("K", [20, 32])
def test_fused_rows_gathered_by_the_plan_reach_the_kernel_aligned(cute_ops: Recorder,
                                                                  K: int) -> None:
    # With a tile the in-kernel gather cannot keep (256 rows), the plan gathers the routed
    # rows with index_select: one row of K = 20 is a new (1, 20) tensor whose row stride (20
    # elements, 40 bytes) is off the rule; of K = 32, it keeps it and passes as it is.
    from moe_gemm import GemmConfig, fused_grouped_mm

    x = torch.randn(1, K).to(BF16)
    w = torch.randn(3, K, 16).to(BF16)
    offs = torch.tensor([0, 1, 1], dtype=torch.int32)
    cfg = GemmConfig(schedule="cooperative", tile_m=256, tile_n=128)
    for _ in range(2):  # the first call and the cached plan's
        fused_grouped_mm(x, w, offs, row_index=torch.zeros(1, dtype=torch.int64), config=cfg)
        xk = cute_ops.calls[-1][0]
        assert xk.data_ptr() != x.data_ptr(), "the plan must have gathered the rows itself"
        assert _keeps_the_rule(xk, 1) and torch.equal(xk, x), xk.stride()
        assert xk.stride() == ((24, 1) if K == 20 else (32, 1))
