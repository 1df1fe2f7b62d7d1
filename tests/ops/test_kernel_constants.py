"""A compiled kernel is a TVM-FFI function: plans hand it their constant tensors converted once
(ops/kernel_cache.kernel_constants). On the CPU, with the recorder wrapped as a TVM-FFI function, every
op must pass the kernel the same arguments as with the plain recorder (same addresses, shapes,
strides, dtypes and scalars), and keep a torch tensor among them (it carries the stream)."""

from __future__ import annotations

import pytest
import torch
from host_fakes import Recorder, clear_caches

import moe_gemm
from moe_gemm.ops import api, launch_kernel
from moe_gemm.ops.kernel_cache import kernel_constants

tvm_ffi = pytest.importorskip("tvm_ffi")

BF16 = torch.bfloat16


def _described(args: tuple) -> list:
    """Each argument as the kernel reads it: tensors by (address, shape, strides, dtype)."""
    out = []
    for a in args:
        if isinstance(a, (torch.Tensor, tvm_ffi.Tensor)):
            t = torch.from_dlpack(a) if isinstance(a, tvm_ffi.Tensor) else a
            out.append((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype))
        else:
            out.append(a)
    return out


def _cases() -> dict:
    x = torch.randn(64, 32, dtype=BF16)
    w = torch.randn(4, 48, 32, dtype=BF16).transpose(1, 2)
    offs = torch.tensor([10, 30, 30, 64], dtype=torch.int32)
    a = [torch.randn(m, 32, dtype=BF16) for m in (8, 0, 24)]
    b = [torch.randn(32, 48, dtype=BF16) for _ in range(3)]
    plan: list = []

    def plan_call():
        if not plan:
            plan.append(moe_gemm.GroupedGemmPlan(a, b))  # (its build launches nothing)
        return plan[0]()

    return {
        "grouped_mm 2-D": lambda: moe_gemm.grouped_mm(x, w, offs),
        "grouped_mm 3-D": lambda: moe_gemm.grouped_mm(x.view(4, 16, 32), w),
        "grouped_gemm": lambda: moe_gemm.grouped_gemm(a, b),
        "GroupedGemmPlan": plan_call,
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_ffi_kernel_gets_the_same_arguments(case: str, kernel: Recorder,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "cute_problem", lambda device=None: None)
    seen: dict[str, list] = {}
    for form in ("torch", "ffi"):
        clear_caches()
        kernel.calls.clear()
        if form == "ffi":
            ffi_kernel = tvm_ffi.convert(lambda *args: kernel.calls.append(args))
            monkeypatch.setattr(launch_kernel, "_kernel_for", lambda *a: ffi_kernel)
            monkeypatch.setattr(launch_kernel, "_compiled", lambda key: ffi_kernel)
        call = _cases()[case]
        # Three calls: the detailed path, then the plan's repeated path (twice).
        for _ in range(3):
            call()
        assert len(kernel.calls) == 3
        seen[form] = [_described(c) for c in kernel.calls]
    # The two runs allocate their own placeholders, uploads and outputs: tensors compare by
    # shape, strides and dtype, scalars by value, except the general form's last one (the
    # address of its outputs' block).
    general = case in ("grouped_gemm", "GroupedGemmPlan")
    for torch_call, ffi_call in zip(seen["torch"], seen["ffi"]):
        assert len(torch_call) == len(ffi_call)
        if general:
            torch_call, ffi_call = torch_call[:-1], ffi_call[:-1]
        for ta, fa in zip(torch_call, ffi_call):
            if isinstance(ta, tuple):
                assert ta[1:] == fa[1:]
            else:
                assert ta == fa


def test_plans_convert_constants_once_and_keep_a_torch_tensor(
        kernel: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "cute_problem", lambda device=None: None)
    calls: list = []

    def record(*args):
        calls.append(args)

    ffi_kernel = tvm_ffi.convert(record)
    monkeypatch.setattr(launch_kernel, "_kernel_for", lambda *a: ffi_kernel)
    monkeypatch.setattr(launch_kernel, "_compiled", lambda key: ffi_kernel)
    a = [torch.randn(16, 32, dtype=BF16) for _ in range(2)]
    b = [torch.randn(32, 48, dtype=BF16) for _ in range(2)]
    plan = moe_gemm.GroupedGemmPlan(a, b)
    gplan = plan._launch.plan
    assert all(isinstance(c, tvm_ffi.Tensor) for c in gplan.constants)
    assert all(isinstance(m, tvm_ffi.Tensor) for m in plan._launch.meta)
    # The workspace goes to the kernel as a torch tensor: TVM-FFI reads the stream from it.
    assert isinstance(gplan.workspace.get(gplan.shape.choice), torch.Tensor)
    # A recorder that is no TVM-FFI function gets torch tensors.
    assert kernel_constants(kernel, a[0]) == (a[0],)
