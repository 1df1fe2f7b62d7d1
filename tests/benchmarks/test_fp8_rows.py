"""The FP8 rows of the zoo (`benchmarks.zoo --fp8`) and of `moe-gemm bench --suite fp8` on
the CPU (--smoke: tiny stand-ins, torch backend): the rows and their fields, each row's floor
from its own operands' bytes, the dense ceiling, and the ratio to the best FP8 peer (torch's
FP8 grouped GEMMs have CUDA kernels only, so a CPU stand-in plays the peer where the ratio is
checked)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks import bench, suite_fp8, zoo, zoo_report
from benchmarks.fp8_operands import checked_error, scaled_operands
from benchmarks.scoring import derive, fp8_bytes_needed, shape_bytes
from moe_gemm.ops.scaled_reference import scaled_grouped_mm_ref
from moe_gemm.tuning import zoo as models

FP8_IMPLS = {suite_fp8.OURS_BLOCK, suite_fp8.OURS_ROW, suite_fp8.OURS_BLOCK_RING,
             suite_fp8.TORCH_ROW, suite_fp8.TORCH_BLOCK, suite_fp8.OURS_BF16, suite_fp8.DENSE}
ROW_KEYS = {"model", "proj", "tokens", "shape", "impl", "ms", "peer", "default", "floor_ms",
            "status", "case", "dtype"}


def _cpu_peer(calls: list[int]):
    """torch._scaled_grouped_mm's signature on the CPU: the fp64 product, rounded to bf16."""

    def fn(x, w, sa, sb, offs=None, out_dtype=torch.bfloat16):
        calls.append(1)
        return scaled_grouped_mm_ref(x, w, sa, sb, offs).to(out_dtype)

    return lambda device: (fn, None)


