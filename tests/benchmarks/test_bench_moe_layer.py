"""benchmarks/bench_moe_layer.py on the CPU: the smoke run end to end (JSON fields, impl names,
the implementations agreeing), and the kernel variants it precompiles for the real shapes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks import bench_moe_layer as bml

pytest.importorskip("transformers")


def test_smoke_run_writes_the_json(tmp_path):
    out = tmp_path / "moe-layer.json"
    rc = bml.main(["--smoke", "--models", "mixtral-8x7b,gpt-oss-120b,deepseek-v3-ep8",
                   "--tokens", "1,3", "--rounds", "2", "--target-ms", "1", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["suite"] == "moe-layer" and data["device"] == "cpu" and data["date"]
    impls = {r["impl"] for r in data["rows"]}
    assert impls == {bml.FUSED, bml.UNFUSED, bml.HF, bml.FUSED_ROUTED}
    assert any("fused" in i and "unfused" not in i for i in impls) and bml.UNFUSED in impls
    assert len(data["rows"]) == 3 * 2 * 3 + 2  # DeepSeek-V3's routed-only row at both T
    assert {r["model"] for r in data["rows"] if r["impl"] == bml.FUSED_ROUTED} == {
        "deepseek-v3-ep8"}
    for row in data["rows"]:
        assert row["ms"] > 0 and row["mode"] == "eager" and row["tflops"] >= 0
        paired = row["speedup_vs_unfused_rounds"]
        assert paired["p10"] <= paired["median"] <= paired["p90"]
        if row["impl"] == bml.UNFUSED:  # (against itself, round by round: exactly 1)
            assert paired == {"median": 1.0, "p10": 1.0, "p90": 1.0}
    for model, diffs in data["accuracy"].items():
        assert set(diffs) == {bml.FUSED, bml.HF}
        assert all(d < 1e-6 for d in diffs.values()), (model, diffs)


def test_smoke_combine_torch_row_and_profile(tmp_path):
    out = tmp_path / "moe-layer.json"
    rc = bml.main(["--smoke", "--models", "qwen3-30b-a3b", "--tokens", "4", "--rounds", "2",
                   "--target-ms", "1", "--combine-torch", "--router-torch", "--gather-wide",
                   "--ieee-gate", "--no-swap", "--profile", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert {r["impl"] for r in data["rows"]} == {bml.FUSED, bml.UNFUSED, bml.HF,
                                                 bml.FUSED_COMBINE, bml.FUSED_ROUTER,
                                                 bml.FUSED_WIDE, bml.FUSED_IEEE_GATE,
                                                 bml.FUSED_NOSWAP}
    # (on the CPU the switch changes nothing: the same layer, the same result)
    assert data["accuracy"]["qwen3-30b-a3b"][bml.FUSED_COMBINE] < 1e-6
    assert data["accuracy"]["qwen3-30b-a3b"][bml.FUSED_ROUTER] < 1e-6
    assert data["order_seed"] == 0
    prof = data["profile"]["qwen3-30b-a3b"]["4"]
    assert set(prof) == {bml.FUSED, bml.UNFUSED, bml.HF, bml.FUSED_COMBINE, bml.FUSED_ROUTER,
                         bml.FUSED_WIDE, bml.FUSED_IEEE_GATE, bml.FUSED_NOSWAP}
    for spent in prof.values():
        kernels = spent["top"]
        assert spent["mode"] == "eager"  # (--smoke times eagerly: no graph to replay)
        assert 0 < len(kernels) <= bml.PROFILE_TOP
        assert all(k["ms"] > 0 and k["launches"] > 0 and k["kernel"] for k in kernels)
        assert [k["ms"] for k in kernels] == sorted((k["ms"] for k in kernels), reverse=True)
        # the total covers every op, the top ones and the rest
        assert spent["kernel_ms"] >= sum(k["ms"] for k in kernels) - 1e-3


def test_with_env_sets_the_variables_for_the_call_only(monkeypatch):
    monkeypatch.delenv("MOE_GEMM_COMBINE", raising=False)
    monkeypatch.delenv("MOE_GEMM_GATHER_FENCE", raising=False)
    seen = []
    fn = bml.with_env(lambda x: seen.append((os.environ.get("MOE_GEMM_COMBINE"),
                                             os.environ.get("MOE_GEMM_GATHER_FENCE"))),
                      {"MOE_GEMM_COMBINE": "torch", "MOE_GEMM_GATHER_FENCE": "0"})
    fn(None)
    assert seen == [("torch", "0")] and "MOE_GEMM_COMBINE" not in os.environ
    assert "MOE_GEMM_GATHER_FENCE" not in os.environ
    monkeypatch.setenv("MOE_GEMM_COMBINE", "other")
    fn(None)
    assert seen[-1] == ("torch", "0") and os.environ["MOE_GEMM_COMBINE"] == "other"
    assert "MOE_GEMM_GATHER_FENCE" not in os.environ


def test_every_switched_variant_names_its_variables():
    for impl, (option, env, what) in bml.SWITCHED.items():
        assert all(name.startswith("MOE_GEMM_") for name in env), impl
        assert bool(env) == (impl != bml.FUSED_CONTROL), impl
    assert bml.SWITCHED[bml.FUSED_WIDE_NOFENCE][1] == {"MOE_GEMM_FUSED_GATHER_WIDE": "1",
                                                      "MOE_GEMM_GATHER_FENCE": "0"}


@pytest.mark.parametrize("model", list(bml.MODELS))
def test_precompiled_variants_cover_both_paths(model):
    keys = bml.kernel_keys(bml.MODELS[model], [1, 128, 16384], torch.device("cpu"))
    fused = [k for k in keys if k.fused]
    plain = [k for k in keys if not k.fused]
    assert fused and plain
    assert any(k.gather and k.gate for k in fused)  # the gate-up launch
    assert any(k.row_scale and not k.gate for k in fused)  # the down launch
    for k in fused:
        k.kernel()  # every variant is one the kernel builds (ValueError otherwise)
    if model == "gpt-oss-120b":
        assert all(k.gate_layout == "alternating" and k.bias for k in fused if k.gate)


def test_probe_falls_back_to_no_gather_then_to_no_fused_rows(monkeypatch):
    import subprocess

    answers = []

    class Done:
        def __init__(self, rc, diffs):
            self.returncode, self.stderr = rc, "boom" if rc else ""
            self.stdout = "compiling...\n" + (json.dumps(diffs) if diffs is not None else "")

    def fake_run(cmd, env, **kw):
        answer = answers.pop(0)
        if answer == "timeout":
            raise subprocess.TimeoutExpired(cmd, kw["timeout"])
        assert ("--probe" in cmd) and (env.get(bml.GATHER_ENV) == ("0" if answer[2] else None))
        return Done(answer[0], answer[1])

    monkeypatch.setattr(subprocess, "run", fake_run)
    answers[:] = [(0, {"m": 1e-6}, False)]
    assert bml.probe_in_subprocess(["m"], 5) == {"ok": True, "gather": True,
                                                 "diffs": {"m": 1e-6}, "tried": []}
    answers[:] = [(1, None, False), (0, {"m": 2e-6}, True)]
    res = bml.probe_in_subprocess(["m"], 5)
    assert res["ok"] and res["gather"] is False and res["tried"][0]["rc"] == 1
    answers[:] = [(0, {"m": 0.5}, False), "timeout"]  # wrong results, then a hang
    res = bml.probe_in_subprocess(["m"], 5)
    assert not res["ok"] and "timed out" in res["tried"][1]["error"]
    # The child writes a NaN diff (an unwritten output) as null, strict JSON: a failure too.
    answers[:] = [(0, {"m": None}, False), (0, {"m": 2e-6}, True)]
    res = bml.probe_in_subprocess(["m"], 5)
    assert res["ok"] and res["gather"] is False and res["tried"][0]["diffs"] == {"m": None}


def test_routed_only_leaves_the_shared_expert_out_and_puts_it_back():
    from moe_gemm.layers.moe import MoE

    torch.manual_seed(0)
    moe = MoE(16, 8, 4, 2, shared_intermediate_size=8, fused=False)
    x = torch.randn(5, 16)
    shared = moe.shared_experts
    routed = bml.routed_only(moe)(x)
    assert moe.shared_experts is shared
    torch.testing.assert_close(moe(x) - routed, shared(x), rtol=1e-5, atol=1e-5)
    assert (shared(x).abs() > 1e-3).any()


def test_round_order_varies_who_goes_first_and_who_goes_before_whom():
    names = ["a", "b", "c", "d"]
    orders = [bml.round_order(names, r) for r in range(12)]
    assert all(sorted(o) == names for o in orders)
    assert orders == [bml.round_order(names, r) for r in range(12)]  # seeded: repeatable
    assert {o[0] for o in orders} == set(names)
    before = {n: {o[o.index(n) - 1] for o in orders if o.index(n) > 0} for n in names}
    assert all(len(b) >= 2 for b in before.values()), before
    assert bml.round_order({"x": 1}, 3) == ["x"] and bml.round_order([], 3) == []


def test_paired_speedups_take_each_round_on_its_own():
    # Both sides drift together (the second half of the run 2x slower): the ratio of the
    # medians would mix rounds, the ratio within a round stays 1.25.
    base = [10.0, 10.0, 20.0, 20.0, 20.0]
    ms = [8.0, 8.0, 16.0, 16.0, 16.0]
    assert bml.paired_speedups(base, ms) == {"median": 1.25, "p10": 1.25, "p90": 1.25}
    spread = bml.paired_speedups([1.0] * 11, [1.0 / (0.9 + 0.02 * i) for i in range(11)])
    assert spread == {"median": 1.0, "p10": 0.92, "p90": 1.08}
    assert bml.paired_speedups([], []) == {}
    assert bml.paired_speedups([1.0], [0.0]) == {}  # (a zero time is no ratio)


def test_measure_warms_each_batch_before_timing_it():
    calls = {"a": 0, "b": 0}
    log = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def call(self):
            calls[self.name] += 1
            log.append(self.name)

    ms = bml.measure({"a": Fake("a"), "b": Fake("b")}, torch.device("cpu"), rounds=3,
                     target_ms=1e6)
    assert set(ms) == {"a", "b"}
    # one probe call, then per round a warm-up of half a batch and the batch (200 calls)
    per = 1 + 3 * (bml.warm_calls(200) + 200)
    assert calls == {"a": per, "b": per}
    assert bml.warm_calls(2) == 1 and bml.warm_calls(200) == 100


@pytest.mark.parametrize("argv, words", [
    (["--models", "mixtral"], "--models: unknown 'mixtral'; expected some of "),
    (["--models", ""], "--models: unknown ''; expected some of "),
    # (a trailing comma passed the check, then ended in a KeyError for '')
    (["--models", "qwen3-30b-a3b,"], "--models: unknown ''; expected some of "),
    (["--tokens", "4,x"], "--tokens takes comma-separated positive integers; got '4,x'"),
    (["--tokens", "0"], "--tokens takes comma-separated positive integers; got '0'"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--budget-s", "-1"], "--budget-s must be > 0; got -1.0"),
    # (nan: a traceback once the warm-up was done)
    (["--target-ms", "nan"], "--target-ms must be a positive finite number; got nan"),
    (["--sonic-budget-s", "-1"], "--sonic-budget-s must be a positive finite number"),
    (["--probe", "--models", "nosuch"], "--models: unknown 'nosuch'"),  # (was a KeyError)
    (["--out", "{tmp}"], "--out {tmp}: is a folder, not a file")])
def test_bad_arguments_are_one_line_before_the_run(tmp_path, capsys, monkeypatch, argv, words):
    # An unknown model raised KeyError, a --tokens typo ValueError, 0 tokens ran as a case, an
    # --out folder raised IsADirectoryError after the whole run (its results lost).
    monkeypatch.setattr(bml, "run", lambda args: pytest.fail("ran"))
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert bml.main(["--smoke", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_moe_layer: " + words.format(tmp=tmp_path)), err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []


def _no_constant(word: str) -> None:
    raise AssertionError(f"{word} in a results file: not JSON")


def test_a_non_finite_number_is_written_as_null(tmp_path, monkeypatch):
    # json.dumps wrote NaN and Infinity as bare words (an accuracy diff of an output with a
    # NaN in it, a ratio over a zero time), and strict readers refused the whole file.
    real = bml.run

    def with_nan(args):
        result = real(args)
        result["accuracy"]["qwen3-30b-a3b"][bml.HF] = float("nan")
        result["rows"][0]["tflops"] = float("inf")
        return result

    monkeypatch.setattr(bml, "run", with_nan)
    out = tmp_path / "moe-layer.json"
    assert bml.main(["--smoke", "--models", "qwen3-30b-a3b", "--tokens", "2", "--rounds", "1",
                     "--target-ms", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text(), parse_constant=_no_constant)
    assert data["accuracy"]["qwen3-30b-a3b"][bml.HF] is None
    assert data["rows"][0]["tflops"] is None and data["rows"][0]["ms"] > 0
