"""heuristics.py: the automatic choices (no GPU; the numbers behind them are in AGENTS.md)."""

import pytest

from moe_gemm import GemmConfig
from moe_gemm.config import COOPERATIVE_TILES, PINGPONG_TILES
from moe_gemm.kernels.sm90.constants import SPLIT_WAYS, TILE_K
from moe_gemm.ops import heuristics
from moe_gemm.ops.heuristics import (
    SHORT_K_TILES,
    choose_batched,
    choose_general,
    choose_varlen,
)


def _sched_tile(c):
    return c.schedule, (c.tile_m, c.tile_n)


def test_varlen_short_k_takes_pingpong_128x192():
    # E=128 experts, 256 rows each, N=2048, K=768: short mainloops.
    assert _sched_tile(choose_varlen(GemmConfig(), 32768, 128, 2048, 768, 132)) == (
        "pingpong", (128, 192))
    k_max = SHORT_K_TILES * TILE_K
    assert choose_varlen(GemmConfig(), 32768, 128, 2048, k_max, 132).schedule == "pingpong"
    # One k-tile more: cooperative 128x256, as moe-down (K=1408) measured.
    assert _sched_tile(choose_varlen(GemmConfig(), 32768, 128, 2048, k_max + 1, 132)) == (
        "cooperative", (128, 256))
    assert _sched_tile(choose_varlen(GemmConfig(), 16384, 64, 2048, 1408, 132)) == (
        "cooperative", (128, 256))


def test_varlen_pingpong_tile_by_rows_per_expert():
    # <= 64 rows per expert: 64x256; 65..127: 128x192 (N >= 192); narrow N: 128x128.
    assert _sched_tile(choose_varlen(GemmConfig(), 1024, 256, 512, 7168, 132)) == (
        "pingpong", (64, 256))
    assert _sched_tile(choose_varlen(GemmConfig(), 800, 8, 14336, 4096, 132)) == (
        "pingpong", (128, 192))
    assert _sched_tile(choose_varlen(GemmConfig(), 800, 8, 136, 4096, 132)) == (
        "pingpong", (128, 128))
    # Long K and >= 128 rows per expert stays cooperative 128x256 (mixtral, prefill).
    assert _sched_tile(choose_varlen(GemmConfig(), 16384, 8, 14336, 4096, 132)) == (
        "cooperative", (128, 256))
    cfg = GemmConfig(schedule="pingpong")
    assert _sched_tile(choose_varlen(cfg, 16384, 8, 14336, 4096, 132)) == (
        "pingpong", (128, 192))


def test_decode_switch_to_the_split_tile_needs_a_split_ways_cap_of_four(monkeypatch):
    # The ping-pong -> split cooperative 128x64 switch is taken for four shares or more (two
    # lost on every shape measured): a MOE_GEMM_SPLIT_WAYS cap under four keeps ping-pong.
    # One process, the cap changed between calls: the rules' caches key on it.
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
    for ways, want in (("2", ("pingpong", (64, 128), False)),
                       ("3", ("pingpong", (64, 128), False)),
                       ("4", ("cooperative", (128, 64), True)),
                       ("16", ("cooperative", (128, 64), True)),
                       ("2", ("pingpong", (64, 128), False))):
        monkeypatch.setenv("MOE_GEMM_SPLIT_WAYS", ways)
        c = choose_varlen(GemmConfig(), 1, 64, 2048, 7168, 132)
        assert (*_sched_tile(c), c.tail_split) == want, ways
        assert not c.tail_split or c.split_ways == int(ways)
    # The long-K split of cooperative 128x128 takes any cap (it splits without a switch).
    c = choose_batched(GemmConfig(), 4, 128, 512, 32768, 132)
    assert _sched_tile(c) == ("cooperative", (128, 128)) and c.tail_split and c.split_ways == 2
    monkeypatch.delenv("MOE_GEMM_SPLIT_WAYS")
    c = choose_varlen(GemmConfig(), 1, 64, 2048, 7168, 132)
    assert (*_sched_tile(c), c.tail_split, c.split_ways) == ("cooperative", (128, 64), True, 8)


