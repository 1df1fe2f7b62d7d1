"""aliasing.py and the ops' handling of outputs that share memory with operands (CPU)."""

import itertools
import random

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig, GroupedGemmPlan
from moe_gemm.ops.aliasing import has_internal_overlap, may_overlap, outputs_aliasing_inputs

TORCH = GemmConfig(backend="torch")


def _addresses(t: torch.Tensor) -> set[int]:
    """Every byte t's elements occupy (brute force, small tensors only)."""
    size = t.element_size()
    out = set()
    for idx in itertools.product(*(range(n) for n in t.shape)):
        off = sum(i * s for i, s in zip(idx, t.stride()))
        base = t.data_ptr() + off * size
        out.update(range(base, base + size))
    return out


def _random_view(buf: torch.Tensor, rng: random.Random) -> torch.Tensor:
    R, C = buf.shape
    r0, c0 = rng.randrange(R), rng.randrange(C)
    m, n = rng.randint(0, R - r0), rng.randint(0, C - c0)
    v = buf[r0:r0 + m, c0:c0 + n]
    kind = rng.random()
    if kind < 0.2:
        v = v.t()
    elif kind < 0.3 and v.numel():
        v = buf.view(-1)[rng.randrange(buf.numel()):][: rng.randint(1, 12)].view(-1, 1)
    return v


def test_may_overlap_is_never_wrong_and_exact_for_row_views():
    rng = random.Random(0)
    buf = torch.zeros(9, 11)
    exact = 0
    for _ in range(3000):
        a, b = _random_view(buf, rng), _random_view(buf, rng)
        truth = bool(_addresses(a) & _addresses(b))
        got = may_overlap(a, b)
        assert got or not truth, (a.shape, a.stride(), b.shape, b.stride())
        rowlike = all(t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1) and
                      t.stride(0) == 11 for t in (a, b))
        if rowlike:
            exact += 1
            assert got == truth, (a.storage_offset(), a.shape, b.storage_offset(), b.shape)
    assert exact > 1000
    assert not may_overlap(torch.zeros(3), torch.zeros(3))  # separate allocations


def test_outputs_aliasing_inputs_and_outputs_sharing_memory():
    buf = torch.zeros(6, 10)
    x = torch.zeros(6, 4)
    outs = [buf[:, :5], buf[:, 5:]]  # column blocks of one buffer: disjoint
    assert outputs_aliasing_inputs(outs, [x, buf[2:3, 7:8]]) == [1]
    assert outputs_aliasing_inputs(outs, [x, x]) == []
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory"):
        outputs_aliasing_inputs([buf[:, :6], buf[:, 5:]], [x])


def test_column_major_outputs_in_one_buffer_are_not_refused():
    # Row blocks of a transposed (column-major) buffer share no element, as torch.mm(out=)
    # agrees: no "share memory" error, and the results land in the buffer.
    g = torch.Generator().manual_seed(7)
    a = [torch.randn(4, 8, generator=g) for _ in range(2)]
    b = [torch.randn(8, 6, generator=g) for _ in range(2)]
    buf = torch.full((6, 8), float("nan")).t()  # (8, 6), strides (1, 8)
    outs = [buf[:4], buf[4:]]
    assert not may_overlap(outs[0], outs[1])
    assert outputs_aliasing_inputs(outs, [*a, *b]) == []
    res = moe_gemm.grouped_gemm(a, b, out=outs)
    assert all(r is o for r, o in zip(res, outs))
    torch.testing.assert_close(buf, torch.cat([ai @ bi for ai, bi in zip(a, b)]))
    GroupedGemmPlan(a, b, out=outs)()
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory"):
        outputs_aliasing_inputs([buf[:5], buf[4:]], [])


