"""Tuned tables (moe_gemm.ops.tuned) and how the heuristics use them, on the CPU: every lookup
path, bucket logic, bad tables, version checks and the nearest timed shapes' vote."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from moe_gemm import GemmConfig
from moe_gemm.ops import heuristics, tuned, versions
from moe_gemm.ops.heuristics import choose_batched, choose_general, choose_varlen

DEV = "NVIDIA Test GPU 80GB"
COOP_128x192 = {"schedule": "cooperative", "tile_m": 128, "tile_n": 192, "cluster_m": 1,
                "cluster_n": 1, "raster_panel": 4, "tail_split": False,
                "whole_epilogue": False, "visitor": "device"}
PP_64x256 = {"schedule": "pingpong", "tile_m": 64, "tile_n": 256, "raster_panel": 8,
             "visitor": "device"}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Shipped tables from an empty folder, the online cache in tmp, caches cleared."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(tuned, "TABLES_DIR", shipped)
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(tuned.USER_TABLE_ENV, raising=False)
    monkeypatch.delenv(tuned.TABLES_ENV, raising=False)
    monkeypatch.delenv("MOE_GEMM_TAIL_SPLIT", raising=False)
    monkeypatch.setattr(tuned, "_warned", set())
    tuned.clear_caches()
    heuristics.clear_caches()
    yield shipped
    tuned.clear_caches()
    heuristics.clear_caches()


def entry(form="varlen", E=64, N=4096, K=7168, bucket=8, config=None, us=100.0, **extra):
    return {"form": form, "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E, "N": N,
            "K": K, "bucket": bucket, "config": config or dict(COOP_128x192), "us": us,
            **extra}


def table(entries, device=DEV, **extra):
    return {"format": tuned.FORMAT, "device": device, "sm_count": 132, "entries": entries,
            **extra}


def write(path: Path, doc) -> Path:
    if isinstance(doc, bytes):
        path.write_bytes(doc)
    else:
        path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


def ship(shipped: Path, doc, device=DEV) -> Path:
    tuned.clear_caches()
    return write(shipped / f"{tuned.device_slug(device)}.json", doc)


def key(E=64, N=4096, K=7168, bucket=8, form="varlen"):
    return tuned.Key(form, "bfloat16", "bfloat16", E, N, K, bucket)


# ---------------------------------------------------------------------------------------------
# Keys and buckets


def test_slug_and_buckets():
    assert tuned.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert tuned.device_slug("NVIDIA H200") == "nvidia-h200"
    assert tuned.device_slug("???") == "unknown-device"
    assert tuned.rows_bucket(256) == 8
    assert tuned.rows_bucket(256 * 1.41) == 8 and tuned.rows_bucket(256 * 1.42) == 9
    assert tuned.rows_bucket(1) == 0 and tuned.rows_bucket(0.5) == -1
    assert tuned.rows_bucket(8 / 256) == -5  # one decode token x top-8 over 256 experts
    assert tuned.rows_bucket(0) == -32


# ---------------------------------------------------------------------------------------------
# Lookup paths


def test_exact_and_none(_isolated):
    ship(_isolated, table([entry(bucket=8), entry(bucket=4, config=dict(PP_64x256))]))
    hit = tuned.lookup(DEV, key(bucket=8), 64 * 256, 132)
    assert hit.how == "exact" and dict(hit.fields)["tile_n"] == 192 and hit.us == 100.0
    assert dict(tuned.lookup(DEV, key(bucket=4), 64 * 16, 132).fields)["tile_n"] == 256
    # Another bucket of the same projection, with no timed shapes to vote: the rules decide.
    assert tuned.lookup(DEV, key(bucket=9), 64 * 512, 132) is None
    assert tuned.lookup(DEV, key(N=2048), 64 * 256, 132) is None  # another family
    assert tuned.lookup("NVIDIA Other GPU", key(), 64 * 256, 132) is None


@pytest.mark.parametrize("device,sibling", [
    ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3"), ("NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA H800", "NVIDIA H100 80GB HBM3"), ("NVIDIA H200 NVL", "NVIDIA H200"),
    ("NVIDIA GH200 480GB", "NVIDIA H200"), ("NVIDIA A100-SXM4-80GB", None),
    ("NVIDIA H20", None)])
def test_a_hopper_part_without_its_own_table_uses_its_siblings(_isolated, device, sibling):
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    ship(_isolated, table([entry(config=dict(COOP_128x192))], device=h100), device=h100)
    ship(_isolated, table([entry(config=dict(PP_64x256))], device=h200), device=h200)
    assert tuned.shipped_device(device) == sibling
    hit = tuned.lookup(device, key(), 64 * 256, 114)
    if sibling is None:
        assert hit is None
        return
    assert hit.how == "exact" and hit.source.endswith(f"{tuned.device_slug(sibling)}.json")
    assert dict(hit.fields)["tile_n"] == (192 if sibling == h100 else 256)
    # A table of the device's own name wins over the sibling's.
    ship(_isolated, table([entry(config=dict(PP_64x256, tile_n=128))], device=device),
         device=device)
    assert dict(tuned.lookup(device, key(), 64 * 256, 114).fields)["tile_n"] == 128


def test_a_copy_of_the_siblings_table_serves_as_ones_own(_isolated, tmp_path, monkeypatch):
    # USAGE: start a table of your own from a copy of the shipped one; on an H200 NVL that is
    # the H200's, which the user-table reader refused as "made for 'NVIDIA H200'".
    mine = write(tmp_path / "mine.json", table([entry(config=dict(PP_64x256))],
                                               device="NVIDIA H200"))
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(mine))
    hit = tuned.lookup("NVIDIA H200 NVL", key(), 64 * 256, 132)
    assert hit.how == "exact" and hit.source == str(mine)
    # Not another family's: an H100 table on an H200 NVL is still foreign.
    other = write(tmp_path / "h100.json", table([entry(config=dict(PP_64x256))],
                                                device="NVIDIA H100 80GB HBM3"))
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(other))
    tuned.clear_caches()
    with pytest.warns(RuntimeWarning, match="made for 'NVIDIA H100 80GB HBM3'"):
        assert tuned.lookup("NVIDIA H200 NVL", key(), 64 * 256, 132) is None


@pytest.mark.parametrize("device", ["NVIDIA H100 80GB HBM3", "NVIDIA H200", DEV])
def test_a_user_table_without_a_device_is_ignored_with_a_warning(_isolated, tmp_path,
                                                                 monkeypatch, device):
    # On a device with no sibling (an H100 SXM, an H200) the sibling check compared the
    # missing "device" with None and raised a KeyError in every lookup.
    doc = table([entry()])
    del doc["device"]
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(write(tmp_path / "mine.json", doc)))
    with pytest.warns(RuntimeWarning, match="made for None"):
        assert tuned.lookup(device, key(), 64 * 256, 132) is None


def test_user_table_wins_over_shipped(_isolated, tmp_path, monkeypatch):
    ship(_isolated, table([entry()]))
    user = write(tmp_path / "mine.json", table([entry(config=dict(PP_64x256))]))
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(user))
    hit = tuned.lookup(DEV, key(), 64 * 256, 132)
    assert hit.source == str(user) and dict(hit.fields)["schedule"] == "pingpong"
    monkeypatch.setenv(tuned.TABLES_ENV, "0")  # everything off: rules only
    assert tuned.lookup(DEV, key(), 64 * 256, 132) is None


def test_missing_user_table_warns_once(_isolated, tmp_path, monkeypatch):
    ship(_isolated, table([entry()]))
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(tmp_path / "nope.json"))
    with pytest.warns(RuntimeWarning, match="does not exist"):
        assert tuned.lookup(DEV, key(), 64 * 256, 132).how == "exact"  # shipped still used
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuned.lookup(DEV, key(), 64 * 256, 132)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_user_table_that_is_not_a_regular_file_is_ignored_with_one_warning(_isolated, tmp_path,
                                                                            monkeypatch, kind):
    # A FIFO (or /dev/stdin, /dev/zero) blocked the first call that looked a shape up until a
    # writer came, or read without end: only a regular file is read.
    ship(_isolated, table([entry()]))
    path = tmp_path / "t.json"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(path))
    with pytest.warns(RuntimeWarning, match="is not a regular file; ignored"):
        assert tuned.lookup(DEV, key(), 64 * 256, 132).how == "exact"  # shipped still used
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned.lookup(DEV, key(), 64 * 256, 132).how == "exact"


def test_a_table_too_large_to_be_one_is_not_read(_isolated, tmp_path, monkeypatch):
    # A user table path set by mistake to a checkpoint or a log was read whole into memory
    # (tens of GB: an out-of-memory kill) before being warned about as "not valid JSON".
    ship(_isolated, table([entry()]))
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.truncate(tuned.MAX_TABLE_BYTES + 1)  # sparse: no disk space taken
    read, read_bytes = [], Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or read_bytes(self))
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(path))
    with pytest.warns(RuntimeWarning, match="more than a table's"):
        assert tuned.lookup(DEV, key(), 64 * 256, 132).how == "exact"  # shipped still used
    assert path not in read
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuned.lookup(DEV, key(), 64 * 256, 132).how == "exact"


@pytest.mark.parametrize("doc,why", [
    ("{not json", "not valid JSON"),
    ([1, 2], "ignored"),
    (table([entry()], device="NVIDIA H200"), "made for 'NVIDIA H200'"),
    ({**table([entry()]), "format": "something/9"}, "not a moe_gemm.tuned-table/1"),
    ({**table([entry()]), "entries": {"a": 1}}, "entries is not a list"),
    (b"\xff\xfe\x00\x81 not text", "not valid JSON"),  # (a UnicodeDecodeError escaped)
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),  # (RecursionError)
    ({**table([entry()]), "versions": 5}, "versions is not an object"),  # (a TypeError)
    ({**table([entry()]), "versions": [1, 2]}, "versions is not an object"),
])
def test_corrupt_or_foreign_table_is_ignored_with_one_warning(_isolated, doc, why):
    ship(_isolated, doc)
    with pytest.warns(RuntimeWarning, match=why):
        assert tuned.lookup(DEV, key(), 64 * 256, 132) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second lookup stays silent
        assert tuned.lookup(DEV, key(), 64 * 256, 132) is None
    # ... and the heuristics fall back to the rules, same choice as with no table at all.
    assert choose_varlen(GemmConfig(), 16384, 64, 4096, 7168, 132, device=DEV) == \
        choose_varlen(GemmConfig(), 16384, 64, 4096, 7168, 132)


def test_entries_and_samples_with_stages_that_do_not_fit_are_skipped(_isolated):
    # GemmConfig takes stages up to 12; the kernel refuses a depth that does not fit in shared
    # memory (ValueError at its construction), so such an entry would fail every call it
    # answers: it is skipped with the table's one warning, and its sample never votes.
    deep = {**COOP_128x192, "stages": 12}
    fits = {**COOP_128x192, "stages": 4}
    ship(_isolated, table([entry(bucket=1, config=deep), entry(bucket=2, config=fits)],
                          samples=[{**entry(config=deep), "rows": 64}]))
    with pytest.warns(RuntimeWarning, match="1 entries"):
        assert tuned.lookup(DEV, key(bucket=2), 1, 132).how == "exact"
    assert tuned.lookup(DEV, key(bucket=1), 1, 132) is None
    assert tuned.tables_for(DEV)[0].timed == []
    c = choose_varlen(GemmConfig(), 128, 64, 4096, 7168, 132, device=DEV)
    assert c == choose_varlen(GemmConfig(), 128, 64, 4096, 7168, 132)


def test_entries_this_build_cannot_use_are_skipped(_isolated):
    bad_tile = {**COOP_128x192, "tile_n": 200}
    unknown = {**COOP_128x192, "warp_count": 3}
    no_tile = {"schedule": "cooperative"}
    ship(_isolated, table([entry(bucket=1, config=bad_tile), entry(bucket=2, config=unknown),
                           entry(bucket=3, config=no_tile), {"form": "varlen"},
                           entry(bucket=8)]))
    with pytest.warns(RuntimeWarning, match="4 entries"):
        assert tuned.lookup(DEV, key(bucket=8), 1, 132).how == "exact"
    for b in (1, 2, 3):  # the skipped entries count for nothing
        assert tuned.lookup(DEV, key(bucket=b), 1, 132) is None


def test_entries_and_samples_with_fractional_or_boolean_sizes_are_skipped(_isolated):
    # int() read E=8.5 as 8 and bucket=true as 1: an entry keyed to a shape it was not timed
    # on. Whole numbers in any JSON spelling (8, 8.0, "8") are the same key.
    ship(_isolated, table([entry(E=8.5, bucket=1), entry(bucket=True, E=8),
                           entry(E=8, bucket=2.0), entry(E="8", bucket=3)],
                          samples=[{**entry(E=8.5), "rows": 64}, {**entry(E=True), "rows": 64},
                                   {**entry(E=8.0, N=1024), "rows": 64}]))
    with pytest.warns(RuntimeWarning, match="2 entries"):
        assert tuned.lookup(DEV, key(E=8, bucket=1), 1, 132) is None
    assert tuned.lookup(DEV, key(E=8, bucket=2), 1, 132).how == "exact"
    assert tuned.lookup(DEV, key(E=8, bucket=3), 1, 132).how == "exact"
    assert [t.shape[3:5] for t in tuned.tables_for(DEV)[0].timed] == [(8, 1024)]


def test_entries_not_built_for_their_form_are_skipped(_isolated):
    # The host visitor on grouped_mm's forms reads offs on the host every call (a sync that
    # breaks CUDA graph capture), K-sorting is grouped_gemm's: an exact entry naming one is
    # skipped like a neighbour's vote for it, not run. The tail split is built for every form
    # but the masked one (which has no table entries), grouped_gemm's lists included.
    host = {**COOP_128x192, "visitor": "host"}
    ksort = {**COOP_128x192, "sort_by_k": True}
    split = {**COOP_128x192, "tail_split": True}
    ship(_isolated, table([entry(bucket=1, config=host), entry(bucket=2, config=ksort),
                           entry(form="batched", bucket=3, config=host),
                           entry(form="general", bucket=4, config=split),
                           entry(form="general", bucket=5, config={**host, "tail_split": None})]))
    with pytest.warns(RuntimeWarning, match="3 entries"):
        assert tuned.lookup(DEV, key(bucket=1), 1, 132) is None
    assert tuned.lookup(DEV, key(bucket=2), 1, 132) is None
    assert tuned.lookup(DEV, key(form="batched", bucket=3), 1, 132) is None
    assert tuned.lookup(DEV, key(form="general", bucket=4), 1, 132).how == "exact"
    assert tuned.lookup(DEV, key(form="general", bucket=5), 1, 132).how == "exact"
    c = choose_varlen(GemmConfig(), 64 * 2, 64, 4096, 7168, 132, device=DEV)
    assert c.visitor == "device"


def test_entries_with_a_whole_epilogue_on_a_256_row_tile_are_skipped(_isolated):
    # The kernel stages a whole tile of 128 rows only and refuses any other at its compile:
    # an entry or a sample naming one would fail every call it answered on the GPU.
    whole_256 = {"schedule": "cooperative", "tile_m": 256, "tile_n": 192,
                 "whole_epilogue": True}
    ship(_isolated, table([entry(bucket=1, config=whole_256),
                           entry(bucket=2, config={**whole_256, "tile_m": 128})],
                          samples=[{**entry(config=whole_256), "rows": 64}]))
    with pytest.warns(RuntimeWarning, match="1 entries"):
        assert tuned.lookup(DEV, key(bucket=1), 1, 132) is None
    assert tuned.lookup(DEV, key(bucket=2), 1, 132).how == "exact"
    assert tuned.tables_for(DEV)[0].timed == []
    c = choose_varlen(GemmConfig(), 64 * 2, 64, 4096, 7168, 132, device=DEV)
    assert not (c.epi_whole and c.tile_m != 128)


def test_numbers_past_a_float_leave_out_one_entry_time_or_sample_not_the_table(_isolated):
    # JSON integers have no bound: float() of one past a float's range raised OverflowError,
    # and the reader refused the whole table over one entry's time or one sample's rows
    # (while `moe-gemm tune --merge` kept them, writing a table the reader then refused).
    huge = 10 ** 400
    ship(_isolated, table([entry(bucket=8, us=huge), entry(bucket=9, us=float("nan"))],
                          samples=[{**entry(N=1024), "rows": huge},
                                   {**entry(N=2048), "rows": 64}]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: no entry is skipped
        hit = tuned.lookup(DEV, key(bucket=8), 64 * 256, 132)
    assert hit.how == "exact" and hit.us is None
    assert tuned.lookup(DEV, key(bucket=9), 64 * 512, 132).us is None
    assert [t.shape[4] for t in tuned.tables_for(DEV)[0].timed] == [2048]


def test_a_sample_with_an_infinite_time_is_left_out_not_a_voter(_isolated):
    # A shape timed only at inf had regrets inf / inf = nan; a NaN score compares False with
    # every other, so that shape's one config won the vote it made possible.
    fast = [s for N in (2048, 4096, 8192)
            for s in samples(128, N, 4096, 128 * 512, [(SMALL, 900.0), (BIG, 600.0)])]
    ship(_isolated, table([], samples=fast + samples(128, 4096, 8192, 128 * 512,
                                                     [(SMALL, float("inf"))])))
    assert len(tuned.tables_for(DEV)[0].timed) == 3
    # Three voters, fewer than MIN_VOTERS: the rules decide (the inf shape made a fourth,
    # and SMALL, the only config timed on all four, won with a NaN score).
    assert tuned.lookup(DEV, key(E=128, N=4096, K=4096, bucket=9), 128 * 512, 132) is None


def test_a_sample_whose_time_is_not_a_number_is_left_out(_isolated):
    # float(True) is 1.0: a sample of "us": true was a 1 us time and won the vote; a string
    # was read as its number. Entries already refused both.
    fast = [s for N in (2048, 4096, 8192)
            for s in samples(128, N, 4096, 128 * 512, [(SMALL, 900.0), (BIG, 600.0)])]
    for bad in (True, "1", None, [1]):
        ship(_isolated, table([], samples=fast + samples(128, 4096, 8192, 128 * 512,
                                                         [(SMALL, bad), (BIG, 600.0)])))
        timed = tuned.tables_for(DEV)[0].timed
        assert len(timed) == 4 and all(len(t.log_regret) == 2 for t in timed[:3])
        assert len(timed[3].log_regret) == 1, bad  # the bad time is no sample


# ---------------------------------------------------------------------------------------------
# The heuristics


def test_varlen_choice_follows_the_table(_isolated):
    ship(_isolated, table([entry(bucket=8)]))
    c = choose_varlen(GemmConfig(), 64 * 256, 64, 4096, 7168, 132, device=DEV)
    assert (c.schedule, c.tile_m, c.tile_n, c.swizzle, c.tail_split, c.epi_whole) == (
        "cooperative", 128, 192, 4, False, False)
    # Without a device (or another device): the rules, cooperative 128x256 here.
    rules = choose_varlen(GemmConfig(), 64 * 256, 64, 4096, 7168, 132)
    assert (rules.tile_n, rules.tail_split) == (256, True)
    assert choose_varlen(GemmConfig(), 64 * 256, 64, 4096, 7168, 132, device="X") == rules
    # A config pinning any tuned field runs by the rules, honouring the pin.
    pinned = choose_varlen(GemmConfig(stages=4), 64 * 256, 64, 4096, 7168, 132, device=DEV)
    assert (pinned.tile_n, pinned.stages) == (256, 4)
    # backend is not a tuned field: the table still applies.
    assert choose_varlen(GemmConfig(backend="cute"), 64 * 256, 64, 4096, 7168, 132,
                         device=DEV).tile_n == 192
    assert heuristics.tuned_hit("varlen", GemmConfig(), 132, device=DEV,
                                shape=(64 * 256, 64, 4096, 7168)).how == "exact"
    assert heuristics.tuned_hit("varlen", GemmConfig(), 132, device=None,
                                shape=(64 * 256, 64, 4096, 7168)) is None


def test_dtype_is_part_of_the_key(_isolated):
    ship(_isolated, table([entry(bucket=8)]))
    fp16 = choose_varlen(GemmConfig(), 64 * 256, 64, 4096, 7168, 132, device=DEV,
                         dtype="float16")
    assert fp16.tile_n == 256  # no fp16 entry: the rules


def test_table_config_refused_for_this_call_falls_back_with_a_warning(_isolated):
    # whole_epilogue needs 16-bit output; the key says bf16 out but the call asks fp32 out
    # through out_itemsize, as a stale or hand-edited table could.
    cfg = {**COOP_128x192, "whole_epilogue": True}
    ship(_isolated, table([entry(bucket=8, config=cfg)]))
    with pytest.warns(RuntimeWarning, match="cannot run here"):
        c = choose_varlen(GemmConfig(), 64 * 256, 64, 4096, 7168, 132, 4, device=DEV)
    assert c == choose_varlen(GemmConfig(), 64 * 256, 64, 4096, 7168, 132, 4)


def test_batched_and_general_lookups(_isolated):
    ship(_isolated, table([
        entry(form="batched", E=256, N=512, K=7168, bucket=7, config=dict(PP_64x256)),
        entry(form="general", E=8, N=512, K=1024, bucket=6,
              config={**COOP_128x192, "sort_by_k": True, "tail_split": None}),
    ]))
    b = choose_batched(GemmConfig(), 256, 128, 512, 7168, 132, device=DEV)
    assert (b.schedule, b.tile_m, b.tile_n) == ("pingpong", 64, 256)
    g = choose_general(GemmConfig(), ((64, 512, 1024),) * 8, 132, device=DEV)
    assert (g.schedule, g.tile_n, g.sort_by_k, g.swizzle) == ("cooperative", 192, True, 4)
    # Problems of different N: no table key, the rules.
    mixed = ((64, 512, 1024),) * 7 + ((64, 256, 1024),)
    assert choose_general(GemmConfig(), mixed, 132, device=DEV) == choose_general(
        GemmConfig(), mixed, 132)
    # Empty problems do not count: 8 live ones still hit the entry.
    assert choose_general(GemmConfig(), ((64, 512, 1024),) * 8 + ((0, 512, 1024),), 132,
                          device=DEV).tile_n == 192


def test_user_table_edit_applies_to_new_choices(_isolated, tmp_path, monkeypatch):
    user = write(tmp_path / "mine.json", table([entry(config=dict(PP_64x256))]))
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(user))
    assert choose_varlen(GemmConfig(), 64 * 256, 64, 4096, 7168, 132,
                         device=DEV).schedule == "pingpong"
    write(user, table([entry()]))
    import os

    os.utime(user, (1, 2_000_000_000))  # a new mtime even on coarse-clock filesystems
    assert choose_varlen(GemmConfig(), 64 * 256, 64, 4096, 7168, 132,
                         device=DEV).schedule == "cooperative"


# ---------------------------------------------------------------------------------------------
# The online cache's versions


def test_online_cache_entries_need_matching_versions(_isolated, monkeypatch):
    versions.runtime_versions.cache_clear()
    here = versions.runtime_versions(DEV)
    assert set(here) == {"moe_gemm", "nvidia-cutlass-dsl", "driver", "device", "kernels"}
    path = tuned.online_path(DEV)
    path.parent.mkdir(parents=True)
    write(path, table([entry(config=dict(PP_64x256))], versions=here))
    tuned.bump_generation()
    assert tuned.lookup(DEV, key(), 1, 132).source == str(path)
    for field in ("driver", "nvidia-cutlass-dsl", "kernels", "moe_gemm", "device"):
        write(path, table([entry()], versions={**here, field: "other"}))
        tuned.bump_generation()
        with pytest.warns(RuntimeWarning, match="other versions"):
            assert tuned.lookup(DEV, key(), 1, 132) is None
        tuned._warned.clear()
    monkeypatch.setenv("MOE_GEMM_DISK_CACHE", "0")  # no disk cache: no online entries either
    write(path, table([entry()], versions=here))
    tuned.bump_generation()
    assert tuned.lookup(DEV, key(), 1, 132) is None


def test_online_cache_switches_reach_a_cached_choice(_isolated, tmp_path, monkeypatch):
    # MOE_GEMM_DISK_CACHE and MOE_GEMM_CACHE_DIR decide whether and from where the online
    # results are read: a change between two choices of one shape (nothing rewritten, no new
    # generation) must not keep the answer the other setting gave.
    monkeypatch.delenv("MOE_GEMM_DISK_CACHE", raising=False)
    path = tuned.online_path(DEV)
    path.parent.mkdir(parents=True)
    write(path, table([entry(E=32, N=2048, K=6144, bucket=9, config=dict(PP_64x256))],
                      versions=versions.runtime_versions(DEV)))

    def schedule(name: str, value: str) -> str:
        monkeypatch.setenv(name, value)
        return choose_varlen(GemmConfig(), 32 * 512, 32, 2048, 6144, 132,
                             device=DEV).schedule

    assert schedule("MOE_GEMM_DISK_CACHE", "1") == "pingpong"  # the online entry
    assert schedule("MOE_GEMM_DISK_CACHE", "0") == "cooperative"  # the rules
    assert schedule("MOE_GEMM_DISK_CACHE", "1") == "pingpong"
    assert schedule("MOE_GEMM_CACHE_DIR", str(tmp_path / "elsewhere")) == "cooperative"
    assert schedule("MOE_GEMM_CACHE_DIR", str(tmp_path / "cache")) == "pingpong"


# ---------------------------------------------------------------------------------------------
# Neighbours: the timed shapes nearest to a shape no entry holds


SMALL = {**PP_64x256}
BIG = {**COOP_128x192, "raster_panel": 8}


def samples(E, N, K, rows, times, form="varlen"):
    """One timed shape's samples: {name: (config, us)}."""
    return [{"form": form, "dtype": "bfloat16", "out_dtype": "bfloat16", "E": E, "N": N,
             "K": K, "rows": rows, "config": cfg, "us": us} for cfg, us in times]


