"""Claims of the user documentation that the code can contradict later, checked without a
server or a GPU: the rejection reasons the metrics count, and the results files the pages name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "server" / "moe_gemm_server"
PAGES = ["README.md", "server/README.md", "client/README.md", "docker/README.md",
         "benchmarks/README.md", "moe_gemm/tables/README.md",
         *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")
                 if p.name != "measurements.md")]


def _rejection_reasons() -> set[str]:
    """Every label the server's code passes to moe_gemm_rejections_total."""
    reasons: set[str] = set()
    for src in SERVER.rglob("*.py"):
        reasons |= set(re.findall(r'rejections\.labels\("([a-z_]+)"\)', src.read_text()))
    return reasons


def test_rejection_reasons_found_in_code():
    # A guard for the parser above: these are labels the service has always counted.
    assert {"queue_full", "timeout", "draining", "not_ready"} <= _rejection_reasons()


@pytest.mark.parametrize("page", ["docs/HTTP-API.md", "server/README.md"])
def test_every_rejection_reason_is_documented(page):
    text = (REPO / page).read_text()
    missing = sorted(r for r in _rejection_reasons() if f"{r}" not in text)
    assert not missing, f"{page} does not list the rejection reasons {missing}"


@pytest.mark.parametrize("page", PAGES)
def test_named_results_files_exist(page):
    # A path wrapped at a hyphen ("...-80gb-\nhbm3-...") is joined back first.
    text = re.sub(r"-\s*\n\s*", "-", (REPO / page).read_text())
    names = set(re.findall(r"results/([A-Za-z0-9_.-]+\.(?:json|png))", text))
    missing = sorted(n for n in names if not (REPO / "benchmarks" / "results" / n).is_file())
    assert not missing, f"{page} names results files that are not in benchmarks/results/: {missing}"
