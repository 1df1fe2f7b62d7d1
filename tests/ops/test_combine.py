"""ops/combine.py on the CPU: the embedding_bag path against an fp64 reference, and the kernel
path's plumbing with the compiled kernel replaced by an emulator (what it is given: the row
view, the indices as they are, fp32 weights or a placeholder, a fresh (T, H) output)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_gemm.ops import combine, launch_resources


def _inputs(T, S, H, k, dtype=torch.bfloat16, weights=None, index=torch.int64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(S, H, generator=gen).to(dtype)
    rows = torch.randint(0, S, (T, k), generator=gen).to(index)
    w = None if weights is None else torch.rand(T, k, generator=gen).to(weights)
    return y, rows, w


def _reference(y, rows, w):
    ww = torch.ones(rows.shape, dtype=torch.float64) if w is None else w.double()
    return (y.double()[rows.long()] * ww.unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("weights", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("index", [torch.int64, torch.int32])
def test_embedding_bag_path_matches_reference(weights, index):
    y, rows, w = _inputs(33, 70, 48, 4, weights=weights, index=index)
    out = combine.combine_rows(y, rows, w)
    assert out.shape == (33, 48) and out.dtype == torch.bfloat16
    ref = _reference(y, rows, w)
    assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=1e-2)
    # As the kernel: the weighted rows summed in fp32 (fp32 weights as given, not rounded to
    # y's dtype first), rounded once. (The CPU's bf16 embedding_bag rounded along the way: 1
    # ulp off in ~4% of these elements.)
    ww = torch.ones(rows.shape) if w is None else w.float()
    once = (y.float()[rows.long()] * ww.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    torch.testing.assert_close(out, once, rtol=0, atol=0)


def test_a_sum_is_rounded_once_on_every_path():
    """Eight bf16 rows whose exact sum 200.5 lies between bf16 neighbours: 200 (fp32 sum,
    rounded once to nearest even) on the plain path and the forward-mode path alike (the CPU's
    bf16 embedding_bag gave 201)."""
    import torch.autograd.forward_ad as fwad

    vals = [54.75, 98.0, -58.25, -176.0, 151.0, 110.0, 110.0, -89.0]
    y = torch.tensor(vals, dtype=torch.bfloat16)[:, None].repeat(1, 8)
    rows = torch.arange(8)[None]
    assert combine.combine_rows(y, rows)[0, 0].item() == 200.0
    assert combine.combine_rows(y, rows, torch.ones(1, 8))[0, 0].item() == 200.0
    with fwad.dual_level():
        d = combine.combine_rows(fwad.make_dual(y, torch.zeros_like(y)), rows)
        assert fwad.unpack_dual(d).primal[0, 0].item() == 200.0
    y64 = torch.randn(5, 3, dtype=torch.float64)
    rows = torch.tensor([[0, 4], [2, 2]])
    with fwad.dual_level():  # (fp64 summed in fp64)
        d = combine.combine_rows(fwad.make_dual(y64, torch.zeros_like(y64)), rows)
        assert torch.equal(fwad.unpack_dual(d).primal, y64[rows].sum(1))


@pytest.mark.parametrize("rows", [[[0, 1], [2, 4]], [[0], [-1]], [[4]]])
def test_a_cpu_row_outside_the_range_is_named(rows):
    # (embedding_bag named the range for the first token's slots only)
    with pytest.raises(IndexError, match=r"outside \[0, S\) = \[0, 4\)"):
        combine.combine_rows(torch.randn(4, 8), torch.tensor(rows))


class _Emulator:
    """Computes what the kernel computes from the arguments it is given."""

    def __init__(self, k, weighted):
        self.k, self.weighted, self.calls = k, weighted, []

    def __call__(self, y, rows, w, out):
        self.calls.append((y, rows, w, out))
        assert rows.shape[1] == self.k and w.dtype == torch.float32
        r = rows.long().clamp(0, y.shape[0] - 1)
        part = y.float()[r]
        if self.weighted:
            assert w.shape == rows.shape
            part = part * w.unsqueeze(-1)
        out.copy_(part.sum(1).to(out.dtype))


@pytest.fixture
def kernel(monkeypatch):
    made = {}

    def fake_kernel(dtype, index_dtype, k, weighted):
        return made.setdefault((dtype, index_dtype, k, weighted), _Emulator(k, weighted))

    monkeypatch.setattr(combine, "_kernel_ok", lambda y, rows, w: True)
    monkeypatch.setattr(combine, "_kernel", fake_kernel)
    monkeypatch.setattr(launch_resources, "_capturing", lambda: False)
    return made


@pytest.mark.parametrize("weights", [None, torch.bfloat16, torch.float32])
def test_kernel_path_arguments(kernel, weights):
    y, rows, w = _inputs(17, 40, 64, 8, weights=weights, index=torch.int32, seed=2)
    out = combine.combine_rows(y, rows, w)
    (key, emu), = kernel.items()
    assert key == (torch.bfloat16, torch.int32, 8, weights is not None)
    yk, rk, wk, ok = emu.calls[0]
    assert yk is y and rk is rows and ok is out and out.shape == (17, 64)
    if weights is None:
        assert wk.shape == (1, 1)  # a placeholder the unweighted kernel never reads
    else:
        assert torch.equal(wk, w.float())
    torch.testing.assert_close(out.double(), _reference(y, rows, w), rtol=2 ** -7, atol=1e-2)


def test_no_slots_give_zeros():
    # k = 0 (permute_by_expert takes (T, 0) ids): each token sums no rows, so its output is
    # zeros, where embedding_bag refuses bags of no rows from a 2-D input.
    y, rows, w = _inputs(5, 7, 16, 0, weights=torch.float32)
    for weights in (None, w):
        out = combine.combine_rows(y, rows, weights)
        assert out.shape == (5, 16) and out.dtype == y.dtype and bool((out == 0).all())


def test_kernel_path_no_tokens_no_launch(kernel):
    y, rows, _ = _inputs(0, 5, 16, 2)
    out = combine.combine_rows(y, rows)
    assert out.shape == (0, 16) and not any(e.calls for e in kernel.values())


def test_what_the_kernel_takes():
    y, rows, w = _inputs(4, 8, 16, 2, weights=torch.float32)
    assert not combine._kernel_ok(y, rows, None)  # a CPU tensor: embedding_bag
    ok = combine._layout_ok
    assert ok(y, rows, None) and ok(y, rows, w) and ok(y, rows.int(), w.bfloat16())
    assert ok(y.half(), rows, None)
    assert not ok(y.float(), rows, None)  # fp32 rows
    assert not ok(y, rows.short(), None)
    assert not ok(y, rows.float(), None)
    assert not ok(y, torch.zeros(4, 17, dtype=torch.int64), None)  # k beyond 16
    assert not ok(y, torch.zeros(4, 0, dtype=torch.int64), None)
    assert not ok(y, rows, w.double()) and not ok(y, rows, w[:, :1])
    assert not ok(y[:, :12], rows, None)  # H not a multiple of 8
    assert not ok(y.t().contiguous().t(), rows, None)  # H not contiguous
    assert not ok(torch.zeros(8, 24, dtype=torch.bfloat16)[:, 1:17], rows, None)  # unaligned
    assert not ok(y[:0], rows, None)  # no rows to read
    assert not ok(y[0], rows, None)


def _bad_inputs():
    y, rows, w = _inputs(6, 10, 16, 2, weights=torch.float32)
    return [
        ((y[0], rows, None), TypeError, "y must be a 2-D (S, H) floating tensor"),
        ((y.long(), rows, None), TypeError, "y must be a 2-D (S, H) floating tensor"),
        ((y, rows[:, 0], None), TypeError, "rows must be a 2-D (T, k) int64 or int32"),
        ((y, rows.float(), None), TypeError, "rows must be a 2-D (T, k) int64 or int32"),
        ((y, rows.short(), None), TypeError, "rows must be a 2-D (T, k) int64 or int32"),
        ((y, rows.tolist(), None), TypeError, "must be torch.Tensors (weights may be None); "
                                              "got Tensor, list, NoneType"),
        ((y, rows, w[:, :1]), ValueError, "weights must have rows' shape (6, 2); got (6, 1)"),
        ((y, rows, w.long()), TypeError, "weights must be a floating tensor; got torch.int64"),
        # (meta stands in for another device: a CPU rows beside a GPU y reached the kernel)
        ((y, rows.to("meta"), None), ValueError, "rows must be on y's device cpu; got meta"),
        ((y, rows, w.to("meta")), ValueError, "weights must be on y's device cpu; got meta"),
        ((y[:0], rows, None), ValueError, "y has no rows for the 12 indices"),
    ]


@pytest.mark.parametrize("args, error, words", _bad_inputs())
def test_bad_inputs_are_refused_by_name(args, error, words):
    # They failed inside embedding_bag with messages about its own arguments (or, on a GPU,
    # reached the kernel: rows on the CPU were read through a host pointer).
    with pytest.raises(error, match=r"^combine_rows: ") as e:
        combine.combine_rows(*args)
    assert words in str(e.value)


def test_checks_come_before_the_no_slot_shortcut():
    y, _, _ = _inputs(4, 8, 16, 1)
    with pytest.raises(TypeError, match="int64 or int32"):
        combine.combine_rows(y, torch.zeros(4, 0))  # float rows of no slots
    assert combine.combine_rows(y[:0], torch.zeros(4, 0, dtype=torch.int32)).shape == (4, 16)


@pytest.fixture
def kernel_allowed(monkeypatch):
    """The kernel path as on a GPU (row_kernel_allowed true, layouts checked), the compiled
    kernel replaced by the emulator: what decides between it and embedding_bag is the code's."""
    made = {}

    def fake_kernel(dtype, index_dtype, k, weighted):
        return made.setdefault((dtype, index_dtype, k, weighted), _Emulator(k, weighted))

    monkeypatch.setattr(combine, "row_kernel_allowed", lambda t, switch: True)
    monkeypatch.setattr(combine, "_kernel", fake_kernel)
    monkeypatch.setattr(launch_resources, "_capturing", lambda: False)
    return made