def timed_grid(decode_small=50.0, decode_big=80.0, prefill_small=900.0, prefill_big=600.0):
    """Shapes around N=2048..8192, K=4096: the small tile wins decode (2 rows per expert),
    the big tile wins prefill (512 rows per expert)."""
    out = []
    for N in (2048, 4096, 8192):
        for K in (2048, 4096, 8192):
            out += samples(128, N, K, 256, [(SMALL, decode_small), (BIG, decode_big)])
            out += samples(128, N, K, 128 * 512, [(SMALL, prefill_small), (BIG, prefill_big)])
    return out


def test_neighbours_answer_unseen_shapes_from_the_nearest_timed_ones(_isolated):
    ship(_isolated, table([], samples=timed_grid()))
    decode = tuned.lookup(DEV, key(E=96, N=3000, K=5000, bucket=1), 96 * 2, 132)
    assert decode.how == "neighbours" and dict(decode.fields)["tile_m"] == 64
    assert decode.us is None
    prefill = tuned.lookup(DEV, key(E=96, N=3000, K=5000, bucket=9), 96 * 512, 132)
    assert prefill.how == "neighbours" and dict(prefill.fields)["tile_n"] == 192
    # Out of reach (N 2^16, four octaves past the grid), another form: the rules decide.
    assert tuned.lookup(DEV, key(E=96, N=1 << 17, K=4096, bucket=9), 96 * 512, 132) is None
    assert tuned.lookup(DEV, key(form="batched", E=8, N=2048, K=4096), 8 * 512, 132) is None
    # Through the heuristics: the rules' own config, never timed on this grid, stands
    # (nothing says the vote beats it) ...
    rules = choose_varlen(GemmConfig(), 96 * 512, 96, 3000, 5000, 132)
    c = choose_varlen(GemmConfig(), 96 * 512, 96, 3000, 5000, 132, device=DEV)
    assert c == rules and (c.tile_m, c.tile_n) != (128, 192)
    # ... until the voters time it too, slower than the vote's pick.
    rules_cfg = heuristics.rules_baseline("varlen", GemmConfig(), 132,
                                          shape=(96 * 512, 96, 3000, 5000))
    slow = [s for N in (2048, 4096, 8192) for K in (2048, 4096, 8192)
            for s in samples(128, N, K, 128 * 512, [(rules_cfg, 700.0)])]
    ship(_isolated, table([], samples=timed_grid() + slow))
    heuristics.clear_caches()  # (the same table path, rewritten within one mtime tick)
    c = choose_varlen(GemmConfig(), 96 * 512, 96, 3000, 5000, 132, device=DEV)
    assert (c.schedule, c.tile_m, c.tile_n) == ("cooperative", 128, 192)


