"""benchmarks/masked.py's harness on the CPU (--smoke: tiny shapes on the torch backend): every
implementation checked on the valid rows and timed, the derived columns, the routing counts."""

from __future__ import annotations

import json

import pytest

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
