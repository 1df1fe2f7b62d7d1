"""The configs the tuner tries: built from the kernel's own lists, read when called.

Stage 1 crosses schedule x tile x cluster from moe_gemm.config (PINGPONG_TILES,
COOPERATIVE_TILES, CLUSTERS; whatever the kernel builds today), each with the default stages,
raster panel 8, no tail split and the subtile epilogue; GemmConfig's validation decides what
is buildable, so a tile or cluster added to (or removed from) the lists is tried (or not)
without a change here. grouped_mm's varlen form with 16-bit output also tries swapped tiles
('swap 256x128' and 'swap 256x128 c1x2': the rows on the WGMMA's N side,
kernels/sm90/swapped.py). The rules' own choice for the shape is always a candidate, so a
tuned entry is never slower than the rules as measured.

Stage 2 varies one field at a time around the best few of stage 1: pipeline stages, raster
panel, tail split, whole-tile epilogue, and for grouped_gemm's lists the visitor and K-sort.
A last candidate combines every stage-2 change that beat its parent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from moe_gemm import config as cfgmod
from moe_gemm.config import GemmConfig
from moe_gemm.kernels.sm90.constants import SWAP_TILE_COLS, SWAP_TILE_ROWS, config_stage_limit
from moe_gemm.ops.heuristics import KernelChoice, choice_fields

# 5: a depth the default epilogue staging leaves no room for on the 40-42 KiB stages of
# cooperative 128x192 and ping-pong 128x208 (the kernel then stages D in 3 buffers, not 4);
# tried only where it is that trade.
DEEP_STAGES = 5
STAGES = (None, 3, 4, DEEP_STAGES)
PANELS = (4, 8, 16)
Fields = dict  # tuned GemmConfig fields, every one explicit


def fields_of(choice: KernelChoice, form: str) -> Fields:
    """The explicit GemmConfig fields that reproduce a KernelChoice."""
    return choice_fields(choice, form)


def config_of(fields: Fields, backend: str = "cute") -> GemmConfig:
    """A GemmConfig pinning `fields` (ValueError if not buildable)."""
    return GemmConfig(backend=backend, **{k: v for k, v in fields.items() if v is not None})  # type: ignore[arg-type]


def name_of(fields: Fields) -> str:
    """A short readable name: 'coop 128x256 c1x2 s3 p16 ts ew'."""
    parts = ["swap" if fields.get("swap_ab") else
             "pp" if fields["schedule"] == "pingpong" else "coop",
             f"{fields['tile_m']}x{fields['tile_n']}"]
    cm, cn = fields.get("cluster_m") or 1, fields.get("cluster_n") or 1
    if (cm, cn) != (1, 1):
        parts.append(f"c{cm}x{cn}")
    if fields.get("stages"):
        parts.append(f"s{fields['stages']}")
    # The raster: p<panel>, "n" for panels of n-tiles, "s" for serpentine ('p8ns').
    parts.append(f"p{fields.get('raster_panel') or 8}"
                 f"{'n' if fields.get('raster_along') == 'n' else ''}"
                 f"{'s' if fields.get('raster_serpentine') else ''}")
    if fields.get("tail_split"):
        parts.append("ts")
    if fields.get("packed_pairs"):
        parts.append("pk")
    if fields.get("whole_epilogue"):
        parts.append("ew")
    if fields.get("visitor") == "host":
        parts.append("host")
    if fields.get("sort_by_k"):
        parts.append("ksort")
    return " ".join(parts)


_NAME_SCHEDULES = {"pp": "pingpong", "pingpong": "pingpong", "coop": "cooperative",
                   "cooperative": "cooperative", "swap": "cooperative"}


def _count(word: str, digits: str) -> int:
    """A positive decimal count written in ASCII digits (int() also takes '1_28', full-width
    digits and signs); ValueError naming the word."""
    if not (digits.isascii() and digits.isdigit()) or int(digits) < 1:
        raise ValueError(f"{word!r} (expected a positive count)")
    return int(digits)


def _pair(word: str, body: str) -> tuple[int, int]:
    parts = body.split("x")
    if len(parts) != 2:
        raise ValueError(f"{word!r} (expected two counts as AxB)")
    return _count(word, parts[0]), _count(word, parts[1])


def parse_name(text: str, form: str = "varlen") -> Fields:
    """The fields of a config written as name_of writes it ('coop 128x256 c1x2 s3 p16 ts ew';
    ':' or ',' may separate the words). Unnamed fields take stage 1's defaults. Raises
    ValueError naming the word it does not understand (or a field given twice), TypeError for
    a name that is not a str."""
    if not isinstance(text, str):
        raise TypeError(f"a config name must be a str; got {type(text).__name__}")
    words = [w for w in text.replace(":", " ").replace(",", " ").split() if w]
    if len(words) < 2 or words[0] not in _NAME_SCHEDULES:
        raise ValueError(f"config {text!r}: expected 'pp|coop|swap MxN [cMxN] [sS] [pP[n][s]] "
                         "[ts] [pk] [ew] [host] [ksort]'")
    fields: Fields = {"schedule": _NAME_SCHEDULES[words[0]], "visitor": "device",
                      "cluster_m": 1, "cluster_n": 1, "stages": None, "raster_panel": 8,
                      "whole_epilogue": False}
    fields["tail_split"] = False
    if form == "general":
        fields["sort_by_k"] = False
    if words[0] == "swap":
        fields["swap_ab"] = True
    seen: set[str] = set()  # ('s3 s4' kept the last, silently)
    try:
        fields["tile_m"], fields["tile_n"] = _pair(words[1], words[1])
        for w in words[2:]:
            kind = w if w in ("ts", "ew", "host", "ksort", "pk") else w[0]
            if kind in seen:
                raise ValueError(f"{w!r} (that field is given twice)")
            seen.add(kind)
            if w == "ts":
                fields["tail_split"] = True
            elif w == "pk":
                fields["packed_pairs"] = True
            elif w == "ew":
                fields["whole_epilogue"] = True
            elif w == "host":
                fields["visitor"] = "host"
            elif w == "ksort":
                fields["sort_by_k"] = True
            elif w[0] == "c" and "x" in w:
                fields["cluster_m"], fields["cluster_n"] = _pair(w, w[1:])
            elif w[0] == "s":
                fields["stages"] = _count(w, w[1:])
            elif w[0] == "p":
                body = w[1:]
                serpentine = body.endswith("s")
                body = body[:-1] if serpentine else body
                along_n = body.endswith("n")
                fields["raster_panel"] = _count(w, body[:-1] if along_n else body)
                if along_n:
                    fields["raster_along"] = "n"
                if serpentine:
                    fields["raster_serpentine"] = True
            else:
                raise ValueError(repr(w))
    except ValueError as exc:
        raise ValueError(f"config {text!r}: cannot read {exc}") from None
    return fields


def _buildable(fields: Fields, form: str, out_itemsize: int) -> bool:
    try:
        cfg = config_of(fields)
    except (TypeError, ValueError):
        return False
    if fields.get("whole_epilogue") and out_itemsize != 2:
        return False
    if form != "general" and (fields.get("visitor") == "host" or fields.get("sort_by_k")):
        return False
    if fields.get("swap_ab") and (form != "varlen" or out_itemsize != 2):
        return False  # (grouped_mm's 2-D x 3-D form, 16-bit output)
    if fields.get("packed_pairs") and (form != "varlen"
                                       or (fields.get("cluster_m"), fields.get("cluster_n"))
                                       != (2, 1)):
        return False  # (grouped_mm's 2-D x 3-D form in 2x1 clusters)
    if fields.get("whole_epilogue") and fields["tile_m"] != 128:
        return False
    if not _stages_fit(fields, out_itemsize):
        return False
    # A candidate pins its schedule (GemmConfig decided above which tiles and clusters build).
    return cfg.schedule != "auto"


def _stage_limit(fields: Fields, out_itemsize: int, want: int | None = None) -> int:
    """The most A/B stages the kernel builds for these fields (constants.ab_stage_limit, the
    kernel's own rule); with `want`, counting a staging shrunk to make room for it."""
    # (The tuner times 16-bit operands and leaves the cooperative subtile at its default.)
    return config_stage_limit(fields["schedule"], fields["tile_m"], fields["tile_n"],
                              bool(fields.get("whole_epilogue")), 16, 8 * out_itemsize, want)


def kernel_identity(choice: KernelChoice, out_itemsize: int) -> KernelChoice:
    """`choice` with its A/B depth resolved: stages=None and a pin equal to the depth None
    builds are the same kernel, so the tuner times it once (they were timed as two configs,
    and whichever measured faster by noise became the table's entry)."""
    depth = _stage_limit({"schedule": choice.schedule, "tile_m": choice.tile_m,
                          "tile_n": choice.tile_n, "whole_epilogue": choice.epi_whole},
                         out_itemsize)
    if choice.stages is None or choice.stages == depth:
        return dataclasses.replace(choice, stages=depth)
    return choice


def _stages_fit(fields: Fields, out_itemsize: int) -> bool:
    """Whether pinned stages fit in shared memory beside the epilogue (so the tuner never
    spends a compile on a config the kernel refuses)."""
    stages = fields.get("stages")
    return not stages or stages <= _stage_limit(fields, out_itemsize, want=stages)


def stage1(form: str, out_itemsize: int = 2) -> list[Fields]:
    """schedule x tile x cluster, everything else at its plain default."""
    out = []
    tiles = {"pingpong": cfgmod.PINGPONG_TILES, "cooperative": cfgmod.COOPERATIVE_TILES}
    for schedule, tile_list in tiles.items():
        for tm, tn in tile_list:
            for cm, cn in cfgmod.CLUSTERS:
                fields: Fields = {"schedule": schedule, "visitor": "device", "tile_m": tm,
                                  "tile_n": tn, "cluster_m": cm, "cluster_n": cn,
                                  "stages": None, "raster_panel": 8, "whole_epilogue": False}
                fields["tail_split"] = False
                if form == "general":
                    fields["sort_by_k"] = False
                if _buildable(fields, form, out_itemsize):
                    out.append(fields)
    for cm, cn in cfgmod.SWAP_CLUSTERS:
        swapped = parse_name(f"swap {SWAP_TILE_ROWS}x{SWAP_TILE_COLS} c{cm}x{cn}", form)
        if _buildable(swapped, form, out_itemsize):
            out.append(swapped)
    return out


def stage2(parent: Fields, form: str, out_itemsize: int = 2) -> list[Fields]:
    """One-field variations of `parent` (those that build)."""
    variants: list[Fields] = []

    def add(**change: object) -> None:
        f = {**parent, **change}
        if f != parent and _buildable(f, form, out_itemsize):
            variants.append(f)

    for s in STAGES:
        if s == DEEP_STAGES and _stage_limit({**parent, "stages": None}, out_itemsize) >= s:
            continue  # the default staging holds it already: the same kernel as stages=None
        add(stages=s)
    for p in PANELS:
        add(raster_panel=p)
    # Panels of n-tiles, serpentine (QuACK's varlen-M order): the CTAs running at once share
    # A's rows and walk B's columns back and forth.
    add(raster_along="n", raster_serpentine=True)
    cluster1 = (parent.get("cluster_m") or 1) * (parent.get("cluster_n") or 1) == 1
    if parent["schedule"] == "cooperative":
        add(whole_epilogue=not parent.get("whole_epilogue"))
    if parent.get("visitor") != "host":
        # (both schedules and every cluster build it: a 2-CTA cluster splits its cluster tile)
        add(tail_split=not parent.get("tail_split"))
    if form == "varlen" and (parent.get("cluster_m"), parent.get("cluster_n")) == (2, 1) and (
            not parent.get("packed_pairs")):
        # Packed pairs: the 2x1 cluster without the tile past an odd expert's end (H200,
        # 2026-12-06: cooperative 128x256 a median 1.13x its cluster tiles, ping-pong 64x256
        # 0.84-1.04x, so the tuner decides per shape).
        add(packed_pairs=True)
    if form == "general":
        add(sort_by_k=not parent.get("sort_by_k"))
        if cluster1:
            add(visitor="host" if parent.get("visitor") == "device" else "device")
    return variants


def combine(parent: Fields, winners: Iterable[Fields], form: str,
            out_itemsize: int = 2) -> Fields | None:
    """`parent` with every field a winning variation changed; None if it adds nothing new or
    does not build."""
    merged = dict(parent)
    for w in winners:
        merged.update({k: v for k, v in w.items() if v != parent.get(k)})
    if merged == parent or any(merged == w for w in winners):
        return None
    return merged if _buildable(merged, form, out_itemsize) else None


def dedupe(candidates: Iterable[Fields]) -> list[Fields]:
    seen, out = set(), []
    for f in candidates:
        key = tuple(sorted(f.items()))
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
