"""support.fast_general (grouped_gemm's one-pass check) agrees with the detailed path:
same sizes and layout when it accepts, and it declines everything the detailed path would
reject, warn about or route elsewhere."""

from __future__ import annotations

import random

import pytest
import torch

from moe_gemm.ops.support import GeneralLayout, analyze_general, fast_general
from moe_gemm.ops.validation import check_grouped_gemm


def _detailed(a, b, out_dtype):
    try:
        args = check_grouped_gemm(a, b, None, out_dtype)
    except (TypeError, ValueError):
        return "error"
    if not args.a:
        return "empty"
    res = analyze_general(args)
    return res if isinstance(res, GeneralLayout) else "unsupported"


def _layout_tuple(lay: GeneralLayout):
    return (lay.a_ptr, lay.a_ld, lay.b_ptr, lay.b_ld, lay.b_major, lay.b_fix)


def _random_case(rng: random.Random):
    dtype = rng.choice([torch.bfloat16, torch.bfloat16, torch.float16])
    G = rng.randint(1, 6)
    a, b = [], []
    for _ in range(G):
        m = rng.choice([0, 1, 3, 64, 130])
        k = rng.choice([0, 1, 8, 16, 72, 7])
        n = rng.choice([0, 1, 8, 16, 24, 12])
        a.append(torch.randn(m, k, dtype=dtype))
        if rng.random() < 0.5:
            b.append(torch.randn(n, k, dtype=dtype).t())  # K contiguous
        else:
            b.append(torch.randn(k, n, dtype=dtype))
    return a, b


@pytest.mark.parametrize("seed", range(300))
def test_agrees_with_detailed_path(seed: int) -> None:
    rng = random.Random(seed)
    a, b = _random_case(rng)
    out_dtype = rng.choice([None, None, torch.float32, torch.float16])
    fast = fast_general(a, b, out_dtype, require_cuda=False)
    detailed = _detailed(a, b, out_dtype)
    if fast is None:
        return  # declining is always allowed: the detailed path decides
    assert isinstance(detailed, GeneralLayout), f"fast path accepted what is {detailed}"
    args, lay = fast
    ref = check_grouped_gemm(a, b, None, out_dtype)
    assert args.sizes == ref.sizes and args.dtype == ref.dtype
    assert args.out_dtype == ref.out_dtype and args.device == ref.device
    assert _layout_tuple(lay) == _layout_tuple(detailed)


def test_accepts_the_common_case() -> None:
    a = [torch.randn(m, 64, dtype=torch.bfloat16) for m in (1, 128, 0, 77)]
    b = [torch.randn(64, 256, dtype=torch.bfloat16) for _ in a]
    fast = fast_general(a, b, None, require_cuda=False)
    assert fast is not None
    assert fast[0].sizes == [(1, 256, 64), (128, 256, 64), (0, 256, 64), (77, 256, 64)]


@pytest.mark.parametrize("case", [
    "fp32", "mixed-dtype", "rank", "k-mismatch", "not-tensor", "empty", "single-tensor",
    "odd-k", "a-col-major", "bad-out-dtype", "len-mismatch",
])
def test_declines(case: str) -> None:
    bf = torch.bfloat16
    a = [torch.randn(4, 16, dtype=bf), torch.randn(8, 16, dtype=bf)]
    b = [torch.randn(16, 8, dtype=bf), torch.randn(16, 8, dtype=bf)]
    out_dtype = None
    if case == "fp32":
        a, b = [t.float() for t in a], [t.float() for t in b]
    elif case == "mixed-dtype":
        b[1] = b[1].half()
    elif case == "rank":
        a[1] = a[1][None]
    elif case == "k-mismatch":
        b[1] = torch.randn(8, 8, dtype=bf)
    elif case == "not-tensor":
        a[0] = a[0].tolist()
    elif case == "empty":
        a, b = [], []
    elif case == "single-tensor":
        a = torch.randn(2, 4, 16, dtype=bf)  # type: ignore[assignment]
    elif case == "odd-k":
        a = [torch.randn(4, 7, dtype=bf)] * 2
        b = [torch.randn(7, 8, dtype=bf)] * 2
    elif case == "a-col-major":
        a[0] = torch.randn(16, 4, dtype=bf).t()
    elif case == "bad-out-dtype":
        out_dtype = torch.int32
    elif case == "len-mismatch":
        b = b[:1]
    assert fast_general(a, b, out_dtype, require_cuda=False) is None


def test_cpu_tensors_decline_by_default() -> None:
    a = [torch.randn(4, 16, dtype=torch.bfloat16)]
    b = [torch.randn(16, 8, dtype=torch.bfloat16)]
    assert fast_general(a, b, None) is None
