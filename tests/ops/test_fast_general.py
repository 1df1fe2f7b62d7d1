"""support.scan_general (grouped_gemm's one-pass check) agrees with the detailed path: same
sizes and layout when it accepts, and it declines everything the detailed path would reject,
warn about or route elsewhere."""

from __future__ import annotations

import random

import pytest
import torch

from moe_gemm.ops.support import GeneralLayout, analyze_general, scan_general
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


def _random_case(rng: random.Random):
    dtype = rng.choice([torch.bfloat16, torch.bfloat16, torch.float16])
    G = rng.randint(1, 6)
    col = rng.random() < 0.5  # B majors: all one (the scan's case) or mixed
    mixed = rng.random() < 0.2
    a, b = [], []
    for _ in range(G):
        m = rng.choice([0, 1, 3, 64, 130])
        k = rng.choice([0, 1, 8, 16, 72, 7])
        n = rng.choice([0, 1, 8, 16, 24, 12])
        a.append(torch.randn(m, k, dtype=dtype))
        if col != (mixed and rng.random() < 0.5):
            b.append(torch.randn(n, k, dtype=dtype).t())  # K contiguous
        else:
            b.append(torch.randn(k, n, dtype=dtype))
    return a, b


@pytest.mark.parametrize("seed", range(300))
def test_agrees_with_detailed_path(seed: int) -> None:
    rng = random.Random(seed)
    a, b = _random_case(rng)
    out_dtype = rng.choice([None, None, torch.float32, torch.float16])
    scan = scan_general(a, b, out_dtype)
    detailed = _detailed(a, b, out_dtype)
    if scan is None:
        return  # declining is always allowed: the detailed path decides
    assert isinstance(detailed, GeneralLayout), f"the scan accepted what is {detailed}"
    ref = check_grouped_gemm(a, b, None, out_dtype)
    assert list(scan.sizes) == ref.sizes and scan.dtype == ref.dtype
    assert scan.out_dtype == ref.out_dtype and scan.device == ref.device
    G = len(a)
    assert list(scan.ptrs[:G]) == [t.data_ptr() for t in a]
    assert list(scan.ptrs[G:]) == [t.data_ptr() for t in b]
    # Wherever the kernel loads the operands, the layout describes them (the scan may pick
    # another B major than the detailed path's majority vote where a size-1 dim makes both
    # valid, and then needs no copy).
    for i, (m, n, k) in enumerate(ref.sizes):
        if not (m and n and k):
            continue
        assert scan.a_ld[i] == a[i].stride(0) and (a[i].stride(1) == 1 or k == 1)
        s0, s1 = b[i].stride()
        if scan.b_major == "n":
            assert scan.b_ld[i] == s0 and (s1 == 1 or n == 1)
        else:
            assert scan.b_ld[i] == s1 and (s0 == 1 or k == 1)


def test_accepts_the_common_case() -> None:
    a = [torch.randn(m, 64, dtype=torch.bfloat16) for m in (1, 128, 0, 77)]
    b = [torch.randn(64, 256, dtype=torch.bfloat16) for _ in a]
    scan = scan_general(a, b, None)
    assert scan is not None
    assert scan.sizes == ((1, 256, 64), (128, 256, 64), (0, 256, 64), (77, 256, 64))
    assert scan.b_major == "n" and scan.a_ld == (64,) * 4 and scan.b_ld == (256,) * 4
    bt = [torch.randn(256, 64, dtype=torch.bfloat16).t() for _ in a]  # K-major weights
    scan = scan_general(a, bt, torch.float32)
    assert scan is not None and scan.b_major == "k" and scan.b_ld == (64,) * 4
    assert scan.out_dtype == torch.float32


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values at an address 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype)
    off = next(i for i in range(8) if (flat.data_ptr() + 2 * i) % 16 == 2)
    return flat[off:off + t.numel()].view(t.shape).copy_(t)


@pytest.mark.parametrize("case", [
    "fp32", "mixed-dtype", "rank", "k-mismatch", "not-tensor", "empty", "single-tensor",
    "odd-k", "a-col-major", "bad-out-dtype", "len-mismatch", "neg", "subclass",
    "misaligned-a", "misaligned-b", "mixed-b-major", "odd-n-rows",
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
    elif case == "neg":
        b[1] = torch._neg_view(b[1])
    elif case == "subclass":
        a[1] = a[1].as_subclass(type("Sub", (torch.Tensor,), {}))
    elif case == "misaligned-a":
        a[1] = _misaligned(a[1])
    elif case == "misaligned-b":
        b[0] = _misaligned(b[0])
    elif case == "mixed-b-major":
        b[1] = torch.randn(8, 16, dtype=bf).t()
    elif case == "odd-n-rows":
        b = [torch.randn(16, 12, dtype=bf)] * 2  # 24-byte output rows
    assert scan_general(a, b, out_dtype) is None


def test_empty_problems_skip_their_checks() -> None:
    bf = torch.bfloat16
    # An expert without tokens, a problem with K = 0 and one with N = 0: their (odd) strides
    # and addresses are never used by the kernel.
    a = [torch.randn(4, 16, dtype=bf), _misaligned(torch.randn(0, 16, dtype=bf)),
         torch.randn(3, 0, dtype=bf), torch.randn(2, 16, dtype=bf)]
    b = [torch.randn(16, 8, dtype=bf), torch.randn(16, 8, dtype=bf),
         torch.randn(0, 8, dtype=bf), torch.randn(16, 0, dtype=bf)]
    scan = scan_general(a, b, None)
    assert scan is not None and scan.sizes == ((4, 8, 16), (0, 8, 16), (3, 8, 0), (2, 0, 16))
    assert isinstance(_detailed(a, b, None), GeneralLayout)
    # ... but a problem with work keeps them.
    a[3] = _misaligned(torch.randn(2, 16, dtype=bf))
    b[3] = torch.randn(16, 8, dtype=bf)
    assert scan_general(a, b, None) is None
