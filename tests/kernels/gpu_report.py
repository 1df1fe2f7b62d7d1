"""Per-case records for GPU runs: appended as JSON lines to $MOE_GEMM_GPU_REPORT (if set), so a
device run that crashes midway still keeps every case it finished."""

from __future__ import annotations

import json
import os
import time


def record(name: str, passed: bool, **fields: object) -> None:
    path = os.environ.get("MOE_GEMM_GPU_REPORT")
    if not path:
        return
    row = {"name": name, "passed": bool(passed), "time": round(time.time(), 3), **fields}
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
