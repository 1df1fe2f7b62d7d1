"""Writing tuned tables (the format moe_gemm.ops.tuned reads).

    {"format": "moe_gemm.tuned-table/1", "device": "NVIDIA H100 80GB HBM3", "sm_count": 132,
     "created": "2026-11-25", "versions": {...}, "ceilings": {"mm_flops_per_s",
     "copy_bytes_per_s"},
     "entries": [{"form", "dtype", "out_dtype", "E", "N", "K", "bucket", "rows",
                  "config": {GemmConfig fields}, "us", "rules_us", "name", ...}],
     "samples": [{"form", ..., "rows", "config", "us"}]}   every timed candidate (the
                                                           lookup's neighbours step reads them)

A table is rewritten whole, atomically (a temporary file renamed into place), after every
shape, so a run stopped at any point leaves a valid table of what finished.

This module also writes every other JSON result: the benchmarks' records and `moe-gemm tune
--report` (`write_json`). All JSON text is made here (`json_line`, `dumps_by_line`), strict:
a non-finite number is written as null, never as the bare words NaN or Infinity.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from moe_gemm.ops import tuned


def new_table(device: str, nsm: int, versions: dict[str, Any],
              ceilings: dict[str, float]) -> dict[str, Any]:
    return {"format": tuned.FORMAT, "device": device, "sm_count": nsm,
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "versions": versions, "ceilings": ceilings, "entries": [], "samples": []}


def load_existing(path: Path, device: str) -> tuple[dict[str, Any] | None, str | None]:
    """A table at `path` to add to: (doc, None), or (None, why it cannot be reused)."""
    try:
        return read_table(path, device), None
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:  # TableError is a ValueError
        return None, f"{path} is not a table for this device ({exc})"


def read_table(path: Path, device: str | None = None,
               warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """A valid table from `path` (of `device` when given): OSError or ValueError (naming the
    file and what is wrong) otherwise. What the reader would skip (an entry or sample that
    does not parse, "samples" or "failures" that is not a list) is left out, and `warn` told,
    so that merging and sorting the table never meets it."""
    try:
        # (bytes, as the library's reader takes them: json detects a BOM or UTF-16 there, and
        # a table the lookup uses must not be refused here)
        doc = json.loads(tuned.read_table_bytes(path))
    except RecursionError:  # nested past the parser's depth: no table is
        raise ValueError(f"{path} is not a tuned table (nested too deeply)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        # (the decoder's message alone, "Expecting value: line 1 column 1 (char 0)", was what
        # `moe-gemm tune --merge` or `--rerank` said of a file that is no JSON at all)
        raise ValueError(f"{path} is not a tuned table (not JSON: {exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("device"), str):
        raise ValueError(f"{path} is not a tuned table (no device name)")
    _check_header(doc, str(path), device or doc["device"])
    dropped = []
    entries = [e for e in doc["entries"] if _valid_entry(e)]
    if len(entries) < len(doc["entries"]):
        dropped.append(f"{len(doc['entries']) - len(entries)} unreadable entries")
    doc["entries"] = entries
    for name, valid in (("samples", _valid_sample), ("failures", lambda f: True)):
        raw = doc.get(name, [])
        if not isinstance(raw, list):
            dropped.append(f'"{name}" (not a list)')
            raw = []
        kept = [x for x in raw if valid(x)]
        if len(kept) < len(raw):
            dropped.append(f"{len(raw) - len(kept)} unreadable {name}")
        doc[name] = kept
    if dropped and warn is not None:
        warn(f"{path}: left out {', '.join(dropped)}")
    return doc


def _check_header(doc: dict[str, Any], path: str, device: str) -> None:
    """The reader's checks of the table as a whole (format, device, a list of entries): a
    TableError (a ValueError) when one fails. The entries and samples are checked one by one
    by the caller, which leaves out those that do not parse."""
    entries = doc.get("entries")
    tuned.parse_table({**doc, "entries": [] if isinstance(entries, list) else entries,
                       "samples": []}, path, device)


def merge_into(doc: dict[str, Any], other: dict[str, Any]) -> int:
    """Add `other`'s valid entries, samples and failures into `doc` (other wins on equal
    keys); returns how many entries were added (an entry the reader would skip is left out)."""
    # A "samples" or "failures" that is not a list holds nothing usable (the reader's view).
    samples, failures = (x if isinstance(x, list) else []
                         for x in (other.get("samples"), other.get("failures")))
    add_result(doc, None, [s for s in samples if _valid_sample(s)])
    added = 0
    for e in other["entries"]:
        if not _valid_entry(e):
            continue
        add_result(doc, e, [])
        added += 1
    doc.setdefault("failures", [])
    seen = {_failure_key(f) for f in doc["failures"]}
    doc["failures"] += [f for f in failures if _failure_key(f) not in seen]
    return added


def _failure_key(f: Any) -> str:
    """A failure as the written table holds it (non-finite numbers as null), for deduplication."""
    return json.dumps(finite(f), sort_keys=True, allow_nan=False)


def _valid_entry(e: Any) -> bool:
    """Whether the reader (moe_gemm.ops.tuned.parse_table) would use entry `e`."""
    try:
        tuned.entry_fields(e, tuned.key_of(e))
    # OverflowError: a number JSON allows but no int holds (Infinity, 1e400).
    except (tuned.TableError, AttributeError, TypeError, OverflowError):
        return False
    return True


def _valid_sample(s: Any) -> bool:
    try:
        return len(tuned.parse_samples([s])) == 1  # (it leaves out what it cannot read)
    except OverflowError:  # as in _valid_entry
        return False


def key_tuple(k: tuned.Key) -> tuple:
    """A key as a plain sortable tuple (what entry_key gives an entry)."""
    return (k.form, k.dtype, k.out_dtype, k.E, k.N, k.K, k.bucket)


def entry_key(e: dict) -> tuple:
    """An entry's key as the reader reads it: "E": "8" and "E": 8 are one key, and the keys
    of a table sort (write() sorts them) whatever types its JSON spelled them in."""
    return key_tuple(tuned.key_of(e))


def find_entry(doc: dict[str, Any], key: tuple) -> dict | None:
    """The entry of `doc` for a key_tuple, or None."""
    return next((e for e in doc.get("entries", []) if entry_key(e) == key), None)


def explicit_fields(config: dict) -> dict:
    """An entry's or sample's config with every tuned field the tuner names explicit (a table
    leaves out what is unset)."""
    return {"stages": None, **config}


def sample_shape(s: dict) -> tuple:
    return (str(s["form"]), str(s["dtype"]), str(s.get("out_dtype", s["dtype"])), int(s["E"]),
            int(s["N"]), int(s["K"]), int(s["rows"]))


def add_result(doc: dict[str, Any], entry: dict | None, samples: list[dict]) -> None:
    """Put one shape's entry (replacing one for the same key) and samples (replacing those of
    the same shape) into the table."""
    if entry is not None:
        key = entry_key(entry)
        doc["entries"] = [e for e in doc["entries"] if entry_key(e) != key] + [entry]
    if samples:
        shapes = {sample_shape(s) for s in samples}
        doc["samples"] = [s for s in doc["samples"] if sample_shape(s) not in shapes] + samples


def finite(v: Any) -> Any:
    """`v` with every non-finite float (NaN, inf) replaced by None, in nested dicts and lists.
    json.dumps writes them as the bare words NaN and Infinity, which are not JSON: jq,
    JavaScript and other strict readers refuse the whole file (a wrong result's rel_err is NaN
    by design, the check of an unwritten output)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


