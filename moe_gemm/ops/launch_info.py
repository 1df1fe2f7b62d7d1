"""What a launch used, for tests, benchmarks and `trace`: the last launch on each thread.

Launches record a plain tuple in `_local.raw` (cheaper on the per-call path than building a
dataclass); last_launch() turns it into a LaunchInfo when asked.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from moe_gemm.ops.heuristics import KernelChoice

__all__ = ["LaunchInfo", "last_launch", "trace_assignment"]

_local = threading.local()


@dataclass(frozen=True)
class LaunchInfo:
    """What the last launch on this thread used (for tests, benchmarks and `trace`)."""

    choice: KernelChoice
    num_ctas: int
    num_problems: int
    order: tuple[int, ...] | None
    trace: torch.Tensor | None


def last_launch() -> LaunchInfo | None:
    """The LaunchInfo of this thread's last launch (the same object until the next launch).

    Launches record a plain tuple (cheaper on the per-call path); it becomes a LaunchInfo here.
    """
    raw = getattr(_local, "raw", None)
    if raw is None:
        return None
    if getattr(_local, "info_of", None) is not raw:
        _local.info = LaunchInfo(*raw)
        _local.info_of = raw
    return _local.info


def trace_assignment(info: LaunchInfo) -> list[list[tuple[int, int, int]]]:
    """Per CTA, the (problem, m_tile, n_tile) records the kernel wrote, in tile order, with
    problems mapped back to the caller's indices (K-sort undone)."""
    assert info.trace is not None
    t = info.trace.cpu().numpy()
    order = info.order
    per_cta = []
    for c in range(t.shape[0]):
        rows = [r for r in t[c] if r[0] >= 0]
        per_cta.append([
            (int(order[r[0]]) if order is not None else int(r[0]), int(r[1]), int(r[2]))
            for r in rows
        ])
    return per_cta