def test_neighbours_keep_the_rules_unless_clearly_better(_isolated):
    # Near-ties (within 1%): the rules' config keeps the call.
    ship(_isolated, table([], samples=timed_grid(prefill_small=601.0)))
    prefill = key(E=96, N=3000, K=5000, bucket=9)
    assert tuned.lookup(DEV, prefill, 96 * 512, 132, baseline=SMALL) is None
    assert tuned.lookup(DEV, prefill, 96 * 512, 132, baseline=BIG) is None
    # Clearly better than the rules' config: the pick.
    ship(_isolated, table([], samples=timed_grid()))
    hit = tuned.lookup(DEV, prefill, 96 * 512, 132, baseline=SMALL)
    assert hit.how == "neighbours" and dict(hit.fields)["tile_n"] == 192
    # A rules' config no voter timed cannot be shown slower: the rules keep the call.
    other = {**BIG, "tile_n": 128}
    assert tuned.lookup(DEV, prefill, 96 * 512, 132, baseline=other) is None
    # Timed on some voters only: compared with the pick on those. (The Llama-4-Scout down
    # projection at 4096 tokens, H200: a vote of eight for a tile none of them had timed
    # against the rules' swapped tile ran 1.76x the best measured config, the rules 0.95x.)
    nearest = [s for K in (4096, 8192) for s in samples(128, 4096, K, 128 * 512,
                                                          [(other, 650.0)])]
    ship(_isolated, table([], samples=timed_grid() + nearest))
    hit = tuned.lookup(DEV, prefill, 96 * 512, 132, baseline=other)
    assert hit.how == "neighbours" and dict(hit.fields)["tile_n"] == 192
    faster = [dict(s, us=500.0) for s in nearest]
    ship(_isolated, table([], samples=timed_grid() + faster))
    assert tuned.lookup(DEV, prefill, 96 * 512, 132, baseline=other) is None


