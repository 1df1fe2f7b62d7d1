"""The general-form host wrapper on the CPU: a recorder in place of the compiled kernel, the
patches that let the launch modules run with CPU tensors (the `kernel` fixture in
conftest.py), and the output checks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from moe_gemm.ops import api, fused_launch, general_launch, launch_kernel, launch_resources

NSM = 132


class Recorder:
    """Records every kernel call's arguments; raises `fail` instead when it is set."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: Exception | None = None

    def __call__(self, *args: object) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append(args)


def clear_caches() -> None:
    general_launch.general_shape.cache_clear()
    general_launch.general_plan.cache_clear()
    general_launch._meta_cache.clear()
    launch_resources._workspaces.clear()
    api._clear_plans()


def install(monkeypatch, rec: Recorder) -> None:
    """The launch modules on the CPU with `rec` as the kernel."""
    monkeypatch.setattr(launch_kernel, "sm_count", lambda device: NSM)
    monkeypatch.setattr(launch_kernel, "device_name", lambda device: "Test GPU")  # no table
    monkeypatch.setattr(launch_resources, "_device_index", lambda device: 0)
    monkeypatch.setattr(launch_resources, "_raw_stream", lambda idx: 0)
    monkeypatch.setattr(launch_resources, "_capturing", lambda: False)
    monkeypatch.setattr(launch_resources, "_pinned",
                        lambda shape, dtype: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(launch_kernel, "_kernel_for", lambda *a: rec)
    monkeypatch.setattr(launch_kernel, "_compiled", lambda key: rec)
    monkeypatch.setattr(general_launch, "_general_placeholders",
                        lambda *a: general_launch._new_placeholders(torch.device("cpu"), *a[1:]))
    monkeypatch.delenv("MOE_GEMM_DISABLE_CUTE", raising=False)
    monkeypatch.delenv("MOE_GEMM_L2_HINTS", raising=False)


def check_outputs(outs, sizes, dtype) -> None:
    """Shapes and dtype as asked; non-empty outputs contiguous, 16-byte aligned, disjoint."""
    spans = []
    for o, (m, n, _) in zip(outs, sizes):
        assert o.shape == (m, n) and o.dtype == dtype
        if m * n:
            assert o.is_contiguous() and o.data_ptr() % 16 == 0
            spans.append((o.data_ptr(), o.data_ptr() + m * n * o.element_size()))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "outputs overlap"


def emulating(monkeypatch, emulator: Callable[[Any], Any], ops_module) -> Iterator[list]:
    """A fixture's body: `ops_module`'s fused ops on the Hopper path with CPU tensors, each
    compile making `emulator(key)`; yields the emulators made."""
    made: list = []

    def compiled(key):
        made.append(emulator(key))
        return made[-1]

    clear_caches()
    install(monkeypatch, None)
    monkeypatch.setattr(launch_kernel, "_compiled", compiled)
    monkeypatch.setattr(fused_launch, "sm_count", lambda device: NSM)
    monkeypatch.setattr(ops_module, "cute_problem", lambda device=None: None)
    ops_module._clear_plans()
    yield made
    ops_module._clear_plans()
    clear_caches()
