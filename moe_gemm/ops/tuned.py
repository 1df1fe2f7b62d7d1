"""Tuned tables: which kernel config runs a shape best on a device, as measured.

`moe-gemm tune` (moe_gemm.tuning) times our configs on shapes and writes a table; the
package ships one per device kind in moe_gemm/tables/<device-slug>.json. For a call whose
GemmConfig leaves every tuned field at "auto", the heuristics ask `lookup` here, in order:

1. exact: an entry for (form, dtypes, E, N, K, rows-per-problem bucket) in the user table
   (MOE_GEMM_TUNED_TABLE=path), the online-autotune cache, then the shipped table (the
   device's own, or for a Hopper part without one its sibling's: SIBLINGS);
2. neighbours: the timed shapes of those tables together (every candidate the tuner timed, a
   table's "samples"; a shape in two tables counts once, from the first) of the same form and
   dtypes nearest to the call's shape (up to NEIGHBOURS of them, at least MIN_VOTERS, distance
   in octaves of N, K and rows per problem, none farther than NEIGHBOUR_REACH): the config with
   the smallest mean log time over each neighbour's best (nearer neighbours weigh more),
   among those timed on all of them; the rules' own config keeps the call unless the pick
   scores RULES_MARGIN better. Measured on the shipped tables, leaving each zoo model out
   (benchmarks/choice_generalization.py): a median 1.011-1.013x of the best measured config
   on the held-out model's shapes, against 1.02-1.05x for the rules and 1.02x for the same
   projection's entry at the nearest rows-per-expert bucket; leaving each token count out
   (--hold tokens) 1.015-1.016x, the rules 1.02-1.05x (docs/measurements.md);
3. nothing: the heuristics' rules decide.

The fused MoE kernel (ops/fused_launch.py) asks its own forms (FUSED_FORMS: entries and samples
timed on the fused kernels) for what was measured alone (measured_lookup: the entry, else the
shape's samples near the call's rows; no vote), before it falls back to grouped_mm's answer.

Buckets: rows per problem r (varlen: T / E; batched: M; general: mean M) rounded in log2,
bucket = round(log2 r), so bucket b covers r in [2^(b-0.5), 2^(b+0.5)).

A table for another device, in another format, that is not valid JSON or is larger than
MAX_TABLE_BYTES is ignored with one warning, never an error: a table only ever picks among
configs that compute the same result (GemmConfig validates every entry; an entry naming a
tile this build lacks, stages that do not fit in shared memory, or an option its form does
not take, such as the host visitor on grouped_mm, is skipped). The online cache
(cache_root()/tuned/<slug>.json) records the library, DSL, driver, device and kernel-source
versions and is ignored when any differs; with MOE_GEMM_DISK_CACHE=0, or where that file
cannot be written, online results are kept in memory (this process) instead.
MOE_GEMM_TUNED_TABLES=0 turns all tables off (rules only), for A/B comparisons.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moe_gemm.config import TUNED_FIELDS, GemmConfig
from moe_gemm.env import env_value

FORMAT = "moe_gemm.tuned-table/1"
TABLES_DIR = Path(__file__).resolve().parents[1] / "tables"
USER_TABLE_ENV = "MOE_GEMM_TUNED_TABLE"
TABLES_ENV = "MOE_GEMM_TUNED_TABLES"
DISK_CACHE_ENV = "MOE_GEMM_DISK_CACHE"  # 0: tables_for leaves the online results on disk out
CACHE_DIR_ENV = "MOE_GEMM_CACHE_DIR"  # their folder (kernel_cache.cache_root, online_path)
# Every variable tables_for reads: a cache of a lookup's answer keys on all of their values
# (state(); ops/api.py's plan switches and heuristics.GENERAL_SWITCHES hold them), else a
# change between two calls would leave the answer the other setting gave.
SWITCHES = (TABLES_ENV, USER_TABLE_ENV, DISK_CACHE_ENV, CACHE_DIR_ENV)
# Neighbours: how many timed shapes vote (the NEIGHBOURS nearest within NEIGHBOUR_REACH summed
# octaves of N, K and rows per problem; fewer than MIN_VOTERS: no vote), how a voter's weight
# falls with its distance d (1 / (d + VOTE_SOFTENING)), and how much better (weighted mean log
# time) a pick must score than the rules' config, on the voters that timed that config (none:
# the rules stand). benchmarks/choice_generalization.py on the shipped tables (H100 / H200,
# 2026-12-07), leaving out one model / one token count in turn: median 1.010x / 1.009x and
# 1.014x / 1.013x of the best measured config, p90 1.056x / 1.068x and 1.089x / 1.055x, max
# 1.16x / 1.37x and 1.39x / 1.37x, within 3% on 79% / 77% and 69% / 77% of the held-out
# shapes. Comparing with the rules' config only where every voter had timed it (before) let a
# vote for a tile no voter had timed against the rules' swapped tile through: max 1.76x on the
# H200, within 3% on 77% / 73% and 67% / 73%. Six equal voters, all within reach (earlier),
# gave medians 1.015x / 1.013x; 6-12 voters weighted 1/d^0.5 to 1/d^2 all land within
# 1.007-1.014x; d + 0.1 (a tenth of an octave, ~7%) keeps one voter at the same coordinates
# from outvoting the rest.
NEIGHBOURS = 8
MIN_VOTERS = 4
NEIGHBOUR_REACH = 4.0
VOTE_SOFTENING = 0.1
RULES_MARGIN = math.log(1.01)
# unswapped_pick reads a shape's samples only this close to the call's rows (octaves). The
# fused down GEMM of Mixtral-8x7B (H200, 2026-12-04, benchmarks.fused_configs, the layer's
# router): the runner-up timed at 256 rows per expert (cooperative 256x192 in a 1x2 cluster)
# ran 1.05x the rules' pick at 288 rows (0.17 octave away) and 0.75x at 320 (0.32 octave:
# 256-row tiles cut an expert into a full and a quarter-full tile there).
SAMPLE_REACH = 0.25
# The fused MoE kernel's own forms (ops/fused_launch.py), named by what its epilogue carries
# beside the accumulators: the gate (an activation over gate/up column pairs) and a
# per-column bias. Their entries and samples are timed on the fused kernels under the MoE
# layer's routing (benchmarks.fused_configs, adopted by benchmarks.fused_adopt): the epilogue
# ranks the tiles differently from grouped_mm's plain store (gpt-oss-120b's biased GEMMs on an
# H200, 2026-12-04: cooperative tiles, grouped_mm's picks at 32-128 rows per expert, ran
# 0.93-0.97x ping-pong ones). A form is its own family, so they never vote for grouped_mm.
FUSED_FORMS = ("fused", "fused-gate", "fused-bias", "fused-gate-bias")
FORMS = ("varlen", "batched", "general", *FUSED_FORMS)


def fused_form(gate: bool, bias: bool) -> str:
    """The table form of a fused launch with (or without) a gate and a bias."""
    return "fused" + ("-gate" if gate else "") + ("-bias" if bias else "")


def device_slug(name: str) -> str:
    """File-name form of a device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