def test_nearer_neighbours_weigh_more(_isolated):
    # Two shapes at and next to the query's N and K favour SMALL by 2x; six two to four
    # octaves away favour BIG by 1.5x. An equal vote (mean log time) would take BIG; weighted
    # by distance, the near pair decides.
    near = [s for K in (4096, 8192)
            for s in samples(128, 4096, K, 128 * 512, [(SMALL, 300.0), (BIG, 600.0)])]
    far = [s for N in (16384, 32768) for K in (2048, 4096, 8192)
           for s in samples(128, N, K, 128 * 512, [(SMALL, 600.0), (BIG, 400.0)])]
    ship(_isolated, table([], samples=near + far))
    hit = tuned.lookup(DEV, key(E=128, N=4096, K=4096, bucket=9), 128 * 512, 132)
    assert hit.how == "neighbours" and hit.fields == tuned.normalize(SMALL)
    # At the far group's own N and K, the far group decides.
    hit = tuned.lookup(DEV, key(E=128, N=32768, K=4096, bucket=9), 128 * 512, 132)
    assert hit.how == "neighbours" and hit.fields == tuned.normalize(BIG)


def test_neighbours_need_enough_shapes_and_a_config_timed_on_all(_isolated, monkeypatch):
    monkeypatch.setattr(tuned, "MIN_VOTERS", 6)  # the six shapes below are enough voters
    few = samples(128, 4096, 4096, 256, [(SMALL, 50.0), (BIG, 80.0)])
    ship(_isolated, table([], samples=few * 3))  # one shape (three copies): too few voters
    assert tuned.lookup(DEV, key(E=96, N=3000, K=5000, bucket=1), 96 * 2, 132) is None
    # Each config timed on only some voters: none can be compared on all of them.
    split = []
    for i, N in enumerate((1024, 2048, 4096, 8192, 16384, 32768)):
        split += samples(128, N, 4096, 256, [(SMALL if i % 2 else BIG, 50.0)])
    ship(_isolated, table([], samples=split))
    assert tuned.lookup(DEV, key(E=96, N=4096, K=4096, bucket=1), 96 * 2, 132) is None


