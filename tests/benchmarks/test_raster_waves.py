"""benchmarks/raster_waves.py on the CPU: the per-wave panel count on small hand-checked
orders, the summary and the command line."""

from __future__ import annotations

import json

from benchmarks import raster_waves as rw
from moe_gemm.tuning import space


def test_wave_bytes_counts_each_waves_distinct_panels():
    # One expert of 256 rows, N = 512, K = 64, 128x256 tiles: a 2 x 2 grid on 2 CTAs.
    along_m = space.parse_name("pp 128x256 p8")  # (0,0) (1,0) | (0,1) (1,1)
    total, compulsory = rw.wave_bytes([256], 512, 64, along_m, num_ctas=2)
    # each wave: both A row panels, one B column panel
    assert total == 2 * (2 * 128 + 1 * 256) * 64 * 2
    assert compulsory == (256 + 512) * 64 * 2
    along_n = space.parse_name("pp 128x256 p8n")  # (0,0) (0,1) | (1,0) (1,1)
    total_n, _ = rw.wave_bytes([256], 512, 64, along_n, num_ctas=2)
    assert total_n == 2 * (1 * 128 + 2 * 256) * 64 * 2
    # One wave holding the whole grid reads every panel once: the compulsory bytes.
    whole, comp = rw.wave_bytes([256], 512, 64, along_m, num_ctas=4)
    assert whole == comp


def test_empty_experts_and_clusters():
    f = space.parse_name("pp 128x256 c2x1 p8")
    total, compulsory = rw.wave_bytes([0, 300, 0], 256, 128, f, num_ctas=5)
    # 300 rows: 3 row tiles, the cluster pair's second CTA of the last pair stores nothing
    assert compulsory == (300 + 256) * 128 * 2 and total >= compulsory
    assert rw.wave_bytes([0, 0], 256, 128, f) == (0, 0)


def test_rows_and_summary(tmp_path):
    out = tmp_path / "w.json"
    rc = rw.main(["--models", "Qwen3-30B-A3B", "--tokens", "64", "--configs",
                  "pp 64x256 c2x1 p8;pp 64x256 c2x1 p8ns", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 2 * 2  # two projections x two configs
    assert all(r["x_compulsory"] >= 1.0 for r in doc["rows"])
    first, second = doc["summary"]
    assert first["median"] == 1.0 and second["vs"] == "pp 64x256 c2x1 p8"
    assert rw.main(["--configs", "pp 64x256 nonsense"]) == 2
