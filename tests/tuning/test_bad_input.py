"""Bad input to the tuning front end: environment values, tables that do not parse, shapes
and options out of range. Each is refused with an error naming the expectation (the CLI: one
line and exit 2), never a traceback or a silent default."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moe_gemm import GemmConfig
from moe_gemm.env import EnvError
from moe_gemm.ops import tuned
from moe_gemm.tuning import cli, online, table_io

DEV = "NVIDIA Test GPU 80GB"
CONFIG = {"schedule": "pingpong", "tile_m": 128, "tile_n": 192, "visitor": "device"}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    for name in (online.AUTOTUNE_ENV, online.BUDGET_ENV, tuned.USER_TABLE_ENV,
                 tuned.TABLES_ENV):  # (the tables on, as the switches read them)
        monkeypatch.delenv(name, raising=False)


# MOE_GEMM_AUTOTUNE and MOE_GEMM_AUTOTUNE_BUDGET_S

def test_autotune_switch_refuses_a_value_neither_on_nor_off(monkeypatch):
    monkeypatch.setenv(online.AUTOTUNE_ENV, "always")
    with pytest.raises(EnvError, match="MOE_GEMM_AUTOTUNE='always': expected one of"):
        online.requested(GemmConfig())


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "30s"])
def test_a_bad_budget_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(online.AUTOTUNE_ENV, "1")
    monkeypatch.setenv(online.BUDGET_ENV, value)
    with pytest.raises(EnvError, match=rf"^MOE_GEMM_AUTOTUNE_BUDGET_S={value!r}: expected a "
                       r"positive finite number of seconds \(default 30\)$"):
        online.requested(GemmConfig())


@pytest.mark.parametrize("value,seconds", [(None, 30.0), ("", 30.0), ("12.5", 12.5),
                                           ("0.2", 1.0), (" 45 ", 45.0)])
def test_good_budgets(monkeypatch, value, seconds):
    monkeypatch.setenv(online.AUTOTUNE_ENV, "1")
    if value is not None:
        monkeypatch.setenv(online.BUDGET_ENV, value)
    assert online.requested(GemmConfig())
    assert online._budget_s() == seconds


def test_the_budget_is_not_read_while_autotune_is_off(monkeypatch):
    monkeypatch.setenv(online.BUDGET_ENV, "abc")
    assert not online.requested(GemmConfig())


# Tables whose numbers do not fit an int (JSON's Infinity, 1e400): left out like any other
# unreadable entry, not a crash of `moe-gemm tune --merge`.

def _table(tmp_path: Path, name: str, entry_e=8, sample_e=8) -> Path:
    entry = {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": entry_e,
             "N": 512, "K": 256, "bucket": 3, "rows": 64, "config": CONFIG, "us": 12.0}
    good = {**entry, "E": 8, "N": 1024}
    sample = {"form": "varlen", "dtype": "bfloat16", "E": sample_e, "N": 512, "K": 256,
              "rows": 64, "config": CONFIG, "us": 12.0}
    doc = table_io.new_table(DEV, 132, {}, {})
    doc.update(entries=[entry, good], samples=[sample])
    path = tmp_path / name
    path.write_text(json.dumps(doc))  # (Python's json writes inf as Infinity)
    return path


@pytest.mark.parametrize("where", ["entry", "sample"])
def test_read_table_leaves_out_numbers_too_large_for_an_int(tmp_path, where):
    kwargs = {"entry_e": float("inf")} if where == "entry" else {"sample_e": float("inf")}
    warned = []
    doc = table_io.read_table(_table(tmp_path, "t.json", **kwargs), warn=warned.append)
    assert len(doc["entries"]) == (1 if where == "entry" else 2)
    assert len(doc["samples"]) == (1 if where == "entry" else 0)
    assert warned and "unreadable" in warned[0]


def test_merge_of_a_table_with_infinity_skips_the_entry(tmp_path, capsys):
    src = _table(tmp_path, "inf.json", entry_e=float("inf"))
    out = tmp_path / "out.json"
    assert cli.main(["--merge", str(src), "--out", str(out)]) == 0
    assert [e["N"] for e in json.loads(out.read_text())["entries"]] == [1024]
    assert "left out 1 unreadable entries" in capsys.readouterr().err


def test_merge_of_a_pathologically_nested_file_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert cli.main(["--merge", str(deep), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-gemm tune: --merge {deep}: ") and err.count("\n") == 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_merge_of_a_fifo_or_a_device_is_one_line_not_a_hang(tmp_path, capsys):
    # A FIFO with no writer would block the read for ever, /dev/zero fill memory: only a
    # regular file is read, as the library's own table reader does.
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        if not path.exists():
            continue
        assert cli.main(["--merge", str(path), "--out", str(tmp_path / "o.json")]) == 2
        err = capsys.readouterr().err
        assert err == f"moe-gemm tune: --merge {path}: {path} is not a regular file\n"
    assert not (tmp_path / "o.json").exists()


def test_merge_of_a_file_past_the_table_limit_is_one_line(tmp_path, capsys, monkeypatch):
    src = _table(tmp_path, "big.json")
    monkeypatch.setattr(tuned, "MAX_TABLE_BYTES", src.stat().st_size - 1)
    assert cli.main(["--merge", str(src), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-gemm tune: --merge {src}: {src} is ") and "more than" in err
    assert err.count("\n") == 1


def test_merge_of_a_table_whose_versions_is_not_an_object_is_one_line(tmp_path, capsys):
    src = _table(tmp_path, "v.json")
    src.write_text(json.dumps({**json.loads(src.read_text()), "versions": [1, 2]}))
    assert cli.main(["--merge", str(src), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"moe-gemm tune: --merge {src}: versions is not an object\n"


# --shapes and the run's options

@pytest.mark.parametrize("item", ["8,512,256,2147483648", "8,512,4294967296,64",
                                  "2147483648,512,256,64"])
def test_shape_values_past_int32_are_refused_at_once(item, capsys):
    # (a shape no kernel takes: offs are int32)
    assert cli.main(["--shapes", item, "--list"]) == 2
    assert capsys.readouterr().err == (
        f"moe-gemm tune: --shapes {item!r}: expected E,N,K,ROWS[,ROWS...], each from 1 to "
        "2147483647\n")


@pytest.mark.parametrize("tokens", ["99999999999999", "16,268435456"])
def test_zoo_tokens_past_int32_rows_are_refused_at_once(tokens, capsys):
    # (tokens x top_k rows drawn token by token: --list used to hang, printing nothing)
    assert cli.main(["--zoo", "--models", "DeepSeek-V3", "--tokens", tokens, "--list"]) == 2
    assert "routed rows; at most 2147483647 (offs are int32)" in capsys.readouterr().err


@pytest.mark.parametrize("rounds", ["0", "-3"])
def test_rounds_must_be_positive(rounds, capsys):
    assert cli.main(["--shapes", "8,512,256,64", "--rounds", rounds]) == 2
    assert capsys.readouterr().err == f"moe-gemm tune: --rounds {rounds}: must be >= 1\n"


@pytest.mark.parametrize("option,value", [("--out", "{f}/t.json"), ("--report", "{f}/r.json"),
                                          ("--out-dir", "{f}")])
def test_outputs_that_cannot_be_written_fail_before_any_tuning(option, value, tmp_path, capsys):
    # A file where a folder must be: refused at once (on a GPU, it used to fail only after
    # the tune, with a traceback), before the check for a GPU.
    f = tmp_path / "a-file"
    f.write_text("x")
    path = value.format(f=f)
    ab = ["--configs", "pp 128x128"] if option == "--report" else []  # (--report's A/B)
    assert cli.main(["--shapes", "8,256,256,64", *ab, option, path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-gemm tune: {option} ") and "is a file, not a folder" in err


@pytest.mark.parametrize("mode", [["--zoo", "--models", "OLMoE-1B-7B", "--tokens", "16"],
                                  ["--merge", "t0.json"]])
def test_out_and_out_dir_together_are_refused(mode, tmp_path, capsys):
    argv = [*mode, "--out", str(tmp_path / "t.json"), "--out-dir", str(tmp_path / "d")]
    assert cli.main(argv) == 2
    assert "--out and --out-dir both name the table to write" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "d").exists()


def test_a_refused_run_leaves_no_folder_behind(tmp_path, capsys, monkeypatch):
    # The output check proves a new folder can be made, then removes it: a run refused
    # afterwards (here: no GPU) must not leave empty folders where --out pointed.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    out = tmp_path / "new" / "deeper" / "t.json"
    assert cli.main(["--shapes", "8,256,256,64", "--out", str(out)]) == 2
    assert cli.NO_GPU in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []


# The command line's other options (a QA sweep's findings): each was ignored or let through


def test_merge_is_refused_beside_the_options_of_a_run(tmp_path, capsys):
    src = tmp_path / "a.json"
    src.write_text(json.dumps(table_io.new_table(DEV, 132, {}, {})))
    out = tmp_path / "o.json"
    for extra in (["--list"], ["--no-merge"], ["--zoo", "--models", "bogus"],
                  ["--shapes", "1,2,3,4"], ["--rerank", "x.json"],
                  # (ignored until every option but --out / --out-dir / --quiet was refused)
                  ["--device", "cpu"], ["--gpus", "2"], ["--dtype", "fp16"], ["--top", "2"]):
        assert cli.main(["--merge", str(src), "--out", str(out), *extra]) == 2
        assert "--merge puts tables together and does nothing else; drop" in (
            capsys.readouterr().err)
        assert not out.exists()


@pytest.mark.parametrize("argv,words", [
    (["--shapes", "8,,128,128,16", "--list"], "an empty field"),
    (["--shapes", "8,128,128,16", "--list", "--budget-s", "nan"], "--budget-s must be"),
    (["--shapes", "8,128,128,16", "--list", "--shape-budget-s", "0"], "--shape-budget-s must"),
    (["--shapes", "8,128,128,16", "--list", "--skip-table", "missing.json"],
     "--skip-table missing.json: no such table file"),
    # (a corrupt one was left out of the list and only logged by a run, which tuned every
    # shape again)
    (["--shapes", "8,128,128,16", "--list", "--skip-table", "deep.json"],
     "--skip-table deep.json: deep.json is not a tuned table (nested too deeply)"),
    (["--shapes", "8,128,128,16", "--list", "--skip-table", "list.json"],
     "--skip-table list.json: list.json is not a tuned table (no device name)"),
    # (the decoder's message alone, naming neither the file nor what it is not)
    (["--shapes", "8,128,128,16", "--list", "--skip-table", "text.json"],
     "--skip-table text.json: text.json is not a tuned table (not JSON: Expecting value"),
    (["--zoo", "--list", "--rerank", "text.json"],
     "--rerank text.json: text.json is not a tuned table (not JSON: Expecting value"),
    # (an E past the kernels' problem count built E-long routing lists: a MemoryError)
    (["--shapes", "100000000,128,128,16", "--list"],
     "E (the expert count) must be at most 65535"),
    # (a tensor past 2^63 bytes: a GPU run stopped in torch's traceback, after the compiles)
    (["--shapes", "2,2147483647,2147483647,16", "--list"],
     "an operand of E=2 N=2147483647 K=2147483647 ROWS=16 takes 2^63 bytes or more"),
    (["--shapes", "65535,128,2147483647,2147483647", "--form", "batched", "--list"],
     "takes 2^63 bytes or more"),
    (["--zoo", "--list", "--rerank", "t.json", "--rivals-file", "deep.json"],
     "--rivals-file deep.json: not JSON (nested too deeply)"),
    (["--zoo", "--list", "--rerank", "t.json", "--rivals", "pp 100x100"], "--rivals: config"),
    (["--zoo", "--list", "--rerank", "t.json", "--rivals", ";"], "names no config"),
    (["--zoo", "--list", "--rivals", ""], "--rivals is empty"),
    (["--zoo", "--list", "--device", "bogus"], "--device 'bogus': expected cuda or cuda:N"),
    # (checked with --rerank only: without it these bad values passed)
    (["--zoo", "--list", "--top", "-5"], "--top -5: must be >= 1"),
    (["--zoo", "--list", "--margin", "7"], "--margin 7.0: must be in [0, 1)"),
    (["--zoo", "--list", "--rivals-file", ""], "--rivals-file is empty"),
])
def test_bad_values_are_refused_before_the_list(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "text.json").write_text("not a table\n")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_a_shape_given_twice_is_listed_and_tuned_once(capsys):
    assert cli.main(["--shapes", "8,128,128,16,16", "--shapes", "8,128,128,16", "--list"]) == 0
    assert capsys.readouterr().out.count("E=8 N=128 K=128 rows=16") == 1


def test_the_tuner_reads_a_table_the_library_reads(tmp_path):
    # A UTF-8 BOM (or UTF-16) table: the lookup used it, `--merge` refused it.
    doc = table_io.new_table(DEV, 132, {}, {})
    for data in (b"\xef\xbb\xbf" + json.dumps(doc).encode(), json.dumps(doc).encode("utf-16")):
        path = tmp_path / "t.json"
        path.write_bytes(data)
        assert table_io.read_table(path, DEV)["device"] == DEV


def test_list_leaves_out_what_resume_and_skip_table_would_skip(tmp_path, capsys):
    # --list printed every shape though a run skips those the tables already hold.
    out = tmp_path / "t.json"
    doc = table_io.new_table(DEV, 132, {}, {})
    doc["entries"].append({"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16",
                           "E": 8, "N": 128, "K": 128, "bucket": 1, "rows": 16,
                           "config": CONFIG, "us": 12.0})
    out.write_text(json.dumps(doc))
    shapes = ["--shapes", "8,128,128,16,1024"]
    assert cli.main([*shapes, "--list"]) == 0
    assert capsys.readouterr().out.count("\n") == 2
    for extra in (["--resume", "--out", str(out)], ["--skip-table", str(out)]):
        assert cli.main([*shapes, "--list", *extra]) == 0
        listed = capsys.readouterr().out
        assert "rows=16 " not in listed and "rows=1024" in listed, extra


def test_report_without_configs_is_refused(tmp_path, capsys):
    # --report writes the timings of a --configs A/B; a tuning run left it unwritten, silently.
    report = tmp_path / "r.json"
    assert cli.main(["--shapes", "8,128,128,16", "--report", str(report)]) == 2
    assert capsys.readouterr().err == ("moe-gemm tune: --report writes the timings of "
                                       "--configs: add --configs, or drop --report\n")
    assert not report.exists()


def test_a_kernel_cache_that_cannot_be_written_is_refused_before_any_tuning(
        tmp_path, capsys, monkeypatch):
    # The compile workers hand every kernel over through the cache: with a file in its place
    # each compile failed and a GPU run "tuned" every shape to nothing. Refused at once, in
    # one line (here before the check for a GPU); --list writes nothing there.
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "a-file"))
    shapes = ["--shapes", "8,128,128,16"]
    assert cli.main(shapes) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moe-gemm tune: the kernel cache {tmp_path / 'a-file'} cannot be "
                          "written (") and "is a file, not a folder" in err
    assert err.rstrip().endswith("or MOE_GEMM_DISK_CACHE=0") and err.count("\n") == 1
    assert cli.main([*shapes, "--list"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("MOE_GEMM_DISK_CACHE", "0")  # (nothing is written there then)
    assert cli.main(shapes) == 2
    assert "the kernel cache" not in capsys.readouterr().err


def test_every_skip_table_given_is_skipped(tmp_path, capsys):
    # --skip-table is repeatable: a --gpus --resume run adds --out's table beside the
    # caller's, and one value (the last) replaced the caller's.
    tables = []
    for rows, bucket in ((16, 1), (1024, 7)):
        doc = table_io.new_table(DEV, 132, {}, {})
        doc["entries"].append({"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16",
                               "E": 8, "N": 128, "K": 128, "bucket": bucket, "rows": rows,
                               "config": CONFIG, "us": 12.0})
        tables.append(tmp_path / f"t{rows}.json")
        tables[-1].write_text(json.dumps(doc))
    argv = ["--shapes", "8,128,128,16,1024,4096", "--list"]
    assert cli.main([*argv, "--skip-table", str(tables[0]), "--skip-table", str(tables[1])]) == 0
    listed = capsys.readouterr().out
    assert "rows=16 " not in listed and "rows=1024 " not in listed and "rows=4096" in listed
