"""benchmarks.fused_adopt: a fused_configs run's winners become the fused forms' table entries
(only plain config variants, faster on every token count of the bucket by the margin), every
timed kernel a sample; the table stays one the reader takes."""

from __future__ import annotations

import json

import pytest

from benchmarks import fused_adopt
from moe_gemm.ops import tuned
from moe_gemm.tuning import table_io

DEV = "NVIDIA Test GPU 80GB"
E = 128
COOP = {"schedule": "cooperative", "visitor": "device", "tile_m": 128, "tile_n": 192,
        "cluster_m": 1, "cluster_n": 2, "stages": None, "raster_panel": 8,
        "whole_epilogue": False, "tail_split": False}
PP = dict(COOP, schedule="pingpong", tile_n=128)
PP_64 = dict(COOP, schedule="pingpong", tile_m=64, tile_n=256, cluster_n=1)


def _row(proj, tokens, variant, fields, us, form=None, kernel=None):
    form = form or ("fused-gate-bias" if proj == "up" else "fused-bias")
    N, K = (5760, 2880) if proj == "up" else (2880, 2880)
    return {"model": "gpt-oss-120b", "proj": proj, "tokens": tokens, "variant": variant,
            "shape": {"form": form, "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E,
                      "N": N, "K": K, "rows": 4 * tokens},
            "kernel": kernel or variant, "fields": dict(fields), "us": us}


def _result(rows, device=DEV):
    return {"suite": "fused-configs", "date": "2026-12-04", "device": device, "rows": rows}


def _table():
    return table_io.new_table(DEV, 132, {}, {})


def _run():
    rows = []
    for tokens, base in ((1024, 1000.0), (1280, 1100.0)):  # both in bucket 5 (32, 40 rows)
        rows += [_row("up", tokens, "default", COOP, base),
                 _row("up", tokens, "pp 128x128 c1x2 p8", PP, base / 1.05),
                 _row("up", tokens, "pp 64x256 p8", PP_64, base / 0.9),
                 # faster, but under an option word or not our kernel: never adopted
                 _row("up", tokens, "default ieeegate", COOP, base / 1.3),
                 _row("up", tokens, "pp 64x256 p8 wide", PP_64, base / 1.3),
                 # the down GEMM: the best variant within the margin
                 _row("down", tokens, "default", COOP, 500.0),
                 _row("down", tokens, "pp 128x128 c1x2 p8", PP, 500.0 / 1.01)]
        rows.append({"model": "gpt-oss-120b", "proj": "up", "tokens": tokens,
                     "variant": "unfused", "shape": rows[-1]["shape"], "us": 1.0})
    # bucket 6 (64 rows): faster at one token count, 3% slower at the other
    rows += [_row("up", 2048, "default", COOP, 2000.0),
             _row("up", 2048, "pp 128x128 c1x2 p8", PP, 2000.0 / 1.10),
             _row("up", 2400, "default", COOP, 2300.0),
             _row("up", 2400, "pp 128x128 c1x2 p8", PP, 2300.0 / 0.97)]
    return _result(rows)


def test_the_winner_of_every_token_count_is_adopted_and_nothing_else():
    table = _table()
    lines = fused_adopt.adopt(table, _run())
    entries = {table_io.entry_key(e): e for e in table["entries"]}
    up5 = ("fused-gate-bias", "bfloat16", "bfloat16", E, 5760, 2880, 5)
    assert set(entries) == {up5}, lines
    e = entries[up5]
    assert e["config"] == {k: v for k, v in PP.items() if v is not None}
    assert e["fused_ab"]["tokens"] == [1024, 1280]
    assert e["fused_ab"]["speedups"] == [1.05, 1.05]
    assert e["fused_ab"]["against"] == ["default", "default"]
    assert e["us"] == pytest.approx(1000.0 / 1.05, abs=0.01)
    assert any("kept" in line and "fused-bias" in line for line in lines)  # the down GEMM
    assert any("kept" in line and "bucket 6" in line for line in lines)
    # every plain kernel's time is a sample, option-word and unfused rows are not
    shapes = {(s["form"], s["rows"]) for s in table["samples"]}
    assert ("fused-gate-bias", 4096) in shapes and ("fused-bias", 5120) in shapes
    at_1024 = sorted(s["us"] for s in table["samples"]
                     if s["form"] == "fused-gate-bias" and s["rows"] == 4096)
    # the three plain kernels: pp 128x128, the default's own (not its ieeegate time), pp 64x256
    # (not its time with the wide gather)
    assert at_1024 == pytest.approx([1000.0 / 1.05, 1000.0, 1000.0 / 0.9], abs=0.01)


