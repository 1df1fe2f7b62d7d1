"""The server's tuning at start: the flag, what the engine tunes, and the kernels it reports
per weight set (CPU: a pretend cute backend and a tuned table for a pretend GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from moe_gemm.ops import heuristics, tuned
from moe_gemm.tuning import online
from moe_gemm_server.cli import settings_from_args
from moe_gemm_server.config import Settings
from moe_gemm_server.engine import Engine, WeightSet
from moe_gemm_server.engine_warmup import TUNE_ROWS_PER_EXPERT

DEV = "NVIDIA Test GPU"


def test_flag_and_setting(monkeypatch):
    assert Settings().tune_at_start is False
    assert settings_from_args(["--tune-at-start"]).tune_at_start is True
    assert settings_from_args(["--no-tune-at-start"]).tune_at_start is False
    monkeypatch.setenv("MOE_GEMM_TUNE_AT_START", "1")
    assert Settings().tune_at_start is True


def test_torch_backend_tunes_nothing_and_reports_nothing(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(online, "tune_once", lambda *a, **k: calls.append(a))
    with caplog.at_level("WARNING", logger="moe_gemm_server.engine"):
        engine = Engine("cpu", tune=True)
    # Asked for and impossible: said once at start, not silently dropped.
    said = [r.getMessage() for r in caplog.records if "tuning at start" in r.getMessage()]
    assert len(said) == 1 and "torch backend" in said[0], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="moe_gemm_server.engine"):
        Engine("cpu")
    assert not [r for r in caplog.records if "tuning at start" in r.getMessage()]
    ws = engine.add_weights("w", torch.randn(4, 32, 16))
    assert calls == [] and ws.kernels == () and "kernels" not in ws.info()
    assert engine.grouped_mm("w", torch.randn(3, 32), torch.tensor([1, 0, 2, 0])).shape == (3, 16)


@pytest.fixture
def pretend_cute(monkeypatch, tmp_path):
    import moe_gemm.capability as cap

    monkeypatch.setattr(cap, "sm_count", lambda device: 132)
    monkeypatch.setattr(tuned, "TABLES_DIR", tmp_path)
    monkeypatch.delenv(tuned.USER_TABLE_ENV, raising=False)
    monkeypatch.delenv(tuned.TABLES_ENV, raising=False)
    tuned.clear_caches()
    heuristics.clear_caches()
    engine = Engine("cpu", max_rows=40000, tune=True)
    engine.backend = "cute"
    monkeypatch.setattr(engine, "_device_name", lambda: DEV)
    yield engine, tmp_path
    tuned.clear_caches()
    heuristics.clear_caches()


def test_tune_weights_tunes_a_ladder_of_shapes(pretend_cute, monkeypatch):
    engine, _ = pretend_cute
    calls = []
    monkeypatch.setattr(online, "tune_once", lambda device, E, N, K, T, counts, **k: calls.append(
        (E, N, K, T, sum(counts), len(counts), k["layout"], k["dtype"])))
    w_t = torch.randn(64, 256, 512, dtype=torch.bfloat16)  # (E, N, K), uploaded as "w_t"
    ws = WeightSet("moe", w_t.transpose(1, 2), "w_t", 1)
    engine.tune_weights(ws)
    rows = [c[3] for c in calls]
    assert rows == sorted({int(64 * r) for r in TUNE_ROWS_PER_EXPERT})
    assert all(c[:3] == (64, 256, 512) and c[3] == c[4] and c[5] == 64 for c in calls)
    assert {c[6] for c in calls} == {"ENK"} and {c[7] for c in calls} == {torch.bfloat16}
    engine.max_rows = 600
    assert engine.tune_rows_for(ws) == (8, 64, 512)


def test_kernel_report_names_configs_and_sources(pretend_cute):
    engine, tables = pretend_cute
    ws = WeightSet("moe", torch.empty(64, 512, 256, dtype=torch.bfloat16), "w", 1)
    rows = engine.warmup_rows_for(ws)
    entry = {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": 64, "N": 256,
             "K": 512, "bucket": tuned.rows_bucket(rows[-1] / 64), "us": 10.0,
             "config": {"schedule": "cooperative", "tile_m": 128, "tile_n": 128,
                        "raster_panel": 4}}
    (tables / f"{tuned.device_slug(DEV)}.json").write_text(json.dumps(
        {"format": tuned.FORMAT, "device": DEV, "entries": [entry]}))
    tuned.clear_caches()
    heuristics.clear_caches()  # (shipped tables never change while a process runs)
    report = engine.kernel_report(ws)
    ladder = engine.warmup_rows_for(ws)  # follows the table: its config gets a row count too
    assert [r["rows"] for r in report] == [t for t in ladder if t > 0]
    by_rows = {r["rows"]: r for r in report}
    from_table = [r for r in report if r["source"].startswith("table:")]
    assert from_table and {r["config"] for r in from_table} == {"coop 128x128 p4"}
    for r in from_table:  # exact at the entry's bucket, nearest within 2 of it
        d = abs(tuned.rows_bucket(r["rows"] / 64) - entry["bucket"])
        assert (d == 0) == (r["source"] == "table:exact") and d <= 2
    assert by_rows[min(by_rows)]["source"] == "rules"  # 1 row: far from the tuned bucket
    assert by_rows[min(by_rows)]["config"].startswith("pp ")
    info = WeightSet("moe", ws.w, "w", 1, kernels=report).info()
    assert info["kernels"] == [dict(r) for r in report]


def test_tables_off_skip_tuning_at_start_with_a_word(monkeypatch, caplog):
    # MOE_GEMM_TUNED_TABLES=0: the tune's result would be read by no launch (the online
    # autotune is off with the tables), so the engine says so instead of tuning for nothing.
    import moe_gemm_server.engine as engine_module

    monkeypatch.setattr(engine_module, "cute_problem", lambda device: None)
    monkeypatch.setenv(tuned.TABLES_ENV, "0")
    with caplog.at_level("WARNING", logger="moe_gemm_server.engine"):
        engine = Engine("cpu", tune=True)
    assert engine.backend == "cute"
    said = [r.getMessage() for r in caplog.records if "tuning at start" in r.getMessage()]
    assert len(said) == 1 and "MOE_GEMM_TUNED_TABLES=0" in said[0], said
