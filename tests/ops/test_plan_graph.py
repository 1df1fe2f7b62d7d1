"""GroupedGemmPlan's CUDA-graph replay (the default; MOE_GEMM_PLAN_GRAPH=0 turns it off;
ops/general_launch.GeneralLaunch.launch): the first call records the launch (minority-layout B copies, then the kernel) as a CUDA graph on a
side stream in thread-local capture mode, later calls replay it, a call inside a caller's own
capture launches directly, and a capture that fails leaves the plan launching directly. On the
CPU: the recorder as the kernel, a stand-in graph and streams (the GPU tests run the real
ones)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from host_fakes import Recorder

import moe_gemm
from moe_gemm.ops import api, general_launch, launch_resources
from moe_gemm.ops.general_launch import PLAN_GRAPH_ENV
from moe_gemm.ops.launch_info import last_launch

BF16 = torch.bfloat16


class Capture:
    """The capture state launch_resources._capturing() reports."""

    def __init__(self) -> None:
        self.on = False


class FakeGraph:
    """Records which kernel calls fall inside its capture; counts replays."""

    fail_begin: Exception | None = None
    made: list[FakeGraph] = []

    def __init__(self, rec: Recorder, capture: Capture) -> None:
        self.rec, self.capture = rec, capture
        self.recorded: list | None = None
        self.replays = 0
        self.mode = None
        FakeGraph.made.append(self)

    def capture_begin(self, capture_error_mode: str = "global") -> None:
        if FakeGraph.fail_begin is not None:
            raise FakeGraph.fail_begin
        assert not self.capture.on, "a capture inside a capture"
        self.mode, self.capture.on, self.start = capture_error_mode, True, len(self.rec.calls)

    def capture_end(self) -> None:
        self.capture.on = False
        self.recorded = self.rec.calls[self.start:]

    def replay(self) -> None:
        assert self.recorded is not None and not self.capture.on
        self.replays += 1


class FakeStream:
    def __init__(self, device=None) -> None:
        self.waits = 0

    def wait_stream(self, other) -> None:
        self.waits += 1


@pytest.fixture
def graphs(kernel: Recorder, monkeypatch: pytest.MonkeyPatch):
    capture = Capture()
    monkeypatch.setattr(api, "cute_problem", lambda device=None: None)
    monkeypatch.setattr(launch_resources, "_capturing", lambda: capture.on)
    monkeypatch.setattr(general_launch, "graphs_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(kernel, capture))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(FakeGraph, "made", [])
    monkeypatch.setattr(FakeGraph, "fail_begin", None)
    monkeypatch.delenv(PLAN_GRAPH_ENV, raising=False)  # the default: on
    return capture


def _operands():
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(m, 32, generator=g).to(BF16) for m in (8, 0, 24)]
    # problem 2's B in the minority layout: the plan keeps a copy it refreshes every launch
    b = [torch.randn(32, 48, generator=g).to(BF16), torch.randn(32, 48, generator=g).to(BF16),
         torch.randn(48, 32, generator=g).to(BF16).t()]
    return a, b


def test_first_call_records_later_calls_replay(graphs, kernel: Recorder) -> None:
    a, b = _operands()
    plan = moe_gemm.GroupedGemmPlan(a, b)
    assert plan.backend == "cute" and not kernel.calls  # building launches nothing
    fixed = plan._launch.fixes[0][1]
    b[2].copy_(torch.full_like(b[2], 2.0))  # a value changed after the build
    out = plan()
    assert torch.equal(fixed, b[2])  # the B copy ran in the recorded sequence
    assert len(FakeGraph.made) == 1
    graph = FakeGraph.made[0]
    assert graph.mode == "thread_local" and len(graph.recorded) == 1 and graph.replays == 1
    assert out == plan.out
    first = last_launch()
    assert first is not None and first.num_problems == 3
    plan()
    plan()
    assert len(FakeGraph.made) == 1 and graph.replays == 3 and len(kernel.calls) == 1
    assert last_launch() is not first  # each replay is recorded as a launch


def test_inside_a_callers_capture_the_plan_launches_directly(graphs, kernel) -> None:
    a, b = _operands()
    plan = moe_gemm.GroupedGemmPlan(a, b)
    plan()
    graphs.on = True  # the caller is capturing its own graph
    plan()
    graphs.on = False
    assert len(kernel.calls) == 2 and FakeGraph.made[0].replays == 1


def test_a_failed_capture_leaves_direct_launches(graphs, kernel) -> None:
    a, b = _operands()
    FakeGraph.fail_begin = RuntimeError("capture not permitted")
    plan = moe_gemm.GroupedGemmPlan(a, b)
    plan()
    plan()
    assert len(kernel.calls) == 2 and plan._launch.graph is None
    assert len(FakeGraph.made) == 1  # tried once


def test_the_switch_is_read_when_the_plan_is_built(graphs, kernel, monkeypatch) -> None:
    a, b = _operands()
    monkeypatch.setenv(PLAN_GRAPH_ENV, "0")
    plan = moe_gemm.GroupedGemmPlan(a, b)
    monkeypatch.setenv(PLAN_GRAPH_ENV, "1")
    plan()
    plan()
    assert len(kernel.calls) == 2 and not FakeGraph.made
    # grouped_gemm itself never records a graph
    moe_gemm.grouped_gemm(a, b)
    assert len(kernel.calls) == 3 and not FakeGraph.made


def test_plans_off_cuda_launch_directly(kernel, monkeypatch) -> None:
    """A plan whose device has no CUDA graphs (the CPU here, a stand-in kernel) never tries
    to record one."""
    monkeypatch.setattr(api, "cute_problem", lambda device=None: None)
    made = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: made.append(1))
    a, b = _operands()
    plan = moe_gemm.GroupedGemmPlan(a, b)
    plan()
    plan()
    assert len(kernel.calls) == 2 and not made and not plan._launch.replay
