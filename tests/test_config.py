"""GemmConfig: defaults, immutability, and every field check with a message naming the rule."""

from __future__ import annotations

import dataclasses
import re

import pytest

from moe_gemm import GemmConfig
from moe_gemm.config import (
    BACKENDS,
    CLUSTERS,
    COOPERATIVE_TILES,
    DEFAULT_CONFIG,
    PINGPONG_TILES,
    SCHEDULES,
    VISITORS,
)


def test_defaults_are_auto() -> None:
    c = GemmConfig()
    assert (c.backend, c.schedule, c.visitor) == ("auto", "auto", "auto")
    assert c.sort_by_k is None
    assert (c.tile_m, c.tile_n, c.cluster_m, c.cluster_n, c.stages) == (None,) * 5
    assert DEFAULT_CONFIG == c


def test_frozen_hashable_and_usable_as_cache_key() -> None:
    c = GemmConfig(backend="torch", schedule="pingpong", tile_m=128, tile_n=128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.backend = "cute"  # type: ignore[misc]
    same = GemmConfig(backend="torch", schedule="pingpong", tile_m=128, tile_n=128)
    assert c == same and hash(c) == hash(same)
    cache = {c: 1}
    assert cache[same] == 1
    assert GemmConfig(backend="torch") != GemmConfig(backend="auto")


def test_as_dict_round_trips() -> None:
    (tm, tn), (cm, cn) = (128, 256), CLUSTERS[-1]  # (the whole epilogue: 128-row tiles)
    c = GemmConfig(schedule="cooperative", visitor="device", sort_by_k=True, tile_m=tm,
                   tile_n=tn, cluster_m=cm, cluster_n=cn, stages=4, raster_panel=16,
                   tail_split=False, whole_epilogue=True, raster_along="n",
                   raster_serpentine=True)
    d = c.as_dict()
    assert d == {
        "backend": "auto", "schedule": "cooperative", "visitor": "device", "sort_by_k": True,
        "tile_m": tm, "tile_n": tn, "cluster_m": cm, "cluster_n": cn, "stages": 4,
        "raster_panel": 16, "tail_split": False, "whole_epilogue": True, "raster_along": "n",
        "raster_serpentine": True, "swap_ab": None, "packed_pairs": None,
    }
    assert GemmConfig(**d) == c


def test_packed_pairs_refuses_pins_that_cannot_build_it() -> None:
    assert GemmConfig(packed_pairs=True, cluster_m=2, cluster_n=1).packed_pairs
    assert GemmConfig(packed_pairs=False, cluster_m=1, cluster_n=2).packed_pairs is False
    for pins, word in ((dict(cluster_m=1, cluster_n=2), "cluster 1x2"),
                       (dict(visitor="host"), "visitor='host'"),
                       (dict(tail_split=True), "tail_split=True"),
                       (dict(raster_along="n"), "raster_along='n'")):
        with pytest.raises(ValueError, match=f"packed_pairs=True .*{word}"):
            GemmConfig(packed_pairs=True, **pins)
    with pytest.raises(TypeError, match="packed_pairs must be None or a bool"):
        GemmConfig(packed_pairs=1)
    # packed_pairs=False keeps the tables choosing (as swap_ab=False); True pins.
    assert not GemmConfig(packed_pairs=False).tuning_pinned
    assert GemmConfig(packed_pairs=True).tuning_pinned


def test_swap_ab_pins_its_kernel_and_refuses_other_pins() -> None:
    assert GemmConfig(swap_ab=True).swap_ab and GemmConfig(swap_ab=False).swap_ab is False
    # Pins of the kernel's own values are taken.
    GemmConfig(swap_ab=True, schedule="cooperative", visitor="device", tile_m=256, tile_n=128,
               cluster_m=1, cluster_n=1, tail_split=False, whole_epilogue=False, stages=4)
    # ... and the 1x2 cluster (two weight-column tiles sharing the rows of x).
    GemmConfig(swap_ab=True, cluster_m=1, cluster_n=2)
    with pytest.raises(TypeError, match="swap_ab must be None or a bool"):
        GemmConfig(swap_ab=1)  # type: ignore[arg-type]
    for pins, named in (({"schedule": "pingpong"}, "schedule='pingpong'"),
                        ({"visitor": "host"}, "visitor='host'"),
                        ({"tile_m": 128, "tile_n": 256}, "tile 128x256"),
                        ({"cluster_m": 2, "cluster_n": 1}, "cluster 2x1"),
                        ({"tail_split": True}, "tail_split=True"),
                        ({"whole_epilogue": True, "tile_m": 128, "tile_n": 128},
                         "whole_epilogue=True")):
        with pytest.raises(ValueError, match=re.escape(named)):
            GemmConfig(swap_ab=True, **pins)
        GemmConfig(swap_ab=False, **pins)  # (only swap_ab=True fixes them)


def test_raster_order_pins_are_checked() -> None:
    assert GemmConfig(raster_along="m", raster_serpentine=False).raster_along == "m"
    with pytest.raises(ValueError, match="raster_along must be one of 'm', 'n'; got 'k'"):
        GemmConfig(raster_along="k")
    with pytest.raises(TypeError, match="raster_serpentine must be None or a bool"):
        GemmConfig(raster_serpentine=1)  # type: ignore[arg-type]


def test_replace_changes_and_revalidates() -> None:
    c = GemmConfig(schedule="pingpong")
    d = c.replace(visitor="device", stages=3)
    assert (d.schedule, d.visitor, d.stages) == ("pingpong", "device", 3)
    assert c.visitor == "auto"  # the original is untouched
    with pytest.raises(ValueError, match="stages must be between 2 and 12"):
        c.replace(stages=1)
    with pytest.raises(ValueError, match="not built for schedule 'pingpong'"):
        c.replace(tile_m=512, tile_n=128)
    with pytest.raises(TypeError):
        c.replace(no_such_field=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("visitor", VISITORS)
def test_every_valid_choice_is_accepted(backend: str, schedule: str, visitor: str) -> None:
    c = GemmConfig(backend=backend, schedule=schedule, visitor=visitor)  # type: ignore[arg-type]
    assert (c.backend, c.schedule, c.visitor) == (backend, schedule, visitor)


@pytest.mark.parametrize(
    "field, value",
    [
        ("backend", "CUTE"),
        ("backend", "cuda"),
        ("schedule", "ping-pong"),
        ("schedule", ""),
        ("visitor", "hostprecompute"),
    ],
)
def test_bad_choice_names_the_allowed_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be one of .*'auto'.*; got {value!r}$"):
        GemmConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("backend", 1),
        ("backend", None),
        ("backend", ["cute"]),
        ("backend", b"cute"),
        ("schedule", 0),
        ("visitor", None),
        ("visitor", True),
        ("raster_along", 0),
        ("raster_along", ("m",)),
    ],
)
def test_choice_of_another_type_is_a_type_error(field: str, value: object) -> None:
    # A non-str was a ValueError ("must be one of ...") where the other fields' wrong types
    # are TypeErrors; the message still names the choices.
    pattern = rf"^{field} must be one of '.*' \(a str\); got {type(value).__name__} "
    with pytest.raises(TypeError, match=pattern):
        GemmConfig(**{field: value})
    assert GemmConfig().replace(**{field: "m" if field == "raster_along" else "auto"})


