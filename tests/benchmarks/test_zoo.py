"""The model-zoo benchmark on the CPU (--smoke: tiny stand-ins, torch backend): the JSON's
shape, the ratio arithmetic, the budget stop and --resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import bench, zoo, zoo_report
from benchmarks.suite import DEFAULT_NAME, GROUPED_MM_NAME

ROW_KEYS = {"model", "proj", "tokens", "shape", "impl", "ms", "peer", "default", "floor_ms",
            "status", "case"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path: Path, *extra: str, name: str = "zoo.json") -> dict:
    out = tmp_path / name
    argv = ["--smoke", "--out", str(out), "--quiet", *extra]
    assert zoo.main(argv) == 0
    return json.loads(out.read_text())


def test_smoke_json_shape_and_ratios(tmp_path, capsys):
    doc = _run(tmp_path, "--models", "DeepSeek-V3,gpt-oss-20b", "--tokens", "1,16")
    assert isinstance(doc["device"], str) and isinstance(doc["date"], str)
    assert doc["complete"] is True and doc["not_run"] == []
    cases = {(r["model"], r["proj"], r["tokens"]) for r in doc["results"]}
    assert cases == {(m, p, t) for m in ("DeepSeek-V3", "gpt-oss-20b")
                     for p in ("gate_up", "down") for t in (1, 16)}
    for r in doc["results"]:
        assert ROW_KEYS <= set(r), r
        assert isinstance(r["peer"], bool) and isinstance(r["default"], bool)
        assert isinstance(r["tokens"], int) and isinstance(r["shape"], str)
    ceil = doc["ceilings"]
    for case in {r["case"] for r in doc["results"]}:
        rows = [r for r in doc["results"] if r["case"] == case]
        defaults = [r for r in rows if r["default"]]
        assert len(defaults) == 1 and defaults[0]["impl"] == DEFAULT_NAME  # one row per impl
        assert len({r["impl"] for r in rows}) == len(rows)
        d = defaults[0]
        assert d["status"] == "ok" and d["backend"] == "torch" and d["rel_err"] < 1e-2
        info = doc["cases"][case]
        assert d["shape"] == f"E={info['E']} N={info['N']} K={info['K']} rows={info['rows']}"
        # The arithmetic, from the case's bytes and FLOPs and the run's ceilings.
        mem = info["bytes"] / ceil["copy_bytes_per_s"] * 1e3
        cmp = info["flops"] / ceil["mm_flops_per_s"] * 1e3
        assert d["floor_ms"] == pytest.approx(max(mem, cmp))
        assert d["fraction_of_floor"] == pytest.approx(d["floor_ms"] / d["ms"])
        assert d["tflops"] == pytest.approx(info["flops"] / d["ms"] / 1e9)
        assert d["gbps"] == pytest.approx(info["bytes"] / d["ms"] / 1e6)
        peers = [r for r in rows if r["peer"] and r["status"] == "ok"]
        if peers:
            best = min(peers, key=lambda r: r["ms"])
            assert d["best_peer"] == best["impl"]
            assert d["vs_best_peer"] == pytest.approx(best["ms"] / d["ms"])
        # Peers that cannot run on a CPU say why.
        by = {r["impl"]: r for r in rows}
        assert by[zoo.GRAPH_NAME]["status"] == "n/a"
        assert "CUDA" in by[zoo.QUACK_NAME]["reason"]
    # gpt-oss stores its weights (E, K, N): the layout travels into the case.
    assert {r["layout"] for r in doc["results"] if r["model"] == "gpt-oss-20b"} == {"EKN"}
    assert {r["impl"] for r in doc["results"]} >= {DEFAULT_NAME, GROUPED_MM_NAME}
    assert doc["bar"]["cases"] == len({r["case"] for r in doc["results"]
                                       if r["default"] and r.get("vs_best_peer")})
    png = tmp_path / "zoo.png"
    if png.exists():
        assert png.read_bytes()[:8] == PNG_MAGIC
    else:
        pytest.importorskip("matplotlib")
        pytest.fail("matplotlib is installed but no PNG was written")
    table = capsys.readouterr().out
    assert "bar: default >= best peer on" in table and "DeepSeek-V3/gate_up/1" in table


def test_bar_and_derive_hand_computed():
    rows = [
        {"case": "a", "impl": "ours", "peer": False, "default": True, "status": "ok", "ms": 2.0},
        {"case": "a", "impl": "p1", "peer": True, "default": False, "status": "ok", "ms": 2.5},
        {"case": "a", "impl": "p2", "peer": True, "default": False, "status": "ok", "ms": 3.0},
        {"case": "a", "impl": "p3", "peer": True, "default": False, "status": "n/a",
         "ms": None},
    ]
    info = {"bytes": 4_000_000_000, "flops": 10**12}
    zoo_report.derive_case(rows, info, {"copy_bytes_per_s": 2e12, "mm_flops_per_s": 1e15})
    ours = rows[0]
    assert ours["floor_ms"] == pytest.approx(2.0) and ours["floor_bound"] == "memory"
    assert ours["fraction_of_floor"] == pytest.approx(1.0)
    assert ours["vs_best_peer"] == pytest.approx(1.25) and ours["best_peer"] == "p1"
    assert rows[2]["vs_best_peer"] == pytest.approx(2.5 / 3.0)
    assert "tflops" not in rows[3]

    def case(name, ratio):
        return {"case": name, "default": True, "status": "ok", "vs_best_peer": ratio,
                "ms": 1.0, "best_peer": "p"}

    # 9 of 10 at least as fast, none under 0.97: passes; one more loss or a 0.96: not.
    results = [case(str(i), 1.0 + i / 100) for i in range(9)] + [case("9", 0.98)]
    b = zoo_report.bar(results)
    assert b["pass"] and b["default_at_least_best_peer"] == 9 and b["cases"] == 10
    assert [w["case"] for w in b["peer_wins"]] == ["9"]
    assert not zoo_report.bar(results[:8] + [case("8", 0.99), case("9", 0.98)])["pass"]
    assert not zoo_report.bar(results[:9] + [case("9", 0.96)])["pass"]
    assert zoo_report.bar([])["pass"] is False
    assert b["peers_not_run"] == []
    # The first case's third peer did not run: the case counts, and the bar names the gap.
    zoo_report.derive_case(rows, info, {"copy_bytes_per_s": 2e12, "mm_flops_per_s": 1e15})
    rows[3]["reason"] = "over the cap"
    b = zoo_report.bar(rows)
    assert b["cases"] == 1 and b["peers_not_run"] == [
        {"case": "a", "peer": "p3", "status": "n/a", "reason": "over the cap"}]


def test_paired_round_ratios_class_the_losses():
    """Round by round, the fastest peer's sample over ours: its median and spread on the row;
    the bar counts losses in 9 of 10 rounds apart from those within the spread."""
    def rows(case, ours, p1, p2):
        return [
            {"case": case, "impl": "ours", "peer": False, "default": True, "status": "ok",
             "ms": sorted(ours)[len(ours) // 2], "ms_rounds": ours},
            {"case": case, "impl": "p1", "peer": True, "default": False, "status": "ok",
             "ms": sorted(p1)[len(p1) // 2], "ms_rounds": p1},
            {"case": case, "impl": "p2", "peer": True, "default": False, "status": "ok",
             "ms": sorted(p2)[len(p2) // 2], "ms_rounds": p2},
        ]

    info = {"bytes": 10**9, "flops": 10**12}
    ceilings = {"copy_bytes_per_s": 2e12, "mm_flops_per_s": 1e15}
    # a: ours 1.0 every round, the best peer 1.1 / 0.9 alternately (a tie by the spread);
    # b: the peers faster in every round (a loss); c: ours faster in every round.
    a = rows("a", [1.0] * 10, [1.1, 0.9] * 5, [2.0] * 10)
    b = rows("b", [1.0] * 10, [0.95] * 10, [0.97] * 10)
    c = rows("c", [1.0] * 10, [1.2] * 10, [1.3, 1.25] * 5)
    for case in (a, b, c):
        zoo_report.derive_case(case, info, ceilings)
    assert a[0]["vs_best_peer_rounds"] == {"median": 1.0,
                                           "p10": 0.9, "p90": 1.1}
    assert b[0]["vs_best_peer_rounds"] == {"median": 0.95, "p10": 0.95, "p90": 0.95}
    assert c[0]["vs_best_peer_rounds"]["p10"] == 1.2
    # a peer's ratio is taken against the other peers and ours
    assert b[1]["vs_best_peer_rounds"]["median"] == pytest.approx(round(0.97 / 0.95, 4))
    res = zoo_report.bar(a + b + c)
    assert (res["rounds_classed"], res["behind_in_90pct_of_rounds"],
            res["ahead_in_90pct_of_rounds"]) == (3, 1, 1)
    assert [w["rounds"]["p90"] for w in res["peer_wins"]] == [0.95]
    # rows without every round's samples are not classed
    del a[1]["ms_rounds"]
    zoo_report.derive_case(a, info, ceilings)
    assert "vs_best_peer_rounds" not in a[0]
    assert zoo_report.bar(a)["rounds_classed"] == 0


def test_budget_stops_cleanly_and_resume_finishes(tmp_path):
    # A budget that fits nothing: no case runs, the JSON says which were left and why.
    doc = _run(tmp_path, "--models", "OLMoE-1B-7B", "--tokens", "1,16", "--budget-s", "0.01")
    assert doc["results"] == [] and doc["complete"] is False
    assert doc["not_run"] == [f"OLMoE-1B-7B/{p}/{t}" for t in (1, 16)
                              for p in ("gate_up", "down")]
    assert doc["stopped"].startswith("budget")
    # Run part of it, then resume with more: the finished cases are kept, not rerun.
    first = _run(tmp_path, "--models", "OLMoE-1B-7B", "--tokens", "1", name="part.json")
    done = {r["case"] for r in first["results"]}
    assert done == {"OLMoE-1B-7B/gate_up/1", "OLMoE-1B-7B/down/1"}
    both = _run(tmp_path, "--models", "OLMoE-1B-7B", "--tokens", "1,16", "--resume",
                str(tmp_path / "part.json"), name="all.json")
    assert {r["case"] for r in both["results"]} == done | {"OLMoE-1B-7B/gate_up/16",
                                                            "OLMoE-1B-7B/down/16"}
    kept = [r for r in both["results"] if r["case"] in done]
    assert kept == first["results"]  # the earlier rows, untouched
    assert len(both["runs"]) == 2 and both["complete"] is True
    assert {both["cases"][c]["run"] for c in done} == {0}  # measured by the first run
    assert {both["cases"][c]["run"] for c in set(both["cases"]) - done} == {1}
    # --rerun: the selected cases are measured again and replace theirs; the others stay.
    again = _run(tmp_path, "--models", "OLMoE-1B-7B", "--tokens", "16", "--proj", "down",
                 "--resume", str(tmp_path / "all.json"), "--rerun", name="again.json")
    assert len(again["runs"]) == 3 and again["complete"] is True
    assert sorted(r["case"] for r in again["results"]) == sorted(
        r["case"] for r in both["results"])  # one row set per case, none lost or doubled
    assert again["cases"]["OLMoE-1B-7B/down/16"]["run"] == 2
    assert again["cases"]["OLMoE-1B-7B/gate_up/16"]["run"] == 1
    assert ([r for r in again["results"] if r["case"] == "OLMoE-1B-7B/gate_up/1"]
            == [r for r in both["results"] if r["case"] == "OLMoE-1B-7B/gate_up/1"])
    # A --rerun the budget cuts short loses nothing: the cases it could not measure again
    # keep the earlier rows and are listed as not re-measured (not as not run).
    short = _run(tmp_path, "--models", "OLMoE-1B-7B", "--tokens", "1,16", "--budget-s", "0.01",
                 "--resume", str(tmp_path / "again.json"), "--rerun", name="short.json")
    assert short["results"] == again["results"] and short["cases"] == again["cases"]
    assert short["not_run"] == [] and short["complete"] is True
    assert sorted(short["not_rerun"]) == sorted(again["cases"])
    assert "keep the earlier run's rows" in zoo_report.format_table(short)
    assert zoo.main(["--smoke", "--rerun", "--out", str(tmp_path / "x.json")]) == 2


def test_estimate_grows_with_the_case():
    ceil = {"copy_bytes_per_s": 3e12, "mm_flops_per_s": 7e14}
    small = {"E": 8, "N": 512, "K": 512, "rows": 16}
    big = {"E": 256, "N": 4096, "K": 7168, "rows": 262144}
    a = zoo.estimate_case_s(small, ceil, 15, False, 60.0, 1.0)
    b = zoo.estimate_case_s(big, ceil, 15, False, 60.0, 1.0)
    assert 2 < a < b
    assert zoo.estimate_case_s(big, ceil, 15, False, 60.0, 2.0) == pytest.approx(2 * b)
    # QuACK's autotune adds its estimate, unless that is over the cap (then it is skipped).
    tune = zoo.quack_autotune_seconds(30.0)
    with_tune = zoo.estimate_case_s(big, ceil, 15, True, 1e9, 1.0)
    assert with_tune - b > 10
    assert zoo.estimate_case_s(big, ceil, 15, True, 1.0, 1.0) == pytest.approx(b)
    assert tune > 100  # a 30 ms call: 22 configs x 250 calls


@pytest.mark.parametrize("argv, shown, not_shown", [
    (["--models", "kimi-k2,OLMoE-1B-7B"], ["Kimi-K2", "OLMoE-1B-7B"], ["Mixtral-8x7B"]),
    (["--fp8"], ["DeepSeek-V3"], ["OLMoE-1B-7B"])])
def test_list_keeps_to_the_models_and_fp8_given(argv, shown, not_shown, capsys):
    # `--list --models X` listed every model, X or not, and --fp8 was ignored there.
    assert zoo.main(["--list", *argv]) == 0
    names = [line[2:].split()[0] for line in capsys.readouterr().out.splitlines()
             if not line.startswith("(")]
    assert all(n in names for n in shown) and not any(n in names for n in not_shown), names


def test_list_refuses_an_unknown_model(capsys):
    assert zoo.main(["--list", "--models", "Nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --models: unknown model(s) Nope;") and err.count("\n") == 1


def test_cli(tmp_path, capsys):
    assert bench.main(["--suite", "zoo", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "DeepSeek-V3-EP8" in listed and "Kimi-K2" in listed and "*" in listed
    assert bench.main(["--suite", "nope"]) == 2
    assert zoo.main(["--smoke", "--models", "Nope"]) == 2
    assert zoo.main(["--smoke", "--proj", "up"]) == 2
    assert zoo.main(["--smoke", "--tokens", "-1"]) == 2
    (tmp_path / "other.json").write_text(json.dumps({"device": "NVIDIA H200", "cases": {},
                                                     "results": []}))
    assert zoo.main(["--smoke", "--resume", str(tmp_path / "other.json"), "--out",
                     str(tmp_path / "x.json")]) == 2
    assert "measured on NVIDIA H200" in capsys.readouterr().err


def test_the_winning_peers_choice_reaches_the_row_and_the_bar():
    rows = [
        {"case": "a", "impl": "ours", "peer": False, "default": True, "status": "ok", "ms": 3.0},
        {"case": "a", "impl": "q", "peer": True, "default": False, "status": "ok", "ms": 2.7,
         "chosen": "tile 128x192 pingpong"},
        {"case": "a", "impl": "m", "peer": True, "default": False, "status": "ok", "ms": 2.9},
    ]
    zoo_report.derive_case(rows, {"bytes": 10**9, "flops": 10**12},
                           {"copy_bytes_per_s": 2e12, "mm_flops_per_s": 1e15})
    assert rows[0]["best_peer"] == "q" and rows[0]["best_peer_chosen"] == "tile 128x192 pingpong"
    wins = zoo_report.bar(rows)["peer_wins"]
    assert wins == [{"case": "a", "vs_best_peer": 0.9, "best_peer": "q", "default_ms": 3.0,
                     "best_peer_chosen": "tile 128x192 pingpong"}]
    rows[1]["ms"] = 3.5  # the loop wins now, and it says nothing of a choice
    zoo_report.derive_case(rows, {"bytes": 10**9, "flops": 10**12},
                           {"copy_bytes_per_s": 2e12, "mm_flops_per_s": 1e15})
    assert rows[0]["best_peer"] == "m" and "best_peer_chosen" not in rows[0]


def test_table_shows_clocks_only_where_both_were_read():
    def doc(ours_mhz, peer_mhz):
        ours = {"case": "m/up/8", "impl": "ours", "default": True, "peer": False, "status": "ok",
                "ms": 2.0, "vs_best_peer": 0.9, "choice_source": "table:exact"}
        peer = {"case": "m/up/8", "impl": "q", "default": False, "peer": True, "status": "ok",
                "ms": 1.8}
        if ours_mhz:
            ours["sm_mhz"] = ours_mhz
        if peer_mhz:
            peer["sm_mhz"] = peer_mhz
        return {"device": "d", "date": "x", "ceilings": {}, "results": [ours, peer]}

    assert "MHz 1605/1755" in zoo_report.format_table(doc(1605.0, 1755.0))
    assert "MHz" not in zoo_report.format_table(doc(1605.0, None))
    assert "MHz" not in zoo_report.format_table(doc(None, None))


def test_shards_run_disjoint_cases_and_merge_into_one_run(tmp_path, capsys):
    sel = ("--models", "OLMoE-1B-7B,gpt-oss-20b", "--tokens", "1,16")
    whole = _run(tmp_path, *sel, name="whole.json")
    parts = [_run(tmp_path, *sel, "--shard", f"{i}/3", name=f"s{i}.json") for i in range(3)]
    names = [sorted(p["cases"]) for p in parts]
    assert sorted(sum(names, [])) == sorted(whole["cases"])  # every case once
    assert all(names) and not set(names[0]) & set(names[1])
    out = tmp_path / "merged.json"
    assert zoo.main(["--merge", str(tmp_path / "s0.json"), "--merge", str(tmp_path / "s1.json"),
                     "--merge", str(tmp_path / "s2.json"), "--out", str(out)]) == 0
    assert "3 files" in capsys.readouterr().out
    merged = json.loads(out.read_text())
    assert sorted(merged["cases"]) == sorted(whole["cases"]) and merged["complete"] is True
    assert len(merged["runs"]) == 3 and merged["not_run"] == []
    for i, p in enumerate(parts):  # each case says which shard's run measured it
        assert {merged["cases"][c]["run"] for c in p["cases"]} == {i}
        assert ([r for r in merged["results"] if r["case"] in p["cases"]]
                == p["results"])
    assert merged["bar"] == zoo_report.bar(merged["results"])
    assert merged["bar"]["cases"] == len(whole["cases"])
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def test_merge_replaces_cases_in_order_and_refuses_other_runs(tmp_path, capsys):
    sel = ("--models", "OLMoE-1B-7B", "--tokens", "1,16")
    base = _run(tmp_path, *sel, name="base.json")
    redo = _run(tmp_path, *sel, "--proj", "down", "--tokens", "16", name="redo.json")
    out = tmp_path / "m.json"
    assert zoo.main(["--merge", str(tmp_path / "base.json"), "--merge",
                     str(tmp_path / "redo.json"), "--out", str(out), "--png", "none"]) == 0
    m = json.loads(out.read_text())
    assert sorted(m["cases"]) == sorted(base["cases"])
    assert m["cases"]["OLMoE-1B-7B/down/16"]["run"] == 1
    assert ([r for r in m["results"] if r["case"] == "OLMoE-1B-7B/down/16"]
            == [r for r in redo["results"] if r["case"] == "OLMoE-1B-7B/down/16"])
    assert ([r for r in m["results"] if r["case"] == "OLMoE-1B-7B/down/1"]
            == [r for r in base["results"] if r["case"] == "OLMoE-1B-7B/down/1"])
    assert not out.with_suffix(".png").exists()
    capsys.readouterr()
    # Another seed (other routing), another device, a missing or broken file: exit 2.
    _run(tmp_path, *sel, "--seed", "7", name="seed7.json")
    other = dict(base, device="Some Other GPU")
    (tmp_path / "other.json").write_text(json.dumps(other))
    (tmp_path / "bad.json").write_text("[")
    (tmp_path / "list.json").write_text("[]")
    for f, words in (("seed7.json", "seed"), ("other.json", "Some Other GPU"),
                     ("list.json", "not a zoo run"),
                     ("missing.json", "missing.json"), ("bad.json", "--merge")):
        assert zoo.main(["--merge", str(tmp_path / "base.json"), "--merge",
                         str(tmp_path / f), "--out", str(tmp_path / "x.json")]) == 2, f
        assert words in capsys.readouterr().err, f
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(SystemExit):
        zoo.main(["--smoke", "--shard", "2/2"])


def test_gpus_runs_the_shards_as_processes_and_joins_them(tmp_path, capsys, monkeypatch):
    """--gpus N on the CPU (--smoke): N real shard processes, joined into --out; with
    --resume FILE --rerun the shards measure their cases again on top of FILE's."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sel = ("--models", "OLMoE-1B-7B", "--tokens", "1,16")
    doc = _run(tmp_path, *sel, "--gpus", "2", name="two.json")
    assert sorted(doc["cases"]) == sorted(f"OLMoE-1B-7B/{p}/{t}" for t in (1, 16)
                                          for p in ("gate_up", "down"))
    assert len(doc["runs"]) == 2 and doc["complete"] is True
    assert {c["run"] for c in doc["cases"].values()} == {0, 1}
    again = _run(tmp_path, *sel, "--proj", "down", "--gpus", "2", "--resume",
                 str(tmp_path / "two.json"), "--rerun", name="again.json")
    assert sorted(again["cases"]) == sorted(doc["cases"])
    assert len(again["runs"]) == 4  # the two of two.json, then one per shard
    for t in (1, 16):  # remeasured by the new shards; gate_up kept from two.json
        assert again["cases"][f"OLMoE-1B-7B/down/{t}"]["run"] in (2, 3)
        kept = f"OLMoE-1B-7B/gate_up/{t}"
        assert again["cases"][kept]["run"] == doc["cases"][kept]["run"]
        assert ([r for r in again["results"] if r["case"] == kept]
                == [r for r in doc["results"] if r["case"] == kept])
    capsys.readouterr()
    assert zoo.main(["--smoke", "--gpus", "2", "--shard", "0/2"]) == 2
    assert zoo.main(["--smoke", "--gpus", "0"]) == 2
    assert "--gpus 0" in capsys.readouterr().err