def test_grouped_mm_out_overlapping_w_or_x_is_computed_as_on_copies():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 5, generator=g)
    w = torch.randn(3, 5, 5, generator=g)
    offs = torch.tensor([3, 6, 9], dtype=torch.int32)
    # out overlaps w[1], w[2]; the row past offs[-1] must keep its value
    want = moe_gemm.grouped_mm(x.clone(), w.clone(), offs, config=TORCH).double()
    out = w.view(15, 5)[5:15]
    tail = out[9].clone()
    y = moe_gemm.grouped_mm(x, w, offs, out=out, config=TORCH)
    assert y is out
    torch.testing.assert_close(y[:9].double(), want[:9], rtol=1e-5, atol=1e-5)
    assert torch.equal(y[9], tail)
    # out two rows ahead of x in one buffer
    xb = torch.randn(12, 5, generator=g)
    x2 = xb[:10]
    want = moe_gemm.grouped_mm(x2.clone(), w, offs, config=TORCH)
    y = moe_gemm.grouped_mm(x2, w, offs, out=xb[2:], config=TORCH)
    torch.testing.assert_close(y[:9], want[:9], rtol=1e-5, atol=1e-5)


def test_grouped_mm_parameter_out_overlapping_x_is_computed_as_on_copies():
    """A Parameter is a plain tensor to the ops (and to the C++ path): an overlapping one is
    caught like a Tensor."""
    g = torch.Generator().manual_seed(4)
    xb = torch.randn(12, 5, generator=g)
    w = torch.randn(3, 5, 5, generator=g)
    offs = torch.tensor([3, 6, 10], dtype=torch.int32)
    x = xb[:10]
    want = moe_gemm.grouped_mm(x.clone(), w, offs, config=TORCH)
    out = torch.nn.Parameter(xb[2:], requires_grad=False)
    y = moe_gemm.grouped_mm(x, w, offs, out=out, config=TORCH)
    assert y is out
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_grouped_mm_out_overlapping_x_in_another_storage_is_computed_as_on_copies():
    """Two storages can share memory (torch.from_numpy of overlapping numpy views; DLPack
    the same): an out one row ahead of x there was taken as disjoint, and the torch path's
    per-expert writes overwrote rows of x that a later expert then read."""
    np = pytest.importorskip("numpy")
    buf = np.random.default_rng(5).standard_normal(12 * 5).astype(np.float32)
    x = torch.from_numpy(buf[:50]).view(10, 5)
    out = torch.from_numpy(buf[5:55]).view(10, 5)  # out[i] is x[i + 1]
    assert x.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    w = torch.randn(3, 5, 5, generator=torch.Generator().manual_seed(5))
    offs = torch.tensor([3, 6, 10], dtype=torch.int32)
    want = moe_gemm.grouped_mm(x.clone(), w, offs, config=TORCH)
    y = moe_gemm.grouped_mm(x, w, offs, out=out, config=TORCH)
    assert y is out
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_batched_out_overlapping_w():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(3, 4, 4, generator=g)
    x = torch.randn(3, 4, 4, generator=g)
    want = torch.bmm(x, w)
    y = moe_gemm.grouped_mm(x, w, out=w, config=TORCH)  # in place over w
    assert y is w
    torch.testing.assert_close(y, want)


def test_grouped_gemm_out_overlapping_an_operand_and_plan():
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(4, 4, generator=g) for _ in range(3)]
    b = [torch.randn(4, 4, generator=g) for _ in range(3)]
    want = [x @ y for x, y in zip(a, b)]
    out = [torch.empty(4, 4), b[0], a[2]]  # out[1] is b[0] (read by problem 0), out[2] is a[2]
    res = moe_gemm.grouped_gemm(a, b, out=out, config=TORCH)
    assert all(r is o for r, o in zip(res, out))
    for r, w_ in zip(res, want):
        torch.testing.assert_close(r, w_)
    a = [torch.randn(4, 4, generator=g) for _ in range(3)]
    b = [torch.randn(4, 4, generator=g) for _ in range(3)]
    want = [x @ y for x, y in zip(a, b)]
    plan = GroupedGemmPlan(a, b, out=[torch.empty(4, 4), a[1], torch.empty(4, 4)], config=TORCH)
    res = plan()
    assert res[1] is a[1]
    for r, w_ in zip(res, want):
        torch.testing.assert_close(r, w_)


