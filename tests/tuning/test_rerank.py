"""moe_gemm.tuning.rerank on the CPU: which configs a re-rank times, when the pick changes, what
the entry records, and the CLI's checks (timing itself runs on a GPU)."""

from __future__ import annotations

import os

import pytest
from test_search import FakeRunner

from moe_gemm.ops.tuned import rows_bucket
from moe_gemm.tuning import cli, rerank, space, table_io
from moe_gemm.tuning.tuner import TuneShape

SHAPE = TuneShape("varlen", 4, 512, 1024, 4096, counts=(1024,) * 4, label="toy")


def _sample(name: str, us: float, rows: int = 4096, E: int = 4, N: int = 512) -> dict:
    return {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E, "N": N,
            "K": 1024, "rows": rows, "config": space.parse_name(name), "us": us}


def _table(pick: str = "pp 128x192 p8") -> dict:
    k = SHAPE.key()
    config = {f: v for f, v in space.parse_name(pick).items() if v is not None}
    entry = {"form": k.form, "dtype": k.dtype, "out_dtype": k.out_dtype, "E": k.E, "N": k.N,
             "K": k.K, "bucket": k.bucket, "rows": SHAPE.rows, "config": config, "us": 100.0,
             "name": pick}
    samples = [_sample("pp 128x192 p8", 100.0), _sample("pp 128x128 c1x2 p8", 101.0),
               _sample("pp 128x192 p8ns", 102.0), _sample("coop 128x256 p8", 103.0),
               _sample("coop 128x256 s3 p16 ts ew", 150.0),
               _sample("pp 64x256 p8", 50.0, N=1024),  # another shape: faster, not a rival
               _sample("pp 64x128 p8", 40.0, rows=64)]  # another rows bucket
    assert rows_bucket(64 / 4) != k.bucket
    return {"device": "X", "entries": [entry], "samples": samples}


def test_leaders_are_the_pick_and_the_fastest_other_configs_of_its_key():
    found = rerank.leaders(_table(), SHAPE, top=2)
    assert space.name_of(found.pick) == "pp 128x192 p8"
    assert [space.name_of(f) for f in found.rivals] == ["pp 128x128 c1x2 p8", "pp 128x192 p8ns"]
    found = rerank.leaders(_table(), SHAPE, top=10)
    assert len(found.rivals) == 4  # every other config of the key, none of other shapes
    other = TuneShape("varlen", 4, 512, 2048, 4096, counts=(1024,) * 4)
    assert rerank.leaders(_table(), other, top=2) is None


def _costs(times: dict[str, float]):
    return lambda f: times[space.name_of(f)] / 1e3


RULES = "coop 128x256 s3 p16 ts ew"


@pytest.mark.parametrize("rival_us,expect", [(97.0, "pp 128x128 c1x2 p8"),
                                             (99.5, "pp 128x192 p8")])
