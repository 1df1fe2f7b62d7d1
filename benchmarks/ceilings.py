"""The device's ceilings, measured in the same run as what they bound: a 2 GiB
device-to-device copy (bytes read plus written) and a bf16 8192^3 torch.mm, on random data;
for FP8 runs also a dense FP8 8192^3 torch._scaled_mm (row-wise scales, bf16 output)."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.clock import Clock, median


def _time_copy(clock: Clock, elems: int, reps: int, gen: torch.Generator) -> tuple[float, int]:
    src = torch.randn(elems, dtype=torch.bfloat16, device=clock.device, generator=gen)
    dst = torch.empty_like(src)

    def copy() -> object:
        return dst.copy_(src)

    for _ in range(3):
        copy()
    clock.sync()
    return median(clock.back_to_back([copy], reps, 2, 1.0)), 2 * elems * src.element_size()


def _time_mm(clock: Clock, n: int, reps: int, gen: torch.Generator) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=clock.device, generator=gen).mul_(0.1)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=clock.device, generator=gen).mul_(0.1)

    def mm() -> object:
        return torch.mm(a, b)

    for _ in range(3):
        mm()
    clock.sync()
    return median(clock.back_to_back([mm], reps, 2, 1.0))


def _time_scaled_mm(clock: Clock, n: int, reps: int, gen: torch.Generator) -> float:
    e4m3 = torch.float8_e4m3fn
    a = torch.randn(n, n, device=clock.device, generator=gen).to(e4m3)
    b = torch.randn(n, n, device=clock.device, generator=gen).to(e4m3).t()  # column-major
    sa = torch.ones(n, 1, device=clock.device)
    sb = torch.ones(1, n, device=clock.device)

    def mm() -> object:
        return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)

    for _ in range(3):
        mm()
    clock.sync()
    return median(clock.back_to_back([mm], reps, 2, 1.0))


def measure_ceilings(clock: Clock, smoke: bool, reps: int, fp8: bool = False) -> dict[str, Any]:
    """Copy bandwidth and bf16 matmul rate on this device (with fp8, the dense FP8 rate too),
    random data, medians of `reps`."""
    gen = torch.Generator(device=clock.device)
    gen.manual_seed(7)
    # 2 GiB per buffer on a GPU (far past any L2); 4 MiB in smoke mode.
    copy_ms, moved = _time_copy(clock, 2**21 if smoke else 2**30, reps, gen)
    n = 256 if smoke else 8192
    mm_ms = _time_mm(clock, n, reps, gen)
    out: dict[str, Any] = {
        "copy_bytes_per_s": moved / (copy_ms * 1e-3),
        "mm_flops_per_s": 2 * n**3 / (mm_ms * 1e-3),
        "copy": {"buffer_bytes": moved // 2, "bytes_moved": moved, "ms": copy_ms,
                 "tb_per_s": moved / copy_ms / 1e9},
        "mm": {"n": n, "dtype": "bf16", "ms": mm_ms, "tflops": 2 * n**3 / mm_ms / 1e9},
        "method": "device-to-device copy (bytes = read + write) and torch.mm n^3 on random "
        f"data; back-to-back events, median of {reps}",
    }
    if fp8:
        try:
            fp8_ms = _time_scaled_mm(clock, n, reps, gen)
        except Exception as exc:  # noqa: BLE001 - no FP8 matmul here: FP8 floors say so
            out["fp8_mm"] = {"n": n, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        else:
            out["fp8_mm_flops_per_s"] = 2 * n**3 / (fp8_ms * 1e-3)
            out["fp8_mm"] = {"n": n, "dtype": "float8_e4m3fn, row-wise scales, bf16 out",
                             "ms": fp8_ms, "tflops": 2 * n**3 / fp8_ms / 1e9}
    return out
