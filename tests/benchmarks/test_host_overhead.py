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
        assert e["queued_us"] > 0 and 0 < e["single_cpu_us"] <= e["single_us"]
        assert e["launch_gap_us"] == e["single_us"] - e["queued_us"]
        assert e["gap_b2b_us"] == e["single_us"] - e["gpu_us"]
    # after the warm-ups, the rounds alternate between the live cases, each round starting
    # one case later: "c" leads some round's CPU samples
    timed = log[15:]
    assert timed[0] == "a" and "c" in timed[:40] and timed.count("a") > 3 * ROUNDS
    runs = [timed[i] for i in range(len(timed)) if i == 0 or timed[i] != timed[i - 1]]
    assert len(runs) > 2 * ROUNDS  # interleaved, not one case's samples after the other's


def test_checks_compare_with_torch_and_limits():
    out = checks({
        "moe_gemm grouped_mm 2-D": {"cpu_us": 10.0, "launch_gap_us": 30.0, "gap_b2b_us": 5.0},
        "F.grouped_mm 2-D": {"cpu_us": 12.0, "launch_gap_us": 20.0, "gap_b2b_us": 6.0},
        "moe_gemm GroupedGemmPlan call": {"cpu_us": 9.0},
    })
    assert out["grouped_mm 2-D cpu_us <= torch"]["ok"] is True
    assert out["grouped_mm 2-D launch_gap_us <= torch"]["ok"] is False
    assert out["grouped_mm 2-D gap_b2b_us <= torch"]["ok"] is True
    assert out["grouped_mm 3-D gap_b2b_us <= torch"]["ok"] is None
    assert out["GroupedGemmPlan call cpu_us <= 10"]["ok"] is True
    assert out["grouped_gemm 256 problems cpu_us <= 250"]["ok"] is None


def test_the_table_shows_each_calls_time_to_result():
    # The gap counts to a call's first kernel: the single-call time to the result stands
    # beside it, so a call that launches a small kernel early is not read as faster.
    from benchmarks.host_overhead import format_lines

    e = {"cpu_us": 14.6, "single_cpu_us": 16.0, "launch_gap_us": 26.1, "gap_b2b_us": 28.3, "queued_us": 8.9,
         "gpu_us": 6.7, "single_us": 35.0}
    lines = format_lines({"calls": {"ours": e, "bad": {"error": "RuntimeError: x"}},
                          "checks": {}})
    assert lines[0].split("|")[-1].strip() == "single us"
    assert [c.strip() for c in lines[1].split("|")][1:] == ["14.6", "16.0", "26.1", "28.3",
                                                            "8.9", "6.7", "35.0"]
    assert lines[2].endswith("error: RuntimeError: x")


def _two_gpus(monkeypatch) -> list:
    chosen: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_bad_arguments_are_one_line_before_anything_is_measured(tmp_path, capsys, monkeypatch):
    # --device foo raised RuntimeError (a traceback), --reps 0 ran as the default, an --out
    # folder raised IsADirectoryError after the measurements, cuda:5 of two GPUs raised out
    # of torch.cuda.set_device.
    import pytest

    from benchmarks import host_overhead

    monkeypatch.setattr(host_overhead, "measure_host_overhead",
                        lambda *a, **k: pytest.fail("measured"))
    for argv, words in ((["--device", "foo"], "bad --device 'foo'"),
                        (["--reps", "0"], "--reps must be at least 1"),
                        (["--out", str(tmp_path)], f"--out {tmp_path}: is a folder")):
        assert host_overhead.main(["--smoke", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {words}") and err.count("\n") == 1, err
    chosen = _two_gpus(monkeypatch)
    assert host_overhead.main(["--device", "cuda:5"]) == 2
    assert capsys.readouterr().err == "error: --device cuda:5: this machine has 2 GPU(s)\n"
    assert chosen == []


def test_bench_device_names_the_device_asked_for_without_a_gpu(monkeypatch):
    import pytest

    from benchmarks.runner import bench_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--device cuda:3: no CUDA GPU is visible here$"):
        bench_device("cuda:3", False, "the suite")


def test_bench_device_refuses_a_gpu_index_past_the_last(monkeypatch):
    import pytest

    from benchmarks.runner import bench_device

    chosen = _two_gpus(monkeypatch)
    with pytest.raises(ValueError, match="--device cuda:2: this machine has 2 GPU"):
        bench_device("cuda:2", False, "the suite")
    assert chosen == []
    assert bench_device("cuda:1", False, "the suite") == torch.device("cuda", 1)
    assert chosen == [torch.device("cuda", 1)]


def _no_constant(word: str) -> None:
    raise AssertionError(f"{word} in a results file: not JSON")


def test_a_non_finite_number_is_written_as_null(tmp_path, monkeypatch, capsys):
    # json.dumps wrote NaN and Infinity as bare words, and strict readers refused the file.
    import json
    import math

    from benchmarks import host_overhead

    real = host_overhead.measure_host_overhead

    def with_nan(*args, **kwargs):
        result = real(*args, **kwargs)
        calls = result["calls"][host_overhead.OURS_MM2]
        calls["launch_gap_us"], calls["gpu_us"] = math.nan, math.inf
        return result

    monkeypatch.setattr(host_overhead, "measure_host_overhead", with_nan)
    out = tmp_path / "ho.json"
    assert host_overhead.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text(), parse_constant=_no_constant)
    ours = doc["calls"][host_overhead.OURS_MM2]
    assert ours["launch_gap_us"] is None and ours["gpu_us"] is None and ours["cpu_us"] > 0


def test_the_case_names_are_the_cases_built():
    # --skip-impl is checked against CASE_NAMES: a case missing there could not be skipped.
    from benchmarks import host_overhead

    cases, _ = host_overhead.build_cases(torch.device("cpu"), smoke=True)
    assert set(cases) <= set(host_overhead.CASE_NAMES)
    assert len(host_overhead.CASE_NAMES) == len(set(host_overhead.CASE_NAMES))
