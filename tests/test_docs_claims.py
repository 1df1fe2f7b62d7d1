"""Claims of the user documentation that the code can contradict later, checked without a
server or a GPU: the rejection reasons the metrics count, and the results files the pages name.
"""

from __future__ import annotations

import json
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


def test_expert_parallel_numbers_match_their_results_file():
    # docs/DEPLOYING.md quotes the two-GPU run's range of forward time over the one-GPU
    # experts' time (comm_overhead) and of the shared expert's overlap from 4096 tokens.
    text = re.sub(r"-\s*\n\s*", "-", (REPO / "docs" / "DEPLOYING.md").read_text())
    m = re.search(r"results/(expert-parallel-[A-Za-z0-9_.-]+\.json)`\)\s+the forward took\s+"
                  r"([\d.]+)-([\d.]+)x.*?hidden behind dispatch\s+(\d+)-(\d+)% from (\d+) tokens",
                  text, re.S)
    assert m, "docs/DEPLOYING.md no longer quotes the expert-parallel run as this test expects"
    rows = json.loads((REPO / "benchmarks" / "results" / m[1]).read_text())["rows"]
    overhead = [r["comm_overhead"] for r in rows]
    assert (float(m[2]), float(m[3])) == (round(min(overhead), 2), round(max(overhead), 2))
    overlap = [r["overlap"] for r in rows if r["tokens_per_rank"] >= int(m[6])]
    assert (int(m[4]), int(m[5])) == (round(100 * min(overlap)), round(100 * max(overlap)))
