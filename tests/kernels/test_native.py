"""The C++ operand scan (moe_gemm/kernels/native.py) on the CPU.

It must accept exactly the inputs the Python scan (support.fast_general) accepts without
per-call copies, with the same columns, and decline everything else (the Python path then
decides). CPU tensors stand in for CUDA ones (require_cuda=False): the scan reads metadata
only, never data.
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

import moe_gemm
from moe_gemm.kernels import native
from moe_gemm.kernels.support import fast_general

pytestmark = pytest.mark.skipif(
    native.status() != "native", reason=f"C++ module unavailable: {native.status()}")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _both(a, b, out_dtype=None):
    return (native.native_general(a, b, out_dtype, require_cuda=False),
            fast_general(a, b, out_dtype, require_cuda=False))


def _assert_same(a, b, out_dtype=None):
    nat, py = _both(a, b, out_dtype)
    if py is None or py[1].b_fix:
        assert nat is None, "the C++ scan accepted what the Python scan declines or copies"
        return None
    assert nat is not None, "the C++ scan declined what the Python scan accepts"
    (na, nl), (pa, pl) = nat, py
    assert list(na.sizes) == list(pa.sizes)
    assert (na.dtype, na.out_dtype, na.device) == (pa.dtype, pa.out_dtype, pa.device)
    assert na.a == pa.a and na.b == pa.b and na.out is None
    assert list(nl.a_ptr) == pl.a_ptr and list(nl.b_ptr) == pl.b_ptr
    assert list(nl.a_ld) == pl.a_ld and list(nl.b_ld) == pl.b_ld
    assert nl.b_major == pl.b_major and nl.b_fix == []
    np.testing.assert_array_equal(nl.packed, np.array([pl.a_ptr, pl.b_ptr, pl.a_ld, pl.b_ld]))
    return nat


def _t(shape, dtype, gen, *, k_major=False, offset=0):
    """A tensor of `shape`; k_major: the transpose of a row-major (N, K) one; offset: starts
    `offset` elements into a larger buffer (misaligns the pointer unless a 16-byte multiple)."""
    if k_major:
        base = torch.randn(shape[1] * shape[0] + offset, generator=gen).to(dtype)
        return base[offset:].view(shape[1], shape[0]).t()
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + offset, generator=gen).to(dtype)[offset:].view(shape)


def test_builds_and_reports_native():
    assert native.status() == "native"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None, *DTYPES])
def test_plain_problem_sets_match(dtype, out_dtype):
    gen = torch.Generator().manual_seed(1)
    sizes = [(64, 128, 256), (1, 8, 64), (0, 64, 32), (17, 16, 0), (33, 0, 16), (128, 256, 8)]
    a = [_t((m, k), dtype, gen) for m, n, k in sizes]
    b = [_t((k, n), dtype, gen) for m, n, k in sizes]
    got = _assert_same(a, b, out_dtype)
    # The kernels read bf16/fp16 operands and write any of the three.
    assert (got is not None) == (dtype is not torch.float32)


def test_k_major_b_and_mixed_layouts():
    gen = torch.Generator().manual_seed(2)
    sizes = [(64, 128, 256), (32, 64, 64), (8, 256, 128)]
    a = [_t((m, k), torch.bfloat16, gen) for m, n, k in sizes]
    bk = [_t((k, n), torch.bfloat16, gen, k_major=True) for m, n, k in sizes]
    got = _assert_same(a, bk)
    assert got is not None and got[1].b_major == "k"
    bn = [_t((k, n), torch.bfloat16, gen) for m, n, k in sizes]
    assert _assert_same(a, bn)[1].b_major == "n"
    mixed = [bk[0], bn[1], bk[2]]  # the Python path copies the minority: the scan declines
    assert _both(a, mixed)[0] is None and _both(a, mixed)[1] is not None


def test_declines_what_the_kernel_cannot_take():
    gen = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    ok_a, ok_b = _t((16, 64), bf, gen), _t((64, 32), bf, gen)
    cases = {
        "misaligned A pointer": ([_t((16, 64), bf, gen, offset=4)], [ok_b]),
        "misaligned B pointer": ([ok_a], [_t((64, 32), bf, gen, offset=4)]),
        "A row stride not 16-byte": ([_t((16, 70), bf, gen)[:, :64]], [ok_b]),
        "A not K-contiguous": ([_t((64, 16), bf, gen).t()], [ok_b]),
        "B neither major": ([ok_a], [_t((64, 64), bf, gen)[:, ::2]]),
        "N not 16-byte rows": ([ok_a], [_t((64, 3), bf, gen)]),
        "K mismatch": ([ok_a], [_t((32, 32), bf, gen)]),
        "3-D A": ([ok_a.view(1, 16, 64)], [ok_b]),
        "1-D B": ([ok_a], [ok_b.reshape(-1)]),
        "mixed dtypes": ([ok_a], [ok_b.half()]),
        "int dtype": ([ok_a.to(torch.int16)], [ok_b.to(torch.int16)]),
        "float64": ([ok_a.double()], [ok_b.double()]),
        "count mismatch": ([ok_a, ok_a], [ok_b]),
        "empty": ([], []),
        "not a tensor": ([ok_a, "x"], [ok_b, ok_b]),
        "a numpy array": ([ok_a.float().numpy()], [ok_b.float()]),
    }
    for name, (a, b) in cases.items():
        nat = native.native_general(a, b, None, require_cuda=False)
        assert nat is None, name
        _assert_same(a, b) if name not in ("not a tensor", "a numpy array") else None
    # A single tensor instead of a sequence, and an out_dtype the kernels do not write.
    assert native.native_general(ok_a, ok_b, None, require_cuda=False) is None
    assert native.native_general([ok_a], [ok_b], torch.int8, require_cuda=False) is None
    # CPU tensors when CUDA is required.
    assert native.native_general([ok_a], [ok_b], None) is None


def test_parameters_are_plain_tensors_to_both_scans():
    gen = torch.Generator().manual_seed(8)
    a = [torch.nn.Parameter(_t((16, 64), torch.bfloat16, gen))]
    b = [torch.nn.Parameter(_t((64, 32), torch.bfloat16, gen), requires_grad=False)]
    assert _assert_same(a, b) is not None

    class Sub(torch.Tensor):
        pass

    sub = [_t((16, 64), torch.bfloat16, gen).as_subclass(Sub)]
    assert _both(sub, b) == (None, None)


def test_size_one_dims_and_views():
    gen = torch.Generator().manual_seed(4)
    bf = torch.bfloat16
    a = [_t((1, 64), bf, gen), _t((40, 72), bf, gen)[3:, 8:], _t((16, 1), bf, gen),
         _t((8, 64), bf, gen)]
    b = [_t((64, 1), bf, gen), _t((64, 40), bf, gen)[:, 8:], _t((1, 16), bf, gen),
         _t((64, 8), bf, gen)]
    _assert_same(a, b)


def test_random_problem_sets_match():
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for trial in range(60):
        dtype = rng.choice(DTYPES)
        G = rng.randint(1, 12)
        k_major = rng.random() < 0.5
        a, b = [], []
        for _ in range(G):
            m, n, k = (rng.choice([0, 1, 7, 16, 64, 130]), rng.choice([0, 1, 8, 16, 24, 96]),
                       rng.choice([0, 1, 8, 16, 40, 64]))
            off_a = rng.choice([0, 0, 0, 8, 3])
            off_b = rng.choice([0, 0, 0, 8, 5])
            a.append(_t((m, k), dtype, gen, offset=off_a))
            b.append(_t((k, n), dtype, gen, k_major=k_major and rng.random() < 0.9,
                        offset=off_b))
        out_dtype = rng.choice([None, None, torch.float32, torch.bfloat16])
        _assert_same(a, b, out_dtype)


def test_repeated_sets_share_size_tuples():
    gen = torch.Generator().manual_seed(5)
    a = [_t((8, 64), torch.bfloat16, gen) for _ in range(3)]
    b = [_t((64, 16), torch.bfloat16, gen) for _ in range(3)]
    first = native.native_general(a, b, None, require_cuda=False)
    again = native.native_general([t.clone() for t in a], b, None, require_cuda=False)
    assert first[0].sizes is again[0].sizes == ((8, 16, 64),) * 3
    assert first[1].packed[0].tolist() != again[1].packed[0].tolist()  # fresh A addresses


def test_disabled_or_unbuildable_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_mod", None)
    monkeypatch.setenv("MOE_GEMM_NATIVE", "0")
    assert native.status() == "python (disabled by MOE_GEMM_NATIVE=0)"
    t = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert native.native_general([t], [t.t().contiguous()], None, require_cuda=False) is None

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv("MOE_GEMM_NATIVE")
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert native.status().startswith("python (build or load failed")
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="no C++ compiler")
def test_builds_into_a_fresh_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_mod", None)
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert native.status() == "native"
    libs = list(tmp_path.rglob(f"{native.MODULE_NAME}*"))
    assert len(libs) == 1
    # Beside it only the cross-process build lock: no temporary left behind.
    assert [p.name for p in libs[0].parent.iterdir() if p != libs[0]] == ["build.lock"]
    assert libs[0].stat().st_mode & 0o044 == 0o044  # readable by other users of the cache


def test_python_scan_block_switches_and_restores():
    t = torch.zeros(8, 16, dtype=torch.bfloat16)
    args = ([t], [t.t().contiguous()], None)
    assert native.native_general(*args, require_cuda=False) is not None
    with native.python_scan():
        assert native.native_general(*args, require_cuda=False) is None
    assert native.native_general(*args, require_cuda=False) is not None


@pytest.mark.parametrize("bad", [[torch.float32], {}, "float32"])
def test_out_dtype_of_the_wrong_type_names_what_is_expected_with_the_scan_loaded(bad):
    # The scan declines anything but a torch.dtype, so validation names the expected type
    # whether or not the C++ scan has been loaded.
    from moe_gemm.kernels import native

    native.status()  # loads (or builds) the scan where a compiler exists
    t = torch.randn(4, 4)
    with pytest.raises(TypeError, match="out_dtype must be a torch.dtype or None"):
        moe_gemm.grouped_gemm([t], [t], out_dtype=bad)
    assert native.native_general([t], [t], bad, require_cuda=False) is None
