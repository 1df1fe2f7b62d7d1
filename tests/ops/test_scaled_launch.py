"""ops/scaled_launch.py and the FP8 kernel choice on the CPU, with the compiled kernel replaced
by an emulator that computes what the kernel computes from the arguments it is given
(fp8_fakes.py): every form and granularity against the fp64 reference, the arguments the
kernel sees (scale views, tables, zero tail, grid), cached plans, pins and refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fp8_fakes import KernelFactory, Memory, install

from moe_gemm import GemmConfig, scaled_grouped_gemm, scaled_grouped_mm
from moe_gemm.env import EnvError
from moe_gemm.ops import heuristics_fp8, launch_info, scaled_launch
from moe_gemm.ops.scaled_reference import scaled_grouped_gemm_ref, scaled_grouped_mm_ref
from moe_gemm.testing import poison_
from moe_gemm.testing_fp8 import (
    GRANULARITIES,
    assert_fp8_close,
    make_fp8_batched_inputs,
    make_fp8_grouped_inputs,
    make_fp8_moe_inputs,
)


@pytest.fixture
def fp8_kernel(monkeypatch):
    factory = KernelFactory()
    install(monkeypatch, factory)
    heuristics_fp8.clear_caches()
    yield factory
    heuristics_fp8.clear_caches()



@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("T,E", [(300, 4), (37, 16)])
def test_varlen(fp8_kernel, granularity, T, E):
    x, w, sa, sb, offs = make_fp8_moe_inputs(T, E, 384, 200, granularity, empty_fraction=0.3,
                                             seed=T)
    y = scaled_grouped_mm(x, w, sa, sb, offs)
    assert len(fp8_kernel.calls) == 1
    call = fp8_kernel.calls[0]
    assert_fp8_close(y, scaled_grouped_mm_ref(x, w, sa, sb, offs))
    key = fp8_kernel.made[0].key
    assert key.form == "varlen" and key.scale_mode == ("block" if granularity == "block"
                                                        else "outer")
    # The zero tail is problem E (out is ours); the scale views the kernel reads have no
    # repeated dimension.
    assert call[8] == E + 1
    for s in (call[3], call[4]):
        assert all(st != 0 or n == 1 for st, n in zip(s.stride(), s.shape))
    info = launch_info.last_launch()
    assert info.num_problems == E + 1 and info.choice.tile_m == key.tile_m


def test_varlen_plan_is_cached_and_sees_new_values(fp8_kernel):
    x, w, sa, sb, offs = make_fp8_moe_inputs(64, 4, 256, 128, "block", seed=1)
    scaled_grouped_mm(x, w, sa, sb, offs)
    x2, _, sa2, _, offs2 = make_fp8_moe_inputs(64, 4, 256, 128, "block", seed=2)
    x.copy_(x2)
    sa.copy_(sa2)
    offs.copy_(offs2)
    y = scaled_grouped_mm(x, w, sa, sb, offs)
    assert len(fp8_kernel.made) == 1 and len(fp8_kernel.calls) == 2
    assert_fp8_close(y, scaled_grouped_mm_ref(x2, w, sa2, sb, offs2))
    # Another out_dtype is another plan.
    scaled_grouped_mm(x, w, sa, sb, offs, out_dtype=torch.float32)
    assert len(fp8_kernel.made) == 2


def test_varlen_out_rows_past_offs_untouched(fp8_kernel):
    x, w, sa, sb, offs = make_fp8_moe_inputs(50, 3, 128, 64, "row", total=41, seed=3)
    out = poison_(torch.empty(50, 64, dtype=torch.float32))
    assert scaled_grouped_mm(x, w, sa, sb, offs, out=out) is out
    assert torch.isnan(out[41:]).all()
    assert_fp8_close(out[:41], scaled_grouped_mm_ref(x, w, sa, sb, offs)[:41])
    assert fp8_kernel.calls[0][8] == 3  # no zero tail into a caller's out


def test_varlen_odd_layouts(fp8_kernel):
    # T = 1 taken from a wider tensor, offs non-contiguous, a single expert.
    x, w, sa, sb, offs = make_fp8_moe_inputs(1, 1, 256, 32, "block", seed=4)
    wide = torch.zeros(1, 512 + 16, dtype=x.dtype)
    wide[:, 16:272] = x
    xv = wide[:, 16:272]
    offs2 = torch.tensor([1, 7], dtype=torch.int32)[::2]
    y = scaled_grouped_mm(xv, w, sa, sb, offs2)
    assert_fp8_close(y, scaled_grouped_mm_ref(x, w, sa, sb, offs))
    assert fp8_kernel.calls[0][7].is_contiguous()


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_varlen_zero_k_writes_zeros_without_a_launch(fp8_kernel, granularity):
    # K = 0: every routed row is an empty sum. The launch-time TMA descriptors of x and w
    # cannot have an empty K extent, so the zeros are written on the host (as the batched
    # form and grouped_mm's varlen form do), with a given out's rows past offs[-1] kept.
    x, w, sa, sb, offs = make_fp8_moe_inputs(40, 3, 0, 48, granularity, total=29, seed=8)
    assert x.shape == (40, 0) and int(offs[-1]) == 29
    y = scaled_grouped_mm(x, w, sa, sb, offs)
    assert y.shape == (40, 48) and y.dtype == torch.bfloat16 and not y.any()
    out = poison_(torch.empty(40, 48, dtype=torch.float32))
    assert scaled_grouped_mm(x, w, sa, sb, offs, out=out) is out
    assert not out[:29].any() and torch.isnan(out[29:]).all()
    assert fp8_kernel.calls == []


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_batched(fp8_kernel, granularity):
    x, w, sa, sb = make_fp8_batched_inputs(3, 70, 256, 144, granularity, seed=5)
    y = scaled_grouped_mm(x, w, sa, sb, out_dtype=torch.float16)
    assert y.dtype == torch.float16
    assert_fp8_close(y, scaled_grouped_mm_ref(x, w, sa, sb))
    assert fp8_kernel.made[0].key.form == "batched"


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_general(fp8_kernel, granularity, monkeypatch):
    sizes = [(40, 64, 256), (0, 32, 128), (7, 144, 384), (1, 16, 128), (9, 48, 128)]
    a, b, sa, sb = make_fp8_grouped_inputs(sizes, granularity, seed=6)
    fp8_kernel.memory = memory = Memory([*a, *b, *sa, *sb])
    made = scaled_launch.new_outputs

    def new_outputs(*args):  # the outputs the op allocates, made known to the emulator
        outs = made(*args)
        memory.tensors.extend(outs)
        return outs

    monkeypatch.setattr(scaled_launch, "new_outputs", new_outputs)
    outs = scaled_grouped_gemm(a, b, sa, sb, out_dtype=torch.float32)
    refs = scaled_grouped_gemm_ref(a, b, sa, sb)
    assert len(fp8_kernel.calls) == 1
    for o, r in zip(outs, refs):
        assert_fp8_close(o, r)


def test_general_out_given_and_zero_k(fp8_kernel):
    sizes = [(5, 32, 128), (6, 16, 0), (0, 16, 128)]
    a, b, sa, sb = make_fp8_grouped_inputs(sizes, "row", seed=7)
    given = [poison_(torch.empty(m, n, dtype=torch.bfloat16)) for m, n, _ in sizes]
    fp8_kernel.memory = Memory([*a, *b, *sa, *sb, *given])
    res = scaled_grouped_gemm(a, b, sa, sb, out=given)
    assert all(r is g for r, g in zip(res, given))
    assert torch.equal(given[1].float(), torch.zeros(6, 16))  # K = 0: zeros
    assert_fp8_close(given[0], scaled_grouped_gemm_ref(a, b, sa, sb)[0])


@pytest.mark.parametrize("avg,N,schedule,tile,cluster,tail_split", [
    (4, 2048, "pingpong", (64, 128), (1, 1), False),
    (32, 2048, "pingpong", (64, 128), (1, 1), False),
    (33, 2048, "cooperative", (128, 128), (1, 2), False),  # pairs of column tiles
    (64, 4096, "cooperative", (128, 128), (1, 2), False),
    (128, 2048, "cooperative", (128, 128), (1, 2), False),
    (64, 200, "cooperative", (128, 128), (1, 1), True),  # second column tile partial: no pair
    (256, 2048, "cooperative", (128, 128), (1, 2), False),
    (2048, 4096, "cooperative", (128, 128), (1, 2), False),
    (2048, 128, "cooperative", (128, 128), (1, 1), True),
])
def test_default_choice(fp8_kernel, avg, N, schedule, tile, cluster, tail_split):
    choice = heuristics_fp8.choose_fp8("varlen", GemmConfig(), avg, N, 7168, 2, "block")
    assert (choice.schedule, (choice.tile_m, choice.tile_n)) == (schedule, tile)
    assert (choice.cluster_m, choice.cluster_n) == cluster
    assert choice.visitor == "device"
    assert choice.tail_split == tail_split
    narrow = heuristics_fp8.choose_fp8("batched", GemmConfig(), 128, 40, 512, 2, "row")
    assert narrow.tile_n == 48 and not narrow.tail_split


def test_default_cluster_only_where_the_config_leaves_it(fp8_kernel):
    """Pinned clusters, tail split, whole epilogue, the general form: no cluster of ours; the
    batched form pairs column tiles like the varlen one (where there are two)."""
    for form in ("varlen", "batched"):
        for cfg in (GemmConfig(cluster_m=1, cluster_n=1), GemmConfig(tail_split=True),
                    GemmConfig(whole_epilogue=True)):
            c = heuristics_fp8.choose_fp8(form, cfg, 64, 4096, 7168, 2, "block")
            assert (c.cluster_m, c.cluster_n) == (1, 1)
    c = heuristics_fp8.choose_fp8("general", GemmConfig(), 64, 4096, 7168, 2, "block")
    assert (c.cluster_m, c.cluster_n) == (1, 1)
    headline = heuristics_fp8.choose_fp8("batched", GemmConfig(), 128, 512, 7168, 2, "block")
    assert (headline.cluster_m, headline.cluster_n) == (1, 2) and not headline.tail_split
    narrow = heuristics_fp8.choose_fp8("batched", GemmConfig(), 128, 200, 7168, 2, "block")
    assert (narrow.cluster_m, narrow.cluster_n) == (1, 1)
    pinned = heuristics_fp8.choose_fp8("varlen", GemmConfig(cluster_m=2, cluster_n=1), 64,
                                       4096, 7168, 2, "block")
    assert (pinned.cluster_m, pinned.cluster_n) == (2, 1)


def test_default_raster_panel_by_form() -> None:
    """Panels of 16 m-tiles in the varlen form, 8 in the others, where the config leaves the
    order to us; a pinned panel, axis or serpentine walk is the kernel's order everywhere."""
    from moe_gemm.kernels.sm90.constants import raster_code

    def choose(form, **cfg):
        return heuristics_fp8.choose_fp8(form, GemmConfig(**cfg), 1024.0, 4096, 7168, 2,
                                         "block").swizzle

    assert choose("varlen") == raster_code(16)
    for form in ("batched", "masked", "general"):
        assert choose(form) == raster_code(8), form
    for form in ("varlen", "batched"):
        assert choose(form, raster_panel=4) == raster_code(4)
        assert choose(form, raster_along="n", raster_serpentine=True) == raster_code(
            heuristics_fp8.default_raster_panel(form), "n", True)