def test_long_k_on_few_experts_takes_cooperative_128x128_split(monkeypatch):
    # E=8, ~128 rows each, N=512, K=32768: ~24 tiles of 128x256 on 132 SMs.
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
    c = choose_varlen(GemmConfig(), 1024, 8, 512, 32768, 132)
    assert _sched_tile(c) == ("cooperative", (128, 128))
    assert c.tail_split and not c.epi_whole and c.stages is None
    # Over half a wave of 128x256 tiles is not narrowed (one expert of 3000 rows, ~96
    # tiles; the whole-wave fit then moves it: tests/ops/test_grid_fit.py).
    ruled = heuristics._varlen_rules(GemmConfig(), 3000, 1, 1000, 1536, 2,
                                     heuristics.split_shares(), 132)
    assert _sched_tile(ruled) == ("cooperative", (128, 256))
    # A pinned tile or tail split is kept as given.
    pinned = choose_varlen(GemmConfig(tile_m=128, tile_n=256), 1024, 8, 512, 32768, 132)
    assert (pinned.tile_m, pinned.tile_n) == (128, 256) and pinned.tail_split
    split = choose_varlen(GemmConfig(tail_split=True), 1024, 8, 512, 32768, 132)
    assert _sched_tile(split) == ("cooperative", (128, 128)) and split.tail_split
    # ... also on a pinned ping-pong tile in a pinned cluster (a tuned table's entry, too),
    # and in grouped_gemm's lists; the rules themselves never split those.
    for cm, cn in ((1, 2), (2, 1), (1, 1)):
        pp = GemmConfig(schedule="pingpong", tile_m=128, tile_n=192, cluster_m=cm,
                        cluster_n=cn, tail_split=True)
        c = choose_varlen(pp, 4096, 8, 6144, 16384, 132)
        assert (*_sched_tile(c), c.cluster_m, c.cluster_n, c.tail_split) == (
            "pingpong", (128, 192), cm, cn, True)
        c = heuristics.choose_general(pp, ((512, 1024, 8192),) * 3, 132)
        assert (*_sched_tile(c), c.cluster_m, c.cluster_n, c.tail_split) == (
            "pingpong", (128, 192), cm, cn, True)
    assert not choose_varlen(GemmConfig(schedule="pingpong", cluster_m=1, cluster_n=2),
                             4096, 8, 6144, 16384, 132).tail_split
    # Without the split (pinned off or switched off): the narrow tile, one short wave.
    off = choose_varlen(GemmConfig(tail_split=False), 1024, 8, 512, 32768, 132)
    assert _sched_tile(off) == ("cooperative", (128, 64)) and not off.tail_split
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    off = choose_varlen(GemmConfig(), 1024, 8, 512, 32768, 132)
    assert _sched_tile(off) == ("cooperative", (128, 64)) and not off.tail_split


def test_general_short_k_rule_unchanged():
    k_varying = ((1152, 768, 128), (1152, 768, 1024), (768, 1152, 128), (768, 1152, 1024)) * 16
    assert _sched_tile(choose_general(GemmConfig(), k_varying, 132)) == (
        "pingpong", (128, 192))
    uniform = ((128, 512, 7168),) * 256
    assert _sched_tile(choose_general(GemmConfig(), uniform, 132)) == (
        "cooperative", (128, 256))


SINGLE_SCHEDULE_TILES = [(t, "cooperative") for t in COOPERATIVE_TILES
                         if t not in PINGPONG_TILES] + [
    (t, "pingpong") for t in PINGPONG_TILES if t not in COOPERATIVE_TILES]


@pytest.mark.parametrize("tile,schedule", SINGLE_SCHEDULE_TILES)
def test_tile_given_with_auto_schedule_gets_a_schedule_that_builds_it(tile, schedule):
    # The automatic rule would pick the other schedule for some of these shapes (short K
    # wants ping-pong, long K cooperative); a given tile must still be honoured.
    cfg = GemmConfig(tile_m=tile[0], tile_n=tile[1])
    for K in (256, 7168):
        assert _sched_tile(choose_general(cfg, ((256, 512, K),) * 4, 132)) == (schedule, tile)
        assert _sched_tile(choose_varlen(cfg, 32768, 128, 2048, K, 132)) == (schedule, tile)
        assert _sched_tile(choose_varlen(cfg, 64, 16, 512, K, 132)) == (schedule, tile)
        assert _sched_tile(choose_batched(cfg, 4, 256, 512, K, 132)) == (schedule, tile)


