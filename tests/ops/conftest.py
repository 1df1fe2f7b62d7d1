"""Fixtures of the kernel-layer tests."""

from __future__ import annotations

import pytest
from host_fakes import Recorder, clear_caches, install


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """The launch modules on the CPU, the compiled kernel replaced by a recorder; caches
    cleared."""
    rec = Recorder()
    clear_caches()
    install(monkeypatch, rec)
    yield rec
    clear_caches()