def test_outputs_that_cannot_be_written_are_clear_errors():
    a = [torch.randn(4, 6), torch.randn(4, 6)]
    b = [torch.randn(6, 6), torch.randn(6, 6)]
    x, w = torch.randn(4, 6), torch.randn(2, 6, 6)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    expanded = torch.zeros(1, 6).expand(4, 6)
    with pytest.raises(ValueError, match=r"out\[0\] has elements that share memory"):
        moe_gemm.grouped_gemm(a, b, out=[expanded, torch.empty(4, 6)])
    with pytest.raises(ValueError, match="out has elements that share memory"):
        moe_gemm.grouped_mm(x, w, offs, out=expanded)
    with pytest.raises(ValueError, match="out has elements that share memory"):
        moe_gemm.grouped_mm(torch.randn(2, 4, 6), w, out=torch.zeros(1, 1, 6).expand(2, 4, 6))
    leaf = torch.zeros(4, 6, requires_grad=True)
    with pytest.raises(ValueError, match="out requires grad"):
        moe_gemm.grouped_mm(x, w, offs, out=leaf)
    with pytest.raises(ValueError, match=r"out\[1\] requires grad"):
        moe_gemm.grouped_gemm(a, b, out=[torch.empty(4, 6), leaf])
    with torch.no_grad():  # allowed where autograd is off, as for torch's out= ops
        moe_gemm.grouped_mm(x, w, offs, out=leaf)
    same = torch.empty(4, 6)
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory"):
        moe_gemm.grouped_gemm(a, b, out=[same, same])


def test_has_internal_overlap_is_exact_on_layouts_torch_finds_too_hard():
    # torch._debug_has_internal_overlap answers "too hard" (2) for every non-dense layout
    # without a zero stride, overlapping or not; brute force decides each one here.
    rng = random.Random(1)
    buf = torch.zeros(400)
    for _ in range(400):
        dims = rng.randint(1, 3)
        shape = tuple(rng.randint(0, 5) for _ in range(dims))
        stride = tuple(rng.randint(1, 7) for _ in range(dims))
        t = buf.as_strided(shape, stride)
        offsets = [sum(i * s for i, s in zip(idx, stride))
                   for idx in itertools.product(*(range(n) for n in shape))]
        truth = len(set(offsets)) < len(offsets)
        assert has_internal_overlap(t) == truth, (shape, stride)
    assert not has_internal_overlap(torch.zeros(10, 16)[:, ::2])
    assert not has_internal_overlap(buf.as_strided((3, 2), (2, 3)))  # interleaved, disjoint
    assert has_internal_overlap(buf.as_strided((10, 8), (1, 1)))


def test_out_whose_strides_overlap_is_refused_and_an_interleaved_one_is_written():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 5, generator=g), torch.randn(2, 5, 3, generator=g)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    want = torch.cat([x[:2] @ w[0], x[2:] @ w[1]])
    buf = torch.full((64,), float("nan"))
    # out[i, j] and out[i + 1, j - 1] are one element: a result written there is not the
    # product whatever the order of the writes.
    with pytest.raises(ValueError, match="out has elements that share memory"):
        moe_gemm.grouped_mm(x, w, offs, out=buf.as_strided((6, 3), (1, 1)))
    with pytest.raises(ValueError, match="out has elements that share memory"):
        moe_gemm.fused_grouped_mm(x, w, offs, out=buf.as_strided((6, 3), (1, 1)))
    with pytest.raises(ValueError, match="out has elements that share memory"):
        moe_gemm.grouped_mm_masked(x.view(2, 3, 5), w, torch.tensor([3, 1], dtype=torch.int32),
                                   out=buf.as_strided((2, 3, 3), (9, 1, 1)))
    # Strides 1 and 6 on a (6, 3) view: rows interleave in memory but no two elements meet.
    out = buf.as_strided((6, 3), (1, 6))
    moe_gemm.grouped_mm(x, w, offs, out=out)
    torch.testing.assert_close(out, want)


