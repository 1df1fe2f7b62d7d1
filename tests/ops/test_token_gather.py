"""ops/token_gather.py on the CPU: the index_select path, the kernel path's plumbing with the
compiled kernel replaced by an emulator (what it is given: x as it is, the indices as they are,
a fresh (S, H) output), which layouts and sizes the kernel takes, the tensors it is never
given (fake, subclassed, under a dispatch mode, differentiated forward), torch.compile and
vmap, and bad input refused by name."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwad
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from moe_gemm.ops import row_kernels, token_gather


def _inputs(T, S, H, dtype=torch.bfloat16, index=torch.int64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    rows = torch.randint(0, T, (S,), generator=gen).to(index)
    return x, rows


@pytest.mark.parametrize("index", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_index_select_path_copies_the_rows(index, dtype):
    x, rows = _inputs(33, 70, 48, dtype=dtype, index=index)
    out = token_gather.gather_rows(x, rows)
    assert out.shape == (70, 48) and out.dtype == dtype
    for r in (0, 17, 69):
        assert torch.equal(out[r], x[int(rows[r])])


def test_out_of_range_rows_are_refused_on_the_cpu():
    x, rows = _inputs(5, 8, 16)
    rows[3] = 5
    with pytest.raises(IndexError):
        token_gather.gather_rows(x, rows)


class _Emulator:
    """Computes what the kernel computes from the arguments it is given."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, rows, out):
        self.calls.append((x, rows, out))
        # (detached: the kernel's result carries no derivative, backward or forward)
        out.copy_(x.detach()[rows.long().clamp(0, x.shape[0] - 1)])


@pytest.fixture
def kernel(monkeypatch):
    made = {}

    def fake_kernel(dtype, index_dtype):
        return made.setdefault((dtype, index_dtype), _Emulator())

    monkeypatch.setattr(token_gather, "_kernel_ok", lambda x, rows: True)
    monkeypatch.setattr(token_gather, "_kernel", fake_kernel)
    return made


def test_kernel_path_arguments(kernel):
    x, rows = _inputs(40, 17, 64, index=torch.int32, seed=2)
    out = token_gather.gather_rows(x, rows)
    (key, emu), = kernel.items()
    assert key == (torch.bfloat16, torch.int32)
    xk, rk, ok = emu.calls[0]
    assert xk is x and rk is rows and ok is out and out.shape == (17, 64)
    assert torch.equal(out, x[rows.long()])


def test_inputs_that_need_a_gradient_take_index_select(kernel):
    x, rows = _inputs(40, 17, 64, dtype=torch.float32)
    x.requires_grad_(True)
    out = token_gather.gather_rows(x, rows)
    assert not any(e.calls for e in kernel.values()) and out.requires_grad
    out.sum().backward()
    assert torch.equal(x.grad.sum(1), torch.bincount(rows, minlength=40).float() * 64)
    with torch.no_grad():
        token_gather.gather_rows(x, rows)  # untracked: the kernel
    assert sum(len(e.calls) for e in kernel.values()) == 1


def test_what_the_kernel_takes():
    x, rows = _inputs(8, 4, 16)
    assert not token_gather._kernel_ok(x, rows)  # a CPU tensor: index_select
    ok = token_gather._layout_ok
    assert ok(x, rows) and ok(x, rows.int()) and ok(x.half(), rows)
    assert not ok(x.float(), rows)  # fp32 rows
    assert not ok(x[:, :12], rows)  # H not a multiple of 8
    assert not ok(x.t().contiguous().t(), rows)  # H not contiguous
    assert not ok(torch.zeros(8, 24, dtype=torch.bfloat16)[:, 1:17], rows)  # unaligned
    assert ok(torch.zeros(8, 32, dtype=torch.bfloat16)[:, 8:24], rows)  # a strided, aligned view
    assert not ok(x[:0], rows[:0]) and not ok(x, rows[:0])  # nothing to copy


def test_no_rows_give_an_empty_result():
    x, rows = _inputs(5, 0, 16)
    out = token_gather.gather_rows(x, rows)
    assert out.shape == (0, 16) and out.dtype == x.dtype
    assert token_gather.gather_rows(x[:0], rows).shape == (0, 16)


def _nested(t):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the prototype API's warning)
        return torch.nested.nested_tensor(list(t))