@pytest.mark.parametrize("content", [[1, 2], {"device": "cpu", "cases": [1]},
                                     {"device": "cpu", "cases": {"a": 1}, "results": []},
                                     {"device": "cpu", "cases": {}, "results": [3]},
                                     {"device": "cpu", "shapes": {}, "results": []}, "{"])
def test_resume_refuses_what_is_not_a_zoo_run(tmp_path, capsys, content):
    # A list or a bench-suite JSON raised AttributeError or was taken silently; --merge
    # already refused them: --resume says the same, before any case runs.
    bad = tmp_path / "zl.json"
    bad.write_text(content if isinstance(content, str) else json.dumps(content))
    out = tmp_path / "x.json"
    assert zoo.main(["--smoke", "--quiet", "--resume", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume {bad}") and err.count("\n") == 1, err
    assert "is not a zoo run" in err or "not JSON" in err
    assert not out.exists()
    assert zoo.main(["--smoke", "--resume", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


# The committed results' routing: the token-by-token draw, other counts for the same seed.
OLD_ROUTING = ("moe_gemm.tuning.zoo.topk_counts: top-k distinct experts per token, "
               "log-normal popularity sigma=0.5")


@pytest.mark.parametrize("changed, words", [
    ({"seed": 7}, "seed 7 (this run: 1234)"),
    ({"routing": OLD_ROUTING}, "routing"),
    ({"reps": 9}, "reps 9 (this run: 2)"),
    ({"smoke": False}, "smoke False (this run: True)")])
@pytest.mark.parametrize("gpus", ["1", "2"])
def test_resume_refuses_a_run_of_other_settings(tmp_path, capsys, monkeypatch, changed, words,
                                                 gpus):
    # Only device and dtype were checked: a run of another seed or routing draw was extended
    # with cases of other counts and data, as one table (--merge already refused the pair).
    # With --gpus, before any shard starts (each would refuse it: N errors, not one).
    sel = ("--models", "OLMoE-1B-7B", "--tokens", "1")
    base = _run(tmp_path, *sel, "--budget-s", "0.01", "--png", "none", name="base.json")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**base, "settings": {**base["settings"], **changed}}))
    monkeypatch.setattr(zoo, "launch_shards", lambda *a: pytest.fail("shards started"))
    capsys.readouterr()
    out = tmp_path / "x.json"
    assert zoo.main(["--smoke", "--quiet", *sel, "--gpus", gpus, "--resume", str(old),
                     "--out", str(out), "--png", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume {old} was run with other settings: ")
    assert words in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize("argv, words", [
    (["--budget-s", "-5"], "--budget-s must be positive"),
    (["--budget-s", "0"], "--budget-s must be positive"),
    (["--budget-s", "nan"], "--budget-s must be positive"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--reps", "-2"], "--reps must be at least 1"),
    (["--proj", ""], "--proj is empty"),
    (["--models", ""], "--models is empty"),
    (["--tokens", " "], "--tokens is empty"),
    (["--models", ","], "unknown model"),
    (["--gpus", "0"], "--gpus 0: must be >= 1"),
    (["--quack-tune-cap-s", "-1"], "--quack-tune-cap-s must be positive")])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys, argv, words):
    # --budget-s -5 ran nothing, wrote a JSON and exited 0; --reps 0 became the default;
    # --models "" ran every default model.
    out = tmp_path / "x.json"
    assert zoo.main(["--smoke", "--quiet", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
    assert not out.exists()


def test_an_out_that_cannot_be_written_is_refused_before_any_case(tmp_path, capsys):
    # --out naming a folder ran every case, then failed renaming <out>.tmp onto the folder
    # (and left the .tmp file behind).
    folder = tmp_path / "results"
    folder.mkdir()
    assert zoo.main(["--smoke", "--quiet", "--models", "OLMoE-1B-7B", "--tokens", "1",
                     "--out", str(folder), "--png", "none"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out {folder}: is a folder, not a file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_quack_cache_points_quacks_autotuner_at_the_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("QUACK_CACHE_DIR", raising=False)
    monkeypatch.delenv("QUACK_CACHE_AUTOTUNING", raising=False)
    cache = tmp_path / "quack" / "cache"
    out = tmp_path / "zoo.json"
    assert zoo.main(["--smoke", "--quiet", "--models", "OLMoE-1B-7B", "--tokens", "1",
                     "--proj", "down", "--quack-cache", str(cache), "--out", str(out),
                     "--png", "none"]) == 0
    assert cache.is_dir() and os.environ["QUACK_CACHE_DIR"] == str(cache.resolve())
    assert os.environ["QUACK_CACHE_AUTOTUNING"] == "1"
    assert json.loads(out.read_text())["settings"]["quack_autotune_cache"] is True
    capsys.readouterr()
    # A path that cannot be a folder is refused before anything runs.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.delenv("QUACK_CACHE_DIR")
    assert zoo.main(["--smoke", "--quiet", "--quack-cache", str(blocker / "sub"),
                     "--out", str(tmp_path / "y.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --quack-cache") and err.count("\n") == 1, err
    assert "QUACK_CACHE_DIR" not in os.environ and not (tmp_path / "y.json").exists()
    assert zoo.main(["--smoke", "--quiet", "--quack-cache", "", "--out",
                     str(tmp_path / "y.json")]) == 2


def test_merge_refuses_an_out_or_png_that_cannot_be_written(tmp_path, capsys):
    # --merge --out FOLDER raised IsADirectoryError out of write_json (a traceback, exit 1)
    # and left FOLDER.tmp behind; a --png folder was saved as FOLDER.png and reported written.
    _run(tmp_path, "--models", "OLMoE-1B-7B", "--tokens", "1", name="a.json")
    folder = tmp_path / "folder"
    folder.mkdir()
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv, words in ((["--out", str(folder)], f"--out {folder}: is a folder"),
                        (["--out", str(tmp_path / "m.json"), "--png", str(folder)],
                         f"--png {folder}: is a folder")):
        assert zoo.main(["--merge", str(tmp_path / "a.json"), *argv]) == 2
        err = capsys.readouterr().err
        assert err == f"error: {words}, not a file\n", err
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        assert list(folder.iterdir()) == []


def test_an_unknown_skip_impl_is_refused_with_the_names(tmp_path, capsys):
    # A misspelt --skip-impl matched no row and skipped nothing, without a word: the run then
    # timed (or crashed in) what it was asked to leave out.
    out = tmp_path / "x.json"
    for argv, bad in ((["--skip-impl", "QuACK varln"], "'QuACK varln'"),
                      (["--skip-impl", "QuACK varlen", "--skip-impl", "torch.mm loop"],
                       "'torch.mm loop'"),
                      (["--fp8", "--models", "DeepSeek-V3", "--skip-impl", "QuACK varlen"],
                       "'QuACK varlen'")):  # a bf16 row's name, in an FP8 run
        assert zoo.main(["--smoke", "--quiet", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --skip-impl: no implementation named {bad};"), err
        assert err.count("\n") == 1 and not out.exists()
        names = zoo.impl_names("--fp8" in argv)
        assert all(repr(n) in err for n in names), err
    assert zoo.impl_names(False) == [i.name for i in zoo.implementations(
        None, True, 1.0, lambda: 0.0)]


def test_a_known_skip_impl_leaves_that_row_out(tmp_path):
    doc = _run(tmp_path, "--models", "OLMoE-1B-7B", "--tokens", "1", "--proj", "down",
               "--png", "none", "--no-quack-tuned", "--skip-impl", zoo.GRAPH_NAME)
    impls = {r["impl"] for r in doc["results"]}
    assert DEFAULT_NAME in impls and GROUPED_MM_NAME in impls and zoo.GRAPH_NAME not in impls


def test_out_and_out_dir_together_are_refused(tmp_path, capsys, monkeypatch):
    # --out won and --out-dir was ignored without a word.
    folder = tmp_path / "dir"
    out = tmp_path / "x.json"
    assert zoo.main(["--smoke", "--quiet", "--out", str(out), "--out-dir", str(folder)]) == 2
    assert capsys.readouterr().err == (
        "error: --out and --out-dir both name the results file: give one\n")
    assert list(tmp_path.iterdir()) == []
    # --gpus gives each shard its own --out after the caller's --out-dir: still a run.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert zoo.main(["--smoke", "--quiet", "--models", "OLMoE-1B-7B", "--tokens", "1,16",
                     "--proj", "down", "--png", "none", "--gpus", "2",
                     "--out-dir", str(folder)]) == 0
    [written] = folder.iterdir()
    assert written.name.startswith("zoo-cpu-") and len(json.loads(written.read_text())[
        "cases"]) == 2


QUACK_REPR = ("config: GemmConfig(tile_m=128, tile_n=256, tile_k=None, num_warps=None, "
              "pingpong=False, is_dynamic_persistent=False, cluster_m=1, cluster_n=2, "
              "cluster_k=1, split_k=1, swap_ab=False, max_swizzle_size=8, "
              "device_capacity=9, use_tma_gather=False)")


def test_quacks_recorded_choice_reads_back_as_its_config_fields():
    fields = zoo.quack_config_fields(QUACK_REPR)
    assert fields["tile_m"] == 128 and fields["tile_n"] == 256 and fields["cluster_n"] == 2
    assert fields["pingpong"] is False and fields["tile_k"] is None
    assert len(fields) == 14
    for bad in ("n/a", "GemmConfig(tile_m=128)", "GemmConfig(tile_m=x, tile_n=1)",
                "GemmConfig(tile_m=1, tile_n=2, 3)"):
        with pytest.raises(ValueError, match="QuACK's choice"):
            zoo.quack_config_fields(bad)


def _zoo_run_with(tmp_path: Path, rows: list[dict], device: str = "NVIDIA H200") -> Path:
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"device": device, "cases": {}, "results": rows}))
    return path


def test_quack_chosen_takes_each_cases_recorded_choice(tmp_path):
    ok = {"impl": zoo.QUACK_TUNED_NAME, "status": "ok", "case": "M/gate_up/8192",
          "shape": "E=8 N=1 K=1 rows=1", "chosen": QUACK_REPR}
    rows = [ok, dict(ok, case="M/down/8192", status="failed"),  # not timed: not replayed
            dict(ok, case="M/down/16", chosen=None),  # nothing said: autotuned
            dict(ok, impl=zoo.QUACK_NAME, case="M/down/2048")]  # untuned QuACK
    device, chosen = zoo.read_quack_chosen(str(_zoo_run_with(tmp_path, rows)))
    assert device == "NVIDIA H200" and chosen == {"M/gate_up/8192": QUACK_REPR}


@pytest.mark.parametrize("rows, words", [
    ([], "no case where QuACK tuned ran"),
    ([{"impl": "QuACK varlen (tuned)", "status": "ok", "case": "a", "shape": "s",
       "chosen": "GemmConfig(tile_m=?)"}], "cannot read"),
])
def test_a_quack_chosen_file_that_cannot_be_used_is_refused(tmp_path, capsys, rows, words):
    path = _zoo_run_with(tmp_path, rows)
    assert zoo.main(["--smoke", "--quiet", "--quack-chosen", str(path), "--out",
                     str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
    assert zoo.main(["--smoke", "--quack-chosen", str(tmp_path / "missing.json")]) == 2
    assert "--quack-chosen" in capsys.readouterr().err


def test_quack_chosen_from_another_gpu_kind_is_refused(tmp_path, capsys):
    ok = {"impl": zoo.QUACK_TUNED_NAME, "status": "ok", "case": "M/gate_up/8192",
          "shape": "E=8 N=1 K=1 rows=1", "chosen": QUACK_REPR}
    path = _zoo_run_with(tmp_path, [ok])
    out = tmp_path / "x.json"
    assert zoo.main(["--smoke", "--quiet", "--quack-chosen", str(path), "--out",
                     str(out)]) == 2
    assert "was measured on NVIDIA H200" in capsys.readouterr().err


@pytest.mark.parametrize("recorded", [QUACK_REPR, QUACK_REPR + " (replayed)"])
def test_a_replayed_choice_says_replayed_once(monkeypatch, recorded):
    # A run that replays an earlier run's choice, itself replayed, labels its row once.
    seen = []
    monkeypatch.setattr(zoo, "build_quack_config",
                        lambda inp, device, fields, describe: seen.append((fields, describe)))
    spec = type("Spec", (), {"name": "M/gate_up/8192"})()
    build = zoo._replayed_quack_tuned({"M/gate_up/8192": recorded}, None)
    build(spec, None, None)
    fields, label = seen[0]
    assert label == QUACK_REPR + " (replayed)"
    assert fields == zoo.quack_config_fields(QUACK_REPR)


def test_cases_measures_just_the_rows_named_in_their_order(tmp_path, capsys):
    doc = _run(tmp_path, "--cases", "OLMoE-1B-7B/down/16,DeepSeek-V3/gate_up/1,"
               "OLMoE-1B-7B/down/16")
    assert list(doc["cases"]) == ["OLMoE-1B-7B/down/16", "DeepSeek-V3/gate_up/1"]
    assert {r["case"] for r in doc["results"]} == set(doc["cases"])
    assert doc["complete"] is True and doc["not_run"] == []
    # Measured again on their own: the other case of the file keeps its rows and its run.
    again = _run(tmp_path, "--cases", "DeepSeek-V3/gate_up/1", "--resume",
                 str(tmp_path / "zoo.json"), "--rerun", name="again.json")
    assert again["cases"]["DeepSeek-V3/gate_up/1"]["run"] == 1
    assert again["cases"]["OLMoE-1B-7B/down/16"]["run"] == 0
    assert ([r for r in again["results"] if r["case"] == "OLMoE-1B-7B/down/16"]
            == [r for r in doc["results"] if r["case"] == "OLMoE-1B-7B/down/16"])
    capsys.readouterr()
    for argv, says in ((["--cases", "OLMoE-1B-7B/down/16", "--models", "OLMoE-1B-7B"], "not both"),
                       (["--cases", "OLMoE-1B-7B/down/16", "--proj", "down"], "not both"),
                       (["--cases", "OLMoE-1B-7B/up/16"], "--cases: a case is"),
                       (["--cases", "Nope/down/16"], "Nope"),
                       (["--cases", ""], "--cases")):
        assert zoo.main(["--smoke", "--out", str(tmp_path / "x.json"), *argv]) == 2, argv
        assert says in capsys.readouterr().err, argv
    assert not (tmp_path / "x.json").exists()


def test_no_compiling_ahead_without_a_writable_kernel_cache(tmp_path, monkeypatch):
    # The workers hand their kernels over through the disk cache; without one every kernel
    # would be compiled twice. (The device checks are stood in for: no GPU here.)
    import torch

    from moe_gemm import capability

    monkeypatch.setattr(capability, "cute_problem", lambda device=None: None)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(blocker))
    monkeypatch.delenv("MOE_GEMM_DISK_CACHE", raising=False)
    logged: list[str] = []
    assert zoo._precompile([], torch.device("cuda"), logged.append) is None
    assert len(logged) == 1 and "not compiling ahead" in logged[0] and str(blocker) in logged[0]
