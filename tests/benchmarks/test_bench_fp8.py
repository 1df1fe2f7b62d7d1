"""benchmarks/bench_fp8.py's harness on the CPU (--smoke: tiny shapes on the torch backend):
the JSON it writes, every implementation checked or recorded with its error, the derived
columns."""

from __future__ import annotations

import json

from benchmarks import bench_fp8


def test_smoke_run_writes_every_section(tmp_path):
    out = tmp_path / "fp8.json"
    assert bench_fp8.main(["--smoke", "--out", str(out), "--reps", "1"]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "fp8" and doc["copy_bytes_per_s"] > 0
    assert [s["name"] for s in doc["shapes"]] == [s.name for s in bench_fp8.SMOKE_SHAPES]
    for shape in doc["shapes"]:
        impls = shape["impls"]
        assert "ours-fp8-block" in impls and "ours-fp8-row" in impls and "ours-bf16" in impls
        for name, entry in impls.items():
            # Timed and checked, or an error with the reason (torch's FP8 ops on the CPU).
            assert ("us" in entry and entry["spot_rel_err"] < 5e-3) or "error" in entry, name
        assert shape["fp8_floor_us"] < shape["bf16_floor_us"]
        assert shape["best_ours_config"].startswith("ours-fp8-block")
    assert {r["granularity"] for r in doc["accuracy"]} == {"block", "row"}
    for r in doc["accuracy"]:
        assert r["ours_fp32_out"]["rel"] < 1e-5  # the torch backend: fp32 accumulation
    assert doc["quantize"][0]["T"] == 64 and doc["quantize"][0]["ours-kernel_us"] > 0


def test_shapes_and_sweep_are_buildable_configs():
    from moe_gemm.ops.heuristics_fp8 import choose_fp8

    for shape in bench_fp8.SHAPES:
        avg = shape.rows if shape.form == "batched" else shape.rows / shape.groups
        for cfg in bench_fp8.sweep_configs(shape).values():
            choose_fp8(shape.form, cfg, avg, shape.N, shape.K, 2, "block")  # never raises


def test_our_implementation_failing_inside_a_shape_is_exit_status_1(tmp_path, monkeypatch,
                                                                     capsys):
    # ours-bf16 raising in every shape was recorded in the JSON and the run exited 0.
    import moe_gemm

    def boom(*args, **kwargs):
        raise RuntimeError("our kernel exploded")

    monkeypatch.setattr(moe_gemm, "grouped_mm", boom)
    out = tmp_path / "fp8.json"
    assert bench_fp8.main(["--smoke", "--out", str(out), "--reps", "1", "--no-sweep"]) == 1
    doc = json.loads(out.read_text())
    assert [s["name"] for s in doc["shapes"]] == [s.name for s in bench_fp8.SMOKE_SHAPES]
    for shape in doc["shapes"]:
        assert "our kernel exploded" in shape["impls"]["ours-bf16"]["error"]
        assert shape["impls"]["ours-fp8-block"]["us"] > 0  # the other rows still timed
    err = capsys.readouterr().err
    assert all(f"failed: {s.name} ours-bf16" in err for s in bench_fp8.SMOKE_SHAPES), err


def test_a_section_of_ours_that_raised_is_exit_status_1(tmp_path, monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("accuracy exploded")

    monkeypatch.setattr(bench_fp8, "accuracy", boom)
    out = tmp_path / "fp8.json"
    assert bench_fp8.main(["--smoke", "--out", str(out), "--reps", "1", "--no-sweep"]) == 1
    doc = json.loads(out.read_text())
    assert "accuracy exploded" in doc["accuracy"]["error"] and len(doc["shapes"]) == 2
    assert "failed: accuracy" in capsys.readouterr().err
