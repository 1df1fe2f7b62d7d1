"""benchmarks.same_config on the CPU: its arguments and the config QuACK is given (the timing
itself needs a Hopper GPU and QuACK)."""

from __future__ import annotations

import pytest

from benchmarks import same_config


def test_cases_parse_and_bad_ones_are_named():
    assert same_config.parse_cases("OLMoE-1B-7B/down/8192, GLM-4.5/gate_up/2048") == [
        ("OLMoE-1B-7B", "down", 8192), ("GLM-4.5", "gate_up", 2048)]
    for bad in ("OLMoE-1B-7B/up/8192", "OLMoE-1B-7B/down", "OLMoE-1B-7B/down/many", ""):
        with pytest.raises(ValueError, match="MODEL/gate_up|down/TOKENS"):
            same_config.parse_cases(bad)


def test_configs_map_to_the_same_quack_tile_schedule_and_cluster():
    pp, coop = same_config.parse_configs("pp 128x192 c2x1; coop 256x128 c1x2")
    assert same_config.quack_config(pp) == {
        "tile_m": 128, "tile_n": 192, "pingpong": True, "cluster_m": 2, "cluster_n": 1,
        "device_capacity": 9, "is_dynamic_persistent": False, "max_swizzle_size": 8}
    q = same_config.quack_config(coop)
    assert (q["tile_m"], q["tile_n"], q["pingpong"], q["cluster_m"], q["cluster_n"]) == (
        256, 128, False, 1, 2)
    with pytest.raises(ValueError):
        same_config.parse_configs("pp 100x100")
    with pytest.raises(ValueError, match="--configs: an empty entry"):
        same_config.parse_configs(" ; ")


def test_ours_takes_quacks_tile_order_unless_the_name_pins_one():
    # QuACK's varlen order: bands of 8 n-tiles, N fastest, serpentine = our raster p8ns.
    (plain,) = same_config.parse_configs("pp 128x192 c1x2")
    assert (plain["raster_panel"], plain.get("raster_along"), plain.get("raster_serpentine")) == (
        8, "n", True)
    (pinned,) = same_config.parse_configs("pp:128x192:c1x2:p16")
    assert pinned["raster_panel"] == 16 and pinned.get("raster_along", "m") == "m"
    (along_m,) = same_config.parse_configs("pp 128x192 c1x2 p8")
    assert not along_m.get("raster_serpentine") and along_m.get("raster_along", "m") == "m"


def test_the_defaults_are_valid_and_a_cpu_run_says_what_it_needs(capsys):
    assert len(same_config.parse_cases(",".join(same_config.DEFAULT_CASES))) == 4
    assert len(same_config.parse_configs(";".join(same_config.DEFAULT_CONFIGS))) == 5
    assert same_config.main(["--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert same_config.main(["--cases", "X/sideways/1"]) == 2
    assert same_config.main(["--reps", "0"]) == 2


def test_each_config_runs_ours_and_quack_through_the_zoo_harness_on_cpu():
    """On the CPU both sides are not applicable (Hopper kernels), and say so in their rows."""
    import torch

    from benchmarks.clock import Clock
    from benchmarks.runner import Run, run_shape
    from benchmarks.zoo import build_cases

    configs = same_config.parse_configs("pp 128x128 c1x2; coop 256x128 c2x1")
    impls = same_config.implementations(configs)
    assert [i.name for i in impls] == ["moe_gemm pp 128x128 c1x2 p8ns",
                                       "QuACK pp 128x128 c1x2 p8ns",
                                       "moe_gemm coop 256x128 c2x1 p8ns",
                                       "QuACK coop 256x128 c2x1 p8ns"]
    assert [i.peer for i in impls] == [False, True, False, True]
    spec, _ = build_cases("OLMoE-1B-7B", "16", ["down"], 1234, smoke=True)[0]
    cpu = torch.device("cpu")
    run = Run(device=cpu, clock=Clock(cpu), reps=1, seed=1234, smoke=True, variants=False,
              skip=frozenset(), doc={"shapes": {}, "results": []}, out_path=None)
    run_shape(run, spec, impls)
    rows = run.doc["results"]
    assert [r["impl"] for r in rows] == [i.name for i in impls]
    assert all(r["status"] == "n/a" for r in rows)
    assert "Hopper kernels" in rows[0]["reason"] and "QuACK" in rows[1]["reason"]


def test_ratios_are_quack_over_ours_per_config():
    rows = [{"impl": "moe_gemm pp 128x128 c1x2 p8", "ms": 0.25},
            {"impl": "QuACK pp 128x128 c1x2 p8", "ms": 0.26},
            {"impl": "moe_gemm coop 256x128 c2x1 p8", "ms": None},
            {"impl": "QuACK coop 256x128 c2x1 p8", "ms": 0.4}]
    lines = same_config.add_ratios(rows, 2e12)
    assert rows[0]["vs_quack"] == pytest.approx(0.26 / 0.25)
    assert rows[0]["tflops"] == pytest.approx(2e12 / 0.25 / 1e9)
    assert "vs_quack" not in rows[2] and "tflops" not in rows[2]
    assert len(lines) == 2 and "1.040" in lines[0] and "nan" in lines[1]


def test_quack_pinned_hands_the_check_its_output_not_quacks_return_value(monkeypatch):
    """gemm_tuned.fn writes `out` and returns a tuple of its own: the run must return out (the
    harness checks what the run returns against the reference)."""
    import sys
    import types

    import torch

    calls = []

    def fn(x, w, out, cu_seqlens_m, config):
        calls.append(config)
        out.copy_(torch.ones_like(out))
        return (None, "something QuACK returns")

    quack = types.ModuleType("quack")
    gemm_config = types.ModuleType("quack.gemm_config")
    gemm_config.GemmConfig = lambda **kw: kw
    gemm_interface = types.ModuleType("quack.gemm_interface")
    gemm_interface.gemm_tuned = types.SimpleNamespace(fn=fn)
    monkeypatch.setitem(sys.modules, "quack", quack)
    monkeypatch.setitem(sys.modules, "quack.gemm_config", gemm_config)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", gemm_interface)
    x, w = torch.zeros(6, 4), torch.zeros(2, 4, 3)
    from benchmarks import suite

    # (the run is built by suite.build_quack_config, shared with the zoo's replayed QuACK)
    monkeypatch.setattr(suite, "quack_operands",
                        lambda inp, device: (None, x, w, torch.tensor([0, 2, 6])))
    (fields,) = same_config.parse_configs("pp 128x192 c2x1")
    prepared = same_config._quack_pinned(fields)(None, None, torch.device("cpu"))
    got = prepared.run()
    assert isinstance(got, torch.Tensor) and got.shape == (6, 3) and bool((got == 1).all())
    assert calls == [same_config.quack_config(fields)]