def test_tile_both_schedules_build_follows_the_rule():
    cfg = GemmConfig(tile_m=128, tile_n=192)  # built for both
    assert choose_varlen(cfg, 32768, 128, 2048, 768, 132).schedule == "pingpong"
    assert choose_varlen(cfg, 32768, 128, 2048, 7168, 132).schedule == "cooperative"


@pytest.mark.parametrize("tile", [(64, 128), (64, 256), (192, 128)])
@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)])
def test_cluster_with_a_pingpong_only_tile_runs_pingpong(tile, cluster):
    # Clusters build with both schedules, and with schedule="auto" a tile built for one
    # schedule only selects it (GemmConfig's docstring): a pinned cluster must not turn it
    # into a cooperative tile that does not exist.
    cfg = GemmConfig(tile_m=tile[0], tile_n=tile[1], cluster_m=cluster[0], cluster_n=cluster[1])
    for c in (choose_batched(cfg, 4, 256, 512, 512, 132),
              choose_varlen(cfg, 4096, 8, 4096, 4096, 132),
              choose_general(cfg, ((512, 4096, 4096),) * 4, 132)):
        assert (c.schedule, c.tile_m, c.tile_n, c.cluster_m, c.cluster_n) == (
            "pingpong", *tile, *cluster)
    # A cluster alone still takes the cooperative schedule under "auto".
    auto = choose_varlen(GemmConfig(cluster_m=cluster[0], cluster_n=cluster[1]), 64, 16, 512,
                         7168, 132)
    assert auto.schedule == "cooperative"


def test_pinned_schedule_with_a_tile_it_lacks_is_a_clear_error():
    with pytest.raises(ValueError, match="not built for schedule 'pingpong'"):
        choose_varlen(GemmConfig(schedule="pingpong", tile_m=128, tile_n=256), 64, 4, 512,
                      512, 132)


def _varlen(monkeypatch, value, **cfg):
    from moe_gemm.ops.heuristics import TRIM_A_ENV

    if value is None:
        monkeypatch.delenv(TRIM_A_ENV, raising=False)
    else:
        monkeypatch.setenv(TRIM_A_ENV, value)
    return choose_varlen(GemmConfig(backend="cute", **cfg), 16384, 64, 4096, 2048, 132)


@pytest.mark.parametrize("cfg,default", [
    (dict(schedule="cooperative", tile_m=128, tile_n=256), True),
    (dict(schedule="cooperative", tile_m=256, tile_n=128, cluster_m=2, cluster_n=1), True),
    (dict(schedule="pingpong", tile_m=64, tile_n=256, cluster_m=2, cluster_n=1), True),
    (dict(schedule="pingpong", tile_m=128, tile_n=192), True),
    (dict(schedule="pingpong", tile_m=128, tile_n=128), False),
    (dict(schedule="pingpong", tile_m=192, tile_n=128), False),
    (dict(schedule="pingpong", tile_m=128, tile_n=128, cluster_m=1, cluster_n=2), True),
    (dict(schedule="cooperative", tile_m=128, tile_n=192, cluster_m=1, cluster_n=2), True),
])
def test_trimmed_a_by_tile_and_switch(monkeypatch, cfg, default):
    assert _varlen(monkeypatch, None, **cfg).trim_a is default
    assert _varlen(monkeypatch, "1", **cfg).trim_a is True
    assert _varlen(monkeypatch, "0", **cfg).trim_a is False


def test_trimmed_a_switch_refuses_other_words(monkeypatch):
    from moe_gemm.env import EnvError

    with pytest.raises(EnvError, match="MOE_GEMM_TRIM_A"):
        _varlen(monkeypatch, "maybe", schedule="cooperative", tile_m=128, tile_n=256)


def test_trimmed_a_only_in_the_varlen_compile_key():
    import torch

    from moe_gemm.ops.launch_kernel import _compile_key

    c = choose_varlen(GemmConfig(backend="cute", schedule="cooperative", tile_m=128,
                                 tile_n=256), 16384, 64, 4096, 2048, 132)
    assert c.trim_a
    assert _compile_key("varlen", torch.bfloat16, torch.bfloat16, "k", c, False).trim_a
    assert not _compile_key("batched", torch.bfloat16, torch.bfloat16, "k", c, False).trim_a


