"""Tuned tables: which kernel config runs a shape best on a device, as measured.

`moe-gemm tune` (moe_gemm.tuning) times our configs on shapes and writes a table; the
package ships one per device kind in moe_gemm/tables/<device-slug>.json. For a call whose
GemmConfig leaves every tuned field at "auto", the heuristics ask `lookup` here, in order:

1. exact: an entry for (form, dtypes, E, N, K, rows-per-problem bucket) in the user table
   (MOE_GEMM_TUNED_TABLE=path), the online-autotune cache, then the shipped table (the
   device's own, or for a Hopper part without one its sibling's: SIBLINGS);
2. nearest: the same (form, dtypes, E, N, K) at the nearest bucket, at most NEAREST_MAX
   buckets (a factor of 4 in rows per problem) away;
3. model: the table's calibrated cost model (moe_gemm.ops.cost_model) picks among the configs
   it was fitted on, for shapes inside the range it was fitted over, and only when it predicts
   its pick at least MODEL_MIN_GAIN faster than the rules' own config (when that config was
   fitted too: a model is not trusted over the rules for a few percent);
4. nothing: the heuristics' rules decide.

Buckets: rows per problem r (varlen: T / E; batched: M; general: mean M) rounded in log2,
bucket = round(log2 r), so bucket b covers r in [2^(b-0.5), 2^(b+0.5)).

A table for another device, in another format, or that is not valid JSON is ignored with one
warning, never an error: a table only ever picks among configs that compute the same result
(GemmConfig validates every entry; an entry naming a tile this build lacks is skipped). The
online cache (cache_root()/tuned/<slug>.json) records the library, DSL, driver, device and
kernel-source versions and is ignored when any differs. MOE_GEMM_TUNED_TABLES=0 turns all
tables off (rules only), for A/B comparisons.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_gemm.config import TUNED_FIELDS, GemmConfig
from moe_gemm.env import env_get, env_switch
from moe_gemm.ops.cost_model import Params, Shape, predict_us

FORMAT = "moe_gemm.tuned-table/1"
MODEL_KIND = "moe_gemm.cost/1"
TABLES_DIR = Path(__file__).resolve().parents[1] / "tables"
USER_TABLE_ENV = "MOE_GEMM_TUNED_TABLE"
TABLES_ENV = "MOE_GEMM_TUNED_TABLES"
NEAREST_MAX = 2
# A fitted model is trusted for shapes within this many octaves of what it was fitted on
# (per N, K and rows per problem).
MODEL_MARGIN = 1.0
# Fitted configs whose RMS log error exceeds this (a factor of ~1.2) are not offered.
MODEL_MAX_ERR = 0.2
MODEL_MIN_GAIN = 1.05
FORMS = ("varlen", "batched", "general")


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

    form: str  # "varlen" | "batched" | "general"
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
    how: str  # "exact" | "nearest" | "model"
    source: str  # the table's path
    us: float | None = None  # measured (exact/nearest) or predicted (model) time

    def apply(self, base: GemmConfig) -> GemmConfig:
        """`base` (the caller's all-auto config: backend etc.) with the tuned fields set."""
        return base.replace(**dict(self.fields))


@dataclass
class Model:
    """A table's fitted cost model (moe_gemm.ops.cost_model)."""

    configs: list[tuple[tuple[tuple[str, Any], ...], Params]]
    mm_flops_per_s: float
    copy_bytes_per_s: float
    forms: frozenset[str]
    dtypes: frozenset[tuple[str, str]]
    log2_n: tuple[float, float]
    log2_k: tuple[float, float]
    buckets: tuple[int, int]

    def covers(self, key: Key) -> bool:
        m = MODEL_MARGIN
        return (key.form in self.forms and (key.dtype, key.out_dtype) in self.dtypes
                and self.log2_n[0] - m <= math.log2(max(1, key.N)) <= self.log2_n[1] + m
                and self.log2_k[0] - m <= math.log2(max(1, key.K)) <= self.log2_k[1] + m
                and self.buckets[0] - m <= key.bucket <= self.buckets[1] + m)

    def best(self, key: Key, rows: int, nsm: int, baseline: tuple | None = None
             ) -> tuple[tuple, float] | None:
        """The fitted config predicted fastest (fields, us); None when `baseline` (normalized
        fields, see normalize) is fitted and predicted within MODEL_MIN_GAIN of it."""
        shape = Shape(key.form, key.E, key.N, key.K, rows, nsm,
                      _ITEMSIZE.get(key.dtype, 2), _ITEMSIZE.get(key.out_dtype, 2))
        best, base_us = None, None
        for fields, params in self.configs:
            cfg = dict(fields)
            if not _fits_form(cfg, key):
                continue
            us = predict_us(cfg, params, shape, self.mm_flops_per_s, self.copy_bytes_per_s)
            if fields == baseline:
                base_us = us
            if best is None or us < best[1]:
                best = (fields, us)
        if best is not None and base_us is not None and best[1] * MODEL_MIN_GAIN > base_us:
            return None
        return best


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _fits_form(cfg: dict, key: Key) -> bool:
    """Whether a config is buildable for this key's form and output dtype."""
    if cfg.get("tail_split") and key.form == "general":
        return False
    if cfg.get("whole_epilogue") and _ITEMSIZE.get(key.out_dtype, 2) != 2:
        return False
    if key.form != "general" and (cfg.get("visitor") == "host" or cfg.get("sort_by_k")):
        return False
    return True


@dataclass
class Table:
    """One parsed table file."""

    path: str
    device: str
    entries: dict[Key, tuple[tuple[tuple[str, Any], ...], float | None]]
    model: Model | None = None
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


def key_of(raw: dict) -> Key:
    try:
        key = Key(str(raw["form"]), str(raw["dtype"]), str(raw.get("out_dtype", raw["dtype"])),
                  int(raw["E"]), int(raw["N"]), int(raw["K"]), int(raw["bucket"]))
    except (KeyError, TypeError, ValueError) as exc:
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
    table = Table(path, device, {}, versions=dict(doc.get("versions") or {}))
    for raw in entries:
        try:
            if not isinstance(raw, dict):
                raise TableError("entry is not an object")
            key = key_of(raw)
            us = raw.get("us")
            table.entries[key] = (config_fields(raw.get("config")),
                                  float(us) if isinstance(us, (int, float)) else None)
        except TableError:
            table.skipped += 1
    if doc.get("model") is not None:
        try:
            table.model = parse_model(doc["model"])
        except TableError:
            table.skipped += 1
    return table


def parse_model(raw: Any) -> Model:
    if not isinstance(raw, dict) or raw.get("kind") != MODEL_KIND:
        raise TableError(f"model is not a {MODEL_KIND} block")
    try:
        configs = []
        for item in raw["configs"]:
            if float(item.get("rms_log_err", 0.0)) > MODEL_MAX_ERR:
                continue
            try:
                fields = config_fields(item["config"])
            except TableError:
                continue  # a config this build lacks: not offered
            p = Params(float(item["eff"]), float(item["tile_us"]), float(item["mem"]))
            if not (0 < p.eff <= 1.5 and p.tile_us >= 0 and p.mem > 0):
                continue
            configs.append((fields, p))
        dom = raw["domain"]
        model = Model(
            configs, float(raw["mm_flops_per_s"]), float(raw["copy_bytes_per_s"]),
            frozenset(dom["forms"]), frozenset(tuple(d) for d in dom["dtypes"]),
            (float(dom["log2_N"][0]), float(dom["log2_N"][1])),
            (float(dom["log2_K"][0]), float(dom["log2_K"][1])),
            (int(dom["bucket"][0]), int(dom["bucket"][1])))
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise TableError(f"bad model block ({type(exc).__name__}: {exc})") from None
    if model.mm_flops_per_s <= 0 or model.copy_bytes_per_s <= 0 or not configs:
        raise TableError("model block has no usable configs or ceilings")
    return model


# ---------------------------------------------------------------------------------------------
# The registry: which tables apply to a device, loaded once


_warned: set[str] = set()
_lock = threading.RLock()
_generation = 0


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"moe_gemm: {message}", RuntimeWarning, stacklevel=4)