def test_whole_epilogue_by_default_in_pairs_of_varlen_tiles() -> None:
    """The varlen form's compute-bound default, cooperative 128x128 in a 1x2 cluster, stores
    through the whole-tile epilogue where the output is 16-bit; not for fp32 output, the
    batched and masked forms, ping-pong tiles, a config that says whole_epilogue=False, or
    a lone tile (which keeps the tail split); whole_epilogue=True still means no cluster."""
    def choose(form="varlen", rows=1024.0, N=4096, out=2, **cfg):
        return heuristics_fp8.choose_fp8(form, GemmConfig(**cfg), rows, N, 7168, out, "block")

    c = choose()
    assert c.epi_whole and (c.cluster_m, c.cluster_n) == (1, 2) and not c.tail_split
    assert choose(rows=64.0).epi_whole  # (cooperative from 33 rows per expert)
    assert choose(cluster_m=1, cluster_n=2).epi_whole  # the same cluster pinned
    for off in (choose(out=4), choose("batched", rows=128.0, N=512), choose("masked"),
                choose(rows=8.0, N=512), choose(whole_epilogue=False), choose(N=200)):
        assert not off.epi_whole, off
    pinned = choose(whole_epilogue=True)
    assert pinned.epi_whole and (pinned.cluster_m, pinned.cluster_n) == (1, 1)


