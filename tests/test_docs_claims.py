"""Claims of the user documentation that the code can contradict later, checked without a
server or a GPU: the rejection reasons the metrics count, and the results files the pages name.
"""

from __future__ import annotations

import ast
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


def _rejection_calls() -> tuple[set[str], set[str]]:
    """(reasons, indirect): every reason the server's code counts in moe_gemm_rejections_total,
    and the functions ("file:function") that pass it a label other than a string literal.

    A reason reaches the counter as `rejections.labels("reason")`, through
    `Batcher.cancel(job, "reason")`, or as an answer's `reason="..."` (an APIError's, counted
    when the app sends it: main.py's `_api_error`); those two `labels(reason)` are the only
    indirect calls."""
    reasons: set[str] = set()
    indirect: set[str] = set()
    for src in sorted(SERVER.rglob("*.py")):
        tree = ast.parse(src.read_text())
        owner = {child: fn.name for fn in ast.walk(tree)
                 if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for child in ast.walk(fn)}  # (inner functions come later: they win)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            f, args = node.func, node.args
            if (f.attr == "labels" and isinstance(f.value, ast.Attribute)
                    and f.value.attr == "rejections"):
                if (len(args) == 1 and isinstance(args[0], ast.Constant)
                        and isinstance(args[0].value, str)):
                    reasons.add(args[0].value)
                else:
                    indirect.add(f"{src.name}:{owner.get(node, '<module>')}")
            elif (f.attr == "cancel" and len(args) == 2 and isinstance(args[1], ast.Constant)
                  and isinstance(args[1].value, str)):
                reasons.add(args[1].value)  # Batcher.cancel(job, reason)
        for node in ast.walk(tree):  # APIError(..., reason="..."), unavailable(..., reason=)
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "reason":
                        reasons |= _constants(kw.value)
    return reasons, indirect


def _constants(node: ast.expr) -> set[str]:
    """The string constants an expression can be: "a", or "a" if ... else "b"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _constants(node.body) | _constants(node.orelse)
    return set()


def _rejection_reasons() -> set[str]:
    return _rejection_calls()[0]


def _documented_reasons(text: str) -> list[str] | None:
    """The reasons a page lists in the parentheses after moe_gemm_rejections_total{reason},
    None if it has no such list."""
    m = re.search(r"moe_gemm_rejections_total\s*\{reason\}`?\s*\(([^)]*)\)", text)
    return None if m is None else [r.strip().strip("`") for r in m[1].split(",")]


def test_rejection_reasons_found_in_code():
    # A guard for the parser above: these are labels the service has always counted, two of
    # them ("disconnected", "cancelled") only through Batcher.cancel.
    reasons, indirect = _rejection_calls()
    assert {"queue_full", "timeout", "draining", "not_ready", "disconnected",
            "cancelled"} <= reasons
    # A label passed any other way would escape the parser, and its reason the docs check.
    assert indirect == {"batcher.py:cancel", "main.py:_api_error"}, (
        f"rejection labels the parser cannot read (teach _rejection_calls the new path): "
        f"{sorted(indirect)}")


@pytest.mark.parametrize("page", ["docs/HTTP-API.md", "server/README.md"])
def test_every_rejection_reason_is_documented(page):
    # The page's list itself, compared both ways: a reason's name found anywhere else on the
    # page ("timeout", "cancelled" are common words) does not document it.
    listed = _documented_reasons((REPO / page).read_text())
    assert listed is not None, f"{page} has no list after moe_gemm_rejections_total{{reason}}"
    assert all(re.fullmatch(r"[a-z_]+", r) for r in listed), (
        f"{page}'s list of rejection reasons should hold only their names; got {listed}")
    reasons = _rejection_reasons()
    missing = sorted(reasons - set(listed))
    assert not missing, f"{page} does not list the rejection reasons {missing}"
    stale = sorted(set(listed) - reasons)
    assert not stale, f"{page} lists rejection reasons the server never counts: {stale}"


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
