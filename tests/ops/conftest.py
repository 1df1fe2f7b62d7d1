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


@pytest.fixture
def cute_ops(kernel, monkeypatch: pytest.MonkeyPatch):
    """Every op on its Hopper path with CPU tensors (plans built and cached as on the GPU),
    each compiled kernel the recorder: the `kernel` fixture's, returned."""
    from host_fakes import NSM

    from moe_gemm.ops import (
        api,
        fused,
        fused_launch,
        fused_masked,
        masked,
        masked_launch,
        scaled,
        scaled_launch,
    )

    for module in (api, masked, scaled, fused, fused_masked):
        monkeypatch.setattr(module, "cute_problem", lambda device=None: None)
    monkeypatch.setattr(api, "_warned", set())
    monkeypatch.setattr(scaled_launch, "sm_count", lambda device: NSM)
    monkeypatch.setattr(fused_launch, "sm_count", lambda device: NSM)
    monkeypatch.setattr(scaled_launch, "_kernel", lambda key: kernel)
    monkeypatch.setattr(masked_launch, "_kernel", lambda key: kernel)
    for name in ("MOE_GEMM_CHECK_OFFS", "MOE_GEMM_TAIL_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    caches = (masked, scaled, fused, fused_masked)
    for module in caches:
        module._clear_plans()
    yield kernel
    for module in caches:
        module._clear_plans()