def test_lagged_promotion_is_opt_in(fp8_kernel, monkeypatch):
    """With the scales loaded by the math threads (MOE_GEMM_FP8_SMEM_SCALES=0, and the
    batched, general and masked forms), MOE_GEMM_FP8_PROMOTE_LAG=1 asks for the lagged promotion; it
    is taken where it is built (block scales, a tile with room for a third accumulator), and
    a repeated call's cached plan follows the switch."""
    choose = heuristics_fp8.choose_fp8
    monkeypatch.delenv(heuristics_fp8.PROMOTE_LAG_ENV, raising=False)
    monkeypatch.setenv(heuristics_fp8.SMEM_SCALES_ENV, "0")
    assert not choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block").promote_lag
    monkeypatch.delenv(heuristics_fp8.SMEM_SCALES_ENV)
    assert not choose("batched", GemmConfig(), 64, 4096, 7168, 2, "block").promote_lag
    assert not choose("general", GemmConfig(), 64, 4096, 7168, 2, "block").promote_lag
    monkeypatch.setenv(heuristics_fp8.SMEM_SCALES_ENV, "0")
    monkeypatch.setenv(heuristics_fp8.PROMOTE_LAG_ENV, "1")
    assert choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block").promote_lag
    assert choose("varlen", GemmConfig(), 4, 4096, 7168, 2, "block").promote_lag  # ping-pong
    assert not choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "row").promote_lag
    assert not choose("varlen", GemmConfig(tile_m=128, tile_n=192), 64, 4096, 7168, 2,
                      "block").promote_lag
    x, w, sa, sb, offs = make_fp8_moe_inputs(200, 3, 256, 256, "block", seed=9)
    ref = scaled_grouped_mm_ref(x, w, sa, sb, offs)
    for lag in (False, True, False):
        monkeypatch.setenv(heuristics_fp8.PROMOTE_LAG_ENV, "1" if lag else "0")
        for _ in range(2):  # the second call takes the cached plan
            key = _key_that_ran(fp8_kernel, lambda: assert_fp8_close(
                scaled_grouped_mm(x, w, sa, sb, offs), ref))
            assert key.promote_lag == lag and key.name().removesuffix("_peek").endswith("_lag") == lag


