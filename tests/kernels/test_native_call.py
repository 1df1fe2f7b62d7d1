"""grouped_gemm's C++ call path (kernels/native.py general_call) on the CPU.

The compiled kernel is replaced by a recorder, and CPU tensors stand in for CUDA ones
(require_cuda=False), so these tests check everything the module hands the kernel and the
caller: the outputs it makes without Python (shapes, strides, one fresh allocation per call,
no overlap), the metadata rows (the same as the Python host wrapper's), and its two caches
(problem set -> shape; operand addresses -> launch record). tests/kernels/test_grouped_gemm_gpu.py
runs the same path on the GPU with real arithmetic.
"""

from __future__ import annotations

import random

import pytest
import torch

from moe_gemm.config import GemmConfig
from moe_gemm.kernels import host_sm90 as host
from moe_gemm.kernels import native
from moe_gemm.kernels.support import analyze_general
from moe_gemm.validation import check_grouped_gemm

from .host_fakes import Recorder, check_outputs

pytestmark = pytest.mark.skipif(
    native.status() != "native", reason=f"C++ module unavailable: {native.status()}")

def call(a, b, out_dtype=None, config=None):
    return native.general_call(a, b, out_dtype, config, require_cuda=False)


def stats() -> tuple[int, int]:
    """(problem sets, launch records) the module keeps."""
    return native.loaded().stats()[:2]


def made_here() -> int:
    """Launch records the module has made itself (addresses seen a second time) so far."""
    return native.loaded().stats()[2]


def one_offs() -> int:
    """Launches through a template's scratch metadata (addresses seen once) so far."""
    return native.loaded().stats()[3]


def _problems(sizes, dtype=torch.bfloat16, k_major=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(m, k, generator=gen).to(dtype) for m, n, k in sizes]
    if k_major:
        b = [torch.randn(n, k, generator=gen).to(dtype).t() for m, n, k in sizes]
    else:
        b = [torch.randn(k, n, generator=gen).to(dtype) for m, n, k in sizes]
    return a, b


def _python_launch(a, b, out_dtype=None, config=GemmConfig()):
    """The Python host wrapper's launch on the same operands: (metadata, outputs)."""
    args = check_grouped_gemm(a, b, None, out_dtype)
    layout = analyze_general(args)
    assert not isinstance(layout, str), layout
    gl = host.GeneralLaunch(args, config, layout=layout)
    return gl, gl.launch()


def _check_outputs(outs, sizes, dtype) -> None:
    check_outputs(outs, sizes, dtype)
    for o in outs:  # plain CPU tensors, outside autograd, empty ones included
        assert o.device.type == "cpu" and o.is_contiguous()
        assert not o.requires_grad and o.grad_fn is None


@pytest.mark.parametrize("seed", range(6))
def test_same_metadata_and_outputs_as_the_python_wrapper(kernel: Recorder, seed: int) -> None:
    rng = random.Random(seed)
    one_n = seed % 2 == 0  # one N (one block split by rows) or several (flat padded pieces)
    n0 = 8 * rng.randint(1, 40)
    sizes = [(rng.choice([0, 1, 5, 64, 129]), n0 if one_n else 8 * rng.randint(1, 40),
              8 * rng.randint(0, 40)) for _ in range(rng.randint(1, 24))]
    a, b = _problems(sizes, k_major=seed % 3 == 0, seed=seed)
    out_dtype = [None, torch.float32, torch.float16][seed % 3]
    outs = call(a, b, out_dtype)
    assert outs is not None
    dtype = out_dtype or torch.bfloat16
    _check_outputs(outs, sizes, dtype)
    gl, py_outs = _python_launch(a, b, out_dtype)
    if not gl.shape.total:
        assert kernel.calls == []
        return
    ours, theirs = kernel.calls[0], kernel.calls[1]
    assert len(ours) == len(theirs) == 16
    assert torch.equal(ours[3], theirs[3])  # metadata rows
    for i in (9, 10, 11, 12, 13, 14):  # G, CTAs, swizzle, policies, PDL
        assert ours[i] == theirs[i]
    # d_base is the block's start: each output sits at its metadata offset from it.
    d_base = ours[15]
    rows = {p: r for p, r in zip(host.last_launch().order, ours[3].tolist())}
    for i, o in enumerate(outs):
        if o.numel():
            assert o.data_ptr() - d_base == rows[i][2]
            assert o.stride(0) == rows[i][5]
    # The Python wrapper's outputs have the same layout relative to its block.
    assert [o.data_ptr() - d_base for o in outs if o.numel()] == [
        o.data_ptr() - theirs[15] for o in py_outs if o.numel()]


