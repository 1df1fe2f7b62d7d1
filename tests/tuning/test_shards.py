"""Sharding a work list over GPUs (`--shard I/N`) and merging the shards' tables."""

from __future__ import annotations

import argparse
import json

import pytest

from moe_gemm.tuning import cli, table_io
from moe_gemm.tuning.shards import parse_shard, take_shard

DEV = "NVIDIA H200"
CEIL = {"mm_flops_per_s": 7.0e14, "copy_bytes_per_s": 4.0e12}


def test_parse_shard_accepts_i_of_n_and_names_the_form_otherwise():
    assert parse_shard("0/4") == (0, 4) and parse_shard("3/4") == (3, 4)
    assert parse_shard("0/1") == (0, 1)
    for bad in ("4/4", "-1/4", "1/0", "1", "a/b", "1/2/3", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="I/N"):
            parse_shard(bad)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_shards_cover_every_item_once_and_are_balanced(n):
    items = list(range(23))
    parts = [take_shard(items, (i, n)) for i in range(n)]
    assert sorted(x for p in parts for x in p) == items
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parts[0][0] == 0 and all(p == sorted(p) for p in parts)  # priority order kept
    assert take_shard(items, None) == items


def test_cli_shard_lists_its_share(capsys):
    assert cli.main(["--list", "--zoo", "--models", "DeepSeek-V3,OLMoE-1B-7B",
                     "--tokens", "16,2048"]) == 0
    every = capsys.readouterr().out.splitlines()
    shares = []
    for i in range(3):
        assert cli.main(["--list", "--zoo", "--models", "DeepSeek-V3,OLMoE-1B-7B",
                         "--tokens", "16,2048", "--shard", f"{i}/3"]) == 0
        shares.append(capsys.readouterr().out.splitlines())
    assert sorted(sum(shares, [])) == sorted(every) and len(every) == 8
    assert shares[1] == every[1::3]
    with pytest.raises(SystemExit):
        cli.main(["--list", "--zoo", "--shard", "3/3"])
    assert "I/N" in capsys.readouterr().err


def _entry(E, us, tile_n=128, bucket=5):
    return {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E, "N": 512,
            "K": 1024, "bucket": bucket, "rows": 32 * E,
            "config": {"schedule": "pingpong", "tile_m": 128, "tile_n": tile_n}, "us": us}


def _sample(E, us, tile_n=128):
    return {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E, "N": 512,
            "K": 1024, "rows": 32 * E,
            "config": {"schedule": "pingpong", "tile_m": 128, "tile_n": tile_n}, "us": us}


def _table(path, entries, samples=(), device=DEV, failures=()):
    doc = table_io.new_table(device, 132, {"moe_gemm": "test"}, CEIL)
    for e in entries:
        table_io.add_result(doc, e, [])
    table_io.add_result(doc, None, list(samples))
    doc["failures"] = list(failures)
    table_io.write(path, doc)
    return path


def test_merge_adds_shards_into_the_table_and_later_files_win(tmp_path, capsys):
    base = _table(tmp_path / "base.json", [_entry(8, 100.0), _entry(16, 200.0)],
                  [_sample(8, 100.0), _sample(16, 200.0)])
    s0 = _table(tmp_path / "s0.json", [_entry(8, 90.0, tile_n=192)],
                [_sample(8, 90.0, tile_n=192), _sample(8, 95.0)],
                failures=[{"shape": "a", "config": "x", "why": "oom"}])
    s1 = _table(tmp_path / "s1.json", [_entry(32, 300.0), _entry(8, 80.0, tile_n=160)])
    assert cli.main(["--merge", str(s0), "--merge", str(s1), "--out", str(base)]) == 0
    assert "3 entries" in capsys.readouterr().out
    doc = json.loads(base.read_text())
    by_e = {e["E"]: e for e in doc["entries"]}
    assert sorted(by_e) == [8, 16, 32]
    assert by_e[8]["us"] == 80.0 and by_e[8]["config"]["tile_n"] == 160  # s1 came last
    assert by_e[16]["us"] == 200.0  # untouched
    # The E=8 shape's samples are s0's (they replace the base's for that shape), E=16 kept.
    assert sorted((s["E"], s["us"]) for s in doc["samples"]) == [(8, 90.0), (8, 95.0),
                                                                  (16, 200.0)]
    assert doc["failures"] == [{"shape": "a", "config": "x", "why": "oom"}]
    # Merging the same shard again changes nothing and duplicates no failure.
    assert cli.main(["--merge", str(s1), "--merge", str(s0), "--out", str(base)]) == 0
    again = json.loads(base.read_text())
    assert len(again["entries"]) == 3 and len(again["failures"]) == 1
    assert {e["E"]: e["us"] for e in again["entries"]}[8] == 90.0  # s0 last now


