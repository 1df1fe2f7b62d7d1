"""Every table shipped in moe_gemm/tables is valid for its device: the file is named after the
device, every entry and every timed shape parse, and every entry names a config this build
runs (a tile removed from the kernel's lists would make an entry unusable: retune), and a default
call at an entry's own shape runs that entry's config, field for field."""

from __future__ import annotations

import json
import os

import pytest

from moe_gemm.config import GemmConfig
from moe_gemm.ops import heuristics, tuned
from moe_gemm.ops.choice_rules import ITEMSIZE, choice_fields

SHIPPED = sorted(tuned.TABLES_DIR.glob("*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_table_is_valid(path):
    doc = json.loads(path.read_text())
    assert path.stem == tuned.device_slug(doc["device"])
    table = tuned.parse_table(doc, str(path), doc["device"])
    assert table.skipped == 0, f"{table.skipped} entries this build cannot use"
    assert table.entries, "a shipped table with no entries"
    for key, (fields, us) in table.entries.items():
        assert us is not None and us > 0, key
    # Every timed shape of the samples parses, and none is lost to a config this build
    # lacks. A searched entry has its shape's samples (the tuner keeps every candidate's
    # time); only an entry a re-rank made from the rules' choice has none (moe-gemm tune
    # --rerank keeps its few timings out of the neighbours' vote), and it says so.
    shapes = {(s["form"], s["E"], s["N"], s["K"], s["rows"]) for s in doc["samples"]}
    assert len(table.timed) == len(shapes)
    sampled = {(s["form"], s["dtype"], s.get("out_dtype", s["dtype"]), s["E"], s["N"], s["K"],
                tuned.rows_bucket(s["rows"] / max(1, s["E"]))) for s in doc["samples"]}
    for e in doc["entries"]:
        key = (e["form"], e["dtype"], e.get("out_dtype", e["dtype"]), e["E"], e["N"], e["K"],
               e["bucket"])
        if key not in sampled:
            assert e.get("rerank", {}).get("from_table_us", 0) is None, (
                f"{e.get('label') or key}: an entry without its shape's samples that no "
                "re-rank made from the rules' choice")
    assert "model" not in doc  # the cost-model block has no reader left
    assert {"moe_gemm", "nvidia-cutlass-dsl", "driver", "device"} <= set(doc["versions"])


# The fields choice_fields leaves out where they hold these values.
_FIELD_DEFAULTS = {"raster_along": "m", "raster_serpentine": False, "swap_ab": False,
                   "packed_pairs": False, "stages": None}


@pytest.fixture
def shipped_tables_only(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """The lookup as a user's default call meets it: the shipped tables on, no user table, no
    online cache, no MOE_GEMM_* switch set; the lookup caches cleared around the test."""
    for name in [n for n in os.environ if n.startswith("MOE_GEMM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path / "cache"))
    tuned.clear_caches()
    heuristics.clear_caches()
    yield
    tuned.clear_caches()
    heuristics.clear_caches()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_a_default_call_at_an_entrys_shape_runs_its_config(path, shipped_tables_only):
    """grouped_mm with no config at a varlen entry's own shape launches exactly the entry's
    config: every field (tile, cluster, stages, raster, epilogue, tail split, swapped tiles,
    packed pairs) reaches the kernel choice, none dropped or overridden on the way (the
    entry's time was measured with all of them)."""
    doc = json.loads(path.read_text())
    checked = 0
    for e in doc["entries"]:
        if e["form"] != "varlen":
            continue
        out_dtype = e.get("out_dtype", e["dtype"])
        choice = heuristics.choose_varlen(
            GemmConfig(), e["rows"], e["E"], e["N"], e["K"], doc.get("sm_count", 132),
            ITEMSIZE[out_dtype], device=doc["device"], dtype=e["dtype"], out_dtype=out_dtype,
            swap_ok=True)
        got = choice_fields(choice, "varlen")
        differ = {k: (v, got.get(k, _FIELD_DEFAULTS.get(k))) for k, v in e["config"].items()
                  if got.get(k, _FIELD_DEFAULTS.get(k)) != v}
        assert not differ, (f"{e.get('name')} at E={e['E']} N={e['N']} K={e['K']} "
                            f"rows={e['rows']}: (entry, chosen) {differ}")
        checked += 1
    assert checked > 100


def test_tables_folder_is_package_data():
    assert tuned.TABLES_DIR.is_dir() and (tuned.TABLES_DIR / "README.md").is_file()