@pytest.mark.parametrize("cfg,packed", [
    (dict(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=2, cluster_n=1), True),
    (dict(schedule="pingpong", tile_m=64, tile_n=256, cluster_m=2, cluster_n=1), True),
    (dict(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=2, cluster_n=1,
          tail_split=True), False),
    (dict(schedule="cooperative", tile_m=128, tile_n=256, cluster_m=1, cluster_n=2), False),
    (dict(schedule="cooperative", tile_m=128, tile_n=256), False),
])
def test_packed_pairs_where_asked_and_built(monkeypatch, cfg, packed):
    import torch

    from moe_gemm.ops.heuristics import PACKED_PAIRS_ENV
    from moe_gemm.ops.launch_kernel import _compile_key

    monkeypatch.delenv(PACKED_PAIRS_ENV, raising=False)
    assert not _varlen(monkeypatch, None, **cfg).packed_pairs
    monkeypatch.setenv(PACKED_PAIRS_ENV, "1")
    c = _varlen(monkeypatch, None, **cfg)
    assert c.packed_pairs is packed
    key = _compile_key("varlen", torch.bfloat16, torch.bfloat16, "k", c, False)
    assert key.packed_pairs is packed and key.name().endswith("_pk") is packed
    assert not _compile_key("batched", torch.bfloat16, torch.bfloat16, "k", c,
                            False).packed_pairs


def test_packed_pairs_pinned_select_the_2x1_cluster_and_the_switch_overrides(monkeypatch):
    from moe_gemm.ops.heuristics import PACKED_PAIRS_ENV

    monkeypatch.delenv(PACKED_PAIRS_ENV, raising=False)
    c = _varlen(monkeypatch, None, packed_pairs=True)
    assert c.packed_pairs and (c.cluster_m, c.cluster_n) == (2, 1) and not c.tail_split
    monkeypatch.setenv(PACKED_PAIRS_ENV, "0")
    assert not _varlen(monkeypatch, None, packed_pairs=True).packed_pairs
    # The other forms run without it, on their own clusters.
    from moe_gemm.ops.heuristics import choose_general

    g = choose_general(GemmConfig(backend="cute", packed_pairs=True), ((4096, 4096, 4096),) * 8,
                       132)
    assert not g.packed_pairs and (g.cluster_m, g.cluster_n) != (2, 1)


def test_packed_pairs_not_on_rasters_along_n(monkeypatch):
    from moe_gemm.ops.heuristics import PACKED_PAIRS_ENV

    monkeypatch.setenv(PACKED_PAIRS_ENV, "1")
    cfg = dict(schedule="pingpong", tile_m=64, tile_n=256, cluster_m=2, cluster_n=1)
    assert _varlen(monkeypatch, None, raster_panel=8, **cfg).packed_pairs
    assert not _varlen(monkeypatch, None, raster_panel=8, raster_along="n", **cfg).packed_pairs


def test_batched_and_general_long_k_on_few_tiles_fill_the_grid():
    # 8 x 128x512x32768: 16 tiles of 128x256 on 132 SMs; 4 x 256x1024x16384: 32. Both
    # forms split 128x128 tiles over K (the lists over their deepest K); without the split
    # they narrow to 128x64.
    for G, M, N, K in ((8, 128, 512, 32768), (4, 256, 1024, 16384)):
        c = choose_batched(GemmConfig(), G, M, N, K, 132)
        assert _sched_tile(c) == ("cooperative", (128, 128)) and c.tail_split
        assert (c.cluster_m, c.cluster_n) == (1, 1) and c.stages is None
        c = choose_batched(GemmConfig(tail_split=False), G, M, N, K, 132)
        assert _sched_tile(c) == ("cooperative", (128, 64)) and not c.tail_split
    lists = ((256, 1024, 16384), (128, 1024, 16384), (384, 1024, 8192), (64, 2048, 16384))
    c = choose_general(GemmConfig(), lists, 132)
    assert _sched_tile(c) == ("cooperative", (128, 128)) and c.tail_split
    c = choose_general(GemmConfig(tail_split=False), lists, 132)
    assert _sched_tile(c) == ("cooperative", (128, 64)) and not c.tail_split
    c = choose_general(GemmConfig(visitor="host"), lists, 132)  # (built for the device one)
    assert _sched_tile(c) == ("cooperative", (128, 64)) and not c.tail_split
    # A grid they fill keeps the rules' tile: the uniform headline, 256 x 128x512x7168.
    c = choose_batched(GemmConfig(), 256, 128, 512, 7168, 132)
    assert _sched_tile(c) == ("cooperative", (128, 256)) and (c.cluster_n, c.stages) == (2, 3)
    c = choose_general(GemmConfig(), ((128, 512, 7168),) * 256, 132)
    assert _sched_tile(c) == ("cooperative", (128, 256)) and (c.cluster_n, c.tail_split) == (
        2, False)
    # Pinned tiles and schedules are kept.
    pinned = choose_batched(GemmConfig(tile_m=128, tile_n=256), 8, 128, 512, 32768, 132)
    assert (pinned.tile_m, pinned.tile_n) == (128, 256)


