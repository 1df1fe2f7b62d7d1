"""The GPU's SM clock and board power while a timed sample runs, read through NVML.

An H100 or H200 SXM running large GEMMs back to back meets its 700 W power limit and lowers
its SM clock below the 1980 MHz boost; two kernels of equal instruction efficiency then differ
in speed by how much energy each spends per multiply-add (shared-memory and L2 traffic cost
power). Recording the clock and power beside each implementation's time tells a kernel that
is slow per cycle from one that runs at fewer cycles per second.

NVML is the driver's own library (libnvidia-ml.so.1, present wherever the driver is); it is
bound here with ctypes, so nothing needs installing. Without it every reading is None. The SM
clock is instantaneous; NVML's power reading is averaged by the driver (over about a second on
recent GPUs), so beside a few-millisecond sample it also spans the samples before it.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

NVML_CLOCK_SM = 1  # nvmlClockType_t: NVML_CLOCK_SM
NVML_SUCCESS = 0


class GpuState:
    """Reads one GPU's current SM clock (MHz), power draw (W) and energy counter (mJ); None
    where it cannot."""

    def __init__(self, handle: Any = None, lib: Any = None) -> None:
        self._lib = lib
        self._handle = handle

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _query(self, name: str, out_type: Any, *args: Any) -> int | None:
        """NVML's nvmlDevice<name>(handle, *args, &out), or None (no GPU, or an error code)."""
        if self._handle is None:
            return None
        out = out_type(0)
        if getattr(self._lib, name)(self._handle, *args, ctypes.byref(out)):
            return None
        return int(out.value)

    def sm_mhz(self) -> float | None:
        mhz = self._query("nvmlDeviceGetClockInfo", ctypes.c_uint, NVML_CLOCK_SM)
        return None if mhz is None else float(mhz)

    def power_w(self) -> float | None:
        mw = self._query("nvmlDeviceGetPowerUsage", ctypes.c_uint)
        return None if mw is None else mw / 1000.0

    def energy_mj(self) -> int | None:
        """The board's energy counter (mJ since the driver loaded; Volta and later)."""
        return self._query("nvmlDeviceGetTotalEnergyConsumption", ctypes.c_ulonglong)

    def reading(self) -> tuple[float | None, float | None]:
        return self.sm_mhz(), self.power_w()

    def sample_while(self, running: Callable[[], bool], every_s: float = 5e-4,
                     max_reads: int = 2000) -> tuple[float | None, float | None]:
        """Median (SM MHz, W) of readings taken every `every_s` while `running()` is true: the
        work's own clock, not that of the idle or sleeping GPU before it (which boosts
        higher). The first reading counts even when the work ends before a second."""
        if self._handle is None:
            return None, None
        reads: list[tuple[float | None, float | None]] = []
        while len(reads) < max_reads:
            r = self.reading()
            if reads and not running():
                break  # the work may have ended before this reading: not its clock
            reads.append(r)
            time.sleep(every_s)
        mhz = [m for m, _ in reads if m is not None]
        watts = [w for _, w in reads if w is not None]
        return (statistics.median(mhz) if mhz else None,
                statistics.median(watts) if watts else None)


def nvml_index(torch_index: int, visible: str | None) -> int | str:
    """NVML's name for the torch device `torch_index`: NVML counts every GPU of the machine,
    CUDA only those CUDA_VISIBLE_DEVICES lists (by index or by UUID)."""
    if not visible:
        return torch_index
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if torch_index >= len(items):
        raise ValueError(f"device {torch_index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    item = items[torch_index]
    return int(item) if item.isdigit() else item


def open_gpu_state(torch_index: int, loader: Any = None) -> GpuState:
    """A GpuState for the torch device `torch_index`, or one that reads None (no NVML, a
    MIG instance, an unknown device): the benchmark runs the same either way."""
    try:
        lib = (loader or ctypes.CDLL)("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != NVML_SUCCESS:
            return GpuState()
        which = nvml_index(torch_index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        handle = ctypes.c_void_p()
        if isinstance(which, int):
            rc = lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(which), ctypes.byref(handle))
        else:
            rc = lib.nvmlDeviceGetHandleByUUID(which.encode(), ctypes.byref(handle))
        if rc != NVML_SUCCESS:
            return GpuState()
        return GpuState(handle, lib)
    except (OSError, AttributeError, ValueError):
        return GpuState()
