"""benchmarks.shape_list: the shape-list benchmarks' command line, header and loop (no GPU)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks import shape_list


def _shapes(*names):
    return [SimpleNamespace(name=n) for n in names]


def test_pick_shapes_smoke_and_only():
    full, smoke = _shapes("a", "b", "c"), _shapes("s")
    args = shape_list.parser(None, reps=3, budget_s=10.0).parse_args(["--out", "x.json"])
    assert [s.name for s in shape_list.pick_shapes(args, full, smoke)] == ["a", "b", "c"]
    args = shape_list.parser(None, 3, 10.0).parse_args(["--out", "x", "--only", "c,a"])
    assert [s.name for s in shape_list.pick_shapes(args, full, smoke)] == ["a", "c"]
    args = shape_list.parser(None, 3, 10.0).parse_args(["--out", "x", "--smoke"])
    assert [s.name for s in shape_list.pick_shapes(args, full, smoke)] == ["s"]
    assert (args.reps, args.budget_s) == (3, 10.0)


def test_header_names_the_run():
    doc = shape_list.header("fp8", torch.device("cpu"))
    assert doc["suite"] == "fp8" and doc["device"] == "cpu" and doc["shapes"] == []
    assert len(doc["date"]) == 10 and doc["method"] == shape_list.METHOD


def test_run_shapes_keeps_going_and_saves(tmp_path):
    out = tmp_path / "r.json"
    doc = shape_list.header("t", torch.device("cpu"))
    seen = []

    def run_one(shape):
        if shape.name == "bad":
            raise RuntimeError("boom")
        return {"name": shape.name, "us": 1.0}

    shape_list.run_shapes(doc, out, _shapes("ok", "bad", "ok2"), time.monotonic(), 60.0,
                          run_one, on_row=seen.append)
    rows = json.loads(out.read_text())["shapes"]
    assert [r["name"] for r in rows] == ["ok", "bad", "ok2"]
    assert "boom" in rows[1]["error"] and rows[2]["us"] == 1.0
    assert [r["name"] for r in seen] == ["ok", "bad", "ok2"]
    assert "seconds" in doc


@pytest.mark.parametrize("budget_s", [-1.0])
def test_run_shapes_skips_past_the_budget(tmp_path, budget_s):
    doc = shape_list.header("t", torch.device("cpu"))
    shape_list.run_shapes(doc, tmp_path / "r.json", _shapes("a", "b"), time.monotonic(),
                          budget_s, lambda s: pytest.fail("ran past the budget"))
    assert [r.get("skipped") for r in doc["shapes"]] == ["time budget", "time budget"]
