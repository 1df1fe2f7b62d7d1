"""Shared pytest setup: the `gpu` marker skips unless an sm90 GPU and the CuTe DSL are here."""

from __future__ import annotations

import pytest
import torch


def _gpu_problem() -> str | None:
    from moe_gemm.capability import cute_problem

    return cute_problem()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    problem = _gpu_problem()
    if problem is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {problem}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_tuned_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see the rules, whatever tuned tables this machine's device has (a shipped table or
    an online-autotune cache would change which kernel a default config picks); the tests of
    the tables re-enable them on tables of their own."""
    monkeypatch.setenv("MOE_GEMM_TUNED_TABLES", "0")


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same RNG state; tests draw fresh random data from it."""
    torch.manual_seed(0)
