"""Compiled-kernel cache: in memory per process, and on disk across processes.

A CuTe DSL compile of one GroupedGemmSm90 variant takes seconds; loading an exported object
file takes about a millisecond. So a kernel is compiled once per compile key per machine:
- memory: a dict keyed by the CompileKey;
- disk: `<cache dir>/<fingerprint>/<key>.o`, written by `export_to_c` to a temporary file and
  renamed into place (a killed process never leaves a truncated object), guarded by a per-key
  file lock so parallel processes compile a key once.
The fingerprint hashes the kernel sources and the DSL / TVM-FFI versions, so editing a kernel
or upgrading the DSL never loads a stale object. Environment:
  MOE_GEMM_CACHE_DIR   where objects live (default ~/.cache/moe_gemm)
  MOE_GEMM_DISK_CACHE  0 disables the disk cache (memory cache only)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from moe_gemm.env import env_value

EXPORT_NAME = "moe_gemm_kernel"
_KERNEL_DIR = Path(__file__).parents[1] / "kernels"

_memory: dict[Any, Any] = {}
# cute.compile is not thread-safe; one compile at a time per process.
_compile_lock = threading.Lock()
stats = {"memory_hits": 0, "disk_hits": 0, "compiles": 0}


def disk_cache_enabled() -> bool:
    return bool(env_value("MOE_GEMM_DISK_CACHE"))


def cache_root() -> Path:
    root = env_value("MOE_GEMM_CACHE_DIR")
    return Path(str(root)) if root else Path.home() / ".cache" / "moe_gemm"


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """Hash of every kernel source file plus the DSL and TVM-FFI versions."""
    h = hashlib.sha256()
    for src in sorted(_KERNEL_DIR.rglob("*.py")):
        h.update(str(src.relative_to(_KERNEL_DIR)).encode())
        h.update(src.read_bytes())
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            from importlib.metadata import version

            h.update(f"{dist}={version(dist)}".encode())
        except Exception:  # noqa: BLE001 - a missing dist just changes the hash
            h.update(f"{dist}=?".encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load(path: Path) -> Any:
    import cutlass.cute as cute

    module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
    return module[EXPORT_NAME]


def get_or_compile(key: Any, name: str | Callable[[], str], compile_fn: Callable[[], Any]
                   ) -> Any:
    """The compiled kernel for `key` (name: a filesystem-safe rendering of key, or a function
    that renders it, called on a memory miss only: CompileKey.name() took ~75 us on the
    CPU-only dev machine, paid by every grouped_mm plan built for a new signature)."""
    fn = _memory.get(key)
    if fn is not None:
        stats["memory_hits"] += 1
        return fn
    with _compile_lock:
        fn = _memory.get(key)
        if fn is not None:
            return fn
        if not disk_cache_enabled():
            return _compiled_in_memory(key, compile_fn)
        if callable(name):
            name = name()
        directory = cache_root() / fingerprint()
        obj = directory / f"{name}.o"
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(_file_lock(directory / f"{name}.lock"))
            except OSError as exc:
                # A cache folder that cannot be made or written (a file in its place, a
                # read-only mount) costs the disk cache, never the call.
                _warn_unwritable(directory, exc)
                return _compiled_in_memory(key, compile_fn)
            if obj.exists():
                try:
                    fn = _load(obj)
                    stats["disk_hits"] += 1
                except Exception as exc:  # noqa: BLE001 - a bad object is a miss
                    warnings.warn(f"moe_gemm cache: reloading {obj} failed ({exc}); recompiling",
                                  RuntimeWarning, stacklevel=2)
                    obj.unlink(missing_ok=True)
                    fn = None
            if fn is None:
                stats["compiles"] += 1
                fn = compile_fn()
                tmp = obj.with_suffix(f".o.tmp{os.getpid()}")
                try:
                    fn.export_to_c(object_file_path=str(tmp), function_name=EXPORT_NAME)
                    os.replace(tmp, obj)
                except Exception as exc:  # noqa: BLE001 - export is an optimisation
                    tmp.unlink(missing_ok=True)
                    warnings.warn(f"moe_gemm cache: could not write {obj} ({exc})",
                                  RuntimeWarning, stacklevel=2)
        _memory[key] = fn
        return fn


def _compiled_in_memory(key: Any, compile_fn: Callable[[], Any]) -> Any:
    stats["compiles"] += 1
    fn = compile_fn()
    _memory[key] = fn
    return fn


_warned_dirs: set[Path] = set()


def _warn_unwritable(directory: Path, exc: OSError) -> None:
    if directory not in _warned_dirs:
        _warned_dirs.add(directory)
        warnings.warn(f"moe_gemm cache: cannot use {directory} ({exc}); compiled kernels are "
                      "kept in memory only (set MOE_GEMM_CACHE_DIR to a writable folder, or "
                      "MOE_GEMM_DISK_CACHE=0)", RuntimeWarning, stacklevel=3)


def clear_memory() -> None:
    """Forgets the loaded kernels (ops/launch_kernel._kernel_for keeps its own per-choice
    memo of those already looked up: they stay valid)."""
    _memory.clear()


def kernel_constants(kernel: object, *tensors: torch.Tensor) -> tuple:
    """A plan's constant tensor arguments (placeholders, metadata uploads) in the form the
    kernel call takes fastest.

    A compiled kernel is a TVM-FFI function, which converts every torch tensor argument
    through DLPack at every call (~0.1 us each on the CPU-only dev machine, a few times that on
    a GPU host); a tvm_ffi.Tensor made once from the same tensor (it keeps the tensor alive)
    is passed as is, and the kernel sees the same DLTensor. The launch stream still comes
    from the call's torch tensors (TVM-FFI takes the current stream of the first CUDA one), so
    every launch keeps at least one as a torch tensor: its operands or its workspace.
    Anything else (a test's recorder) gets the torch tensors, as does a torch without the
    C DLPack exchange API (a conversion then goes through Python and may synchronize).
    """
    ffi = sys.modules.get("tvm_ffi")
    if (ffi is None or not isinstance(kernel, ffi.Function)
            or not hasattr(torch.Tensor, "__dlpack_c_exchange_api__")):
        return tensors
    return tuple(ffi.from_dlpack(t) for t in tensors)
