"""benchmarks.pick_ab on the CPU: its arguments, how a variant changes the default's pick, and
its ratios (the timing itself needs a Hopper GPU)."""

from __future__ import annotations

import json

import pytest

from benchmarks import pick_ab
from benchmarks.ab_cases import table_key
from moe_gemm.ops.tuned import rows_bucket
from moe_gemm.tuning import space


def test_variants_parse_and_a_word_that_varies_nothing_is_named():
    assert pick_ab.parse_variants(["p8", "p8ns", "s4 p16"]) == [["p8"], ["p8ns"], ["s4", "p16"]]
    with pytest.raises(ValueError, match="'128x192' is not one of"):
        pick_ab.parse_variants(["p8", "128x192"])
    with pytest.raises(ValueError, match="at least two"):
        pick_ab.parse_variants(["p8ns"])
    with pytest.raises(ValueError, match="empty"):
        pick_ab.parse_variants(["p8", " "])


def test_a_variant_replaces_the_picks_word_of_its_kind_only():
    pick = space.parse_name("pp 128x192 c1x2 s4 p8ns")
    along_m = pick_ab.vary(pick, ["p8"])
    assert along_m.get("raster_along", "m") == "m" and not along_m.get("raster_serpentine")
    assert (along_m["tile_m"], along_m["tile_n"], along_m["cluster_n"], along_m["stages"]) == (
        128, 192, 2, 4)
    back = pick_ab.vary(space.parse_name("coop 128x256 s3 p16 ts ew"), ["p8ns"])
    assert space.name_of(back) == "coop 128x256 s3 p8ns ts ew"
    assert space.name_of(pick_ab.vary(pick, ["c2x1", "p16"])) == "pp 128x192 c2x1 s4 p16"
    # (a ping-pong pick in a cluster takes the tail split too; the host visitor does not)
    assert space.name_of(pick_ab.vary(pick, ["ts"])) == "pp 128x192 c1x2 s4 p8ns ts"
    with pytest.raises(ValueError):
        pick_ab.vary(pick, ["ts", "host"])


def test_no_words_turn_the_tail_split_and_whole_epilogue_off():
    pick = space.parse_name("coop 128x256 s3 p16 ts ew")
    assert pick_ab.parse_variants(["s4 no-ew", "c1x2 no-ts no-ew"]) == [
        ["s4", "no-ew"], ["c1x2", "no-ts", "no-ew"]]
    assert space.name_of(pick_ab.vary(pick, ["s4", "no-ew"])) == "coop 128x256 s4 p16 ts"
    assert space.name_of(pick_ab.vary(pick, ["c1x2", "s4", "no-ew", "no-ts"])) == (
        "coop 128x256 c1x2 s4 p16")
    # (a pick without them stays as it is; 'no-' only applies to the on/off words)
    assert space.name_of(pick_ab.vary(space.parse_name("coop 128x256 p8"), ["no-ts"])) == (
        "coop 128x256 p8")
    with pytest.raises(ValueError, match="'no-p8' is not one of"):
        pick_ab.parse_variants(["p8", "no-p8"])


def test_equal_variants_are_timed_once_under_the_first_index():
    pick = space.parse_name("pp 128x192 p8")
    impls = pick_ab.implementations([pick_ab.vary(pick, w) for w in (["p8"], ["p8ns"], [])]
                                    + [None])
    assert [(impl.name, i) for impl, i in impls] == [("moe_gemm pp 128x192 p8", 0),
                                                    ("moe_gemm pp 128x192 p8ns", 1)]
    assert impls[1][0].config.raster_along == "n" and impls[1][0].config.raster_serpentine


