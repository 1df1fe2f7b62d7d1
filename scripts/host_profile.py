"""Device: where the host time of one call goes, for grouped_gemm, grouped_mm (2-D and 3-D)
and GroupedGemmPlan: per-call host time of each route and of the pieces a call is made of
(plan key, cached plan, the compiled kernel's call alone, pinned upload, allocation), beside
torch's own grouped_mm and bmm, then cProfile's top entries.

    python3 scripts/host_profile.py
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from moe_gemm import GroupedGemmPlan, grouped_gemm, grouped_mm  # noqa: E402


def per_call(fn, n=208):
    """Host time of one call. The synchronize every 16 calls is outside the timed region: a
    call that takes less host time than its kernel takes on the GPU would otherwise be timed
    at the GPU's pace."""
    for _ in range(10):
        fn()
    total = 0.0
    for _ in range(max(1, n // 16)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(16):
            fn()
        total += time.perf_counter() - t
    return total / (max(1, n // 16) * 16) * 1e6


def main() -> None:
    dev, dt = "cuda", torch.bfloat16
    a8 = [torch.randn(8, 512, device=dev, dtype=dt) for _ in range(8)]
    b8 = [torch.randn(512, 512, device=dev, dtype=dt) for _ in range(8)]
    a256 = [torch.randn(128, 512, device=dev, dtype=dt) for _ in range(256)]
    b256 = [torch.randn(512, 512, device=dev, dtype=dt) for _ in range(256)]
    x = torch.randn(64, 512, device=dev, dtype=dt)
    w = torch.randn(8, 512, 512, device=dev, dtype=dt)
    offs = torch.tensor([1, 8, 19, 27, 37, 48, 58, 64], dtype=torch.int32, device=dev)
    print(f"grouped_gemm 8 problems:   {per_call(lambda: grouped_gemm(a8, b8)):8.1f} us/call")
    # New operand addresses every call: per_call's 210 calls each take a set never seen
    # before, so each uploads its metadata (no cached upload to reuse).
    sets = [[torch.randn(8, 512, device=dev, dtype=dt) for _ in range(8)] for _ in range(256)]
    turn = iter(range(256))
    print(f"  ... new A addresses:     "
          f"{per_call(lambda: grouped_gemm(sets[next(turn)], b8)):8.1f} us/call")
    # A new problem set every call (row counts change: routed tokens through the list API):
    # each builds its GeneralShape (kernel choice, schedule) in Python first.
    rows = [[torch.randn(1 + i if j == 0 else 1 + (5 * i + 37 * j) % 64, 512, device=dev,
                         dtype=dt) for j in range(8)] for i in range(256)]
    turn2 = iter(range(256))
    print(f"  ... new sizes each call: "
          f"{per_call(lambda: grouped_gemm(rows[next(turn2)], b8)):8.1f} us/call")
    print(f"grouped_gemm 256 problems: {per_call(lambda: grouped_gemm(a256, b256), 50):8.1f} us")
    print(f"grouped_mm E=8:            {per_call(lambda: grouped_mm(x, w, offs)):8.1f} us/call")
    ws = torch.nn.functional.grouped_mm
    print(f"F.grouped_mm E=8:          {per_call(lambda: ws(x, w, offs=offs)):8.1f} us/call")
    # The batched (3-D) form on the same rows, and where its call's time goes.
    x3 = x.view(8, 8, 512)
    print(f"grouped_mm 3-D:            {per_call(lambda: grouped_mm(x3, w)):8.1f} us/call")
    print(f"F.grouped_mm 3-D:          {per_call(lambda: ws(x3, w)):8.1f} us/call")
    print(f"torch.bmm 3-D:             {per_call(lambda: torch.bmm(x3, w)):8.1f} us/call")
    from moe_gemm.ops import api as ops
    from moe_gemm.ops import launch_resources

    bplan = ops.cached_mm_plan(x3, w)
    print(f"  plan lookup:             {per_call(lambda: ops.cached_mm_plan(x3, w)):8.1f} us")
    print(f"  BmmPlan call:            {per_call(lambda: bplan.launch(x3, w, None)):8.1f} us")
    out3 = torch.empty(8, 8, 512, device=dev, dtype=dt)
    bws = bplan.workspace.get(bplan.choice) if bplan.choice.tail_split else bplan.no_workspace
    kargs = (x3, w, out3, bplan.meta, bplan.meta32, bplan.offs, bplan.no_table, bws,
             bplan.no_trace, 8, bplan.num_ctas, bplan.choice.swizzle, 0, 0, 0, 0)
    print(f"  kernel call alone:       {per_call(lambda: bplan.kernel(*kargs)):8.1f} us "
          f"({bplan.choice.schedule} {bplan.choice.tile_m}x{bplan.choice.tile_n}, "
          f"{bplan.num_ctas} CTAs)")
    mplan = ops.cached_mm_plan(x, w, offs)
    out2 = torch.empty(64, 512, device=dev, dtype=dt)
    ws2 = launch_resources._kernel_workspace(x.device, mplan.num_ctas, mplan.choice)
    margs = (x, w, out2, mplan.meta, mplan.meta32, offs, mplan.no_table, ws2, mplan.no_trace,
             mplan.num_problems, mplan.num_ctas, mplan.choice.swizzle, 0, 0, 0, 0)
    print(f"  2-D plan lookup:         "
          f"{per_call(lambda: ops.cached_mm_plan(x, w, offs)):8.1f} us")
    print(f"  MmPlan call:             {per_call(lambda: mplan.launch(x, w, offs, None)):8.1f} us")
    print(f"  2-D kernel call alone:   {per_call(lambda: mplan.kernel(*margs)):8.1f} us "
          f"({mplan.choice.schedule} {mplan.choice.tile_m}x{mplan.choice.tile_n}, "
          f"{mplan.num_ctas} CTAs)")
    plan = GroupedGemmPlan(a8, b8)
    print(f"GroupedGemmPlan 8 call:    {per_call(plan):8.1f} us/call")
    # The pieces a per-call general launch is made of.
    pin = lambda: torch.empty((8, 8), dtype=torch.int64, pin_memory=True)  # noqa: E731
    print(f"  pinned (8, 8) empty:     {per_call(pin):8.1f} us")
    m = pin()
    print(f"  pinned .to(cuda, nb):    {per_call(lambda: m.to(dev, non_blocking=True)):8.1f} us")
    print(f"  torch.empty cuda:        {per_call(lambda: torch.empty(64, 512, device=dev)):8.1f} us")
    flat = torch.empty(64, 512, device=dev, dtype=dt)
    ms = [1, 7, 11, 8, 10, 11, 10, 6]
    print(f"  split 8 rows:            {per_call(lambda: flat.split(ms)):8.1f} us")
    print(f"  8 x data_ptr+stride+shape: "
          f"{per_call(lambda: [(t.data_ptr(), t.stride(), t.shape) for t in a8]):8.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        grouped_gemm(a8, b8)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    more = [[torch.randn(300 + i if j == 0 else 1 + (3 * i + 29 * j) % 64, 512, device=dev,
                         dtype=dt) for j in range(8)] for i in range(50)]
    prof = cProfile.Profile()
    prof.enable()
    for a in more:  # a new problem set each call
        grouped_gemm(a, b8)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    for args in ((x, w, offs), (x3, w)):
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            grouped_mm(*args)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
