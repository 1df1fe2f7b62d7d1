"""choice_rules.py: the rule pieces every form's config choice shares (no GPU)."""

import warnings

import pytest

from moe_gemm import GemmConfig
from moe_gemm.config import COOPERATIVE_TILES, PINGPONG_TILES
from moe_gemm.kernels.sm90.constants import raster_fields
from moe_gemm.ops import choice_rules, tuned
from moe_gemm.ops.choice_rules import (
    KernelChoice,
    check_tail_split,
    check_tile,
    choice_fields,
    fit_schedule,
    general_rules,
    pick_tile,
    raster_of,
)
from moe_gemm.ops.heuristics import choose_batched, choose_general, choose_varlen


def test_check_tile_names_the_tiles_a_schedule_builds():
    for tile in PINGPONG_TILES:
        check_tile("pingpong", tile)
    for tile in COOPERATIVE_TILES:
        check_tile("cooperative", tile)
    only_coop = next(t for t in COOPERATIVE_TILES if t not in PINGPONG_TILES)
    with pytest.raises(ValueError, match=rf"{only_coop[0]}x{only_coop[1]} is not built for "
                                         r"schedule 'pingpong'"):
        check_tile("pingpong", only_coop)


def test_fit_schedule_follows_what_the_config_pins():
    assert fit_schedule("pingpong", GemmConfig()) == "pingpong"
    # A cluster, the tail split or the whole-tile epilogue take the cooperative schedule ...
    assert fit_schedule("pingpong", GemmConfig(cluster_m=2, cluster_n=1)) == "cooperative"
    assert fit_schedule("pingpong", GemmConfig(tail_split=True)) == "cooperative"
    # ... but a tile built for one schedule only selects that one.
    only_pp = next(t for t in PINGPONG_TILES if t not in COOPERATIVE_TILES)
    cfg = GemmConfig(tile_m=only_pp[0], tile_n=only_pp[1], cluster_m=2, cluster_n=1)
    assert fit_schedule("cooperative", cfg) == "pingpong"


def test_pick_tile_by_rows_and_width():
    assert pick_tile("cooperative", 4096, 4096) == (128, 256)
    assert pick_tile("cooperative", 4096, 128) == (128, 128)
    assert pick_tile("pingpong", 32, 4096) == (64, 256)
    assert pick_tile("pingpong", 512, 4096) == (128, 192)
    assert pick_tile("pingpong", 512, 160) == (128, 128)


def test_general_rules_long_k_takes_three_stages_unless_pinned():
    assert general_rules(GemmConfig(), 512, 4096, 112) == ("cooperative", (128, 256), 3)
    assert general_rules(GemmConfig(stages=5), 512, 4096, 112)[2] == 5
    with pytest.raises(ValueError, match="not built"):
        general_rules(GemmConfig(schedule="pingpong", tile_m=256, tile_n=128), 512, 4096, 8)


def test_check_tail_split_refuses_what_does_not_build_it():
    # Both schedules and every cluster build it (a cluster splits its cluster tile) ...
    for args in (("cooperative", "device", 1, 1), ("pingpong", "device", 1, 1),
                 ("cooperative", "device", 1, 2), ("pingpong", "device", 2, 1)):
        check_tail_split(*args)
    # ... on the device visitor only.
    for args in (("cooperative", "host", 1, 1), ("pingpong", "host", 1, 1)):
        with pytest.raises(ValueError, match="tail_split=True is built for the device visitor"):
            check_tail_split(*args)


@pytest.mark.parametrize("panel,along,serpentine", [(8, "m", False), (4, "n", True),
                                                     (16, "m", True)])
def test_raster_of_round_trips_through_raster_fields(panel, along, serpentine):
    cfg = GemmConfig(raster_panel=panel, raster_along=along, raster_serpentine=serpentine)
    assert raster_fields(raster_of(cfg, 2)) == (panel, along, serpentine)
    assert raster_fields(raster_of(GemmConfig(), 2)) == (2, "m", False)


@pytest.mark.parametrize("form", ["varlen", "batched", "general"])
def test_choice_fields_reproduce_the_choice(form):
    # The fields of a choice, given back as a config, choose the same kernel (what the tuner's
    # candidates and the tables' comparison with the rules rely on).
    def choose(cfg):
        if form == "varlen":
            return choose_varlen(cfg, 20000, 64, 2816, 2048, 132)
        if form == "batched":
            return choose_batched(cfg, 8, 1000, 4096, 4096, 132)
        return choose_general(cfg, ((300, 1024, 4096), (700, 1024, 4096)) * 20, 132)

    rules = choose(GemmConfig())
    fields = choice_fields(rules, form)
    assert ("sort_by_k" in fields) == (form == "general")
    again = choose(GemmConfig(**fields))
    for name in ("schedule", "visitor", "tile_m", "tile_n", "cluster_m", "cluster_n",
                 "swizzle", "epi_whole", "tail_split", "sort_by_k"):
        assert getattr(again, name) == getattr(rules, name), name


def test_warn_unusable_warns_once_per_entry(monkeypatch):
    monkeypatch.setattr(choice_rules, "_unusable_warned", set())
    hit = tuned.Hit(fields=(("tile_m", 128), ("tile_n", 999)), how="exact", source="t.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            choice_rules.warn_unusable(hit, ValueError("no such tile"))
    assert len(caught) == 1
    assert "t.json" in str(caught[0].message) and "no such tile" in str(caught[0].message)


def test_kernel_choice_is_hashable_and_frozen():
    c = KernelChoice("pingpong", "device", 128, 192, None, False, 8)
    assert hash(c) == hash(KernelChoice("pingpong", "device", 128, 192, None, False, 8))
    with pytest.raises(AttributeError):
        c.tile_m = 64


@pytest.mark.parametrize("count", [8, 131, 132, 1000])
def test_short_rows_take_the_64_row_tile_at_any_problem_count(count):
    """Problems of 16 rows and long K: ping-pong 64-row tiles, also past one problem per SM
    (at 132 problems on 132 SMs the grid-fill step was skipped and with it this rule:
    cooperative 128x256, 8x the rows computed)."""
    from moe_gemm.ops import heuristics

    c = heuristics._choose_general(GemmConfig(), ((16, 4096, 4096),) * count, 132)
    assert (c.schedule, c.tile_m) == ("pingpong", 64)
    pinned = heuristics._choose_general(GemmConfig(schedule="cooperative"),
                                        ((16, 4096, 4096),) * count, 132)
    assert pinned.schedule == "cooperative"