@pytest.mark.parametrize("value", [1, 0, "yes", "true"])
def test_sort_by_k_must_be_bool_or_none(value: object) -> None:
    with pytest.raises(TypeError, match="sort_by_k must be None or a bool"):
        GemmConfig(sort_by_k=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, False])
def test_sort_by_k_bools_accepted(value: bool) -> None:
    assert GemmConfig(sort_by_k=value).sort_by_k is value


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tile_m": True, "tile_n": 128}, "tile_m"),
        ({"tile_m": 128, "tile_n": 128.0}, "tile_n"),
        ({"cluster_m": "2", "cluster_n": 1}, "cluster_m"),
        ({"cluster_m": 1, "cluster_n": False}, "cluster_n"),
        ({"stages": True}, "stages"),
        ({"stages": 4.0}, "stages"),
        ({"stages": "4"}, "stages"),
    ],
)
def test_int_fields_reject_bools_and_non_ints(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(TypeError, match=rf"{field} must be None or an int"):
        GemmConfig(**kwargs)  # type: ignore[arg-type]


def test_int_fields_take_numpy_integers_as_python_ints() -> None:
    """A config built from numpy values (a sweep's arrays) is the config of the same Python
    ints: equal, the same hash (cache keys) and JSON-serializable fields."""
    np = pytest.importorskip("numpy")
    cfg = GemmConfig(tile_m=np.int64(128), tile_n=np.int32(192), cluster_m=np.int16(2),
                     cluster_n=np.uint8(1), stages=np.int64(4), raster_panel=np.int64(8))
    plain = GemmConfig(tile_m=128, tile_n=192, cluster_m=2, cluster_n=1, stages=4,
                       raster_panel=8)
    assert cfg == plain and hash(cfg) == hash(plain)
    for name in ("tile_m", "tile_n", "cluster_m", "cluster_n", "stages", "raster_panel"):
        assert type(getattr(cfg, name)) is int, name
    with pytest.raises(TypeError, match="tile_m must be None or an int"):
        GemmConfig(tile_m=np.float64(128), tile_n=128)
    with pytest.raises(TypeError, match="stages must be None or an int"):
        GemmConfig(stages=np.bool_(True))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"tile_m": 0, "tile_n": 128}, "tile_m"),
        ({"tile_m": 128, "tile_n": -128}, "tile_n"),
        ({"cluster_m": -1, "cluster_n": 1}, "cluster_m"),
        ({"stages": 0}, "stages"),
    ],
)
def test_int_fields_must_be_positive(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be positive"):
        GemmConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"tile_m": 128}, {"tile_n": 128}, {"tile_m": 128, "schedule": "pingpong"}],
)
def test_tile_m_and_tile_n_go_together(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="tile_m and tile_n are set together"):
        GemmConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"cluster_m": 2}, {"cluster_n": 1}])
