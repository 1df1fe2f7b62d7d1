"""The kernel variants (CompileKeys) the GPU tests launch, derived from their cases through the
library's own kernel choice (moe_gemm.ops.heuristics), so a device run can compile them all
in parallel before the tests start (scripts/precompile.py --set tests).

No GPU is needed: the choice reads shapes, dtypes and the config only. The SM count does not
enter a CompileKey (the grid and the tail split are launch-time values); 132 (H100 SXM and
H200) only feeds the K-sort decision, which is not a key field either. A case listed here
that a test no longer runs costs one needless compile; a launch missing here compiles inside
the test (scripts/gpu_session.py reports those per group).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import random
from unittest import mock

import torch

from moe_gemm import GemmConfig
from moe_gemm.ops import heuristics

from . import helpers as h

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NUM_SMS = 132
CUTE = GemmConfig(backend="cute")


class Variants:
    """Collects the CompileKey of each launch a test makes (b_major: "n" for row-major B or
    w, "k" for K-major views; force: KernelChoice fields a test patches in)."""

    def __init__(self, nsm: int = NUM_SMS):
        self.nsm = nsm
        self.keys: set = set()

    def _add(self, form, dtype, out_dtype, b_major, choice, trace, force):
        from moe_gemm.ops.launch_kernel import _compile_key

        if force:
            choice = dataclasses.replace(choice, **force)
        self.keys.add(_compile_key(form, dtype, out_dtype or dtype, b_major, choice, trace))

    def general(self, sizes, config=None, dtype=BF16, out_dtype=None, b_major="n",
                trace=False, **force):
        sizes = tuple(tuple(s) for s in sizes)
        if not any(m and n for m, n, _ in sizes):
            return  # nothing to launch
        choice = heuristics.choose_general(config or GemmConfig(), sizes, self.nsm)
        self._add("general", dtype, out_dtype, b_major, choice, trace, force)

    def varlen(self, T, E, N, K, config=None, dtype=BF16, out_dtype=None, b_major="n",
               trace=False, **force):
        if T == 0 or E == 0 or N == 0:
            return
        itemsize = (out_dtype or dtype).itemsize
        choice = heuristics.choose_varlen(config or GemmConfig(), T, E, N, K, self.nsm, itemsize)
        self._add("varlen", dtype, out_dtype, b_major, choice, trace, force)

    def batched(self, G, M, N, K, config=None, dtype=BF16, out_dtype=None, b_major="n",
                trace=False, **force):
        if G == 0 or M == 0 or N == 0 or K == 0:
            return  # trivial or all zeros: no launch
        choice = heuristics.choose_batched(config or GemmConfig(), G, M, N, K, self.nsm)
        self._add("batched", dtype, out_dtype, b_major, choice, trace, force)


    def masked(self, G, M, N, K, config=None, dtype=BF16, out_dtype=None, b_major="n",
               expected_m=None):
        """grouped_mm_masked's launch (ops/masked_launch.MaskedPlan's choice)."""
        from moe_gemm.ops.masked_launch import _masked_choice

        if G == 0 or M == 0 or N == 0 or K == 0:
            return
        config = config or GemmConfig()
        m = min(expected_m or M, M)
        itemsize = (out_dtype or dtype).itemsize
        choice = _masked_choice(heuristics.choose_varlen(config, G * m, G, N, K, self.nsm,
                                                         itemsize), config)
        self._add("masked", dtype, out_dtype, b_major, choice, False, None)


def fused_key(S, T, E, N, K, *, gate=None, layout="concat", w_major="k", gather=True,
              bias=False, scale=False, config=None, dtype=BF16, out_dtype=None,
              gate_alpha=1.702, gate_limit=7.0, nsm=NUM_SMS):
    """The CompileKey of a fused_grouped_mm launch (ops/fused_launch.py's choice), from meta
    tensors: no GPU, no data."""
    from moe_gemm.ops.fused_launch import fused_choice
    from moe_gemm.ops.fused_launch import fused_key as key_of
    from moe_gemm.ops.fused_validation import check_fused_mm

    meta = torch.device("meta")
    x = torch.empty(T if gather else S, K, dtype=dtype, device=meta)
    w = (torch.empty(E, N, K, dtype=dtype, device=meta).transpose(1, 2) if w_major == "k"
         else torch.empty(E, K, N, dtype=dtype, device=meta))
    args = check_fused_mm(
        x, w, torch.empty(E, dtype=torch.int32, device=meta),
        row_index=torch.empty(S, dtype=torch.int64, device=meta) if gather else None,
        bias=torch.empty(E, N, device=meta) if bias else None,
        row_weight=torch.empty(S, device=meta) if scale else None, gate=gate,
        gate_layout=layout, gate_alpha=gate_alpha, gate_limit=gate_limit,
        out_dtype=out_dtype, concrete=False)
    choice, in_kernel = fused_choice(args, config or GemmConfig(), nsm, meta)
    return key_of(args, choice, w_major, in_kernel)


def fused_masked_key(G, M, N, K, *, gate=None, layout="concat", w_major="k", bias=False,
                     scale=False, config=None, expected_m=None, gate_alpha=1.702,
                     gate_limit=7.0, nsm=NUM_SMS):
    """The CompileKey of a fused_grouped_mm_masked launch (ops/fused_launch.FusedPlan with
    expected_m), from meta tensors."""
    from moe_gemm.ops.fused_launch import fused_key as key_of
    from moe_gemm.ops.fused_launch import masked_fused_choice
    from moe_gemm.ops.fused_masked import check_fused_masked

    meta = torch.device("meta")
    x = torch.empty(G, M, K, dtype=BF16, device=meta)
    w = (torch.empty(G, N, K, dtype=BF16, device=meta).transpose(1, 2) if w_major == "k"
         else torch.empty(G, K, N, dtype=BF16, device=meta))
    args = check_fused_masked(
        x, w, torch.empty(G, dtype=torch.int32, device=meta),
        bias=torch.empty(G, N, device=meta) if bias else None,
        row_weight=torch.empty(G, M, device=meta) if scale else None, gate=gate,
        gate_layout=layout, gate_alpha=gate_alpha, gate_limit=gate_limit,
        expected_m=expected_m, concrete=False)
    config = config or GemmConfig()
    choice = masked_fused_choice(args.flat, config, nsm, meta, args.expected_m)
    return dataclasses.replace(key_of(args.flat, choice, w_major, False), row_counts=True)


def _fused_masked_tests(v: Variants) -> None:
    """tests/kernels/test_fused_masked_gpu.py's parametrized cases."""
    try:
        from . import test_fused_masked_gpu as t
    except Exception:  # noqa: BLE001 - the tests moved or changed: compile in-test
        return

    def add(G, M, K, N, gate, layout, major=None, bias=True, scale=True, config=None,
            expected_m=None):
        major = major or ("k" if gate is not None and layout == "concat" else "n")
        clamp = t.CLAMP if gate == "clamped_swiglu" else {}
        v.keys.add(fused_masked_key(G, M, N, K, gate=gate, layout=layout, w_major=major,
                                    bias=bias, scale=scale, config=config,
                                    expected_m=expected_m, **clamp))

    for gate, layout, major in t.GATE_CASES:
        for inter in (128, 136):
            add(6, 200, 136, 2 * inter, gate, layout, major)
    for schedule in h.SCHEDULES:
        for gate, layout, major in (("silu", "concat", "k"),
                                    ("clamped_swiglu", "alternating", "n"),
                                    (None, "concat", "n")):
            add(6, 200, 136, 272, gate, layout, major, config=_cfg(schedule=schedule))
    add(32, 128, 7168, 4096, "silu", "concat", bias=False, scale=False, expected_m=8)
    for gate, layout, major in (("silu", "concat", "k"), ("clamped_swiglu", "alternating", "n")):
        add(8, 1024, 1024, 2048, gate, layout, major)
    for expected_m in (4, None):
        add(16, 256, 2048, 1024, "silu", "concat", expected_m=expected_m)


def _fused_tests(v: Variants) -> None:
    """tests/kernels/test_fused_moe_gpu.py: every case's launch, from the test module's own
    case list."""
    from . import test_fused_moe_gpu as t

    def add(c: dict) -> None:
        extra = t.CLAMP if c["gate"] in ("clamped_swiglu", "clamped_silu") else {}
        with t.case_env(c):
            v.keys.add(fused_key(c["S"], c["T"], c["E"], c["N"], c["K"], gate=c["gate"],
                                 layout=c["layout"], w_major=c["w_major"], gather=c["gather"],
                                 bias=c["bias"], scale=c["scale"], config=c["config"],
                                 dtype=c["dtype"], out_dtype=c["out_dtype"], **extra,
                                 nsm=v.nsm))

    for c in t.ALL_CASES:
        if c["S"] - c["tail"] > 0 or c["tail"] != 0:
            add(c)
    # The wide gather's and the sigmoids' cases, each under its switch (the tests set them).
    from moe_gemm.ops.fused_launch import FAST_GATE_ENV, GATHER_WIDE_ENV

    for switch, value, cases in ((GATHER_WIDE_ENV, "1", t.WIDE_GATHER_CASES),
                                 (FAST_GATE_ENV, "1", t.SIGMOID_CASES),
                                 (FAST_GATE_ENV, "0", t.SIGMOID_CASES)):
        with mock.patch.dict(os.environ, {switch: value}):
            for c in cases:
                add(c)
    # The clamp, checked-indices, repeat and graph tests.
    add(t.CLAMP_CASE)
    add(t.GRAPH_CASE)
    v.keys.add(fused_key(120, 50, 3, 64, 64, gate="silu", nsm=v.nsm))
    v.keys.add(fused_key(777, 300, 10, 400, 264, gate="silu", bias=True, nsm=v.nsm))
    # Swapped tiles with the fused options (test_swapped_fused_gpu.py): its cases, then its
    # graph and default-window launches.
    from . import test_swapped_fused_gpu as s

    for c in s.CASES:
        add(c)
    for S, E, I, H, config in ((756, 4, 192, 256, s.SWAP), (2048, 8, 2048, 2048, None)):
        v.keys.add(fused_key(S, S, E, 2 * I, H, gate="silu", gather=False, config=config,
                             nsm=v.nsm))
        v.keys.add(fused_key(S, S, E, H, I, gather=False, scale=True, config=config,
                             nsm=v.nsm))


def _layer_keys(v: Variants, T: int, H: int, I: int, E: int, k: int, act: str = "silu",
                unfused: bool = True) -> None:
    """A layer forward's launches: fused (gate-up with the gather, down with the routing
    weights) and, with `unfused`, the two plain grouped_mm."""
    S = T * k
    v.keys.add(fused_key(S, T, E, 2 * I, H, gate=act, nsm=v.nsm))
    v.keys.add(fused_key(S, T, E, H, I, gather=False, scale=True, nsm=v.nsm))
    if unfused:
        v.varlen(S, E, 2 * I, H, b_major="k")
        v.varlen(S, E, H, I, b_major="k")


def _fused_layer_tests(v: Variants) -> None:
    """tests/layers/test_fused_layer_gpu.py and test_compile_gpu.py."""
    path = os.path.join(os.path.dirname(__file__), "..", "layers", "test_fused_layer_gpu.py")
    try:
        spec = importlib.util.spec_from_file_location("_fused_layer_gpu_cases", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for T, H, I, E, k, extra in getattr(module, "SHAPES", []):
            _layer_keys(v, T, H, I, E, k, extra.get("activation", "silu"))
    except Exception:  # noqa: BLE001 - the layer tests moved or changed: compile in-test
        pass
    for T, H, I, E, k in [(96, 512, 256, 32, 4), (1, 512, 256, 32, 4), (100, 512, 256, 32, 4),
                          (257, 512, 256, 32, 4), (400, 1024, 256, 64, 8),
                          (77, 512, 256, 16, 4), (20, 512, 256, 8, 2),
                          (300, 1024, 512, 8, 2), (300, 512, 128, 64, 8),
                          (300, 1024, 256, 64, 8), (1, 1024, 384, 32, 8),
                          (77, 1024, 384, 32, 8), (513, 1024, 384, 32, 8),
                          (64, 512, 256, 16, 2), (66, 256, 128, 8, 2)]:
        _layer_keys(v, T, H, I, E, k, unfused=False)
    # GPT-OSS's experts: clamped SwiGLU over alternating columns with biases, (E, H, 2I) and
    # (E, I, H) weights as stored (N-major).
    v.keys.add(fused_key(800, 200, 32, 512, 512, gate="clamped_swiglu", layout="alternating",
                         w_major="n", bias=True, nsm=v.nsm))
    v.keys.add(fused_key(800, 200, 32, 512, 256, gather=False, w_major="n", bias=True,
                         scale=True, nsm=v.nsm))


def fused_test_variants(nsm: int = NUM_SMS) -> list:
    """The CompileKeys of the fused kernel's GPU tests and the MoE layer's GPU tests (the set
    `scripts/precompile.py --set fused` compiles), sorted by name."""
    v = Variants(nsm)
    for collect in (_fused_tests, _layer_tests, _fused_layer_tests):
        collect(v)
    return sorted(v.keys, key=lambda k: k.name())


def _cfg(**kw) -> GemmConfig:
    return GemmConfig(backend="cute", **kw)


def _major(layout: str) -> str:
    """A test's B / w layout name -> the kernel's b_major."""
    return "k" if layout in ("col", "nk_view") else "n"


def _general_tests(v: Variants) -> None:
    for kind in ("mixed", "many", "one", "kvary"):
        sizes = h.general_case(kind, random.Random(7))
        for schedule in h.SCHEDULES:
            for visitor in h.VISITORS:
                for sort in (False, True):
                    for dt in h.DTYPES.values():
                        v.general(sizes, _cfg(schedule=schedule, visitor=visitor,
                                              sort_by_k=sort), dt,
                                  b_major="n" if kind == "many" else "k")
    mixed = h.general_case("mixed", random.Random(3))
    for layout in ("row", "col"):
        for out_dtype in (FP32, None):
            for schedule in h.SCHEDULES:
                v.general(mixed, _cfg(schedule=schedule), out_dtype=out_dtype,
                          b_major=_major(layout))
    for tile in ((64, 128), (64, 256), (128, 64), (128, 192)):
        v.general(mixed, _cfg(schedule="pingpong", tile_m=tile[0], tile_n=tile[1]), b_major="k")
    for tile in ((128, 64), (128, 128), (128, 192)):
        v.general(mixed, _cfg(schedule="cooperative", tile_m=tile[0], tile_n=tile[1]))
    headline = h.general_case("headline", random.Random(1))
    for config in (None, _cfg(schedule="cooperative")):
        v.general(headline, config, b_major="k")
    v.general([(64, 64, 64)])
    for kind in ("mixed", "kvary"):
        for config in (None, _cfg(schedule="pingpong")):
            v.general(h.general_case(kind, random.Random(7)), config)
    for seed in range(3):  # test_general_fast_path_random_sets
        rng = random.Random(seed)
        sizes = [(rng.choice([0, 1, 7, 64, 130, 300]), 8 * rng.randint(1, 48),
                  rng.choice([0, 8, 72, 520, 2056])) for _ in range(rng.randint(3, 20))]
        v.general(sizes, b_major="k" if seed % 2 else "n")


def _varlen_tests(v: Variants) -> None:
    for schedule in h.SCHEDULES:
        for visitor in h.VISITORS:
            for layout in ("kn", "nk_view"):
                for dt in h.DTYPES.values():
                    v.varlen(1000, 10, 136, 264, _cfg(schedule=schedule, visitor=visitor), dt,
                             b_major=_major(layout))
        v.varlen(1024, 256, 512, 7168, _cfg(schedule=schedule), b_major="k")
    v.varlen(8192, 8, 1024, 2048, b_major="k")
    v.varlen(6000, 24, 392, 768, b_major="k")
    for tile in ((64, 256), (128, 128), (128, 192)):
        for layout in ("kn", "nk_view"):
            v.varlen(2600, 14, 520, 1000, _cfg(schedule="pingpong", tile_m=tile[0],
                                               tile_n=tile[1]), FP16, b_major=_major(layout))
    v.varlen(1, 3, 32, 64, CUTE)


def _batched_tests(v: Variants) -> None:
    from .test_batched_gpu import BATCHED_SHAPES

    for schedule in h.SCHEDULES:
        for layout in ("kn", "nk_view"):
            for dt in h.DTYPES.values():
                v.batched(7, 130, 200, 72, _cfg(schedule=schedule), dt, b_major=_major(layout))
        for out_dtype in (FP32, FP16):
            v.batched(6, 100, 192, 320, _cfg(schedule=schedule), out_dtype=out_dtype)
    for shape in BATCHED_SHAPES:
        for schedule in ("auto", *h.SCHEDULES):
            v.batched(*shape, _cfg(schedule=schedule))
    for tile in ((64, 128), (64, 256), (128, 64), (128, 128), (128, 192)):
        v.batched(5, 200, 264, 200, _cfg(schedule="pingpong", tile_m=tile[0], tile_n=tile[1]))
    for tile in ((128, 64), (128, 128), (128, 192), (128, 256)):
        v.batched(5, 200, 264, 200, _cfg(schedule="cooperative", tile_m=tile[0],
                                         tile_n=tile[1]))
    v.batched(4, 1, 16, 8, CUTE)


def _cluster_tests(v: Variants) -> None:
    from .test_clusters_gpu import (
        CLUSTER_BATCHED_SHAPES,
        DEFAULT_1X2_SIZES,
        GENERAL_CLUSTER_CASES,
    )

    for cl in h.CLUSTER_SHAPES.values():
        for layout in ("kn", "nk_view"):
            v.varlen(3000, 24, 264, 200, _cfg(**cl), b_major=_major(layout))
        for tile_n in (128, 256):
            for dt in h.DTYPES.values():
                v.varlen(2100, 8, 640, 4160, _cfg(schedule="cooperative", tile_m=128,
                                                  tile_n=tile_n, **cl), dt, b_major="k")
        v.varlen(1, 4, 256, 128, _cfg(**cl))
        v.varlen(64, 3, 256, 128, _cfg(**cl))
        for shape in CLUSTER_BATCHED_SHAPES:
            for out_dtype in (None, FP32):
                v.batched(*shape, _cfg(**cl), out_dtype=out_dtype, b_major="k")
        for sizes in GENERAL_CLUSTER_CASES.values():
            for layout in ("row", "col"):
                for sort in (False, True):
                    v.general(sizes, _cfg(sort_by_k=sort, **cl), b_major=_major(layout))
        for tile_n in (128, 256):
            for dt, out_dtype in ((BF16, None), (FP16, None), (BF16, FP32)):
                v.general(GENERAL_CLUSTER_CASES["mixed"], _cfg(tile_m=128, tile_n=tile_n, **cl),
                          dt, out_dtype, b_major="k")
    v.general(h.general_case("many", random.Random(17)), _cfg(cluster_m=1, cluster_n=2))
    v.general(DEFAULT_1X2_SIZES)


def _tail_split_tests(v: Variants) -> None:
    from .test_tail_split_gpu import TAIL_SPLIT_BMM_SHAPES

    for zero_tail_tiles in (0, 1):
        T = sum(h.tail_split_counts(v.nsm, zero_tail_tiles)) + 50
        E = len(h.tail_split_counts(v.nsm, zero_tail_tiles))
        for dt, out_dtype, layout in ((BF16, None, "nk_view"), (BF16, None, "kn"),
                                      (FP16, None, "nk_view"), (BF16, FP32, "nk_view")):
            v.varlen(T, E, h.TS_N, h.TS_K, None, dt, out_dtype, b_major=_major(layout))
    counts = h.tail_split_counts(v.nsm, 0)
    T, E = sum(counts), len(counts)
    for extra in (0, 40 * 128):  # test_tail_split_visits (more rows: no split, same key)
        v.varlen(T + extra, E, h.TS_N, h.TS_K, CUTE, trace=True)
    v.varlen(T, E, h.TS_N, h.TS_K, b_major="k")
    v.varlen(T, E, h.TS_N, h.TS_K)
    v.varlen(T, E, h.TS_N, h.TS_K, tail_split=False)  # MOE_GEMM_TAIL_SPLIT=0
    for G, M, N in TAIL_SPLIT_BMM_SHAPES:
        v.batched(G, M, N, h.TS_K, _cfg(schedule="cooperative"), tail_split=True, cluster_m=1,
                  cluster_n=1)
    _tail_split_list_tests(v)
    _tail_split_pinned_tests(v)


def _tail_split_pinned_tests(v: Variants) -> None:
    """test_tail_split_clusters_and_pingpong and test_tail_split_pingpong_lists."""
    from .test_tail_split_gpu import CLUSTER_SPLITS, LIST_CASES, cluster_split_case

    for pins in CLUSTER_SPLITS.values():
        counts, N, _ = cluster_split_case(pins, v.nsm)
        T, E = sum(counts), len(counts)
        cfg = _cfg(tail_split=True, **pins)
        for rows in (T, T + 40):
            v.varlen(rows, E, N, h.TS_K, cfg, b_major="k")
        v.varlen(T, E, N, h.TS_K, cfg, b_major="k", trace=True)
    v.general(LIST_CASES["mixed-k"], _cfg(schedule="pingpong", tile_m=128, tile_n=128,
                                          cluster_m=1, cluster_n=2, tail_split=True),
              b_major="k")


def _tail_split_list_tests(v: Variants) -> None:
    """test_tail_split_lists: each case's launch and its trace launch."""
    from .test_tail_split_gpu import LIST_CASES

    cases = (("long-k", None, BF16, None, "row"), ("long-k", True, FP16, FP32, "col"),
             ("mixed-k", False, BF16, None, "col"), ("mixed-k", True, BF16, FP32, "row"))
    for case, sort, dt, out_dtype, layout in cases:
        if case == "long-k":
            cfg = _cfg(sort_by_k=sort)
        else:
            cfg = _cfg(schedule="cooperative", tile_m=128, tile_n=128, cluster_m=1,
                       cluster_n=1, tail_split=True, sort_by_k=sort)
        for trace in (False, True):
            v.general(LIST_CASES[case], cfg, dt, out_dtype, b_major=_major(layout),
                      trace=trace)


def _trace_tests(v: Variants) -> None:
    rng = random.Random(11)
    sizes = [(rng.choice([0, 1, 130, 257, 600]), 8 * rng.randint(1, 50), 8 * rng.randint(1, 90))
             for _ in range(90)]
    for schedule in h.SCHEDULES:
        for visitor in h.VISITORS:
            for sort in (False, True):
                v.general(sizes, _cfg(schedule=schedule, visitor=visitor, sort_by_k=sort),
                          trace=True)
            v.varlen(3000, 40, 264, 128, _cfg(schedule=schedule, visitor=visitor), trace=True)
        v.batched(37, 300, 264, 128, _cfg(schedule=schedule), trace=True)
    rng = random.Random(12)
    sizes = [(rng.choice([0, 1, 130, 257, 600]), 8 * rng.randint(1, 80), 8 * rng.randint(1, 90))
             for _ in range(70)]
    for cl in h.CLUSTER_SHAPES.values():
        v.varlen(3000, 40, 264, 128, _cfg(**cl), trace=True)
        v.batched(9, 300, 264, 128, _cfg(**cl), trace=True)
        for sort in (False, True):
            v.general(sizes, _cfg(sort_by_k=sort, **cl), trace=True)


def _edge_rows_tests(v: Variants) -> None:
    from .test_edge_rows_gpu import edge_rows_general_sizes

    for cm, cn in ((1, 1), (2, 1), (1, 2)):
        for k in (72, 4160):
            v.varlen(2800, 16, 520, k, _cfg(schedule="cooperative", cluster_m=cm,
                                            cluster_n=cn), b_major="k")
    for tile_n in (128, 256):
        v.general(edge_rows_general_sizes(), _cfg(schedule="cooperative", tile_m=128,
                                                  tile_n=tile_n), b_major="k")
    for m in (1, 64, 65, 193):
        v.batched(5, m, 264, 136, _cfg(schedule="cooperative", cluster_m=2, cluster_n=1))
        v.batched(5, m, 264, 136, _cfg(schedule="cooperative"))


def _trimmed_a_tests(v: Variants) -> None:
    from .test_trimmed_a_gpu import CONFIGS, trim_counts

    for schedule, tile, cluster in CONFIGS:
        counts = trim_counts(tile[0])
        cfg = _cfg(schedule=schedule, tile_m=tile[0], tile_n=tile[1], cluster_m=cluster[0],
                   cluster_n=cluster[1])
        for trim in (False, True):
            for k in (64, 1000):
                v.varlen(sum(counts) + 37, len(counts), 264, k, cfg, b_major="k", trim_a=trim)


def _peek_wait_tests(v: Variants) -> None:
    from .test_peek_wait_gpu import CONFIGS, peek_counts

    for schedule, tile, cluster, trim in CONFIGS:
        counts = peek_counts(tile[0])
        cfg = _cfg(schedule=schedule, tile_m=tile[0], tile_n=tile[1], cluster_m=cluster[0],
                   cluster_n=cluster[1])
        for peek in (False, True):
            for k in (64, 1000):
                v.varlen(sum(counts) + 29, len(counts), 264, k, cfg, b_major="k", trim_a=trim,
                         peek_wait=peek)
    for schedule, tile in (("pingpong", (128, 128)), ("cooperative", (256, 128))):
        cfg = _cfg(schedule=schedule, tile_m=tile[0], tile_n=tile[1])
        for peek in (False, True):
            v.general([(m, 200, 136) for m in (1, 63, 65, 129, 200, 0, 255)], cfg,
                      peek_wait=peek)
            v.batched(5, 97, 264, 136, cfg, peek_wait=peek)


def _other_tests(v: Variants) -> None:
    """Graphs, operands, repeated calls, determinism and kernel options."""
    from .test_kernel_options_gpu import EPI_WHOLE_GENERAL_SIZES
    from .test_repeated_calls_gpu import GENERAL_CONFIGS, MM_REPEAT_CASES

    v.varlen(512, 16, 128, 256, CUTE, b_major="k")  # graph replay
    v.varlen(256, 4, 64, 128, CUTE)  # no host sync
    v.varlen(300, 3, 256, 128)  # capture after eager calls
    for cl in h.CLUSTER_SHAPES.values():
        v.varlen(700, 16, 256, 256, _cfg(**cl), b_major="k")
    v.batched(16, 96, 256, 512, CUTE)
    default_sets = [(64, 256, 512), (0, 256, 64), (129, 256, 1024), (1, 256, 72),
                    (300, 256, 264)]
    v.general(default_sets)
    # Operands: aliasing and expanded / negated views (those our kernels take).
    v.varlen(300, 4, 256, 256, CUTE)
    v.batched(3, 128, 256, 256, CUTE)
    v.general([(96, 256, 256)] * 3, CUTE)
    v.general([(64, 128, 256)])
    v.varlen(300, 4, 128, 256)
    v.batched(3, 64, 128, 256)
    # Repeated calls.
    for config in GENERAL_CONFIGS:
        v.general([(37, 256, 512), (0, 256, 64), (128, 256, 4096), (1, 256, 72),
                   (200, 256, 1024)], config)
        v.general([*default_sets, (17, 256, 2056)], config)
    v.general([(64, 256, 512), (5, 256, 1024), (130, 256, 264)])
    mixed = h.general_case("mixed", random.Random(3))
    v.general(mixed, CUTE, b_major="n")
    for T, counts, N, K, dt, out_dtype, k_major, _, config in MM_REPEAT_CASES.values():
        v.varlen(T, len(counts), N, K, config, dt, out_dtype, b_major="k" if k_major else "n")
    for G, M, N, K, k_major in ((6, 100, 264, 512, False), (3, 1, 512, 1024, True),
                                (64, 128, 512, 7168, False)):
        v.batched(G, M, N, K, b_major="k" if k_major else "n")
    v.varlen(512, 4, 128, 256)
    v.varlen(256, 2, 128, 128)
    v.varlen(64, 4, 64, 128, CUTE)
    v.batched(4, 16, 64, 128, CUTE)
    v.general([(10, 64, 128), (54, 64, 128)], CUTE)
    # Determinism.
    for config in (None, _cfg(schedule="pingpong", tile_m=64, tile_n=256),
                   _cfg(schedule="pingpong"), _cfg(schedule="cooperative")):
        v.varlen(384, 32, 512, 512, config, b_major="k")
    v.general([(1, 384, 256), (77, 384, 256), (130, 384, 256), (256, 384, 256)])
    # Kernel options: PDL (a launch-time flag) and the whole-tile epilogue forced.
    v.general([(130, 200, 72), (256, 512, 1024), (1, 64, 64)], CUTE)
    v.varlen(700, 8, 256, 512, CUTE)
    coop = _cfg(schedule="cooperative")
    v.general(EPI_WHOLE_GENERAL_SIZES, coop, epi_whole=True)
    v.varlen(2500, 12, 512, 640, coop, b_major="k", epi_whole=True)
    v.batched(9, 300, 512, 1024, coop, epi_whole=True)
    v.batched(4, 129, 264, 200, coop, FP16, epi_whole=True)


def _layer_tests(v: Variants) -> None:
    """tests/layers/test_moe_gpu.py: the MoE layer's two grouped_mm per forward, over all
    T * k routed slots, on transposed views of the (E, 2I, H) and (E, H, I) weights."""
    path = os.path.join(os.path.dirname(__file__), "..", "layers", "test_moe_gpu.py")
    shapes = [(1, 256, 128, 16, 4), (96, 512, 256, 32, 4), (200, 1024, 256, 64, 8)]
    shapes += [(T, 512, 256, 64, 8) for T in (1, 100, 257)]
    try:  # the parametrized shapes, from the test module itself
        spec = importlib.util.spec_from_file_location("_moe_gpu_cases", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        shapes += [shape[:5] for shape in getattr(module, "SHAPES", [])]
    except Exception:  # noqa: BLE001 - the layer tests moved or changed: compile in-test
        pass
    for T, H, I, E, k in shapes:
        v.varlen(T * k, E, 2 * I, H, b_major="k")
        v.varlen(T * k, E, H, I, b_major="k")
        # The fused expert path (the layer's default on the GPU): gate-up with the gather,
        # down with the routing weights.
        for act in ("silu", "gelu_tanh"):
            v.keys.add(fused_key(T * k, T, E, 2 * I, H, gate=act, nsm=v.nsm))
        v.keys.add(fused_key(T * k, T, E, H, I, gather=False, scale=True, nsm=v.nsm))


def _masked_tests(v: Variants) -> None:
    """tests/kernels/test_masked_gpu.py: its parametrized cases, from the module's own tables."""
    try:
        from . import test_masked_gpu as module
    except Exception:  # noqa: BLE001 - the tests moved or changed: compile in-test
        return
    for schedule in h.SCHEDULES:
        for layout in ("kn", "nk_view"):
            for dt in (BF16, FP16):
                v.masked(6, 200, 264, 136, _cfg(schedule=schedule), dt,
                         b_major=_major(layout))
        for out_dtype in (FP32, FP16):
            v.masked(6, 200, 192, 320, _cfg(schedule=schedule), out_dtype=out_dtype)
        for cluster in h.CLUSTER_SHAPES.values():
            v.masked(7, 384, 512, 256, _cfg(schedule=schedule, **cluster), b_major="k")
    for G, M, N, K, _, expected_m in module.SHAPES.values():
        v.masked(G, M, N, K, CUTE, b_major="k", expected_m=expected_m)
    for schedule, tm, tn in module.PINNED:
        v.masked(5, 300, 264, 200, _cfg(schedule=schedule, tile_m=tm, tile_n=tn))
    for expected_m in (4, None):
        v.masked(16, 256, 1024, 2048, CUTE, b_major="k", expected_m=expected_m)


def _packed_pairs_tests(v: Variants) -> None:
    from moe_gemm.ops.choice_switches import PACKED_PAIRS_ENV

    from .test_packed_pairs_gpu import CONFIGS, _counts

    for i, (schedule, (tm, tn)) in enumerate(CONFIGS):
        counts = _counts(tm)
        cfg = _cfg(schedule=schedule, tile_m=tm, tile_n=tn, cluster_m=2, cluster_n=1)
        for packed in ("0", "1"):
            with mock.patch.dict(os.environ, {PACKED_PAIRS_ENV: packed}):
                for K in (64, 1000):
                    v.varlen(sum(counts) + 37, len(counts), 264, K, cfg, b_major="k")
                if i < 2:
                    v.varlen(sum(counts) + 9, len(counts), 264, 320, cfg, b_major="n")
                    if packed == "1":
                        v.varlen(3 * sum(counts) + 50, 3 * len(counts), 1000, 128, cfg,
                                 b_major="k", trace=True)


def kernel_test_variants(nsm: int = NUM_SMS) -> list:
    """The CompileKeys the GPU tests launch, sorted by name."""
    v = Variants(nsm)
    for collect in (_general_tests, _varlen_tests, _batched_tests, _cluster_tests,
                    _tail_split_tests, _trace_tests, _edge_rows_tests, _other_tests,
                    _layer_tests, _fused_tests, _fused_layer_tests, _masked_tests,
                    _fused_masked_tests, _trimmed_a_tests, _peek_wait_tests,
                    _packed_pairs_tests):
        collect(v)
    return sorted(v.keys, key=lambda k: k.name())


# tests/ops/test_router_topk_gpu.py's routers: (E, k, dtype, renormalize) of the softmax router
# and (E, k, n_group, topk_group, dtype, has_bias, renormalize) of the sigmoid one.
_SOFTMAX_ROUTERS = [
    (1, 1, "float32", True), (8, 2, "bfloat16", True), (33, 32, "float32", False),
    (60, 4, "bfloat16", False), (128, 8, "bfloat16", True), (128, 8, "float32", False),
    (256, 8, "bfloat16", True), (384, 6, "float32", True), (1000, 32, "bfloat16", False),
    (1024, 8, "bfloat16", True), (128, 8, "float16", True), (64, 4, "float32", False),
    (48, 8, "float32", True), (48, 4, "float32", True), (128, 8, "float32", True)]
_GROUP_ROUTERS = [
    (256, 8, 8, 4, "float32", True, True), (256, 8, 8, 4, "bfloat16", True, False),
    (160, 8, 1, 1, "float32", True, True), (64, 6, 8, 3, "bfloat16", False, True),
    (96, 4, 3, 2, "float32", True, True), (384, 8, 1, 1, "bfloat16", True, True),
    (1024, 32, 32, 31, "float32", True, True), (256, 8, 8, 4, "bfloat16", True, True)]


def router_test_variants() -> list:
    """The router kernels' compile keys the router GPU tests launch (scripts/precompile.py's
    'tests' set compiles them beside the GEMMs)."""
    from moe_gemm.kernels.sm90.router_topk import GroupTopkCompileKey, RouterTopkCompileKey

    keys = [RouterTopkCompileKey(d, E, k, r) for E, k, d, r in _SOFTMAX_ROUTERS]
    keys += [GroupTopkCompileKey(d, E, k, g, tg, r, b) for E, k, g, tg, d, b, r in _GROUP_ROUTERS]
    return sorted(set(keys), key=lambda k: k.name())
