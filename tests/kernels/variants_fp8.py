"""The FP8 kernel variants the GPU tests launch (test_fp8_gpu.py, the FP8 layer tests), derived
from their cases through the library's own FP8 kernel choice, so scripts/precompile.py
--set fp8 compiles them all in parallel before the tests start (no GPU needed). A case added
to the tests and missed here compiles inside the test."""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import torch

from moe_gemm import GemmConfig
from moe_gemm.kernels.sm90.constants_fp8 import fp8_tile_problem
from moe_gemm.ops.heuristics_fp8 import choose_fp8
from moe_gemm.ops.scaled_launch import fp8_compile_key

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# (loop, schedule, tile, cluster_m, cluster_n) of the scale loops' GPU tests (test_fp8_gpu.py):
# the lagged promotion, the scales prefetched n stages ahead and the scales staged in shared
# memory (with the lag, on the tiles with room for it)
LOOP_CASES = [("lagged", "cooperative", (128, 128), 1, 1),
              ("lagged", "cooperative", (128, 128), 1, 2),
              ("lagged", "cooperative", (128, 128), 2, 1), ("lagged", "pingpong", (64, 128), 1, 1),
              ("lagged", "cooperative", (128, 64), 1, 1), ("lagged", "pingpong", (128, 64), 1, 1),
              ("ahead2", "cooperative", (128, 128), 1, 2),
              ("ahead3", "cooperative", (128, 128), 1, 1),
              ("ahead4", "cooperative", (128, 192), 2, 1), ("ahead2", "pingpong", (64, 128), 1, 1),
              ("ahead3", "pingpong", (128, 64), 1, 1), ("ahead2", "cooperative", (128, 160), 1, 1),
              ("smem", "cooperative", (128, 128), 1, 1), ("smem", "cooperative", (128, 128), 1, 2),
              ("smem", "cooperative", (128, 128), 2, 1), ("smem", "pingpong", (64, 128), 1, 1),
              ("smem", "cooperative", (128, 64), 1, 2), ("smem", "pingpong", (128, 64), 1, 1)]
# the loops test_scale_loop_long_k_tail_split_and_forms runs
FORM_LOOPS = ("lagged", "ahead2", "ahead3", "smem")

# (loop, granularity, schedule, tile, cluster_m, cluster_n) of test_fp8_gpu.py's probed-wait
# test: each stage loop (the staged scales with the lag, the scale ring, the plain loop, the
# lag on global scales) with its waits probed a stage ahead and in full
PEEK_CASES = [("staged", "block", "cooperative", (128, 128), 1, 2),
              ("staged", "block", "pingpong", (64, 128), 1, 1),
              ("ring", "block", "cooperative", (128, 128), 1, 1),
              ("plain", "block", "cooperative", (128, 192), 1, 1),
              ("lagged", "block", "cooperative", (128, 128), 2, 1),
              ("plain", "row", "cooperative", (128, 128), 1, 2),
              ("plain", "row", "pingpong", (64, 128), 1, 1)]
# (schedule, tile, cluster_m, cluster_n) of the staged scales promoted in the plain loop
STAGED_PLAIN_CASES = [("cooperative", (128, 128), 1, 1), ("cooperative", (128, 128), 1, 2),
                      ("cooperative", (128, 128), 2, 1), ("pingpong", (64, 128), 1, 1),
                      ("cooperative", (128, 64), 1, 2), ("pingpong", (128, 64), 1, 1)]
# (loop, granularity, tile_n, cluster_m, cluster_n) of test_fp8_gpu.py's skipped-half test:
# cooperative 128-row tiles with each stage loop, with and without MOE_GEMM_FP8_HALF_SKIP
HALF_SKIP_CASES = [("staged", "block", 128, 1, 2), ("staged", "block", 128, 1, 1),
                   ("ring", "block", 128, 1, 1), ("plain", "block", 192, 1, 1),
                   ("lagged", "block", 128, 2, 1), ("plain", "row", 128, 1, 2)]
