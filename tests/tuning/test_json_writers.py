"""Strict JSON for every result, report and table (moe_gemm.tuning.table_io's writers): a
non-finite number is written as null, never as the bare words NaN or Infinity that jq,
JavaScript and other strict readers refuse along with the whole file."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

from moe_gemm.tuning import table_io

REPO = Path(__file__).resolve().parents[2]
# Where results and reports are written: the benchmarks, the tuner, the scripts (probes, audits,
# the GPU session and chaos reports) and the GPU tests' report plugin.
SCANNED = ("benchmarks", "moe_gemm/tuning", "scripts", "tests/kernels/gpu_report.py")
WRITER = Path("moe_gemm/tuning/table_io.py")
# Runs where moe_gemm may not import (no torch: `gpu_session.py --merge` needs no GPU), so it
# cannot use the writer: its own calls must pass allow_nan=False.
WITHOUT_MOE_GEMM = {Path("scripts/gpu_session.py")}


def _no_constant(word: str):
    raise ValueError(f"not JSON: {word}")


def _strict_load(text: str):
    return json.loads(text, parse_constant=_no_constant)


def _json_text_calls(path: Path) -> list[tuple[int, str, bool]]:
    """(line, call, whether it passes allow_nan=False) for each json.dump / json.dumps call
    of a module, and each dump / dumps imported from json (which would hide such calls)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "json":
            found += [(node.lineno, f"from json import {a.name}", False) for a in node.names
                      if a.name in ("dump", "dumps")]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "json"
              and node.func.attr in ("dump", "dumps")):
            strict = any(k.arg == "allow_nan" and isinstance(k.value, ast.Constant)
                         and k.value.value is False for k in node.keywords)
            found.append((node.lineno, f"json.{node.func.attr}", strict))
    return found


def _scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = REPO / name
        assert path.exists(), f"{name} was moved: scan it where it is now"
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def test_json_text_is_made_only_by_the_strict_writer():
    # fused_configs, dram_traffic, bench_server, `moe-gemm tune --report`, the scripts' --out
    # and --json files and the GPU report plugin wrote json.dump(s) output of their own, NaN
    # and all. Results go through table_io.write_json (printed records through json_line);
    # only table_io calls json.dumps, always with allow_nan=False.
    bad, own = [], 0
    for path in _scanned_files():
        rel = path.relative_to(REPO)
        for line, call, strict in _json_text_calls(path):
            if rel == WRITER and call == "json.dumps" and strict:
                own += 1
            elif not (rel in WITHOUT_MOE_GEMM and call.startswith("json.") and strict):
                bad.append(f"{rel}:{line}: {call}")
    assert not bad, ("JSON written outside moe_gemm.tuning.table_io (use write_json, or "
                     "json_line for a printed record): " + ", ".join(bad))
    assert own >= 2  # the scan sees the writer's own calls: it is not looking at nothing


@pytest.mark.parametrize("compact", [False, True])
def test_a_report_list_is_written_strictly(tmp_path: Path, compact: bool) -> None:
    # `moe-gemm tune --report` writes a list of timings; an untimed config's "us" may be NaN.
    report = [{"name": "coop 128x256", "us": float("nan"), "error": None},
              {"name": "pp 128x192", "us": 12.5, "ratio": float("inf")}]
    out = tmp_path / "deep" / "report.json"
    table_io.write_json(out, report, compact=compact)
    assert _strict_load(out.read_text()) == [
        {"name": "coop 128x256", "us": None, "error": None},
        {"name": "pp 128x192", "us": 12.5, "ratio": None}]
    assert math.isnan(report[0]["us"])  # the caller's document is left as it is
    table_io.write_json(out, [])
    assert _strict_load(out.read_text()) == []


def test_tables_and_printed_records_are_strict(tmp_path: Path) -> None:
    doc = table_io.new_table("dev", 132, {}, {"mm_flops_per_s": float("inf")})
    doc["failures"] = [{"shape": "s", "us": float("nan")}]
    path = tmp_path / "t.json"
    table_io.write(path, doc)
    back = _strict_load(path.read_text())
    assert back["ceilings"] == {"mm_flops_per_s": None}
    # A failure read back (null) is the one already held (NaN): merged once, not twice.
    assert table_io.merge_into(doc, {**back, "entries": []}) == 0
    assert len(doc["failures"]) == 1
    assert _strict_load(table_io.json_line({"x": [1.0, -math.inf]})) == {"x": [1.0, None]}
