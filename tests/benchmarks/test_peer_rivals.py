"""benchmarks.peer_rivals: a zoo run's QuACK-tuned choices as re-rank rivals (no GPU)."""

from __future__ import annotations

import json

import pytest

from benchmarks import peer_rivals
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
