"""grouped_mm's C++ call path (kernels/native.py mm_call / remember_mm, native/mm_call.h) on
the CPU.

Real MmPlan / BmmPlan objects are made on CPU tensors with the compiled kernel replaced by a
recorder (require_cuda=False; the module then calls the kernel from Python instead of through
its TVM-FFI handle). These tests check what the module hands the kernel (the same arguments as
the plan's own call, the call's x, w, offs and a fresh output in their slots), what it returns,
and what its key tells apart. tests/kernels/test_grouped_gemm_gpu.py runs the same path on the
GPU through the TVM-FFI C call, with real arithmetic.
"""

from __future__ import annotations

import threading

import pytest
import torch

from moe_gemm.config import GemmConfig
from moe_gemm.kernels import host_sm90 as host
from moe_gemm.kernels import native
from moe_gemm.validation import check_grouped_bmm, check_grouped_mm

from .host_fakes import Recorder, clear_caches, install

pytestmark = pytest.mark.skipif(
    native.status() != "native", reason=f"C++ module unavailable: {native.status()}")

CFG = GemmConfig()


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch):
    rec = Recorder()
    clear_caches()
    install(monkeypatch, rec)
    monkeypatch.setattr(host, "_compiled", lambda key: rec)
    monkeypatch.setattr(host, "_grid", lambda device, nsm, size, units: (
        min(nsm // size, units) * size, -(-units // max(1, min(nsm // size, units)))))
    monkeypatch.delenv("MOE_GEMM_CHECK_OFFS", raising=False)
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
    yield rec
    clear_caches()


def varlen(T=200, E=5, K=64, N=96, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(dtype)
    w = torch.randn(E, K, N, generator=gen).to(dtype)
    offs = torch.tensor([3, 3, 70, 150, 190][:E], dtype=torch.int32)
    return x, w, offs


def plan_for(x, w, offs, out=None, out_dtype=None, config=CFG):
    if offs is None:
        return host.BmmPlan(check_grouped_bmm(x, w, out, out_dtype), config)
    return host.MmPlan(check_grouped_mm(x, w, offs, out, out_dtype), config)


def remember(x, w, offs, plan, out=None, out_dtype=None, config=None) -> bool:
    return native.remember_mm(x, w, offs, out, config, out_dtype, plan, require_cuda=False)


def call(x, w, offs, out=None, out_dtype=None, config=None):
    return native.mm_call(x, w, offs, out, config, out_dtype, require_cuda=False)


def mm_stats() -> tuple[int, int, int]:
    return native.mm_stats()


WORKSPACE = 6  # its index once the output is left out (the fakes make one per call)


def same_args(got: tuple, want: tuple) -> None:
    """The same kernel arguments (all but the output): tensors by memory and layout (the
    workspace by layout), ints by value."""
    assert len(got) == len(want) == 15
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor)
            assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
            assert i == WORKSPACE or g.data_ptr() == w.data_ptr()
        else:
            assert g == w


def test_launches_the_plans_call_with_a_fresh_output(kernel: Recorder) -> None:
    x, w, offs = varlen()
    plan = plan_for(x, w, offs)
    assert call(x, w, offs) is False  # no entry yet
    plan(x, w, offs, None)
    want = kernel.calls[-1]
    assert remember(x, w, offs, plan)
    before = mm_stats()
    y = call(x, w, offs)
    assert isinstance(y, torch.Tensor) and y.shape == (200, 96) and y.dtype == torch.bfloat16
    assert y.is_contiguous()
    got = kernel.calls[-1]
    assert got[2] is y
    same_args(got[:2] + got[3:], want[:2] + want[3:])
    assert got[0] is x and got[1] is w and got[5] is offs
    assert mm_stats()[2] == before[2] + 1
    assert host._local.raw[1:3] == (plan.num_ctas, plan.num_problems)
    y2 = call(x, w, offs)
    assert y2 is not y  # a new output each call


def test_offs_values_and_addresses_are_not_part_of_the_key(kernel: Recorder) -> None:
    x, w, offs = varlen()
    plan = plan_for(x, w, offs)
    assert remember(x, w, offs, plan)
    x2 = x.clone()
    offs2 = torch.tensor([0, 50, 60, 61, 199], dtype=torch.int32)
    y = call(x2, w, offs2)
    assert isinstance(y, torch.Tensor)
    assert kernel.calls[-1][0] is x2 and kernel.calls[-1][5] is offs2


@pytest.mark.parametrize("change", ["T", "K-stride", "dtype", "w-layout", "align", "out_dtype",
                                    "config", "l2", "tail", "pdl", "out"])
def test_what_the_key_tells_apart(kernel: Recorder, monkeypatch: pytest.MonkeyPatch,
                                  change: str) -> None:
    x, w, offs = varlen()
    assert remember(x, w, offs, plan_for(x, w, offs))
    kw: dict = {}
    if change == "T":
        x = torch.randn(208, 64).to(torch.bfloat16)
    elif change == "K-stride":
        x = torch.randn(200, 72).to(torch.bfloat16)[:, :64]
    elif change == "dtype":
        x, w = x.half(), w.half()
    elif change == "w-layout":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "align":
        x = torch.randn(200 * 64 + 4).to(torch.bfloat16)[4:].view(200, 64)
    elif change == "out_dtype":
        kw["out_dtype"] = torch.float32
    elif change == "config":
        kw["config"] = GemmConfig(schedule="cooperative")
    elif change == "l2":
        monkeypatch.setenv("MOE_GEMM_L2_HINTS", "1")
    elif change == "tail":
        monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    elif change == "pdl":
        monkeypatch.setattr(host, "PDL", 1 - host.PDL)
    elif change == "out":
        kw["out"] = torch.empty(200, 96, dtype=torch.bfloat16)
    assert call(x, w, offs, **kw) is False


def test_equal_configs_share_an_entry(kernel: Recorder) -> None:
    x, w, offs = varlen()
    cfg = GemmConfig(schedule="pingpong")
    assert remember(x, w, offs, plan_for(x, w, offs, config=cfg), config=cfg)
    assert isinstance(call(x, w, offs, config=GemmConfig(schedule="pingpong")), torch.Tensor)


def test_out_given_is_written_and_returned(kernel: Recorder) -> None:
    x, w, offs = varlen()
    out = torch.empty(200, 96, dtype=torch.float32)
    plan = plan_for(x, w, offs, out=out, out_dtype=torch.float32)
    assert remember(x, w, offs, plan, out=out, out_dtype=torch.float32)
    out2 = torch.empty(200, 96, dtype=torch.float32)
    y = call(x, w, offs, out=out2, out_dtype=torch.float32)
    assert y is out2 and kernel.calls[-1][2] is out2
    assert kernel.calls[-1][9] == plan.num_problems == 5  # no zero-tail problem with `out`


def test_out_sharing_memory_with_an_operand_is_declined(kernel: Recorder) -> None:
    x, w, offs = varlen(K=96)
    buf = torch.randn(2, 200, 96).to(torch.bfloat16)
    x, out = buf[0], buf[1]
    assert remember(x, w, offs, plan_for(x, w, offs, out=out), out=out)
    assert call(x, w, offs, out=out) is None
    # Another storage over the same memory (a second tensor made from the same buffer).
    alias = torch.from_dlpack(buf[1].__dlpack__()) if hasattr(buf, "__dlpack__") else None
    if alias is not None:
        assert alias.untyped_storage().data_ptr() == buf[1].data_ptr()
        assert call(x, w, offs, out=alias) is None
    other = torch.empty(200, 96, dtype=torch.bfloat16)
    assert remember(x, w, offs, plan_for(x, w, offs, out=other), out=other)
    assert call(x, w, offs, out=other) is other


def test_batched_form_passes_the_plans_placeholder_offs(kernel: Recorder) -> None:
    x = torch.randn(4, 40, 64).to(torch.bfloat16)
    w = torch.randn(4, 64, 96).to(torch.bfloat16)
    plan = plan_for(x, w, None)
    plan(x, w, None)
    want = kernel.calls[-1]
    assert remember(x, w, None, plan)
    y = call(x, w, None)
    assert y.shape == (4, 40, 96)
    got = kernel.calls[-1]
    assert got[2] is y
    same_args(got[:2] + got[3:], want[:2] + want[3:])


def test_trivial_and_host_visitor_plans_have_no_entry(kernel: Recorder) -> None:
    x, w, offs = varlen()
    assert not remember(x, w, offs, plan_for(x, w, offs, config=GemmConfig(visitor="host")),
                        config=GemmConfig(visitor="host"))
    x0 = torch.empty(0, 64, dtype=torch.bfloat16)
    zeros = torch.zeros(5, dtype=torch.int32)
    assert not remember(x0, w, zeros, plan_for(x0, w, zeros))
    assert mm_stats()[0] == 0


def test_declines_grad_under_grad_mode_only(kernel: Recorder) -> None:
    x, w, offs = varlen()
    assert remember(x, w, offs, plan_for(x, w, offs))
    xg = x.clone().requires_grad_()
    assert call(xg, w, offs) is None
    with torch.no_grad():
        assert isinstance(call(xg, w, offs), torch.Tensor)
    out = torch.empty(200, 96, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        assert call(x, w, offs, out=out) is None


@pytest.mark.parametrize("switch", ["MOE_GEMM_DISABLE_CUTE", "MOE_GEMM_CHECK_OFFS"])
def test_declines_under_switches(kernel: Recorder, monkeypatch: pytest.MonkeyPatch,
                                 switch: str) -> None:
    x, w, offs = varlen()
    assert remember(x, w, offs, plan_for(x, w, offs))
    monkeypatch.setenv(switch, "1")
    assert call(x, w, offs) is None
    monkeypatch.setenv(switch, "0")
    assert isinstance(call(x, w, offs), torch.Tensor)


def test_declines_subclasses_modes_and_lazy_views(kernel: Recorder) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w, offs = varlen()
    assert remember(x, w, offs, plan_for(x, w, offs))

    class Sub(torch.Tensor):
        pass

    assert call(x.as_subclass(Sub), w, offs) is None
    assert call(x._neg_view(), w, offs) is None

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert call(x, w, offs) is None
    assert call("x", w, offs) is None
    assert call(x, w, offs.tolist()) is None
    assert call(x, w, offs, out_dtype="bf16") is None
    assert call(x, w, offs, config={}) is None  # validation names the type
    assert call(x, w, offs, config="torch") is None
    # A Parameter is a plain tensor.
    assert isinstance(call(x, torch.nn.Parameter(w, requires_grad=False), offs), torch.Tensor)


def test_entries_are_per_thread(kernel: Recorder) -> None:
    x, w, offs = varlen()
    assert remember(x, w, offs, plan_for(x, w, offs))
    seen = []
    t = threading.Thread(target=lambda: seen.append(call(x, w, offs)))
    t.start()
    t.join()
    assert seen == [False]


def test_a_failing_kernel_raises_and_returns_nothing(kernel: Recorder) -> None:
    x, w, offs = varlen()
    assert remember(x, w, offs, plan_for(x, w, offs))
    kernel.fail = RuntimeError("launch failed")
    with pytest.raises(RuntimeError, match="launch failed"):
        call(x, w, offs)
    kernel.fail = None
    assert isinstance(call(x, w, offs), torch.Tensor)


def test_bad_entries_are_refused(kernel: Recorder) -> None:
    x, w, offs = varlen()
    plan = plan_for(x, w, offs)
    mod = native.loaded()
    k, args, shape, raw = plan.native_entry()
    with pytest.raises(TypeError):
        mod.remember_mm(x, w, offs, None, None, -1, 0, k, 0, args[:-1], shape, 0, raw, 0)
    bad = (x,) + args[1:]
    with pytest.raises(ValueError, match="slots"):
        mod.remember_mm(x, w, offs, None, None, -1, 0, k, 0, bad, shape, 0, raw, 0)
    bad = args[:3] + ("meta",) + args[4:]
    with pytest.raises(TypeError, match="fixed argument"):
        mod.remember_mm(x, w, offs, None, None, -1, 0, k, 0, bad, shape, 0, raw, 0)
    with pytest.raises(TypeError):
        mod.mm_call(x, w, offs, None, None, -1)


def test_forget_and_bounded_entries(kernel: Recorder) -> None:
    x, w, offs = varlen()
    assert remember(x, w, offs, plan_for(x, w, offs))
    assert mm_stats()[0] == 1
    native.forget()
    assert mm_stats()[0] == 0 and call(x, w, offs) is False
    plan = plan_for(x, w, offs)
    for t in range(1, 1030):
        xt = torch.empty(t, 64, dtype=torch.bfloat16)
        assert native.loaded().remember_mm(xt, w, offs, None, None, -1, 0, *(
            (plan.kernel, 0) + plan.native_entry()[1:2] + ((t, 96), 0)
            + plan.native_entry()[3:] + (0,)))
    assert 0 < mm_stats()[0] <= 1024


def test_grouped_mm_reaches_the_entry_on_its_third_call(kernel: Recorder,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.grouped_mm end to end on the CPU with the module's path forced on: the first call
    makes the plan, the second remembers it, the third launches from C++."""
    from moe_gemm import ops

    x, w, offs = varlen()
    real_call, real_remember = native.mm_call, native.remember_mm
    monkeypatch.setattr(native, "mm_call", lambda *a: real_call(*a, require_cuda=False))
    monkeypatch.setattr(native, "remember_mm",
                        lambda *a: real_remember(*a, require_cuda=False))
    plan = plan_for(x, w, offs)
    ops._mm_plans.clear()
    monkeypatch.setattr(ops, "_mm_plan_key", lambda *a: ("cpu-test",))
    ops._mm_plans[("cpu-test",)] = plan
    start = mm_stats()
    ops.grouped_mm(x, w, offs)  # plan call, then remember
    assert mm_stats()[1] == start[1] + 1
    y = ops.grouped_mm(x, w, offs)
    assert mm_stats()[2] == start[2] + 1 and kernel.calls[-1][2] is y
    ops._mm_plans.clear()
