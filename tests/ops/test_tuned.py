"""Tuned tables (moe_gemm.ops.tuned) and how the heuristics use them, on the CPU: every lookup
path, bucket logic, bad tables, version checks and the cost model's sanity."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from moe_gemm import GemmConfig
from moe_gemm.ops import cost_model, heuristics, tuned, versions
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


def test_exact_nearest_and_none(_isolated):
    ship(_isolated, table([entry(bucket=8), entry(bucket=4, config=dict(PP_64x256))]))
    hit = tuned.lookup(DEV, key(bucket=8), 64 * 256, 132)
    assert hit.how == "exact" and dict(hit.fields)["tile_n"] == 192 and hit.us == 100.0
    near = tuned.lookup(DEV, key(bucket=9), 64 * 512, 132)
    assert near.how == "nearest" and dict(near.fields)["tile_n"] == 192
    # Equidistant (6 is 2 from both 4 and 8): the larger bucket wins.
    assert dict(tuned.lookup(DEV, key(bucket=6), 64 * 64, 132).fields)["tile_n"] == 192
    assert dict(tuned.lookup(DEV, key(bucket=3), 64 * 8, 132).fields)["tile_n"] == 256
    assert tuned.lookup(DEV, key(bucket=11), 64 * 2048, 132) is None  # 3 buckets away
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


@pytest.mark.parametrize("doc,why", [
    ("{not json", "not valid JSON"),
    ([1, 2], "ignored"),
    (table([entry()], device="NVIDIA H200"), "made for 'NVIDIA H200'"),
    ({**table([entry()]), "format": "something/9"}, "not a moe_gemm.tuned-table/1"),
    ({**table([entry()]), "entries": {"a": 1}}, "entries is not a list"),
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


def test_entries_this_build_cannot_use_are_skipped(_isolated):
    bad_tile = {**COOP_128x192, "tile_n": 200}
    unknown = {**COOP_128x192, "warp_count": 3}
    no_tile = {"schedule": "cooperative"}
    ship(_isolated, table([entry(bucket=1, config=bad_tile), entry(bucket=2, config=unknown),
                           entry(bucket=3, config=no_tile), {"form": "varlen"},
                           entry(bucket=8)]))
    with pytest.warns(RuntimeWarning, match="4 entries"):
        assert tuned.lookup(DEV, key(bucket=8), 1, 132).how == "exact"
    assert tuned.lookup(DEV, key(bucket=7), 1, 132).how == "nearest"
    for b in (1, 2, 3):  # the skipped entries count for nothing, not even as nearest
        assert tuned.lookup(DEV, key(bucket=b), 1, 132) is None


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


# ---------------------------------------------------------------------------------------------
# The cost model


def _model_block(configs, forms=("varlen",), n=(9, 13), k=(9, 13), buckets=(0, 10)):
    return {"kind": tuned.MODEL_KIND, "mm_flops_per_s": 7e14, "copy_bytes_per_s": 3e12,
            "nsm": 132, "configs": configs,
            "domain": {"forms": list(forms), "dtypes": [["bfloat16", "bfloat16"]],
                       "log2_N": list(n), "log2_K": list(k), "bucket": list(buckets)}}


def test_model_answers_inside_its_domain_only(_isolated):
    small = {**PP_64x256}
    big = {**COOP_128x192, "raster_panel": 8}
    model = _model_block([
        {"config": small, "eff": 0.5, "tile_us": 0.5, "mem": 1.1, "rms_log_err": 0.05},
        {"config": big, "eff": 0.8, "tile_us": 2.0, "mem": 1.3, "rms_log_err": 0.05},
        {"config": {**big, "tile_n": 128}, "eff": 1.0, "tile_us": 0.0, "mem": 0.9,
         "rms_log_err": 0.9},  # fits badly: never offered
    ])
    ship(_isolated, table([], model=model))
    decode = tuned.lookup(DEV, key(E=128, N=2048, K=4096, bucket=-1), 64, 132)
    assert decode.how == "model" and dict(decode.fields)["tile_m"] == 64
    prefill = tuned.lookup(DEV, key(E=128, N=2048, K=4096, bucket=9), 128 * 512, 132)
    assert prefill.how == "model" and dict(prefill.fields)["tile_m"] == 128
    assert dict(prefill.fields)["tile_n"] == 192  # the badly fitted 128x128 is not offered
    assert tuned.lookup(DEV, key(E=128, N=65536, K=4096, bucket=9), 1, 132) is None  # N 2^16
    assert tuned.lookup(DEV, key(E=8, N=2048, K=4096, bucket=13), 1, 132) is None
    assert tuned.lookup(DEV, key(form="batched", E=8, N=2048, K=4096), 1, 132) is None


def test_cost_model_sanity():
    cfg = {"tile_m": 128, "tile_n": 256, "cluster_m": 1, "cluster_n": 1}
    p = cost_model.Params(eff=0.8, tile_us=1.0, mem=1.2)

    def t(rows, E=64, N=4096, K=4096, form="varlen", cfg=cfg, p=p):
        s = cost_model.Shape(form, E, N, K, rows, 132)
        return cost_model.predict_us(cfg, p, s, 7e14, 3e12)

    sizes = [1, 8, 64, 512, 4096, 32768, 262144]
    times = [t(r) for r in sizes]
    assert times == sorted(times) and times[0] > cost_model.LAUNCH_US
    # Decode: weight reads dominate; doubling the active experts' weights ~doubles time.
    assert t(64, E=64) > 1.5 * t(64, E=64, N=2048)
    # Prefill is compute-bound: time tracks FLOPs within the wave quantisation.
    big, bigger = t(262144), t(2 * 262144)
    assert 1.8 < bigger / big < 2.2
    # A more efficient config is never predicted slower.
    assert t(262144, p=cost_model.Params(0.9, 1.0, 1.2)) <= big
    # Nothing to do costs the launch only.
    assert t(0) == cost_model.LAUNCH_US
    # The tail split halves the cost of a short last wave (compute-bound, K long).
    one_wave_and_a_bit = 132 * 128 + 128 * 10  # rows for 132 + 10 m-tiles of one N tile
    split = {**cfg, "tail_split": True}
    s = cost_model.Shape("batched", 1, 256, 8192, one_wave_and_a_bit, 132)
    a = cost_model.terms(cfg, s, 7e14, 3e12)
    b = cost_model.terms(split, s, 7e14, 3e12)
    assert a.waves == 2 and b.waves == pytest.approx(1.55)  # 142 tiles on 132 CTAs


def test_active_experts():
    assert cost_model.active_experts(256, 0) == 0
    assert cost_model.active_experts(256, 1) == pytest.approx(1.0)
    assert 7.8 < cost_model.active_experts(256, 8) < 8.0
    assert cost_model.active_experts(8, 100000) == pytest.approx(8.0)


def test_model_must_clearly_beat_the_rules_config(_isolated):
    small = {**PP_64x256}
    big = {**COOP_128x192, "raster_panel": 8}
    ship(_isolated, table([], model=_model_block([
        {"config": small, "eff": 0.5, "tile_us": 0.5, "mem": 1.1, "rms_log_err": 0.05},
        {"config": big, "eff": 0.8, "tile_us": 2.0, "mem": 1.3, "rms_log_err": 0.05}])))
    prefill = key(E=128, N=2048, K=4096, bucket=9)
    decode = key(E=128, N=2048, K=4096, bucket=-1)
    # The rules' config is the model's own pick: the rules keep the call.
    assert tuned.lookup(DEV, prefill, 128 * 512, 132, baseline=big) is None
    # Predicted clearly faster than the rules' config: the model's pick.
    hit = tuned.lookup(DEV, decode, 64, 132, baseline=big)
    assert hit.how == "model" and dict(hit.fields)["tile_m"] == 64
    # A rules' config the model was not fitted on cannot be compared: the model decides.
    other = {**big, "tile_n": 128}
    assert tuned.lookup(DEV, prefill, 128 * 512, 132, baseline=other).how == "model"
    # Through the heuristics, the rules' choice is the baseline.
    rules = choose_varlen(GemmConfig(), 64, 128, 2048, 4096, 132)
    chosen = choose_varlen(GemmConfig(), 64, 128, 2048, 4096, 132, device=DEV)
    assert (rules.tile_m, rules.tile_n) == (64, 256)  # here the model agrees with the rules
    assert (chosen.tile_m, chosen.tile_n) == (64, 256)
