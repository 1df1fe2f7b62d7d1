"""benchmarks.env_ab on the CPU: its arguments, the switch held around each call, which cases
a switch changes, and its ratios (the timing itself needs a Hopper GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import env_ab
from benchmarks.suite import Prepared

SWITCH = "MOE_GEMM_TRIM_A"


@pytest.mark.parametrize("argv,message", [
    (["--switch", "MOE_GEMM_NOPE"], "not one of the library's variables"),
    (["--switch", SWITCH, "--values", "1"], "two or more distinct values"),
    (["--switch", SWITCH, "--values", "1,1"], "two or more distinct values"),
    (["--switch", SWITCH, "--configs", "pp 999x1"], "999x1"),
    (["--switch", SWITCH, "--projs", "up"], "--projs takes gate_up"),
    (["--switch", SWITCH, "--cases", "Nope/down/16"], "Nope"),
    (["--fp8", "--switch", SWITCH, "--configs", "pp 128x128"], "not taken with --fp8"),
    (["--fp8", "--switch", SWITCH, "--cases", "Mixtral-8x7B/down/16"],
     "no FP8 checkpoint is published for Mixtral-8x7B"),
    (["--fp8", "--switch", SWITCH, "--models", "OLMoE-1B-7B"], "no FP8 checkpoint"),
])
def test_bad_arguments_exit_2_with_the_reason(capsys, argv, message):
    assert env_ab.main(argv + ["--device", "cpu"]) == 2
    assert message in capsys.readouterr().err


def test_needs_a_gpu(capsys):
    assert env_ab.main(["--switch", SWITCH, "--cases", "OLMoE-1B-7B/down/16",
                        "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_switch_holds_during_setup_and_each_call_and_is_restored(monkeypatch):
    monkeypatch.setenv(SWITCH, "keep")
    seen = []

    def build(spec, inp, device):
        seen.append(("build", os.environ.get(SWITCH)))
        return Prepared(lambda: seen.append(("run", os.environ.get(SWITCH))),
                        lambda: seen.append(("check", os.environ.get(SWITCH))))

    prepared = env_ab.with_switch(build, SWITCH, "1")(None, None, torch.device("cpu"))
    prepared.run()
    prepared.check()
    assert seen == [("build", "1"), ("run", "1"), ("check", "1")]
    assert os.environ[SWITCH] == "keep"


def test_a_case_the_switch_does_not_change_is_told_apart(monkeypatch):
    monkeypatch.setenv("MOE_GEMM_TUNED_TABLES", "1")  # the shipped H200 table's picks
    monkeypatch.setattr("moe_gemm.capability.device_name", lambda d: "NVIDIA H200")
    monkeypatch.setattr("moe_gemm.capability.sm_count", lambda d: 132)
    dev = torch.device("cpu")
    # Kimi-K2 gate/up at 8192 tokens: a cooperative 128x256 pick in a 1x2 cluster, which trims
    # where the switch lets it.
    case = {"E": 384, "N": 4096, "K": 7168, "rows": 65536, "layout": "ENK"}
    keys = {env_ab.launched_key(case, dev, SWITCH, v) for v in ("0", "1")}
    assert len(keys) == 2 and {k.trim_a for k in keys} == {False, True}
    # The same with the tail split off: MOE_GEMM_TAIL_SPLIT=0 changes only a cooperative
    # 1x1 pick's tail split; Qwen3-30B-A3B gate/up at 2048 tokens (a ping-pong 1x2 pick)
    # keeps its kernel.
    case = {"E": 128, "N": 1536, "K": 2048, "rows": 16384, "layout": "ENK"}
    keys = {env_ab.launched_key(case, dev, "MOE_GEMM_TAIL_SPLIT", v) for v in ("0", "1")}
    assert len(keys) == 1 and next(iter(keys)).cluster_n == 2


def test_ratios_against_the_first_value_and_the_summary():
    rows = [{"impl": f"moe_gemm {label} {SWITCH}={v}", "ms": ms}
            for label, v, ms in [("default", "0", 2.0), ("default", "1", 1.6),
                                 ("pp 128x128", "0", 1.0), ("pp 128x128", "1", None)]]
    lines = env_ab.add_ratios(rows, SWITCH, ["0", "1"])
    assert len(lines) == 4
    assert rows[1]["vs_first"] == pytest.approx(1.25) and rows[0]["vs_first"] == 1.0
    assert "vs_first" not in rows[3] and rows[3]["config_label"] == "pp 128x128"
    assert rows[1]["switch_value"] == "1"
    summary = env_ab.summary(rows, ["0", "1"])
    assert summary == ["default =1: vs =0 over 1 cases: median 1.250, min 1.250, max 1.250; "
                       ">1% faster on 1, >1% slower on 0"]


def test_fp8_cases_rows_and_the_kernels_a_switch_changes():
    """--fp8: the FP8 zoo's cases (--models all: the models with FP8 checkpoints), our
    block-scaled and row-wise defaults at each value, and a switch told apart by the FP8
    kernels it changes (the empty-half skip: cooperative prefill tiles, not decode's
    ping-pong ones)."""
    from benchmarks.ab_cases import add_case_options, cases_from_args
    from benchmarks.zoo import FP8_MODELS

    p = env_ab.argparse.ArgumentParser()
    add_case_options(p)
    p.add_argument("--seed", type=int, default=1234)
    cases = cases_from_args(p.parse_args(["--tokens", "16"]), fp8=True)
    assert {f["model"] for _, f in cases} == set(FP8_MODELS)
    assert all(spec.dtype == "fp8" and spec.name.endswith("/fp8") for spec, _ in cases)
    impls = env_ab.implementations([], "MOE_GEMM_FP8_HALF_SKIP", ["0", "1"], fp8=True)
    assert [i.name for i in impls] == [f"moe_gemm fp8-{g} MOE_GEMM_FP8_HALF_SKIP={v}"
                                      for g in ("block", "row") for v in ("0", "1")]
    assert all(i.dtype == "fp8" and not i.peer for i in impls)
    dev = torch.device("cpu")
    prefill = {"E": 8, "N": 4096, "K": 7168, "rows": 8192}
    keys = {env_ab.launched_key(prefill, dev, "MOE_GEMM_FP8_HALF_SKIP", v, fp8=True)
            for v in ("0", "1")}
    assert len(keys) == 2
    assert {tuple(k.skip_empty_half for k in ks) for ks in keys} == {(False, False),
                                                                     (True, True)}
    decode = {"E": 256, "N": 512, "K": 7168, "rows": 128}
    keys = {env_ab.launched_key(decode, dev, "MOE_GEMM_FP8_HALF_SKIP", v, fp8=True)
            for v in ("0", "1")}
    assert len(keys) == 1