def test_the_written_table_is_read_and_answers_the_fused_form(tmp_path):
    path = tmp_path / "t.json"
    table_io.write(path, _table())
    (tmp_path / "fc.json").write_text(json.dumps(_run()))
    assert fused_adopt.main([str(tmp_path / "fc.json"), "--table", str(path)]) == 0
    doc = json.loads(path.read_text())
    parsed = tuned.parse_table(doc, str(path), DEV)
    assert parsed.skipped == 0
    key = tuned.Key("fused-gate-bias", "bfloat16", "bfloat16", E, 5760, 2880, 5)
    assert dict(parsed.entries[key][0])["schedule"] == "pingpong"
    # a second run against the adopted entry (now the default) keeps it
    again = _result([_row("up", 1024, "default", PP, 950.0),
                     _row("up", 1024, "coop 128x192 c1x2 p8", COOP, 1000.0)])
    (tmp_path / "fc2.json").write_text(json.dumps(again))
    assert fused_adopt.main([str(tmp_path / "fc2.json"), "--table", str(path)]) == 0
    assert tuned.parse_table(json.loads(path.read_text()), str(path), DEV).entries[key][0] == (
        parsed.entries[key][0])


def test_refusals_and_the_dry_run(tmp_path, capsys):
    path = tmp_path / "t.json"
    table_io.write(path, _table())
    before = path.read_text()
    with pytest.raises(ValueError, match="the run is from 'NVIDIA Other'"):
        fused_adopt.adopt(_table(), _result([], device="NVIDIA Other"))
    (tmp_path / "fc.json").write_text(json.dumps(_run()))
    assert fused_adopt.main([str(tmp_path / "fc.json"), "--table", str(path), "--dry-run"]) == 0
    assert path.read_text() == before
    assert "fused-gate-bias" in capsys.readouterr().out
    (tmp_path / "other.json").write_text(json.dumps({"suite": "zoo"}))
    assert fused_adopt.main([str(tmp_path / "other.json"), "--table", str(path)]) == 2
    assert "not a benchmarks.fused_configs result" in capsys.readouterr().err
    assert fused_adopt.main([str(tmp_path / "fc.json"), "--table", str(tmp_path / "none.json")
                             ]) == 2
    assert fused_adopt.main([str(tmp_path / "fc.json"), "--table", str(path),
                             "--min-gain", "1.5"]) == 2
    assert path.read_text() == before


def _bucket5_run(speedup_pp, default=COOP, us=1000.0):
    """A run at 1024 and 1280 tokens (bucket 5) of the up GEMM: the default and pp 128x128."""
    rows = []
    for tokens in (1024, 1280):
        rows += [_row("up", tokens, "default", default, us),
                 _row("up", tokens, "pp 128x128 c1x2 p8", PP, us / speedup_pp),
                 _row("up", tokens, "pp 64x256 p8", PP_64, us / 0.95)]
    return _result(rows)


UP5 = ("fused-gate-bias", "bfloat16", "bfloat16", E, 5760, 2880, 5)


def test_runs_are_pooled_a_leader_of_one_run_that_ties_in_the_next_is_kept_out():
    table = _table()
    lines = fused_adopt.adopt(table, [_bucket5_run(1.04), _bucket5_run(1.00)])
    assert not table["entries"], lines  # geometric mean ~1.02 with 1.00 in one run: below
    assert any("kept" in line and "2 runs" in line for line in lines)
    table = _table()
    lines = fused_adopt.adopt(table, [_bucket5_run(1.03), _bucket5_run(1.035)])
    (e,) = table["entries"]
    assert table_io.entry_key(e) == UP5
    assert e["fused_ab"]["runs"] == 2
    assert e["fused_ab"]["tokens"] == [1024, 1280, 1024, 1280]
    assert e["fused_ab"]["speedups"] == pytest.approx([1.03, 1.03, 1.035, 1.035], abs=1e-3)
    # the entry's time is the newest run's
    assert e["us"] == pytest.approx(1000.0 / 1.035, abs=0.01)


def test_a_run_against_another_default_is_left_out_of_that_key():
    # the older run measured against pp 64x256 (the table then), the newest against coop:
    # only the newest decides
    old = _bucket5_run(1.20, default=PP_64)
    table = _table()
    lines = fused_adopt.adopt(table, [old, _bucket5_run(1.01)])
    assert not table["entries"], lines
    assert any("1 left out" in line for line in lines)


def test_the_newest_run_gives_each_shape_its_samples(tmp_path):
    path = tmp_path / "t.json"
    table_io.write(path, _table())
    files = []
    for i, us in enumerate((1000.0, 2000.0)):
        files.append(tmp_path / f"fc{i}.json")
        files[-1].write_text(json.dumps(_bucket5_run(1.0, us=us)))
    assert fused_adopt.main([*map(str, files), "--table", str(path)]) == 0
    doc = json.loads(path.read_text())
    at_1024 = sorted(s["us"] for s in doc["samples"] if s["rows"] == 4096)
    assert at_1024 == pytest.approx([2000.0, 2000.0, 2000.0 / 0.95], abs=0.01)
    # a second file from another device refuses the whole adoption
    (tmp_path / "other.json").write_text(json.dumps(dict(_bucket5_run(1.1),
                                                         device="NVIDIA Other")))
    before = path.read_text()
    assert fused_adopt.main([str(files[0]), str(tmp_path / "other.json"), "--table",
                             str(path)]) == 2
    assert path.read_text() == before