def _key_that_ran(fp8_kernel, call):
    """The compile key of the one stand-in kernel that `call` launched."""
    before = [len(e.calls) for e in fp8_kernel.made]
    call()
    ran = [e for i, e in enumerate(fp8_kernel.made)
           if len(e.calls) > (before[i] if i < len(before) else 0)]
    assert len(ran) == 1
    return ran[0].key


def test_prefetched_scales_default_and_switch(fp8_kernel, monkeypatch):
    """Block scales are loaded DEFAULT_SCALE_AHEAD stages ahead by default on the plain loop's
    tiles within one scale block (not on those spanning two); MOE_GEMM_FP8_SCALE_AHEAD=n (1 to 4; 1 is the plain loop) sets it for the
    block-scaled plain loop only (not row-wise scales, not the lagged loop), a bad value is
    refused with the variable named, and a repeated call's cached plan follows it."""
    choose = heuristics_fp8.choose_fp8
    env = heuristics_fp8.SCALE_AHEAD_ENV
    default = heuristics_fp8.DEFAULT_SCALE_AHEAD
    monkeypatch.delenv(heuristics_fp8.PROMOTE_LAG_ENV, raising=False)
    monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(heuristics_fp8.SMEM_SCALES_ENV, "0")  # the ring, not staged scales
    assert default > 1
    coop = choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block")
    assert coop.schedule == "cooperative" and coop.scale_ahead == default
    pingpong = choose("varlen", GemmConfig(), 4, 4096, 7168, 2, "block")
    assert pingpong.schedule == "pingpong" and pingpong.scale_ahead == default
    assert choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "row").scale_ahead == 1
    pinned = GemmConfig(schedule="pingpong", tile_m=128, tile_n=64)
    assert choose("general", pinned, 512, 4096, 7168, 2, "block").scale_ahead == default
    # tiles spanning two scale blocks keep the plain loop unless asked
    for schedule, tile_n in (("cooperative", 192), ("cooperative", 160), ("pingpong", 192)):
        wide = GemmConfig(schedule=schedule, tile_m=128 if schedule == "cooperative" else 64,
                          tile_n=tile_n)
        assert choose("batched", wide, 512, 4096, 7168, 2, "block").scale_ahead == 1
    narrow = choose("varlen", GemmConfig(), 300, 40, 640, 2, "block")
    assert narrow.tile_n == 48 and narrow.scale_ahead == 1
    monkeypatch.setenv(env, "3")
    assert choose("batched", wide, 512, 4096, 7168, 2, "block").scale_ahead == 3
    monkeypatch.delenv(env)
    for n in (1, 2, 3, 4):
        monkeypatch.setenv(env, str(n))
        assert choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block").scale_ahead == n
        assert choose("varlen", GemmConfig(), 4, 4096, 7168, 2, "block").scale_ahead == n
        assert choose("general", GemmConfig(), 64, 4096, 7168, 2, "block").scale_ahead == n
        assert choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "row").scale_ahead == 1
    monkeypatch.setenv(heuristics_fp8.PROMOTE_LAG_ENV, "1")
    lagged = choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block")
    assert lagged.promote_lag and lagged.scale_ahead == 1
    monkeypatch.delenv(heuristics_fp8.PROMOTE_LAG_ENV)
    for bad in ("0", "5", "two", "-1", "2.5"):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block")
    monkeypatch.setenv(env, " ")  # empty: the default
    assert choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block").scale_ahead == default
    x, w, sa, sb, offs = make_fp8_moe_inputs(200, 3, 256, 256, "block", seed=19)
    ref = scaled_grouped_mm_ref(x, w, sa, sb, offs)
    for n in (1, 3, 1):
        monkeypatch.setenv(env, str(n))
        for _ in range(2):  # the second call takes the cached plan
            key = _key_that_ran(fp8_kernel, lambda: assert_fp8_close(
                scaled_grouped_mm(x, w, sa, sb, offs), ref))
            assert key.scale_ahead == n and key.name().removesuffix("_peek").endswith(f"_ahead{n}") == (n != 1)


