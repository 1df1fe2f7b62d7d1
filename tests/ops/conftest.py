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


TEST_DEVICE = "NVIDIA Test GPU 80GB"


@pytest.fixture
def online_entry(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """A function that makes `entry` the only tuned result the lookup can find: written to
    the online autotune results on disk under MOE_GEMM_CACHE_DIR=tmp_path/cache for a test
    device (no shipped table, no user table, the table switches unset); returns that cache
    folder. The tables' and heuristics' caches are cleared before and after."""
    import json

    from moe_gemm.ops import heuristics, launch_kernel, tuned, versions

    def install_entry(entry: dict):
        monkeypatch.setattr(launch_kernel, "_table_device", lambda device: TEST_DEVICE)
        cache = tmp_path / "cache"
        monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(cache))
        for name in ("MOE_GEMM_DISK_CACHE", tuned.TABLES_ENV, tuned.USER_TABLE_ENV):
            monkeypatch.delenv(name, raising=False)
        shipped = tmp_path / "shipped"
        shipped.mkdir()
        monkeypatch.setattr(tuned, "TABLES_DIR", shipped)
        online = tuned.online_path(TEST_DEVICE)
        online.parent.mkdir(parents=True)
        online.write_text(json.dumps({"format": tuned.FORMAT, "device": TEST_DEVICE,
                                      "sm_count": 132,
                                      "versions": versions.runtime_versions(TEST_DEVICE),
                                      "entries": [entry]}))
        tuned.clear_caches()
        heuristics.clear_caches()
        return cache

    yield install_entry
    tuned.clear_caches()
    heuristics.clear_caches()