def test_general_long_k_splits_a_short_last_wave_as_grouped_mm_does(monkeypatch):
    # 6 x 1024x768x8192 on 132 SMs: 144 tiles of 128x256 (odd n-tile count: no 1x2 pairs),
    # a last wave of 12 split over K, as grouped_mm's rule splits a long-K cooperative launch.
    sizes = ((1024, 768, 8192),) * 6
    c = choose_general(GemmConfig(), sizes, 132)
    assert _sched_tile(c) == ("cooperative", (128, 256)) and c.tail_split
    assert (c.cluster_m, c.cluster_n, c.visitor) == (1, 1, "device")
    # A last wave over half the grid is not split (the kernel would not split it).
    assert not choose_general(GemmConfig(), ((1024, 768, 8192),) * 10, 132).tail_split
    # Nor is a last wave of short-K tiles beside deep problems (the kernel would not split
    # them, only take a workspace): the last problems in launch order, which K-sort makes the
    # shallowest.
    deep_first = ((1024, 768, 4096),) * 4 + ((512, 768, 512),) * 4
    shallow_first = deep_first[4:] + deep_first[:4]
    assert not choose_general(GemmConfig(), deep_first, 132).tail_split
    assert not choose_general(GemmConfig(sort_by_k=True), shallow_first, 132).tail_split
    # (unsorted, its last wave holds the deep problems' tiles)
    assert choose_general(GemmConfig(sort_by_k=False), shallow_first, 132).tail_split
    # Short K is not split, nor is anything with the switch off, pinned or not.
    assert not choose_general(GemmConfig(), ((1024, 768, 2048),) * 6, 132).tail_split
    monkeypatch.setenv("MOE_GEMM_TAIL_SPLIT", "0")
    assert not choose_general(GemmConfig(), sizes, 132).tail_split
    assert not choose_general(GemmConfig(tail_split=True), sizes, 132).tail_split


def test_few_rows_on_very_long_k_take_a_split_128x128_where_128x64_gets_two_shares():
    # Problems of at most 64 rows take ping-pong's 64-row tile; where 128x64 tiles would get
    # only two shares but 128x128 ones four, on K >= 16384, cooperative 128x128 split (H200,
    # lists: 4 x 64x1024x16384 62.3 us against ping-pong 64x128's 69.7, 8 x 16x512x32768
    # 98.3 / 129.6, 2 x 32x2048x16384 64.3 / 67.8); at one routed row 128x64 keeps it.
    for sizes in (((64, 1024, 16384),) * 4, ((16, 512, 32768),) * 8, ((32, 2048, 16384),) * 2):
        c = choose_general(GemmConfig(), sizes, 132)
        assert (*_sched_tile(c), c.tail_split) == ("cooperative", (128, 128), True), sizes
    c = choose_batched(GemmConfig(), 4, 64, 1024, 16384, 132)
    assert (*_sched_tile(c), c.tail_split) == ("cooperative", (128, 128), True)
    # Shorter K (not measured there) keeps the ping-pong tile.
    c = choose_batched(GemmConfig(), 8, 64, 512, 7168, 132)
    assert (*_sched_tile(c), c.tail_split) == ("pingpong", (64, 128), False)
    c = choose_varlen(GemmConfig(), 1, 64, 2048, 7168, 132)
    assert (*_sched_tile(c), c.tail_split) == ("cooperative", (128, 64), True)


def test_general_split_ways_cap_applies(monkeypatch):
    lists = ((256, 1024, 16384), (128, 1024, 16384))
    assert choose_general(GemmConfig(), lists, 132).split_ways == SPLIT_WAYS
    monkeypatch.setenv("MOE_GEMM_SPLIT_WAYS", "3")
    assert choose_general(GemmConfig(), lists, 132).split_ways == 3


