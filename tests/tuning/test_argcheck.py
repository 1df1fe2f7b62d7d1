"""moe_gemm.tuning.argcheck: the output-path check the tools run before their work (CPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from moe_gemm.tuning.argcheck import output_problem


def test_a_writable_path_passes_and_leaves_nothing_behind(tmp_path: Path) -> None:
    assert output_problem(tmp_path / "new" / "deeper" / "t.json") is None
    assert output_problem(tmp_path / "t.json") is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc")
def test_a_folder_where_no_file_can_be_made_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # For root, os.access says /proc is writable: `moe-gemm bench --out /proc/b.json` ran the
    # whole suite, then died in a traceback writing its JSON. Here os.access answers as it
    # does for root, whoever runs the test.
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)
    for option, name in (("--out", "b.json"), ("--png", "b.png")):
        why = output_problem(Path("/proc") / name, option)
        assert why is not None and why.startswith(f"{option} /proc/{name}: cannot create a file")


def test_loads_json_makes_every_parse_failure_a_value_error() -> None:
    from moe_gemm.tuning.argcheck import loads_json

    assert loads_json(b'{"a": [1, 2]}') == {"a": [1, 2]}
    for bad, words in (("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                       ("{", "Expecting"), (b"\xff\xfe\x00", None)):
        with pytest.raises(ValueError, match=words):
            loads_json(bad)


def test_choice_switches_set_names_each_switch_the_tuner_would_time_under(monkeypatch):
    from moe_gemm.tuning.argcheck import choice_switches_set

    for name in ("MOE_GEMM_L2_HINTS", "MOE_GEMM_PACKED_PAIRS", "MOE_GEMM_PEEK_WAIT",
                 "MOE_GEMM_SPLIT_WAYS", "MOE_GEMM_TAIL_SPLIT", "MOE_GEMM_TRIM_A",
                 "MOE_GEMM_SWAP_AB"):
        monkeypatch.delenv(name, raising=False)
    assert choice_switches_set() is None
    monkeypatch.setenv("MOE_GEMM_PACKED_PAIRS", "1")
    line = choice_switches_set()
    assert "MOE_GEMM_PACKED_PAIRS=1 set" in line and "without it" in line
    monkeypatch.setenv("MOE_GEMM_TRIM_A", "0")
    monkeypatch.setenv("MOE_GEMM_SWAP_AB", " ")  # blank: unset
    line = choice_switches_set()
    assert "MOE_GEMM_PACKED_PAIRS=1, MOE_GEMM_TRIM_A=0 set" in line and "without them" in line
