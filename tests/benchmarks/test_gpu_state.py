"""benchmarks/gpu_state.py: NVML readings through a stand-in library (no GPU needed)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from benchmarks.clock import Clock
from benchmarks.gpu_state import GpuState, nvml_index, open_gpu_state
from benchmarks.runner import state_fields


class FakeNvml:
    """Answers the five NVML calls the reader makes; records what it was asked."""

    def __init__(self, init_rc: int = 0, handle_rc: int = 0, clock_rc: int = 0) -> None:
        self.init_rc, self.handle_rc, self.clock_rc = init_rc, handle_rc, clock_rc
        self.asked: list[object] = []
        self.mhz, self.mw = 1755, 698_500

    def __call__(self, name: str) -> FakeNvml:  # as ctypes.CDLL(name)
        assert name == "libnvidia-ml.so.1"
        return self

    def nvmlInit_v2(self) -> int:
        return self.init_rc

    def nvmlDeviceGetHandleByIndex_v2(self, index: ctypes.c_uint, out: object) -> int:
        self.asked.append(index.value)
        out._obj.value = 1234  # type: ignore[attr-defined]
        return self.handle_rc

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes, out: object) -> int:
        self.asked.append(uuid)
        out._obj.value = 99  # type: ignore[attr-defined]
        return self.handle_rc

    def nvmlDeviceGetClockInfo(self, handle: object, kind: int, out: object) -> int:
        assert kind == 1  # the SM clock
        out._obj.value = self.mhz  # type: ignore[attr-defined]
        return self.clock_rc

    def nvmlDeviceGetPowerUsage(self, handle: object, out: object) -> int:
        out._obj.value = self.mw  # type: ignore[attr-defined]
        return 0

    energy_rc = 0
    mj = 123_456_789_012

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object, out: object) -> int:
        out._obj.value = self.mj  # type: ignore[attr-defined]
        return self.energy_rc


def test_nvml_index_follows_cuda_visible_devices() -> None:
    assert nvml_index(0, None) == 0 and nvml_index(1, "") == 1
    assert nvml_index(1, "4, 6") == 6
    assert nvml_index(0, "GPU-abc,GPU-def") == "GPU-abc"
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        nvml_index(2, "0,1")


def test_readings_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    lib = FakeNvml()
    state = open_gpu_state(1, loader=lib)
    assert state.available and lib.asked == [5]
    assert state.reading() == (1755.0, 698.5)
    lib.clock_rc = 3  # NVML_ERROR_NOT_SUPPORTED: no clock, the power still reads
    assert state.reading() == (None, 698.5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1f2e")
    lib2 = FakeNvml()
    assert open_gpu_state(0, loader=lib2).available and lib2.asked == [b"GPU-1f2e"]


def test_without_nvml_every_reading_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> object:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for state in (open_gpu_state(0, loader=missing), open_gpu_state(0, FakeNvml(init_rc=9)),
                  open_gpu_state(0, FakeNvml(handle_rc=2)), GpuState()):
        assert not state.available and state.reading() == (None, None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not open_gpu_state(1, loader=FakeNvml()).available  # not a visible device


def test_state_fields_take_medians_of_what_was_read() -> None:
    assert state_fields([]) == {}
    assert state_fields([(None, None)]) == {}
    got = state_fields([(1700.0, 690.0), (1500.0, None), (None, 700.0), (1600.0, 650.0)])
    assert got == {"sm_mhz": 1600.0, "power_w": 690.0}


def test_cpu_clock_reads_no_state() -> None:
    clock = Clock(torch.device("cpu"))
    assert not clock.gpu_state.available
    samples = clock.back_to_back([lambda: None], 3, 2, 0.0)
    assert len(samples) == 3 and clock.last_states == []


def test_rows_carry_the_clock_and_power_of_their_samples(tmp_path, monkeypatch) -> None:
    import json

    from benchmarks import bench
    from benchmarks import clock as clock_mod

    real = clock_mod.Clock.back_to_back

    def reading(self, fns, reps, calls, backlog_ms):  # as a GPU with NVML would report
        samples = real(self, fns, reps, calls, backlog_ms)
        self.last_states = [(1650.0, 695.0)] * len(samples)
        return samples

    monkeypatch.setattr(clock_mod.Clock, "back_to_back", reading)
    out = tmp_path / "s.json"
    assert bench.main(["--smoke", "--only", "uniform", "--no-variants", "--quiet",
                       "--png", "none", "--no-table", "--out", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r["status"] == "ok"]
    assert rows and all(r["sm_mhz"] == 1650.0 and r["power_w"] == 695.0 for r in rows)


def test_sample_while_reads_only_while_the_work_runs() -> None:
    lib = FakeNvml()
    state = open_gpu_state(0, loader=lib)
    clocks = iter([1980, 1700, 1650, 1600, 1990, 1990])
    lib.nvmlDeviceGetClockInfo = lambda h, kind, out: setattr(out._obj, "value",
                                                            next(clocks)) or 0
    # The first reading is kept; each later one only if the work still runs after it.
    polls = iter([True, True, False])
    mhz, watts = state.sample_while(lambda: next(polls), every_s=0)
    assert mhz == 1700.0 and watts == 698.5  # median of 1980, 1700, 1650 (1600: after the end)
    lib2 = FakeNvml()
    quick = open_gpu_state(0, loader=lib2)
    assert quick.sample_while(lambda: False, every_s=0) == (1755.0, 698.5)  # one reading
    assert GpuState().sample_while(lambda: True) == (None, None)


def test_energy_counter_reads_millijoules_or_none() -> None:
    lib = FakeNvml()
    state = open_gpu_state(0, loader=lib)
    assert state.energy_mj() == 123_456_789_012  # (a 64-bit counter: past 2**32 mJ)
    lib.energy_rc = 3  # NVML_ERROR_NOT_SUPPORTED
    assert state.energy_mj() is None
    assert GpuState().energy_mj() is None
