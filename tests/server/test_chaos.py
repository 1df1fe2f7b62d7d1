"""scripts/chaos.py in CI: kill -9 under load, restarts, racing uploads and slow clients
against a real server process; no request may be lost or answered wrong, and no acknowledged
weight set may be lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~30 s on the 2-core CI machine: three server starts and 12 s of load
def test_chaos_run_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_GEMM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "server"), str(REPO / "client")])
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "chaos.py"), "--duration", "12", "--kills", "2",
         "--clients", "3", "--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    print(proc.stdout)
    assert out.exists(), proc.stdout + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["lost"] == 0 and report["wrong"] == 0, report["samples"]
    assert report["kills"] == 2 and report["restarts"] == 2
    assert not report["durability_failures"] and not report["contended_failures"], report
    # every request got an answer: right, or refused with a clear status
    assert report["answered_right"] + report["refused_total"] == report["sent"]
    assert report["answered_right"] > 50 and report["uploads_acked"] > 3
    assert report["durability_checks"] >= 4 and report["contended_bursts"] >= 1
    assert report["slow_clients_right"] >= 1 and report["stalled_connections"] >= 1
    assert report["final_exit_code"] == 0  # the last server drained and exited cleanly
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