def test_staged_scales_default_and_switch(fp8_kernel, monkeypatch):
    """Varlen block-scaled tiles with room for the lag stage their scales in shared memory
    and promote a stage behind by default (batched ones when asked); other forms, row-wise
    scales and tiles spanning
    two scale blocks do not. MOE_GEMM_FP8_SMEM_SCALES=0 / 1 forces the ring / the staged
    scales (on tiles with room for the lag), a pinned scale depth means the ring, a bad
    value is refused with the variable named, decode-sized experts with K / 128 not a
    multiple of 4 (the weight scales would be copied every call) keep the ring unless asked,
    and the launch hands the kernel
    M-major A scales and k-block-major B scales (any layout given) with an unchanged
    result."""
    choose = heuristics_fp8.choose_fp8
    env = heuristics_fp8.SMEM_SCALES_ENV
    for name in (env, heuristics_fp8.PROMOTE_LAG_ENV, heuristics_fp8.SCALE_AHEAD_ENV):
        monkeypatch.delenv(name, raising=False)
    wide = GemmConfig(schedule="cooperative", tile_m=128, tile_n=192)
    for avg in (4, 64, 2048):  # ping-pong 64x128, cooperative 128x128 (paired or not)
        c = choose("varlen", GemmConfig(), avg, 4096, 7168, 2, "block")
        assert c.smem_scales and c.promote_lag and c.scale_ahead == 1
    assert choose("varlen", GemmConfig(), 64, 4096, 768, 2, "block").smem_scales
    for c in (choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "row"),
              choose("varlen", GemmConfig(), 4, 4096, 768, 2, "block"),  # K / 128 = 6
              choose("batched", GemmConfig(), 64, 4096, 7168, 2, "block"),
              choose("masked", GemmConfig(), 64, 4096, 7168, 2, "block"),
              choose("general", GemmConfig(), 64, 4096, 7168, 2, "block"),
              choose("varlen", wide, 64, 4096, 7168, 2, "block")):
        assert not c.smem_scales
    monkeypatch.setenv(heuristics_fp8.SCALE_AHEAD_ENV, "2")
    pinned = choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block")
    assert not pinned.smem_scales and pinned.scale_ahead == 2
    monkeypatch.delenv(heuristics_fp8.SCALE_AHEAD_ENV)
    monkeypatch.setenv(env, "0")
    ring = choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block")
    assert not ring.smem_scales and not ring.promote_lag
    assert ring.scale_ahead == heuristics_fp8.DEFAULT_SCALE_AHEAD
    monkeypatch.setenv(env, "1")  # (tiles without room for the lag keep the ring)
    staged_wide = choose("varlen", wide, 64, 4096, 7168, 2, "block")
    assert not staged_wide.smem_scales and not staged_wide.promote_lag
    assert not choose("masked", GemmConfig(), 64, 4096, 7168, 2, "block").smem_scales
    forced = choose("batched", GemmConfig(), 64, 4096, 7168, 2, "block")
    assert forced.smem_scales and forced.promote_lag  # (the batched form stages when asked)
    for bad in ("2", "maybe", "-1"):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block")
    monkeypatch.delenv(env)
    before = len(fp8_kernel.calls)
    # K / 128 = 5 on decode-sized experts (13 rows): staged only when asked (the weight
    # scales would be copied every call); on 100-row experts, or with K / 128 = 4, by default
    for T, K, on, staged in ((40, 640, "0", False), (40, 640, "1", True),
                             (40, 640, None, False), (40, 512, None, True),
                             (301, 640, None, True), (301, 640, "0", False)):
        x, w, sa, sb, offs = make_fp8_moe_inputs(T, 3, K, 256, "block", seed=27)
        ref = scaled_grouped_mm_ref(x, w, sa, sb, offs)
        if on is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, on)
        key = _key_that_ran(fp8_kernel, lambda: assert_fp8_close(
            scaled_grouped_mm(x, w, sa, sb, offs), ref))
        assert key.smem_scales == staged
        assert key.name().removesuffix("_peek").endswith("_lag_sscales") == staged
    for call in fp8_kernel.calls[before:]:
        sfa, sfb = call[3], call[4]
        if sfa.stride(0) == 1:  # the staged launches: TMA-ready layouts, aligned strides
            assert sfa.stride(1) % 4 == 0 and sfa.stride(1) >= sfa.shape[0]
            assert sfb.stride(1) == 1 and sfb.stride(2) % 4 == 0 and sfb.stride(0) % 4 == 0
    assert sum(c[3].stride(0) == 1 for c in fp8_kernel.calls[before:]) == 3
    # The batched form stages them when asked: A scales M-major within each problem (padded
    # to 4 rows where M is not a multiple of 4), the values unchanged.
    monkeypatch.setenv(env, "1")
    for M in (40, 37):
        xb, wb, sab, sbb = make_fp8_batched_inputs(2, M, 512, 256, "block", seed=M)
        key = _key_that_ran(fp8_kernel, lambda: assert_fp8_close(
            scaled_grouped_mm(xb, wb, sab, sbb), scaled_grouped_mm_ref(xb, wb, sab, sbb)))
        assert key.form == "batched" and key.smem_scales and key.promote_lag
        sfa, sfb = fp8_kernel.calls[-1][3], fp8_kernel.calls[-1][4]
        assert sfa.stride(1) == 1 and sfa.stride(2) % 4 == 0 and sfa.stride(2) >= M
        assert sfa.stride(0) % 4 == 0 and sfa.data_ptr() % 16 == 0 and torch.equal(sfa, sab)
        assert sfb.stride(1) == 1 and sfb.stride(2) % 4 == 0 and torch.equal(sfb, sbb)


