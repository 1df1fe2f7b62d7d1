"""benchmarks.peer_rivals: a zoo run's QuACK-tuned choices as re-rank rivals (no GPU)."""

from __future__ import annotations

import json

import pytest

from benchmarks import peer_rivals
from benchmarks.ab_cases import table_key
from benchmarks.suite import DEFAULT_NAME, QUACK_NAME, QUACK_TUNED_NAME
from moe_gemm.tuning import cli, space

COOP = ("config: GemmConfig(tile_m=128, tile_n=256, tile_k=None, pingpong=False, "
        "cluster_m=1, cluster_n=2, max_swizzle_size=8) (replayed)")
PP = "config: GemmConfig(tile_m=128, tile_n=192, pingpong=True, cluster_m=1, cluster_n=1)"


def _run() -> dict:
    rows = [
        {"impl": QUACK_TUNED_NAME, "status": "ok", "case": "Kimi-K2/gate_up/8192",
         "chosen": COOP},
        {"impl": DEFAULT_NAME, "default": True, "case": "Kimi-K2/gate_up/8192",
         "vs_best_peer": 0.95},
        {"impl": QUACK_TUNED_NAME, "status": "ok", "case": "OLMoE-1B-7B/down/2048",
         "chosen": PP},
        {"impl": DEFAULT_NAME, "default": True, "case": "OLMoE-1B-7B/down/2048",
         "vs_best_peer": 1.04},
        {"impl": QUACK_TUNED_NAME, "status": "n/a", "case": "GLM-4.5/down/16", "chosen": PP},
        {"impl": QUACK_NAME, "status": "ok", "case": "GLM-4.5/gate_up/16", "chosen": PP},
    ]
    return {"device": "NVIDIA H200", "cases": {}, "results": rows}


def test_each_cases_quack_choice_in_our_words_under_the_tuners_label():
    rivals = peer_rivals.peer_rivals(_run())
    assert rivals == {"Kimi-K2/gate_up tokens=8192": ["coop 128x256 c1x2 p8ns"],
                      "OLMoE-1B-7B/down tokens=2048": ["pp 128x192 p8ns"]}
    # the names read back as our configs, QuACK's tile order (panels of 8 n-tiles, serpentine)
    fields = space.parse_name(rivals["Kimi-K2/gate_up tokens=8192"][0])
    assert (fields["schedule"], fields["tile_m"], fields["tile_n"], fields["cluster_n"]) == (
        "cooperative", 128, 256, 2)
    assert fields["raster_along"] == "n" and fields["raster_serpentine"] is True
    assert peer_rivals.peer_rivals(_run(), only_lost=True) == {
        "Kimi-K2/gate_up tokens=8192": ["coop 128x256 c1x2 p8ns"]}


def test_the_labels_are_the_tuners_own():
    shapes = cli.zoo_shapes("Kimi-K2", "8192", "bfloat16", "bfloat16", 1234)
    assert peer_rivals.tuner_label("Kimi-K2/gate_up/8192") in {s.label for s in shapes}
    with pytest.raises(ValueError, match="Model/proj/tokens"):
        peer_rivals.tuner_label("Kimi-K2/gate_up")


def test_cli_writes_a_file_the_tuner_reads(tmp_path, capsys):
    run, out = tmp_path / "zoo.json", tmp_path / "rivals.json"
    run.write_text(json.dumps(_run()))
    assert peer_rivals.main([str(run), "--out", str(out)]) == 0
    assert "2 shapes" in capsys.readouterr().out
    args = cli.parse_args(["--zoo", "--rerank", "t.json", "--rivals-file", str(out)])
    by_label = cli.rivals_by_label(args)
    assert set(by_label) == {"Kimi-K2/gate_up tokens=8192", "OLMoE-1B-7B/down tokens=2048"}
    assert by_label["OLMoE-1B-7B/down tokens=2048"][0]["tile_n"] == 192