def test_a_rival_replaces_the_pick_only_beyond_the_margin(rival_us, expect):
    found = rerank.leaders(_table(), SHAPE, top=1)
    times = {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": rival_us, RULES: 150.0}
    res = rerank.rerank_shape(SHAPE, FakeRunner(_costs(times)), found, rounds=5, margin=0.01,
                              regime="eager")
    assert res.winner.name == expect
    entry = res.entry()
    assert entry["name"] == expect and entry["config"]["tile_m"] == 128
    assert entry["rerank"]["from"] == "pp 128x192 p8"
    assert entry["rerank"]["from_us"] == pytest.approx(100.0)
    assert entry["rerank"]["regime"] == "eager"
    assert set(entry["rerank"]["timed"]) == {"pp 128x192 p8", "pp 128x128 c1x2 p8", RULES}
    assert table_io._valid_entry(entry)
    assert res.samples()  # timed, though the CLI keeps the source table's samples


def test_the_rules_choice_can_win_and_a_broken_rival_never_does():
    found = rerank.leaders(_table(), SHAPE, top=2)
    times = {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": 10.0, "pp 128x192 p8ns": 99.8,
             RULES: 90.0}
    res = rerank.rerank_shape(SHAPE, FakeRunner(_costs(times), broken={"pp 128x128 c1x2 p8"}),
                              found, rounds=5)
    assert res.winner.name == RULES


def test_rerank_takes_the_zoos_regime_unless_told_otherwise():
    args = cli.parse_args(["--zoo", "--rerank", "t.json"])
    assert (args.timing, args.rest_ms, args.sample_ms) == ("eager", 0.0, 5.0)
    args = cli.parse_args(["--zoo", "--rerank", "t.json", "--timing", "graph", "--rest-ms",
                           "1"])
    assert (args.timing, args.rest_ms, args.sample_ms) == ("graph", 1.0, 5.0)
    args = cli.parse_args(["--zoo"])
    assert (args.timing, args.top, args.margin) == ("graph", rerank.DEFAULT_TOP,
                                                    rerank.DEFAULT_MARGIN)


@pytest.mark.parametrize("extra,message", [
    (["--configs", "pp 128x192"], "give one"),
    (["--top", "0"], "--top 0"),
    (["--margin", "1"], "--margin 1"),
    (["--margin", "nan"], "--margin nan"),
])
def test_bad_rerank_options_are_refused(extra, message, capsys):
    assert cli.main(["--zoo", "--rerank", "t.json", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_rerank_table_is_refused_before_the_list(capsys, tmp_path):
    # `--rerank missing.json --zoo --list` listed the shapes and exited 0; the run would stop
    # at the table.
    assert cli.main(["--zoo", "--list", "--rerank", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.endswith("missing.json: no such table file\n")


def test_an_empty_rerank_table_name_is_refused(capsys):
    assert cli.main(["--zoo", "--rerank", ""]) == 2
    assert "--rerank" in capsys.readouterr().err


def _fake_gpu(monkeypatch, times: dict[str, float]):
    """cli.run's device side replaced: a CPU 'device' named X, no compiles, a FakeRunner."""
    import types

    import torch

    from moe_gemm import capability
    from moe_gemm.ops import versions
    from moe_gemm.tuning import ceilings, compile_pool
    from moe_gemm.tuning import runner as runner_mod

    monkeypatch.setattr(cli, "kernel_device", lambda spec: (torch.device("cpu"), None))
    monkeypatch.setattr(capability, "device_name", lambda device: "X")
    monkeypatch.setattr(capability, "sm_count", lambda device: 132)
    monkeypatch.setattr(versions, "runtime_versions", lambda name: {"device": name})
    monkeypatch.setattr(ceilings, "measure_ceilings", lambda device: {
        "copy_bytes_per_s": 1e12, "mm_flops_per_s": 1e14})
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(L2_cache_size=1 << 20))

    class Pool:
        workers = 1

        def __init__(self, workers=None):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, keys):
            pass

    class Runner(FakeRunner):
        def __init__(self, shape, device, pool, **kw):
            super().__init__(_costs(times))

        def close(self):
            pass

    monkeypatch.setattr(compile_pool, "CompilePool", Pool)
    monkeypatch.setattr(runner_mod, "ShapeRunner", Runner)
    monkeypatch.setattr(runner_mod, "compile_key_for", lambda shape, fields, nsm: "key")
    monkeypatch.setattr(runner_mod, "rules_fields", lambda shape, nsm: space.parse_name(RULES))


def test_the_cli_reranks_into_a_table_and_keeps_its_samples(monkeypatch, tmp_path, capsys):
    """End to end on fakes: a shape with an entry in the source table is re-ranked, one
    without is skipped; the winner replaces the entry at --out, whose samples stay as they
    were (a re-rank's are in another regime)."""
    import json

    times = {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": 90.0, "pp 128x192 p8ns": 99.0,
             "coop 128x256 p8": 120.0, RULES: 150.0}
    _fake_gpu(monkeypatch, times)
    (tuned_shape,) = cli.parse_shape_items(["4,512,1024,4096"], "varlen", "ENK", "bfloat16",
                                           "bfloat16", 1234)
    k = tuned_shape.key()
    entry = {"form": k.form, "dtype": k.dtype, "out_dtype": k.out_dtype, "E": k.E, "N": k.N,
             "K": k.K, "bucket": k.bucket, "rows": tuned_shape.rows, "us": 100.0,
             "name": "pp 128x192 p8", "config": {
                 f: v for f, v in space.parse_name("pp 128x192 p8").items() if v is not None}}
    samples = [dict(_sample(n, us), rows=tuned_shape.rows) for n, us in (
        ("pp 128x192 p8", 100.0), ("pp 128x128 c1x2 p8", 101.0), ("pp 128x192 p8ns", 102.0),
        ("coop 128x256 p8", 103.0))]
    table = {"format": "moe_gemm.tuned-table/1", "device": "X", "sm_count": 132,
             "versions": {}, "ceilings": {}, "entries": [entry], "samples": samples}
    path = tmp_path / "X.json"
    path.write_text(json.dumps(table))
    rc = cli.main(["--shapes", "4,512,1024,4096", "--shapes", "4,512,2048,4096", "--rerank",
                   str(path), "--top", "2", "--rounds", "3", "--out", str(path)])
    assert rc == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "1 of 2 shapes have an entry there" in err
    out = json.loads(path.read_text())
    (new,) = out["entries"]
    assert new["name"] == "pp 128x128 c1x2 p8"  # 10% faster: beyond the 3% margin
    assert new["rerank"]["from"] == "pp 128x192 p8" and new["rerank"]["margin"] == 0.03
    assert set(new["rerank"]["timed"]) == {"pp 128x192 p8", "pp 128x128 c1x2 p8",
                                           "pp 128x192 p8ns", RULES}
    assert out["samples"] == samples


def test_a_table_the_cli_cannot_write_stops_the_run_in_one_line(monkeypatch, tmp_path, capsys):
    # The write after each shape (a full disk, a file size limit, the folder removed) raised
    # its OSError as a traceback, after the tuning it could not save.
    import json

    _fake_gpu(monkeypatch, {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": 90.0,
                            RULES: 150.0})
    (tuned_shape,) = cli.parse_shape_items(["4,512,1024,4096"], "varlen", "ENK", "bfloat16",
                                           "bfloat16", 1234)
    k = tuned_shape.key()
    entry = {"form": k.form, "dtype": k.dtype, "out_dtype": k.out_dtype, "E": k.E, "N": k.N,
             "K": k.K, "bucket": k.bucket, "rows": tuned_shape.rows, "us": 100.0,
             "config": {f: v for f, v in space.parse_name("pp 128x192 p8").items()
                        if v is not None}}
    samples = [dict(_sample(n, 100.0), rows=tuned_shape.rows)
               for n in ("pp 128x192 p8", "pp 128x128 c1x2 p8")]
    source = tmp_path / "X.json"
    source.write_text(json.dumps({"format": "moe_gemm.tuned-table/1", "device": "X",
                                  "entries": [entry], "samples": samples}))

    def full_disk(path, doc):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(table_io, "write", full_disk)
    rc = cli.main(["--shapes", "4,512,1024,4096", "--rerank", str(source), "--rounds", "3",
                   "--out", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.splitlines()[-1] == (
        f"moe-gemm tune: cannot write the table {tmp_path / 'out.json'} (No space left on "
        "device); stopped at shape 1 of 1")


@pytest.mark.parametrize("content", ["my notes\n", '{"format": "moe_gemm.tuned-table/1", '
                                     '"device": "NVIDIA H200", "entries": []}'])
def test_an_out_that_is_no_table_for_this_device_is_refused_not_replaced(
        monkeypatch, tmp_path, capsys, content):
    # It was replaced by a new table after the first shape, with one log line (--quiet: none):
    # another device's table, or a file that is no table at all, was lost.
    class Times(dict):
        def __missing__(self, name):
            return 200.0

    _fake_gpu(monkeypatch, Times({"pp 128x192 p8": 100.0}))
    out = tmp_path / "notes.json"
    out.write_text(content)
    assert cli.main(["--shapes", "4,512,1024,4096", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-gemm tune: --out {out} is not a table for this device (")
    assert err.count("\n") == 1 and out.read_text() == content


SWAPPED = "swap 256x128 p8"


def test_rivals_join_every_shape_and_a_shape_without_an_entry_starts_from_the_rules():
    from moe_gemm.tuning.runner import rules_fields

    extra = (space.parse_name("coop 128x256 c1x2 s4"), space.parse_name("pp 128x192 p8"))
    found = rerank.leaders(_table(), SHAPE, top=1, extra=extra)
    # the pick, its fastest sample rival, then the given rivals not already there
    assert [space.name_of(f) for f in found.rivals] == ["pp 128x128 c1x2 p8",
                                                        "coop 128x256 c1x2 s4 p8"]
    other = TuneShape("varlen", 4, 512, 2048, 4096, counts=(1024,) * 4)
    assert rerank.leaders(_table(), other, top=2) is None
    found = rerank.leaders(_table(), other, top=2, extra=extra)
    assert found.entry == {} and found.pick == rules_fields(other, 132)
    assert {space.name_of(f) for f in found.rivals} == {space.name_of(f) for f in extra}


def _window_shape_and_table(config_extra: dict | None = None):
    shape = TuneShape("varlen", 16, 2048, 4096, 16 * 256, counts=(256,) * 16)
    k = shape.key()
    config = {f: v for f, v in space.parse_name("pp 128x192 p8").items() if v is not None}
    config.update(config_extra or {})
    entry = {"form": k.form, "dtype": k.dtype, "out_dtype": k.out_dtype, "E": k.E, "N": k.N,
             "K": k.K, "bucket": k.bucket, "rows": shape.rows, "config": config, "us": 100.0,
             "name": "pp 128x192 p8"}
    return shape, {"device": "X", "entries": [entry], "samples": []}


def test_inside_the_swap_window_the_swapped_kernel_is_the_pick_to_beat(monkeypatch):
    """The default launches swapped tiles there, not the entry's pick: a re-rank starts from
    what the default launches, so the entry's pick must beat it by the margin; an entry that
    names swap_ab (a measurement) is its own pick."""
    from moe_gemm.ops import heuristics

    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    shape, table = _window_shape_and_table()
    found = rerank.leaders(table, shape, top=2)
    assert space.name_of(found.pick).startswith("swap 256x128")
    assert [space.name_of(f) for f in found.rivals] == ["pp 128x192 p8"]
    shape, table = _window_shape_and_table({"swap_ab": False})
    found = rerank.leaders(table, shape, top=2)
    assert space.name_of(found.pick) == "pp 128x192 p8" and found.rivals == []
    monkeypatch.setenv(heuristics.SWAP_AB_ENV, "0")  # the switch off: no swapped default
    shape, table = _window_shape_and_table()
    assert space.name_of(rerank.leaders(table, shape, top=2).pick) == "pp 128x192 p8"


@pytest.mark.parametrize("swap_us,expect_swap", [(90.0, True), (99.0, False), (120.0, False)])
def test_an_entry_written_after_timing_the_swapped_kernel_names_swap_ab(swap_us, expect_swap):
    """The lookup lets such an entry outrank the swapped tiles' window (heuristics), so the
    entry must say which way the measurement went: True where the swapped kernel won, False
    where it lost or stayed within the margin."""
    found = rerank.leaders(_table(), SHAPE, top=1, extra=(space.parse_name("swap 256x128"),))
    times = {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": 150.0, RULES: 150.0,
             SWAPPED: swap_us}
    res = rerank.rerank_shape(SHAPE, FakeRunner(_costs(times)), found, rounds=5, margin=0.03)
    entry = res.entry()
    assert entry["config"]["swap_ab"] is expect_swap
    assert (entry["name"] == SWAPPED) is expect_swap
    assert table_io._valid_entry(entry)


def test_an_entry_that_never_timed_the_swapped_kernel_leaves_swap_ab_unnamed():
    found = rerank.leaders(_table(), SHAPE, top=1)
    times = {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": 150.0, RULES: 150.0}
    entry = rerank.rerank_shape(SHAPE, FakeRunner(_costs(times)), found, rounds=5).entry()
    assert "swap_ab" not in entry["config"]


@pytest.mark.parametrize("extra,message", [
    (["--rivals", "swap 256x128"], "--rivals needs --rerank"),
    (["--rerank", "t.json", "--rivals", "swap 256"], "--rivals: config 'swap 256'"),
    (["--rerank", "t.json", "--rivals", "pp 128x192;banana 1x2"], "--rivals: config 'banana"),
])
def test_bad_rivals_are_refused(extra, message, capsys):
    assert cli.main(["--zoo", *extra]) == 2
    assert message in capsys.readouterr().err


def test_the_cli_reranks_shapes_without_an_entry_when_given_rivals(monkeypatch, tmp_path,
                                                                   capsys):
    import json

    times = {"pp 128x192 p8": 100.0, RULES: 150.0, SWAPPED: 80.0}
    _fake_gpu(monkeypatch, times)
    table = {"format": "moe_gemm.tuned-table/1", "device": "X", "sm_count": 132,
             "versions": {}, "ceilings": {}, "entries": [], "samples": []}
    path = tmp_path / "X.json"
    path.write_text(json.dumps(table))
    rc = cli.main(["--shapes", "4,512,2048,4096", "--rerank", str(path), "--rivals",
                   "swap 256x128", "--rounds", "3", "--out", str(path)])
    assert rc == 0, capsys.readouterr().err
    assert "0 of 1 shapes have an entry there; the others start from the rules' choice" in \
        capsys.readouterr().err
    (new,) = json.loads(path.read_text())["entries"]
    assert new["name"] == SWAPPED and new["config"]["swap_ab"] is True
    assert set(new["rerank"]["timed"]) == {RULES, SWAPPED}


def test_the_record_names_the_pick_timed_and_the_tables_own_where_the_window_replaced_it(
        monkeypatch):
    from moe_gemm.ops import heuristics

    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    shape, table = _window_shape_and_table()
    found = rerank.leaders(table, shape, top=1)
    swapped = space.name_of(found.pick)
    times = {swapped: 100.0, "pp 128x192 p8": 90.0}
    res = rerank.rerank_shape(shape, FakeRunner(lambda f: times.get(space.name_of(f), 200.0)
                                                / 1e3), found, rounds=3, margin=0.03)
    record = res.entry()["rerank"]
    assert record["from"] == swapped and record["from_us"] == pytest.approx(100.0)
    assert record["table_pick"] == "pp 128x192 p8"
    assert res.entry()["name"] == "pp 128x192 p8" and res.entry()["config"]["swap_ab"] is False


def test_a_pick_measured_against_the_swapped_kernel_keeps_that_verdict_when_replaced():
    """An entry naming swap_ab=False (the swapped kernel lost there) re-ranked without the
    swapped kernel: a new winner, or the rules' choice of the pick's own name (which the
    comparison times in its place), is written with swap_ab=False too."""
    table = _table()
    table["entries"][0]["config"]["swap_ab"] = False
    found = rerank.leaders(table, SHAPE, top=1)
    assert found.pick["swap_ab"] is False
    times = {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": 80.0, RULES: 150.0}
    entry = rerank.rerank_shape(SHAPE, FakeRunner(_costs(times)), found, rounds=3).entry()
    assert entry["name"] == "pp 128x128 c1x2 p8" and entry["config"]["swap_ab"] is False
    times = {"pp 128x192 p8": 100.0, "pp 128x128 c1x2 p8": 120.0, RULES: 50.0}
    entry = rerank.rerank_shape(SHAPE, FakeRunner(_costs(times)), found, rounds=3).entry()
    assert entry["name"] == RULES and entry["config"]["swap_ab"] is False


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_rivals_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path, capsys):
    fifo = tmp_path / "r.json"
    os.mkfifo(fifo)
    assert cli.main(["--zoo", "--rerank", "t.json", "--rivals-file", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert f"--rivals-file {fifo}: {fifo} is not a regular file" in err, err


@pytest.mark.parametrize("content, words", [
    ("[1]", "expected an object of shape labels"),
    ('{"a": ["pp 128x"]}', "config 'pp 128x'"),
    ("{", "not JSON"),
])
def test_a_bad_rivals_file_is_refused(tmp_path, capsys, content, words):
    path = tmp_path / "r.json"
    path.write_text(content)
    assert cli.main(["--zoo", "--rerank", "t.json", "--rivals-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--rivals-file {path}" in err and words in err, err
    assert cli.main(["--zoo", "--rivals-file", str(path)]) == 2
    assert "--rivals-file needs --rerank" in capsys.readouterr().err


def test_the_list_of_a_rerank_without_rivals_leaves_out_shapes_without_an_entry(
        capsys, tmp_path):
    # A re-rank without rivals skips every shape its table has no entry for; --list listed
    # them all.
    import json
    from pathlib import Path

    shipped = Path(cli.__file__).resolve().parents[1] / "tables" / "nvidia-h200.json"
    doc = json.loads(shipped.read_text())
    args = ["--zoo", "--models", "qwen3-30b-a3b", "--tokens", "2048,8192", "--list"]
    assert cli.main(args) == 0
    every = capsys.readouterr().out.splitlines()
    kept = [e for e in doc["entries"] if e["N"] == 1536 and e["K"] == 2048]  # the gate/up GEMM
    assert kept and len(kept) < len(doc["entries"])
    doc["entries"] = kept
    table = tmp_path / "t.json"
    table.write_text(json.dumps(doc))
    assert cli.main([*args, "--rerank", str(table)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert 0 < len(listed) < len(every) and all("N=1536 K=2048" in line for line in listed)
    assert cli.main([*args, "--rerank", str(table), "--rivals", "pp 128x128"]) == 0
    assert capsys.readouterr().out.splitlines() == every  # rivals: every shape runs
    table.write_text("[]")
    assert cli.main([*args, "--rerank", str(table)]) == 2
    assert "not a tuned table" in capsys.readouterr().err