def test_against_a_table_the_baseline_is_the_pick_and_the_tables_entry_a_variant(tmp_path):
    assert pick_ab.parse_variants([], against=True) == [[]]
    assert pick_ab.parse_variants(["p8ns"], against=True) == [["p8ns"]]
    case = {"E": 8, "N": 4096, "K": 14336, "rows": 4096}
    k = ("varlen", "bfloat16", "bfloat16", 8, 4096, 14336, rows_bucket(4096 / 8))
    entry = {"form": k[0], "dtype": k[1], "out_dtype": k[2], "E": 8, "N": 4096, "K": 14336,
             "bucket": k[6], "rows": 4096, "us": 1.0,
             "config": {"schedule": "pingpong", "tile_m": 128, "tile_n": 160, "cluster_m": 1,
                        "cluster_n": 2, "raster_panel": 8}}
    doc = {"entries": [entry]}
    assert space.name_of(pick_ab.table_pick(doc, case)) == "pp 128x160 c1x2 p8"
    assert pick_ab.table_pick(doc, {**case, "rows": 64}) is None
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert pick_ab.main(["--against", str(bad), "--device", "cpu"]) == 2


def test_ratios_are_against_the_first_variant_and_the_default_is_marked():
    pick = space.parse_name("pp 128x192 p8ns")
    rows = [{"impl": "moe_gemm pp 128x192 p8", "variant": 0, "ms": 2.0},
            {"impl": "moe_gemm pp 128x192 p8ns", "variant": 1, "ms": 1.6},
            {"impl": "moe_gemm pp 128x192 p16", "variant": 2, "status": "error"}]
    lines = pick_ab.add_ratios(rows, pick, 2e12)
    assert [r.get("vs_first") for r in rows] == [1.0, 1.25, None]
    assert [r["is_default"] for r in rows] == [False, True, False]
    assert rows[1]["tflops"] == pytest.approx(2e12 / 1.6 / 1e9)
    assert len(lines) == 3 and "*" in lines[1]
    for r in rows:
        r["case"] = "X"
    (line0, line1) = pick_ab.summary(rows)
    assert "variant 0" in line0 and "median 1.000" in line0
    assert "median 1.250" in line1 and ">1% faster on 1" in line1


def test_a_failed_first_variant_gives_no_ratio():
    pick = space.parse_name("pp 128x192 p8")
    rows = [{"impl": "moe_gemm pp 128x192 p8", "variant": 0, "status": "error"},
            {"impl": "moe_gemm pp 128x192 p8ns", "variant": 1, "ms": 1.6}]
    pick_ab.add_ratios(rows, pick, 1e12)
    assert all("vs_first" not in r for r in rows)


