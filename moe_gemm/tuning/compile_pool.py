"""Compile many kernel variants at once: a process pool writing into the disk cache.

A CuTe DSL compile takes seconds and holds the process's compile lock, so the tuner (and the
benchmark's warm-up) hands the variants it is about to run to worker processes, each of which
compiles one variant into the disk cache (moe_gemm.ops.kernel_cache: MOE_GEMM_CACHE_DIR, keyed
by the kernel sources' fingerprint) and returns. The parent then loads each object file in
about a millisecond. Workers never touch the GPU (CUTE_DSL_ARCH=sm_90a), are started with
"spawn" (the parent's CUDA context must not be forked) and inherit the environment.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing
import os
import time
from collections.abc import Iterable
from typing import Any


def _compile_one(fields: dict[str, Any]) -> tuple[str, float, str | None]:
    """Worker: compile one CompileKey (given as its fields) into the disk cache."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from moe_gemm.kernels.sm90.compile import CompileKey, compile_variant
    from moe_gemm.ops import kernel_cache

    key = CompileKey(**fields)
    t0 = time.perf_counter()
    try:
        kernel_cache.get_or_compile(key, key.name, lambda: compile_variant(key))
    except Exception as exc:  # noqa: BLE001 - the caller drops the variant and says why
        return key.name(), time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:400]
    return key.name(), time.perf_counter() - t0, None


def default_workers() -> int:
    """One per core but two (the parent times kernels meanwhile), at least one."""
    return max(1, (os.cpu_count() or 2) - 2)


class CompilePool:
    """Compiles CompileKeys in worker processes; `wait` returns each key's error or None.

    Without the disk cache (MOE_GEMM_DISK_CACHE=0) there is nothing to share between
    processes: every key is compiled in the calling process instead."""

    def __init__(self, workers: int | None = None) -> None:
        from moe_gemm.ops.kernel_cache import disk_cache_enabled

        self.workers = workers or default_workers()
        self.inline = not disk_cache_enabled() or self.workers <= 1
        self._pool: cf.ProcessPoolExecutor | None = None
        self._futures: dict[Any, cf.Future] = {}
        self.errors: dict[Any, str | None] = {}
        self.seconds = 0.0  # summed compile time reported by the workers

    def _executor(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def submit(self, keys: Iterable[Any]) -> None:
        """Start compiling `keys` (CompileKeys) not already started."""
        if self.inline:
            return
        for key in keys:
            if key not in self._futures and key not in self.errors:
                self._futures[key] = self._executor().submit(
                    _compile_one, dataclasses.asdict(key))

    def wait(self, keys: Iterable[Any], timeout_s: float | None = None) -> dict[Any, str | None]:
        """Each key's compile error (None: compiled), waiting at most `timeout_s` in all; a
        key still compiling then reports a timeout."""
        keys = list(dict.fromkeys(keys))
        if self.inline:
            for key in keys:
                if key not in self.errors:
                    _, seconds, err = _compile_one(dataclasses.asdict(key))
                    self.seconds += seconds
                    self.errors[key] = err
            return {k: self.errors[k] for k in keys}
        self.submit(keys)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for key in keys:
            if key in self.errors:
                continue
            fut = self._futures[key]
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                _, seconds, err = fut.result(timeout=left)
                self.seconds += seconds
            except cf.TimeoutError:
                continue  # still compiling: reported below; a later wait may collect it
            except Exception as exc:  # noqa: BLE001 - a dead worker: that key failed
                err = f"compile worker failed: {type(exc).__name__}: {exc}"[:400]
            self.errors[key] = err
            self._futures.pop(key, None)
        return {k: self.errors.get(k, f"compile still running after {timeout_s} s")
                for k in keys}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
