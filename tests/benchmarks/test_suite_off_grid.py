"""benchmarks.suite_off_grid: the off-grid shapes are valid inputs for every form they name,
the smoke set has the same names, and `moe-gemm bench --suite off-grid --smoke` runs on the CPU
with every shape checked against its float32 reference."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import bench, suite_off_grid
from benchmarks.suite import DEFAULT_NAME


def test_shapes_are_valid_and_named_once():
    full = suite_off_grid.off_grid_suite()
    names = [s.name for s in full]
    assert len(names) == len(set(names)) == 24
    for s in full:
        for m, n, k in s.sizes(1234):
            assert m >= 0 and n > 0 and k >= 0
            # 16-byte rows for 16-bit data (fp32: 4-byte elements, multiples of 4)
            assert n % 8 == 0 and k % 8 == 0, (s.name, n, k)
    smoke = {s.name for s in suite_off_grid.off_grid_smoke_suite()}
    assert smoke <= set(names)
    mixed = next(s for s in full if s.name == "og-list-mix").problems
    assert any(m == 0 for m, _, _ in mixed) and any(k == 0 for _, _, k in mixed)
    # seeded: the same list on every machine
    assert mixed == next(s for s in suite_off_grid.off_grid_suite()
                         if s.name == "og-list-mix").problems


def test_smoke_run_checks_every_shape(tmp_path: Path):
    out = tmp_path / "og.json"
    assert bench.main(["--suite", "off-grid", "--smoke", "--quiet", "--no-table", "--png",
                       "none", "--reps", "2", "--device", "cpu", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    ours = {r["shape"]: r for r in doc["results"] if r["impl"] == DEFAULT_NAME}
    assert set(ours) == {s.name for s in suite_off_grid.off_grid_smoke_suite()}
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-2 for r in ours.values()), ours