def test_bad_arguments_and_a_cpu_run_say_what_is_wrong(capsys):
    assert pick_ab.main(["--vary", "p8"]) == 2
    assert "at least two" in capsys.readouterr().err
    assert pick_ab.main(["--vary", "p8", "--vary", "p8ns", "--projs", "up"]) == 2
    assert "--projs" in capsys.readouterr().err
    assert pick_ab.main(["--vary", "p8", "--vary", "p8ns", "--models", "NoSuchModel"]) == 2
    assert pick_ab.main(["--vary", "p8", "--vary", "p8ns", "--cases", "OLMoE-1B-7B/up/16"]) == 2
    assert "MODEL/gate_up|down/TOKENS" in capsys.readouterr().err
    assert pick_ab.main(["--vary", "p8", "--vary", "p8ns", "--cases",
                         "OLMoE-1B-7B/down/16", "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert pick_ab.main(["--vary", "p8", "--vary", "p8ns", "--device", "cpu"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_peers_rows_carry_times_but_no_ratio_and_stay_out_of_the_summary():
    pick = space.parse_name("pp 128x192 p8")
    rows = [{"impl": "moe_gemm pp 128x192 p8", "variant": 0, "ms": 2.0, "case": "X"},
            {"impl": "moe_gemm pp 128x192 p8ns", "variant": 1, "ms": 1.6, "case": "X"},
            {"impl": "QuACK varlen", "variant": -1, "ms": 1.0, "case": "X"}]
    lines = pick_ab.add_ratios(rows, pick, 2e12)
    assert "vs_first" not in rows[2] and rows[2]["tflops"] == pytest.approx(2e12 / 1e9)
    assert lines[2].lstrip().startswith("QuACK varlen")
    assert [line.split(":")[0] for line in pick_ab.summary(rows)] == ["variant 0", "variant 1"]


def test_variants_and_peers_go_through_the_zoo_harness_on_cpu():
    """On the CPU our pinned kernels are not applicable and say why; the peers' rows are
    there beside them (what --with-peers adds)."""
    import torch

    from benchmarks import zoo
    from benchmarks.clock import Clock
    from benchmarks.runner import Run, run_shape

    spec, _ = zoo.build_cases("OLMoE-1B-7B", "16", ["down"], 1234, smoke=True)[0]
    cpu = torch.device("cpu")
    run = Run(device=cpu, clock=Clock(cpu), reps=1, seed=1234, smoke=True, variants=False,
              skip=frozenset(), doc={"shapes": {}, "results": []}, out_path=None)
    pick = space.parse_name("pp 128x192 p8")
    impls = pick_ab.implementations([pick_ab.vary(pick, ["p8"]), pick_ab.vary(pick, ["p8ns"])])
    peers = zoo.implementations(run, False, 0.0, lambda: 0.0)[1:]
    assert [p.name for p in peers] == [zoo.GROUPED_MM_NAME, zoo.GRAPH_NAME, zoo.QUACK_NAME]
    run_shape(run, spec, [impl for impl, _ in impls] + peers)
    rows = run.doc["results"]
    assert [r["impl"] for r in rows] == [i.name for i, _ in impls] + [p.name for p in peers]
    assert rows[0]["status"] == "n/a" and "Hopper kernels" in rows[0]["reason"]


def _table(device: str, *entries: dict) -> dict:
    return {"format": "moe_gemm.tuned-table/1", "device": device, "entries": list(entries)}


def _entry(E: int, N: int, K: int, rows: int, name: str) -> dict:
    key = table_key({"E": E, "N": N, "K": K, "rows": rows})
    fields = space.parse_name(name)
    return {"form": key[0], "dtype": key[1], "out_dtype": key[2], "E": E, "N": N, "K": K,
            "bucket": key[6], "rows": rows, "us": 1.0, "name": name,
            "config": {k: v for k, v in fields.items() if v is not None}}


def _rows(case: str, E: int, N: int, K: int, rows: int, base_ms: float, theirs_ms: float):
    fields = {"case": case, "E": E, "N": N, "K": K, "rows": rows}
    return [{**fields, "impl": "moe_gemm a", "variant": 0, "ms": base_ms},
            {**fields, "impl": "moe_gemm b", "variant": 1, "ms": theirs_ms},
            {**fields, "impl": "QuACK varlen", "variant": -1, "ms": 0.5}]


def test_adopt_takes_the_against_pick_only_where_it_won_by_the_margin():
    mine = _table("NVIDIA H200", _entry(8, 4096, 14336, 4096, "pp 128x160 c1x2 p8"),
                  _entry(64, 2048, 1024, 65536, "pp 128x128 c1x2 p8"),
                  _entry(128, 5120, 8192, 4096, "pp 64x256 c1x2 s4 p8"))
    theirs = _table("NVIDIA H200", _entry(8, 4096, 14336, 4096, "coop 128x256 c1x2 p8ns"),
                    _entry(64, 2048, 1024, 65536, "pp 128x208 c1x2 p8ns"),
                    _entry(128, 5120, 8192, 4096, "coop 128x256 c1x2 p8ns"))
    results = (_rows("Mixtral-8x7B/down/2048", 8, 4096, 14336, 4096, 2.0, 1.9)  # 5.3% faster
               + _rows("OLMoE-1B-7B/down/8192", 64, 2048, 1024, 65536, 1.0, 0.99)  # 1%: noise
               + _rows("Llama-4-Maverick/down/4096", 128, 5120, 8192, 4096, 2.5, 2.6))  # slower
    mine["entries"][0]["zoo_check"] = {"how": "the zoo's own rows: this pick ... put back"}
    mine["entries"][2]["zoo_check"] = {"how": "kept"}
    lines = pick_ab.adopt(mine, theirs, results, 1, 0.013, "NVIDIA H200", "2026-12-02")
    assert lines == ["Mixtral-8x7B/down/2048: pp 128x160 c1x2 p8 -> coop 128x256 c1x2 p8ns "
                     "(1.053x)"]
    won = mine["entries"][0]
    # (the replaced pick's check is not carried over to the new one; an unchanged entry's stays)
    assert "zoo_check" not in won and mine["entries"][2]["zoo_check"] == {"how": "kept"}
    assert won["name"] == "coop 128x256 c1x2 p8ns" and won["config"] == theirs["entries"][0][
        "config"]
    assert won["zoo_ab"]["against"] == "pp 128x160 c1x2 p8" and won["zoo_ab"]["speedup"] == 1.053
    assert won["us"] == 1900.0  # the adopted pick's own time, not the old pick's
    assert [e["name"] for e in mine["entries"][1:]] == ["pp 128x128 c1x2 p8",
                                                         "pp 64x256 c1x2 s4 p8"]
    # the other table's entry stays its own object (a later change to one leaves the other)
    won["config"]["stages"] = 4
    assert "stages" not in theirs["entries"][0]["config"]


def test_adopt_runs_among_the_peers_unless_told_not_to():
    parse = pick_ab._parser().parse_args
    base = ["--cases", "Mixtral-8x7B/down/2048"]
    assert pick_ab.peers_wanted(parse(base + ["--against", "t.json", "--adopt", "a.json"]))
    assert not pick_ab.peers_wanted(parse(base + ["--against", "t.json", "--adopt", "a.json",
                                                  "--no-with-peers"]))
    assert not pick_ab.peers_wanted(parse(base + ["--against", "t.json"]))
    assert not pick_ab.peers_wanted(parse(base + ["--vary", "p8", "--vary", "p8ns"]))
    assert pick_ab.peers_wanted(parse(base + ["--vary", "p8", "--vary", "p8ns", "--with-peers"]))


def test_the_adopted_entrys_record_names_the_regime_that_decided():
    def tables():
        return (_table("NVIDIA H200", _entry(8, 4096, 14336, 4096, "pp 128x160 c1x2 p8")),
                _table("NVIDIA H200", _entry(8, 4096, 14336, 4096, "coop 128x256 c1x2 p8ns")))
    results = _rows("Mixtral-8x7B/down/2048", 8, 4096, 14336, 4096, 2.0, 1.9)
    mine, theirs = tables()
    pick_ab.adopt(mine, theirs, results, 1, 0.013, "NVIDIA H200", "2026-12-05", with_peers=True)
    assert mine["entries"][0]["zoo_ab"]["how"].endswith("among its peers)")
    mine, theirs = tables()
    pick_ab.adopt(mine, theirs, results, 1, 0.013, "NVIDIA H200", "2026-12-05")
    assert mine["entries"][0]["zoo_ab"]["how"].endswith("our kernels alone)")


def test_adopt_needs_against_a_readable_table_and_a_sane_margin(tmp_path, capsys):
    t = tmp_path / "t.json"
    t.write_text(json.dumps(_table("NVIDIA H200", _entry(8, 4096, 14336, 4096, "pp 128x160 p8"))))
    base = ["--cases", "Mixtral-8x7B/down/2048", "--device", "cuda"]
    assert pick_ab.main([*base, "--vary", "p8", "--vary", "p8ns", "--adopt", str(t)]) == 2
    assert "give --against" in capsys.readouterr().err
    assert pick_ab.main([*base, "--against", str(t), "--adopt", str(t), "--min-gain", "1.5"]) == 2
    assert "--min-gain" in capsys.readouterr().err
    assert pick_ab.main([*base, "--against", str(t), "--adopt", str(tmp_path / "no.json")]) == 2
    assert "--adopt" in capsys.readouterr().err


def test_adopt_takes_another_devices_picks_and_says_whose():
    """An H100 table's pick tried on an H200: only its config moves into the H200 table, with
    the time measured here, and the record names the table's device."""
    mine = _table("NVIDIA H200", _entry(8, 4096, 14336, 4096, "pp 128x160 p8"))
    theirs = _table("NVIDIA H100 80GB HBM3", _entry(8, 4096, 14336, 4096,
                                                    "coop 128x256 c1x2 p8ns"))
    results = _rows("Mixtral-8x7B/down/2048", 8, 4096, 14336, 4096, 2.0, 1.9)
    source = "--against" + pick_ab._foreign(theirs, mine)
    lines = pick_ab.adopt(mine, theirs, results, 1, 0.013, "NVIDIA H200", "2026-12-06",
                          with_peers=True, source=source)
    entry = mine["entries"][0]
    assert lines and entry["name"] == "coop 128x256 c1x2 p8ns"
    assert entry["us"] == 1900.0 and entry["zoo_ab"]["device"] == "NVIDIA H200"
    assert "(NVIDIA H100 80GB HBM3's table)" in entry["zoo_ab"]["how"]
    assert pick_ab._foreign(_table("NVIDIA H200"), mine) == ""


def test_against_config_is_a_table_of_that_config_at_each_cases_key():
    from benchmarks import zoo

    cases = zoo.named_cases("Mixtral-8x7B/down/2048,Llama-4-Scout/gate_up/8192", 1234, False)
    cases.append(cases[0])  # (a key named twice gets one entry)
    doc = pick_ab.config_table("swap 256x128", cases, "NVIDIA H100 80GB HBM3")
    assert doc["device"] == "NVIDIA H100 80GB HBM3"
    assert len(doc["entries"]) == len({table_key(f) for _, f in cases}) == 2
    for _, f in cases:
        entry = pick_ab.table_pick(doc, f)  # (what --against reads from a table)
        assert entry is not None and entry["swap_ab"] is True
        assert (entry["tile_m"], entry["tile_n"]) == (256, 128)
    assert [e["name"] for e in doc["entries"]] == ["swap 256x128 p8"] * 2
    with pytest.raises(ValueError, match="expected"):
        pick_ab.config_table("swap", cases, None)


def test_against_config_adopts_like_against_and_says_so():
    mine = _table("NVIDIA H100 80GB HBM3", _entry(8, 4096, 14336, 4096, "pp 128x160 c1x2 p8"))
    theirs = pick_ab.config_table(
        "swap 256x128", [(None, {"E": 8, "N": 4096, "K": 14336, "rows": 4096})],
        "NVIDIA H100 80GB HBM3")
    results = _rows("Mixtral-8x7B/down/2048", 8, 4096, 14336, 4096, 2.0, 1.8)
    lines = pick_ab.adopt(mine, theirs, results, 1, 0.013, "NVIDIA H100 80GB HBM3",
                          "2026-12-05", with_peers=True, source="--against-config 'swap 256x128'")
    assert lines == ["Mixtral-8x7B/down/2048: pp 128x160 c1x2 p8 -> swap 256x128 p8 (1.111x)"]
    won = mine["entries"][0]
    assert won["config"]["swap_ab"] is True
    assert won["zoo_ab"]["how"].startswith("benchmarks.pick_ab --against-config 'swap 256x128'")


def test_against_config_refuses_a_bad_name_and_against_beside_it(tmp_path, capsys):
    base = ["--cases", "Mixtral-8x7B/down/2048", "--device", "cuda"]
    assert pick_ab.main([*base, "--against-config", "swap"]) == 2
    assert "--against-config 'swap'" in capsys.readouterr().err
    t = tmp_path / "t.json"
    t.write_text(json.dumps(_table("NVIDIA H200", _entry(8, 4096, 14336, 4096, "pp 128x160 p8"))))
    assert pick_ab.main([*base, "--against", str(t), "--against-config", "swap 256x128"]) == 2
    assert "not both" in capsys.readouterr().err
    # A second rival was dropped without a word (the last one kept): refused, naming both.
    assert pick_ab.main([*base, "--against-config", "swap 256x128", "--against-config",
                         "pp 64x256 c2x1 pk"]) == 2
    assert "give one --against-config a run" in capsys.readouterr().err
