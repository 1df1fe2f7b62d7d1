"""The FP8 kernels' skipped empty halves on the CPU: on by default only on problems of
HALF_SKIP_MIN_ROWS rows or more in grouped_mm's forms, the switch that takes them everywhere
the kernel builds them (or nowhere), the compile key that names them and the tiles the kernel
refuses them on. (The skip itself runs in test_fp8_gpu.py, bit for bit against whole
tiles.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_gemm.config import GemmConfig
from moe_gemm.env import EnvError
from moe_gemm.ops import api
from moe_gemm.ops.heuristics_fp8 import HALF_SKIP_ENV, HALF_SKIP_MIN_ROWS, choose_fp8
from moe_gemm.ops.scaled_launch import fp8_compile_key

CFG = GemmConfig()


def _choices(config=CFG):
    """(form, granularity, choice) over the forms, decode and prefill row counts and both
    scale granularities."""
    return [(form, g, choose_fp8(form, config, avg, 4096, 7168, 2, g))
            for form in ("varlen", "batched", "general", "masked")
            for avg in (4.0, 512.0)  # ping-pong 64-row decode tiles, cooperative 128-row
            for g in ("block", "row")]


def test_off_by_default_below_the_row_threshold_and_off_everywhere_when_switched_off(
        monkeypatch):
    monkeypatch.delenv(HALF_SKIP_ENV, raising=False)
    assert not any(c.skip_empty_half for _, _, c in _choices())
    monkeypatch.setenv(HALF_SKIP_ENV, "0")
    assert not any(c.skip_empty_half for _, _, c in _choices())
    big = [(form, choose_fp8(form, CFG, float(HALF_SKIP_MIN_ROWS), 4096, 7168, 2, g))
           for form in ("varlen", "batched", "general", "masked") for g in ("block", "row")]
    assert not any(c.skip_empty_half for _, c in big)


@pytest.mark.parametrize("granularity", ["block", "row"])
def test_on_by_default_from_the_row_threshold_in_grouped_mms_forms(monkeypatch, granularity):
    monkeypatch.delenv(HALF_SKIP_ENV, raising=False)
    for form in ("varlen", "batched"):
        below = choose_fp8(form, CFG, HALF_SKIP_MIN_ROWS - 1.0, 4096, 7168, 2, granularity)
        at = choose_fp8(form, CFG, float(HALF_SKIP_MIN_ROWS), 4096, 7168, 2, granularity)
        assert (below.schedule, below.tile_m) == (at.schedule, at.tile_m) == (
            "cooperative", 128)
        assert not below.skip_empty_half and at.skip_empty_half, form
        # nothing else about the kernel changes
        assert dataclasses.replace(below, skip_empty_half=True) == at
    # the general form (per-problem sizes) and the masked form were never timed with it
    for form in ("general", "masked"):
        assert not choose_fp8(form, CFG, 4096.0, 4096, 7168, 2, granularity).skip_empty_half
    # a pinned ping-pong tile (a warpgroup a tile) never takes it
    assert not choose_fp8("varlen", GemmConfig(schedule="pingpong", tile_m=128, tile_n=64),
                          4096.0, 1024, 4096, 2, granularity).skip_empty_half


def test_the_switch_takes_it_on_every_cooperative_128_row_tile_only(monkeypatch):
    monkeypatch.delenv(HALF_SKIP_ENV, raising=False)
    off = _choices()
    monkeypatch.setenv(HALF_SKIP_ENV, "1")
    on = _choices()
    assert {c.schedule for _, _, c in on} == {"pingpong", "cooperative"}
    for (form, g, a), (_, _, b) in zip(on, off):
        want = a.schedule == "cooperative" and a.tile_m == 128
        assert a.skip_empty_half == want, (form, g, a.schedule, a.tile_m)
        # nothing else about the kernel changes
        assert dataclasses.replace(b, skip_empty_half=a.skip_empty_half) == a
    # pinned tiles too: cooperative 128 x 192 takes it, ping-pong 128 x 64 (a warpgroup a
    # tile) does not
    pinned = choose_fp8("varlen", GemmConfig(schedule="cooperative", tile_m=128, tile_n=192),
                        300.0, 1024, 4096, 2, "block")
    assert pinned.skip_empty_half
    assert not choose_fp8("varlen", GemmConfig(schedule="pingpong", tile_m=128, tile_n=64),
                          300.0, 1024, 4096, 2, "block").skip_empty_half
    key = fp8_compile_key("varlen", torch.float8_e4m3fn, torch.bfloat16, "block", pinned)
    assert key.skip_empty_half and "_halfskip" in key.name()
    key = fp8_compile_key("varlen", torch.float8_e4m3fn, torch.bfloat16, "block", off[3][2])
    assert not key.skip_empty_half and "halfskip" not in key.name()


def test_the_switch_refuses_other_values_and_keys_the_plan_caches(monkeypatch):
    monkeypatch.setenv(HALF_SKIP_ENV, "half")
    with pytest.raises(EnvError, match=HALF_SKIP_ENV):
        choose_fp8("varlen", CFG, 512.0, 4096, 7168, 2, "block")
    assert HALF_SKIP_ENV in api._PLAN_SWITCHES


@pytest.mark.parametrize("schedule, tile", [("pingpong", (64, 128)), ("pingpong", (128, 64)),
                                            ("pingpong", (64, 192))])
def test_the_kernel_refuses_it_on_other_tiles(schedule, tile):
    cutlass = pytest.importorskip("cutlass")
    from moe_gemm.kernels.sm90.grouped_gemm_fp8 import GroupedGemmFp8Sm90

    with pytest.raises(ValueError, match="skip_empty_half is built for cooperative 128-row"):
        GroupedGemmFp8Sm90(cutlass.Float8E4M3FN, cutlass.BFloat16, "varlen", schedule,
                           "device", tile, "block", skip_empty_half=True)
