"""benchmarks/raster_waves.py on the CPU: the per-wave panel count on small hand-checked
orders, the summary and the command line."""

from __future__ import annotations

import json

import pytest

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


def test_a_cta_past_the_edge_keeps_its_place_in_the_wave():
    # One 2x1 cluster; experts of 384 rows (3 m-tiles: the second cluster tile's rank 1 lies
    # past the edge and computes for the multicast) and 256 rows; N = 256, one n-tile each.
    # Waves: expert 0's m-tiles 0-1, then m-tile 2 (its peer idle past the edge), then expert
    # 1's two: 5 A panels and 3 B panels. (Counting only the tiles a CTA stores shifted rank
    # 1's list by one and paired expert 0's last tile with expert 1's: 4 B panels; that model
    # read 1.93x for Mixtral-8x22B gate/up at 2048 tokens in 2x1 clusters, where ncu measured
    # 1.11x on an H100.)
    f = space.parse_name("coop 128x256 c2x1 p8")
    total, compulsory = rw.wave_bytes([384, 256], 256, 64, f, num_ctas=2)
    assert total == (5 * 128 + 3 * 256) * 64 * 2
    assert compulsory == (384 + 256 + 2 * 256) * 64 * 2


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


def _table_with(tmp_path, configs: dict[str, str]):
    """A tuned table whose entries hold, at the exact keys of Mixtral-8x22B's zoo cases at 2048
    tokens, the configs named per projection ("gate_up", "down")."""
    from benchmarks import zoo
    from benchmarks.ab_cases import table_key
    from moe_gemm.tuning import table_io

    doc = table_io.new_table("NVIDIA Test GPU", 132, {}, {})
    for proj, name in configs.items():
        _, f = zoo.named_cases(f"Mixtral-8x22B/{proj}/2048", 1234, False)[0]
        form, dtype, out_dtype, E, N, K, bucket = table_key(f)
        config = {k: v for k, v in space.parse_name(name).items() if v is not None}
        doc["entries"].append({"form": form, "dtype": dtype, "out_dtype": out_dtype, "E": E,
                               "N": N, "K": K, "bucket": bucket, "rows": f["rows"] // E,
                               "config": config, "us": 1000.0, "name": name})
    path = tmp_path / "table.json"
    table_io.write(path, doc)
    return path


def test_table_mode_points_at_a_pick_whose_raster_rereads_the_weights(tmp_path):
    # Mixtral-8x22B gate/up at 2048 tokens: panels of 8 n-tiles re-read the weight panels
    # across waves, 1.45x the compulsory bytes (ncu on an H100 measured 1.45x for this pick);
    # panels of m-tiles read them once per wave, 1.14x. The down pick is already its best.
    from benchmarks import zoo
    from benchmarks.pick_ab import table_pick
    from moe_gemm.tuning import table_io

    path = _table_with(tmp_path, {"gate_up": "coop 128x256 c1x2 p8ns",
                                  "down": "coop 128x256 c1x2 p8"})
    out, rivals = tmp_path / "rows.json", tmp_path / "rivals.json"
    assert rw.main(["--table", str(path), "--models", "Mixtral-8x22B", "--tokens", "2048",
                    "--out", str(out), "--rivals-out", str(rivals)]) == 0
    rows = {r["proj"]: r for r in json.loads(out.read_text())["rows"]}
    up, down = rows["gate_up"], rows["down"]
    assert up["pick_x_compulsory"] > 1.4 and up["best_x_compulsory"] < 1.2
    assert up["ratio"] == pytest.approx(up["pick_x_compulsory"] / up["best_x_compulsory"])
    assert up["ratio"] > 1.2
    assert space.parse_name(up["best"]).get("raster_along") in (None, "m")
    assert down["ratio"] >= 1.0 and down["best_x_compulsory"] <= down["pick_x_compulsory"]
    table = table_io.read_table(rivals)
    assert [e["name"] for e in table["entries"]] == [up["best"]]
    assert "us" not in table["entries"][0]  # the replaced pick's time is not the rival's
    _, f = zoo.named_cases("Mixtral-8x22B/gate_up/2048", 1234, False)[0]
    fields = table_pick(table, f)
    assert (fields["tile_m"], fields["tile_n"], fields["cluster_n"]) == (128, 256, 2)
    assert (fields["raster_along"], fields["raster_serpentine"]) != ("n", True)


def test_table_mode_leaves_out_swapped_picks_and_refuses_bad_options(tmp_path, capsys):
    path = _table_with(tmp_path, {"gate_up": "swap 256x128 c1x2"})
    out = tmp_path / "rows.json"
    assert rw.main(["--table", str(path), "--models", "Mixtral-8x22B", "--tokens", "2048",
                    "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == []
    assert rw.main(["--rivals-out", str(tmp_path / "r.json")]) == 2
    assert "--rivals-out needs --table" in capsys.readouterr().err
    assert rw.main(["--table", str(path), "--min-ratio", "0.5"]) == 2
    assert rw.main(["--table", str(tmp_path / "missing.json")]) == 2
    assert "--table" in capsys.readouterr().err
