"""Compile kernel variants into the disk cache (no GPU needed), e.g. to carry them to a GPU
machine or to warm a server image:

    MOE_GEMM_CACHE_DIR=.kcache python scripts/precompile.py --set tests -j 2
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def variant_set(name: str):
    from moe_gemm.kernels.sm90.compile import CompileKey

    keys = set()
    tiles = {"pingpong": [(128, 128), (64, 256)], "cooperative": [(128, 128), (128, 256)]}
    for form, ab, d_same, b_major, schedule, visitor in itertools.product(
        ["general", "varlen"], ["bfloat16", "float16"], [True, False], ["k", "n"],
        ["pingpong", "cooperative"], ["device", "host"],
    ):
        d = ab if d_same else "float32"
        for tm, tn in tiles[schedule]:
            keys.add(CompileKey(form, ab, d, b_major, schedule, visitor, tm, tn))
        if ab == "bfloat16" and d_same:
            tm, tn = tiles[schedule][0]
            keys.add(CompileKey(form, ab, d, b_major, schedule, visitor, tm, tn, None, True))
    batched_tiles = {"pingpong": [(128, 128), (64, 256), (128, 192)],
                     "cooperative": [(128, 128), (128, 256)]}
    for ab, d_same, b_major, schedule in itertools.product(
        ["bfloat16", "float16"], [True, False], ["k", "n"], ["pingpong", "cooperative"],
    ):
        d = ab if d_same else "float32"
        for tm, tn in batched_tiles[schedule]:
            keys.add(CompileKey("batched", ab, d, b_major, schedule, "device", tm, tn))
    keys.add(CompileKey("batched", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                        256, 3))
    keys.add(CompileKey("batched", "float16", "float16", "n", "cooperative", "device", 128,
                        256, 3))
    for tm, tn in [(128, 128), (128, 256)]:
        keys.add(CompileKey("batched", "bfloat16", "bfloat16", "n", "cooperative", "device",
                            tm, tn, None, True))
    keys.add(CompileKey("batched", "bfloat16", "bfloat16", "n", "pingpong", "device", 128, 192,
                        None, True))
    # Clusters in every form (bf16 / fp16 / fp32 out, both B majors, the 128x128 and 128x256
    # tiles; the default 1x2 of the batched and general forms is 128x256 with 3 stages).
    for form, ab, d_same, b_major, tile, stages in itertools.product(
        ["general", "varlen", "batched"], ["bfloat16", "float16"], [True, False], ["k", "n"],
        [(128, 128), (128, 256)], [None, 3],
    ):
        if stages is None or tile == (128, 256):
            for cm, cn in ((2, 1), (1, 2)):
                keys.add(CompileKey(form, ab, ab if d_same else "float32", b_major,
                                    "cooperative", "device", *tile, stages, cluster_m=cm,
                                    cluster_n=cn))
    for form in ("varlen", "batched"):
        for cm, cn in ((2, 1), (1, 2)):
            for b_major in ("n", "k"):
                keys.add(CompileKey(form, "bfloat16", "bfloat16", b_major, "cooperative",
                                    "device", 128, 256, 3, True, cluster_m=cm, cluster_n=cn))
    for ab, b_major in itertools.product(["bfloat16", "float16"], ["k", "n"]):
        for ts in (False, True):  # K >= 4096 picks the tail split (tail_split=False drops it)
            keys.add(CompileKey("varlen", ab, ab, b_major, "cooperative", "device", 128, 256, 3,
                                epi_whole=True, tail_split=ts))
        keys.add(CompileKey("varlen", ab, "float32", b_major, "cooperative", "device", 128,
                            256, 3, tail_split=True))
        keys.add(CompileKey("varlen", ab, ab, b_major, "cooperative", "device", 128, 128,
                            tail_split=True))
    keys.add(CompileKey("batched", "bfloat16", "bfloat16", "n", "cooperative", "device", 128,
                        256, 3, tail_split=True))
    for ab, b_major in itertools.product(["bfloat16", "float16"], ["k", "n"]):
        # varlen ping-pong 128x192: the default for short K or 65-127 rows per expert
        keys.add(CompileKey("varlen", ab, ab, b_major, "pingpong", "device", 128, 192))
    if name == "tests":
        for tm, tn in [(64, 128), (64, 256), (128, 64)]:
            keys.add(CompileKey("batched", "bfloat16", "bfloat16", "n", "pingpong", "device",
                                tm, tn))
        keys.add(CompileKey("batched", "bfloat16", "bfloat16", "n", "cooperative", "device",
                            128, 64))
        keys.add(CompileKey("batched", "bfloat16", "bfloat16", "n", "cooperative", "device",
                            128, 192))
        for tm, tn in [(64, 128), (128, 64), (128, 192)]:
            for b_major in ("k", "n"):
                keys.add(CompileKey("general", "bfloat16", "bfloat16", b_major, "pingpong",
                                    "device", tm, tn))
        for tm, tn in [(128, 64), (128, 192)]:
            for b_major in ("k", "n"):
                keys.add(CompileKey("general", "bfloat16", "bfloat16", b_major, "cooperative",
                                    "device", tm, tn))
    return sorted(keys, key=lambda k: k.name())


def _compile_one(key) -> tuple[str, float, str]:
    from moe_gemm.kernels.sm90.compile import compile_variant
    from moe_gemm.ops import kernel_cache as cache

    t = time.time()
    try:
        cache.get_or_compile(key, key.name(), lambda: compile_variant(key))
        return key.name(), time.time() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - report and go on
        return key.name(), time.time() - t, f"FAILED: {type(exc).__name__}: {exc}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--set", default="all", choices=["all", "tests"])
    p.add_argument("-j", "--jobs", type=int, default=1)
    args = p.parse_args()
    keys = variant_set(args.set)
    print(f"{len(keys)} variants -> {os.environ.get('MOE_GEMM_CACHE_DIR', '~/.cache/moe_gemm')}")
    failed = 0
    # grouped_gemm's C++ module (kernels/native.py) builds beside the kernels.
    from moe_gemm.kernels import native

    native.start()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for fut in as_completed([pool.submit(_compile_one, k) for k in keys]):
            name, secs, status = fut.result()
            failed += status != "ok"
            print(f"{secs:6.1f}s {status:8s} {name}", flush=True)
    print(f"grouped_gemm host path: {native.status()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