def test_a_narrowed_vote_takes_the_rules_fields_of_its_narrow_tile(_isolated):
    # Long K, ~128 rows per expert: the vote favours cooperative 128x256 with what the long-K
    # rule gives that tile (3 stages, whole-tile epilogue, tail split). E=8, N=512, K=32768 at
    # 1024 rows has ~24 tiles of 128x256 on 132 SMs: the tile narrows to 128x128 split over
    # K, and the stages and epilogue of the wide tile do not come along.
    wide = {**COOP_128x192, "tile_n": 256, "stages": 3, "whole_epilogue": True,
            "tail_split": True, "raster_panel": 16}
    # (each query's rules' config timed too, slower: the vote must beat it where it was timed)
    rules = [heuristics.rules_baseline("varlen", GemmConfig(), 132, shape=q)
             for q in ((64 * 128, 64, 1024, 16384), (1024, 8, 512, 32768))]
    grid = [s for N in (256, 512, 1024) for K in (16384, 32768)
            for s in samples(8, N, K, 8 * 128, [(wide, 300.0), (BIG, 400.0)]
                             + [(r, 500.0) for r in rules if r != wide])]
    ship(_isolated, table([], samples=grid))
    # 64 experts of ~128 rows, N=1024: ~384 tiles of 128x256, a grid they fill: kept whole
    c = choose_varlen(GemmConfig(), 64 * 128, 64, 1024, 16384, 132, device=DEV)
    assert (c.tile_n, c.stages, c.epi_whole, c.tail_split) == (256, 3, True, True)
    c = choose_varlen(GemmConfig(), 1024, 8, 512, 32768, 132, device=DEV)
    hit = heuristics.tuned_hit("varlen", GemmConfig(), 132, device=DEV,
                               shape=(1024, 8, 512, 32768))
    assert hit.how == "neighbours" and dict(hit.fields)["tile_n"] == 256
    assert (c.schedule, c.tile_m, c.tile_n) == ("cooperative", 128, 128)
    assert (c.stages, c.epi_whole, c.tail_split) == (None, False, True)
    # as the rules choose that tile themselves
    rules = choose_varlen(GemmConfig(), 1024, 8, 512, 32768, 132)
    assert (rules.tile_n, rules.stages, rules.epi_whole, rules.tail_split) == (
        128, None, False, True)


