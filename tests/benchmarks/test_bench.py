"""The benchmark harness on the CPU: arithmetic, routing, checking, and end-to-end smoke runs."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench, host_overhead
from benchmarks import suite as bench_suite
from benchmarks.scoring import bytes_needed, derive, floor_ms, flops, format_table
from benchmarks.suite import (
    DEFAULT_NAME,
    TOLERANCE,
    GeneralInputs,
    ShapeSpec,
    VarlenInputs,
    full_suite,
    input_sets_needed,
    make_inputs,
    reference,
    rel_err,
    zipf_counts,
)
from moe_gemm.ops import api as ops

ROW_KEYS = {"shape", "impl", "ms", "peer", "default", "floor_ms", "status"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _suite(name: str) -> ShapeSpec:
    return next(s for s in full_suite() if s.name == name)


# ---------------------------------------------------------------------------------------------
# Arithmetic on hand-computed examples


def test_bytes_and_flops_hand_computed() -> None:
    sizes = [(2, 3, 4), (0, 5, 6), (1, 1, 1)]
    # (2*4 + 4*3) * 2 + 2*3*4 = 64; the M=0 expert reads no weights: 0; (1 + 1) * 2 + 1 * 4 = 8
    assert bytes_needed(sizes, in_elem=2, out_elem=4) == 72
    assert flops(sizes) == 2 * 2 * 3 * 4 + 2 * 1 * 1 * 1


def test_headline_bytes_match_perf_notes() -> None:
    sizes = _suite("uniform").sizes(0)
    assert len(sizes) == 256
    assert bytes_needed(sizes, 2, 2) == 2_382_364_672  # PERF-NOTES: 2382.4 MB
    assert flops(sizes) == 2 * 256 * 128 * 512 * 7168
    # The issue's reference: 0.554 ms at 4.3 TB/s (memory-bound; 1e15 FLOP/s is no limit).
    ms, bound = floor_ms(bytes_needed(sizes, 2, 2), flops(sizes), 4.3e12, 1e15)
    assert bound == "memory" and ms == pytest.approx(0.554, abs=1e-3)


def test_floor_picks_the_larger_term() -> None:
    assert floor_ms(2e9, 1e11, 4e12, 1e15) == (pytest.approx(0.5), "memory")
    assert floor_ms(1e9, 3e12, 4e12, 1e15) == (pytest.approx(3.0), "compute")
    with pytest.raises(ValueError):
        floor_ms(1, 1, 0.0, 1.0)


def test_varlen_bytes_skip_empty_experts() -> None:
    spec = _suite("moe-decode")
    sizes = spec.sizes(1234)
    used = sum(1 for m, _, _ in sizes if m > 0)
    expect = (1024 * 7168 + used * 7168 * 512) * 2 + 1024 * 512 * 2
    assert bytes_needed(sizes, 2, 2) == expect
    assert used < 256


def test_input_sets_needed() -> None:
    l2 = 60 << 20
    assert input_sets_needed(2_400_000_000, l2, 64) == 1
    assert input_sets_needed(2 * l2, l2, 64) == 1
    assert input_sets_needed(l2, l2, 64) == 2
    assert input_sets_needed(10 << 20, l2, 64) == 12  # 12 x 10 MiB = 2 x 60 MiB
    assert input_sets_needed(1, l2, 8) == 8  # capped
    n = input_sets_needed(7 << 20, l2, 64)
    assert n * (7 << 20) >= 2 * l2


# ---------------------------------------------------------------------------------------------
# Routing


def test_zipf_deterministic_and_sums() -> None:
    a = zipf_counts(256, 1024, 1.2, seed=3)
    assert a == zipf_counts(256, 1024, 1.2, seed=3)
    assert a != zipf_counts(256, 1024, 1.2, seed=4)
    assert sum(a) == 1024 and len(a) == 256 and min(a) >= 0
    # Skewed: the busiest expert takes many times the mean of 4 rows.
    assert max(a) > 40


def test_moe_decode_routing_leaves_experts_empty() -> None:
    spec = _suite("moe-decode")
    counts = spec.counts(1234)
    assert counts == spec.counts(1234)
    assert len(counts) == 256 and sum(counts) == 1024
    assert sum(1 for c in counts if c == 0) >= 20
    for seed in range(5):
        assert 0 in spec.counts(seed)


def test_skewed_shapes_route_every_row() -> None:
    for spec in full_suite():
        if spec.form == "varlen":
            counts = spec.counts(7)
            assert len(counts) == spec.experts and sum(counts) == spec.rows


def test_uniform_routing_is_balanced() -> None:
    counts = zipf_counts(8, 16384, 0.0, seed=1)
    assert sum(counts) == 16384
    assert max(counts) < 1.1 * 2048 and min(counts) > 0.9 * 2048


def test_zipf_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="experts"):
        zipf_counts(0, 10, 1.2, 0)
    with pytest.raises(ValueError, match="rows"):
        zipf_counts(4, -1, 1.2, 0)
    with pytest.raises(ValueError, match="s must"):
        zipf_counts(4, 10, -1.0, 0)


def test_shape_spec_validation() -> None:
    with pytest.raises(ValueError, match="form"):
        ShapeSpec("x", "ragged", problems=((1, 1, 1),))
    with pytest.raises(ValueError, match="dtype"):
        ShapeSpec("x", "general", "int8", problems=((1, 1, 1),))
    with pytest.raises(ValueError, match="problems"):
        ShapeSpec("x", "general")


def test_suite_matches_issue() -> None:
    by = {s.name: s for s in full_suite()}
    assert set(by) == {"uniform", "moe-decode", "moe-prefill", "mixtral", "moe-down",
                       "k-varying", "uniform-fp16"}
    assert by["uniform"].headline and by["uniform"].variants and by["k-varying"].variants
    assert by["uniform-fp16"].dtype == "fp16" and not by["uniform-fp16"].variants
    kv = by["k-varying"].sizes(0)
    assert len(kv) == 64 and {k for _, _, k in kv} == {128, 1024}
    assert (by["moe-prefill"].experts, by["moe-prefill"].rows) == (32, 32768)
    assert (by["mixtral"].n, by["mixtral"].k) == (14336, 4096)
    assert (by["moe-down"].experts, by["moe-down"].n, by["moe-down"].k) == (64, 2048, 1408)


# ---------------------------------------------------------------------------------------------
# Inputs and the reference


def test_inputs_random_layout_and_reference() -> None:
    spec = ShapeSpec("v", "varlen", experts=4, rows=40, n=16, k=24)
    counts = spec.counts(0)
    inp = make_inputs(spec, counts, torch.device("cpu"), seed=5)
    assert isinstance(inp, VarlenInputs)
    assert inp.x.shape == (40, 24) and inp.w.shape == (4, 24, 16)
    assert inp.w_t.is_contiguous() and inp.w.stride() == (16 * 24, 1, 24)  # transposed view
    assert inp.offs.dtype == torch.int32 and inp.offs.tolist() == bench_suite.offsets(counts)
    assert inp.x.abs().sum() > 0 and inp.w.abs().sum() > 0  # never zeros
    again = make_inputs(spec, counts, torch.device("cpu"), seed=5)
    other = make_inputs(spec, counts, torch.device("cpu"), seed=6)
    assert torch.equal(inp.x, again.x) and not torch.equal(inp.x, other.x)
    ref = reference(inp)
    expect = torch.cat([inp.x[s:e].double() @ inp.w[i].double() for i, (s, e) in
                        enumerate(zip([0, *bench_suite.offsets(counts)],
                                      bench_suite.offsets(counts)))])
    assert torch.allclose(ref.double(), expect.reshape(-1), rtol=1e-5, atol=1e-6)


def test_rel_err_catches_unwritten_and_wrong() -> None:
    spec = ShapeSpec("g", "general", problems=((8, 16, 32), (4, 8, 16)))
    inp = make_inputs(spec, spec.counts(0), torch.device("cpu"), seed=1)
    assert isinstance(inp, GeneralInputs)
    ref = reference(inp)
    good = [a @ b for a, b in zip(inp.a, inp.b)]
    assert rel_err(good, ref) < TOLERANCE["bf16"]
    half = [good[0], torch.full_like(good[1], float("nan"))]
    assert not rel_err(half, ref) <= TOLERANCE["bf16"]  # NaN never passes
    assert rel_err([good[0], torch.zeros_like(good[1])], ref) > TOLERANCE["bf16"]
    with pytest.raises(RuntimeError, match="elements"):
        rel_err([good[0]], ref)


# ---------------------------------------------------------------------------------------------
# Derived numbers and the bar


def _doc() -> dict:
    row = lambda impl, ms, peer=False, default=False, status="ok": {  # noqa: E731
        "shape": "s", "impl": impl, "ms": ms, "peer": peer, "default": default,
        "status": status}
    return {
        "device": "test", "date": "2026-01-01",
        "ceilings": {"copy_bytes_per_s": 1e12, "mm_flops_per_s": 1e15},
        "shapes": {"s": {"bytes": 2_000_000_000, "flops": 10**12, "headline": True}},
        "results": [
            row(DEFAULT_NAME, 2.5, default=True),
            row("peer-a", 3.0, peer=True),
            row("peer-b", 4.0, peer=True),
            {**row("moe_gemm pingpong/host/ksort-on", None, status="error"), "error": "boom"},
            {**row("QuACK varlen", None, peer=True, status="n/a"), "reason": "not here"},
        ],
    }


def test_derive_hand_computed() -> None:
    doc = _doc()
    derive(doc)
    assert doc["shapes"]["s"]["floor_ms"] == pytest.approx(2.0)  # 2 GB at 1 TB/s
    assert doc["shapes"]["s"]["floor_bound"] == "memory"
    ours = doc["results"][0]
    assert ours["tflops"] == pytest.approx(400.0)  # 1e12 FLOP in 2.5 ms
    assert ours["gbps"] == pytest.approx(800.0)  # 2e9 B in 2.5 ms
    assert ours["fraction_of_floor"] == pytest.approx(0.8)
    assert ours["vs_best_peer"] == pytest.approx(1.2) and ours["best_peer"] == "peer-a"
    assert doc["results"][2]["vs_best_peer"] == pytest.approx(0.75)
    assert doc["results"][3]["floor_ms"] == pytest.approx(2.0)
    assert "tflops" not in doc["results"][3]
    bar = doc["bar"]
    assert bar["shapes"]["s"]["ok"] is True
    assert bar["headline_fraction_of_floor"] == pytest.approx(0.8)
    assert bar["pass"] is False  # 0.8 of the floor is under the 0.95 bar
    doc["results"][0]["ms"] = 2.05
    derive(doc)
    assert doc["bar"]["pass"] is True


def test_derive_default_slower_or_failed() -> None:
    doc = _doc()
    doc["results"][0]["ms"] = 3.5
    derive(doc)
    assert doc["bar"]["shapes"]["s"]["ok"] is False and not doc["bar"]["pass"]
    doc = _doc()
    doc["results"][0].update(status="error", ms=None, error="kernel failed")
    derive(doc)
    assert doc["bar"]["shapes"]["s"]["ok"] is False
    assert "kernel failed" in doc["bar"]["shapes"]["s"]["why"]


def test_table_skips_failures_and_lists_them() -> None:
    doc = _doc()
    derive(doc)
    table = format_table(doc)
    lines = table.splitlines()
    assert "shape" in lines[1] and "vs best peer" in lines[1]
    body = [ln for ln in lines if ln.startswith("s ")]
    assert [ln.split("|")[1].strip() for ln in body] == [
        "(roofline floor, memory)", DEFAULT_NAME, "peer-a", "peer-b"]
    assert "1.20x" in body[1] and "80" in body[1]
    assert "1 failed, 1 n/a" in table and "boom" in table


# ---------------------------------------------------------------------------------------------
# End to end (--smoke on the CPU, torch backend)


def _no_constant(word: str) -> None:
    raise AssertionError(f"{word} in a results file: not JSON")


def _load(path: Path) -> dict:
    doc = json.loads(path.read_text(), parse_constant=_no_constant)
    assert isinstance(doc["device"], str) and isinstance(doc["date"], str)
    assert isinstance(doc["results"], list) and doc["results"]
    for row in doc["results"]:
        assert ROW_KEYS <= set(row), row
        assert isinstance(row["peer"], bool) and isinstance(row["default"], bool)
    return doc


def test_smoke_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r" / "bench.json", tmp_path / "r" / "bench.png"
    assert bench.main(["--smoke", "--out", str(out), "--png", str(png), "--quiet"]) == 0
    doc = _load(out)
    assert doc["complete"] is True
    shapes = [s.name for s in bench_suite.smoke_suite()]
    assert list(doc["shapes"]) == shapes
    ceil = doc["ceilings"]
    assert ceil["copy_bytes_per_s"] > 0 and ceil["mm_flops_per_s"] > 0
    for name in shapes:
        rows = [r for r in doc["results"] if r["shape"] == name]
        defaults = [r for r in rows if r["default"]]
        assert len(defaults) == 1 and defaults[0]["impl"] == DEFAULT_NAME
        d = defaults[0]
        assert d["status"] == "ok", d
        assert d["ms"] > 0 and d["ms_single"] > 0 and d["rel_err"] < TOLERANCE["bf16"]
        assert d["backend"] == "torch"  # smoke on a CPU: the torch backend ran
        assert d["fraction_of_floor"] == pytest.approx(d["floor_ms"] / d["ms"])
        assert d["tflops"] == pytest.approx(doc["shapes"][name]["flops"] / d["ms"] / 1e9)
        peers = [r for r in rows if r["peer"]]
        assert any(r["status"] == "ok" for r in peers)
        assert {r["impl"] for r in peers} >= {"torch.bmm", "torch.mm loop",
                                              "torch.mm loop (CUDA graph)", "QuACK varlen"}
        best = min(r["ms"] for r in peers if r["status"] == "ok")
        assert d["vs_best_peer"] == pytest.approx(best / d["ms"])
        graph = next(r for r in peers if r["impl"] == "torch.mm loop (CUDA graph)")
        assert graph["status"] == "n/a" and "CUDA" in graph["reason"]
        assert doc["shapes"][name]["input_sets"] == 2  # L2 rotation exercised
    kv = [r for r in doc["results"] if r["shape"] == "k-varying"]
    assert {r["impl"]: r["status"] for r in kv}["torch.bmm"] == "n/a"
    lists = [r for r in doc["results"] if r["impl"] == bench_suite.LIST_NAME]
    # Uniform shapes: the default row is the 3-D call; the list call is reported beside it.
    assert {r["shape"] for r in lists} == {"uniform", "uniform-fp16"}
    assert all(r["status"] == "ok" and not r["default"] for r in lists)
    variants = [r for r in doc["results"] if r["impl"].startswith("moe_gemm ")
                and not r["default"] and r["impl"] != bench_suite.LIST_NAME]
    assert len(variants) == 16  # 8 on uniform, 8 on k-varying
    assert {r["shape"] for r in variants} == {"uniform", "k-varying"}
    for r in variants:  # backend="cute" cannot run on a CPU: not applicable here, with why
        assert r["status"] == "n/a" and r["ms"] is None
        assert "Hopper kernels cannot run here" in r["reason"]
        assert r["config"]["backend"] == "cute"
    host = doc["host_overhead"]["calls"]
    for name in (host_overhead.OURS_MM2, host_overhead.OURS_MM3, host_overhead.TORCH_MM2,
                 host_overhead.TORCH_MM3, host_overhead.PLAN, host_overhead.GEMM8,
                 host_overhead.GEMM256):
        assert host[name]["cpu_us"] > 0, name
    checks = doc["host_overhead"]["checks"]
    assert all(isinstance(c["ok"], bool) for c in checks.values()), checks
    assert set(doc["bar"]["shapes"]) == set(shapes)

    printed = capsys.readouterr().out.strip().splitlines()
    table_start = next(i for i, ln in enumerate(printed) if ln.startswith("shape "))
    table = printed[table_start:]
    assert printed[-1].startswith("  FAILED") or "failed" in printed[-1]
    for name in shapes:
        assert any(ln.startswith(f"{name} ") and DEFAULT_NAME in ln for ln in table)
    assert not any("pingpong/" in ln for ln in table if " | " in ln)  # errors stay out
    assert all(len(ln) <= 120 for ln in table)

    if png.exists():
        assert png.read_bytes()[:8] == PNG_MAGIC
    else:
        pytest.importorskip("matplotlib")
        pytest.fail("matplotlib is installed but no PNG was written")


def test_only_subset_and_default_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--smoke", "--only", "moe-decode", "--no-variants", "--reps", "2",
                       "--quiet", "--png", "none"]) == 0
    files = list((tmp_path / "benchmarks" / "results").glob("bench-*.json"))
    assert len(files) == 1 and not list(tmp_path.rglob("*.png"))
    # named <suite>-<device>-<date> as the results folder's records are (it had no device)
    assert re.fullmatch(r"bench-cpu-\d{4}-\d{2}-\d{2}\.json", files[0].name), files[0].name
    doc = _load(files[0])
    assert set(doc["shapes"]) == {"moe-decode"} and "host_overhead" not in doc
    assert doc["shapes"]["moe-decode"]["routing"]["kind"] == "zipf"
    assert doc["shapes"]["moe-decode"]["routing"]["s"] == pytest.approx(1.2)
    assert all(r["reps"] == 2 for r in doc["results"] if r["status"] == "ok")


def test_cli_errors_and_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--smoke", "--only", "nope"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert bench.main(["--smoke", "--reps", "0"]) == 2
    assert bench.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "moe-decode" in listed and "host-overhead" in listed
    # --list with --only lists what a run would take (it listed the whole suite)
    assert bench.main(["--list", "--only", "moe-decode"]) == 0
    listed = capsys.readouterr().out.split()
    assert "moe-decode" in listed and "host-overhead" not in listed
    assert bench.main(["--list", "--only", "nope"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main([]) == 2  # the full suite needs a GPU
        assert "--smoke" in capsys.readouterr().err


@pytest.mark.parametrize("suite, skip, bad", [
    ("bench", ["torch.bmmm"], "'torch.bmmm'"),
    ("bench", ["torch.bmm", "moe_gemm grouped_mm 2D"], "'moe_gemm grouped_mm 2D'"),
    ("fp8", ["torch.bmm"], "'torch.bmm'")])  # a bf16 row's name, in the FP8 suite
def test_an_unknown_skip_impl_is_refused_with_the_names(
        suite: str, skip: list[str], bad: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A misspelt --skip-impl matched no row and skipped nothing, without a word: the run then
    # timed (or crashed in) what it was asked to leave out.
    out = tmp_path / "b.json"
    argv = ["--suite", suite, "--smoke", "--quiet", "--out", str(out), "--png", "none"]
    for name in skip:
        argv += ["--skip-impl", name]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --skip-impl: no implementation named {bad};"), err
    assert err.count("\n") == 1 and not out.exists()
    shapes = bench.SHAPES[suite][1]()
    names = bench.impl_names(shapes, suite == "bench")
    assert all(repr(n) in err for n in names), err
    assert (host_overhead.GEMM8 in names) == (suite == "bench")
    assert {i.name for s in shapes for i in bench.shape_implementations(
        s, _Options(), 0, {})} <= set(names)


class _Options:
    variants = True
    quack_tuned = True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's /proc")
@pytest.mark.parametrize("option", ["--out", "--png"])
def test_an_out_or_png_where_no_file_can_be_made_is_refused_before_the_suite_runs(
        option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # For root, os.access calls /proc writable: `--out /proc/b.json` ran the whole suite, then
    # died in a traceback writing the JSON (--png: the PNG). os.access answers here as for root.
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)
    out = tmp_path / "b.json"
    argv = ["--out", "/proc/b.json"] if option == "--out" else [
        "--out", str(out), "--png", "/proc/b.png"]
    assert bench.main(["--smoke", "--only", "uniform", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    target = "/proc/b.json" if option == "--out" else "/proc/b.png"
    assert err.startswith(f"error: {option} {target}: cannot create a file in its folder")
    assert err.count("\n") == 1 and not out.exists()


def test_a_known_skip_impl_leaves_those_rows_out(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    assert bench.main(["--smoke", "--only", "uniform", "--no-variants", "--reps", "2",
                       "--quiet", "--png", "none", "--no-table", "--out", str(out),
                       "--skip-impl", "torch.bmm", "--skip-impl",
                       bench_suite.QUACK_TUNED_NAME]) == 0
    impls = {r["impl"] for r in _load(out)["results"]}
    assert DEFAULT_NAME in impls and "torch.mm loop" in impls and "torch.bmm" not in impls


@pytest.mark.parametrize("only", ["", " ", ","])
def test_an_empty_only_is_refused_not_the_whole_suite(
        only: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `--only ""` ran the whole smoke suite, as if --only were not given.
    assert bench.main(["--smoke", "--only", only, "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only names no shape;") and err.count("\n") == 1
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("argv, words", [
    (["--out", "{folder}"], "error: --out {folder}: is a folder, not a file"),
    (["--out", "{folder}/b.json", "--png", "{folder}"],
     "error: --png {folder}: is a folder, not a file"),
    (["--out", "{folder}/b.json", "--isolate", "--timeout", "-1"],
     "error: --timeout must be positive"),
    (["--out", "{folder}/b.json", "--isolate", "--timeout", "nan"],
     "error: --timeout must be positive"),
    # (it bounds --isolate's subprocesses; alone it bounded nothing and said nothing)
    (["--out", "{folder}/b.json", "--timeout", "60"], "error: --timeout applies with --isolate only")])
def test_bad_out_png_and_timeout_are_refused_before_the_suite_runs(
        argv: list[str], words: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # --out naming a folder ran the whole suite and then died in a traceback renaming
    # <out>.tmp onto the folder (leaving the .tmp behind); --isolate --timeout -1 "timed out"
    # every shape at once and exited 0.
    folder = tmp_path / "results"
    folder.mkdir()
    argv = [a.format(folder=folder) for a in argv]
    assert bench.main(["--smoke", "--only", "uniform", "--quiet", *argv]) == 2
    assert capsys.readouterr().err == words.format(folder=folder) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    assert list(folder.iterdir()) == []


def test_failing_and_wrong_implementations_are_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> object:
        raise RuntimeError("peer exploded")

    def lazy(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None = None, *, out=None,
             **kw: object):
        return out if out is not None else torch.zeros(*x.shape[:-1], w.shape[2],
                                                       dtype=x.dtype)

    monkeypatch.setattr(bench_suite, "_build_bmm", boom)
    monkeypatch.setattr(ops, "grouped_mm", lazy)  # writes nothing: must fail the check
    out = tmp_path / "b.json"
    # (exit 1: our rows failed; the run still finishes and records every row)
    assert bench.main(["--smoke", "--only", "uniform,moe-down", "--no-variants", "--quiet",
                       "--png", "none", "--no-table", "--out", str(out)]) == 1
    doc = _load(out)
    rows = {(r["shape"], r["impl"]): r for r in doc["results"]}
    assert rows[("uniform", "torch.bmm")]["status"] == "error"
    assert "peer exploded" in rows[("uniform", "torch.bmm")]["error"]
    assert rows[("uniform", bench_suite.LIST_NAME)]["status"] == "ok"  # grouped_gemm unaffected
    lazy_3d = rows[("uniform", DEFAULT_NAME)]  # the 3-D grouped_mm call writes nothing
    assert lazy_3d["status"] == "error" and "wrong result" in lazy_3d["error"]
    assert rows[("uniform", "torch.mm loop")]["status"] == "ok"
    bad = rows[("moe-down", DEFAULT_NAME)]
    assert bad["status"] == "error" and "wrong result" in bad["error"]
    # NaN in the run, null in the file: the bare word NaN is not JSON (strict readers refuse it)
    assert bad["rel_err"] is None and bad["ms"] is None
    json.loads(out.read_text(), parse_constant=_no_constant)
    assert rows[("moe-down", "torch.mm loop")]["status"] == "ok"
    assert doc["bar"]["shapes"]["moe-down"]["ok"] is False


@pytest.mark.slow
def test_isolate_survives_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    # The crash comes in the interleaved timing phase, when the other implementations have
    # passed their checks but have no times yet: they must be retried, the culprit not.
    monkeypatch.setenv(bench.ABORT_ENV, "uniform/torch.bmm@timing")
    out = tmp_path / "iso.json"
    assert bench.main(["--smoke", "--isolate", "--only", "uniform", "--no-variants",
                       "--out", str(out), "--png", "none"]) == 0
    doc = _load(out)
    rows = {r["impl"]: r for r in doc["results"]}
    assert len(rows) == len(doc["results"])  # no implementation recorded twice
    assert rows[DEFAULT_NAME]["status"] == "ok"
    assert rows["torch.bmm"]["status"] == "error" and "died" in rows["torch.bmm"]["error"]
    assert rows["torch.bmm"]["peer"] is True
    assert rows["torch.mm loop"]["status"] == "ok"  # ran in the retry, after the crash
    assert rows[bench_suite.GROUPED_MM_NAME]["status"] == "ok"
    assert doc["ceilings"]["copy_bytes_per_s"] > 0 and len(doc["ceilings"]["per_process"]) == 2
    assert rows[DEFAULT_NAME]["floor_ms"] > 0 and rows[DEFAULT_NAME]["vs_best_peer"] > 0
    err = capsys.readouterr().err
    assert "retrying without it" in err


def test_error_while_timing_drops_only_that_implementation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = bench_suite._build_loop
    calls = {"n": 0}  # shared by both input sets

    def flaky(spec: ShapeSpec, inp: object, device: torch.device) -> bench_suite.Prepared:
        prepared = real(spec, inp, device)

        def run() -> object:
            calls["n"] += 1
            # Preparation makes 12 calls (first call, 3 warm-up, 5 host-timed, 3 estimate);
            # each timing round 2 (smoke: one single, one back-to-back): fail in round 2.
            if calls["n"] > 14:
                raise RuntimeError("flaked while timed")
            return prepared.run()

        return bench_suite.Prepared(run, prepared.check)

    monkeypatch.setattr(bench_suite, "_build_loop", flaky)
    out = tmp_path / "t.json"
    assert bench.main(["--smoke", "--only", "moe-down", "--no-variants", "--reps", "4",
                       "--quiet", "--png", "none", "--no-table", "--out", str(out)]) == 0
    rows = {r["impl"]: r for r in _load(out)["results"]}
    assert rows["torch.mm loop"]["status"] == "error"
    assert "flaked while timed" in rows["torch.mm loop"]["error"]
    assert "host_us" in rows["torch.mm loop"]  # it had passed preparation
    assert calls["n"] == 15
    assert rows[DEFAULT_NAME]["status"] == "ok" and len(rows) == 6
    assert rows[DEFAULT_NAME]["reps"] == 4 and "ms_repeat" in rows[DEFAULT_NAME]
    assert not list(tmp_path.glob("*.inprogress"))  # the progress sidecar is cleared


def test_a_peers_own_choice_is_recorded_and_a_failing_account_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_loop, real_bmm = bench_suite._build_loop, bench_suite._build_bmm

    def told(spec: ShapeSpec, inp: object, device: torch.device) -> bench_suite.Prepared:
        p = real_loop(spec, inp, device)
        return bench_suite.Prepared(p.run, p.check, describe=lambda: f"tile for {spec.name}")

    def mute(spec: ShapeSpec, inp: object, device: torch.device) -> bench_suite.Prepared:
        def fail() -> str:
            raise RuntimeError("no account")
        p = real_bmm(spec, inp, device)
        return bench_suite.Prepared(p.run, p.check, describe=fail)

    monkeypatch.setattr(bench_suite, "_build_loop", told)
    monkeypatch.setattr(bench_suite, "_build_bmm", mute)
    out = tmp_path / "c.json"
    assert bench.main(["--smoke", "--only", "uniform", "--no-variants", "--quiet",
                       "--png", "none", "--no-table", "--out", str(out)]) == 0
    rows = {r["impl"]: r for r in _load(out)["results"]}
    assert rows["torch.mm loop"]["chosen"] == "tile for uniform"
    assert rows["torch.mm loop"]["status"] == "ok"
    assert rows["torch.bmm"]["status"] == "ok" and "chosen" not in rows["torch.bmm"]
    assert "chosen" not in rows[DEFAULT_NAME]


def test_quack_tuned_choice_reads_the_autotuners_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    class Pick:
        def __str__(self) -> str:
            return "config: GemmConfig(tile_m=128, tile_n=192, pingpong=True)"

    iface = types.ModuleType("quack.gemm_interface")
    iface.gemm_tuned = types.SimpleNamespace(best_config=Pick())
    pkg = types.ModuleType("quack")
    pkg.gemm_interface = iface
    monkeypatch.setitem(sys.modules, "quack", pkg)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", iface)
    assert bench_suite._quack_tuned_choice() == str(Pick())
    iface.gemm_tuned = types.SimpleNamespace()  # a QuACK that keeps no pick
    assert bench_suite._quack_tuned_choice() is None


def test_exit_status_says_whether_one_of_our_rows_failed(capsys: pytest.CaptureFixture[str]):
    # A script running the bench sees our failures in the exit status (they are in the JSON
    # too); a peer that cannot run here is not one.
    from benchmarks.runner import our_failures

    ok = {"shape": "s", "impl": "moe_gemm", "peer": False, "status": "ok", "ms": 1.0}
    peer_down = {"shape": "s", "impl": "QuACK", "peer": True, "status": "error", "error": "x"}
    wrong = {"shape": "t", "impl": "moe_gemm", "peer": False, "status": "error",
             "error": "wrong result: relative error 0.5 > 0.01"}
    assert our_failures({"results": [ok, peer_down]}) == []
    assert bench._exit_status({"results": [ok, peer_down]}) == 0
    assert our_failures({"results": [ok, wrong]}) == [
        "t: moe_gemm: wrong result: relative error 0.5 > 0.01"]
    assert bench._exit_status({"results": [ok, wrong, peer_down]}) == 1
    assert "failed: t: moe_gemm: wrong result" in capsys.readouterr().err



@pytest.mark.parametrize("compact", [False, True])
def test_results_files_are_strict_json_and_a_failed_write_leaves_no_temporary(
        tmp_path: Path, compact: bool) -> None:
    from benchmarks.report import write_json

    # NaN / inf (a wrong result's rel_err, a ratio over a zero time) were written as the bare
    # words NaN and Infinity, which jq and JavaScript refuse: null instead, the run's doc as it is.
    doc = {"results": [{"rel_err": float("nan"), "ms": 1.5, "r": [float("inf"), 2]}],
           "bar": {"min": float("-inf")}, "t": (1.0, float("nan"))}
    out = tmp_path / "r.json"
    write_json(out, doc, compact=compact)
    back = json.loads(out.read_text(), parse_constant=_no_constant)
    assert back == {"results": [{"rel_err": None, "ms": 1.5, "r": [None, 2]}],
                    "bar": {"min": None}, "t": [1.0, None]}
    assert math.isnan(doc["results"][0]["rel_err"])
    # An --out that is a folder: the error, and no partial <out>.tmp left beside it.
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(OSError):
        write_json(folder, doc, compact=compact)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "r.json"]


@pytest.mark.parametrize("argv", [["--sui", "fp8", "--smoke"], ["--suit=fp8", "--smoke"],
                                  ["--suite", "fp8", "--smoke"]])
def test_suite_abbreviations_pick_the_suite(argv):
    # argparse takes --sui / --suit for --suite; the suite split read only the full name and
    # ran the bf16 suite for them
    from benchmarks.bench import split_suite

    assert split_suite(argv) == ("fp8", ["--smoke"])
    assert split_suite(["--smoke"]) == ("bench", ["--smoke"])
    assert split_suite(["--sui", "nope"])[0] is None


@pytest.mark.parametrize("only", ["uniform,", "uniform,,mixtral"])
def test_an_only_with_a_stray_comma_is_refused(
        only: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--smoke", "--only", only, "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only: an empty entry in") and err.count("\n") == 1


def test_the_shortest_suite_abbreviation_selects_the_suite() -> None:
    # argparse takes --su for --suite (no other option starts so); it was parsed and ignored:
    # `--su zoo` ran the bf16 suite.
    assert bench.split_suite(["--su", "zoo", "--list"]) == ("zoo", ["--list"])
    assert bench.split_suite(["--su=fp8"]) == ("fp8", [])
    assert [a for a in bench._parser()._option_string_actions if a.startswith("--su")] == [
        "--suite"]


@pytest.mark.parametrize("option", ["--out", "--png"])
def test_an_empty_out_or_png_is_refused_not_the_default(
        option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # It was read as "the default" and wrote benchmarks/results/... under the working folder.
    monkeypatch.chdir(tmp_path)
    argv = ["--smoke", "--only", "uniform", option, " "]
    if option == "--png":
        argv += ["--out", str(tmp_path / "b.json")]
    assert bench.main(argv) == 2
    assert capsys.readouterr().err == f"error: {option} is empty (leave the option out for its " \
                                      "default)\n"
    assert not any(tmp_path.rglob("*.json")) and not any(tmp_path.rglob("*.png"))