def _zoo(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "zoo-fp8.json"
    assert zoo.main(["--fp8", "--smoke", "--out", str(out), "--quiet", "--png", "none",
                     *extra]) == 0
    return json.loads(out.read_text())


def _check_rows(rows: list[dict], info: dict, ceil: dict) -> None:
    """One case's FP8 rows: their fields, floors, ratios and the dense fraction."""
    by = {r["impl"]: r for r in rows}
    assert set(by) == FP8_IMPLS and len(rows) == len(FP8_IMPLS)
    ours = by[suite_fp8.OURS_BLOCK]
    assert ours["default"] and not ours["peer"] and ours["status"] == "ok"
    assert (ours["dtype"], ours["scale"]) == ("fp8", "block")
    assert (by[suite_fp8.OURS_ROW]["dtype"], by[suite_fp8.OURS_ROW]["scale"]) == ("fp8", "row")
    assert by[suite_fp8.OURS_BF16]["dtype"] == "bf16" and not by[suite_fp8.OURS_BF16]["peer"]
    assert by[suite_fp8.TORCH_ROW]["peer"] and by[suite_fp8.TORCH_BLOCK]["peer"]
    assert sum(r["default"] for r in rows) == 1
    for name in (suite_fp8.OURS_BLOCK, suite_fp8.OURS_ROW, suite_fp8.OURS_BF16):
        r = by[name]
        assert r["status"] == "ok" and r["ms"] > 0 and r["backend"] == "torch"
        assert r["rel_err"] < 1e-2, r  # against the product of its own operands
        # Each row's floor: its own operands' bytes over the copy bandwidth, or its FLOPs
        # over its dtype's dense rate (FP8 rows: the FP8 rate measured in the run).
        rate = ceil["fp8_mm_flops_per_s" if r["dtype"] == "fp8" else "mm_flops_per_s"]
        mode = f"fp8-{r['scale']}" if r["dtype"] == "fp8" else "bf16"
        assert r["bytes"] == info["bytes_by_mode"][mode]
        floor = max(r["bytes"] / ceil["copy_bytes_per_s"], info["flops"] / rate) * 1e3
        assert r["floor_ms"] == pytest.approx(floor)
        assert r["fraction_of_floor"] == pytest.approx(floor / r["ms"])
        assert r["tflops"] == pytest.approx(info["flops"] / r["ms"] / 1e9)
        assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
    assert info["bytes_by_mode"]["fp8-block"] < info["bytes_by_mode"]["bf16"]
    peers = [r for r in rows if r["peer"] and r["status"] == "ok"]
    if peers:
        best = min(peers, key=lambda r: r["ms"])
        for name in (suite_fp8.OURS_BLOCK, suite_fp8.OURS_ROW, suite_fp8.OURS_BF16):
            assert by[name]["best_peer"] == best["impl"]
            assert by[name]["vs_best_peer"] == pytest.approx(best["ms"] / by[name]["ms"])
    else:
        assert "vs_best_peer" not in ours
    dense = by[suite_fp8.DENSE]
    assert dense["ceiling"] and not dense["peer"] and not dense["default"]
    if dense["status"] == "ok":
        assert dense["rel_err"] < 1e-2 and dense["floor_ms"] is None
        assert "vs_best_peer" not in dense and "fraction_of_floor" not in dense
        assert ours["fraction_of_dense"] == pytest.approx(dense["ms"] / ours["ms"])
        assert "fraction_of_dense" not in by[suite_fp8.OURS_BF16]
    else:
        assert dense["status"] == "n/a" and "memory-bound" in dense["reason"]
        assert "fraction_of_dense" not in ours


def test_zoo_fp8_smoke_rows(tmp_path, capsys):
    doc = _zoo(tmp_path, "--models", "DeepSeek-V3-EP8,Qwen3-30B-A3B", "--tokens", "1,16")
    assert doc["complete"] and doc["settings"]["dtype"] == "fp8"
    assert doc["ceilings"]["fp8_mm_flops_per_s"] > 0  # torch._scaled_mm runs on the CPU
    cases = {r["case"] for r in doc["results"]}
    assert cases == {f"{m}/{p}/{t}/fp8" for m in ("DeepSeek-V3-EP8", "Qwen3-30B-A3B")
                     for p in ("gate_up", "down") for t in (1, 16)}
    for case in cases:
        rows = [r for r in doc["results"] if r["case"] == case]
        for r in rows:
            assert ROW_KEYS <= set(r), r
            assert r["checkpoint"] == models.BY_NAME[r["model"]].fp8_id
        info = doc["cases"][case]
        assert info["K"] % 128 == 0  # whole scale blocks even in the stand-ins
        _check_rows(rows, info, doc["ceilings"])
        for name in (suite_fp8.TORCH_ROW, suite_fp8.TORCH_BLOCK):  # CUDA only: n/a, why
            r = next(r for r in rows if r["impl"] == name)
            assert r["status"] == "n/a" and "CUDA" in r["reason"]
    table = capsys.readouterr().out
    assert "moe-gemm zoo fp8" in table and "dense%" in table
    assert "DeepSeek-V3-EP8/gate_up/16/fp8" in table


def test_zoo_fp8_ratio_to_the_best_fp8_peer(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(suite_fp8, "torch_scaled_grouped_mm", _cpu_peer(calls))
    doc = _zoo(tmp_path, "--models", "Kimi-K2", "--tokens", "16", "--proj", "down")
    rows = doc["results"]
    assert calls and {r["case"] for r in rows} == {"Kimi-K2/down/16/fp8"}
    peer = next(r for r in rows if r["impl"] == suite_fp8.TORCH_ROW)
    assert peer["status"] == "ok" and peer["ms"] > 0 and peer["rel_err"] < 1e-2
    _check_rows(rows, doc["cases"]["Kimi-K2/down/16/fp8"], doc["ceilings"])
    ours = next(r for r in rows if r["default"])
    assert ours["vs_best_peer"] == pytest.approx(peer["ms"] / ours["ms"])
    assert doc["bar"]["cases"] == 1


def test_zoo_fp8_refusals(tmp_path, capsys):
    # A model with no published FP8 checkpoint, and resuming a bf16 run in FP8.
    assert zoo.main(["--fp8", "--smoke", "--models", "Mixtral-8x7B"]) == 2
    assert "no FP8 checkpoint" in capsys.readouterr().err
    bf16 = tmp_path / "bf16.json"
    assert zoo.main(["--smoke", "--models", "OLMoE-1B-7B", "--tokens", "1", "--out",
                     str(bf16), "--quiet", "--png", "none"]) == 0
    assert zoo.main(["--fp8", "--smoke", "--resume", str(bf16), "--out",
                     str(tmp_path / "x.json"), "--quiet"]) == 2
    assert "is a bf16 run" in capsys.readouterr().err
    assert set(models.FP8_MODELS) == {m.name for m in models.MODELS if m.fp8_id}


def test_bench_fp8_suite_smoke(tmp_path, capsys, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(suite_fp8, "torch_scaled_grouped_mm", _cpu_peer(calls))
    out = tmp_path / "bench-fp8.json"
    assert bench.main(["--suite", "fp8", "--smoke", "--out", str(out), "--png", "none",
                       "--quiet"]) == 0
    doc = json.loads(out.read_text())
    names = [s.name for s in suite_fp8.fp8_smoke_suite()]
    assert list(doc["shapes"]) == names and calls
    for name in names:
        info = doc["shapes"][name]
        assert info["dtype"] == "fp8"
        rows = [r for r in doc["results"] if r["shape"] == name]
        _check_rows(rows, info, doc["ceilings"])
    # The batched headline: 8 problems of (16, 32, 128), each its own weights.
    head = doc["shapes"]["uniform-fp8"]
    sizes = [(16, 32, 128)] * 8
    assert head["bytes"] == fp8_bytes_needed(sizes, "block") and head["headline"]
    assert doc["bar"]["headline"] == "uniform-fp8"
    table = capsys.readouterr().out
    assert "FP8 mm" in table and "| TFLOP/s |   GB/s |" in table
    assert "uniform-fp8  | ours-fp8-block" in table and "decode-fp8" in table
    assert bench.main(["--suite", "fp8", "--smoke", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "prefill-fp8" in listed and "host-overhead" not in listed
    assert bench.main(["--suite", "fp8", "--smoke", "--only", "host-overhead"]) == 2


def test_fp8_bytes_hand_computed():
    sizes = [(2, 256, 256), (0, 256, 256), (1, 100, 128)]
    # (2*256 + 256*256) + 2*256*2 + 4 * (2*2 + 2*2) = 67,104; the empty expert costs nothing;
    # (128 + 128*100) + 100*2 + 4 * (1*1 + 1*1) = 13,136.
    assert fp8_bytes_needed(sizes, "block") == 67_104 + 13_136
    # row: one scale per row of A and column of B: 4 * (2 + 256) and 4 * (1 + 100).
    assert fp8_bytes_needed(sizes, "row") == (66_048 + 1_024 + 1_032) + (12_928 + 200 + 404)
    by = shape_bytes(sizes, "fp8")["bytes_by_mode"]
    assert by["bf16"] == (2 * 256 + 256 * 256) * 2 + 2 * 256 * 2 + (128 + 12_800) * 2 + 200
    assert shape_bytes(sizes, "bf16") == {"bytes": by["bf16"]}


def test_derive_per_row_floors_and_dense_hand_computed():
    info = {"dtype": "fp8", "bytes": 1_000, "flops": 4_000,
            "bytes_by_mode": {"fp8-block": 1_000, "fp8-row": 1_200, "bf16": 2_000}}
    ceil = {"copy_bytes_per_s": 1e6, "mm_flops_per_s": 2e6, "fp8_mm_flops_per_s": 4e6}

    def row(impl, dtype, scale, ms, peer=False, default=False, ceiling=False):
        r = {"shape": "s", "impl": impl, "dtype": dtype, "peer": peer, "default": default,
             "status": "ok", "ms": ms}
        if scale:
            r["scale"] = scale
        if ceiling:
            r["ceiling"] = True
        return r

    doc = {"ceilings": ceil, "shapes": {"s": info}, "results": [
        row("ours-fp8-block", "fp8", "block", 2.0, default=True),
        row("torch-row", "fp8", "row", 2.5, peer=True),
        row("ours-bf16", "bf16", None, 4.0),
        row("dense", "fp8", "row", 1.5, ceiling=True)]}
    derive(doc)
    ours, peer, bf16, dense = doc["results"]
    # fp8-block: max(1000 B / 1e6 B/s, 4000 / 4e6) = 1 ms; fp8-row 1.2 ms; bf16 max(2, 2) ms.
    assert ours["floor_ms"] == pytest.approx(1.0) and ours["fraction_of_floor"] == pytest.approx(0.5)
    assert peer["floor_ms"] == pytest.approx(1.2) and bf16["floor_ms"] == pytest.approx(2.0)
    assert ours["vs_best_peer"] == pytest.approx(1.25) and bf16["vs_best_peer"] == pytest.approx(0.625)
    assert ours["fraction_of_dense"] == pytest.approx(0.75) and "fraction_of_dense" not in bf16
    assert dense["tflops"] == pytest.approx(4_000 / 1.5 / 1e9) and dense["floor_ms"] is None
    assert "vs_best_peer" not in dense and info["dense_ms"] == 1.5
    # The zoo derives one case the same way.
    rows = [dict(r, case="c") for r in doc["results"]]
    for r in rows:
        for k in ("vs_best_peer", "fraction_of_dense", "fraction_of_floor", "floor_ms"):
            r.pop(k, None)
    zoo_report.derive_case(rows, dict(info), ceil)
    assert [r.get("vs_best_peer") for r in rows] == [
        doc["results"][i].get("vs_best_peer") for i in range(4)]
    assert rows[0]["fraction_of_dense"] == pytest.approx(0.75)


def test_checked_error_catches_unwritten_and_wrong_outputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 256, generator=gen).to(torch.bfloat16)
    w = torch.randn(3, 64, 256, generator=gen).to(torch.bfloat16)  # (E, N, K)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    for g, s in scaled_operands(x, w, offs).items():
        ref = scaled_grouped_mm_ref(s.x, s.w, s.sa, s.sb, offs).to(torch.bfloat16)
        assert checked_error(ref, s) < 5e-3, g
        bad = ref.clone()
        bad[12] = float("nan")  # one unwritten row
        assert checked_error(bad, s) != checked_error(bad, s)  # NaN
        assert checked_error(ref * 1.1, s) == pytest.approx(0.1, rel=0.05)
        with pytest.raises(RuntimeError, match="expected"):
            checked_error(ref[:, :32], s)


def test_promote_lag_switch_is_scoped(monkeypatch):
    from benchmarks.fp8_operands import promote_lag
    from moe_gemm.ops.heuristics_fp8 import PROMOTE_LAG_ENV, promote_lag_requested

    for before in (None, "0"):
        if before is None:
            monkeypatch.delenv(PROMOTE_LAG_ENV, raising=False)
        else:
            monkeypatch.setenv(PROMOTE_LAG_ENV, before)
        assert not promote_lag_requested()
        with promote_lag():
            assert promote_lag_requested()
        assert os.environ.get(PROMOTE_LAG_ENV) == before
