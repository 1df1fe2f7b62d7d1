"""The device's two ceilings, measured where the tuner runs: copy bandwidth and bf16 mm rate.

A table records those of the run that measured it, beside its timings (a reader can tell a
slower clock or a throttled part from a slower config).
"""

from __future__ import annotations

import statistics

import torch

COPY_ELEMS = 1 << 29  # 1 GiB of bf16 per buffer: far past any L2
MM_N = 8192


def _median_ms(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def _copy_ms(device: torch.device, reps: int) -> float:
    src = torch.randn(COPY_ELEMS, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return _median_ms(lambda: dst.copy_(src), reps)


def _mm_ms(device: torch.device, reps: int) -> float:
    a = torch.randn(MM_N, MM_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(MM_N, MM_N, device=device, dtype=torch.bfloat16)
    return _median_ms(lambda: torch.mm(a, b), reps)


def measure_ceilings(device: torch.device, reps: int = 9) -> dict[str, float]:
    """{copy_bytes_per_s (read + write), mm_flops_per_s (bf16 8192^3 torch.mm)}."""
    copy_ms = _copy_ms(device, reps)
    mm_ms = _mm_ms(device, reps)
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * COPY_ELEMS * 2 / (copy_ms * 1e-3),
            "mm_flops_per_s": 2 * MM_N**3 / (mm_ms * 1e-3)}