def test_cluster_m_and_cluster_n_go_together(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="cluster_m and cluster_n are set together"):
        GemmConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("tile", PINGPONG_TILES)
def test_pingpong_tiles_accepted(tile: tuple[int, int]) -> None:
    c = GemmConfig(schedule="pingpong", tile_m=tile[0], tile_n=tile[1])
    assert (c.tile_m, c.tile_n) == tile


@pytest.mark.parametrize("tile", COOPERATIVE_TILES)
def test_cooperative_tiles_accepted(tile: tuple[int, int]) -> None:
    c = GemmConfig(schedule="cooperative", tile_m=tile[0], tile_n=tile[1])
    assert (c.tile_m, c.tile_n) == tile


@pytest.mark.parametrize("tile", sorted(set(PINGPONG_TILES) | set(COOPERATIVE_TILES)))
def test_auto_schedule_takes_any_built_tile(tile: tuple[int, int]) -> None:
    assert GemmConfig(tile_m=tile[0], tile_n=tile[1]).tile_m == tile[0]


def _fmt(tiles: tuple[tuple[int, int], ...]) -> str:
    return re.escape(", ".join(f"{m}x{n}" for m, n in tiles))


def test_tile_not_built_for_the_schedule_names_the_allowed_ones() -> None:
    # Tiles built for the other schedule only, plus one built for neither.
    not_pp = sorted(set(COOPERATIVE_TILES) - set(PINGPONG_TILES)) + [(512, 128)]
    not_coop = sorted(set(PINGPONG_TILES) - set(COOPERATIVE_TILES)) + [(512, 128)]
    for m, n in not_pp:
        with pytest.raises(ValueError, match=rf"tile {m}x{n} is not built for schedule "
                                             rf"'pingpong'; expected one of "
                                             rf"{_fmt(PINGPONG_TILES)}"):
            GemmConfig(schedule="pingpong", tile_m=m, tile_n=n)
    for m, n in not_coop:
        with pytest.raises(ValueError, match=rf"tile {m}x{n} is not built for schedule "
                                             rf"'cooperative'; expected one of "
                                             rf"{_fmt(COOPERATIVE_TILES)}"):
            GemmConfig(schedule="cooperative", tile_m=m, tile_n=n)


