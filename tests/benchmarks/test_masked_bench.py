"""benchmarks/masked.py's harness on the CPU (--smoke: tiny shapes on the torch backend): every
implementation checked on the valid rows and timed, the derived columns, the routing counts."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import masked


def test_smoke_run_checks_and_times_every_implementation(tmp_path):
    out = tmp_path / "masked.json"
    assert masked.main(["--smoke", "--out", str(out), "--reps", "1"]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "masked" and doc["copy_bytes_per_s"] > 0
    assert [s["name"] for s in doc["shapes"]] == [s.name for s in masked.SMOKE_SHAPES]
    for shape in doc["shapes"]:
        impls = shape["impls"]
        assert {"ours-masked", "ours-batched-full", "ours-varlen-compact",
                "ours-fp8-masked"} <= set(impls)
        for name, entry in impls.items():
            assert "error" not in entry, (name, entry.get("error"))
            assert entry["rel_err"] < (0.08 if "fp8" in name else 0.02), name
            assert entry["us"] > 0 and entry["tflops"] >= 0
        assert shape["valid_rows"] == sum(shape["counts"])
        assert shape["ratio_vs_ours-batched-full"] > 0
    gate_up = doc["shapes"][0]
    assert {"ours-fused-masked-swiglu", "ours-masked+torch-swiglu"} <= set(gate_up["impls"])
    assert gate_up["fused_swiglu_speedup"] > 0


@pytest.mark.parametrize("shape", masked.SHAPES, ids=lambda s: s.name)
def test_counts_are_seeded_and_within_capacity(shape):
    a, b = masked.counts_for(shape, 7), masked.counts_for(shape, 7)
    assert a.dtype.is_floating_point is False and a.tolist() == b.tolist()
    assert len(a) == shape.G and 0 <= int(a.min()) and int(a.max()) <= shape.M
    # around the expected rows per expert (log-normal popularity, mean-normalised)
    assert 0.8 * shape.expected <= float(a.float().mean()) <= 1.2 * shape.expected


def test_our_implementation_failing_inside_a_shape_is_exit_status_1(tmp_path, monkeypatch,
                                                                     capsys):
    # An error of ours inside a shape (raised, or a wrong result) stayed in the JSON while the
    # run exited 0; a peer's error is not ours and leaves the status alone.
    import moe_gemm

    out = tmp_path / "masked.json"
    real = masked.implementations

    def peer_explodes(*args, **kwargs):
        def boom():
            raise RuntimeError("peer exploded")

        return {**real(*args, **kwargs), "torch-bmm-full": boom}

    monkeypatch.setattr(masked, "implementations", peer_explodes)
    assert masked.main(["--smoke", "--out", str(out), "--reps", "1"]) == 0
    assert "peer exploded" in json.loads(out.read_text())["shapes"][0]["impls"][
        "torch-bmm-full"]["error"]
    capsys.readouterr()
    monkeypatch.setattr(masked, "implementations", real)

    def wrong(x, w, masked_m, **kwargs):
        return torch.zeros(*x.shape[:-1], w.shape[-1], dtype=x.dtype)

    monkeypatch.setattr(moe_gemm, "grouped_mm_masked", wrong)
    assert masked.main(["--smoke", "--out", str(out), "--reps", "1"]) == 1
    doc = json.loads(out.read_text())
    assert [s["name"] for s in doc["shapes"]] == [s.name for s in masked.SMOKE_SHAPES]
    for shape in doc["shapes"]:
        assert "relative error" in shape["impls"]["ours-masked"]["error"]
        assert shape["impls"]["ours-varlen-compact"]["us"] > 0  # the other rows still timed
    err = capsys.readouterr().err
    assert f"failed: {masked.SMOKE_SHAPES[0].name} ours-masked" in err
