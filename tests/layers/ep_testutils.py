"""Spawning the ranks of the expert-parallel tests (CPU gloo and GPU NCCL alike)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable, world: int, timeout_s: float) -> dict[int, dict[str, list[str]]]:
    """Run worker(rank, world, port, queue) in `world` spawned processes; each puts (rank,
    {case: [errors]}) on the queue. Returns what the ranks reported (a rank that dies or
    hangs past timeout_s is killed; the caller checks that every rank reported)."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(worker, args=(world, free_port(), queue), nprocs=world,
                               join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=1) and time.monotonic() < deadline:
            pass
    except Exception:  # noqa: BLE001 - a rank died; what the others reported still counts
        pass
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    out = {}
    while not queue.empty():
        rank, res = queue.get()
        out[rank] = res
    return out


def run_world(worker: Callable, world: int, timeout_s: float) -> dict[int, dict[str, list[str]]]:
    """spawn_ranks, and every rank must have reported."""
    out = spawn_ranks(worker, world, timeout_s)
    assert len(out) == world, f"only ranks {sorted(out)} of {world} reported"
    return out


def rank_errors(results: dict[int, dict[str, list[str]]], case: str) -> dict[int, list[str]]:
    """{rank: errors} of the ranks that reported errors for `case`."""
    return {rank: res[case] for rank, res in results.items() if res[case]}
