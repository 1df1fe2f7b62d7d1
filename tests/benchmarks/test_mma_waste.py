"""benchmarks.mma_waste: the default choice's wasted MMA work on zoo routings, from the
schedule module (CPU only)."""

from __future__ import annotations

import json

from benchmarks import mma_waste
from moe_gemm.ops import schedule as sched
from moe_gemm.tuning import zoo as models


def test_rows_follow_the_schedule_module(tmp_path, capsys):
    out = tmp_path / "waste.json"
    assert mma_waste.main(["--models", "Mixtral-8x7B,DeepSeek-V3", "--tokens", "2048",
                           "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {(r["model"], r["proj"]) for r in rows} == {
        (m, p) for m in ("Mixtral-8x7B", "DeepSeek-V3") for p in ("gate_up", "down")}
    for r in rows:
        assert r["wasted_fraction"] >= r["wasted_without_cluster"] >= 0
        counts = models.topk_counts(r["E"], 2048, min(r["top_k"], r["E"]), 1234)
        assert sum(counts) == r["rows"]
        tile_m, tile_n = (int(v) for v in r["choice"].split()[1].split("x"))
        cm, cn = (int(v) for v in r["choice"].split()[2][1:].split("x"))
        want = sched.mma_work([(c, r["N"], r["K"]) for c in counts], tile_m, tile_n, 64, cm, cn)
        assert r["wasted_fraction"] == want.wasted_fraction
    s = doc["summary"]
    assert s["cases"] == 4 and s["max"] >= s["median"] >= 0
    assert "DeepSeek-V3/gate_up/2048" in capsys.readouterr().out


def test_rules_only_and_no_rows():
    rows = mma_waste.waste_rows("OLMoE-1B-7B", [16], None)
    assert len(rows) == 2 and all(r["tokens"] == 16 for r in rows)
    assert mma_waste.summary([]) == {"cases": 0}


def test_granularity_floor_is_the_rounding_of_each_experts_rows():
    floor = mma_waste.granularity_floor("Mixtral-8x7B", [2048], steps=(128, 64, 8, 1))
    counts = [models.topk_counts(8, 2048, 2, 1234)] * 2  # both projections share the routing
    for f in floor:
        g = f["rows_granularity"]
        want = [sum(-(-r // g) * g for r in c) / sum(c) - 1 for c in counts]
        assert f["cases"] == 2 and abs(f["median"] - want[0]) < 1e-12
    # Coarser row tiles never waste less; one-row granularity wastes nothing.
    medians = [f["median"] for f in floor]
    assert medians == sorted(medians, reverse=True) and medians[-1] == 0


def test_rows_computed_by_each_tail_design():
    rc = mma_waste.rows_computed
    assert rc(0, 128) == 0 and rc(256, 128) == 256  # nothing, or whole tiles only
    assert rc(130, 128) == 256  # 2 rows in a whole second tile
    assert rc(130, 128, half_skip=True) == 192  # ... or in its first 64-row half
    assert rc(130, 128, swap_max=32) == 136  # ... or in a swapped tile of 8 rows
    assert rc(161, 128, swap_max=32) == 256  # 33 rows: past the swap, a whole tile
    assert rc(161, 128, swap_max=64) == 128 + 40
    assert rc(5, 64, swap_max=32) == 8 and rc(100, 64) == 128


def test_tail_designs_summarise_the_zoo_routings():
    designs = mma_waste.tail_designs("Mixtral-8x7B", [2048])
    counts = models.topk_counts(8, 2048, 2, 1234)
    by = {d["design"]: d for d in designs}
    assert len(by) == len(mma_waste.TAIL_DESIGNS)
    for name, tile_m, swap_max, half, _ in mma_waste.TAIL_DESIGNS:
        want = sum(mma_waste.rows_computed(r, tile_m, swap_max, half) for r in counts) / sum(
            counts) - 1
        assert by[name]["cases"] == 2 and abs(by[name]["median"] - want) < 1e-12
    # Every finer design wastes no more than plain 128-row tiles.
    assert all(d["median"] <= by["128-row tiles"]["median"] for d in designs)


def test_operand_bytes_of_each_tail_design():
    ol = mma_waste.operand_rows_loaded
    # A tile loads its A box and its B box whatever its rows: 130 rows in 128-row tiles load
    # two of each; a swapped tail of 2 rows loads an 8-row A box beside its B box.
    assert ol(0, 128, 192) == 0 and ol(128, 128, 192) == 320
    assert ol(130, 128, 192) == 2 * 320
    assert ol(130, 128, 192, swap_max=32) == 320 + 8 + 192
    assert ol(161, 128, 192, swap_max=32) == 2 * 320  # 33 tail rows: a whole tile
    assert ol(100, 64, 192) == 2 * (64 + 192)  # 64-row tiles load B twice as often
    # Trimmed A loads: a tail of 2 rows loads 16 rows of A beside its whole B box.
    assert ol(130, 128, 192, trim=16) == 320 + 16 + 192
    assert ol(128 + 127, 128, 192, trim=16) == 2 * 320
    by = {d["design"]: d for d in mma_waste.tail_designs("Mixtral-8x7B", [2048])}
    counts = models.topk_counts(8, 2048, 2, 1234)
    base = sum(ol(r, 128) for r in counts)
    for name, tile_m, swap_max, _, trim in mma_waste.TAIL_DESIGNS:
        want = sum(ol(r, tile_m, mma_waste.BYTES_TILE_N, swap_max, trim) for r in counts) / base
        assert abs(by[name]["operand_bytes_vs_128"] - want) < 1e-12
    # Skipping an empty half computes less but loads the same; swapped tails load less A;
    # 64-row tiles load B twice per 128 rows.
    assert by["128, an empty 64-row half skipped"]["operand_bytes_vs_128"] == 1.0
    assert by["128, last <= 32 rows swapped"]["operand_bytes_vs_128"] < 1.0
    trimmed = by["128, tail A rows loaded to 16"]
    assert trimmed["operand_bytes_vs_128"] < 1.0
    assert trimmed["median"] == by["128-row tiles"]["median"]  # as many rows computed
    assert by["64-row tiles"]["operand_bytes_vs_128"] > 1.0


def test_swap_designs_reach_the_granularity_floor():
    floor = {f["rows_granularity"]: f for f in mma_waste.granularity_floor(
        "Mixtral-8x7B,Llama-4-Scout", [2048, 4096])}
    by = {d["unit"]: d for d in mma_waste.swap_designs("Mixtral-8x7B,Llama-4-Scout",
                                                       [2048, 4096])}
    for unit in (8, 16):
        assert by[unit]["cases"] == floor[unit]["cases"] == 8
        assert abs(by[unit]["median"] - floor[unit]["median"]) < 1e-12
    counts = models.topk_counts(16, 2048, 1, 1234)  # Llama-4-Scout, top-1
    swapped = sum(rows + mma_waste.SWAP_TILE_COLS for r in counts
                  for rows in sched.even_row_split(r, 256, 16)) / mma_waste.SWAP_TILE_COLS
    plain = sum(mma_waste.operand_rows_loaded(r, 128) for r in counts) / mma_waste.BYTES_TILE_N
    assert swapped < plain  # fewer operand bytes per weight column than 128-row tiles


def test_bad_models_or_tokens_are_one_line(capsys):
    # (a bare ValueError traceback before)
    for argv in (["--models", "nosuch"], ["--tokens", "abc"], ["--tokens", "0"]):
        assert mma_waste.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, (argv, err)