@pytest.mark.parametrize("tile", [(64, 64), (128, 96), (100, 128), (512, 128)])
def test_unbuilt_tile_rejected_under_auto(tile: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match=rf"tile {tile[0]}x{tile[1]} is not built; expected "
                                         r"one of .*128x128"):
        GemmConfig(tile_m=tile[0], tile_n=tile[1])


@pytest.mark.parametrize("field", ["tail_split", "whole_epilogue"])
def test_cooperative_only_options_refuse_a_ping_pong_tile_at_once(field: str) -> None:
    # Under schedule="auto" these options select the cooperative schedule: a tile it does
    # not have is named when the config is made, not at the first call.
    with pytest.raises(ValueError, match=rf"{field}=True is built for the cooperative "
                                         r"schedule, whose tiles are .*; got tile 64x128"):
        GemmConfig(tile_m=64, tile_n=128, **{field: True})
    assert GemmConfig(tile_m=128, tile_n=256, **{field: True}).tile_m == 128


@pytest.mark.parametrize("tile", [t for t in COOPERATIVE_TILES if t[0] != 128])
def test_whole_epilogue_refuses_a_tile_not_of_128_rows_at_once(tile: tuple[int, int]) -> None:
    # The kernel stages a whole tile of 128 rows only (it refuses any other at its compile,
    # on the GPU): named when the config is made, and a tuned table's entry is skipped.
    with pytest.raises(ValueError, match=rf"whole_epilogue=True is built for cooperative "
                                         rf"128-row tiles; got tile {tile[0]}x{tile[1]}"):
        GemmConfig(schedule="cooperative", tile_m=tile[0], tile_n=tile[1], whole_epilogue=True)
    assert GemmConfig(tile_m=tile[0], tile_n=tile[1], whole_epilogue=False).tile_m == tile[0]


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_supported_clusters_accepted(cluster: tuple[int, int]) -> None:
    c = GemmConfig(cluster_m=cluster[0], cluster_n=cluster[1])
    assert (c.cluster_m, c.cluster_n) == cluster


@pytest.mark.parametrize(
    "cluster", [c for c in [(1, 2), (2, 1), (2, 2), (4, 1), (1, 4), (3, 1)] if c not in CLUSTERS]
)
def test_unsupported_cluster_names_the_allowed_ones(cluster: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match=rf"cluster {cluster[0]}x{cluster[1]} is not "
                                         rf"supported; expected one of {_fmt(CLUSTERS)}$"):
        GemmConfig(cluster_m=cluster[0], cluster_n=cluster[1])


@pytest.mark.parametrize("stages", [2, 3, 7, 12])
def test_stages_in_range(stages: int) -> None:
    assert GemmConfig(stages=stages).stages == stages


@pytest.mark.parametrize("stages", [1, 13, 100])
def test_stages_out_of_range(stages: int) -> None:
    with pytest.raises(ValueError, match=rf"stages must be between 2 and 12; got {stages}"):
        GemmConfig(stages=stages)


def test_cluster_2x1_needs_the_device_visitor() -> None:
    assert GemmConfig(schedule="pingpong", cluster_m=2, cluster_n=1)
    assert GemmConfig(schedule="pingpong", tile_m=128, tile_n=208, cluster_m=1, cluster_n=2)
    with pytest.raises(ValueError, match=r"cluster 2x1 is built for the device visitor"):
        GemmConfig(visitor="host", cluster_m=2, cluster_n=1)
    assert GemmConfig(schedule="cooperative", visitor="device", cluster_m=2, cluster_n=1)
    assert GemmConfig(schedule="pingpong", cluster_m=1, cluster_n=1)