def test_pins_honoured_and_refused(fp8_kernel):
    x, w, sa, sb, offs = make_fp8_moe_inputs(64, 2, 256, 192, "block", seed=8)
    cfg = GemmConfig(schedule="cooperative", tile_m=128, tile_n=192, cluster_m=2, cluster_n=1,
                     stages=4, raster_panel=4)
    y = scaled_grouped_mm(x, w, sa, sb, offs, config=cfg)
    key = fp8_kernel.made[-1].key
    assert (key.tile_m, key.tile_n, key.cluster_m, key.stages) == (128, 192, 2, 4)
    assert fp8_kernel.calls[-1][-1] % 2 == 0  # a whole number of clusters
    assert_fp8_close(y, scaled_grouped_mm_ref(x, w, sa, sb, offs))
    with pytest.raises(ValueError, match="FP8 kernel cannot build .*registers"):
        scaled_grouped_mm(x, w, sa, sb, offs, config=GemmConfig(tile_m=128, tile_n=256))
    with pytest.raises(ValueError, match="device visitor"):
        scaled_grouped_mm(x, w, sa, sb, offs, config=GemmConfig(visitor="host"))
    with pytest.raises(ValueError, match="tail_split"):
        scaled_grouped_gemm([x[:4]], [w[0]], [sa[:4]], [sb[0]],
                            config=GemmConfig(tail_split=True))


