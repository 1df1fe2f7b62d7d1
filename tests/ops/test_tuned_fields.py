"""GemmConfig's tuned fields (raster_panel, raster_along, raster_serpentine, tail_split,
whole_epilogue): validation, and how each reaches the KernelChoice in every form."""

from __future__ import annotations

import pytest

from moe_gemm import GemmConfig
from moe_gemm.config import TUNED_FIELDS
from moe_gemm.ops import heuristics
from moe_gemm.ops.heuristics import choose_batched, choose_general, choose_varlen

# mixtral-like: long K, 128 rows per expert and more: the rules pick cooperative 128x256 with
# the whole-tile epilogue, panel 16 and the tail split.
MIX = (16384, 8, 14336, 4096, 132)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
    heuristics.clear_caches()
    yield
    heuristics.clear_caches()


def test_validation():
    for bad in (0, -1, 65):
        with pytest.raises(ValueError, match="raster_panel"):
            GemmConfig(raster_panel=bad)
    with pytest.raises(TypeError, match="raster_panel"):
        GemmConfig(raster_panel=8.0)
    with pytest.raises(TypeError, match="raster_panel"):
        GemmConfig(raster_panel=True)
    for name in ("tail_split", "whole_epilogue"):
        with pytest.raises(TypeError, match=name):
            GemmConfig(**{name: 1})
    with pytest.raises(ValueError, match="tail_split=True is built for the device visitor"):
        GemmConfig(tail_split=True, visitor="host")
    # Ping-pong tiles and 2-CTA clusters build it (a cluster splits its cluster tile) ...
    GemmConfig(tail_split=True, schedule="pingpong", tile_m=128, tile_n=192)
    GemmConfig(tail_split=True, cluster_m=2, cluster_n=1)
    # ... but under schedule="auto" a split pins the cooperative schedule's tiles.
    with pytest.raises(ValueError, match="tail_split=True is built for the cooperative"):
        GemmConfig(tail_split=True, tile_m=64, tile_n=256)
    with pytest.raises(ValueError, match="whole_epilogue=True is built for the cooperative"):
        GemmConfig(whole_epilogue=True, schedule="pingpong")
    # False is always fine, and the configs stay hashable and comparable.
    a = GemmConfig(tail_split=False, schedule="pingpong", whole_epilogue=False, raster_panel=1)
    assert hash(a) == hash(GemmConfig(tail_split=False, schedule="pingpong",
                                      whole_epilogue=False, raster_panel=1))
    assert GemmConfig(raster_panel=64).raster_panel == 64


def test_tuning_pinned():
    assert set(TUNED_FIELDS) >= {"raster_panel", "tail_split", "whole_epilogue", "stages"}
    assert not GemmConfig().tuning_pinned
    assert not GemmConfig(backend="cute").tuning_pinned
    for change in ({"schedule": "pingpong"}, {"raster_panel": 4}, {"tail_split": False},
                   {"whole_epilogue": False}, {"sort_by_k": False}, {"stages": 3},
                   {"visitor": "device"}, {"tile_m": 128, "tile_n": 128}):
        assert GemmConfig(**change).tuning_pinned, change


def test_varlen_crossing():
    rules = choose_varlen(GemmConfig(), *MIX)
    assert (rules.swizzle, rules.epi_whole, rules.tail_split) == (16, True, True)
    c = choose_varlen(GemmConfig(raster_panel=4), *MIX)
    assert c.swizzle == 4 and c.epi_whole  # only the panel changed
    c = choose_varlen(GemmConfig(tail_split=False, whole_epilogue=False), *MIX)
    assert (c.tail_split, c.epi_whole, c.swizzle) == (False, False, 8)
    # Pinned on where the rules say no (short K, ping-pong by rule): forces cooperative.
    short = (32768, 128, 2048, 768, 132)
    assert choose_varlen(GemmConfig(), *short).schedule == "pingpong"
    c = choose_varlen(GemmConfig(tail_split=True, whole_epilogue=True), *short)
    assert (c.schedule, c.tail_split, c.epi_whole) == ("cooperative", True, True)