def _bad_inputs():
    x, rows = _inputs(6, 10, 16)
    return [
        ((x[0], rows), TypeError, "x must be a 2-D (T, H) floating tensor"),
        ((x.long(), rows), TypeError, "x must be a 2-D (T, H) floating tensor"),
        ((x, rows[None]), TypeError, "rows must be a 1-D (S,) int64 or int32"),
        ((x, rows.float()), TypeError, "rows must be a 1-D (S,) int64 or int32"),
        ((x, rows.short()), TypeError, "rows must be a 1-D (S,) int64 or int32"),
        ((x, rows.bool()), TypeError, "rows must be a 1-D (S,) int64 or int32"),
        ((x, rows.to(torch.uint8)), TypeError, "rows must be a 1-D (S,) int64 or int32"),
        ((x, rows[0]), TypeError, "rows must be a 1-D (S,) int64 or int32"),
        ((x.to(torch.complex64), rows), TypeError, "x must be a 2-D (T, H) floating tensor"),
        # Other layouts: a sparse x came back sparse (on a GPU: a stride error inside the
        # layout check), a sparse rows met index_select's IndexError, a nested one torch's
        # "Internal error".
        ((x.to_sparse(), rows), TypeError, "x must be a dense (strided) tensor; got layout "
                                           "torch.sparse_coo"),
        ((x, rows.to_sparse()), TypeError, "rows must be a dense (strided) tensor"),
        ((_nested(x[:2]), rows), TypeError, "x must be a dense (strided) tensor; got a nested"),
        ((x, _nested(rows[None])), TypeError, "rows must be a dense (strided) tensor; got a "
                                              "nested"),
        ((x, rows.tolist()), TypeError, "must be torch.Tensors; got Tensor, list"),
        # (meta stands in for another device: a CPU rows beside a GPU x reached the kernel)
        ((x, rows.to("meta")), ValueError, "rows must be on x's device cpu; got meta"),
        ((x[:0], rows), ValueError, "x has no rows for the 10 indices"),
    ]


