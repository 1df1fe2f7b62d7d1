"""moe_gemm/cache.py: the compiled-kernel cache's lookups (memory, disk, compile), with fake
compiled objects (a real compile is `moe-gemm check`'s job)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from moe_gemm.ops import kernel_cache as cache


class FakeKernel:
    """Stands in for a compiled function: export_to_c writes an object file."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def export_to_c(self, object_file_path: str, function_name: str) -> None:
        Path(object_file_path).write_text(f"{function_name}:{self.tag}")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setattr(cache, "_memory", {})
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MOE_GEMM_DISK_CACHE", raising=False)
    return tmp_path


def test_memory_hit_renders_no_name_and_compiles_nothing(fresh: Path) -> None:
    names, compiles = [], []

    def name() -> str:
        names.append(1)
        return "k1"

    def compile_fn() -> FakeKernel:
        compiles.append(1)
        return FakeKernel("a")

    first = cache.get_or_compile(("k", 1), name, compile_fn)
    assert (len(names), len(compiles)) == (1, 1)
    assert (fresh / cache.fingerprint() / "k1.o").read_text() == f"{cache.EXPORT_NAME}:a"
    again = cache.get_or_compile(("k", 1), name, compile_fn)
    assert again is first and (len(names), len(compiles)) == (1, 1)


def test_name_may_be_a_string_and_disk_cache_can_be_off(fresh: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_GEMM_DISK_CACHE", "0")
    k = cache.get_or_compile(("k", 2), "k2", lambda: FakeKernel("b"))
    assert k.tag == "b" and not (fresh / cache.fingerprint()).exists()
    monkeypatch.setenv("MOE_GEMM_DISK_CACHE", "1")
    k3 = cache.get_or_compile(("k", 3), "k3", lambda: FakeKernel("c"))
    assert k3.tag == "c" and (fresh / cache.fingerprint() / "k3.o").exists()


def test_a_disk_object_is_loaded_not_recompiled(fresh: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache.get_or_compile(("k", 4), "k4", lambda: FakeKernel("d"))
    monkeypatch.setattr(cache, "_memory", {})  # a new process: only the disk remembers
    loaded = []
    monkeypatch.setattr(cache, "_load", lambda path: loaded.append(path) or FakeKernel("disk"))

    def must_not_compile() -> FakeKernel:
        raise AssertionError("compiled although the object was on disk")

    k = cache.get_or_compile(("k", 4), lambda: "k4", must_not_compile)
    assert k.tag == "disk" and loaded == [fresh / cache.fingerprint() / "k4.o"]


def test_a_cache_folder_that_cannot_be_written_costs_the_disk_cache_not_the_call(
        fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A file where the folder should be (or a read-only mount): the lock file cannot be made.
    # The kernel call raised NotADirectoryError; now it compiles into memory, warning once.
    blocker = fresh / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("MOE_GEMM_CACHE_DIR", str(blocker))
    monkeypatch.setattr(cache, "_warned_dirs", set())
    with pytest.warns(RuntimeWarning, match="kept in memory only"):
        k = cache.get_or_compile(("k", 5), "k5", lambda: FakeKernel("e"))
    assert k.tag == "e"
    assert cache.get_or_compile(("k", 5), "k5", lambda: FakeKernel("other")) is k
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second kernel compiles without a second warning
        assert cache.get_or_compile(("k", 6), "k6", lambda: FakeKernel("f")).tag == "f"