# rows per expert there: last tiles of 2, none, 64, 1, 72, 127, 65 and 44 rows
HALF_SKIP_COUNTS = (130, 0, 64, 1, 200, 255, 65, 300)
# each loop's switches (MOE_GEMM_FP8_*; the staged scales are the varlen default)
PEEK_LOOP_ENV = {"staged": {}, "ring": {"MOE_GEMM_FP8_SMEM_SCALES": "0"},
                 "plain": {"MOE_GEMM_FP8_SMEM_SCALES": "0", "MOE_GEMM_FP8_SCALE_AHEAD": "1"},
                 "lagged": {"MOE_GEMM_FP8_SMEM_SCALES": "0", "MOE_GEMM_FP8_PROMOTE_LAG": "1"}}


def fp8_test_variants() -> list:
    from moe_gemm.kernels.sm90.compile_fp8 import QuantCompileKey, fp8_check_variants

    keys: set = set(fp8_check_variants())

    def add(form, granularity, config, avg_m, N, K, out=BF16, fp8=E4M3, loops=()):
        choice = choose_fp8(form, config or GemmConfig(), avg_m, N, K, out.itemsize,
                            granularity)
        keys.add(fp8_compile_key(form, fp8, out, granularity, choice))
        # The same choice with the plain loop and with each other loop (test_fp8_gpu.py's
        # _plain_and and LOOPS)
        plain = dataclasses.replace(choice, smem_scales=False, promote_lag=False,
                                    scale_ahead=1)
        if loops:
            keys.add(fp8_compile_key(form, fp8, out, granularity, plain))
        lag_fits = fp8_tile_problem(choice.schedule, choice.tile_m, choice.tile_n, "block",
                                    promote_lag=True) is None
        for loop in loops:
            if loop == "smem" and (form not in ("varlen", "batched") or not lag_fits):
                continue  # (built for the varlen and batched forms' tiles with room for
                # the lag)
            change = ({"promote_lag": True} if loop == "lagged"
                      else {"smem_scales": True, "promote_lag": True} if loop == "smem"
                      else {"scale_ahead": int(loop.removeprefix("ahead"))})
            keys.add(fp8_compile_key(form, fp8, out, granularity,
                                     dataclasses.replace(plain, **change)))

    def cute(**f):
        return GemmConfig(backend="cute", **f)

    def masked(granularity, config, G, M, N, K, out=BF16, expected_m=None):
        # tests/kernels/test_masked_gpu.py (ops/masked_launch.Fp8MaskedPlan's choice)
        from moe_gemm.ops.masked_launch import _masked_choice

        config = config or GemmConfig()
        choice = _masked_choice(choose_fp8("masked", config, min(expected_m or M, M), N, K,
                                           out.itemsize, granularity), config)
        keys.add(fp8_compile_key("masked", E4M3, out, granularity, choice))

    masked("block", cute(), 4, 256, 512, 7168)
    for g in ("block", "row", "tensor"):
        for sched, tile in (("cooperative", (128, 128)), ("pingpong", (64, 128))):
            masked(g, cute(schedule=sched, tile_m=tile[0], tile_n=tile[1]), 6, 200, 264, 384)
    for g in ("block", "row"):
        masked(g, cute(), 32, 128, 4096, 7168, expected_m=8)
    for out in (FP16, FP32):
        masked("block", cute(), 5, 160, 200, 512, out)
    masked("block", cute(), 4, 256, 256, 512)
    for g in ("block", "row", "tensor"):
        for sched, tile in (("cooperative", (128, 128)), ("pingpong", (64, 128))):
            add("varlen", g, cute(schedule=sched, tile_m=tile[0], tile_n=tile[1]), 100, 264, 384)
        add("batched", g, cute(), 200, 264, 384)
        add("general", g, cute(), 96, 520, 1024, FP16)
        add("general", g, cute(), 96, 520, 1024)
    for sched, tile in (("cooperative", (128, 192)), ("cooperative", (128, 160)),
                        ("cooperative", (128, 64)), ("pingpong", (64, 192)),
                        ("pingpong", (128, 64))):
        for g in ("block", "row"):
            add("varlen", g, cute(schedule=sched, tile_m=tile[0], tile_n=tile[1]), 116, 712, 640)
    for cm, cn in ((2, 1), (1, 2)):
        add("varlen", "block", cute(schedule="cooperative", tile_m=128, tile_n=128,
                                    cluster_m=cm, cluster_n=cn), 187, 392, 512)
    # the default cluster (ops/heuristics_fp8._default_cluster) with row-wise scales
    add("varlen", "row", None, 64, 512, 7168)
    for ts in (True, False):
        add("varlen", "block", cute(schedule="cooperative", tile_m=128, tile_n=128,
                                    tail_split=ts), 300, 1024, 4096)
    for K in (7168, 14336):
        for g in ("block", "row"):
            add("varlen", g, None, 128, 256, K, FP32)
    for sched in ("cooperative", "pingpong"):
        add("varlen", "block", cute(schedule=sched), 96, 136, 256)
        add("varlen", "block", cute(schedule=sched), 0.25, 136, 256)
    add("varlen", "block", None, 8, 512, 7168)
    add("varlen", "block", None, 1024, 2048, 7168)
    for out in (BF16, FP16, FP32):
        add("varlen", "block", None, 120, 200, 256, out)
    add("varlen", "block", None, 120, 200, 256, BF16, E5M2)
    add("varlen", "row", None, 120, 200, 256, BF16, E5M2)
    add("varlen", "block", cute(), 75, 64, 256)
    add("varlen", "block", cute(), 32, 256, 512)
    add("varlen", "block", cute(), 187, 512, 2048)
    add("batched", "block", None, 128, 512, 7168)
    add("batched", "row", cute(), 1, 256, 1024)
    add("varlen", "block", None, 1024, 264, 512)  # a compute-bound batched call (as varlen)
    # test_fp8_gpu.py's loop cases
    for loop, sched, tile, cm, cn in LOOP_CASES:
        cfg = cute(schedule=sched, tile_m=tile[0], tile_n=tile[1], cluster_m=cm, cluster_n=cn,
                   tail_split=False)
        add("varlen", "block", cfg, 108, 392, 640, loops=(loop,))
    add("varlen", "block", cute(schedule="cooperative", tile_m=128, tile_n=128,
                                tail_split=True), 300, 1024, 4096, loops=FORM_LOOPS)
    for form in ("batched", "general"):
        add(form, "block", cute(schedule="cooperative", tile_m=128, tile_n=128), 100, 264,
            384, loops=FORM_LOOPS)
    add("varlen", "block", None, 300 / 4, 40, 640, loops=FORM_LOOPS)  # a narrow two-block tile
    for K in (512, 640):  # test_staged_scale_layouts
        add("varlen", "block", cute(tail_split=False), 701 / 5, 392, K, loops=("smem",))
    # test_fp8_gpu.py's probed-wait cases, each way
    for loop, g, sched, tile, cm, cn in PEEK_CASES:
        cfg = cute(schedule=sched, tile_m=tile[0], tile_n=tile[1], cluster_m=cm, cluster_n=cn,
                   tail_split=False)
        for peek in ("0", "1"):
            with mock.patch.dict(os.environ, {**PEEK_LOOP_ENV[loop],
                                              "MOE_GEMM_FP8_PEEK_WAIT": peek}):
                add("varlen", g, cfg, 650 / 6, 392, 640)
    with mock.patch.dict(os.environ, {"MOE_GEMM_FP8_PEEK_WAIT": "0"}):
        add("varlen", "block", cute(schedule="cooperative", tile_m=128, tile_n=128,
                                    tail_split=True), 300, 1024, 4096)
    # test_fp8_gpu.py's skipped empty halves, each way (and the batched form's and the tail
    # split's with the skip)
    for loop, g, tile_n, cm, cn in HALF_SKIP_CASES:
        cfg = cute(schedule="cooperative", tile_m=128, tile_n=tile_n, cluster_m=cm,
                   cluster_n=cn, tail_split=False)
        for skip in ("0", "1"):
            with mock.patch.dict(os.environ, {**PEEK_LOOP_ENV[loop],
                                              "MOE_GEMM_FP8_HALF_SKIP": skip}):
                add("varlen", g, cfg, sum(HALF_SKIP_COUNTS) / 8, 392, 640)
    with mock.patch.dict(os.environ, {"MOE_GEMM_FP8_HALF_SKIP": "1"}):
        add("batched", "block", cute(), 190, 264, 384)
        add("varlen", "block", cute(schedule="cooperative", tile_m=128, tile_n=128,
                                    tail_split=True), 300, 1024, 4096)
    add("batched", "block", cute(), 190, 264, 384)
    # test_fp8_gpu.py's staged scales promoted in the plain loop, beside the lagged loop
    for sched, tile, cm, cn in STAGED_PLAIN_CASES:
        cfg = cute(schedule=sched, tile_m=tile[0], tile_n=tile[1], cluster_m=cm, cluster_n=cn,
                   tail_split=False)
        for lag in ("0", ""):
            with mock.patch.dict(os.environ, {"MOE_GEMM_FP8_PROMOTE_LAG": lag}):
                add("varlen", "block", cfg, 650 / 6, 392, 640)
    for lag in ("0", ""):
        with mock.patch.dict(os.environ, {"MOE_GEMM_FP8_PROMOTE_LAG": lag}):
            add("varlen", "block", cute(schedule="cooperative", tile_m=128, tile_n=128,
                                        tail_split=True), 300, 1024, 4096)
    # The FP8 benchmark's shapes, its default and sweep configs (benchmarks/bench_fp8.py).
    try:
        from benchmarks import bench_fp8
    except ImportError:  # (an installed package without the checkout's benchmarks/)
        bench_fp8 = None
    for shape in bench_fp8.SHAPES if bench_fp8 else ():
        avg = shape.rows if shape.form == "batched" else shape.rows / shape.groups
        add(shape.form, "row", None, avg, shape.N, shape.K)
        with mock.patch.dict(os.environ, {"MOE_GEMM_FP8_PEEK_WAIT": "0"}):  # the -nopeek rows
            add(shape.form, "row", None, avg, shape.N, shape.K)
            add(shape.form, "block", None, avg, shape.N, shape.K)
        # its -ring, -ahead1, -ahead4 and -lag rows beside the default
        add(shape.form, "block", None, avg, shape.N, shape.K,
            loops=("ahead3", "ahead4", "lagged"))
        for cfg in bench_fp8.sweep_configs(shape).values():
            add(shape.form, "block", cfg, avg, shape.N, shape.K)
    for g in ("block", "row"):
        add("varlen", g, None, 128, 256, 7168)
        add("varlen", g, None, 128, 256, 14336)
        add("varlen", g, None, 128, 256, 7168, FP32)
        add("varlen", g, None, 128, 256, 14336, FP32)
    # The FP8 layer tests (tests/layers/test_moe_fp8_gpu.py): up and down GEMMs.
    for g in ("block", "row"):
        for avg in (8 / 64, 512 * 8 / 64):
            add("varlen", g, None, avg, 2048, 2048)
            add("varlen", g, None, avg, 2048, 1024)
    add("varlen", "block", None, 32, 1024, 1024)
    add("varlen", "block", None, 32, 1024, 512)
    for src in ("bfloat16", "float16", "float32"):
        for dst in ("float8_e4m3fn", "float8_e5m2"):
            keys.add(QuantCompileKey(src, dst))
    return sorted(keys, key=lambda k: k.name())