def test_merge_into_a_new_file_and_bad_inputs(tmp_path, capsys):
    s0 = _table(tmp_path / "s0.json", [_entry(8, 90.0)])
    s1 = _table(tmp_path / "s1.json", [_entry(16, 80.0)])
    out = tmp_path / "new.json"
    assert cli.main(["--merge", str(s0), "--merge", str(s1), "--out", str(out)]) == 0
    assert sorted(e["E"] for e in json.loads(out.read_text())["entries"]) == [8, 16]
    capsys.readouterr()
    # No --out, a missing or corrupt file, another device's table: exit 2 with the reason,
    # and the table at --out is left as it was.
    before = out.read_text()
    other = _table(tmp_path / "h100.json", [_entry(8, 1.0)], device="NVIDIA H100 80GB HBM3")
    (tmp_path / "bad.json").write_text("{")
    cases = [(["--merge", str(s0)], "needs --out"),
             (["--merge", str(tmp_path / "missing.json"), "--out", str(out)], "missing.json"),
             (["--merge", str(tmp_path / "bad.json"), "--out", str(out)], "bad.json"),
             (["--merge", str(s0), "--merge", str(other), "--out", str(out)], "one device"),
             (["--merge", str(other), "--out", str(out)], "H100")]
    for argv, words in cases:
        assert cli.main(argv) == 2, argv
        assert words in capsys.readouterr().err, argv
        assert out.read_text() == before