def json_line(v: Any, default: Callable[[Any], Any] | None = None) -> str:
    """`v` as one line of strict JSON (`finite`: NaN and inf as null), written compactly."""
    return json.dumps(finite(v), separators=(",", ":"), default=default, allow_nan=False)


def dumps_by_line(doc: dict[str, Any] | list[Any],
                  default: Callable[[Any], Any] | None = None) -> str:
    """Strict JSON text of `doc` (see `json_line`) with one top-level key per line and, in a
    list (or a top-level list), one item per line, each written compactly. A table's ~13k
    samples indented one field per line took 5.4 MB (a third of the repository), compact
    lines 3.9 MB, and a retune's diff stays one line per changed sample."""
    def one(v: Any) -> str:
        return json_line(v, default)

    def items(v: list[Any]) -> str:
        return ",\n".join(one(x) for x in v)

    if isinstance(doc, list):
        return f"[\n{items(doc)}\n]\n" if doc else "[]\n"
    lines = []
    for k, v in doc.items():
        if isinstance(v, list) and v:
            lines.append(f"{one(k)}:[\n{items(v)}\n]")
        else:
            lines.append(f"{one(k)}:{one(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_json(path: Path, doc: dict[str, Any] | list[Any], compact: bool = False) -> None:
    """Write a result or report: strict JSON (see `json_line`; `doc` itself is left as it is),
    atomically (a crash mid-write never leaves half a file), one top-level key and one list
    item per line (`dumps_by_line`), or all on one line for progress saves. A value JSON has
    no type for is written as its str()."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json_line(doc, default=str) + "\n" if compact
                      else dumps_by_line(doc, default=str))


def write(path: Path, doc: dict[str, Any]) -> None:
    """Atomic write: a reader (or a crash) never sees half a table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc["entries"].sort(key=entry_key)
    doc.pop("model", None)  # the cost-model block earlier tables carried: no reader left
    write_text_atomic(path, dumps_by_line(doc))


def write_text_atomic(path: Path, text: str) -> None:
    """`text` into `path` through a temporary file beside it and a rename, so that a reader
    (or a crash) never sees half a file; the temporary file goes on any failure (a full disk,
    a file size limit, a folder in the way or Ctrl-C mid-write left it behind, megabytes per
    failed write)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
