"""benchmarks.choice_generalization: scoring the lookup's choice on held-out models' shapes."""

from __future__ import annotations

import json

import pytest

from benchmarks import choice_generalization as cg
from moe_gemm.ops import tuned

SMALL = {"schedule": "pingpong", "tile_m": 64, "tile_n": 256, "visitor": "device",
         "cluster_m": 1, "cluster_n": 1, "stages": None, "raster_panel": 8,
         "whole_epilogue": False, "tail_split": False}
BIG = {**SMALL, "schedule": "cooperative", "tile_m": 128, "tile_n": 192}
BIG_P4 = {**BIG, "raster_panel": 4}  # a variation timed only where BIG won


def _doc():
    """Three models x three (N, K) x two row counts: SMALL wins 2 rows per expert, BIG wins
    512; the rules always take SMALL (12 us) and the variation BIG p4 is timed on prefill."""
    entries, samples = [], []
    for m, (N, K) in enumerate(((2048, 4096), (4096, 4096), (4096, 8192))):
        for rows, times in ((256, {"SMALL": 10.0, "BIG": 15.0}),
                            (65536, {"SMALL": 30.0, "BIG": 20.0, "BIG_P4": 19.0})):
            cfgs = {"SMALL": SMALL, "BIG": BIG, "BIG_P4": BIG_P4}
            shape = {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": 128,
                     "N": N, "K": K, "rows": rows}
            best = min(times, key=times.get)
            entries.append({**shape, "bucket": tuned.rows_bucket(rows / 128),
                            "config": cfgs[best], "us": times[best], "label":
                            f"M{m}/gate_up tokens={rows}", "rules_name": "pp 64x256 p8",
                            "rules_us": times["SMALL"]})
            samples += [{**shape, "config": cfgs[n], "us": t} for n, t in times.items()]
    return {"format": tuned.FORMAT, "device": "NVIDIA Test GPU", "created": "2026-01-01",
            "sm_count": 132, "ceilings": {}, "entries": entries, "samples": samples}


def test_held_out_models_are_scored_against_their_own_timings(monkeypatch):
    monkeypatch.setattr(tuned, "NEIGHBOURS", 2)  # two other models: two shapes in reach
    monkeypatch.setattr(tuned, "MIN_VOTERS", 2)
    res = cg.evaluate(_doc())
    assert len(res["rows"]) == 6
    by = {r["label"]: r for r in res["rows"]}
    prefill = by["M1/gate_up tokens=65536"]
    assert prefill["best"] == "coop 128x192 p4" and prefill["best_us"] == 19.0
    # The rules (SMALL) lose prefill by 30/19; the vote of the other models picks BIG p4.
    assert prefill["rules"]["regret"] == pytest.approx(30 / 19)
    assert prefill["neighbours"]["choice"] == "coop 128x192 p4"
    assert prefill["neighbours"]["regret"] == pytest.approx(1.0)
    assert prefill["neighbours"]["used_pick"] is True
    # Decode: the vote agrees with the rules, which keep the call.
    decode = by["M1/gate_up tokens=256"]
    assert decode["neighbours"]["used_pick"] is False
    assert decode["neighbours"]["regret"] == pytest.approx(1.0)
    s = res["summary"]
    assert s["rules"]["shapes"] == 6 and s["rules"]["max"] == pytest.approx(30 / 19)
    assert s["neighbours"]["max"] == pytest.approx(1.0) and s["neighbours"]["picked"] == 3
    assert s["nearest"]["shapes"] == 0  # each projection has one bucket per model here


def test_holding_out_a_token_count_removes_its_shapes_of_every_model(monkeypatch):
    monkeypatch.setattr(tuned, "NEIGHBOURS", 2)
    monkeypatch.setattr(tuned, "MIN_VOTERS", 2)
    res = cg.evaluate(_doc(), hold="tokens")
    assert res["held_out"] == "tokens" and len(res["rows"]) == 6
    by = {r["label"]: r for r in res["rows"]}
    # Every prefill shape is out at once: the decode shapes left are 8 octaves of rows away,
    # beyond the vote's reach, so the rules keep the call (where holding out one model, the
    # other models' prefill shapes voted for BIG p4).
    prefill = by["M1/gate_up tokens=65536"]
    assert prefill["neighbours"]["used_pick"] is False
    assert prefill["neighbours"]["regret"] == pytest.approx(30 / 19)
    assert cg.evaluate(_doc())["rows"][1]["neighbours"]["used_pick"] is True
    with pytest.raises(KeyError):
        cg.evaluate(_doc(), hold="layer")


