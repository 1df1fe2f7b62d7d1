"""Compile kernel variants into the disk cache in parallel (no GPU needed), so that the GPU
tests, a benchmark or a server image start without compiling:

    MOE_GEMM_CACHE_DIR=/tmp/kcache python3 scripts/precompile.py --set tests -j 16

Sets: "tests" = the variants the GPU tests launch (tests/kernels/variants.py and
variants_fp8.py, derived from their cases through the library's kernel choice) plus "check";
"check" = `moe-gemm check --full`'s list (the defaults for the benchmark suite shapes); "fp8" = the FP8 kernels and
quantizers the FP8 GPU tests launch (tests/kernels/variants_fp8.py); "fused" = those of the
fused kernel's and the MoE layer's GPU tests only; "zoo" = the kernel our default picks for
every model-zoo projection at every token count on a GPU of that name (--device, its shipped
table: what a benchmark or a server on that GPU launches); "zoo-fp8" = the FP8 kernels of
`benchmarks.zoo --fp8`. --list prints the names only.

The cache is keyed by the kernel sources and the DSL and TVM-FFI versions, not by the machine
(a cached object that fails to load is compiled again).

Each worker is a fresh interpreter (spawn, never fork: a forked child inherits the parent's
threads' locks and any CUDA state, and one hung worker stalls the pool) that compiles one
variant at a time; a compile is single-threaded (~1.2 s of one core on the CPU-only dev
machine), so one worker per core. Per-key file locks in the cache let other processes
(tests already running) wait for a variant being compiled here instead of compiling it
twice. --timeout bounds the whole run: the pool is terminated and the run fails.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]  # moe_gemm; the tests package (tests.kernels.variants)


def zoo_variants(device: str, nsm: int = 132) -> list:
    """Our default kernel for every zoo projection and token count on `device`."""
    from moe_gemm.tuning import zoo

    keys = {zoo.default_kernel_key(p.E, p.N, p.K, p.rows(t), p.layout, device, nsm)
            for t in zoo.TOKENS for m in zoo.select_models("all") for p in m.projections()}
    return sorted(keys, key=lambda k: k.name())


def zoo_fp8_variants() -> list:
    """The FP8 kernels `benchmarks.zoo --fp8` runs on every FP8 model's projections at every
    token count: our block-scaled default, the same with the scales loaded by the math
    threads (its `-ring` row) and the row-wise one (FP8 choices do not depend on the GPU)."""
    import torch

    from moe_gemm import GemmConfig
    from moe_gemm.ops.heuristics_fp8 import SMEM_SCALES_ENV, choose_fp8
    from moe_gemm.ops.scaled_launch import fp8_compile_key
    from moe_gemm.tuning import zoo

    keys = set()
    with mock.patch.dict(os.environ):  # (restored afterwards, whatever the caller had)
        for smem in (None, "0"):  # the default, then the ring
            if smem is None:
                os.environ.pop(SMEM_SCALES_ENV, None)
            else:
                os.environ[SMEM_SCALES_ENV] = smem
            for m in zoo.select_models(",".join(zoo.FP8_MODELS)):
                for p in m.projections():
                    for t in zoo.TOKENS:
                        rows = sum(zoo.topk_counts(p.E, t, min(p.top_k, p.E), 0))
                        for g in ("block", "row"):
                            c = choose_fp8("varlen", GemmConfig(), rows / p.E, p.N, p.K, 2, g)
                            keys.add(fp8_compile_key("varlen", torch.float8_e4m3fn,
                                                     torch.bfloat16, g, c))
    return sorted(keys, key=lambda k: k.name())


def variant_set(name: str, device: str | None = None) -> list:
    if name == "zoo-fp8":
        return zoo_fp8_variants()
    if name == "zoo":
        if not device:
            raise SystemExit("--set zoo needs --device (a shipped table's GPU name)")
        return zoo_variants(device)
    if name == "fp8":
        from tests.kernels.variants_fp8 import fp8_test_variants

        return fp8_test_variants()
    from moe_gemm.cli import check_variants

    if name == "fused":
        from tests.kernels.variants import fused_test_variants

        return fused_test_variants()
    keys = set(check_variants(full=True))
    if name == "tests":
        from tests.kernels.variants import kernel_test_variants, router_test_variants
        from tests.kernels.variants_fp8 import fp8_test_variants

        keys.update(kernel_test_variants())
        keys.update(router_test_variants())
        keys.update(fp8_test_variants())
    return sorted(keys, key=lambda k: k.name())


def _compile_one(key) -> tuple[str, float, str]:
    """In a worker: (name, seconds, "compiled" | "cached" | "FAILED: ...")."""
    from moe_gemm.kernels.sm90.compile_fp8 import compile_any
    from moe_gemm.ops import kernel_cache as cache

    t = time.perf_counter()
    before = cache.stats["compiles"]
    try:
        cache.get_or_compile(key, key.name, lambda: compile_any(key))
    except Exception as exc:  # noqa: BLE001 - report and go on
        return key.name(), time.perf_counter() - t, f"FAILED: {type(exc).__name__}: {exc}"
    status = "compiled" if cache.stats["compiles"] > before else "cached"
    return key.name(), time.perf_counter() - t, status


def compile_all(keys: list, jobs: int, timeout: float) -> dict:
    """Compiles `keys` on `jobs` spawned workers; returns counts, seconds and failures."""
    counts = {"compiled": 0, "cached": 0, "failed": 0}
    failures: list[str] = []
    busy = 0.0
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    pool = multiprocessing.get_context("spawn").Pool(min(jobs, len(keys)) or 1)
    try:
        results = pool.imap_unordered(_compile_one, keys, chunksize=1)
        for done in range(1, len(keys) + 1):
            name, secs, status = results.next(timeout=max(0.0, deadline - time.monotonic()))
            busy += secs
            kind = status if status in counts else "failed"
            counts[kind] += 1
            if kind == "failed":
                failures.append(f"{name}: {status}")
            print(f"[{done}/{len(keys)}] {secs:5.1f}s {status[:120]:10s} {name}", flush=True)
        pool.close()
    except multiprocessing.TimeoutError:
        failures.append(f"timed out after {timeout:.0f} s with "
                        f"{len(keys) - sum(counts.values())} variants left")
    finally:
        pool.terminate()
        pool.join()
    return {"variants": len(keys), "jobs": jobs, **counts,
            "seconds": round(time.perf_counter() - t0, 1), "compile_seconds": round(busy, 1),
            "failures": failures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="tests",
                   choices=["tests", "check", "fp8", "fused", "zoo", "zoo-fp8"])
    p.add_argument("--device", help="--set zoo: the GPU's name, e.g. 'NVIDIA H100 80GB HBM3'")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--list", action="store_true", help="print the variant names and exit")
    args = p.parse_args(argv)
    # Usage errors, exit 2 in one line: -j 0 or less raised ValueError out of
    # multiprocessing.Pool (a traceback) after the variant list was built, and --set zoo
    # without --device exited 1 as if a compile had failed.
    if args.jobs < 1:
        p.error(f"-j/--jobs {args.jobs}: must be at least 1")
    if not args.timeout > 0:
        p.error(f"--timeout {args.timeout}: must be positive")
    if args.set == "zoo" and not args.device:
        p.error("--set zoo needs --device (a shipped table's GPU name)")
    keys = variant_set(args.set, args.device)
    if args.list:
        print("\n".join(k.name() for k in keys))
        return 0
    cache_dir = os.environ.get("MOE_GEMM_CACHE_DIR", "~/.cache/moe_gemm")
    print(f"{len(keys)} variants, {args.jobs} workers -> {cache_dir}", flush=True)
    res = compile_all(keys, args.jobs, args.timeout)
    print(f"{res['compiled']} compiled, {res['cached']} cached, {res['failed']} failed in "
          f"{res['seconds']} s ({res['compile_seconds']} s of worker time)", flush=True)
    for line in res["failures"]:
        print("FAILED", line, flush=True)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