@pytest.mark.parametrize("tracked", ["y", "weights"])
def test_autograd_takes_embedding_bag_and_its_gradients(kernel_allowed, tracked):
    # The kernel has no derivative: with grad on y or the weights, embedding_bag runs (it
    # used to be the kernel, its result detached from the graph without a word).
    y, rows, w = _inputs(9, 20, 32, 3, weights=torch.bfloat16, seed=4)
    (y if tracked == "y" else w).requires_grad_(True)
    out = combine.combine_rows(y, rows, w)
    assert not any(e.calls for e in kernel_allowed.values())
    assert out.requires_grad
    out.float().sum().backward()
    leaf = y if tracked == "y" else w
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape
    if tracked == "weights":  # d out / d w[t, j] = sum over H of y[rows[t, j]]
        want = y.double()[rows].sum(-1)
        torch.testing.assert_close(w.grad.double(), want, rtol=2 ** -6, atol=5e-2)
    with torch.no_grad():  # no grad: the kernel again
        combine.combine_rows(y, rows, w)
    assert sum(len(e.calls) for e in kernel_allowed.values()) == 1


def test_forward_mode_dual_y_takes_embedding_bag(kernel_allowed):
    import torch.autograd.forward_ad as fwad

    y, rows, _ = _inputs(5, 11, 16, 2, seed=5)
    with fwad.dual_level(), torch.no_grad():
        dual = fwad.make_dual(y.float(), torch.ones_like(y, dtype=torch.float32)).bfloat16()
        out = combine.combine_rows(dual, rows)
        primal, tangent = fwad.unpack_dual(out)
    assert not any(e.calls for e in kernel_allowed.values())
    assert tangent is not None and torch.equal(tangent, torch.full_like(tangent, 2.0))
    torch.testing.assert_close(primal, F.embedding_bag(rows, y, mode="sum"))


def test_fake_tensors_take_no_value_check():
    # (the CPU range check read values: the layer under FakeTensorMode raised
    # DataDependentOutputException)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = combine.combine_rows(torch.randn(6, 8), torch.zeros(3, 2, dtype=torch.long),
                                   torch.rand(3, 2))
    assert out.shape == (3, 8)
