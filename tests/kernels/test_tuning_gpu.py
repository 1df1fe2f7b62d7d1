"""GPU tests of tuning (run on the device: `pytest -m gpu tests/kernels/test_tuning_gpu.py`):
the search on real kernels, tuned configs computing what the rules' config computes, the
online autotune with its disk cache, and no tuning under CUDA-graph capture.

The candidate lists are cut to a few configs so the tests compile little."""

from __future__ import annotations

import json

import pytest
import torch

import moe_gemm
from moe_gemm import GemmConfig
from moe_gemm.ops import heuristics, launch_info, tuned
from moe_gemm.tuning import online, space
from moe_gemm.tuning.compile_pool import CompilePool
from moe_gemm.tuning.runner import ShapeRunner
from moe_gemm.tuning.tuner import TuneShape, tune_shape
from moe_gemm.tuning.zoo import topk_counts

from .gpu_report import record

pytestmark = pytest.mark.gpu
FEW = ["pp 64x256 p8", "pp 128x192 p8", "coop 128x256 p8", "coop 128x128 c2x1 p8"]


@pytest.fixture
def few_candidates(monkeypatch, tmp_path):
    """Stage 1 cut to FEW, stage 2 to the panel and stages only; caches under tmp_path."""
    real2 = space.stage2
    monkeypatch.setattr(space, "stage1", lambda form, out_itemsize=2: [
        space.parse_name(n, form) for n in FEW])
    monkeypatch.setattr(space, "stage2", lambda parent, form, out_itemsize=2: [
        v for v in real2(parent, form, out_itemsize)
        if {k for k in parent if parent[k] != v[k]} <= {"raster_panel", "stages"}])
    monkeypatch.setattr(tuned, "TABLES_DIR", tmp_path / "shipped")
    monkeypatch.delenv(tuned.USER_TABLE_ENV, raising=False)
    monkeypatch.delenv(tuned.TABLES_ENV, raising=False)
    tuned.clear_caches()
    heuristics.clear_caches()
    yield
    tuned.clear_caches()
    heuristics.clear_caches()


@pytest.mark.parametrize("layout,timing", [("ENK", "graph"), ("EKN", "graph"),
                                           ("ENK", "eager")])