def rows_bucket(rows_per_problem: float) -> int:
    """round(log2(rows per problem)); -32 for no rows (decode with fewer rows than experts
    lands on negative buckets: 8 rows over 256 experts is bucket -5)."""
    if rows_per_problem <= 0:
        return -32
    return round(math.log2(rows_per_problem))


@dataclass(frozen=True)
class Key:
    """What a table entry is for."""

    form: str  # "varlen" | "batched" | "general" | one of FUSED_FORMS
    dtype: str  # input dtype, e.g. "bfloat16"
    out_dtype: str
    E: int  # experts (varlen), problems (batched), non-empty problems (general)
    N: int
    K: int
    bucket: int

    def family(self) -> tuple:
        return (self.form, self.dtype, self.out_dtype, self.E, self.N, self.K)


@dataclass(frozen=True)
class Hit:
    """A lookup's answer: the tuned fields, how they were found and where."""

    fields: tuple[tuple[str, Any], ...]
    how: str  # "exact" | "neighbours"
    source: str  # the table's path
    us: float | None = None  # the entry's measured time (exact); None for neighbours

    def apply(self, base: GemmConfig) -> GemmConfig:
        """`base` (the caller's all-auto config: backend etc.) with the tuned fields set."""
        return base.replace(**dict(self.fields))


