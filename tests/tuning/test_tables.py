"""Writing tables, choosing from their timed shapes, the CLI's CPU paths, the online cache, the
zoo."""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest

from moe_gemm import GemmConfig
from moe_gemm.ops import heuristics, tuned
from moe_gemm.tuning import cli, online, table_io, zoo
from moe_gemm.tuning.tuner import TuneShape

DEV = "NVIDIA Test GPU 80GB"
CEIL = {"copy_bytes_per_s": 3.0e12, "mm_flops_per_s": 7.0e14}
CONFIGS = {
    "small": {"schedule": "pingpong", "tile_m": 64, "tile_n": 256, "visitor": "device",
              "raster_panel": 8},
    "mid": {"schedule": "pingpong", "tile_m": 128, "tile_n": 192, "visitor": "device",
            "raster_panel": 8},
    "big": {"schedule": "cooperative", "tile_m": 128, "tile_n": 256, "visitor": "device",
            "raster_panel": 8, "tail_split": False},
}
@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setattr(tuned, "TABLES_DIR", tmp_path / "shipped")
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(tuned.USER_TABLE_ENV, raising=False)
    monkeypatch.delenv(online.AUTOTUNE_ENV, raising=False)
    monkeypatch.delenv(tuned.TABLES_ENV, raising=False)
    tuned.clear_caches()
    heuristics.clear_caches()
    yield
    tuned.clear_caches()
    heuristics.clear_caches()


# A stand-in device: per config (tile, efficiency, fixed cost per tile, DRAM traffic factor).
TRUE = {"small": (64, 256, 0.45, 0.3, 1.05), "mid": (128, 192, 0.75, 0.8, 1.1),
        "big": (128, 256, 0.85, 3.0, 1.35)}


def truth_us(name, E, N, K, rows):
    """A persistent kernel's roofline: whole waves of tiles at the config's efficiency, or the
    compulsory bytes at its traffic factor, whichever is slower."""
    tm, tn, eff, tile_us, mem = TRUE[name]
    active = min(E, rows)
    tiles = active * math.ceil(rows / max(1, active) / tm) * math.ceil(N / tn)
    waves = math.ceil(tiles / 132)
    compute = waves * (2 * tm * tn * K / (CEIL["mm_flops_per_s"] / 132) / eff * 1e6 + tile_us)
    memory = (rows * K + active * K * N + rows * N) * 2 / CEIL["copy_bytes_per_s"] * 1e6 * mem
    return max(compute, memory) + 4.0


def synthetic_samples(shapes, noise=0.03, seed=0):
    """The stand-in device's times, plus multiplicative noise."""
    rng = random.Random(seed)
    out = []
    for E, N, K, rows in shapes:
        for name, cfg in CONFIGS.items():
            out.append({"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E,
                        "N": N, "K": K, "rows": rows, "config": cfg,
                        "us": truth_us(name, E, N, K, rows) * (1 + rng.uniform(-noise, noise))})
    return out


TRAIN = [(E, N, K, rows) for E in (8, 64, 256) for N, K in ((4096, 7168), (1536, 2048),
                                                            (28672, 4096))
         for rows in (16, 256, 4096, 65536)]


def test_neighbours_pick_well_on_unseen_shapes(tmp_path):
    path = tmp_path / "t.json"
    doc = table_io.new_table(DEV, 132, {"moe_gemm": "test"}, CEIL)
    table_io.add_result(doc, None, synthetic_samples(TRAIN))
    table_io.write(path, doc)
    timed = tuned.parse_table(json.loads(path.read_text()), str(path), DEV).timed
    assert len(timed) == len(TRAIN)
    # Shapes no sample holds (other E, N, K, rows): the pick is within 5% of the truth's best.
    for E, N, K, rows in [(32, 5760, 2880, 512), (128, 3072, 4096, 16), (16, 16384, 5120, 8192),
                          (160, 3072, 5120, 40000)]:
        key = tuned.Key("varlen", "bfloat16", "bfloat16", E, N, K,
                        tuned.rows_bucket(rows / E))
        fields = tuned.neighbours_pick(timed, key, rows)
        truth = {n: truth_us(n, E, N, K, rows) for n in CONFIGS}
        picked = next(n for n, c in CONFIGS.items() if tuned.normalize(c) == fields)
        assert truth[picked] <= 1.05 * min(truth.values()), (E, N, K, rows, picked, truth)