def test_merge_leaves_out_entries_the_reader_would_skip(tmp_path):
    s0 = _table(tmp_path / "s0.json", [_entry(8, 90.0)])
    doc = json.loads(s0.read_text())
    doc["entries"] += [{"form": "varlen", "E": 8}, "junk",
                       {**_entry(16, 1.0), "config": {"tile_m": 128, "bogus": 1}}]
    doc["samples"] = [{"E": 1}, _sample(8, 90.0)]
    s0.write_text(json.dumps(doc))
    out = tmp_path / "out.json"
    assert cli.main(["--merge", str(s0), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [e["E"] for e in merged["entries"]] == [8]
    assert [s["E"] for s in merged["samples"]] == [8]


def test_gpu_ids_follow_the_visible_list(monkeypatch):
    from moe_gemm.tuning.shards import gpu_ids

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_ids(2, 4) == ["0", "1"]
    with pytest.raises(ValueError, match="--gpus 5: 4 GPU"):
        gpu_ids(5, 4)
    with pytest.raises(ValueError, match="--gpus 0"):
        gpu_ids(0, 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,7")
    assert gpu_ids(2, 99) == ["3", "5"]
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=3, 5,7"):
        gpu_ids(4, 99)


def test_gpu_ids_on_the_cpu_are_bounded_by_its_cores(monkeypatch):
    # count None (the zoo's --smoke shards run on the CPU): a list of n ids was built before
    # any check, so `--gpus 100000000000000000000` never returned.
    import os

    from moe_gemm.tuning.shards import gpu_ids

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert gpu_ids(3) == ["0", "1", "2"]
    with pytest.raises(ValueError, match=r"--gpus 100000000000000000000: at most one shard "
                                         r"process per CPU core here \(4\)"):
        gpu_ids(10**20)


def test_run_shards_runs_each_command_on_its_gpu_and_returns_the_exit_codes():
    import sys

    from moe_gemm.tuning.shards import run_shards

    lines = []
    code = ("import os, sys; print('on', os.environ['CUDA_VISIBLE_DEVICES']); "
            "sys.exit(int(os.environ['CUDA_VISIBLE_DEVICES']) % 2)")
    codes = run_shards([[sys.executable, "-c", code]] * 3, ["4", "5", "6"], lines.append)
    assert codes == [0, 1, 0]
    assert sorted(lines) == ["[gpu 4] on 4", "[gpu 5] on 5", "[gpu 6] on 6"]


@pytest.fixture
def fake_gpus(monkeypatch):
    """`moe-gemm tune --gpus` on the CPU: two GPUs named like an H200, and shard processes
    replaced by a function that writes each shard's table as the shard would."""
    import torch

    from moe_gemm import capability

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(capability, "device_name", lambda device=None: DEV)
    seen = []

    def fake_run_shards(commands, gpus, log, fail=()):
        seen.append((commands, gpus))
        codes = []
        for cmd, gpu in zip(commands, gpus):
            out = cmd[len(cmd) - 1 - cmd[::-1].index("--out") + 1]
            shard = cmd[len(cmd) - 1 - cmd[::-1].index("--shard") + 1]
            if gpu in fake_run_shards.fail:
                codes.append(1)
                continue
            i = int(shard.split("/")[0])
            _table(__import__("pathlib").Path(out), [_entry(8 * (i + 1), 10.0 + i)])
            codes.append(0)
        return codes

    fake_run_shards.fail = set()
    from moe_gemm.tuning import shards

    monkeypatch.setattr(shards, "run_shards", fake_run_shards)
    return fake_run_shards, seen


def test_tune_on_gpus_merges_every_shard_into_the_table(tmp_path, fake_gpus, capsys):
    fake, seen = fake_gpus
    out = _table(tmp_path / "t.json", [_entry(64, 1.0)])
    argv = ["--zoo", "--models", "OLMoE-1B-7B", "--tokens", "16", "--gpus", "2", "--out",
            str(out), "--resume"]
    assert cli.main(argv) == 0
    (commands, gpus), = seen
    assert gpus == ["0", "1"]
    for i, cmd in enumerate(commands):
        assert cmd[1:3] == ["-m", "moe_gemm.tuning"]
        joined = " ".join(cmd)
        assert f"--shard {i}/2" in joined and "--no-merge" in joined and "--gpus 1" in joined
        assert f"--skip-table {out}" in joined  # --resume: the shards skip what --out has
        last = len(cmd) - 1 - cmd[::-1].index("--gpus")
        assert cmd[last + 1] == "1"  # the shard's own --gpus (argparse keeps the last)
    assert sorted(e["E"] for e in json.loads(out.read_text())["entries"]) == [8, 16, 64]
    # --no-merge: a table of the shards alone replaces --out (--resume then skips nothing).
    seen.clear()
    assert cli.main(argv + ["--no-merge"]) == 0
    assert sorted(e["E"] for e in json.loads(out.read_text())["entries"]) == [8, 16]
    assert "--skip-table" not in " ".join(seen[0][0][0])


def test_tune_on_gpus_with_resume_keeps_the_callers_skip_table(tmp_path, fake_gpus, capsys):
    # --resume hands the shards --out's table as a --skip-table after the caller's options;
    # a caller's own --skip-table was replaced by it (argparse kept the last value).
    fake, seen = fake_gpus
    out = _table(tmp_path / "t.json", [_entry(64, 1.0)])
    mine = _table(tmp_path / "mine.json", [_entry(32, 1.0)])
    assert cli.main(["--zoo", "--models", "OLMoE-1B-7B", "--tokens", "16", "--gpus", "2",
                     "--out", str(out), "--resume", "--skip-table", str(mine)]) == 0
    for cmd in seen[0][0]:
        shard = cli.parse_args(cmd[3:])
        assert shard.skip_table == [str(mine), str(out)]


def test_tune_on_gpus_keeps_what_finished_when_a_shard_fails(tmp_path, fake_gpus, capsys):
    fake, seen = fake_gpus
    fake.fail = {"1"}
    out = tmp_path / "t.json"
    assert cli.main(["--zoo", "--models", "OLMoE-1B-7B", "--tokens", "16", "--gpus", "2",
                     "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "GPU 1 (exit 1)" in err and "merged 1 of 2" in err
    assert [e["E"] for e in json.loads(out.read_text())["entries"]] == [8]
    # Bad combinations and too many GPUs: exit 2 before anything runs.
    for extra in (["--gpus", "3"], ["--gpus", "2", "--shard", "0/2"],
                  ["--gpus", "2", "--device", "cuda:1"],
                  ["--gpus", "2", "--configs", "pp 128x128"]):
        seen.clear()
        assert cli.main(["--zoo", "--models", "OLMoE-1B-7B", "--tokens", "16", "--out",
                         str(out), *extra]) == 2, extra
        assert not seen


@pytest.mark.parametrize("content", ["my notes\n", "other device"])
def test_tune_on_gpus_refuses_an_out_that_is_no_table_for_this_device(tmp_path, fake_gpus,
                                                                      capsys, content):
    # Found out only when the shards' tables were merged into it, after all the tuning.
    fake, seen = fake_gpus
    out = tmp_path / "t.json"
    if content == "other device":
        _table(out, [_entry(64, 1.0)], device="NVIDIA H100 80GB HBM3")
    else:
        out.write_text(content)
    before = out.read_text()
    assert cli.main(["--zoo", "--models", "OLMoE-1B-7B", "--tokens", "16", "--gpus", "2",
                     "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-gemm tune: --out {out} is not a table for this device")
    assert err.rstrip().endswith("give another --out, or --no-merge to replace it")
    assert not seen and out.read_text() == before
    # --no-merge replaces it, as asked.
    assert cli.main(["--zoo", "--models", "OLMoE-1B-7B", "--tokens", "16", "--gpus", "2",
                     "--out", str(out), "--no-merge"]) == 0
    assert json.loads(out.read_text())["device"] == DEV


def _edit(path, **fields):
    doc = json.loads(path.read_text())
    doc.update(fields)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("fields", [{"samples": 5}, {"failures": 3}, {"samples": None,
                                                                        "failures": {"a": 1}}])
def test_merge_leaves_out_samples_or_failures_that_are_not_lists(tmp_path, capsys, fields):
    # These raised "TypeError: 'int' object is not iterable": the reader ignores them.
    s0 = _edit(_table(tmp_path / "s0.json", [_entry(8, 90.0)], [_sample(8, 90.0)]), **fields)
    out = tmp_path / "out.json"
    assert cli.main(["--merge", str(s0), "--out", str(out)]) == 0
    assert "warning" in capsys.readouterr().err
    merged = json.loads(out.read_text())
    assert [e["E"] for e in merged["entries"]] == [8]
    assert isinstance(merged["samples"], list) and isinstance(merged["failures"], list)


@pytest.mark.parametrize("junk", [{}, 5, "x", {"form": "varlen"}])
def test_merge_into_an_out_table_with_unreadable_entries_drops_them(tmp_path, capsys, junk):
    # The reader skips such entries; the sort in table_io.write raised KeyError / TypeError.
    s0 = _table(tmp_path / "s0.json", [_entry(8, 90.0)])
    out = tmp_path / "out.json"
    doc = json.loads(_table(out, [_entry(16, 1.0)]).read_text())
    doc["entries"].append(junk)
    doc["samples"] = [{"E": 1}, 7, _sample(16, 1.0)]
    out.write_text(json.dumps(doc))
    assert cli.main(["--merge", str(s0), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "1 unreadable entries" in err and "Traceback" not in err
    merged = json.loads(out.read_text())
    assert sorted(e["E"] for e in merged["entries"]) == [8, 16]
    assert [s["E"] for s in merged["samples"]] == [16]


def test_merge_reads_a_string_E_as_the_reader_does(tmp_path):
    # "E": "8" beside integer E's: the sort raised "'<' not supported between str and int".
    s0 = _table(tmp_path / "s0.json", [_entry(8, 90.0), _entry(16, 80.0)])
    doc = json.loads(s0.read_text())
    doc["entries"][0]["E"] = "8"
    s0.write_text(json.dumps(doc))
    s1 = _table(tmp_path / "s1.json", [_entry(8, 70.0)])
    out = tmp_path / "out.json"
    assert cli.main(["--merge", str(s0), "--merge", str(s1), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())["entries"]
    assert [(int(e["E"]), e["us"]) for e in merged] == [(8, 70.0), (16, 80.0)]  # one key


def test_merge_checks_the_output_path_before_merging(tmp_path, capsys):
    s0 = _table(tmp_path / "s0.json", [_entry(8, 90.0)])
    for out, words in ((f"{s0}/x.json", "is a file, not a folder"),
                       ("/proc/nope/x.json", "cannot create its folder"),
                       (str(tmp_path), "is a folder")):
        assert cli.main(["--merge", str(s0), "--out", out]) == 2, out
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "entries" not in err, err


def test_merge_into_out_dir_writes_the_device_table(tmp_path, capsys):
    s0 = _table(tmp_path / "s0.json", [_entry(8, 90.0)])
    d = tmp_path / "tables"
    assert cli.main(["--merge", str(s0), "--out-dir", str(d)]) == 0
    assert [p.name for p in d.iterdir()] == ["nvidia-h200.json"]
    assert cli.main(["--merge", str(s0)]) == 2
    assert "--merge needs --out FILE or --out-dir DIR" in capsys.readouterr().err
    # A table there that cannot be read: the error names the option and the file it chose.
    (d / "nvidia-h200.json").write_text("{not json")
    assert cli.main(["--merge", str(s0), "--out-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-gemm tune: --out-dir {d / 'nvidia-h200.json'}: "), err
    assert (d / "nvidia-h200.json").read_text() == "{not json"  # left as it was


@pytest.mark.parametrize("argv, words", [
    (["--zoo", "--models", "", "--list"], "--models is empty"),
    (["--zoo", "--models", " ", "--list"], "--models is empty"),
    (["--shapes", "8,256,256,64", "--configs", "", "--list"], "--configs is empty"),
    (["--shapes", "8,256,256,64", "--configs", ";"], "names no config"),
    (["--merge", ""], "--merge is empty"),
    (["--shapes", "8,256,256,64", "--gpus", "0"], "--gpus 0: must be >= 1"),
    (["--shapes", "8,256,256,64", "--gpus", "-1"], "--gpus -1: must be >= 1"),
    (["--shapes", "8,256,256,64", "--shape-budget-s", "-3"],
     "--shape-budget-s must be a positive finite number of seconds"),
    (["--shapes", "8,256,256,64", "--budget-s", "nan"], "--budget-s must be a positive finite"),
    (["--shapes", "8,256,256,64", "--budget-s", "inf"], "--budget-s must be a positive finite"),
    (["--shapes", "8,256,256,64", "--shape-budget-s", "inf", "--list"],
     "--shape-budget-s must be a positive finite")])
def test_empty_values_and_gpus_below_one_are_refused(capsys, argv, words):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"moe-gemm tune: {err.split(': ', 1)[1]}" and words in err
    assert err.count("\n") == 1


def test_select_models_refuses_an_empty_list():
    with pytest.raises(ValueError, match="unknown model"):
        __import__("moe_gemm.tuning.zoo", fromlist=["x"]).select_models("")


def test_gpus_without_a_cuda_torch_says_it_needs_a_gpu(monkeypatch, capsys):
    # CUDA_VISIBLE_DEVICES names GPUs a CPU-only torch cannot use: it raised AssertionError.
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cli.main(["--shapes", "8,256,256,64", "--gpus", "2"]) == 2
    assert capsys.readouterr().err == f"moe-gemm tune: {cli.NO_GPU}\n"


@pytest.mark.parametrize("spec", ["DeepSeek-V3,", ",Kimi-K2", "DeepSeek-V3,,Kimi-K2"])
def test_select_models_refuses_a_stray_comma(spec):
    # A stray comma was dropped: the list ran as if it spelled fewer entries.
    with pytest.raises(ValueError, match="an empty model name in"):
        __import__("moe_gemm.tuning.zoo", fromlist=["x"]).select_models(spec)


@pytest.mark.parametrize("spec", ["2048,", ",16", "16,,2048"])
def test_parse_tokens_refuses_a_stray_comma(spec):
    with pytest.raises(ValueError, match="comma-separated positive integers"):
        __import__("moe_gemm.tuning.zoo", fromlist=["x"]).parse_tokens(spec, (1,))