@pytest.mark.parametrize("form", ["batched", "general"])
def test_a_narrowed_vote_in_the_3d_and_list_forms(_isolated, form):
    # The vote of a batched or general table favours 128x256 at 3 stages on long K; 8 x
    # 128x512x32768 has 16 tiles of it on 132 SMs (299 us against 142 narrowed, H200): the
    # tile narrows as the rules' does (to 128x128 split over K, in both forms), with the
    # narrow tile's default stages.
    wide = {**COOP_128x192, "tile_n": 256, "stages": 3}
    shape = (8, 128, 512, 32768) if form == "batched" else ((128, 512, 32768),) * 8
    rules = heuristics.rules_baseline(form, GemmConfig(), 132, shape=shape)
    grid = [s for N in (256, 512, 1024) for K in (16384, 32768)
            for s in samples(8, N, K, 8 * 128, [(wide, 300.0), (BIG, 400.0), (rules, 500.0)],
                             form=form)]
    ship(_isolated, table([], samples=grid))
    if form == "batched":
        c = choose_batched(GemmConfig(), *shape, 132, device=DEV)
    else:
        c = choose_general(GemmConfig(), shape, 132, device=DEV)
    hit = heuristics.tuned_hit(form, GemmConfig(), 132, device=DEV, shape=shape)
    assert hit.how == "neighbours" and dict(hit.fields)["tile_n"] == 256
    assert (c.schedule, c.tile_m, c.tile_n, c.stages) == ("cooperative", 128, 128, None)
    assert c.tail_split


def test_bad_samples_are_left_out_not_fatal(_isolated):
    good = timed_grid()
    bad = [{"form": "varlen"}, "x", {**good[0], "us": "fast"}, {**good[0], "us": -1.0},
           {**good[0], "config": {"tile_m": 7}}, {**good[0], "form": "sideways"},
           {**good[0], "E": 0}]
    ship(_isolated, table([], samples=bad + good))
    t = tuned.tables_for(DEV)[0]
    assert len(t.timed) == 18  # the grid's shapes, nothing of the bad ones
    ship(_isolated, table([], samples="not a list"))
    assert tuned.tables_for(DEV)[0].timed == []
    assert tuned.has_form(DEV, "varlen") is False
    ship(_isolated, table([], samples=good))
    assert tuned.has_form(DEV, "varlen") is True and tuned.has_form(DEV, "general") is False


def test_neighbours_vote_across_tables_and_a_shape_counts_once(_isolated, tmp_path,
                                                               monkeypatch):
    monkeypatch.setattr(tuned, "MIN_VOTERS", 6)  # three shapes per table, six together
    prefill = [(N, K) for N in (2048, 4096, 8192) for K in (2048, 4096)]
    shipped = [s for N, K in prefill[:3]
               for s in samples(128, N, K, 128 * 512, [(SMALL, 900.0), (BIG, 600.0)])]
    user = [s for N, K in prefill[3:]
            for s in samples(128, N, K, 128 * 512, [(SMALL, 900.0), (BIG, 600.0)])]
    ship(_isolated, table([], samples=shipped))
    q = key(E=96, N=4096, K=4096, bucket=9)
    assert tuned.lookup(DEV, q, 96 * 512, 132) is None  # three shapes: too few alone
    monkeypatch.setenv(tuned.USER_TABLE_ENV, str(write(tmp_path / "mine.json",
                                                       table([], samples=user))))
    tuned.clear_caches()
    hit = tuned.lookup(DEV, q, 96 * 512, 132)
    assert hit.how == "neighbours" and dict(hit.fields)["tile_n"] == 192
    assert "mine.json" in hit.source
    # A shape in both tables votes once, with the first table's (the user's) timings: the
    # shipped copy (BIG 3x faster) would outvote the user's next-nearest shape otherwise.
    monkeypatch.setattr(tuned, "NEIGHBOURS", 2)
    monkeypatch.setattr(tuned, "MIN_VOTERS", 2)
    ship(_isolated, table([], samples=samples(128, 2048, 2048, 128 * 512,
                                              [(SMALL, 900.0), (BIG, 300.0)])))
    mine = (samples(128, 2048, 2048, 128 * 512, [(SMALL, 500.0), (BIG, 600.0)])
            + samples(128, 2048, 4096, 128 * 512, [(SMALL, 500.0), (BIG, 520.0)]))
    write(tmp_path / "mine.json", table([], samples=mine))
    tuned.clear_caches()
    at_shape = tuned.lookup(DEV, key(E=128, N=2048, K=2048, bucket=9), 128 * 512, 132)
    assert dict(at_shape.fields)["tile_m"] == 64


