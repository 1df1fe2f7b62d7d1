"""Fixtures for the client tests (helpers live in moe_client_testutils.py)."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client reads MOE_GEMM_BASE_URL / MOE_GEMM_API_KEY; tests start without them."""
    monkeypatch.delenv("MOE_GEMM_BASE_URL", raising=False)
    monkeypatch.delenv("MOE_GEMM_API_KEY", raising=False)
