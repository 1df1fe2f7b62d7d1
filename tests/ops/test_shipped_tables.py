"""Every table shipped in moe_gemm/tables is valid for its device: the file is named after the
device, every entry and every timed shape parse, and every entry names a config this build
runs (a tile removed from the kernel's lists would make an entry unusable: retune)."""

from __future__ import annotations

import json

import pytest

from moe_gemm.ops import tuned

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


def test_tables_folder_is_package_data():
    assert tuned.TABLES_DIR.is_dir() and (tuned.TABLES_DIR / "README.md").is_file()
