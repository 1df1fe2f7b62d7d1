"""Records of a GPU run, appended as JSON lines to $MOE_GEMM_GPU_REPORT (if set) the moment
they happen, so a run that crashes midway still keeps everything it finished:

- "case": a checked result (`record`, called by the tests: errors against float32, flags);
- "test": each test's outcome and duration (pytest hooks below);
- "compile": a kernel compiled inside a test process, i.e. one the precompile step missed.

With $MOE_GEMM_GPU_COLLECT set, the node ids of the selected tests are written there as a
JSON list once collection is done (how scripts/gpu_session.py finds the GPU tests).

The hooks act only where this module is loaded as a plugin: `pytest -p tests.kernels.gpu_report`
with the repository root on PYTHONPATH, as scripts/gpu_session.py does (the name pytest itself
gives this module, so the tests' `from .gpu_report import record` is the plugin's module).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def _append(row: dict) -> None:
    path = os.environ.get("MOE_GEMM_GPU_REPORT")
    if not path:
        return
    # Strict JSON: a case's error is NaN by design where a kernel left the output unwritten
    # (NaN-poisoned), and the bare word NaN is not JSON (jq and other readers refuse the file).
    from moe_gemm.tuning.table_io import json_line

    with open(path, "a") as f:
        f.write(json_line(row, default=str) + "\n")


def _current_test() -> str | None:
    """The running test's node id (pytest sets PYTEST_CURRENT_TEST to "<nodeid> (<phase>)")."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return current.rsplit(" ", 1)[0] if current else None


def record(name: str, passed: bool, **fields: object) -> None:
    """One checked case of a test (its name, whether it passed, and numbers worth keeping)."""
    _append({"kind": "case", "name": name, "passed": bool(passed), "time": round(time.time(), 3),
             "test": _current_test(), **fields})


def _watch_compiles() -> None:
    """Wraps the kernel cache's compile step to log each compile with its test."""
    from moe_gemm.ops import kernel_cache

    original = kernel_cache.get_or_compile

    def get_or_compile(key, name, compile_fn):
        def compile_and_log():
            t = time.perf_counter()
            fn = compile_fn()
            _append({"kind": "compile", "name": name() if callable(name) else name,
                     "seconds": round(time.perf_counter() - t, 2), "test": _current_test()})
            return fn

        return original(key, name, compile_and_log)

    kernel_cache.get_or_compile = get_or_compile


def pytest_configure(config) -> None:
    if os.environ.get("MOE_GEMM_GPU_REPORT"):
        _watch_compiles()


def pytest_collection_finish(session) -> None:
    path = os.environ.get("MOE_GEMM_GPU_COLLECT")
    if path:
        from moe_gemm.tuning.table_io import write_json

        write_json(Path(path), list(dict.fromkeys(item.nodeid for item in session.items)))


def pytest_runtest_logreport(report) -> None:
    """One "test" row per test: its call outcome, or the setup/teardown error or skip."""
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.when == "setup" and report.failed:
            outcome = "error"
        else:
            outcome = report.outcome
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    else:
        return
    row = {"kind": "test", "nodeid": report.nodeid, "outcome": outcome, "when": report.when,
           "seconds": round(report.duration, 3)}
    if report.failed or report.skipped:
        row["message"] = str(getattr(report, "longreprtext", "") or report.longrepr)[-2000:]
    _append(row)