@dataclass(frozen=True)
class TimedShape:
    """One shape the tuner timed: where it lies (log2 N, log2 K, log2 rows per problem) and
    every config's time there as a multiple of the shape's best, in log."""

    shape: tuple  # form, dtype, out_dtype, E, N, K, rows: the shape's identity across tables
    at: tuple[float, float, float]
    log_regret: dict[tuple[tuple[str, Any], ...], float]

    @property
    def family(self) -> tuple:
        """form, dtype, out_dtype: the shapes that can vote for one another."""
        return self.shape[:3]


def _place(n: int, k: int, rows_per_problem: float) -> tuple[float, float, float]:
    return (math.log2(max(1, n)), math.log2(max(1, k)), math.log2(max(rows_per_problem, 0.5)))


def quantized_rows(rows_per_problem: float) -> float:
    """Rows per problem to a quarter octave: the vote moves with whole octaves, and a lookup
    per distinct row count (a serving batch's tokens x top-k) can reuse an earlier one's."""
    if rows_per_problem <= 0:
        return 0.0
    return 2.0 ** (round(4 * math.log2(rows_per_problem)) / 4)


def neighbours_pick(shapes: list[TimedShape], key: Key, rows: int,
                    baseline: tuple | None = None,
                    accept: Callable[[tuple], bool] | None = None) -> tuple | None:
    """The config the NEIGHBOURS timed shapes nearest to `key` (with `rows` rows over key.E
    problems) favour (normalized fields; only configs `accept` admits, where given), or None:
    too few shapes within reach, no config timed on all of them, or `baseline` (the rules'
    config) scoring within RULES_MARGIN."""
    at = _place(key.N, key.K, quantized_rows(rows / max(1, key.E)))
    fam = (key.form, key.dtype, key.out_dtype)
    near = [(d, i) for d, i in sorted((sum(abs(a - b) for a, b in zip(at, s.at)), i)
                                      for i, s in enumerate(shapes) if s.family == fam)
            if d <= NEIGHBOUR_REACH][:NEIGHBOURS]
    if len(near) < MIN_VOTERS:
        return None
    voters = [shapes[i].log_regret for _, i in near]
    weights = [1.0 / (d + VOTE_SOFTENING) for d, _ in near]
    total = sum(weights)
    scores = {}
    for fields in voters[0]:
        if (all(fields in v for v in voters[1:]) and _fits_form(dict(fields), key)
                and (accept is None or accept(fields))):
            scores[fields] = sum(w * v[fields] for w, v in zip(weights, voters)) / total
    if not scores:
        return None
    pick = min(scores, key=lambda f: (scores[f], repr(f)))
    if baseline is None:
        return pick
    # The rules' config against the pick on the voters that timed it (the tuner times some
    # of its fields, such as the tail split, only as variations of its winners); on none of
    # them, nothing says the pick beats it and the rules stand.
    timed = [(w, v) for w, v in zip(weights, voters) if baseline in v]
    if not timed:
        return None
    weight = sum(w for w, _ in timed)
    gain = sum(w * (v[baseline] - v[pick]) for w, v in timed) / weight
    return None if gain <= RULES_MARGIN else pick


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def form_problem(cfg: dict, form: str, out_dtype: str | None = None) -> str | None:
    """Why a config's options are not built for `form` (and `out_dtype`, where given), or
    None: the rule the tables' lookup and `moe-gemm tune --configs` share (worded as the
    tuner's config names and --form say it)."""
    if cfg.get("whole_epilogue") and out_dtype and _ITEMSIZE.get(out_dtype, 2) != 2:
        return "'ew' is for 16-bit output"
    if form != "general" and (cfg.get("visitor") == "host" or cfg.get("sort_by_k")):
        return "'host' and 'ksort' are for --form general"
    if cfg.get("swap_ab"):
        # (what grouped_mm / swap_rules refuse at run time: accepted here, every shape failed)
        if form in ("batched", "general"):
            return "'swap' tiles are for --form varlen (grouped_mm's 2-D x 3-D form)"
        if out_dtype and _ITEMSIZE.get(out_dtype, 2) != 2:
            return "'swap' tiles store 16-bit output"
    return None


def _fits_form(cfg: dict, key: Key) -> bool:
    """Whether a config is buildable for this key's form and output dtype."""
    return form_problem(cfg, key.form, key.out_dtype) is None


