"""benchmarks.router_logits on the CPU: the harness end to end (the CPU takes the widened GEMM
for both rows, so they must agree exactly) and its argument errors."""

from __future__ import annotations

import json

from benchmarks import router_logits as rl


def test_smoke_run_writes_rows(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert rl.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "router-logits" and doc["device"] == "cpu"
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * len(rl.SHAPES)  # two token counts, two implementations
    assert {r["impl"] for r in rows} == {rl.OURS, rl.WIDENED}
    for r in rows:
        assert r["same_experts"] == 1.0 and r["max_abs_err"] < 1e-4
        assert r["us"] > 0 and r["ratio"] > 0
    assert "same experts" in capsys.readouterr().out


def test_bad_tokens_are_an_error(capsys):
    for bad in ("1k", "0", "", "16,-1"):
        assert rl.main(["--smoke", "--tokens", bad]) == 2
        assert "--tokens takes comma-separated positive integers" in capsys.readouterr().err