def test_batched_rows_of_at_most_64_take_a_pingpong_tile_on_long_k():
    c = choose_batched(GemmConfig(), 8, 1, 4096, 4096, 132)  # 128 tiles: a wave nearly full
    assert _sched_tile(c) == ("pingpong", (64, 256))
    c = choose_batched(GemmConfig(), 4, 1, 4096, 4096, 132)  # 64 tiles: narrowed
    assert _sched_tile(c) == ("pingpong", (64, 128))
    # a pinned cooperative schedule stays cooperative
    c = choose_batched(GemmConfig(schedule="cooperative"), 8, 1, 4096, 4096, 132)
    assert c.schedule == "cooperative"


class _CountedSizes(tuple):
    """A problem set that counts the passes over it."""

    passes = 0

    def __iter__(self):
        type(self).passes += 1
        return super().__iter__()


def test_general_grid_count_adds_no_pass_where_the_rows_alone_exceed_the_grid():
    # 100 problems (fewer than the SMs) of 256 rows, long K: 200 m-tiles of 128 at least,
    # past 132 SMs, so counting the tiles need not read the problems again (each pass is
    # ~0.2 us a problem on the CPU-only dev machine, paid on every new problem set).
    sizes = tuple((256, 512 + 8 * i, 8192) for i in range(100))

    def passes(config):
        _CountedSizes.passes = 0
        choice = heuristics._choose_general.__wrapped__(config, _CountedSizes(sizes), 132)
        return choice, _CountedSizes.passes

    auto, n_auto = passes(GemmConfig())
    assert _sched_tile(auto) == ("cooperative", (128, 256))
    # the same path with the tile given (no grid count at all)
    _, n_pinned = passes(GemmConfig(tile_m=128, tile_n=256))
    assert n_auto == n_pinned


# ---------------------------------------------------------------------------------------------
# Swapped tiles (kernels/sm90/swapped.py): the window, the switch and the pins


@pytest.mark.parametrize("T,E,K,want", [
    (4096, 16, 5120, True),  # 256 rows per expert (Llama-4-Scout at 4096 tokens)
    (192 * 64, 64, 2048, True), (320 * 64, 64, 2048, True),  # the window's edges
    (191 * 64, 64, 2048, False), (321 * 64, 64, 2048, False),
    (200 * 160, 160, 5120, True), (200 * 161, 161, 5120, False),  # at most 160 experts
    (256 * 256, 256, 7168, False),
    (256 * 64, 64, 1024, False),  # short K
    (0, 0, 2048, False),
])
def test_swap_window(monkeypatch, T, E, K, want):
    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    assert heuristics.swap_ab_wanted(GemmConfig(), T, E, K, 2) is want
    assert heuristics.swap_ab_wanted(GemmConfig(), T, E, K, 4) is False  # 16-bit output only
    # A config that pins the kernel's choice runs the rules; swap_ab pins it either way.
    assert heuristics.swap_ab_wanted(GemmConfig(schedule="pingpong"), T, E, K, 2) is False
    assert heuristics.swap_ab_wanted(GemmConfig(swap_ab=True), T, E, K, 2) is True
    assert heuristics.swap_ab_wanted(GemmConfig(swap_ab=False), T, E, K, 2) is False
    monkeypatch.setenv(heuristics.SWAP_AB_ENV, "1")
    assert heuristics.swap_ab_wanted(GemmConfig(), T, E, K, 2) is True
    assert heuristics.swap_ab_wanted(GemmConfig(swap_ab=False), T, E, K, 2) is False
    # The switch neither overrides a caller's pins nor asks fp32 output of swapped tiles
    # (which store 16 bits only: every fp32-output grouped_mm raised under it).
    assert heuristics.swap_ab_wanted(GemmConfig(), T, E, K, 4) is False
    assert heuristics.swap_ab_wanted(GemmConfig(schedule="pingpong"), T, E, K, 2) is False
    monkeypatch.setenv(heuristics.SWAP_AB_ENV, "0")
    assert heuristics.swap_ab_wanted(GemmConfig(), T, E, K, 2) is False


