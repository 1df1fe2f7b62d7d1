"""Every benchmark's --out is checked when its arguments are read: an empty path or one that
cannot be written is one line and exit 2 before any work (it was a traceback once the run had
finished, its results lost)."""

from __future__ import annotations

import importlib
import sys

import pytest

from benchmarks.report import out_argument

# (module, how its arguments are read: main(argv) or parse_args(argv))
TOOLS = [("router_logits", "main"), ("mma_waste", "main"), ("raster_waves", "main"),
         ("choice_generalization", "main"), ("peer_rivals", "main"), ("dram_traffic", "main"),
         ("bench_moe", "parse_args"), ("bench_expert_parallel", "parse_args")]


def _bad_outs(tmp_path) -> list[tuple[str, str]]:
    blocker = tmp_path / "file"
    blocker.write_text("")
    return [(str(tmp_path), "is a folder, not a file"),
            (str(blocker / "x.json"), "is a file, not a folder"),
            ("", "is empty")]


@pytest.mark.parametrize("module,entry", TOOLS)
def test_a_bad_out_is_refused_before_any_work(module, entry, tmp_path, capsys):
    fn = getattr(importlib.import_module(f"benchmarks.{module}"), entry)
    extra = ["ZOO.json"] if module == "peer_rivals" else []
    for out, words in _bad_outs(tmp_path):
        with pytest.raises(SystemExit) as exc:
            fn([*extra, "--out", out])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --out:" in err and words in err, (module, out, err)
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]  # nothing made


def test_the_server_benchmark_checks_its_out_too(tmp_path, capsys, monkeypatch):
    import benchmarks.bench_server as bench_server

    monkeypatch.setattr(sys, "argv", ["bench_server.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        bench_server.main()
    assert exc.value.code == 2 and "is a folder, not a file" in capsys.readouterr().err


def test_a_writable_out_is_taken_as_given(tmp_path):
    path = str(tmp_path / "new" / "x.json")
    assert out_argument(path) == path and not (tmp_path / "new").exists()