def _read(path: Path, device: str, versions: dict[str, Any] | None) -> Table | None:
    """The table at `path` for `device`, or None with one warning (missing files are silent)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        _warn_once(f"{path}:read", f"cannot read tuned table {path} ({exc}); ignored")
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        _warn_once(f"{path}:json", f"tuned table {path} is not valid JSON ({exc}); ignored")
        return None
    try:
        table = parse_table(doc, str(path), device, versions)
    except TableError as exc:
        _warn_once(f"{path}:{device}", f"tuned table {path} ignored: {exc}")
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
    return _read(Path(path), device, None)


@functools.lru_cache(maxsize=8)
def _online(path: str, generation: int, device: str) -> Table | None:
    from moe_gemm.ops.versions import runtime_versions

    return _read(Path(path), device, runtime_versions(device))


def enabled() -> bool:
    return env_switch(TABLES_ENV)


def state() -> tuple:
    """What the answer of `lookup` depends on besides its arguments (heuristics key their
    caches on it): the online cache's generation and the user table's path and mtime."""
    path = env_get(USER_TABLE_ENV)
    mtime = 0.0
    if path:
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            mtime = -1.0
    return (enabled(), _generation, path or None, mtime)


def tables_for(device: str) -> list[Table]:
    """The tables that apply to `device`, most specific first: user, online cache, shipped."""
    if not enabled():
        return []
    with _lock:
        found = []
        path = env_get(USER_TABLE_ENV)
        if path:
            try:
                mtime = os.stat(path).st_mtime
            except OSError:
                _warn_once(f"{path}:missing", f"{USER_TABLE_ENV}={path} does not exist; "
                           "ignored")
                mtime = None
            if mtime is not None:
                found.append(_user(path, mtime, device))
        if env_switch("MOE_GEMM_DISK_CACHE"):
            found.append(_online(str(online_path(device)), _generation, device))
        found.append(_shipped(device))
        return [t for t in found if t is not None]


def has_form(device: str, form: str) -> bool:
    """Whether any table for `device` holds an entry or a model for `form` (lets the general
    form skip building a key, an O(problems) pass, when no table can answer it)."""
    return _has_form(device, form, state())


@functools.lru_cache(maxsize=32)
def _has_form(device: str, form: str, _state: tuple) -> bool:
    for t in tables_for(device):
        if any(k.form == form for k in t.entries) or (
                t.model is not None and form in t.model.forms):
            return True
    return False


def lookup(device: str, key: Key, rows: int, nsm: int,
           baseline: dict | None = None) -> Hit | None:
    """The tuned fields for `key` on `device` (see the module docstring), or None.
    baseline: the rules' config for the call (the model must beat it clearly)."""
    tables = tables_for(device)
    for t in tables:
        hit = t.entries.get(key)
        if hit is not None:
            return Hit(hit[0], "exact", t.path, hit[1])
    family = key.family()
    best = None
    for t in tables:
        for k, (fields, us) in t.entries.items():
            if k.family() == family:
                d = abs(k.bucket - key.bucket)
                # Ties go to the larger bucket: more rows per problem is the costlier side.
                rank = (d, -k.bucket)
                if d <= NEAREST_MAX and (best is None or rank < best[0]):
                    best = (rank, Hit(fields, "nearest", t.path, us))
    if best is not None:
        return best[1]
    for t in tables:
        if t.model is not None and t.model.covers(key):
            found = t.model.best(key, rows, nsm,
                                 None if baseline is None else normalize(baseline))
            if found is not None:
                return Hit(found[0], "model", t.path, found[1])
    return None


def clear_caches() -> None:
    """Forget every parsed table (tests; a process never sees a shipped table change)."""
    for fn in (_shipped, _user, _online, _has_form):
        fn.cache_clear()


def bump_generation() -> None:
    """The online cache changed: later lookups reread it."""
    global _generation
    with _lock:
        _generation += 1
