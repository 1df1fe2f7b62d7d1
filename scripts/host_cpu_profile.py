"""Host cost per call of each op's cute path, measured on the CPU (no GPU needed).

The compiled kernel is replaced by a no-op that counts its calls, capability says the cute
backend can run, and the CUDA-only pieces of the launch path (ops/launch_resources.py: stream,
capture state, pinned staging; ops/launch_kernel.py: SM count) get CPU stand-ins; everything
else is the real per-call path: the plan lookup, validation or the scan, the metadata, the
output allocation, the kernel's argument list. What it leaves out: the kernel call through
TVM-FFI (~4-5 us on an H200 host), CUDA's allocator (torch.empty is ~1 us slower there) and the
pinned host-to-device copy of a metadata miss. Numbers from this machine compare with each
other, not with a GPU host's.

    python scripts/host_cpu_profile.py                 # every case, us per call
    python scripts/host_cpu_profile.py --profile "grouped_gemm 256"   # cProfile of one case
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import moe_gemm  # noqa: E402
from moe_gemm.ops import api, launch_kernel, launch_resources  # noqa: E402


class NoKernel:
    """Stands in for a compiled kernel: counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: object) -> None:
        self.calls += 1


def install_cpu_launch(kernel: NoKernel) -> None:
    """The cute path on CPU tensors, `kernel` as every compiled kernel."""
    api.cute_problem = lambda device=None: None
    launch_kernel.sm_count = lambda device: 132
    launch_resources._device_index = lambda device: 0
    launch_resources._raw_stream = lambda idx: 0
    launch_resources._capturing = lambda: False
    launch_resources._pinned = lambda shape, dtype: torch.empty(shape, dtype=dtype)
    launch_kernel._kernel_for = lambda *a: kernel
    launch_kernel._compiled = lambda key: kernel
    os.environ.pop("MOE_GEMM_DISABLE_CUTE", None)


def per_call_us(fn: Callable[[], object], calls: int, repeats: int = 9) -> tuple[float, float]:
    """(median, min) over `repeats` timed loops of `calls` calls each, garbage collector off.
    This thread's CPU time, not wall time: other processes on a shared machine do not count
    (what they do to the caches still does)."""
    for _ in range(5):
        fn()
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            t = time.thread_time()
            for _ in range(calls):
                fn()
            times.append((time.thread_time() - t) / calls * 1e6)
    finally:
        gc.enable()
    return statistics.median(times), min(times)


def cases() -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, calls per timed loop). E=8 MoE shapes as the bench's host section."""
    dt = torch.bfloat16
    x = torch.randn(64, 512, dtype=dt)
    w = torch.randn(8, 512, 512, dtype=dt)
    offs = torch.tensor([1, 8, 19, 27, 37, 48, 58, 64], dtype=torch.int32)
    x3 = x.view(8, 8, 512)
    out2 = torch.empty(64, 512, dtype=dt)
    a8 = [x[8 * e:8 * e + 8] for e in range(8)]
    b8 = [w[e] for e in range(8)]
    a256 = [torch.randn(128, 512, dtype=dt) for _ in range(256)]
    b256 = [torch.randn(512, 512, dtype=dt) for _ in range(256)]
    # Operand addresses never seen before at every call (fresh activations each step): views
    # of one buffer at more row offsets than the metadata cache keeps.
    block = torch.randn(1031 * 64, 512, dtype=dt)
    fresh8 = itertools.cycle([[block[r * 64 + 8 * e:r * 64 + 8 * e + 8] for e in range(8)]
                              for r in range(1031)])
    fresh256 = itertools.cycle([[block[r * 64 + e % 48:r * 64 + e % 48 + 16]
                                 for e in range(256)] for r in range(97)])
    w256 = [torch.randn(512, 512, dtype=dt)] * 256
    # A new problem set every call (routed row counts through the list API).
    rows = itertools.cycle([[torch.randn(1 + i if j == 0 else 1 + (5 * i + 37 * j) % 64, 512,
                                         dtype=dt) for j in range(8)] for i in range(256)])
    plan8 = moe_gemm.GroupedGemmPlan(a8, b8)
    plan256 = moe_gemm.GroupedGemmPlan(a256, b256)
    gmm, gg = moe_gemm.grouped_mm, moe_gemm.grouped_gemm
    return {
        "grouped_mm 2-D E=8": (lambda: gmm(x, w, offs), 2000),
        "grouped_mm 2-D out=": (lambda: gmm(x, w, offs, out=out2), 2000),
        "grouped_mm 3-D G=8": (lambda: gmm(x3, w), 2000),
        "grouped_gemm 8": (lambda: gg(a8, b8), 500),
        "grouped_gemm 8 new addresses": (lambda: gg(next(fresh8), b8), 500),
        "grouped_gemm 8 new sizes": (lambda: gg(next(rows), b8), 200),
        "grouped_gemm 256": (lambda: gg(a256, b256), 40),
        "grouped_gemm 256 new addresses": (lambda: gg(next(fresh256), w256), 40),
        "GroupedGemmPlan 8 call": (plan8, 2000),
        "GroupedGemmPlan 256 call": (plan256, 500),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", metavar="CASE", help="cProfile one case instead")
    parser.add_argument("--no-grad", action="store_true", help="run under torch.no_grad()")
    args = parser.parse_args()
    kernel = NoKernel()
    install_cpu_launch(kernel)
    table = cases()
    grad = torch.no_grad() if args.no_grad else torch.enable_grad()
    with grad:
        if args.profile:
            fn, calls = table[args.profile]
            per_call_us(fn, calls, 1)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            return
        print(f"torch {torch.__version__}, grad {'off' if args.no_grad else 'on'}; "
              "CPU us per call, median (min) of 9 loops")
        for name, (fn, calls) in table.items():
            before = kernel.calls
            med, low = per_call_us(fn, calls)
            launched = kernel.calls - before
            assert launched >= calls, f"{name}: the kernel ran {launched} times, not per call"
            print(f"{name:32s} {med:8.1f} ({low:.1f})")


if __name__ == "__main__":
    main()
