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


@pytest.mark.parametrize("argv, words", [
    (["--reps", "0"], "--reps must be at least 1"),
    (["--budget-s", "0"], "--budget-s must be positive"),
    (["--budget-s", "nan"], "--budget-s must be positive"),
    (["--only", "nope"], "unknown shape(s) nope; expected some of s"),
    (["--only", ","], "--only names no shape; expected some of s"),
    (["--out", "{tmp}"], "--out {tmp}: is a folder, not a file")])
@pytest.mark.parametrize("module", ["bench_fp8", "masked"])
def test_bad_arguments_are_one_line_and_exit_2_before_anything_runs(
        tmp_path, capsys, monkeypatch, module, argv, words):
    # Each of these ran and exited 0: --reps 0 recorded every shape as a StatisticsError,
    # --budget-s 0 skipped them all, an --only typo ran none, an --out folder raised
    # IsADirectoryError (a traceback) and left <out>.tmp beside it.
    import importlib

    bench = importlib.import_module(f"benchmarks.{module}")
    monkeypatch.setattr(bench, "SMOKE_SHAPES", _shapes("s"))
    monkeypatch.setattr(bench, "copy_bandwidth", lambda *a: pytest.fail("ran"), raising=False)
    argv = [a.format(tmp=tmp_path) for a in ["--smoke", "--out", str(tmp_path / "r.json"),
                                             *argv]]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {words.format(tmp=tmp_path)}\n", err
    assert list(tmp_path.iterdir()) == []


def test_the_full_shapes_without_a_gpu_are_refused(tmp_path, capsys, monkeypatch):
    # Without --smoke on a machine without a GPU the full shapes started on the CPU (hours).
    from benchmarks import masked

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert masked.main(["--out", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err == ("error: the full shapes need a CUDA GPU; use --smoke on "
                                       "the CPU\n")


def test_a_shape_that_raised_is_exit_status_1(tmp_path, capsys):
    doc = shape_list.header("t", torch.device("cpu"))

    def run_one(shape):
        if shape.name == "bad":
            raise RuntimeError("boom")
        return {"name": shape.name}

    failed = shape_list.run_shapes(doc, tmp_path / "r.json", _shapes("ok", "bad"),
                                   time.monotonic(), 60.0, run_one)
    assert failed == ["bad"] and shape_list.exit_status(failed) == 1
    assert "failed: bad" in capsys.readouterr().err
    assert shape_list.exit_status([]) == 0


def test_only_with_a_stray_comma_is_refused():
    # "a," was read as "a": a list that does not spell what it runs.
    shapes = [type("S", (), {"name": n})() for n in ("a", "b")]
    for only, words in (("a,", "an empty entry"), ("a,,b", "an empty entry"),
                        (",", "names no shape")):
        args = shape_list.parser(None, reps=3, budget_s=10.0).parse_args(
            ["--out", "x.json", "--only", only, "--smoke"])
        assert words in shape_list.arg_problem(args, shapes, shapes)