def _result_doc(path: Path):
    doc = table_io.new_table(DEV, 132, {"moe_gemm": "test"}, CEIL)
    entry = {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": 8,
             "N": 28672, "K": 4096, "bucket": 11, "rows": 16384,
             "config": CONFIGS["big"], "us": 1234.5}
    table_io.add_result(doc, entry, synthetic_samples(TRAIN))
    doc["model"] = {"kind": "moe_gemm.cost/1"}  # what earlier tables carried: dropped on write
    table_io.write(path, doc)
    return doc


def test_written_table_reads_back_and_merges(tmp_path):
    path = tmp_path / "t.json"
    doc = _result_doc(path)
    back, why = table_io.load_existing(path, DEV)
    assert why is None and back["entries"] == doc["entries"] and "model" not in back
    parsed = tuned.parse_table(back, str(path), DEV)
    assert len(parsed.entries) == 1 and len(parsed.timed) == len(TRAIN)
    assert parsed.skipped == 0
    # A new result for the same key replaces the entry; its samples replace that shape's.
    newer = {**doc["entries"][0], "config": CONFIGS["mid"], "us": 1000.0}
    shape_samples = [s for s in back["samples"]
                     if (s["E"], s["N"], s["K"], s["rows"]) == (8, 4096, 7168, 16)]
    assert len(shape_samples) == len(CONFIGS)
    table_io.add_result(back, newer, [{**shape_samples[0], "us": 1.0}])
    assert len(back["entries"]) == 1 and back["entries"][0]["config"] == CONFIGS["mid"]
    assert len(back["samples"]) == len(doc["samples"]) - len(shape_samples) + 1
    # Another device's table, or garbage, is not merged into.
    assert table_io.load_existing(path, "NVIDIA H200")[0] is None
    (tmp_path / "bad.json").write_text("{")
    assert "not a table" in table_io.load_existing(tmp_path / "bad.json", DEV)[1]
    assert table_io.load_existing(tmp_path / "none.json", DEV) == (None, None)
    assert not list(tmp_path.glob("*.tmp*"))  # atomic writes leave nothing behind


def test_a_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    # A full disk or a file size limit mid-write (the merge, each tuned shape, the online
    # cache) left the partial temporary file beside the table.
    path = tmp_path / "t.json"
    doc = _result_doc(path)

    def full_disk(self, text):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        table_io.write(path, doc)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # the old table intact
    assert table_io.load_existing(path, DEV)[1] is None


