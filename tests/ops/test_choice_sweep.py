"""The host-side kernel choices never name a kernel the compile rules refuse: over a grid of
shapes, every pinnable config and every fused option, fused_choice's tile (and whether the
kernel gathers) passes tile_problem / fused_problem and the tile sets, and choose_fp8 either
refuses a pin with a ValueError naming why or returns a tile fp8_tile_problem accepts. (Shapes
from meta tensors: nothing here needs a GPU.)"""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_gemm.config import CLUSTERS, COOPERATIVE_TILES, PINGPONG_TILES, GemmConfig
from moe_gemm.kernels.sm90.constants import fused_problem, tile_problem
from moe_gemm.kernels.sm90.constants_fp8 import fp8_tile_problem
from moe_gemm.ops import fused_launch, launch_kernel
from moe_gemm.ops.fused_validation import check_fused_mm
from moe_gemm.ops.heuristics_fp8 import choose_fp8, kernel_scale_mode

META = torch.device("meta")


def _configs():
    yield GemmConfig()
    for schedule, tiles in (("pingpong", PINGPONG_TILES), ("cooperative", COOPERATIVE_TILES)):
        for (tm, tn), (cm, cn) in itertools.product(tiles, CLUSTERS):
            try:
                yield GemmConfig(schedule=schedule, tile_m=tm, tile_n=tn, cluster_m=cm,
                                 cluster_n=cn)
            except ValueError:
                pass
    for cm, cn in CLUSTERS:
        yield GemmConfig(cluster_m=cm, cluster_n=cn)
    yield from (GemmConfig(schedule="pingpong"), GemmConfig(schedule="cooperative"),
                GemmConfig(whole_epilogue=True), GemmConfig(tail_split=True))


CONFIGS = list(_configs())


def _assert_buildable(choice, tiles_ok=True):
    tiles = PINGPONG_TILES if choice.schedule == "pingpong" else COOPERATIVE_TILES
    assert not tiles_ok or (choice.tile_m, choice.tile_n) in tiles, choice
    assert (choice.cluster_m, choice.cluster_n) in CLUSTERS, choice
    if choice.tail_split:
        assert choice.schedule == "cooperative" and choice.cluster_m * choice.cluster_n == 1
    if choice.epi_whole:
        assert choice.schedule == "cooperative" and choice.tile_m == 128


@pytest.mark.parametrize("device", [None, "NVIDIA H100 80GB HBM3"])
def test_fused_choices_are_buildable(device, monkeypatch):
    monkeypatch.setattr(launch_kernel, "_table_device", lambda _: device)  # tables or rules
    for S, N, K in itertools.product((1, 64, 2048, 4096), (96, 768, 14336), (128, 7168)):
        for gate, layout, gather, bias, weight in itertools.product(
                (None, "silu"), ("concat", "interleaved", "alternating"), (False, True),
                (False, True), (False, True)):
            if gate is None and layout != "concat":
                continue
            w = torch.empty(8, N, K, device=META, dtype=torch.bfloat16)
            w = w.transpose(1, 2) if layout == "concat" or S == 1 else w.reshape(8, K, N)
            args = check_fused_mm(
                torch.empty(S, K, device=META, dtype=torch.bfloat16), w,
                torch.empty(8, dtype=torch.int32, device=META),
                row_index=torch.empty(S, dtype=torch.int32, device=META) if gather else None,
                bias=torch.empty(8, N, device=META) if bias else None,
                row_weight=torch.empty(S, device=META) if weight else None, gate=gate,
                gate_layout=layout, concrete=False)
            b_major = "k" if w.stride(1) == 1 else "n"
            for config in CONFIGS if S == 64 else CONFIGS[:1]:
                choice, in_kernel = fused_launch.fused_choice(args, config, 132, META)
                why = tile_problem(choice.schedule, choice.tile_m, choice.tile_n) or (
                    fused_problem("varlen", choice.schedule, choice.tile_m, choice.tile_n,
                                  b_major, choice.cluster_n, gate or "", layout, in_kernel))
                assert why is None, (S, N, K, gate, layout, gather, config, choice, why)
                assert in_kernel <= gather
                _assert_buildable(choice)


def test_fp8_choices_are_buildable_or_refused_with_a_reason():
    refused = 0
    for config in [*CONFIGS, GemmConfig(stages=2), GemmConfig(tail_split=False)]:
        for form, m, N, K, itemsize, g in itertools.product(
                ("varlen", "batched", "general"), (1, 64, 65, 4096), (16, 100, 256, 4096),
                (128, 8192), (2, 4), ("block", "row")):
            try:
                choice = choose_fp8(form, config, m, N, K, itemsize, g)
            except ValueError as exc:
                assert str(exc)  # (a pin the FP8 kernel does not build, named)
                refused += 1
                continue
            assert fp8_tile_problem(choice.schedule, choice.tile_m, choice.tile_n,
                                    kernel_scale_mode(g)) is None, (config, form, choice)
            assert not choice.tail_split or form != "general"
            assert not choice.epi_whole or itemsize == 2
            _assert_buildable(choice, tiles_ok=False)
    assert refused  # (the sweep does reach pins the FP8 kernel refuses)