def test_repeated_call_launches_from_the_record(kernel: Recorder) -> None:
    sizes = [(64, 128, 256), (17, 128, 64), (0, 128, 32), (1, 128, 128)]
    a, b = _problems(sizes)
    first = call(a, b)
    assert stats() == (1, 1)
    second = call(a, b)
    assert stats() == (1, 1) and len(kernel.calls) == 2
    # Same metadata upload and arguments; a fresh output block each call.
    assert kernel.calls[0][3] is kernel.calls[1][3]
    assert kernel.calls[0][:15] == kernel.calls[1][:15]
    assert kernel.calls[1][15] == second[0].data_ptr() != first[0].data_ptr()
    first[1].fill_(3.0)
    assert not torch.equal(second[1], first[1])  # no shared memory between calls
    info = host.last_launch()
    assert info is not None and info.num_problems == len(sizes)
    # New operand addresses, seen once: launched through the template's scratch rows (made in
    # C++, no record kept); seen again: a launch record of their own; then launched from it.
    a2 = [t.clone() for t in a]
    made, once = made_here(), one_offs()
    call(a2, b)
    assert stats() == (1, 1) and (made_here(), one_offs()) == (made, once + 1)
    scratch = kernel.calls[2][3]
    assert scratch is not kernel.calls[0][3]
    assert scratch[:, 0].tolist() != kernel.calls[0][3][:, 0].tolist()
    call(a2, b)
    assert stats() == (1, 2) and (made_here(), one_offs()) == (made + 1, once + 1)
    assert kernel.calls[3][3] is not scratch and torch.equal(kernel.calls[3][3], scratch)
    call(a2, b)
    assert stats() == (1, 2) and (made_here(), one_offs()) == (made + 1, once + 1)
    assert kernel.calls[4][3] is kernel.calls[3][3]
    call([t.clone() for t in a], b)  # the scratch rows are reused for the next one-off
    assert kernel.calls[5][3] is scratch and one_offs() == once + 2