@dataclass
class Table:
    """One parsed table file."""

    path: str
    device: str
    entries: dict[Key, tuple[tuple[tuple[str, Any], ...], float | None]]
    timed: list[TimedShape] = field(default_factory=list)
    versions: dict[str, Any] = field(default_factory=dict)
    skipped: int = 0


class TableError(ValueError):
    """Why a table file cannot be used (foreign, corrupt, wrong versions)."""


def normalize(fields: dict) -> tuple[tuple[str, Any], ...]:
    """The comparable form of tuned fields: sorted, without None / "auto"."""
    return tuple(sorted((k, v) for k, v in fields.items() if v is not None and v != "auto"))


def config_fields(raw: Any) -> tuple[tuple[str, Any], ...]:
    """Validated tuned fields of an entry's "config" (raises TableError when unusable).

    Every key must be a tuned GemmConfig field and the whole must construct a GemmConfig that
    pins at least schedule and tile (so the rules add nothing a measurement did not pick)."""
    if not isinstance(raw, dict) or not raw:
        raise TableError("config is not a non-empty object")
    unknown = set(raw) - set(TUNED_FIELDS)
    if unknown:
        raise TableError(f"unknown config fields {sorted(unknown)}")
    try:
        cfg = GemmConfig(**raw)
    except (TypeError, ValueError) as exc:
        raise TableError(f"invalid config: {exc}") from None
    if cfg.schedule == "auto" or cfg.tile_m is None:
        raise TableError("config pins no schedule and tile")
    return normalize(raw)


@functools.lru_cache(maxsize=256)
def stages_fit(fields: tuple[tuple[str, Any], ...], dtype: str, out_dtype: str) -> bool:
    """Whether validated tuned fields' pinned stages fit in shared memory beside the epilogue
    for these operand and output dtypes (the kernel's own rule: it refuses a depth that does
    not fit, so a table naming one is skipped like a tile this build lacks)."""
    cfg = dict(fields)
    if not cfg.get("stages"):
        return True
    from moe_gemm.kernels.sm90.constants import config_stage_limit

    bits = {name: 8 * _ITEMSIZE.get(name, 1 if name.startswith("float8") else 2)
            for name in (dtype, out_dtype)}
    return cfg["stages"] <= config_stage_limit(
        cfg["schedule"], cfg["tile_m"], cfg["tile_n"], bool(cfg.get("whole_epilogue")),
        bits[dtype], bits[out_dtype], want=cfg["stages"])


def entry_fields(raw: dict, key: Key) -> tuple[tuple[str, Any], ...]:
    """The validated tuned fields of entry `raw` for `key` (raises TableError when unusable)."""
    fields = config_fields(raw.get("config"))
    if not _fits_form(dict(fields), key):
        # The rule the neighbours' vote applies: e.g. visitor="host" on grouped_mm's forms
        # would read offs on the host in every call (a sync, no CUDA graph capture), which
        # the tuner never picks there.
        raise TableError(f"config {dict(fields)} is not built for the {key.form} form with "
                         f"{key.out_dtype} output")
    if not stages_fit(fields, key.dtype, key.out_dtype):
        raise TableError(f"{dict(fields)['stages']} stages do not fit in shared memory")
    return fields


def _whole(value: Any) -> int:
    """int(value) for a JSON number or numeric string that is a whole number: int() would
    truncate 8.5 to 8 and read true as 1, keying an entry to a shape it was not timed on."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


def key_of(raw: dict) -> Key:
    try:
        key = Key(str(raw["form"]), str(raw["dtype"]), str(raw.get("out_dtype", raw["dtype"])),
                  _whole(raw["E"]), _whole(raw["N"]), _whole(raw["K"]), _whole(raw["bucket"]))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise TableError(f"bad key ({type(exc).__name__}: {exc})") from None
    if key.form not in FORMS or min(key.E, key.N, key.K) <= 0:
        raise TableError(f"bad key {key}")
    return key


def parse_table(doc: Any, path: str, device: str,
                versions: dict[str, Any] | None = None) -> Table:
    """A Table from a decoded JSON document, for `device` (raises TableError if unusable).

    versions: when given, the document's "versions" must equal it (the online cache)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TableError(f"not a {FORMAT} table")
    if doc.get("device") != device:
        raise TableError(f"made for {doc.get('device')!r}, this device is {device!r}")
    if versions is not None and doc.get("versions") != versions:
        raise TableError(f"made with other versions ({doc.get('versions')} here {versions})")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise TableError("entries is not a list")
    if not isinstance(doc.get("versions") or {}, dict):
        raise TableError("versions is not an object")
    table = Table(path, device, {}, versions=dict(doc.get("versions") or {}))
    for raw in entries:
        try:
            if not isinstance(raw, dict):
                raise TableError("entry is not an object")
            key = key_of(raw)
            table.entries[key] = (entry_fields(raw, key), _time(raw.get("us")))
        except TableError:
            table.skipped += 1
    table.timed = parse_samples(doc.get("samples"))
    return table


