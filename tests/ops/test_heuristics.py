"""heuristics.py: the automatic choices (no GPU; the numbers behind them are in AGENTS.md)."""

import pytest

from moe_gemm import GemmConfig
from moe_gemm.config import COOPERATIVE_TILES, PINGPONG_TILES
from moe_gemm.kernels.sm90.constants import TILE_K
from moe_gemm.ops.heuristics import SHORT_K_TILES, choose_batched, choose_general, choose_varlen


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
