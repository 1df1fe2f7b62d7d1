"""Device: which GPU kernels each implementation of a suite shape launches, and for how long.

torch.profiler's kernel names say what cuBLAS and QuACK picked (tile, cluster, schedule are in
cuBLAS's names), which is where a compute-bound comparison starts. With --one IMPL it runs a
single warm call of that implementation instead, for `ncu`:

    python3 scripts/peer_kernels.py --shape mixtral
    ncu --profile-from-start off -c 1 --metrics ... \
        python3 scripts/peer_kernels.py --shape mixtral --one 'torch.mm loop'
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.suite import full_suite, make_inputs  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from isolation_probe import build_impls  # noqa: E402


def impls(shape: str, configs: str, only: str = ""):
    """isolation_probe's implementations of a suite shape (only: just that one)."""
    dev = torch.device("cuda")
    spec = {s.name: s for s in full_suite()}[shape]
    inp = make_inputs(spec, spec.counts(0), dev, 0)
    out = build_impls(spec, inp, dev, configs, quack=not only or only == "QuACK")
    return {only: out[only]} if only else out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="mixtral")
    p.add_argument("--configs", default="")
    p.add_argument("--one", default="", help="one name: moe_gemm, a config, torch.mm loop, QuACK, ...")
    a = p.parse_args()
    fns = impls(a.shape, a.configs, a.one)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    if a.one:  # ncu --profile-from-start off: only this call is profiled
        torch.cuda.profiler.start()
        fns[a.one]()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return
    from torch.profiler import ProfilerActivity, profile

    for name, fn in fns.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = collections.defaultdict(list)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels[ev.name].append(ev.device_time)
        print(f"== {a.shape} {name}")
        for k, v in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {len(v):4d} x {sum(v) / len(v):9.1f} us  {k[:200]}")


if __name__ == "__main__":
    main()