def test_layouts_the_kernel_refuses(fp8_kernel):
    x, w, sa, sb, offs = make_fp8_moe_inputs(16, 2, 256, 64, "block", seed=9)
    w_n_major = w.contiguous()  # (E, K, N) with N contiguous
    with pytest.warns(RuntimeWarning, match="K-major"):
        y = scaled_grouped_mm(x, w_n_major, sa, sb, offs)
    assert not fp8_kernel.calls  # the torch backend ran
    assert_fp8_close(y, scaled_grouped_mm_ref(x, w, sa, sb, offs))
    with pytest.raises(ValueError, match="K-major"):
        scaled_grouped_mm(x, w_n_major, sa, sb, offs, config=GemmConfig(backend="cute"))
    xr, wr, sar, sbr, offsr = make_fp8_moe_inputs(16, 2, 136, 64, "row", seed=10)
    with pytest.raises(ValueError, match="16 bytes"):
        scaled_grouped_mm(xr, wr, sar, sbr, offsr, config=GemmConfig(backend="cute"))


def test_promote_lag_zero_promotes_staged_scales_in_the_plain_loop(monkeypatch):
    """MOE_GEMM_FP8_PROMOTE_LAG=0: where the scales are staged, the plain loop promotes them
    (no third accumulator, no scale ring); elsewhere nothing changes."""
    choose = heuristics_fp8.choose_fp8
    for name in (heuristics_fp8.SMEM_SCALES_ENV, heuristics_fp8.SCALE_AHEAD_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(heuristics_fp8.PROMOTE_LAG_ENV, raising=False)
    cases = [("varlen", avg, "block") for avg in (4, 64, 2048)]
    others = [("varlen", 64, "row"), ("batched", 64, "block"), ("masked", 64, "block"),
              ("general", 64, "block")]
    default = {c: choose(c[0], GemmConfig(), c[1], 4096, 7168, 2, c[2]) for c in cases + others}
    monkeypatch.setenv(heuristics_fp8.PROMOTE_LAG_ENV, "0")
    for c in cases:
        plain = choose(c[0], GemmConfig(), c[1], 4096, 7168, 2, c[2])
        assert default[c].smem_scales and default[c].promote_lag
        assert plain.smem_scales and not plain.promote_lag and plain.scale_ahead == 1
        assert dataclasses.replace(plain, promote_lag=True) == default[c]
    for c in others:
        assert choose(c[0], GemmConfig(), c[1], 4096, 7168, 2, c[2]) == default[c]
    monkeypatch.setenv(heuristics_fp8.PROMOTE_LAG_ENV, "lagged")
    with pytest.raises(EnvError, match=heuristics_fp8.PROMOTE_LAG_ENV):
        choose("varlen", GemmConfig(), 64, 4096, 7168, 2, "block")


@pytest.mark.parametrize("given_out", [False, True])
def test_compute_bound_batched_block_calls_run_the_varlen_kernel(fp8_kernel, given_out):
    """Block-scaled batched problems of BATCHED_AS_VARLEN_MIN_ROWS rows or more launch the
    varlen kernel on x's G x M rows (offs every M rows) with the same result; below, other
    scales, a pinned config or rows that are not one run per problem keep the batched
    kernel."""
    from moe_gemm.ops.scaled_launch import BATCHED_AS_VARLEN_MIN_ROWS as M

    G, K, N = 3, 256, 136
    x, w, sa, sb = make_fp8_batched_inputs(G, M, K, N, "block", seed=31)
    ref = scaled_grouped_mm_ref(x, w, sa, sb)
    out = torch.full((G, M, N), float("nan"), dtype=torch.bfloat16) if given_out else None
    for _ in range(2):  # the second call takes the cached plan (without out)
        y = scaled_grouped_mm(x, w, sa, sb, out=out)
        assert_fp8_close(y, ref)
        if given_out:
            assert y.data_ptr() == out.data_ptr()
        key = fp8_kernel.made[-1].key
        assert key.form == "varlen" and key.smem_scales and key.promote_lag
        call = fp8_kernel.calls[-1]
        assert call[0].shape == (G * M, K) and call[0].data_ptr() == x.data_ptr()
        assert call[7].tolist() == [M * (g + 1) for g in range(G)]  # offs
    xl, wl, sal, sbl = make_fp8_batched_inputs(G, M + 8, K, N, "block", seed=34)
    for args, cfg in (
            (make_fp8_batched_inputs(G, M - 8, K, N, "block", seed=32), None),
            (make_fp8_batched_inputs(G, M, K, N, "row", seed=33), None),
            ((x, w, sa, sb), GemmConfig(tile_m=128, tile_n=128)),
            ((xl[:, :M], wl, sal[:, :M], sbl), None)):  # problems with a gap between them
        y = scaled_grouped_mm(*args, config=cfg)
        assert fp8_kernel.made[-1].key.form == "batched"
        assert_fp8_close(y, scaled_grouped_mm_ref(*args))


def test_a_256_row_fp8_tile_is_refused_for_its_own_reason():
    # (schedule "auto" tried ping-pong for it and said ping-pong has no 256-row tiles)
    from moe_gemm.ops.heuristics_fp8 import choose_fp8

    with pytest.raises(ValueError, match="cooperative 256x128 needs"):
        choose_fp8("varlen", GemmConfig(tile_m=256, tile_n=128), 1024.0, 4096, 7168, 2, "block")