@pytest.mark.parametrize("content, words", [
    ("{", "not JSON"), ("[1, 2]", "is not a zoo run"),
    ('{"device": "x", "cases": {}, "results": []}', "no case where QuACK tuned ran")])
def test_a_run_it_cannot_use_is_refused(tmp_path, capsys, content, words):
    run = tmp_path / "zoo.json"
    run.write_text(content)
    assert peer_rivals.main([str(run), "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err and err.count("\n") == 1, err
    assert peer_rivals.main([str(tmp_path / "missing.json"), "--out", "x.json"]) == 2


def _table_run() -> tuple[dict, dict]:
    """A zoo run whose two cases carry their sizes, and a table with entries for both (the
    OLMoE one already QuACK's choice) and none for a third case."""
    run = _run()
    sizes = {"Kimi-K2/gate_up/8192": (384, 4096, 7168, 65536),
             "OLMoE-1B-7B/down/2048": (64, 2048, 1024, 16384)}
    for r in run["results"]:
        if r.get("default"):
            r.update(zip(("E", "N", "K", "rows"), sizes[r["case"]]))
    entries = []
    for (E, N, K, rows), name in zip(sizes.values(), ["coop 128x256 s3 p16 ts", "pp 128x192 p8ns"]):
        key = table_key({"E": E, "N": N, "K": K, "rows": rows})
        fields = space.parse_name(name)
        config = {k: v for k, v in fields.items() if v is not None}
        entries.append({"form": key[0], "dtype": key[1], "out_dtype": key[2], "E": E, "N": N,
                        "K": K, "bucket": key[6], "rows": rows, "us": 1.0, "name": name,
                        "config": {**config, "swap_ab": False}})
    return run, {"format": "moe_gemm.tuned-table/1", "device": "NVIDIA H200", "sm_count": 132,
                 "entries": entries}


def test_a_rival_table_holds_quacks_choice_where_it_differs():
    run, table = _table_run()
    out, changed = peer_rivals.rival_table(run, table)
    assert changed == ["Kimi-K2/gate_up/8192"]  # OLMoE's entry is QuACK's choice already
    kimi = out["entries"][0]
    assert kimi["name"] == "coop 128x256 c1x2 p8ns"
    assert (kimi["config"]["cluster_n"], kimi["config"]["raster_along"]) == (2, "n")
    assert kimi["config"]["swap_ab"] is False  # (the entry's own swap decision is kept)
    assert table["entries"][0]["name"] == "coop 128x256 s3 p16 ts"  # the input is untouched
    assert peer_rivals.rival_table(run, table, only_lost=True)[1] == ["Kimi-K2/gate_up/8192"]


def test_cli_table_mode_writes_a_table_and_names_the_cases(tmp_path, capsys):
    run, table = _table_run()
    zoo, shipped, out = tmp_path / "zoo.json", tmp_path / "table.json", tmp_path / "T.json"
    zoo.write_text(json.dumps(run))
    shipped.write_text(json.dumps(table))
    assert peer_rivals.main([str(zoo), "--table", str(shipped), "--out", str(out)]) == 0
    assert "cases: Kimi-K2/gate_up/8192" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert {e["name"] for e in written["entries"]} == {"coop 128x256 c1x2 p8ns",
                                                       "pp 128x192 p8ns"}
    # nothing left to time, another GPU's table, a missing table: refused with a reason
    assert peer_rivals.main([str(zoo), "--table", str(out), "--out", str(out)]) == 2
    assert "nothing to time" in capsys.readouterr().err
    shipped.write_text(json.dumps({**table, "device": "NVIDIA H100 80GB HBM3"}))
    assert peer_rivals.main([str(zoo), "--table", str(shipped), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error:")
    assert peer_rivals.main([str(zoo), "--table", str(tmp_path / "no.json"), "--out",
                             str(out)]) == 2
    assert "no.json" in capsys.readouterr().err