@pytest.mark.parametrize("N,want", [(512, False), (1024, False), (1152, True), (16384, True)])
def test_the_window_wants_a_wave_of_swapped_tiles(monkeypatch, N, want):
    """16 experts x 256 rows make 16 x N/128 swapped tiles: under 132 (N <= 1024) SMs would
    idle that the M-side tiles keep busy; the switch and a pin still swap."""
    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    assert heuristics.swapped_tiles(4096, 16, N) == 16 * (N // 128)
    assert heuristics.swap_ab_wanted(GemmConfig(), 4096, 16, 5120, 2, N=N, num_sms=132) is want
    assert heuristics.swap_ab_wanted(GemmConfig(), 4096, 16, 5120, 2) is True  # N not given
    c = heuristics.choose_varlen(GemmConfig(), 4096, 16, N, 5120, 132, swap_ok=True)
    assert c.swap_ab is want
    assert heuristics.swap_ab_wanted(GemmConfig(swap_ab=True), 4096, 16, 5120, 2, N=N,
                                     num_sms=132) is True
    monkeypatch.setenv(heuristics.SWAP_AB_ENV, "1")
    assert heuristics.choose_varlen(GemmConfig(), 4096, 16, N, 5120, 132, swap_ok=True).swap_ab
    fp32 = heuristics.choose_varlen(GemmConfig(), 4096, 16, N, 5120, 132, 4, swap_ok=True)
    assert not fp32.swap_ab
    pinned = heuristics.choose_varlen(GemmConfig(schedule="pingpong", tile_m=128, tile_n=192),
                                      4096, 16, N, 5120, 132, swap_ok=True)
    assert (pinned.swap_ab, pinned.schedule, pinned.tile_m, pinned.tile_n) == (
        False, "pingpong", 128, 192)


def test_swapped_choice_and_its_compile_key(monkeypatch):
    import torch

    from moe_gemm.ops.launch_kernel import _compile_key

    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    plain = choose_varlen(GemmConfig(), 4096, 16, 16384, 5120, 132)
    assert not plain.swap_ab  # (only a launch that can run it asks: swap_ok)
    c = choose_varlen(GemmConfig(), 4096, 16, 16384, 5120, 132, swap_ok=True)
    assert c.swap_ab and c.trim_a and not c.tail_split
    assert (c.schedule, c.visitor, c.tile_m, c.tile_n, c.epi_n) == (
        "cooperative", "device", 256, 128, 16)
    assert (c.cluster_m, c.cluster_n, c.stages) == (1, 1, None)
    key = _compile_key("varlen", torch.bfloat16, torch.bfloat16, "n", c, False)
    assert key.swap_ab and key.name().endswith("_swap")
    with pytest.raises(ValueError, match="16-bit output"):
        choose_varlen(GemmConfig(swap_ab=True), 4096, 16, 16384, 5120, 132, 4, swap_ok=True)


def test_a_swap_pin_takes_its_1x2_cluster_and_not_the_rules_cluster(monkeypatch):
    import torch

    from moe_gemm.ops.launch_kernel import _compile_key

    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    pair = choose_varlen(GemmConfig(swap_ab=True, cluster_m=1, cluster_n=2), 4096, 8, 6144,
                         16384, 132, swap_ok=True)
    assert pair.swap_ab and (pair.cluster_m, pair.cluster_n) == (1, 2)
    assert (pair.tile_m, pair.tile_n, pair.schedule) == (256, 128, "cooperative")
    key = _compile_key("varlen", torch.bfloat16, torch.bfloat16, "k", pair, False)
    assert key.swap_ab and (key.cluster_m, key.cluster_n) == (1, 2)
    # Without a cluster pin the swapped kernel runs 1x1, whatever cluster the rules would
    # give the M-side tile of that shape.
    rules = choose_varlen(GemmConfig(), 4096, 8, 6144, 16384, 132)
    lone = choose_varlen(GemmConfig(swap_ab=True), 4096, 8, 6144, 16384, 132, swap_ok=True)
    assert (lone.cluster_m, lone.cluster_n) == (1, 1), rules
    with pytest.raises(ValueError, match="1x1 or 1x2 cluster"):
        heuristics.swapped_choice(rules, 2, cluster_n=4)


def test_a_swap_pin_keeps_its_stages(monkeypatch):
    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    c = choose_varlen(GemmConfig(swap_ab=True, stages=3, raster_panel=4), 4096, 16, 16384,
                      5120, 132, swap_ok=True)
    assert c.swap_ab and c.stages == 3 and c.swizzle == heuristics.raster_of(
        GemmConfig(raster_panel=4), 8)