def test_pinned_fields_refused_with_the_reason():
    with pytest.raises(ValueError, match="tail_split=True is built for the cooperative "
                                         "schedule, whose tiles are .*; got tile 64x256"):
        GemmConfig(tile_m=64, tile_n=256, tail_split=True)  # (named when the config is made)
    with pytest.raises(ValueError, match="16-bit"):
        choose_varlen(GemmConfig(whole_epilogue=True), *MIX, out_itemsize=4)
    # The lists take a pinned split, but not with the host visitor the config also pins.
    assert choose_general(GemmConfig(tail_split=True), ((256, 512, 4096),) * 4, 132).tail_split
    with pytest.raises(ValueError, match="device visitor"):
        GemmConfig(tail_split=True, visitor="host")
    # A cluster pinned beside tail_split is caught by GemmConfig already; the 1x2 cluster the
    # rules would pick (the headline, as 3-D batches and as lists) gives way to a pinned split.
    c = choose_batched(GemmConfig(tail_split=True), 256, 128, 512, 7168, 132)
    assert c.tail_split and (c.cluster_m, c.cluster_n) == (1, 1)
    c = choose_general(GemmConfig(tail_split=True), ((128, 512, 7168),) * 256, 132)
    assert c.tail_split and (c.cluster_m, c.cluster_n) == (1, 1)
    assert (choose_general(GemmConfig(), ((128, 512, 7168),) * 256, 132).cluster_n) == 2


def test_env_switch_still_turns_a_pinned_tail_split_off(monkeypatch):
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    assert not choose_varlen(GemmConfig(tail_split=True), *MIX).tail_split
    assert not choose_batched(GemmConfig(tail_split=True, cluster_m=1, cluster_n=1), 64, 256,
                              512, 7168, 132).tail_split


def test_general_and_batched_crossing():
    sizes = ((256, 512, 4096),) * 4
    g = choose_general(GemmConfig(raster_panel=2, whole_epilogue=True), sizes, 132)
    assert (g.swizzle, g.epi_whole, g.schedule) == (2, True, "cooperative")
    assert choose_general(GemmConfig(), sizes, 132).swizzle == 8
    with pytest.raises(ValueError, match="16-bit"):
        choose_general(GemmConfig(whole_epilogue=True), sizes, 132, 4)
    b = choose_batched(GemmConfig(raster_panel=32, tail_split=True, cluster_m=1, cluster_n=1),
                       64, 256, 512, 7168, 132)
    assert (b.swizzle, b.tail_split, b.cluster_n) == (32, True, 1)
    assert choose_batched(GemmConfig(whole_epilogue=True), 64, 256, 512, 7168, 132).epi_whole


def test_raster_pins_reach_the_kernel_code_in_every_form():
    from moe_gemm.kernels.sm90.constants import raster_code
    from moe_gemm.ops.heuristics import choice_fields
    from moe_gemm.ops.heuristics_fp8 import choose_fp8

    pinned = GemmConfig(raster_panel=8, raster_along="n", raster_serpentine=True)
    want = raster_code(8, "n", serpentine=True)
    varlen = choose_varlen(pinned, 32768, 128, 2048, 768, 132)
    assert varlen.swizzle == want
    assert choose_batched(pinned, 8, 512, 1024, 1024, 132).swizzle == want
    assert choose_general(pinned, ((256, 512, 1024),) * 4, 132).swizzle == want
    assert choose_fp8("varlen", pinned, 512.0, 2048, 1024, 2, "block").swizzle == want
    # Axis or serpentine alone; the panel from the rules when not pinned.
    assert choose_varlen(GemmConfig(raster_along="n"), 32768, 128, 2048, 768,
                         132).swizzle == raster_code(8, "n")
    assert choose_varlen(GemmConfig(raster_serpentine=True), 32768, 128, 2048, 768,
                         132).swizzle == raster_code(8, "m", serpentine=True)
    # Unpinned: the plain m-panel codes the kernel always took.
    assert choose_varlen(GemmConfig(), 32768, 128, 2048, 768, 132).swizzle in (8, 16)
    # The tuner's fields for a choice reproduce it.
    fields = choice_fields(varlen, "varlen")
    assert (fields["raster_panel"], fields["raster_along"], fields["raster_serpentine"]) == (
        8, "n", True)
    again = choose_varlen(GemmConfig(**fields), 32768, 128, 2048, 768, 132)
    assert again.swizzle == want and again.tile_m == varlen.tile_m
    assert "raster_along" not in choice_fields(
        choose_varlen(GemmConfig(), 32768, 128, 2048, 768, 132), "varlen")