def _time(us: Any) -> float | None:
    """An entry's "us" as a time, None where it is none (not a number, not finite and
    positive). float() of a JSON integer past a float's range raises OverflowError: caught
    here, so that one entry's time cannot make the reader refuse the whole table."""
    if isinstance(us, bool) or not isinstance(us, (int, float)):
        return None
    try:
        us = float(us)
    except OverflowError:
        return None
    return us if 0 < us < math.inf else None


def parse_samples(raw: Any) -> list[TimedShape]:
    """The timed shapes of a table's "samples" (the tuner's every timing: form, dtypes, E, N,
    K, rows, config, us); samples that do not parse or name a config this build lacks are left
    out, a malformed list gives none."""
    if not isinstance(raw, list):
        return []
    by_shape: dict[tuple, dict[tuple, float]] = {}
    places: dict[tuple, tuple[float, float, float]] = {}
    known: dict[tuple, tuple | None] = {}  # a table's ~10k samples share ~100 configs
    for s in raw:
        try:
            shape = (str(s["form"]), str(s["dtype"]), str(s.get("out_dtype", s["dtype"])),
                     _whole(s["E"]), _whole(s["N"]), _whole(s["K"]), _whole(s["rows"]))
            us = _time(s["us"])  # (as an entry's: a bool or a string is no time)
            if shape[0] not in FORMS or min(shape[3:6]) <= 0 or shape[6] < 0 or us is None:
                # (an infinite time would make the shape's regrets inf / inf = nan, and a
                # NaN score compares False with every other, so it could win the vote)
                continue
            if shape not in places:
                # Here, where a bad sample is left out: rows / E of integers past a float's
                # range raises OverflowError, which must not refuse the whole table.
                places[shape] = _place(shape[4], shape[5], shape[6] / shape[3])
            raw_cfg = tuple(sorted(s["config"].items()))
            if raw_cfg not in known:
                try:
                    known[raw_cfg] = config_fields(s["config"])
                except TableError:
                    known[raw_cfg] = None
            fields = known[raw_cfg]
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
            continue
        if fields is None or not stages_fit(fields, shape[1], shape[2]):
            continue
        times = by_shape.setdefault(shape, {})
        times[fields] = min(times.get(fields, math.inf), us)
    out = []
    for shape, times in by_shape.items():
        best = min(times.values())
        out.append(TimedShape(shape=shape, at=places[shape],
                              log_regret={f: math.log(t / best) for f, t in times.items()}))
    return out


# ---------------------------------------------------------------------------------------------
# The registry: which tables apply to a device, loaded once


_warned: set[str] = set()
# lookup's neighbours answers: (device, state(), key, quantized rows, baseline) -> fields
_picks: dict[tuple, tuple | None] = {}
# unswapped_pick's votes: (device, state(), key, quantized rows, baseline) -> fields or None
_unswapped_picks: dict[tuple, tuple | None] = {}
_lock = threading.RLock()
_generation = 0
_UNSEEN = object()  # (None is a memoized answer: no pick)
# The largest file read as a table: the shipped ones, whole zoo runs, are 3-4 MB. A path set
# by mistake to a checkpoint or a log would otherwise be read whole into memory (tens of
# GB, an out-of-memory kill) only to be warned about as "not valid JSON".
MAX_TABLE_BYTES = 256 << 20


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"moe_gemm: {message}", RuntimeWarning, stacklevel=4)