def test_a_pick_whose_tile_the_held_out_shape_never_timed_is_untimed_and_says_why(monkeypatch):
    # M1's prefill shape was tuned before BIG's tile existed: no sample of it there at all.
    monkeypatch.setattr(tuned, "NEIGHBOURS", 2)
    monkeypatch.setattr(tuned, "MIN_VOTERS", 2)
    doc = _doc()
    doc["samples"] = [x for x in doc["samples"]
                      if not (x["N"] == 4096 and x["K"] == 4096 and x["rows"] == 65536
                              and x["config"]["tile_m"] == 128)]
    res = cg.evaluate(doc)
    prefill = {r["label"]: r for r in res["rows"]}["M1/gate_up tokens=65536"]
    assert prefill["neighbours"]["choice"] == "coop 128x192 p4"
    assert prefill["neighbours"]["regret"] is None and prefill["neighbours"]["newer_tile"]
    nb = res["summary"]["neighbours"]
    assert nb["untimed"] == nb["untimed_newer_tile"] == 1
    # A pick whose tile was timed there (only its variation was not) is scored, not excused.
    other = {r["label"]: r for r in cg.evaluate(_doc())["rows"]}["M1/gate_up tokens=65536"]
    assert "newer_tile" not in other["neighbours"]


def test_an_untimed_variation_is_scored_by_its_family():
    assert cg._family("coop 128x192 c1x2 s4 p4 ts") == "coop 128x192 c1x2 p8"
    assert cg._family("pp 64x256 p8") == "pp 64x256 p8"
    # (a swapped pick, which the re-ranked tables name: its family is the swapped tile)
    assert cg._family("swap 256x128 p8ns") == "swap 256x128 p8"


def test_cli(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_doc()))
    out = tmp_path / "r.json"
    assert cg.main(["--table", str(path), "--out", str(out)]) == 0
    assert "neighbours" in capsys.readouterr().out
    assert cg.main(["--table", str(path), "--hold", "tokens", "--out", str(out)]) == 0
    assert "each token count held out" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["held_out"] == "tokens"
    assert json.loads(out.read_text())[0]["summary"]["rules"]["shapes"] == 6
    assert cg.main(["--table", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bare.json").write_text(json.dumps({**_doc(), "samples": []}))
    assert cg.main(["--table", str(tmp_path / "bare.json")]) == 2
    assert cg.main(["--device", "NVIDIA No Such GPU"]) == 2


def test_shipped_tables_score():
    res = [cg.evaluate(json.loads(tuned.shipped_path(d).read_text()))
           for d in cg.DEFAULT_DEVICES]
    for r in res:
        s = r["summary"]
        assert s["rules"]["shapes"] == s["neighbours"]["shapes"] == len(r["rows"]) > 100
        # Every vote pick is scored on the held-out shape, except where the shape was tuned
        # before the pick's tile existed (a table retuned in parts: the H100 table's rows at
        # 16-512 tokens predate ping-pong 192x128); those stay few, and a full retune makes
        # them none.
        nb = s["neighbours"]
        assert nb["untimed"] == nb["untimed_newer_tile"] <= len(r["rows"]) // 20
        assert nb["median"] >= 1.0


def test_cli_skips_what_the_reader_skips(tmp_path, capsys):
    # A non-object entry or a sample of an E past any float was a TypeError / OverflowError
    # traceback; the library's lookup skips them with a warning, and so does this tool now.
    doc = _doc()
    doc["entries"].append(5)
    doc["samples"].append({**doc["samples"][0], "E": 1e400})
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc).replace("Infinity", "1e400"))
    assert cg.main(["--table", str(path), "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "left out 1 unreadable entries, 1 unreadable samples" in err
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    assert cg.main(["--table", str(tmp_path / "deep.json")]) == 2
    assert "nested too deeply" in capsys.readouterr().err
