"""GemmConfig: every choice a caller may pin, frozen so it can key caches.

A field left at "auto" / None is decided per call by `moe_gemm.heuristics` from the problem
shapes and the device; a field set by the caller is honoured or, when the kernel cannot take
it, rejected with a ValueError that says why (a TypeError where a field's type is wrong). The
config never carries anything that varies per call (sizes, group counts), so it is safe to
use as part of a compile key.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace
from typing import Literal

Backend = Literal["auto", "cute", "torch"]
Schedule = Literal["auto", "pingpong", "cooperative"]
Visitor = Literal["auto", "device", "host"]

BACKENDS = ("auto", "cute", "torch")
SCHEDULES = ("auto", "pingpong", "cooperative")
VISITORS = ("auto", "device", "host")

# Tile shapes the sm90 kernel is built and tested for (kernels/sm90/constants.tile_problem has
# the rules). WGMMA's M is 64 per warpgroup instruction; N here is a multiple of 16 up to 256.
# Ping-pong gives each consumer warpgroup a whole tile of 64, 128 or 192 rows, so its
# accumulator (tile_m * tile_n / 128 fp32 registers per thread) must fit beside the epilogue:
# 128x208 = 208 registers is the largest (its math warpgroups get 240 registers, the producer
# 24). 192x128 (three m64 WGMMAs of n128 per k-block, 192 registers) is the tile QuACK's tuner
# picks on mid-size experts; on the H100 it won 25 of the 60 prefill projections of the zoo
# (docs/measurements.md, 2026-11-28).
# Cooperative splits one tile over two warpgroups: 128 rows (one m64 WGMMA each per k-block)
# or 256 rows (two each; 256x208 = 208 accumulator registers per thread). N not a multiple of
# 64 (160, 208, 224) stores through 32- or 16-column epilogue subtiles and, with an N-major B,
# uses 64- or 32-byte swizzled B tiles.
PINGPONG_TILES = ((64, 128), (64, 192), (64, 256), (128, 64), (128, 128), (128, 160),
                  (128, 192), (128, 208), (192, 128))
COOPERATIVE_TILES = ((128, 64), (128, 128), (128, 160), (128, 192), (128, 224), (128, 256),
                     (256, 128), (256, 160), (256, 192), (256, 208))
# Thread-block clusters: 1x1, 2x1 (two CTAs on vertically adjacent tiles share B's tile by TMA
# multicast) or 1x2 (horizontally adjacent, sharing A); both schedules, device visitor, every
# form (grouped_gemm's lists too). The two tiles of a pair always belong to one problem.
CLUSTERS = ((1, 1), (2, 1), (1, 2))
# Swapped tiles (swap_ab) in a cluster: 1x2 only, two CTAs on adjacent weight-column tiles of
# one expert sharing its rows of x by multicast (kernels/sm90/swapped.py). A tile loads 256
# rows of x and 128 weight columns a k-step: the pair loads 128 + 256 / 2 units a CTA instead
# of 384, a third less L2 -> SM traffic on the few-large-expert shapes where cuBLAS's
# 2-CTA-cluster kernels beat the 1x1 swapped tiles.
SWAP_CLUSTERS = ((1, 1), (1, 2))
# Raster panels wider than this gain nothing: an H100/H200 runs at most 132 CTAs at once, and
# 64 m-tiles of 128 rows already cover an 8k-row expert.
MAX_RASTER_PANEL = 64
# The fields a tuned table sets (moe_gemm.ops.tuned); backend stays the caller's.
TUNED_FIELDS = ("schedule", "visitor", "sort_by_k", "tile_m", "tile_n", "cluster_m",
                "cluster_n", "stages", "raster_panel", "tail_split", "whole_epilogue",
                "raster_along", "raster_serpentine", "swap_ab", "packed_pairs")
RASTER_AXES = ("m", "n")


@dataclass(frozen=True)
class GemmConfig:
    """How a grouped GEMM runs. Every field defaults to "let the library choose".

    Args:
        backend: "cute" (our sm90a kernels; needs an H100/H200 and the CuTe DSL), "torch"
            (moe_gemm.reference: CPU or any CUDA GPU) or "auto" (cute wherever it can run,
            torch elsewhere; `moe-gemm info` says which and why).
        schedule: "pingpong" (each consumer warpgroup owns a tile; one's epilogue overlaps the
            other's mainloop), "cooperative" (both warpgroups split one larger tile) or "auto".
        visitor: how a CTA finds its next (problem, tile): "device" (a warp-wide prefix-sum
            search over problem sizes in GPU memory; no host work, CUDA-graph safe), "host"
            (a per-CTA table built by moe_gemm.schedule on the host, cached per problem set)
            or "auto".
        sort_by_k: order problems by K descending before the round-robin tile assignment
            (general form only); None lets the cost model decide.
        tile_m, tile_n: output tile per CTA (cooperative) or per warpgroup (pingpong);
            None = heuristic. tile_k is 64 elements (one 128-byte swizzle row of bf16). With
            schedule="auto", a tile built for one schedule only (e.g. 128x256 cooperative,
            64x256 ping-pong) selects that schedule.
        cluster_m, cluster_n: thread-block cluster shape, (1, 1), (2, 1) or (1, 2); None =
            heuristic. 2x1 pairs CTAs on vertically adjacent tiles that load B's tile once and
            multicast it, 1x2 the same for A (device visitor only; either schedule).
        stages: A/B shared-memory pipeline depth; None = as many as shared memory holds
            beside the default epilogue staging. A deeper pin that fits once the output is
            staged in fewer buffers (at least 2) gets them (e.g. 5 for cooperative 128x192 at
            bf16, whose default holds 4); one that does not fit is a ValueError naming the
            limit.
        raster_panel: tiles per raster panel: a problem's tiles go along the panel's axis
            fastest inside panels of this many tiles (m-tiles by default), so CTAs running at
            once share B's (the expert weights') columns in L2; 1 to 64, None = heuristic.
        raster_along: the panels' axis, "m" (panels of m-tiles, the default) or "n" (panels
            of n-tiles: CTAs running at once share A's rows; QuACK's order for varlen-M).
            None = heuristic ("m" by the rules; a tuned table's entry may pick "n").
        raster_serpentine: odd panels walk the other axis backwards, so a panel starts on the
            tiles the previous one ended on (still in L2). None = heuristic (off by the
            rules; a tuned table's entry may turn it on).
        tail_split: when the last wave of tiles fills at most half the grid (or a launch has
            that few tiles), 2 or more CTAs share each of its tiles, a share of K each, as
            many as the idle SMs, K and a cap allow (8; MOE_GEMM_SPLIT_WAYS sets it, 2 to 16:
            under 4, decode keeps its ping-pong tile, which trades for a split one only where
            it gets four shares; grouped_mm and grouped_gemm, not the masked form nor the
            FP8 lists; device visitor; the rules take it on cooperative 1x1 tiles only, and a
            pinned split under schedule="auto" runs the cooperative schedule without the
            rules' own cluster; pinned with schedule="pingpong" or a pinned 2x1 / 1x2
            cluster it splits those tiles (a cluster's two CTAs share out K alike; the fused
            MoE kernels and FP8 run cooperative 1x1 splits only, else unsplit); in
            grouped_gemm's lists the deepest problem sizes the split and a shallower tile
            takes fewer shares, each keeping ~1024 of K). None = heuristic. The split adds
            fp32 partial sums in a fixed order (run to run bitwise), so results may differ
            from an unsplit run in the last bit.
            MOE_GEMM_TAIL_SPLIT=0 turns it off everywhere, pinned or not (it relies on the
            whole persistent grid being resident: see choice_switches.tail_split_enabled).
        whole_epilogue: stage a whole output tile in shared memory and store it with two
            barrier syncs instead of two per 32-column subtile (cooperative schedule, 128-row
            tiles, 16-bit output; it costs A/B pipeline stages). None = heuristic.
        swap_ab: grouped_mm's 2-D x 3-D (MoE) form computes each expert as out^T = w^T x^T,
            the routed rows on the WGMMA's N side: tiles of 128 weight columns by up to 256
            rows, each expert's rows split evenly over its tiles in steps of 16, so an expert
            computes fewer than 16 padding rows (the M-side tiles pad to 64 or 128; for few
            large experts). Cooperative, device visitor, a 1x1 cluster (or a pinned 1x2:
            adjacent weight-column tiles share the rows of x), 16-bit output; also
            fused_grouped_mm without a gate or with the concat gate layout (its other
            layouts and the other ops refuse it). None = by
            MOE_GEMM_SWAP_AB, else as a tuned table's exact entry measured it, else where an
            expert fills about one 256-row tile (192-320 rows on at most 160 experts,
            K >= 2048; swap_rules.swap_ab_wanted); False = off.
        packed_pairs: grouped_mm's 2-D x 3-D (MoE) form in 2x1 clusters: the cluster's two
            CTAs take two consecutive tiles of the tile order, across experts, so an expert
            with an odd count of m-tiles computes no tile past its end (B multicast where the
            pair shares an expert and a column of tiles). Needs the 2x1 cluster, the device
            visitor, panels along M and no tail split; the other forms and ops run without
            it. None = by MOE_GEMM_PACKED_PAIRS, else as a tuned table's entry names it;
            False = off.

    Which kernel an all-"auto" config runs is looked up in tuned tables first (see
    moe_gemm.ops.tuned); a config that pins any of schedule, visitor, sort_by_k, tile,
    cluster, stages, raster_panel, raster_along, raster_serpentine, tail_split or
    whole_epilogue runs by the rules with those pins honoured.
    """

    backend: Backend = "auto"
    schedule: Schedule = "auto"
    visitor: Visitor = "auto"
    sort_by_k: bool | None = None
    tile_m: int | None = None
    tile_n: int | None = None
    cluster_m: int | None = None
    cluster_n: int | None = None
    stages: int | None = None
    raster_panel: int | None = None
    tail_split: bool | None = None
    whole_epilogue: bool | None = None
    raster_along: str | None = None
    raster_serpentine: bool | None = None
    swap_ab: bool | None = None
    packed_pairs: bool | None = None

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("visitor", self.visitor, VISITORS)
        if self.raster_along is not None:
            _check_choice("raster_along", self.raster_along, RASTER_AXES)
        for name in ("sort_by_k", "tail_split", "whole_epilogue", "raster_serpentine",
                     "swap_ab", "packed_pairs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be None or a bool; got {value!r}")
        for name in ("tile_m", "tile_n", "cluster_m", "cluster_n", "stages", "raster_panel"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, numbers.Integral)):
                raise TypeError(f"{name} must be None or an int; got {value!r}")
            if value is not None and type(value) is not int:
                # (numpy's integer scalars: kept as Python ints, which the cache keys and the
                # tables' JSON hold)
                value = int(value)
                object.__setattr__(self, name, value)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive; got {value}")
        if (self.tile_m is None) != (self.tile_n is None):
            raise ValueError("tile_m and tile_n are set together (or both left None)")
        if (self.cluster_m is None) != (self.cluster_n is None):
            raise ValueError("cluster_m and cluster_n are set together (or both left None)")
        if self.tile_m is not None and self.schedule != "auto":
            allowed = PINGPONG_TILES if self.schedule == "pingpong" else COOPERATIVE_TILES
            if (self.tile_m, self.tile_n) not in allowed:
                raise ValueError(
                    f"tile {self.tile_m}x{self.tile_n} is not built for schedule "
                    f"{self.schedule!r}; expected one of {_fmt_tiles(allowed)}"
                )
        if self.tile_m is not None and self.schedule == "auto":
            if (self.tile_m, self.tile_n) not in PINGPONG_TILES + COOPERATIVE_TILES:
                raise ValueError(
                    f"tile {self.tile_m}x{self.tile_n} is not built; expected one of "
                    f"{_fmt_tiles(tuple(dict.fromkeys(PINGPONG_TILES + COOPERATIVE_TILES)))}"
                )
        if self.cluster_m is not None and (self.cluster_m, self.cluster_n) not in CLUSTERS:
            raise ValueError(
                f"cluster {self.cluster_m}x{self.cluster_n} is not supported; expected one of "
                f"{', '.join(f'{m}x{n}' for m, n in CLUSTERS)}"
            )
        if self.cluster_m is not None and (self.cluster_m, self.cluster_n) != (1, 1):
            if self.visitor == "host":
                raise ValueError(
                    f"cluster {self.cluster_m}x{self.cluster_n} is built for the device visitor "
                    "only; use visitor='device' or 'auto'"
                )
        if self.stages is not None and not 2 <= self.stages <= 12:
            raise ValueError(f"stages must be between 2 and 12; got {self.stages}")
        if self.raster_panel is not None and self.raster_panel > MAX_RASTER_PANEL:
            raise ValueError(f"raster_panel must be between 1 and {MAX_RASTER_PANEL}; got "
                             f"{self.raster_panel}")
        if self.tail_split and self.visitor == "host":
            raise ValueError("tail_split=True is built for the device visitor; use "
                             "visitor='device' or 'auto'")
        if self.whole_epilogue and self.schedule == "pingpong":
            raise ValueError("whole_epilogue=True is built for the cooperative schedule; use "
                             "schedule='cooperative' or 'auto'")
        # Under schedule="auto" the tail split selects the cooperative schedule (a pinned
        # schedule="pingpong" builds it on ping-pong tiles).
        if ((self.tail_split and self.schedule != "pingpong" or self.whole_epilogue)
                and self.tile_m is not None
                and (self.tile_m, self.tile_n) not in COOPERATIVE_TILES):
            which = "tail_split" if self.tail_split else "whole_epilogue"
            raise ValueError(
                f"{which}=True is built for the cooperative schedule, whose tiles are "
                f"{_fmt_tiles(COOPERATIVE_TILES)}; got tile {self.tile_m}x{self.tile_n}")
        if self.whole_epilogue and self.tile_m is not None and self.tile_m != 128:
            # The kernel stages a whole tile of 128 rows (GroupedGemmSm90 refuses any other
            # at its compile): refused here, so that neither a pin nor a tuned table's entry
            # (tuned.config_fields builds a GemmConfig) reaches it.
            raise ValueError("whole_epilogue=True is built for cooperative 128-row tiles; got "
                             f"tile {self.tile_m}x{self.tile_n}")

        if self.swap_ab:
            self._check_swap_ab()
        if self.packed_pairs:
            self._check_packed_pairs()

    def _check_packed_pairs(self) -> None:
        """packed_pairs=True pairs the tiles of 2x1 clusters: pins that cannot build it are
        refused."""
        conflicts = []
        if self.cluster_m is not None and (self.cluster_m, self.cluster_n) != (2, 1):
            conflicts.append(f"cluster {self.cluster_m}x{self.cluster_n}")
        if self.visitor == "host":
            conflicts.append("visitor='host'")
        if self.tail_split:
            conflicts.append("tail_split=True")
        if self.swap_ab:
            conflicts.append("swap_ab=True")
        if self.raster_along == "n":
            conflicts.append("raster_along='n'")
        if conflicts:
            raise ValueError(
                "packed_pairs=True runs 2x1 clusters on the device visitor with panels along "
                f"M, without the tail split or swapped tiles; got {', '.join(conflicts)}")

    def _check_swap_ab(self) -> None:
        """swap_ab=True fixes the kernel's schedule, tile, visitor and cluster: pins of any
        other value are refused."""
        conflicts = []
        if self.schedule == "pingpong":
            conflicts.append("schedule='pingpong'")
        if self.visitor == "host":
            conflicts.append("visitor='host'")
        if self.tile_m is not None and (self.tile_m, self.tile_n) != (256, 128):
            conflicts.append(f"tile {self.tile_m}x{self.tile_n}")
        if self.cluster_m is not None and (self.cluster_m, self.cluster_n) not in SWAP_CLUSTERS:
            conflicts.append(f"cluster {self.cluster_m}x{self.cluster_n}")
        if self.tail_split:
            conflicts.append("tail_split=True")
        if self.whole_epilogue:
            conflicts.append("whole_epilogue=True")
        if conflicts:
            raise ValueError(
                "swap_ab=True runs cooperative tiles of 256 rows x 128 columns on the device "
                "visitor in a 1x1 or 1x2 cluster, without the tail split or the whole-tile "
                "epilogue; "
                f"got {', '.join(conflicts)}")

    @property
    def tuning_pinned(self) -> bool:
        """Whether any field the tuned tables choose is pinned (then the rules decide).
        swap_ab=False and packed_pairs=False only keep swapped tiles and packed pairs out: the
        tables still choose among the rest."""
        return any(getattr(self, name) not in (None, "auto") for name in TUNED_FIELDS
                   if name not in ("swap_ab", "packed_pairs")) or bool(self.swap_ab) or bool(
            self.packed_pairs)

    def replace(self, **changes: object) -> GemmConfig:
        """A copy with some fields changed (validated like a new config)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    # A wrong type is a TypeError, an unknown name a ValueError (the library's convention,
    # as the bool and int fields).
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(map(repr, choices))} (a str); got "
                        f"{type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _fmt_tiles(tiles: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{m}x{n}" for m, n in tiles)


DEFAULT_CONFIG = GemmConfig()