def test_search_on_the_kernels(few_candidates, layout, timing):
    counts = tuple(topk_counts(16, 512, 2, seed=5))
    shape = TuneShape("varlen", 16, 1536, 1024, sum(counts), counts, layout=layout)
    dev = torch.device("cuda")
    with CompilePool(4) as pool:
        runner = ShapeRunner(shape, dev, pool, seed=2, l2_bytes=50 << 20, timing_mode=timing)
        try:
            res = tune_shape(shape, runner, rounds=3)
        finally:
            runner.close()
    record(f"tuning/search/{layout}/{timing}", res.winner is not None, winner=getattr(
        res.winner, "name", None), failures=res.failures())
    assert res.winner is not None, res.stopped
    assert not res.failures(), res.failures()  # every candidate passed the 2x rule
    few = [o for o in res.outcomes if o.name in FEW]
    assert len(few) == len(FEW) and all(o.status in ("ok", "duplicate") for o in few)
    assert all(o.samples and o.ms > 0 for o in res.outcomes if o.status == "ok")
    # The winner, run as a caller would pin it, passes the same accuracy rule.
    x = torch.randn(shape.rows, shape.K, device=dev, dtype=torch.bfloat16)
    if layout == "ENK":
        w = torch.randn(16, shape.N, shape.K, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    else:
        w = torch.randn(16, shape.K, shape.N, device=dev, dtype=torch.bfloat16)
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    y = moe_gemm.grouped_mm(x, w, offs, config=space.config_of(res.winner.fields))
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = moe_gemm.grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
    base = (low.float() - ref).abs().max().item()
    assert (y.float() - ref).abs().max().item() <= 2 * base + 1e-5


def test_online_autotune_tunes_once_and_caches(few_candidates, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(online.AUTOTUNE_ENV, "1")
    monkeypatch.setenv(online.BUDGET_ENV, "120")
    monkeypatch.setattr(online, "_attempted", set())
    dev = torch.device("cuda")
    T, E, N, K = 384, 8, 1024, 768  # a shape no table holds
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.tensor([40, 90, 90, 200, 260, 300, 350, 384], device=dev, dtype=torch.int32)
    y = moe_gemm.grouped_mm(x, w, offs)
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = moe_gemm.grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
    err = (y.float() - ref).abs().max().item()
    base = (low.float() - ref).abs().max().item()
    assert err <= 2 * base + 1e-3 * ref.abs().max().item()
    name = torch.cuda.get_device_name(dev)
    path = tuned.online_path(name)
    doc = json.loads(path.read_text())
    record("tuning/online", True, entries=len(doc["entries"]))
    assert len(doc["entries"]) == 1 and doc["versions"]["device"] == name
    key = tuned.Key("varlen", "bfloat16", "bfloat16", E, N, K, tuned.rows_bucket(T / E))
    assert tuned.lookup(name, key, T, 132).how == "exact"
    info = launch_info.last_launch()
    entry = doc["entries"][0]["config"]
    assert (info.choice.tile_m, info.choice.tile_n) == (entry["tile_m"], entry["tile_n"])
    # A new plan for the same key (the plan cache cleared) does not tune again.
    mtime = path.stat().st_mtime
    moe_gemm.ops.api._mm_plans.clear()
    moe_gemm.grouped_mm(x, w, offs)
    assert path.stat().st_mtime == mtime


def test_no_tuning_while_capturing(few_candidates, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(online.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(online, "_attempted", set())
    dev = torch.device("cuda")
    x = torch.randn(200, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4, 512, 256, device=dev, dtype=torch.bfloat16)
    offs = torch.tensor([50, 100, 150, 200], device=dev, dtype=torch.int32)
    out = torch.empty(200, 256, device=dev, dtype=torch.bfloat16)
    # Plans built inside capture must not tune (no kernel may compile there either: warm the
    # rules' kernel first with the autotune off).
    monkeypatch.setenv(online.AUTOTUNE_ENV, "0")
    moe_gemm.grouped_mm(x, w, offs, out=out)
    moe_gemm.ops.api._mm_plans.clear()
    monkeypatch.setenv(online.AUTOTUNE_ENV, "1")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moe_gemm.grouped_mm(x, w, offs, out=out)
    g.replay()
    torch.cuda.synchronize()
    assert not tuned.online_path(torch.cuda.get_device_name(dev)).exists()
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    assert (out.float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_rerank_through_the_cli(few_candidates, tmp_path):
    """`moe-gemm tune` searches a shape into a table, then `--rerank` times that table's pick
    and its two fastest rivals in the zoo's regime and writes an entry that says so."""
    from moe_gemm.tuning import cli, table_io

    searched, reranked = tmp_path / "searched.json", tmp_path / "reranked.json"
    shape = ["--shapes", "16,1536,1024,1024", "--rounds", "3", "--workers", "4", "--quiet"]
    assert cli.main([*shape, "--out", str(searched), "--no-merge"]) == 0
    source = json.loads(searched.read_text())
    (entry,) = source["entries"]
    assert cli.main([*shape, "--rerank", str(searched), "--top", "2", "--out", str(reranked),
                     "--no-merge"]) == 0
    out = json.loads(reranked.read_text())
    (new,) = out["entries"]
    assert out["samples"] == []  # a re-rank leaves the search's samples as they are
    record("tuning/rerank", "rerank" in new, pick=entry["name"], reranked=new["name"])
    assert table_io.entry_key(new) == table_io.entry_key(entry)
    assert new["rerank"]["from"] == entry["name"] and new["rerank"]["from_us"] > 0
    assert new["rerank"]["regime"].startswith("eager, rest 0.0 ms, samples of 5.0 ms")
    timed = set(new["rerank"]["timed"])
    assert entry["name"] in timed and 3 <= len(timed) <= 4  # pick, 2 rivals, (rules)
    sampled = {space.name_of({"stages": None, **s["config"]}) for s in source["samples"]}
    assert new["name"] in sampled | timed


def test_a_rerank_against_the_swapped_kernel_decides_what_the_default_launches(
        few_candidates, tmp_path, monkeypatch):
    """On 256 rows of each of 16 experts, K = 2048 (the window's rows, N = 512 below its one
    wave) a re-rank with the swapped kernel as a rival writes an entry that names swap_ab, and
    with that table the default launches what the entry says, whichever way the timing went
    (on an H200, 2026-12-01: ping-pong 128x192 4 stages, not swapped)."""
    from moe_gemm.tuning import cli

    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    searched, reranked = tmp_path / "searched.json", tmp_path / "reranked.json"
    shape = ["--shapes", "16,512,2048,4096", "--rounds", "3", "--workers", "4", "--quiet"]
    assert cli.main([*shape, "--out", str(searched), "--no-merge"]) == 0
    assert cli.main([*shape, "--rerank", str(searched), "--top", "1", "--rivals",
                     "swap 256x128", "--out", str(reranked), "--no-merge"]) == 0
    (new,) = json.loads(reranked.read_text())["entries"]
    assert isinstance(new["config"].get("swap_ab"), bool), new["config"]
    assert any(n.startswith("swap 256x128") for n in new["rerank"]["timed"])
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(reranked))
    tuned.clear_caches()
    heuristics.clear_caches()
    dev = torch.device("cuda")
    x = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(16, 512, 2048, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.arange(256, 4097, 256, device=dev, dtype=torch.int32)
    y = moe_gemm.grouped_mm(x, w, offs)
    chosen = launch_info.last_launch().choice
    record("tuning/rerank-swap", chosen.swap_ab == new["config"]["swap_ab"],
           entry=new["name"], swap_ab=chosen.swap_ab)
    assert chosen.swap_ab == new["config"]["swap_ab"]
    ref = moe_gemm.ops.reference.grouped_mm_ref(x, w, offs)
    low = moe_gemm.grouped_mm(x, w, offs, config=GemmConfig(backend="torch"))
    base = (low.float() - ref).abs().max().item()
    assert (y.float() - ref).abs().max().item() <= 2 * base + 1e-5
