"""benchmarks.host_overhead: every case measured in interleaved rounds; a failing case is
recorded and the others still measured."""

from __future__ import annotations

import torch

from benchmarks.clock import Clock
from benchmarks.host_overhead import ROUNDS, checks, measure_cases


def test_cases_are_interleaved_and_a_failing_case_drops_out():
    log: list[str] = []
    state = {"b_calls": 0}

    def case(name):
        def fn():
            log.append(name)
        return fn

    def flaky():
        state["b_calls"] += 1
        log.append("b")
        if state["b_calls"] > 8:  # fails after its warm-up, in the first round
            raise RuntimeError("boom")

    errors = []
    entries = measure_cases(Clock(torch.device("cpu")), {"a": case("a"), "b": flaky,
                                                         "c": case("c")},
                            reps=ROUNDS, iters=3 * ROUNDS, smoke=False,
                            on_error=lambda name, exc: errors.append((name, str(exc))))
    assert list(entries) == ["a", "b", "c"]
    assert entries["b"] == {"error": "RuntimeError: boom"}
    assert errors == [("b", "boom")]
    for name in ("a", "c"):
        e = entries[name]
        assert e["cpu_us"] > 0 and e["single_us"] > 0 and e["gpu_us"] > 0
        assert e["launch_gap_us"] == e["single_us"] - e["gpu_us"]
    # after the warm-ups, the rounds alternate between the live cases, each round starting
    # one case later: "c" leads some round's CPU samples
    timed = log[15:]
    assert timed[0] == "a" and "c" in timed[:40] and timed.count("a") > 3 * ROUNDS
    runs = [timed[i] for i in range(len(timed)) if i == 0 or timed[i] != timed[i - 1]]
    assert len(runs) > 2 * ROUNDS  # interleaved, not one case's samples after the other's


def test_checks_compare_with_torch_and_limits():
    out = checks({
        "moe_gemm grouped_mm 2-D": {"cpu_us": 10.0, "launch_gap_us": 30.0},
        "F.grouped_mm 2-D": {"cpu_us": 12.0, "launch_gap_us": 20.0},
        "moe_gemm GroupedGemmPlan call": {"cpu_us": 9.0},
    })
    assert out["grouped_mm 2-D cpu_us <= torch"]["ok"] is True
    assert out["grouped_mm 2-D launch_gap_us <= torch"]["ok"] is False
    assert out["GroupedGemmPlan call cpu_us <= 10"]["ok"] is True
    assert out["grouped_gemm 256 problems cpu_us <= 250"]["ok"] is None


def test_the_table_shows_each_calls_time_to_result():
    # The gap counts to a call's first kernel: the single-call time to the result stands
    # beside it, so a call that launches a small kernel early is not read as faster.
    from benchmarks.host_overhead import format_lines

    e = {"cpu_us": 14.6, "launch_gap_us": 28.3, "gpu_us": 6.7, "single_us": 35.0}
    lines = format_lines({"calls": {"ours": e, "bad": {"error": "RuntimeError: x"}},
                          "checks": {}})
    assert lines[0].split("|")[-1].strip() == "single us"
    assert [c.strip() for c in lines[1].split("|")][1:] == ["14.6", "28.3", "6.7", "35.0"]
    assert lines[2].endswith("error: RuntimeError: x")