@pytest.mark.parametrize("seed", range(8))
def test_records_for_new_addresses_match_the_python_wrapper(kernel: Recorder, seed: int) -> None:
    """A launch record the module makes for new operand addresses (from the problem set's
    last record on this stream and thread) hands the kernel what the Python host wrapper
    would: metadata rows in launch order (K-sorted sets included), and every other argument."""
    rng = random.Random(100 + seed)
    one_n = seed % 2 == 0
    n0 = 8 * rng.randint(1, 40)
    # Varied K (the default K-sorts such sets) with empty problems and M = 1 among them.
    sizes = [(rng.choice([0, 1, 5, 64, 129, 300]), n0 if one_n else 8 * rng.randint(1, 40),
              8 * rng.randint(0, 96)) for _ in range(rng.randint(2, 40))]
    sizes[0] = (64, sizes[0][1], 512)  # at least one tile of work
    k_major = seed % 3 == 0
    out_dtype = [None, torch.float32, torch.float16][seed % 3]
    config = {1: GemmConfig(schedule="cooperative"), 3: GemmConfig(sort_by_k=True)}.get(seed % 4)
    a, b = _problems(sizes, k_major=k_major, seed=seed)
    assert call(a, b, out_dtype, config) is not None  # the Python-made record (the template)
    made, once = made_here(), one_offs()
    # Every operand list stays alive to the end: a freed block handed back by the allocator
    # would be a second sighting (or a hit on an earlier record), not the new address meant.
    alive = [a, b]
    for turn in range(6):  # new A, then the same again (a record); new B too from turn 4
        if turn % 2 == 0:
            a = [t.clone() for t in a]
        if turn == 4:
            b = [t.clone() if not k_major else t.t().clone().t() for t in b]
        alive += [a, b]
        outs = call(a, b, out_dtype, config)
        assert (made_here(), one_offs()) == (made + (turn + 1) // 2, once + turn // 2 + 1)
        ours = kernel.calls[-1]
        _check_outputs(outs, sizes, out_dtype or torch.bfloat16)
        gl, _ = _python_launch(a, b, out_dtype, config or GemmConfig())
        theirs = kernel.calls[-1]
        assert torch.equal(ours[3], theirs[3])  # metadata rows, launch order
        assert ours[3].dtype == torch.int64 and ours[3].shape == (len(sizes), 8)
        assert ours[4].dtype == torch.int32 and ours[4].data_ptr() == ours[3].data_ptr()
        assert torch.equal(ours[4], ours[3].view(torch.int32))
        for i in (0, 1, 2, 5, 6):  # placeholders and the tile table: the template's
            assert ours[i].shape == theirs[i].shape and ours[i].dtype == theirs[i].dtype
        for i in (9, 10, 11, 12, 13, 14):  # G, CTAs, swizzle, policies, PDL
            assert ours[i] == theirs[i]
        assert ours[15] == outs[0].data_ptr() - outs[0].storage_offset() * outs[0].element_size()
        assert host.last_launch().order == gl.shape.launch_order
        if seed % 4 == 3:  # K-sorted: rows in an order that is not the caller's
            assert gl.shape.order is not None


def test_records_for_new_addresses_are_per_stream_and_thread(kernel: Recorder) -> None:
    """Another thread's first launch of a problem set goes through Python (its workspace is
    the thread's own); after that its new addresses get records made in C++ too."""
    import threading

    a, b = _problems([(32, 64, 128), (16, 64, 64)])
    call(a, b)
    before = made_here()
    made = []

    def other_thread() -> None:
        a1 = [t.clone() for t in a]  # kept alive, so a2 cannot reuse its blocks
        call(a1, b)
        made.append((made_here(), one_offs()))
        a2 = [t.clone() for t in a]
        call(a2, b)
        made.append((made_here(), one_offs()))
        call(a2, b)
        made.append((made_here(), one_offs()))

    once = one_offs()
    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert made == [(before, once), (before, once + 1), (before + 1, once + 1)]
    assert stats() == (1, 3)


def test_a_failing_launch_from_a_made_record(kernel: Recorder) -> None:
    a, b = _problems([(8, 32, 64)])
    call(a, b)
    a1 = [a[0].clone()]
    kernel.fail = RuntimeError("launch failed")
    with pytest.raises(RuntimeError, match="launch failed"):
        call(a1, b)  # one-off launch
    with pytest.raises(RuntimeError, match="launch failed"):
        call(a1, b)  # from a record made here
    kernel.fail = None
    assert call(a1, b) is not None
    assert call([a[0].clone()], b) is not None


def test_problem_set_key(kernel: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _problems([(32, 64, 64), (16, 64, 64)])
    call(a, b)
    call(a, b, torch.float32)  # output dtype
    cfg = GemmConfig(schedule="cooperative")
    call(a, b, None, cfg)  # config
    call(a, b, None, cfg)
    assert stats() == (3, 3)
    monkeypatch.setenv("MOE_GEMM_L2_HINTS", "first,normal")  # the kernel choice reads it
    call(a, b)
    assert stats() == (4, 4)
    a3, b3 = _problems([(32, 64, 64), (16, 64, 128)])
    call(a3, b3)  # sizes
    assert stats() == (5, 5)


def test_outputs_are_independent_tensors(kernel: Recorder) -> None:
    a, b = _problems([(8, 32, 64)] * 3)
    outs = call(a, b)
    assert all(o._base is None for o in outs)
    outs[0].zero_()
    outs[1].fill_(1.0)
    assert outs[0].abs().sum() == 0 and torch.equal(outs[1], torch.ones(8, 32, dtype=outs[1].dtype))
    v0 = outs[0]._version
    outs[1].add_(1)
    assert outs[0]._version == v0  # own version counters
    y = outs[2].float().requires_grad_()
    (y * 2).sum().backward()  # usable in autograd like any tensor
    assert torch.equal(y.grad, torch.full_like(y, 2.0))


def test_declines_grad_under_grad_mode_only(kernel: Recorder) -> None:
    a, b = _problems([(8, 32, 64)] * 2)
    w = [t.clone().requires_grad_() for t in b]
    assert call(a, w) is None
    with torch.no_grad():
        assert call(a, w) is not None
    with torch.inference_mode():
        assert call(a, w) is not None
    params = [torch.nn.Parameter(t.clone()) for t in b]
    assert call(a, params) is None
    with torch.no_grad():
        assert call(a, params) is not None


def test_declines_when_cute_is_disabled(kernel: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _problems([(8, 32, 64)])
    assert call(a, b) is not None
    monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", "1")
    assert call(a, b) is None
    monkeypatch.setenv("MOE_GEMM_DISABLE_CUTE", "0")
    assert call(a, b) is not None


def test_declines_what_the_python_scan_declines(kernel: Recorder) -> None:
    a, b = _problems([(8, 32, 64), (8, 32, 64)])
    assert call(a, [b[0], b[1].t().contiguous().t()]) is None  # mixed B majors
    assert call([a[0]], b) is None  # counts differ
    assert call(a, b, torch.int8) is None
    assert call(a, b, "float32") is None
    assert call(tuple(a), tuple(b)) is not None
    assert call(iter(a), b) is None
    assert kernel.calls and stats()[0] == 1


def test_all_empty_problem_set_launches_nothing(kernel: Recorder) -> None:
    a, b = _problems([(0, 32, 64), (5, 0, 16)])
    for _ in range(2):
        outs = call(a, b)
        assert [tuple(o.shape) for o in outs] == [(0, 32), (5, 0)]
    assert kernel.calls == []


def test_a_failing_launch_raises_and_returns_nothing(kernel: Recorder) -> None:
    a, b = _problems([(8, 32, 64)])
    call(a, b)
    kernel.fail = RuntimeError("launch failed")
    with pytest.raises(RuntimeError, match="launch failed"):
        call(a, b)
    kernel.fail = None
    assert call(a, b) is not None


def test_launch_records_are_bounded(kernel: Recorder) -> None:
    a, b = _problems([(8, 32, 64)])
    most, kept = 0, []
    for _ in range(1030):
        a1 = [a[0].clone()]
        kept.append(a1)  # no address comes back
        call(a1, b)  # seen once: no record
        call(a1, b)  # seen again: a record
        most = max(most, stats()[1])
        assert stats()[1] <= 1024
    assert most == 1024 and stats()[0] == 1


def test_python_scan_block_bypasses_the_module(kernel: Recorder) -> None:
    a, b = _problems([(8, 32, 64)])
    with native.python_scan():
        assert call(a, b) is None
    assert call(a, b) is not None


def test_declines_functorch_and_functionalize_and_modes(kernel: Recorder) -> None:
    """Operands or thread states only torch should handle: declined, never a crash or a
    launch with null pointers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    a, b = _problems([(16, 32, 64)] * 2)
    call(a, b)  # a problem set and a launch record exist
    seen = []

    def under_transform(x):
        seen.append(call([x, a[1]], b))
        seen.append(native.loaded().scan([x, a[1]], b, -1, 0))
        return x

    torch.func.vmap(under_transform)(torch.randn(3, 16, 64).to(torch.bfloat16))
    torch.func.functionalize(under_transform)(a[0])
    torch.func.grad(lambda x: under_transform(x).float().sum())(a[0].float().bfloat16())
    assert seen == [None] * len(seen) and len(seen) == 6

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    launched = len(kernel.calls)
    with Log():
        assert call(a, b) is None
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert call(a, b) is None
    assert len(kernel.calls) == launched
    assert call(a, b) is not None  # and back to normal


def test_neg_views_and_odd_b_strides_are_declined_by_both_scans(kernel: Recorder) -> None:
    from moe_gemm.kernels.support import fast_general

    a, b = _problems([(16, 32, 64)])
    neg = [torch._neg_view(b[0])]
    assert call(a, neg) is None
    assert fast_general(a, neg, None, require_cuda=False) is None
    # K == 1, K-major B whose N stride is 33 elements (66 bytes): TMA needs 16-byte strides.
    w = torch.randn(32, 33).to(torch.bfloat16)
    b1 = [w[:, :1].t()]  # (1, 32), strides (1, 33)
    a1 = [torch.randn(16, 1).to(torch.bfloat16)]
    assert call(a1, b1) is None
    assert fast_general(a1, b1, None, require_cuda=False) is None
    assert isinstance(analyze_general(check_grouped_gemm(a1, b1, None, None)), str)


def test_cpu_and_cuda0_never_share_an_entry(kernel: Recorder) -> None:
    a, b = _problems([(16, 32, 64)])
    res = native.loaded().scan(a, b, -1, 0)
    assert res is not None and res[0] >> 21 & 1  # the CPU bit is part of the problem-set key


def test_pdl_is_part_of_the_key(kernel: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _problems([(16, 32, 64)])
    call(a, b)
    assert kernel.calls[-1][14] == 0
    monkeypatch.setattr(host, "PDL", 1)
    call(a, b)
    assert kernel.calls[-1][14] == 1
    monkeypatch.setattr(host, "PDL", 0)
    call(a, b)
    assert kernel.calls[-1][14] == 0


def test_equal_configs_share_entries(kernel: Recorder) -> None:
    a, b = _problems([(16, 32, 64)])
    for _ in range(5):
        call(a, b, None, GemmConfig(schedule="cooperative"))
    assert stats() == (1, 1)


# Metadata uploads through the module's pinned ring (upload_ring.h). On the CPU the driver is
# replaced by fakes: copies run at once or queue until flushed (a GPU behind the host), and
# events complete once nothing is queued, unless told not to.

def uploads() -> tuple[int, int]:
    """Metadata uploads so far: (through the ring, through torch's copy)."""
    return native.loaded().stats()[4:6]


@pytest.fixture
def ring():
    """The fake driver, with 512-byte chunks (two uploads of three problems each)."""
    mod = native.loaded()

    def set_state(not_ready: bool = False, fail: bool = False, defer: bool = False,
                  flush: bool = False) -> None:
        mod.upload_testing(1, 512, not_ready | fail << 1 | defer << 2 | flush << 3)

    set_state()
    yield set_state
    mod.upload_testing(0, 0, 0)


def _one_off_rows(kernel: Recorder, a, b, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the metadata rows a call on new addresses hands the kernel, the Python wrapper's)."""
    call(a, b, None, config)
    ours = kernel.calls[-1][3].clone()  # scratch rows: rewritten by the next one-off
    _python_launch(a, b, None, config or GemmConfig())
    return ours, kernel.calls[-1][3]


def test_without_a_driver_uploads_go_through_torch(kernel: Recorder) -> None:
    a, b = _problems([(8, 32, 64), (3, 32, 16)])
    call(a, b)
    before = uploads()
    kept = [[t.clone() for t in a] for _ in range(3)]
    for a1 in kept:
        call(a1, b)
    assert uploads() == (before[0], before[1] + 3)


@pytest.mark.parametrize("config", [None, GemmConfig(sort_by_k=True)])
def test_ring_uploads_the_same_rows_as_the_python_wrapper(kernel: Recorder, ring,
                                                          config) -> None:
    """Many laps of the ring (16 uploads a lap here), one-off launches and made records,
    K-sorted rows: every call's rows equal the Python wrapper's."""
    sizes = [(64, 32, 512), (0, 32, 64), (5, 32, 1024)]
    a, b = _problems(sizes)
    before = uploads()
    call(a, b, None, config)  # the first launch's rows go up through the ring too
    first = kernel.calls[-1][3].clone()
    _python_launch(a, b, None, config or GemmConfig())
    assert torch.equal(first, kernel.calls[-1][3])
    assert uploads() == (before[0] + 1, before[1])
    before, kept = uploads(), []
    for i in range(50):
        a1 = [t.clone() for t in a]
        kept.append(a1)
        ours, theirs = _one_off_rows(kernel, a1, b, config)
        assert torch.equal(ours, theirs), i
        if i % 5 == 0:  # seen again: a record of its own, uploaded through the ring too
            call(a1, b, None, config)
            assert torch.equal(kernel.calls[-1][3], theirs)
    assert uploads() == (before[0] + 60, before[1])


def test_ring_declines_while_the_gpu_is_a_lap_behind(kernel: Recorder, ring) -> None:
    """A chunk whose fence has not completed is not written: the upload goes through torch
    (still the right rows) until the GPU catches up."""
    a, b = _problems([(64, 32, 512), (7, 32, 64), (5, 32, 128)])
    kept = []

    def one_off() -> None:
        a1 = [t.clone() for t in a]
        kept.append(a1)
        ours, theirs = _one_off_rows(kernel, a1, b)
        assert torch.equal(ours, theirs)

    before = uploads()
    ring(not_ready=True)  # fences recorded from now on never complete
    call(a, b)  # the first launch: the lap's first upload
    for _ in range(15):  # the rest of the lap: 8 chunks of 2, none fenced yet
        one_off()
    assert uploads() == (before[0] + 16, before[1])
    for _ in range(3):  # back at the first chunk: its fence is pending
        one_off()
    assert uploads() == (before[0] + 16, before[1] + 3)
    ring(not_ready=False)  # caught up
    one_off()
    assert uploads() == (before[0] + 17, before[1] + 3)


def test_ring_copy_failure_falls_back_to_torch(kernel: Recorder, ring) -> None:
    a, b = _problems([(64, 32, 512), (9, 32, 64)])
    call(a, b)
    before = uploads()
    ring(fail=True)
    a1 = [t.clone() for t in a]
    ours, theirs = _one_off_rows(kernel, a1, b)
    assert torch.equal(ours, theirs)
    assert uploads() == (before[0], before[1] + 1)
    ring(fail=False)
    a2 = [t.clone() for t in a]
    ours, theirs = _one_off_rows(kernel, a2, b)
    assert torch.equal(ours, theirs)
    assert uploads() == (before[0] + 1, before[1] + 1)


def test_ring_takes_uploads_up_to_a_chunk(kernel: Recorder, ring) -> None:
    """Rows larger than a chunk (512 bytes: 8 problems) go through torch."""
    sizes = [(16, 32, 64)] * 8
    a, b = _problems(sizes)
    call(a, b)
    a1 = [t.clone() for t in a]
    before = uploads()
    ours, theirs = _one_off_rows(kernel, a1, b)
    assert torch.equal(ours, theirs) and uploads() == (before[0] + 1, before[1])
    a9, b9 = _problems(sizes + [(16, 32, 64)])
    call(a9, b9)
    a10 = [t.clone() for t in a9]
    ours, theirs = _one_off_rows(kernel, a10, b9)
    assert torch.equal(ours, theirs) and uploads() == (before[0] + 1, before[1] + 2)


def test_ring_never_overwrites_rows_a_queued_copy_reads(kernel: Recorder, ring) -> None:
    """Copies queued behind the host (the fakes run them only when flushed) read their rows
    when they run: records made meanwhile each get their own rows, past a lap too (the ring
    then declines to torch rather than write over a queued copy's rows)."""
    sizes = [(64, 32, 512), (3, 32, 64), (5, 32, 1024)]
    a, b = _problems(sizes)
    ring(defer=True)
    before = uploads()
    call(a, b)  # the lap's first upload
    kept = [[t.clone() for t in a] for _ in range(10)]
    first = kernel.calls[-1][3]
    for a1 in kept:  # seen once: the scratch rows (the rest of chunk 0, chunks 1-5)
        call(a1, b)
    made = []
    for a1 in kept:  # seen again: records of their own, two to a chunk (6-7), then torch
        call(a1, b)
        made.append(kernel.calls[-1][3])
    ring(flush=True)
    assert uploads() == (before[0] + 16, before[1] + 5)  # a lap of 16, then torch
    made.append(first)
    kept.append(a)
    for rows, a1 in zip(made, kept):
        _python_launch(a1, b)
        assert torch.equal(rows, kernel.calls[-1][3])


def test_upload_rows_of_an_unknown_problem_set_is_none(kernel: Recorder) -> None:
    """The first launch's rows come from the module only for a remembered problem set; else
    the caller makes them (GeneralShape.metadata)."""
    mod = native.loaded()
    a, b = _problems([(8, 32, 64), (3, 32, 16)])
    code, cols = mod.scan(a, b, -1, 0)
    req = native.PDL_FLAG if host.PDL else 0  # as general_call's for CPU tensors
    assert mod.upload_rows(cols, code, -1, req, None, 0) is None
    call(a, b)  # remembered now
    rows = mod.upload_rows(cols, code, -1, req, None, 0)
    _python_launch(a, b)
    assert torch.equal(rows, kernel.calls[-1][3])
    with pytest.raises(TypeError):
        mod.upload_rows(cols, code, -1, req, None)


def test_first_launch_rows_made_in_python_where_the_module_has_none(
        kernel: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """upload_rows answers None when the problem set was forgotten between remember_shape and
    the launch (another thread filled the cache): the rows are then made in Python, the same."""
    mod = native.loaded()
    monkeypatch.setattr(mod, "upload_rows", lambda *args: None)
    a, b = _problems([(40, 32, 64), (0, 32, 16), (9, 32, 128)])
    call(a, b)
    ours = kernel.calls[-1][3]
    _python_launch(a, b)
    assert torch.equal(ours, kernel.calls[-1][3]) and ours.dtype == torch.int64