def read_table_bytes(path: Path, what: str = "a table") -> bytes:
    """The bytes of the table file at `path`: OSError where it cannot be read, ValueError
    (starting with the path) where it is not a regular file of at most MAX_TABLE_BYTES. A
    FIFO or a device (/dev/stdin, /dev/zero) would block the read until a writer comes, or
    fill memory: only a regular file is read."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if info.st_size > MAX_TABLE_BYTES:
        raise ValueError(f"{path} is {info.st_size} bytes, more than {what}'s "
                         f"{MAX_TABLE_BYTES}")
    with open(path, "rb") as f:  # (at most the limit, should it grow after the stat)
        raw = f.read(MAX_TABLE_BYTES + 1)
    if len(raw) > MAX_TABLE_BYTES:
        raise ValueError(f"{path} is more than {what}'s {MAX_TABLE_BYTES} bytes")
    return raw


def _read(path: Path, device: str, versions: dict[str, Any] | None,
          sibling_ok: bool = False) -> Table | None:
    """The table at `path` for `device`, or None with one warning (missing files are silent).
    sibling_ok: a table made for the device's sibling (SIBLINGS) serves too."""
    try:
        raw = read_table_bytes(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn_once(f"{path}:read", f"cannot read tuned table {path} ({exc}); ignored")
        return None
    except ValueError as exc:
        _warn_once(f"{path}:read", f"tuned table {exc}; ignored")
        return None
    try:
        # Bytes, so that json detects the encoding and a file that is not text at all is a
        # UnicodeDecodeError (a ValueError) here; RecursionError: a pathologically nested one.
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        _warn_once(f"{path}:json", f"tuned table {path} is not valid JSON "
                   f"({type(exc).__name__}: {str(exc)[:200]}); ignored")
        return None
    made_for = device
    sibling = sibling_of(device) if sibling_ok else None
    if sibling is not None and isinstance(doc, dict) and doc.get("device") == sibling:
        # (a copy of the sibling's shipped table, say. An H100 or H200 has no sibling: a
        # table without "device" then compared equal to None and raised a KeyError here.)
        made_for = sibling
    try:
        table = parse_table(doc, str(path), made_for, versions)
    except TableError as exc:
        _warn_once(f"{path}:{device}", f"tuned table {path} ignored: {exc}")
        return None
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign table never stops a call
        _warn_once(f"{path}:{device}", f"tuned table {path} ignored: it does not parse as a "
                   f"table ({type(exc).__name__}: {str(exc)[:200]})")
        return None
    if table.skipped:
        _warn_once(f"{path}:skipped", f"tuned table {path}: {table.skipped} entries this "
                   "build cannot use were skipped")
    return table


# The shipped table that stands in for a Hopper device none is named after: the same SM
# architecture with the closest memory system. H800 and the H100 PCIe / NVL parts get the H100
# SXM table (HBM2e/HBM3, 3.3-3.9 TB/s; the PCIe part has 114 SMs, not 132); the H200 NVL and
# the GH200 (the H100 die with HBM3/HBM3e, 4.0-4.9 TB/s, a higher power limit) the H200's.
# A table's configs all compute the same result, so a stand-in can only cost speed.
SIBLINGS = (
    (re.compile(r"\b(H200|GH200)\b"), "NVIDIA H200"),
    (re.compile(r"\b(H100|H800)\b"), "NVIDIA H100 80GB HBM3"),
)


def sibling_of(device: str) -> str | None:
    """The device whose tables stand in for `device` (SIBLINGS), None if none does."""
    for pattern, sibling in SIBLINGS:
        if pattern.search(device) and sibling != device:
            return sibling
    return None


def shipped_device(device: str) -> str | None:
    """The device whose shipped table applies to `device`: its own, else its sibling's
    (SIBLINGS), else None."""
    if (TABLES_DIR / f"{device_slug(device)}.json").is_file():
        return device
    for pattern, sibling in SIBLINGS:
        if pattern.search(device) and (TABLES_DIR / f"{device_slug(sibling)}.json").is_file():
            return sibling
    return None


def shipped_path(device: str) -> Path:
    return TABLES_DIR / f"{device_slug(shipped_device(device) or device)}.json"


def online_path(device: str) -> Path:
    from moe_gemm.ops.kernel_cache import cache_root

    return cache_root() / "tuned" / f"{device_slug(device)}.json"


@functools.lru_cache(maxsize=8)
def _shipped(device: str) -> Table | None:
    own = shipped_device(device)
    return None if own is None else _read(shipped_path(own), own, None)


@functools.lru_cache(maxsize=8)
def _user(path: str, mtime: float, device: str) -> Table | None:
    # (USAGE: a table of one's own may start as a copy of the shipped one, which on an H200
    # NVL or an H100 PCIe is its sibling's)
    return _read(Path(path), device, None, sibling_ok=True)


# Online-autotune results kept in this process only (device -> table document): with the disk
# cache off (MOE_GEMM_DISK_CACHE=0), or where the cache file cannot be written.
_memory: dict[str, dict[str, Any]] = {}
MEMORY_SOURCE = "(online autotune, in memory)"


@functools.lru_cache(maxsize=8)
def _in_memory(device: str, generation: int) -> Table | None:
    doc = _memory.get(device)
    return None if doc is None else parse_table(doc, MEMORY_SOURCE, device)


@functools.lru_cache(maxsize=8)
def _online(path: str, generation: int, device: str) -> Table | None:
    from moe_gemm.ops.versions import runtime_versions

    return _read(Path(path), device, runtime_versions(device))


def enabled() -> bool:
    return bool(env_value(TABLES_ENV))


def state() -> tuple:
    """What the answer of `lookup` depends on besides its arguments (heuristics key their
    caches on it): the online cache's generation, whether it is read from disk and from which
    folder, and the user table's path and mtime."""
    path = env_value(USER_TABLE_ENV)
    mtime = 0.0
    if path:
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            mtime = -1.0
    return (enabled(), _generation, path, mtime, env_value(DISK_CACHE_ENV),
            env_value(CACHE_DIR_ENV))


def tables_for(device: str) -> list[Table]:
    """The tables that apply to `device`, most specific first: user, online cache, shipped."""
    if not enabled():
        return []
    with _lock:
        found = []
        path = env_value(USER_TABLE_ENV)
        if path:
            try:
                mtime = os.stat(path).st_mtime
            except OSError:
                _warn_once(f"{path}:missing", f"{USER_TABLE_ENV}={path} does not exist; "
                           "ignored")
                mtime = None
            if mtime is not None:
                found.append(_user(path, mtime, device))
        if env_value(DISK_CACHE_ENV):
            found.append(_online(str(online_path(device)), _generation, device))
        if device in _memory:
            found.append(_in_memory(device, _generation))
        found.append(_shipped(device))
        return [t for t in found if t is not None]


def has_form(device: str, form: str) -> bool:
    """Whether any table for `device` holds an entry or a timed shape for `form` (lets the general
    form skip building a key, an O(problems) pass, when no table can answer it)."""
    return _has_form(device, form, state())


@functools.lru_cache(maxsize=32)
def _has_form(device: str, form: str, _state: tuple) -> bool:
    for t in tables_for(device):
        if any(k.form == form for k in t.entries) or any(
                s.family[0] == form for s in t.timed):
            return True
    return False


def lookup(device: str, key: Key, rows: int, nsm: int,
           baseline: dict | None = None) -> Hit | None:
    """The tuned fields for `key` on `device` (see the module docstring), or None.
    baseline: the rules' config for the call (a neighbours pick must beat it clearly); nsm
    is the device's SM count (each table is for one device kind already)."""
    tables = tables_for(device)
    for t in tables:
        hit = t.entries.get(key)
        if hit is not None:
            return Hit(hit[0], "exact", t.path, hit[1])
    if not tables:
        return None
    base = None if baseline is None else normalize(baseline)
    memo = (device, state(), key, quantized_rows(rows / max(1, key.E)), base)
    # Read once into a local: another thread may clear _picks (past 4096 memos, or
    # clear_caches) between storing the pick and reading it back, which raised KeyError in
    # the call that made it.
    found = _picks.get(memo, _UNSEEN)
    if found is _UNSEEN:
        found = neighbours_pick(_timed_shapes(tables), key, rows, base)
        if len(_picks) > 4096:
            _picks.clear()
        _picks[memo] = found
    return None if found is None else Hit(found, "neighbours", ",".join(t.path for t in tables))


def sample_pick(device: str, key: Key, rows: int,
                accept: Callable[[tuple], bool] | None = None) -> Hit | None:
    """The fastest config (of those `accept` admits) the tables timed on key's own shape (form,
    dtypes, E, N, K) at the row count nearest to `rows`, if one lies within SAMPLE_REACH
    octaves of it ("exact"; the most specific table that timed the shape answers), else None."""
    tables = tables_for(device)
    family = key.family()
    best: tuple[float, TimedShape] | None = None
    for t in tables:
        for s in t.timed:
            if s.shape[:6] != family:
                continue
            gap = abs(math.log2(max(s.shape[6], 1) / max(rows, 1)))
            if gap <= SAMPLE_REACH and (best is None or gap < best[0]):
                best = (gap, s)
        if best is not None:
            break
    if best is None:
        return None
    timed = best[1].log_regret
    admitted = [f for f in timed if _fits_form(dict(f), key) and (accept is None or accept(f))]
    if not admitted:
        return None
    fastest = min(timed[f] for f in admitted)
    return Hit(min((f for f in admitted if timed[f] == fastest), key=repr), "exact",
               ",".join(t.path for t in tables))


def measured_lookup(device: str, key: Key, rows: int) -> Hit | None:
    """What was measured for `key` alone: its entry ("exact"), else the config timed fastest on
    its shape within SAMPLE_REACH octaves of `rows` (sample_pick); no vote. For the fused
    forms, whose tables hold an entry only where a config beat the default by a margin
    (benchmarks.fused_adopt) and few shapes: a timed row count keeps what ran fastest there,
    and a launch nobody timed keeps grouped_mm's answer rather than a vote of a few shapes
    (gpt-oss-120b's fused GEMMs on an H200, 2026-12-04: two runs at 256 rows per expert put the
    same two tiles 3-4% apart one way and 0.4-1.7% the other)."""
    for t in tables_for(device):
        hit = t.entries.get(key)
        if hit is not None:
            return Hit(hit[0], "exact", t.path, hit[1])
    return sample_pick(device, key, rows)


def unswapped_pick(device: str, key: Key, rows: int,
                   baseline: dict | None = None) -> Hit | None:
    """A config without swapped tiles for `key` with `rows` rows, for a launch that cannot run
    the swapped kernel an exact entry names (the fused and masked forms, or swap_ab turned
    off), where the rules alone can be far off: the fastest unswapped config the tables timed
    on key's own shape at the row count nearest to `rows` (sample_pick); else the neighbours'
    vote among unswapped configs ("neighbours", `baseline` as in lookup, memoized per quarter
    octave of rows per problem as lookup's vote); else None."""
    hit = sample_pick(device, key, rows, accept=_unswapped)
    if hit is not None:
        return hit
    tables = tables_for(device)
    base = None if baseline is None else normalize(baseline)
    memo = (device, state(), key, quantized_rows(rows / max(1, key.E)), base)
    found = _unswapped_picks.get(memo, _UNSEEN)
    if found is _UNSEEN:
        found = neighbours_pick(_timed_shapes(tables), key, rows, base, accept=_unswapped)
        if len(_unswapped_picks) > 4096:
            _unswapped_picks.clear()
        _unswapped_picks[memo] = found
    return None if found is None else Hit(found, "neighbours",
                                          ",".join(t.path for t in tables))


def _unswapped(fields: tuple[tuple[str, Any], ...]) -> bool:
    return not dict(fields).get("swap_ab")


def _timed_shapes(tables: list[Table]) -> list[TimedShape]:
    """The timed shapes of `tables`, in priority order: a shape timed twice votes with the
    first."""
    seen: set[tuple] = set()
    timed = []
    for t in tables:
        for s in t.timed:
            if s.shape not in seen:
                seen.add(s.shape)
                timed.append(s)
    return timed


def clear_caches() -> None:
    """Forget every parsed table (tests; a process never sees a shipped table change)."""
    for fn in (_shipped, _user, _online, _in_memory, _has_form):
        fn.cache_clear()
    _picks.clear()
    _unswapped_picks.clear()
    _memory.clear()


def bump_generation() -> None:
    """The online cache changed: later lookups reread it."""
    global _generation
    with _lock:
        _generation += 1
