"""benchmarks/bench_expert_parallel.py as a CPU smoke run: two gloo ranks, tiny sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_the_results_json(tmp_path: Path) -> None:
    out = tmp_path / "ep.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_expert_parallel.py"), "--smoke",
         "--world", "2", "--tokens", "8,24", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["device"] and res["date"]
    assert res["dist_backend"] == "gloo"
    assert [r["tokens_per_rank"] for r in res["rows"]] == [8, 24]
    for row in res["rows"]:
        for phase in ("route", "dispatch", "shared", "experts", "combine", "total", "baseline"):
            assert row[f"{phase}_us"] > 0, (phase, row)
        assert row["overlap"] is None or 0.0 <= row["overlap"] <= 1.0
        # top-4 of 16 experts over 2 ranks: a rank receives at most every token of both ranks
        assert 0 < row["max_received_tokens"] <= 2 * row["tokens_per_rank"]
    # the expert-parallel output equals the whole layer's (float32 on CPUs)
    assert res["check"]["ok"], res["check"]