def test_a_pick_cleared_by_another_thread_is_still_answered(_isolated, monkeypatch):
    # lookup stored the vote in _picks and read it back; another thread clearing _picks in
    # between (past 4096 memos, or clear_caches) made that read a KeyError in the call.
    class ClearedAtOnce(dict):
        def __setitem__(self, k, v):
            super().__setitem__(k, v)
            self.clear()

    ship(_isolated, table([], samples=timed_grid()))
    monkeypatch.setattr(tuned, "_picks", ClearedAtOnce())
    hit = tuned.lookup(DEV, key(E=96, N=3000, K=5000, bucket=9), 96 * 512, 132)
    assert hit.how == "neighbours" and dict(hit.fields)["tile_n"] == 192
    assert tuned.lookup(DEV, key(E=96, N=1 << 17, K=4096, bucket=9), 96 * 512, 132) is None


SWAP = {"schedule": "cooperative", "tile_m": 256, "tile_n": 128, "raster_panel": 16,
        "visitor": "device", "swap_ab": True}


def test_a_swapped_entry_runs_where_the_launch_can_take_it(_isolated, monkeypatch):
    """A table entry with swap_ab (the tuner's 'swap 256x128') gives grouped_mm's 2-D x 3-D
    launch the swapped kernel with the entry's raster; a launch that cannot run it (the
    masked and fused forms: swap_ok False), a caller's swap_ab=False and MOE_GEMM_SWAP_AB=0
    get the rules instead; 32-bit output falls back with a warning."""
    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    ship(_isolated, table([entry(bucket=8, config=SWAP)]))
    shape = (64 * 256, 64, 4096, 7168, 132)
    c = choose_varlen(GemmConfig(), *shape, device=DEV, swap_ok=True)
    assert c.swap_ab and (c.tile_m, c.tile_n, c.swizzle, c.epi_n) == (256, 128, 16, 16)
    rules = choose_varlen(GemmConfig(), *shape)
    assert not rules.swap_ab
    assert choose_varlen(GemmConfig(), *shape, device=DEV) == rules  # swap_ok=False
    assert choose_varlen(GemmConfig(swap_ab=False), *shape, device=DEV, swap_ok=True) == rules
    monkeypatch.setenv(heuristics.SWAP_AB_ENV, "0")
    assert choose_varlen(GemmConfig(), *shape, device=DEV, swap_ok=True) == rules
    monkeypatch.delenv(heuristics.SWAP_AB_ENV)
    with pytest.warns(RuntimeWarning, match="cannot run here"):
        wide = choose_varlen(GemmConfig(), *shape, 4, device=DEV, swap_ok=True)
    assert not wide.swap_ab


def test_a_packed_pairs_entry_runs_packed_unless_the_caller_or_switch_says_no(
        _isolated, monkeypatch):
    """A table entry with packed_pairs (the tuner's 'pk') gives grouped_mm's varlen launch the
    packed 2x1 kernel; a caller's packed_pairs=False and MOE_GEMM_PACKED_PAIRS=0 keep the
    entry's other fields without it; the masked and fused forms build it never."""
    monkeypatch.delenv(heuristics.PACKED_PAIRS_ENV, raising=False)
    packed = dict(PP_64x256, cluster_m=2, cluster_n=1, packed_pairs=True)
    ship(_isolated, table([entry(bucket=8, config=packed)]))
    shape = (64 * 256, 64, 4096, 7168, 132)
    c = choose_varlen(GemmConfig(), *shape, device=DEV)
    assert c.packed_pairs and (c.tile_m, c.tile_n, c.cluster_m, c.cluster_n) == (64, 256, 2, 1)
    off = choose_varlen(GemmConfig(packed_pairs=False), *shape, device=DEV)
    assert not off.packed_pairs and (off.tile_m, off.cluster_m) == (64, 2)
    monkeypatch.setenv(heuristics.PACKED_PAIRS_ENV, "0")
    assert choose_varlen(GemmConfig(), *shape, device=DEV) == off
    monkeypatch.setenv(heuristics.PACKED_PAIRS_ENV, "1")
    assert choose_varlen(GemmConfig(), *shape, device=DEV) == c


def test_a_packed_pairs_entry_where_the_window_swaps_runs_the_swapped_kernel_unpacked(
        _isolated, monkeypatch):
    """An entry with packed_pairs that names no swap_ab, on a shape in the swap window (256
    rows per expert, K=7168): grouped_mm's launch (swap_ok) takes the swapped kernel, which
    has no packed pairs (its compile key refuses them), also where MOE_GEMM_SWAP_AB=1
    forces it."""
    from moe_gemm.kernels.sm90.constants import SWAP_TILE_ROWS

    monkeypatch.delenv(heuristics.PACKED_PAIRS_ENV, raising=False)
    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    packed = dict(PP_64x256, cluster_m=2, cluster_n=1, packed_pairs=True)
    ship(_isolated, table([entry(bucket=8, config=packed)]))
    shape = (64 * 256, 64, 4096, 7168, 132)
    assert choose_varlen(GemmConfig(), *shape, device=DEV).packed_pairs  # (swap_ok=False)
    c = choose_varlen(GemmConfig(), *shape, device=DEV, swap_ok=True)
    assert c.swap_ab and c.tile_m == SWAP_TILE_ROWS and not c.packed_pairs
    # 340 rows per expert: the entry's bucket, past the window (packed), unless forced.
    wide = (64 * 340, 64, 4096, 7168, 132)
    assert choose_varlen(GemmConfig(), *wide, device=DEV, swap_ok=True).packed_pairs
    monkeypatch.setenv(heuristics.SWAP_AB_ENV, "1")
    forced = choose_varlen(GemmConfig(), *wide, device=DEV, swap_ok=True)
    assert forced.swap_ab and not forced.packed_pairs


