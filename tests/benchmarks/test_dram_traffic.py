"""benchmarks.dram_traffic: ncu output parsing, compulsory bytes and the driver, with a stand-in
for ncu (the real one needs a GPU)."""

from __future__ import annotations

import json
import shutil
import stat
import sys

import pytest

from benchmarks import dram_traffic as dt
from moe_gemm.tuning import zoo as models

RAW = "\n".join([
    "==PROF== Connected to process 4242",
    "some line the program printed",
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    '"dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum","lts__t_bytes.sum"',
    '"","","","","","","","byte","byte","nsecond","byte"',
    '"0","4242","python3","h","kernel_a(...)","1","7","1,000,000","2000","1500","3,000,000"',
    '"1","4242","python3","h","kernel_b(...)","1","7","500","n/a","2500","700"',
    "==PROF== Disconnected from process 4242",
])

LONG = "\n".join([
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
    '"Section Name","Metric Name","Metric Unit","Metric Value"',
] + [
    f'"{i}","1","p","h","k{i}","1","7","Command line profiler metrics","{m}","byte","{v}"'
    for i, vals in enumerate([(10, 20, 30, 40), (1, 2, 3, 4)])
    for m, v in zip(dt.METRICS, vals)
])


def stand_in_ncu(tmp_path, expect: str = "*", output: str = RAW):
    """An executable standing in for ncu: exits 9 unless its arguments match the shell pattern
    `expect`, else prints `output` as a real ncu would for a two-kernel call."""
    fake = tmp_path / "ncu"
    (tmp_path / "out.csv").write_text(output + "\n")
    fake.write_text(f'#!/bin/sh\ncase "$*" in {expect}) ;; *) exit 9;; esac\n'
                    f"cat {tmp_path / 'out.csv'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def test_parse_raw_page():
    ks = dt.parse_ncu_csv(RAW)
    assert [k["kernel"] for k in ks] == ["kernel_a(...)", "kernel_b(...)"]
    assert ks[0]["dram_read"] == 1e6 and ks[0]["l2_bytes"] == 3e6 and ks[0]["gpu_ns"] == 1500
    assert ks[1]["dram_write"] == 0.0 and ks[1]["dram_read"] == 500


def test_parse_details_page():
    ks = dt.parse_ncu_csv(LONG)
    assert len(ks) == 2
    assert (ks[0]["dram_read"], ks[0]["dram_write"], ks[0]["l2_bytes"], ks[0]["gpu_ns"]) == (
        10, 20, 30, 40)


def test_parse_refuses_output_without_the_metrics_and_ignores_no_csv():
    assert dt.parse_ncu_csv("==PROF== nothing profiled\n") == []
    bad = '"ID","Kernel Name","dram__bytes_read.sum"\n"0","k","5"\n'
    with pytest.raises(ValueError, match="lacks"):
        dt.parse_ncu_csv(bad)


def test_compulsory_bytes_count_used_experts_once():
    read, write = dt.compulsory_bytes([3, 0, 5], n=16, k=32)
    assert read == (8 * 32 + 2 * 32 * 16) * 2 and write == 8 * 16 * 2
    row = dt.summarize(dt.parse_ncu_csv(RAW), [(3, 16, 32), (0, 16, 32), (5, 16, 32)])
    assert row["kernels"] == 2 and row["dram_read"] == 1_000_500
    assert row["read_ratio"] == pytest.approx(1_000_500 / read)
    assert row["us"] == pytest.approx(4.0)


def test_compulsory_bytes_of_separate_problems():
    # Each problem its own A and B; an empty problem moves nothing; fp16 output.
    read, write = dt.compulsory_of_sizes([(4, 8, 16), (0, 32, 32), (2, 24, 8)])
    assert read == (4 * 16 + 16 * 8 + 2 * 8 + 8 * 24) * 2
    assert write == (4 * 8 + 2 * 24) * 2
    assert dt.compulsory_of_sizes([(3, 16, 32), (0, 16, 32), (5, 16, 32)]) == \
        dt.compulsory_bytes([3, 0, 5], 16, 32)


def test_suite_cases_and_their_errors():
    names = [spec.name for spec, _ in dt.suite_cases(None)]
    assert "uniform" in names and "moe-prefill" in names
    picked = dt.suite_cases("moe-decode,k-varying")
    assert [f["suite"] for _, f in picked] == ["moe-decode", "k-varying"]
    assert {f["form"] for _, f in picked} == {"varlen", "general"}
    with pytest.raises(ValueError, match="bogus"):
        dt.suite_cases("moe-decode,bogus")


def test_driver_on_suite_shapes_with_a_stand_in_ncu(tmp_path, capsys):
    from benchmarks.suite import full_suite

    fake = stand_in_ncu(tmp_path, "*--worker*suite/*")
    out = tmp_path / "t.json"
    assert dt.main(["--suite", "--only", "uniform,moe-decode", "--impls", "ours",
                    "--ncu", str(fake), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["suite"]) for r in rows] == [
        ("suite/uniform", "uniform"), ("suite/moe-decode", "moe-decode")]
    specs = {s.name: s for s in full_suite()}
    for r in rows:  # the compulsory bytes of each shape's own problems
        read, _ = dt.compulsory_of_sizes(specs[r["suite"]].sizes(1234))
        assert r["compulsory_read"] == read
        assert r["read_ratio"] == pytest.approx(1_000_500 / read)
    assert rows[0]["compulsory_read"] == 256 * (128 * 7168 + 7168 * 512) * 2
    assert "suite/moe-decode" in capsys.readouterr().out


def test_an_implementation_that_does_not_take_the_case_is_not_applicable(tmp_path):
    fake = tmp_path / "ncu"
    fake.write_text(f"#!/bin/sh\necho 'not applicable: needs one (M, N, K)' >&2\n"
                    f"exit {dt.NOT_APPLICABLE_RC}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "t.json"
    assert dt.main(["--suite", "--only", "k-varying", "--impls", "quack", "--ncu", str(fake),
                    "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["status"] == "not_applicable" and "one (M, N, K)" in row["why"]


def test_worker_names_an_unknown_case():
    assert dt._case_spec("suite/bogus", 1234) is None
    assert dt._case_spec("NoSuchModel/down/16", 1234) is None
    assert dt._case_spec("OLMoE-1B-7B/down/16", 1234).name == "OLMoE-1B-7B/down/16"
    assert dt._case_spec("suite/mixtral", 1234).name == "mixtral"


def test_cli_errors_are_exit_2(capsys):
    assert dt.main(["--impls", "ours,bogus", "--ncu", sys.executable]) == 2
    assert "bogus" in capsys.readouterr().err
    assert dt.main(["--proj", "up", "--ncu", sys.executable]) == 2
    assert dt.main(["--ncu", "/nonexistent/ncu"]) == 2
    assert "ncu" in capsys.readouterr().err
    assert dt.main(["--models", "NoSuchModel", "--ncu", sys.executable]) == 2
    assert dt.main(["--suite", "--fp8", "--ncu", sys.executable]) == 2
    assert dt.main(["--only", "uniform", "--ncu", sys.executable]) == 2
    assert dt.main(["--suite", "--only", "bogus", "--ncu", sys.executable]) == 2
    assert "bogus" in capsys.readouterr().err


def test_driver_with_a_stand_in_ncu(tmp_path, capsys):
    # The stand-in checks it was asked for the metrics and the worker.
    fake = stand_in_ncu(tmp_path, "*dram__bytes_read.sum*--worker*")
    out = tmp_path / "t.json"
    rc = dt.main(["--models", "OLMoE-1B-7B", "--tokens", "16", "--proj", "down", "--impls",
                  "ours,quack", "--ncu", str(fake), "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["impl"] for r in doc["rows"]] == ["ours", "quack"]
    counts = models.topk_counts(64, 16, 8, 1234)
    read, _ = dt.compulsory_bytes(counts, 2048, 1024)
    assert doc["rows"][0]["compulsory_read"] == read
    assert doc["rows"][0]["read_ratio"] == pytest.approx(1_000_500 / read)
    assert "OLMoE-1B-7B/down/16" in capsys.readouterr().out
    # The stand-in prints no utilization columns: the bytes alone, from the same run.
    assert "did not report" in doc["rows"][0]["utilization_error"]
    assert "tensor_pct" not in doc["rows"][0]


def test_utilization_is_time_weighted():
    both = {**dt.METRICS, **dt.UTILIZATION}
    names = list(both)
    text = "\n".join(['"ID","Kernel Name",' + ",".join(f'"{n}"' for n in names)] + [
        f'"{i}","k{i}",' + ",".join(f'"{v}"' for v in vals)
        for i, vals in enumerate([(100, 0, 10, 1000, 90, 50, 20), (100, 0, 10, 3000, 50, 10, 60)])])
    ks = dt.parse_ncu_csv(text, both)
    row = dt.summarize(ks, [(64, 64, 64)])
    assert row["tensor_pct"] == pytest.approx((90 * 1000 + 50 * 3000) / 4000)
    assert row["dram_pct"] == pytest.approx((20 * 1000 + 60 * 3000) / 4000)


def test_unreported_utilization_keeps_the_rest_without_a_second_run(tmp_path):
    # ncu reports the bytes and two of the three utilizations: one profile, the two kept.
    names = list(dt.METRICS) + list(dt.UTILIZATION)[1:]
    text = "\n".join(['"ID","Kernel Name",' + ",".join(f'"{n}"' for n in names),
                      '"0","k0","100","0","10","1000","40","70"'])
    runs = tmp_path / "runs"
    fake = tmp_path / "ncu"
    (tmp_path / "out.csv").write_text(text + "\n")
    fake.write_text(f"#!/bin/sh\necho run >> {runs}\ncat {tmp_path / 'out.csv'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    row = dt.measure(str(fake), "OLMoE-1B-7B/down/16", "ours", 1234,
                     {"N": 64, "K": 64}, [(64, 64, 64)])
    assert row["status"] == "ok" and runs.read_text().count("run") == 1
    assert row["l2_pct"] == 40 and row["dram_pct"] == 70 and "tensor_pct" not in row
    assert list(dt.UTILIZATION)[0] in row["utilization_error"]


def test_parse_refuses_output_lacking_a_required_metric_even_with_optional_ones():
    bad = '"ID","Kernel Name","dram__bytes_read.sum"\n"0","k","5"\n'
    with pytest.raises(ValueError, match="lacks"):
        dt.parse_ncu_csv(bad, {**dt.METRICS, **dt.UTILIZATION}, optional=tuple(dt.UTILIZATION))


def test_driver_reports_a_failing_worker(tmp_path):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho 'worker died' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "t.json"
    assert dt.main(["--models", "OLMoE-1B-7B", "--tokens", "16", "--proj", "down", "--impls",
                    "ours", "--ncu", str(fake), "--out", str(out)]) == 1
    row = json.loads(out.read_text())["rows"][0]
    assert row["status"] == "error" and "worker died" in row["error"]
    assert row["returncode"] == 3
    assert "utilization_error" not in row  # a worker's own failure is not run twice


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("ncu") is None, reason="needs ncu (Nsight Compute)")
def test_real_ncu_on_one_case(tmp_path):
    out = tmp_path / "t.json"
    assert dt.main(["--models", "OLMoE-1B-7B", "--tokens", "2048", "--proj", "down",
                    "--impls", "ours,mm_loop", "--out", str(out)]) == 0
    ours, loop = json.loads(out.read_text())["rows"]
    # Caches are flushed before each kernel: every operand byte comes from DRAM at least once.
    assert ours["read_ratio"] >= 0.99 and loop["read_ratio"] >= 0.99
    # (cuBLAS may add a reduction kernel to an expert's mm.)
    assert ours["kernels"] >= 1 and loop["kernels"] >= sum(
        1 for c in models.topk_counts(64, 2048, 8, 1234) if c)


def test_fp8_cases_and_implementations(tmp_path, capsys):
    assert dt.main(["--fp8", "--impls", "ours", "--ncu", sys.executable]) == 2
    assert "for --fp8" in capsys.readouterr().err
    assert dt.main(["--fp8", "--models", "Mixtral-8x7B", "--ncu", sys.executable]) == 2
    fake = stand_in_ncu(tmp_path)
    out = tmp_path / "t.json"
    assert dt.main(["--fp8", "--models", "Qwen3-30B-A3B", "--tokens", "16", "--proj", "down",
                    "--ncu", str(fake), "--out", str(out), "--bytes-only"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == list(dt.FP8_IMPLS)
    assert all(r["case"] == "Qwen3-30B-A3B/down/16/fp8" for r in rows)
    counts = models.topk_counts(128, 16, 8, 1234)
    assert rows[0]["compulsory_read"] == dt.compulsory_bytes(counts, 2048, 768, 1)[0]


def test_ours_pinned_to_a_config(tmp_path, capsys):
    assert dt.main(["--impls", "ours:pp 999x1", "--ncu", sys.executable]) == 2
    assert "ours:pp 999x1" in capsys.readouterr().err
    assert dt.main(["--fp8", "--impls", "ours:pp 128x192", "--ncu", sys.executable]) == 2
    fake = stand_in_ncu(tmp_path, '*"ours:coop 128x256 c1x2"*')
    out = tmp_path / "t.json"
    assert dt.main(["--models", "OLMoE-1B-7B", "--tokens", "16", "--proj", "down", "--impls",
                    "ours:coop 128x256 c1x2", "--ncu", str(fake), "--out", str(out),
                    "--bytes-only"]) == 0
    assert json.loads(out.read_text())["rows"][0]["impl"] == "ours:coop 128x256 c1x2"
    cfg = dt._config_of("ours:coop 128x256 c1x2")
    assert (cfg.schedule, cfg.tile_m, cfg.tile_n, cfg.cluster_n) == ("cooperative", 128, 256, 2)


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("ncu") is None, reason="needs ncu (Nsight Compute)")
def test_real_ncu_on_a_suite_shape(tmp_path):
    out = tmp_path / "t.json"
    assert dt.main(["--suite", "--only", "moe-down", "--impls", "ours", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and row["read_ratio"] >= 0.99


def test_stall_ratios_are_time_weighted_and_summarized(tmp_path, capsys):
    names = list(dt.METRICS) + list(dt.STALLS)
    reasons = {"stall_barrier": (1.0, 3.0), "stall_long_scoreboard": (2.0, 0.0),
               "stall_wait": (0.25, 0.25), "issue_pct": (40.0, 60.0)}

    def value(short, i):
        return reasons.get(short, (0.0, 0.0))[i]

    shorts = list(dt.STALLS.values())
    rows = [(100, 0, 10, 1000), (100, 0, 10, 3000)]
    text = "\n".join(['"ID","Kernel Name",' + ",".join(f'"{n}"' for n in names)] + [
        f'"{i}","k{i}",' + ",".join(f'"{v}"' for v in rows[i])
        + "," + ",".join(f'"{value(s, i)}"' for s in shorts) for i in range(2)])
    row = _one_row(tmp_path, "*stalled_barrier_per_issue_active*--worker*", text, "--stalls")
    assert row["stall_barrier"] == pytest.approx((1.0 * 1000 + 3.0 * 3000) / 4000)
    assert row["stall_long_scoreboard"] == pytest.approx(0.5)
    assert row["issue_pct"] == pytest.approx(55.0)
    assert "stall_error" not in row and "utilization_error" not in row
    assert dt.stall_summary(row, top=2) == "issue 55% | barrier 2.50, long_scoreboard 0.50"
    assert "stalls/issue: issue 55% | barrier 2.50" in capsys.readouterr().out
    assert dt.stall_summary({"issue_pct": 50.0}) == ""


def test_an_ncu_that_refuses_the_stall_names_keeps_the_utilizations(tmp_path):
    # First run (stall names asked): ncu refuses them; second run: bytes and utilizations.
    names = list(dt.METRICS) + list(dt.UTILIZATION)
    ok = "\n".join(['"ID","Kernel Name",' + ",".join(f'"{n}"' for n in names),
                    '"0","k0","100","0","10","1000","80","40","70"'])
    (tmp_path / "ok.csv").write_text(ok + "\n")
    runs = tmp_path / "runs"
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n"
                    f"echo run >> {runs}\n"
                    'case "$*" in *stalled*) echo "==ERROR== Failed to find metric '
                    'smsp__average_warps_issue_stalled_x" >&2; exit 1;; esac\n'
                    f"cat {tmp_path / 'ok.csv'}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    row = dt.measure(str(fake), "OLMoE-1B-7B/down/16", "ours", 1234, {"N": 64, "K": 64},
                     [(64, 64, 64)], stalls=True)
    assert row["status"] == "ok" and runs.read_text().count("run") == 2
    assert "Failed to find metric" in row["stall_error"]
    assert row["tensor_pct"] == 80 and "utilization_error" not in row
    assert not any(k.startswith("stall_") and k != "stall_error" for k in row)


def test_fabric_sectors_are_summed_and_printed(tmp_path, capsys):
    # Two kernels (the mm loop's shape): the fabric sectors add up like the bytes, unlike the
    # time-weighted ratios.
    names = list(dt.METRICS) + list(dt.FABRIC)
    rows = [(100, 0, 6400, 1000, 50), (100, 0, 3200, 3000, 150)]
    text = "\n".join(['"ID","Kernel Name",' + ",".join(f'"{n}"' for n in names)] + [
        f'"{i}","k{i}",' + ",".join(f'"{v}"' for v in rows[i]) for i in range(2)])
    row = _one_row(tmp_path, "*ltcfabric*--worker*", text, "--fabric")
    assert row["l2_fabric_sectors"] == 200
    assert "fabric_error" not in row
    # 200 sectors of 32 bytes against 9600 L2 bytes
    assert "L2 fabric: 0.00 GB (67% of L2 bytes)" in capsys.readouterr().out


def _one_row(tmp_path, pattern, text, flag):
    """The row of one OLMoE case of ours profiled by a stand-in ncu answering `text` to a
    command matching `pattern`, with --bytes-only and `flag`."""
    fake = stand_in_ncu(tmp_path, pattern, text)
    out = tmp_path / "rows.json"
    assert dt.main(["--models", "OLMoE-1B-7B", "--tokens", "16", "--proj", "down", "--impls",
                    "ours", "--bytes-only", flag, "--ncu", str(fake), "--out", str(out)]) == 0
    return json.loads(out.read_text())["rows"][0]