@pytest.mark.parametrize("args, error, words", _bad_inputs())
def test_bad_inputs_are_refused_by_name(args, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        token_gather.gather_rows(*args)


def test_the_torch_switch(monkeypatch):
    class OnCuda:
        device = torch.device("cuda")

    monkeypatch.setenv(token_gather.TOKEN_GATHER_ENV, "torch")
    assert not token_gather._kernel_ok(OnCuda(), None)


@pytest.fixture
def on_gpu(monkeypatch):
    """As on a Hopper GPU with the kernel's switch on: the kernel (an emulator) wherever
    _layout_ok takes the tensors. Returns the emulators made, by (dtype, index dtype)."""
    made = {}
    monkeypatch.setattr(token_gather, "row_kernel_allowed", lambda t, switch: True)
    monkeypatch.setattr(token_gather, "_kernel",
                        lambda dtype, index: made.setdefault((dtype, index), _Emulator()))
    return made


def _kernel_calls(made):
    return sum(len(e.calls) for e in made.values())


def test_the_emulated_gpu_takes_the_kernel(on_gpu):
    x, rows = _inputs(40, 17, 64, seed=3)
    out = token_gather.gather_rows(x, rows)
    assert _kernel_calls(on_gpu) == 1 and torch.equal(out, x[rows])
    p = torch.nn.Parameter(x.float().bfloat16(), requires_grad=False)  # a plain tensor too
    assert type(token_gather.gather_rows(p, rows)) is torch.Tensor
    assert _kernel_calls(on_gpu) == 2


def test_a_fake_tensor_never_reaches_the_kernel(on_gpu):
    # A FakeTensor's data pointer is a placeholder: the kernel would have read and written
    # address 0 (make_fx, FakeTensorMode shape propagation on a GPU).
    with FakeTensorMode():
        x, rows = torch.empty(40, 64, dtype=torch.bfloat16), torch.zeros(17, dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no data_ptr of a FakeTensor is read)
            out = token_gather.gather_rows(x, rows)
    assert out.shape == (17, 64) and _kernel_calls(on_gpu) == 0


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_gather(on_gpu):
    # make_fx's tracer, FlopCounterMode, FakeTensorMode over real tensors: a kernel launch is
    # invisible to them (a traced graph would have lost the copy).
    x, rows = _inputs(40, 17, 64, seed=4)
    with _Seen() as seen:
        out = token_gather.gather_rows(x, rows)
    assert torch.ops.aten.index_select.default in seen.ops
    assert _kernel_calls(on_gpu) == 0 and torch.equal(out, x[rows])


class _Tagged(torch.Tensor):
    """A subclass with torch's default __torch_function__: results keep the type."""


def test_a_subclass_keeps_its_type(on_gpu):
    x, rows = _inputs(40, 17, 64, seed=5)
    out = token_gather.gather_rows(x.as_subclass(_Tagged), rows)
    assert type(out) is _Tagged and _kernel_calls(on_gpu) == 0
    assert torch.equal(out.as_subclass(torch.Tensor), x[rows])
    assert type(token_gather.gather_rows(x.as_subclass(_Tagged), rows)) is type(
        x.as_subclass(_Tagged).index_select(0, rows))
    token_gather.gather_rows(x, rows.as_subclass(_Tagged))
    assert _kernel_calls(on_gpu) == 0


def test_forward_mode_ad_differentiates_through_the_gather(on_gpu):
    # A dual tensor does not require grad: the kernel dropped its tangent (a zero jvp).
    x, rows = _inputs(40, 17, 64, seed=6)
    tangent = torch.randn_like(x)
    with fwad.dual_level():
        dual = fwad.make_dual(x, tangent)
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                out = fwad.unpack_dual(token_gather.gather_rows(dual, rows))
            assert torch.equal(out.primal, x[rows]) and torch.equal(out.tangent, tangent[rows])
        assert _kernel_calls(on_gpu) == 0
        token_gather.gather_rows(x, rows)  # not dual, in a dual level: the kernel
    assert _kernel_calls(on_gpu) == 1


def test_no_grad_and_inference_mode_take_the_kernel(on_gpu):
    x, rows = _inputs(40, 17, 64, seed=7)
    x.requires_grad_(True)
    out = token_gather.gather_rows(x, rows)
    assert out.requires_grad and _kernel_calls(on_gpu) == 0
    with torch.no_grad():
        assert not token_gather.gather_rows(x, rows).requires_grad
    with torch.inference_mode():
        assert not token_gather.gather_rows(x, rows).requires_grad
    assert _kernel_calls(on_gpu) == 2


def test_sizes_past_the_kernels_int32_indices_and_grid():
    ok = token_gather._layout_ok
    n = row_kernels.MAX_ROWS
    assert n + 8 <= 2**31 - 1  # (a CTA's 8 rows past the last: kernels/sm90/token_gather.ROWS)
    one = torch.zeros(1, 16, dtype=torch.bfloat16)
    rows = torch.zeros(4, dtype=torch.long)
    # (expanded: no memory) S routed rows; T rows of x
    assert ok(one, torch.zeros(1, dtype=torch.long).expand(n))
    assert not ok(one, torch.zeros(1, dtype=torch.long).expand(n + 1))
    assert ok(one.expand(n, 16), rows) and not ok(one.expand(n + 1, 16), rows)
    # Rows wider than 65535 CTAs of the gather's 64 threads' vectors: a launch error before.
    widest = row_kernels.MAX_GRID_Y * row_kernels.ROW_THREADS * 8
    assert widest == 33_553_920
    assert ok(torch.empty(1, widest, dtype=torch.bfloat16), rows)
    assert not ok(torch.empty(1, widest + 8, dtype=torch.bfloat16), rows)


def test_past_the_kernels_sizes_the_emulated_gpu_takes_index_select(on_gpu):
    x = torch.randn(1, 16).bfloat16().expand(row_kernels.MAX_ROWS + 5, 16)
    rows = torch.tensor([0, row_kernels.MAX_ROWS + 4, 7])
    out = token_gather.gather_rows(x, rows)
    assert _kernel_calls(on_gpu) == 0 and torch.equal(out, x[:1].expand(3, 16))


def test_int32_rows_of_an_x_of_2_31_rows_are_clamped():
    # On a GPU the index_select path clamps into [0, T - 1]: with T - 1 past int32's range,
    # int32 rows raised "value cannot be converted to type int without overflow".
    class OnCuda:
        device = torch.device("cuda")
        shape = (2**31 + 5, 16)

    rows = torch.tensor([-3, 7, 2**31 - 1], dtype=torch.int32)
    got = token_gather._clamped(OnCuda(), rows)
    assert got.dtype == torch.int32 and got.tolist() == [0, 7, 2**31 - 1]
    OnCuda.shape = (2**31, 16)  # T - 1 = int32's largest: clamped as usual
    assert token_gather._clamped(OnCuda(), rows).tolist() == [0, 7, 2**31 - 1]
    OnCuda.shape = (9, 16)
    assert token_gather._clamped(OnCuda(), rows).tolist() == [0, 7, 8]


def test_the_result_is_always_a_new_contiguous_tensor():
    x, rows = _inputs(12, 9, 32, seed=8)
    wide = torch.randn(12, 80).bfloat16()
    cases = [(x, rows), (x.t().contiguous().t(), rows), (wide[:, 8:40], rows),
             (x[:1].expand(12, 32), rows), (x, rows[:1].expand(9)), (x, rows[::2]),
             (x, rows[:1]), (x[:, :0], rows), (x, rows[:0]), (x[:0], rows[:0])]
    for xi, ri in cases:
        out = token_gather.gather_rows(xi, ri)
        assert out.shape == (ri.shape[0], xi.shape[1]) and out.is_contiguous()
        assert out.untyped_storage().data_ptr() != xi.untyped_storage().data_ptr() or (
            out.numel() == 0)
        assert torch.equal(out, xi[ri])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_other_floating_dtypes_take_index_select(dtype):
    x, rows = _inputs(12, 9, 32, seed=9)
    x = x.float().to(dtype)
    assert not token_gather._layout_ok(x, rows) or dtype == torch.float16
    out = token_gather.gather_rows(x, rows)
    assert out.dtype == dtype and torch.equal(out.view(torch.uint8) if dtype.itemsize == 1
                                              else out, (x.view(torch.uint8) if
                                                         dtype.itemsize == 1 else x)[rows])


def test_meta_tensors():
    x = torch.empty(2**31 + 5, 64, dtype=torch.bfloat16, device="meta")
    out = token_gather.gather_rows(x, torch.empty(100, dtype=torch.int32, device="meta"))
    assert out.shape == (100, 64) and out.device.type == "meta"


def test_torch_compile_fullgraph():
    def f(x, rows):
        return token_gather.gather_rows(x, rows) * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x, rows = _inputs(40, 17, 64, dtype=torch.float32, seed=10)
    assert torch.equal(compiled(x, rows), x[rows] * 2)
    assert torch.equal(compiled(x[:30], rows.clamp(max=29)), x[rows.clamp(max=29)] * 2)
    xg = x.clone().requires_grad_(True)
    compiled(xg, rows).sum().backward()
    assert torch.equal(xg.grad.sum(1), torch.bincount(rows, minlength=40).float() * 128)


def test_vmap():
    x, rows = _inputs(40, 17, 64, seed=11)
    xs = torch.stack([x, x + 1])
    assert torch.equal(torch.vmap(token_gather.gather_rows, in_dims=(0, None))(xs, rows),
                       xs[:, rows])
    rs = torch.stack([rows, rows.flip(0)])
    assert torch.equal(torch.vmap(token_gather.gather_rows, in_dims=(None, 0))(x, rs), x[rs])


@pytest.mark.parametrize("H", [64, 7, 2])
def test_fp8_rows_are_gathered_bit_for_bit(H):
    # FP8 rows move as 16-bit words where their width allows (the kernel on a GPU), else as
    # index_select: either way every bit, NaN and negative-zero encodings included, arrives as is.
    gen = torch.Generator().manual_seed(H)
    raw = torch.randint(0, 256, (9, H + 3), generator=gen, dtype=torch.uint8)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = raw.view(dtype)[:, :H]  # a strided view: rows H + 3 bytes apart
        index = torch.tensor([8, 0, 0, 3, 7], dtype=torch.int64)
        for src in (t, t.contiguous()):
            got = token_gather.gather_rows(src, index)
            assert got.dtype == dtype and got.shape == (5, H)
            assert torch.equal(got.view(torch.uint8), src.contiguous().view(torch.uint8)[index])


def test_fp8_rows_reach_the_kernel_as_16_bit_words(on_gpu):
    raw = torch.randint(0, 256, (12, 48), dtype=torch.uint8)
    index = torch.tensor([11, 0, 5, 5], dtype=torch.int64)
    x = raw.view(torch.float8_e4m3fn)
    out = token_gather.gather_rows(x[:, :32], index)  # rows 48 bytes apart: 24 words
    assert _kernel_calls(on_gpu) == 1 and (torch.bfloat16, torch.int64) in on_gpu
    assert out.dtype == x.dtype and torch.equal(out.view(torch.uint8), raw[index, :32])
    for odd in (x[:, :31], x[:, 1:33], x.reshape(-1)[:33 * 11].view(11, 33)):
        got = token_gather.gather_rows(odd, index.clamp(max=10))  # odd width, offset, stride
        assert torch.equal(got.view(torch.uint8), odd.contiguous().view(torch.uint8)[
            index.clamp(max=10)])
    assert _kernel_calls(on_gpu) == 1  # (those took index_select)
