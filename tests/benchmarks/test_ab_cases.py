"""benchmarks.ab_cases: the zoo A/B scripts' case options and their summary line."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.ab_cases import add_case_options, cases_from_args, ratio_line


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_case_options(p)
    args = p.parse_args(list(argv))
    args.seed = 1234
    return args


def test_cases_by_name_or_by_models_tokens_and_projections():
    one = cases_from_args(_args("--cases", "OLMoE-1B-7B/down/16"))
    assert [f["proj"] for _, f in one] == ["down"] and one[0][1]["tokens"] == 16
    grid = cases_from_args(_args("--models", "OLMoE-1B-7B", "--tokens", "16,2048"))
    assert sorted((f["proj"], f["tokens"]) for _, f in grid) == [
        ("down", 16), ("down", 2048), ("gate_up", 16), ("gate_up", 2048)]
    with pytest.raises(ValueError, match="--projs takes gate_up"):
        cases_from_args(_args("--projs", "up"))


def test_ratio_line_counts_faster_and_slower_beyond_one_percent():
    line = ratio_line("variant 1: vs first", [1.02, 0.98, 1.005])
    assert line == ("variant 1: vs first over 3 cases: median 1.005, min 0.980, max 1.020; "
                    ">1% faster on 1, >1% slower on 1")