def test_plan_on_the_torch_backend_is_differentiable_and_empty_plan_has_backend():
    a = [torch.randn(4, 3, requires_grad=True)]
    b = [torch.randn(3, 5)]
    plan = GroupedGemmPlan(a, b, config=TORCH)
    assert plan.backend == "torch"
    plan()[0].sum().backward()
    torch.testing.assert_close(a[0].grad, torch.ones(4, 5) @ b[0].t())
    empty = GroupedGemmPlan([], [])
    assert empty.backend == "torch" and empty() == []


def test_an_input_without_storage_beside_out_is_left_to_validation(monkeypatch):
    # A sparse or nested operand has no storage (or sizes) to compare with out's: the out=
    # fast paths read them before any check, and raised torch's own error; the op's checks
    # name the operand instead. Any other failure to read still raises.
    from moe_gemm.ops import aliasing

    x = torch.randn(8, 16)
    out = torch.empty(8, 8)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    sparse = torch.randn(2, 16, 8).to_sparse()
    jagged = torch.nested.nested_tensor([torch.randn(16, 8)] * 2, layout=torch.jagged)
    for w in (sparse, jagged):
        assert not aliasing.overlaps_any(out, (x, w, offs))
    with pytest.raises(TypeError, match=r"^w must be a dense \(strided\) tensor; got layout "
                                        r"torch\.sparse_coo"):
        moe_gemm.grouped_mm(x, sparse, offs, out=out)

    def broken(*args):
        raise RuntimeError("some other failure")

    monkeypatch.setattr(aliasing, "may_overlap", broken)
    with pytest.raises(RuntimeError, match="some other failure"):
        aliasing.overlaps_any(out, (out[:, :4],))


def test_an_interleaved_layout_past_the_counting_limit_counts_as_overlapping(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_gemm.ops import aliasing

    # (3, 2) with strides (2, 3): offsets 0, 3, 2, 5, 4, 7, distinct but interleaved, so
    # they are counted; past the limit such a layout is refused rather than enumerated.
    t = torch.empty(8).as_strided((3, 2), (2, 3))
    assert not aliasing.has_internal_overlap(t)
    monkeypatch.setattr(aliasing, "_COUNTED_MAX", 4)
    assert aliasing.has_internal_overlap(t)


def test_grouped_gemm_out_under_grad_and_vmap_of_grad():
    # torch.func's wrappers have no storage: the aliasing check of grouped_gemm's `out` read
    # their spans and raised "Cannot access data pointer of Tensor that doesn't have storage"
    # (grouped_mm's compared the wrapped tensors already).
    from torch.func import grad, vmap

    g = torch.Generator().manual_seed(21)
    a = [torch.randn(3, 5, 8, generator=g), torch.randn(3, 2, 4, generator=g)]
    b = [torch.randn(8, 6, generator=g), torch.randn(4, 3, generator=g)]

    def loss(b0, a0, a1, o0, o1):
        d = moe_gemm.grouped_gemm([a0, a1], [b0, b[1]], out=[o0, o1], config=TORCH)
        return d[0].square().sum() + d[1].sum()

    def want(a0):
        return 2 * a0.double().t() @ (a0.double() @ b[0].double())

    got = grad(loss)(b[0], a[0][0], a[1][0], torch.zeros(5, 6), torch.zeros(2, 3))
    torch.testing.assert_close(got.double(), want(a[0][0]), rtol=1e-5, atol=1e-5)
    outs = (torch.full((3, 5, 6), 7.0), torch.full((3, 2, 3), 7.0))
    got = vmap(grad(loss), in_dims=(None, 0, 0, 0, 0))(b[0], *a, *outs)
    torch.testing.assert_close(got.double(), torch.stack([want(x) for x in a[0]]),
                               rtol=1e-5, atol=1e-5)
    wrapped = []
    grad(lambda x: wrapped.append(outputs_aliasing_inputs([x[:, :2], torch.zeros(2, 2)],
                                                          [x, x[:, 2:]])) or x.sum())(
        torch.randn(2, 4))
    assert wrapped == [[0]]  # (x[:, :2] lies in x; the fresh tensor in nothing)