def test_the_fused_kernels_swap_in_the_window_whatever_an_entry_timed_on_grouped_mm(
        _isolated, monkeypatch):
    """table_unswap=False (the fused kernels, fused_launch.fused_choice): an exact entry's
    swap_ab=False, timed on grouped_mm's kernels, does not keep the M-side tiles inside the
    window; an entry's swap_ab=True still swaps outside it."""
    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    inside = (64 * 256, 64, 4096, 7168, 132)
    outside = (64 * 1024, 64, 4096, 7168, 132)
    ship(_isolated, table([entry(bucket=8, config=dict(PP_64x256, swap_ab=False)),
                           entry(bucket=10, config=dict(SWAP))]))
    assert not choose_varlen(GemmConfig(), *inside, device=DEV, swap_ok=True).swap_ab
    fused = choose_varlen(GemmConfig(), *inside, device=DEV, swap_ok=True, table_unswap=False)
    assert fused.swap_ab and (fused.tile_m, fused.tile_n) == (256, 128)
    assert choose_varlen(GemmConfig(), *outside, device=DEV, swap_ok=True,
                         table_unswap=False).swap_ab
    # pins still decide
    assert not choose_varlen(GemmConfig(swap_ab=False), *inside, device=DEV, swap_ok=True,
                             table_unswap=False).swap_ab


def test_a_launch_that_cannot_swap_takes_the_runner_up_its_entry_timed(_isolated, monkeypatch):
    """Where an exact entry names the swapped kernel and the launch cannot run it (the fused
    and masked forms: swap_ok False; a caller's swap_ab=False; MOE_GEMM_SWAP_AB=0), the choice
    is the fastest unswapped config the same search timed on that shape (its samples at the
    row count nearest the call's within the bucket), not the rules; with no such samples, the
    rules."""
    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    E, N, K = 64, 4096, 7168
    near = samples(E, N, K, E * 256, [(SWAP, 90.0), (SMALL, 120.0), (BIG, 100.0)])
    # the same shape timed at another row count of the bucket, ranking the other way
    edge = samples(E, N, K, E * 200, [(SWAP, 90.0), (SMALL, 95.0), (BIG, 130.0)])
    # another shape, where SMALL wins (must not be read for this key)
    other = samples(E, 2 * N, K, E * 256, [(SMALL, 50.0), (BIG, 100.0)])
    ship(_isolated, table([entry(E=E, N=N, K=K, bucket=8, config=SWAP)],
                          samples=near + edge + other))
    rules = choose_varlen(GemmConfig(), E * 256, E, N, K, 132)
    assert (rules.schedule, rules.tile_n) != ("cooperative", 192)

    hit = tuned.unswapped_pick(DEV, key(E=E, N=N, K=K, bucket=8), E * 256)
    assert hit.fields == tuned.normalize(BIG)
    assert tuned.unswapped_pick(DEV, key(E=E, N=N, K=K, bucket=8), E * 210).fields == (
        tuned.normalize(SMALL))
    # no timing of this shape in this bucket
    assert tuned.unswapped_pick(DEV, key(E=E, N=N, K=K, bucket=10), E * 1024) is None

    assert choose_varlen(GemmConfig(), E * 256, E, N, K, 132, device=DEV, swap_ok=True).swap_ab
    for c in (choose_varlen(GemmConfig(), E * 256, E, N, K, 132, device=DEV),
              choose_varlen(GemmConfig(swap_ab=False), E * 256, E, N, K, 132, device=DEV,
                            swap_ok=True)):
        assert not c.swap_ab and (c.schedule, c.tile_m, c.tile_n) == ("cooperative", 128, 192)
    monkeypatch.setenv(heuristics.SWAP_AB_ENV, "0")
    heuristics.clear_caches()
    c = choose_varlen(GemmConfig(), E * 256, E, N, K, 132, device=DEV, swap_ok=True)
    assert not c.swap_ab and (c.schedule, c.tile_n) == ("cooperative", 192)
    monkeypatch.delenv(heuristics.SWAP_AB_ENV)

    # the entry without samples: the rules, as before
    ship(_isolated, table([entry(E=E, N=N, K=K, bucket=8, config=SWAP)]))
    heuristics.clear_caches()
    assert choose_varlen(GemmConfig(), E * 256, E, N, K, 132, device=DEV) == rules


def test_an_exact_entry_that_timed_the_swapped_kernel_decides_over_the_window(
        _isolated, monkeypatch):
    """The window (heuristics.swap_ab_wanted) guesses where no measurement says otherwise: an
    exact entry naming swap_ab=False (the tuner or a re-rank timed the swapped kernel there and
    it lost) keeps its pick inside the window; one naming True swaps outside it; an entry that
    does not name it, or a neighbours pick, leaves the window to decide. Pins and
    MOE_GEMM_SWAP_AB still come first."""
    monkeypatch.delenv(heuristics.SWAP_AB_ENV, raising=False)
    inside = (64 * 256, 64, 4096, 7168, 132)  # 256 rows per expert: in the window
    outside = (64 * 1024, 64, 4096, 7168, 132)  # 1024 rows per expert: out of it
    assert heuristics.swap_ab_wanted(GemmConfig(), 64 * 256, 64, 7168, 2)
    assert not heuristics.swap_ab_wanted(GemmConfig(), 64 * 1024, 64, 7168, 2)
    ship(_isolated, table([entry(bucket=8, config=dict(PP_64x256, swap_ab=False)),
                           entry(bucket=10, config=dict(SWAP))]))
    kept = choose_varlen(GemmConfig(), *inside, device=DEV, swap_ok=True)
    assert not kept.swap_ab and (kept.schedule, kept.tile_m, kept.tile_n) == ("pingpong", 64,
                                                                             256)
    swapped = choose_varlen(GemmConfig(), *outside, device=DEV, swap_ok=True)
    assert swapped.swap_ab and (swapped.tile_m, swapped.tile_n) == (256, 128)
    # the caller's switch and pin outrank the measurement
    monkeypatch.setenv(heuristics.SWAP_AB_ENV, "1")
    assert choose_varlen(GemmConfig(), *inside, device=DEV, swap_ok=True).swap_ab
    monkeypatch.delenv(heuristics.SWAP_AB_ENV)
    assert choose_varlen(GemmConfig(swap_ab=True), *inside, device=DEV, swap_ok=True).swap_ab
    assert not choose_varlen(GemmConfig(), *outside, device=DEV, swap_ok=False).swap_ab
    # an entry that does not name swap_ab: the window swaps its pick
    ship(_isolated, table([entry(bucket=8, config=dict(PP_64x256))]))
    heuristics.clear_caches()
    assert choose_varlen(GemmConfig(), *inside, device=DEV, swap_ok=True).swap_ab
    # no table at all: the window
    ship(_isolated, table([]))
    heuristics.clear_caches()
    assert choose_varlen(GemmConfig(), *inside, device=DEV, swap_ok=True).swap_ab