def test_cli_list_and_errors(tmp_path, capsys):
    assert cli.main(["--list", "--zoo", "--models", "DeepSeek-V3", "--tokens", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "E=256 N=4096 K=7168" in out[0] and "bucket=-1" in out[0]
    assert cli.main(["--list", "--shapes", "128,1536,2048,4096,32768"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    for bad in (["--shapes", "1,2,3"], ["--shapes", "a,b,c,d"], ["--zoo", "--models", "Nope"],
                ["--zoo", "--tokens", "0"], []):
        assert cli.main(bad) == 2, bad
    assert cli.main(["--shapes", "8,64,64,64", "--configs", "coop 128x256 z9"]) == 2
    if not __import__("torch").cuda.is_available():
        assert cli.main(["--shapes", "8,64,64,64"]) == 2  # needs a GPU
        assert "CUDA" in capsys.readouterr().err


def test_cli_shape_items():
    shapes = cli.parse_shape_items(["8,64,32,100,200"], "varlen", "EKN", "bfloat16", "float32",
                                   1)
    assert [(s.rows, s.layout, s.out_dtype) for s in shapes] == [(100, "EKN", "float32"),
                                                                 (200, "EKN", "float32")]
    assert sum(shapes[0].counts) == 100 and len(shapes[0].counts) == 8
    b = cli.parse_shape_items(["4,64,32,16"], "batched", "ENK", "bfloat16", "bfloat16", 1)[0]
    assert (b.form, b.rows, b.key().bucket) == ("batched", 64, 4)


# ---------------------------------------------------------------------------------------------
# Online autotune: the switch and the cache (the GPU search is in tests/kernels)


def test_requested(monkeypatch):
    assert not online.requested(GemmConfig())
    monkeypatch.setenv(online.AUTOTUNE_ENV, "1")
    assert online.requested(GemmConfig()) and online.requested(GemmConfig(backend="cute"))
    assert not online.requested(GemmConfig(stages=3))  # a pinned config is the caller's
    monkeypatch.setenv(online.AUTOTUNE_ENV, "0")
    assert not online.requested(GemmConfig())
    # With the tables off no lookup reads what a tune writes: every new shape was tuned (a
    # host sync and up to the budget) for nothing.
    monkeypatch.setenv(online.AUTOTUNE_ENV, "1")
    monkeypatch.setenv(tuned.TABLES_ENV, "0")
    assert not online.requested(GemmConfig())


def test_store_feeds_lookups_and_replaces_other_versions(monkeypatch):
    entry = {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": 8, "N": 512,
             "K": 256, "bucket": 3, "rows": 64, "config": CONFIGS["mid"], "us": 12.0}
    key = tuned.Key("varlen", "bfloat16", "bfloat16", 8, 512, 256, 3)
    assert tuned.lookup(DEV, key, 64, 132) is None
    path = online.store(DEV, 132, entry, [])
    hit = tuned.lookup(DEV, key, 64, 132)
    assert hit.how == "exact" and hit.source == str(path)
    c = heuristics.choose_varlen(GemmConfig(), 64, 8, 512, 256, 132, device=DEV)
    assert (c.schedule, c.tile_m, c.tile_n) == ("pingpong", 128, 192)
    # A later library version ignores the file and starts a new one on the next store.
    from moe_gemm.ops import versions

    real = versions.runtime_versions(DEV)
    monkeypatch.setattr(versions, "runtime_versions",
                        lambda device: {**real, "moe_gemm": "9.9"})
    monkeypatch.setattr(online, "runtime_versions", versions.runtime_versions)
    tuned._online.cache_clear()
    with pytest.warns(RuntimeWarning, match="other versions"):
        assert tuned.lookup(DEV, key, 64, 132) is None
    other = {**entry, "N": 1024}
    online.store(DEV, 132, other, [])
    doc = json.loads(path.read_text())
    assert doc["versions"]["moe_gemm"] == "9.9" and [e["N"] for e in doc["entries"]] == [1024]


def test_store_leaves_out_what_the_online_cache_cannot_parse():
    # A cache file of this build's versions with an entry or sample that does not parse (a
    # hand edit, a foreign tool): the reader skips them, and so must the store that adds to the
    # file, which keyed every old entry and failed the tuned call with a TableError.
    from moe_gemm.ops import versions

    path = tuned.online_path(DEV)
    path.parent.mkdir(parents=True)
    good = _online_entry()
    sample = {k: good[k] for k in ("form", "dtype", "out_dtype", "E", "N", "K", "rows",
                                   "config", "us")}
    path.write_text(json.dumps({
        "format": tuned.FORMAT, "device": DEV, "versions": versions.runtime_versions(DEV),
        "entries": [good, {"form": "varlen"}, "x"], "samples": [sample, {"rows": 1}]}))
    new = {**good, "N": 1024}
    online.store(DEV, 132, new, [{**sample, "N": 1024}])
    doc = json.loads(path.read_text())
    assert [e["N"] for e in doc["entries"]] == [512, 1024]
    assert sorted(s["N"] for s in doc["samples"]) == [512, 1024]
    key = tuned.Key("varlen", "bfloat16", "bfloat16", 8, 1024, 256, 3)
    assert tuned.lookup(DEV, key, 64, 132).how == "exact"


def _online_entry():
    return {"form": "varlen", "dtype": "bfloat16", "out_dtype": "bfloat16", "E": 8, "N": 512,
            "K": 256, "bucket": 3, "rows": 64, "config": CONFIGS["mid"], "us": 12.0}


def test_disk_cache_off_keeps_online_results_in_memory(monkeypatch, tmp_path):
    # MOE_GEMM_DISK_CACHE=0: "online-tuned configs in memory only". They were written to disk
    # anyway, and never read back (the reader skips the disk cache then): a wasted tune.
    monkeypatch.setenv("MOE_GEMM_DISK_CACHE", "0")
    key = tuned.Key("varlen", "bfloat16", "bfloat16", 8, 512, 256, 3)
    assert online.store(DEV, 132, _online_entry(), []) is None
    assert not tuned.online_path(DEV).exists()
    hit = tuned.lookup(DEV, key, 64, 132)
    assert hit.how == "exact" and hit.source == tuned.MEMORY_SOURCE
    c = heuristics.choose_varlen(GemmConfig(), 64, 8, 512, 256, 132, device=DEV)
    assert (c.schedule, c.tile_m, c.tile_n) == ("pingpong", 128, 192)


def test_an_online_cache_that_cannot_be_written_does_not_fail_the_call(monkeypatch, tmp_path):
    # A cache folder that cannot be created (here under a file): the tune's result stays in
    # memory with one warning; the OSError used to escape grouped_mm (and the server's
    # --tune-at-start weight upload) after the tune. (The GPU search is stubbed: host logic.)
    import warnings

    import torch

    from moe_gemm import capability

    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(tuned, "_warned", set())
    monkeypatch.setattr(online, "_attempted", set())
    monkeypatch.setattr(capability, "device_name", lambda device=None: DEV)
    monkeypatch.setattr(capability, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(online, "_tune", lambda shape, device, name: (_online_entry(), []))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        online.tune_once(torch.device("cuda", 0), 8, 512, 256, 64, [8] * 8)
    assert sum("cannot write the online autotune cache" in str(w.message) for w in seen) == 1
    key = tuned.Key("varlen", "bfloat16", "bfloat16", 8, 512, 256, 3)
    assert tuned.lookup(DEV, key, 64, 132).source == tuned.MEMORY_SOURCE


@pytest.mark.parametrize("device", ["torch cpu", "cpu", "cuda"])
def test_tune_once_refuses_a_device_that_is_not_a_cuda_torch_device(device):
    # A CPU device reached torch.cuda's capture query: a CPU-only torch raised an obscure
    # RuntimeError ("dummy base class"); a string failed on its missing .index.
    import torch

    dev = torch.device("cpu") if device == "torch cpu" else device
    with pytest.raises(ValueError, match="tune_once tunes the kernels on a CUDA device"):
        online.tune_once(dev, 8, 512, 256, 64, [8] * 8)


def test_varlen_shape_from_offs(monkeypatch):
    import torch

    from moe_gemm.ops.validation import check_grouped_mm

    seen = {}
    monkeypatch.setattr(online, "_ensure", lambda device, key, rows, make: seen.update(
        key=key, rows=rows, shape=make()))
    x = torch.randn(10, 32, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 32, dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)
    args = check_grouped_mm(x, w, offs, None, None)
    online.ensure_tuned_varlen(args, GemmConfig())
    s = seen["shape"]
    assert (s.E, s.N, s.K, s.rows, s.layout) == (3, 16, 32, 10, "ENK")
    assert s.counts == (4, 0, 6)  # rows past offs[-1] are timed with the last expert
    assert seen["key"].bucket == tuned.rows_bucket(10 / 3)


# ---------------------------------------------------------------------------------------------
# The zoo's data


def test_a_huge_top1_routing_is_one_multinomial_draw():
    # Drawn token by token, 2^31 - 1 top-1 rows took about an hour (`moe-gemm tune --shapes
    # E,N,K,2147483647 --list` printed nothing for that long).
    import time

    t0 = time.monotonic()
    rows = 2**31 - 1
    counts = zoo.topk_counts(8, rows, 1, seed=1234)
    assert time.monotonic() - t0 < 5.0
    assert sum(counts) == rows and min(counts) > 0
    assert counts == zoo.topk_counts(8, rows, 1, seed=1234)
    assert counts != zoo.topk_counts(8, rows, 1, seed=1235)
    assert len(zoo.topk_counts(8, rows, 1, seed=-7)) == 8  # any int seeds it
    weights = zoo.popularity(8, zoo.ROUTING_SIGMA, 1234)
    for c, w in zip(counts, weights):  # the same popularity as token by token
        assert c / rows == pytest.approx(w / sum(weights), abs=1e-4)
    # Up to the threshold, token by token as before: these counts are what it always drew.
    assert zoo.topk_counts(8, 1000, 1, seed=5) == [74, 74, 201, 54, 142, 46, 270, 139]
    assert zoo.topk_counts(16, zoo.DRAW_AT_ONCE_TOKENS, 1, seed=2)[:4] == [
        218297, 48360, 83280, 73075]


def test_zoo_models_and_routing():
    assert len(zoo.MODELS) >= 10 and len({m.name for m in zoo.MODELS}) == len(zoo.MODELS)
    ds = zoo.BY_NAME["DeepSeek-V3"]
    up, down = ds.projections()
    assert (up.E, up.N, up.K, down.N, down.K) == (256, 4096, 7168, 7168, 2048)
    assert zoo.BY_NAME["gpt-oss-120b"].layout == "EKN"
    for m in zoo.MODELS:
        for p in m.projections():
            assert p.N * 2 % 16 == 0 and p.K * 2 % 16 == 0  # bf16 rows on 16-byte multiples
    counts = zoo.topk_counts(256, 2048, 8, seed=3)
    assert sum(counts) == 2048 * 8 and max(counts) <= 2048
    assert counts == zoo.topk_counts(256, 2048, 8, seed=3)
    assert counts != zoo.topk_counts(256, 2048, 8, seed=4)
    mean = 2048 * 8 / 256
    assert 1.5 * mean < max(counts) < 8 * mean  # skewed, not degenerate
    decode = zoo.topk_counts(256, 1, 8, seed=0)
    assert sorted(decode, reverse=True)[:8] == [1] * 8 and sum(decode) == 8
    flat = zoo.topk_counts(8, 4000, 2, seed=0, sigma=0.0)
    assert max(flat) < 1.1 * 1000 and min(flat) > 0.9 * 1000
    for bad in ((0, 1, 1), (4, -1, 1), (4, 1, 5)):
        with pytest.raises(ValueError):
            zoo.topk_counts(*bad, seed=0)
    with pytest.raises(ValueError, match="unknown model"):
        zoo.select_models("DeepSeek-V3,Nope")
    assert [m.name for m in zoo.select_models("deepseek-v3, Kimi-K2")] == ["DeepSeek-V3",
                                                                          "Kimi-K2"]
    assert zoo.parse_tokens("all", (1,)) == list(zoo.TOKENS)
    assert zoo.parse_tokens(None, (5,)) == [5]
    with pytest.raises(ValueError):
        zoo.parse_tokens("1,x", (1,))


def test_held_out_models_are_outside_the_zoo_and_the_shipped_tables():
    held = zoo.select_models("held-out")
    assert held == list(zoo.HELD_OUT) and len(held) >= 10
    assert not {m.name for m in held} & {m.name for m in zoo.MODELS}
    assert [m.name for m in zoo.select_models("all")] == sorted(
        (m.name for m in zoo.MODELS), key=lambda n: n not in zoo.DEFAULT_MODELS)
    assert zoo.select_models("dbrx, Qwen3-Next-80B-A3B") == [zoo.BY_NAME["DBRX"],
                                                            zoo.BY_NAME["Qwen3-Next-80B-A3B"]]

    def shapes(models):
        return {(p.E, p.N, p.K) for m in models for p in m.projections()}

    assert not shapes(held) & shapes(zoo.MODELS)
    for m in held:
        for p in m.projections():
            assert p.N * 2 % 16 == 0 and p.K * 2 % 16 == 0 and 1 <= p.top_k <= p.E
    for path in sorted(Path(tuned.__file__).parent.parent.joinpath("tables").glob("*.json")):
        doc = json.loads(path.read_text())
        for timed in ("entries", "samples"):  # no exact entry, nor a vote from its own shape
            assert not {(e["E"], e["N"], e["K"]) for e in doc[timed]} & shapes(held), path.name
    with pytest.raises(ValueError, match="held-out"):
        zoo.select_models("Nope")


def _inclusion(weights: list[float], top_k: int) -> list[float]:
    """Exact chance that each expert is among a token's top_k when the token picks one by one,
    each pick in proportion to the weights of the experts it has not picked yet."""
    chance = [0.0] * len(weights)
    for order in itertools.permutations(range(len(weights)), top_k):
        p, left = 1.0, sum(weights)
        for e in order:
            p, left = p * weights[e] / left, left - weights[e]
        for e in order:
            chance[e] += p
    return chance


def test_topk_routing_is_weighted_sampling_without_replacement():
    # Drawn in arrays now, token by token before: the same law. Each expert's share of the
    # tokens is its exact chance of being picked (200k tokens: ~0.001 standard error).
    tokens = 200_000
    counts = zoo.topk_counts(6, tokens, 3, seed=11, sigma=1.0)
    for c, p in zip(counts, _inclusion(zoo.popularity(6, 1.0, 11), 3)):
        assert c / tokens == pytest.approx(p, abs=0.005)
    # The hot experts take more rows: at the zoo's spread, the most popular tenth of
    # Kimi-K2's 384 experts gets several times the rows of the least popular tenth.
    counts = zoo.topk_counts(384, 32768, 8, seed=1234)
    by_popularity = [c for _, c in sorted(zip(zoo.popularity(384, zoo.ROUTING_SIGMA, 1234),
                                              counts))]
    assert sum(by_popularity[-38:]) > 3 * sum(by_popularity[:38])


def test_topk_routing_picks_distinct_experts_per_token():
    # Skewed (sigma 1.5: half the picks are the busiest of 8 experts) and top-7 of 8, so that
    # nearly every token draws repeats; none is left in any token's picks.
    weights = zoo.popularity(8, 1.5, 5)
    cdf = np.cumsum(np.array(weights) / sum(weights))
    picks = zoo._distinct_picks(np.random.RandomState(5), zoo._CategoricalTable(cdf), 5000, 7)
    assert picks.shape == (5000, 7) and picks.min() >= 0 and picks.max() < 8
    assert all(len(set(row)) == 7 for row in picks.tolist())
    # In the counts: top-E is every expert on every token, and no expert gets a token twice.
    assert zoo.topk_counts(8, 1000, 8, seed=5, sigma=1.5) == [1000] * 8
    skewed = zoo.topk_counts(8, 1000, 7, seed=5, sigma=1.5)
    assert sum(skewed) == 1000 * 7 and max(skewed) == 1000


def test_topk_routing_is_seeded_and_fixed():
    # The same counts on every machine for a seed (numpy's legacy MT19937 stream is frozen),
    # other counts for another seed; any int seeds it. The values pin the stream: a change of
    # TOPK_BLOCK_TOKENS or of the draw would change every routing, and fail here.
    assert zoo.topk_counts(16, 100, 4, seed=7) == [16, 29, 22, 27, 10, 20, 31, 34, 33, 29, 24,
                                                   24, 2, 36, 36, 27]
    two_blocks = zoo.topk_counts(8, zoo.TOPK_BLOCK_TOKENS + 5, 3, seed=-3)
    assert two_blocks[:4] == [20955, 33010, 13208, 30318]
    assert two_blocks == zoo.topk_counts(8, zoo.TOPK_BLOCK_TOKENS + 5, 3, seed=-3)
    assert two_blocks != zoo.topk_counts(8, zoo.TOPK_BLOCK_TOKENS + 5, 3, seed=-4)
    assert zoo.topk_counts(8, 0, 3, seed=1) == [0] * 8


def test_a_large_topk_routing_is_drawn_in_arrays():
    # Token by token, 2^22 top-8 tokens over Kimi-K2's 384 experts took 14 s (and --tokens
    # at the int32 row limit, 2^28 tokens, ~15 minutes); in arrays ~1 s.
    t0 = time.monotonic()
    counts = zoo.topk_counts(384, 1 << 22, 8, seed=1234)
    assert time.monotonic() - t0 < 5.0
    assert sum(counts) == 8 << 22 and max(counts) <= 1 << 22


def test_tune_shape_keys_match_lookup_keys():
    """What the tuner writes for a zoo shape is what grouped_mm looks up for that call."""
    shapes = cli.zoo_shapes("Qwen3-30B-A3B", "512", "bfloat16", "bfloat16", 1)
    for s in shapes:
        assert isinstance(s, TuneShape)
        k = s.key()
        assert k == tuned.Key("varlen", "bfloat16", "bfloat16", s.E, s.N, s.K,
                              tuned.rows_bucket(s.rows / s.E))


def test_tables_and_records_are_written_one_item_per_line():
    # Round trip, whatever the values; every list item on a line of its own, so a retune's
    # diff is one line per changed sample.
    from moe_gemm.tuning.table_io import dumps_by_line

    doc = {"format": "x", "empty": [], "nested": {"a": [1, {"b": None}], "é": "ü"},
           "entries": [{"E": 8, "config": {"tile_m": 128}}, {"E": 16, "us": 1.5e-3}],
           "samples": [[1, 2], "three", 4.0, None, True], "n": 7}
    text = dumps_by_line(doc)
    assert json.loads(text) == doc
    lines = text.splitlines()
    assert '{"E":8,"config":{"tile_m":128}},' in lines and '{"E":16,"us":0.0015}' in lines
    assert "[1,2]," in lines and '"three",' in lines and '"empty":[],' in lines
    assert json.loads(dumps_by_line({})) == {}
    # The shipped tables are written so (and read back as they were).
    for path in sorted(tuned.TABLES_DIR.glob("*.json")):
        raw = path.read_text()
        assert raw == dumps_by_line(json.loads(raw)), path.name
