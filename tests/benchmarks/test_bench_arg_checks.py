"""The benchmark tools' sizes, counts and lists are checked when their arguments are read: a
bad value is one line and exit 2 before any work (and before any GPU check, so it is said on a
machine without one), not a traceback, a run of nothing, or a silent fallback to the default.
Lists are read as benchmarks.runner.split_names reads them: stripped, an empty entry (a stray
or trailing separator) refused."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import (
    bench_expert_parallel,
    bench_moe,
    choice_generalization,
    dram_traffic,
    env_ab,
    mma_waste,
    raster_waves,
    router_logits,
    same_config,
    sustained,
)
from benchmarks.runner import (
    counts_problem,
    names_problem,
    number_problem,
    split_names,
    zoo_tokens_problem,
)
from benchmarks.zoo import parse_cases

# ---------------------------------------------------------------------------------------------
# The shared checks


def test_split_names_keeps_empty_entries_and_duplicates_for_the_checks_to_judge():
    assert split_names(" a, b ,a") == ["a", "b", "a"]
    assert split_names("a,") == ["a", ""] and split_names("") == [""]
    assert split_names("pp 128x128; coop 128x256", ";") == ["pp 128x128", "coop 128x256"]


def test_names_problem_without_known_names_refuses_only_an_empty_entry():
    assert names_problem("anything,else", None, "--impls") is None
    assert names_problem("a,", None, "--impls") == "--impls: an empty entry in 'a,' (a stray ','?)"
    assert "a stray ';'" in names_problem("x;", None, "--configs", ";")
    assert names_problem("on,", ["on", "off"], "--modes").startswith("--modes: unknown ''")


@pytest.mark.parametrize("text", ["", "4,", "0", "-1", "1k", "²", "4,,8"])
def test_counts_problem_names_the_option(text):
    # ('²' is a digit to str.isdigit that int() refuses: it was a ValueError traceback)
    assert counts_problem(text, "--x") == (f"--x takes comma-separated positive integers; "
                                           f"got {text!r}")


def test_zoo_tokens_take_all_or_positive_integers():
    assert zoo_tokens_problem("all") is None and zoo_tokens_problem(" 16, 2048") is None
    assert zoo_tokens_problem("16,") == ("--tokens takes comma-separated positive integers; "
                                         "got '16,'")


@pytest.mark.parametrize("value,zero,words", [
    (0, False, "a positive integer; got 0"), (-1, True, "a non-negative integer; got -1"),
    (float("nan"), False, "a positive finite number; got nan"),
    (float("inf"), True, "a non-negative finite number; got inf"),
    (-0.5, False, "a positive finite number; got -0.5")])
def test_number_problem_refuses_nan_and_inf_too(value, zero, words):
    assert number_problem(value, "--x", zero) == f"--x must be {words}"
    assert number_problem(3, "--x") is None and number_problem(0.0, "--x", zero=True) is None


def test_a_case_list_refuses_an_empty_entry():
    assert parse_cases("OLMoE-1B-7B/down/16 , GLM-4.5/gate_up/8") == [
        ("OLMoE-1B-7B", "down", 16), ("GLM-4.5", "gate_up", 8)]
    for bad in ("", ",", "OLMoE-1B-7B/down/16,"):  # (a trailing comma was dropped)
        with pytest.raises(ValueError, match="^--cases: a case is .*; got ''$"):
            parse_cases(bad)


# ---------------------------------------------------------------------------------------------
# bench_moe and bench_expert_parallel: sizes and counts


def _refused(fn, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,words", [
    (["--hidden", "0"], "--hidden must be a positive integer; got 0"),
    (["--intermediate", "-8"], "--intermediate must be a positive integer; got -8"),
    (["--experts", "0"], "--experts must be a positive integer; got 0"),
    (["--ep", "0"], "--ep must be a positive integer; got 0"),  # (a ZeroDivisionError)
    (["--topk", "0"], "--topk must be a positive integer; got 0"),
    (["--iters", "0"], "--iters must be a positive integer; got 0"),
    (["--warmup", "-1"], "--warmup must be a non-negative integer; got -1"),
    (["--tokens", "0"], "--tokens takes comma-separated positive integers; got '0'"),
    (["--tokens", "8,"], "--tokens takes comma-separated positive integers; got '8,'"),
    (["--tokens", ""], "--tokens takes comma-separated positive integers; got ''"),
    (["--hidden", "x"], "argument --hidden: invalid int value: 'x'"),
    # (was a SystemExit from run(), exit 1, once transformers had built the block)
    (["--experts", "10", "--ep", "3", "--topk", "2"], "--ep 3 must divide --experts 10"),
])
@pytest.mark.parametrize("smoke", [[], ["--smoke"]])
def test_bench_moe_refuses_bad_sizes(argv, words, smoke, capsys):
    # With --smoke too: its sizes replaced the bad ones, which then ran (a size of 0 as well);
    # now a size given beside --smoke stands (its own experts=10 is the one refused).
    assert _refused(bench_moe.parse_args, smoke + argv, capsys).endswith(f": error: {words}")


def test_bench_moe_reads_its_tokens_as_before():
    assert bench_moe.parse_args(["--tokens", "1, 8"]).tokens == [1, 8]
    assert bench_moe.parse_args([]).tokens == bench_moe.DEFAULT_TOKENS
    # (--smoke replaced the tokens given beside it: they stand, as every size does)
    assert bench_moe.parse_args(["--smoke", "--tokens", "5"]).tokens == [5]
    smoke = bench_moe.parse_args(["--smoke", "--hidden", "128", "--topk", "1"])
    assert (smoke.hidden, smoke.intermediate, smoke.topk, smoke.tokens) == (128, 32, 1, [1, 7, 33])
    with pytest.raises(SystemExit):  # (the smoke's 8 experts, its message says so)
        bench_moe.parse_args(["--smoke", "--ep", "3"])


def test_bench_expert_parallel_keeps_sizes_given_beside_smoke():
    args = bench_expert_parallel.parse_args(["--smoke", "--experts", "8", "--top-k", "2"])
    assert (args.hidden, args.experts, args.top_k, args.tokens) == (64, 8, 2, [8, 32])
    args = bench_expert_parallel.parse_args(["--smoke", "--tokens", "3", "--iters", "2"])
    assert (args.experts, args.tokens, args.iters) == (16, [3], 2)
    plain = bench_expert_parallel.parse_args([])
    assert (plain.hidden, plain.experts) == (7168, 256) and plain.preset == set()


@pytest.mark.parametrize("argv,words", [
    (["--hidden", "0"], "--hidden must be a positive integer; got 0"),
    (["--top-k", "0"], "--top-k must be a positive integer; got 0"),
    (["--world", "0"], "--world must be a positive integer; got 0"),  # (read as the default)
    (["--world", "-2"], "--world must be a positive integer; got -2"),
    (["--iters", "0"], "--iters must be a positive integer; got 0"),
    (["--shared", "-1"], "--shared must be a non-negative integer; got -1"),
    (["--warmup", "-1"], "--warmup must be a non-negative integer; got -1"),
    (["--timeout-s", "nan"], "--timeout-s must be a positive finite number; got nan"),
    (["--tokens", "0"], "--tokens takes comma-separated positive integers; got '0'"),
    (["--tokens", "8,"], "--tokens takes comma-separated positive integers; got '8,'"),
    (["--world", "3"], "--experts 16 (--smoke's) does not split evenly over 3 ranks"),
])
def test_bench_expert_parallel_refuses_bad_sizes(argv, words, capsys):
    err = _refused(bench_expert_parallel.parse_args, ["--smoke", *argv], capsys)
    assert err.endswith(f": error: {words}"), err


def test_bench_expert_parallel_checks_the_world_it_picks_before_spawning(monkeypatch, capsys):
    import torch.multiprocessing

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.multiprocessing, "start_processes",
                        lambda *a, **k: pytest.fail("spawned"))
    # (--cpu: two ranks; each raised a ValueError traceback of its own)
    err = _refused(bench_expert_parallel.main, ["--cpu", "--experts", "15", "--top-k", "2"],
                   capsys)
    assert err.endswith("error: --experts 15 does not split evenly over 2 ranks")
    err = _refused(bench_expert_parallel.parse_args, ["--world", "1", "--top-k", "300"], capsys)
    assert err.endswith("error: --top-k 300 is more than --experts 256")
    assert bench_expert_parallel.parse_args(["--tokens", "8, 24"]).tokens == [8, 24]


# ---------------------------------------------------------------------------------------------
# bench_server: its lists and durations


@pytest.mark.parametrize("argv,words", [
    (["--sizes", ""], "--sizes: unknown ''; expected some of small, large"),
    (["--sizes", "small,"], "--sizes: unknown ''; expected some of small, large"),
    (["--sizes", "huge"], "--sizes: unknown 'huge'"),  # (a KeyError)
    (["--modes", "maybe"], "--modes: unknown 'maybe'; expected some of on, off"),  # (ran 'off')
    (["--modes", ""], "--modes: unknown ''"),
    (["--concurrency", ""], "--concurrency takes comma-separated positive integers; got ''"),
    (["--concurrency", "0"], "--concurrency takes comma-separated positive integers; got '0'"),
    (["--concurrency", "1,-8"], "--concurrency takes comma-separated positive integers"),
    (["--duration", "0"], "--duration must be a positive finite number; got 0.0"),
    (["--duration", "nan"], "--duration must be a positive finite number; got nan"),
    (["--duration", "inf"], "--duration must be a positive finite number; got inf"),
    (["--warmup", "-1"], "--warmup must be a non-negative finite number; got -1.0"),
    (["--client-procs", "-1"], "--client-procs must be a non-negative integer; got -1"),
    (["--batch-delay-us", "-5"], "--batch-delay-us must be a non-negative integer; got -5"),
])
def test_bench_server_refuses_bad_arguments_before_starting_a_server(argv, words, capsys,
                                                                     monkeypatch):
    from benchmarks import bench_server

    monkeypatch.setattr(bench_server, "Server", lambda *a, **k: pytest.fail("started"))
    monkeypatch.setattr(sys, "argv", ["bench_server.py"])
    err = _refused(bench_server.main, argv, capsys)
    assert err.startswith(f"bench_server.py: error: {words}"), err


# ---------------------------------------------------------------------------------------------
# Empty values and entries: refused, naming the option, not read as the default


def _one_line(rc: int, capsys) -> str:
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


SWITCH = ["--switch", "MOE_GEMM_TRIM_A", "--device", "cpu"]
CASE = ["--cases", "OLMoE-1B-7B/down/16", "--device", "cpu"]


@pytest.mark.parametrize("main,argv,words", [
    # env_ab (and pick_ab and sustained: their case options are ab_cases')
    (env_ab.main, [*SWITCH, "--cases", ""], "--cases is empty"),  # (ran every default case)
    (env_ab.main, [*SWITCH, "--cases", "OLMoE-1B-7B/down/16,"], "--cases: a case is"),
    (env_ab.main, [*SWITCH, "--models", ""], "--models is empty"),
    (env_ab.main, [*SWITCH, "--models", ","], "--models: an empty entry in ','"),
    (env_ab.main, [*SWITCH, "--models", "OLMoE-1B-7B,"], "--models: an empty entry"),
    (env_ab.main, [*SWITCH, "--tokens", "16,"], "--tokens takes comma-separated positive"),
    (env_ab.main, [*SWITCH, "--projs", "down,"], "--projs takes gate_up and/or down"),
    (env_ab.main, [*SWITCH, "--configs", ""], "--configs is empty"),  # (the default alone)
    (env_ab.main, [*SWITCH, "--configs", "pp 128x128;"], "--configs: an empty entry"),
    (env_ab.main, [*SWITCH, "--values", "0,1,"], "--values: an empty entry in '0,1,'"),
    # sustained
    (sustained.main, [*CASE, "--impls", ""], "--impls is empty"),  # (timed the default)
    (sustained.main, [*CASE, "--impls", " , "], "--impls: an empty entry in ' , '"),
    (sustained.main, [*CASE, "--impls", "default,"], "--impls: an empty entry"),
    (sustained.main, ["--cases", "", "--device", "cpu"], "--cases is empty"),
    # dram_traffic (checked before it looks for ncu)
    (dram_traffic.main, ["--impls", ""], "--impls is empty"),  # (the default impls)
    (dram_traffic.main, ["--impls", "ours,"], "--impls: an empty entry in 'ours,'"),
    (dram_traffic.main, ["--models", ""], "--models is empty"),
    (dram_traffic.main, ["--models", "OLMoE-1B-7B,"], "--models: an empty entry"),
    (dram_traffic.main, ["--suite", "--only", ""], "--only is empty"),  # (every shape)
    (dram_traffic.main, ["--suite", "--only", "uniform,"], "--only: unknown ''; expected"),
    (dram_traffic.main, ["--suite", "--models", ""], "--models is empty"),
    (dram_traffic.main, ["--proj", ","], "--proj: unknown '', ''"),  # (ran no case, exit 0)
    (dram_traffic.main, ["--tokens", "16,"], "--tokens takes comma-separated positive"),
    (dram_traffic.main, ["--ncu", ""], "--ncu is empty"),  # (looked on PATH)
    # mma_waste and raster_waves (no GPU: they ran the default models)
    (mma_waste.main, ["--models", ""], "--models is empty"),
    (mma_waste.main, ["--models", "Mixtral-8x7B,"], "--models: an empty entry"),
    (mma_waste.main, ["--tokens", "2048,"], "--tokens takes comma-separated positive"),
    (raster_waves.main, ["--models", ""], "--models is empty"),
    (raster_waves.main, ["--configs", ""], "--configs is empty"),
    (raster_waves.main, ["--configs", ";"], "--configs: an empty entry in ';'"),  # (exit 0)
    (raster_waves.main, ["--tokens", "0"], "--tokens takes comma-separated positive"),
    # same_config (its --cases are zoo.parse_cases')
    (same_config.main, ["--configs", "pp 128x128 c1x2;", "--device", "cpu"],
     "--configs: an empty entry"),
    (same_config.main, ["--cases", "OLMoE-1B-7B/down/16,", "--device", "cpu"],
     "--cases: a case is"),
])
def test_an_empty_value_or_entry_is_refused_naming_the_option(main, argv, words, capsys,
                                                              monkeypatch):
    monkeypatch.setattr(dram_traffic, "measure", lambda *a, **k: pytest.fail("measured"))
    err = _one_line(main(argv), capsys)
    assert words in err and "needs a CUDA GPU" not in err and "ncu (Nsight" not in err, err


# ---------------------------------------------------------------------------------------------
# One check each


@pytest.mark.parametrize("argv,words", [
    (["--rounds", "0"], "--rounds must be a positive integer; got 0"),  # (StatisticsError)
    (["--calls", "-1"], "--calls must be a positive integer; got -1"),
    (["--tokens", "1024,"], "--tokens takes comma-separated positive integers; got '1024,'"),
])
def test_router_logits_refuses_bad_counts_even_with_smoke(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(router_logits, "run_shape", lambda *a, **k: pytest.fail("ran"))
    assert _one_line(router_logits.main(["--smoke", *argv]), capsys) == f"error: {words}"


@pytest.mark.parametrize("seconds", ["nan", "inf", "0", "-1"])
def test_sustained_seconds_must_be_positive_and_finite(seconds, capsys):
    # (nan passed `<= 0` and sampled nothing; inf never ended a sample)
    err = _one_line(sustained.main([*CASE, "--seconds", seconds]), capsys)
    assert err.startswith("sustained: --seconds must be a positive finite number; got ")


def test_sustained_refuses_an_implementation_named_twice(capsys):
    # (samples are gathered by name: the two rows shared, and mixed, one list)
    err = _one_line(sustained.main([*CASE, "--impls", "quack,pp 128x192 c1x2 p8ns,"
                                    "pp:128x192:c1x2:p8ns"]), capsys)
    assert err == "sustained: --impls names 'moe_gemm pp 128x192 c1x2 p8ns' more than once"


def test_dram_traffic_refuses_an_ncu_that_is_not_an_executable_file(tmp_path, capsys):
    plain = tmp_path / "ncu"
    plain.write_text("#!/bin/sh\n")  # (not executable)
    for path in (tmp_path, plain, tmp_path / "missing"):
        # (a folder passed os.path.exists: every worker then raised PermissionError)
        err = _one_line(dram_traffic.main(["--suite", "--only", "uniform", "--ncu",
                                           str(path)]), capsys)
        assert err == f"error: --ncu {path}: not an executable file"


@pytest.mark.parametrize("top", [[1, 2], 3, "text", None])
def test_choice_generalization_refuses_a_table_that_is_not_an_object(top, tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(top))  # (a top-level list was an AttributeError traceback)
    err = _one_line(choice_generalization.main(["--table", str(path)]), capsys)
    # (read as the tuner reads a table: the reader names what it lacks)
    assert err == f"error: {path}: {path} is not a tuned table (no device name)"


def test_choice_generalization_reads_every_table_before_scoring_one(tmp_path, capsys,
                                                                    monkeypatch):
    # (a bad second table was refused only after the first had been scored and printed)
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_bytes(choice_generalization.tuned.shipped_path("NVIDIA H200").read_bytes())
    bad.write_text("[]")
    monkeypatch.setattr(choice_generalization, "evaluate", lambda *a: pytest.fail("scored"))
    err = _one_line(choice_generalization.main(["--table", str(good), "--table", str(bad)]),
                    capsys)
    assert err.startswith(f"error: {bad}: ")
