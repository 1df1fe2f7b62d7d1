"""grouped_gemm's per-call operand scan in C++ (native/scan_general.cc), built on first use.

The list API reads every tensor's dtype, device, shape, strides and address on every call. In
Python that is six attribute calls per tensor (~1.2 us per problem on an H200 host, the
largest part of a grouped_gemm call); the C++ scan reads the same fields from one DLPack
conversion per tensor, done by TVM-FFI (the CuTe DSL's own dependency) in C.

The module is compiled once per machine with the system C++ compiler (`$CXX`, else `c++`)
against TVM-FFI's headers and stable C ABI (no torch headers: ~3 s), into
`<cache dir>/native/<hash of source, TVM-FFI version, compiler>/`, written under a temporary
name and renamed into place. Without a compiler, or with MOE_GEMM_NATIVE=0, grouped_gemm uses
the Python scan (kernels/support.fast_general), which accepts and rejects exactly the same
inputs (tests/kernels/test_native.py compares the two); `status()` says which one runs and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..cache import cache_root
from ..env import env_switch
from ..validation import GroupedGemmArgs
from .support import MAX_PROBLEMS, GeneralLayout

SOURCE = Path(__file__).parent / "native" / "scan_general.cc"
ROWS = 7  # a_ptr, b_ptr, a_ld, b_ld, M, N, K (scan_general.cc's Row enum)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # scan_general.cc's dtype index
_DTYPE_INDEX = {d: i for i, d in enumerate(_DTYPES)}

SIZES_CACHE_ENTRIES = 1024
_sizes: dict[bytes, tuple[tuple[int, int, int], ...]] = {}
_lock = threading.Lock()
_state: dict[str, object] = {}
_devices: dict[int, torch.device] = {}


def _enabled() -> bool:
    return env_switch("MOE_GEMM_NATIVE")


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    return cxx if cxx else shutil.which("c++") or shutil.which("g++")


def _build(cxx: str) -> Path:
    import tvm_ffi
    from tvm_ffi import libinfo

    src = SOURCE.read_bytes()
    tag = hashlib.sha256(
        src + f"|{tvm_ffi.__version__}|{cxx}|{sys.platform}".encode()).hexdigest()[:16]
    out_dir = cache_root() / "native" / tag
    lib = out_dir / "scan_general.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    lib_dir = os.path.dirname(libinfo.find_libtvm_ffi())
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
           f"-I{libinfo.find_include_path()}", f"-I{libinfo.find_dlpack_include_path()}",
           str(SOURCE), f"-L{lib_dir}", "-ltvm_ffi", f"-Wl,-rpath,{lib_dir}", "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, lib)  # atomic: a concurrent build or a killed one leaves no half file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def scan_function():
    """The loaded C++ scan, or None (status() says why); built on the first call."""
    fn = _state.get("fn", False)
    if fn is not False:
        return fn
    with _lock:
        if "fn" not in _state:
            _state["fn"] = None
            if not _enabled():
                _state["why"] = "disabled by MOE_GEMM_NATIVE=0"
            elif (cxx := _compiler()) is None:
                _state["why"] = "no C++ compiler (set CXX or install g++)"
            else:
                try:
                    import tvm_ffi

                    _state["fn"] = tvm_ffi.load_module(str(_build(cxx)))["scan_general"]
                    _state["why"] = None
                except Exception as exc:  # noqa: BLE001 - the Python scan still works
                    _state["why"] = f"build or load failed: {exc}"
    return _state["fn"]


@contextlib.contextmanager
def python_scan() -> Iterator[None]:
    """Within the block grouped_gemm uses the Python scan, as on a machine without a C++
    compiler (benchmarks and tests compare the two in one process; not thread-safe)."""
    saved = _state.get("fn", False)
    _state["fn"] = None
    try:
        yield
    finally:
        if saved is False:
            _state.pop("fn", None)
        else:
            _state["fn"] = saved


def status() -> str:
    """'native' or 'python (<why>)': which scan grouped_gemm uses here."""
    fn = scan_function()
    return "native" if fn is not None else f"python ({_state.get('why')})"


def _device(index: int) -> torch.device:
    dev = _devices.get(index)
    if dev is None:
        dev = _devices[index] = torch.device("cuda", index)
    return dev


def _kernels_run_on(a) -> bool:
    from ..capability import cute_problem

    a0 = a[0] if a else None
    return type(a0) is torch.Tensor and a0.is_cuda and cute_problem(a0.device) is None


def native_general(a: object, b: object, out_dtype: torch.dtype | None, *,
                   require_cuda: bool = True) -> tuple[GroupedGemmArgs, GeneralLayout] | None:
    """support.fast_general's result from the C++ scan, or None where it declines (anything
    outside the common case, mixed B layouts included) or is unavailable: the caller then
    runs the Python scan, which handles those cases or names the error."""
    if type(a) not in (list, tuple) or type(b) not in (list, tuple):
        return None
    fn = _state.get("fn", False)
    if fn is False:
        # First use: build only where the kernels run (a CPU-only caller never pays it).
        if require_cuda and not _kernels_run_on(a):
            return None
        fn = scan_function()
    if fn is None:
        return None
    G = len(a)
    if G == 0 or G > MAX_PROBLEMS or len(b) != G:
        return None
    # Plain tensors only, as in the Python scan (a subclass may not own plain memory).
    Tensor = torch.Tensor
    types = set(map(type, a))
    types.update(map(type, b))
    if len(types) != 1 or Tensor not in types:
        return None
    if out_dtype is not None and type(out_dtype) is not torch.dtype:
        return None  # validation names what is expected
    odt = -1 if out_dtype is None else _DTYPE_INDEX.get(out_dtype, -9)
    if odt == -9:
        return None
    cols = np.empty((ROWS, G), dtype=np.int64)
    try:
        code = fn(a, b, odt, 1 if require_cuda else 0, cols)
    except Exception:  # noqa: BLE001 - e.g. a tensor DLPack cannot export: Python decides
        return None
    if code < 0:
        return None
    dtype = _DTYPES[code & 15]
    device = _device(code >> 4 & 255) if require_cuda else a[0].device
    # The (M, N, K) tuples of a problem set seen before, by the bytes of its size columns: a
    # serving loop repeats a few sets, and building G tuples costs ~0.2 us per problem.
    size_key = cols[4:].tobytes()
    sizes = _sizes.get(size_key)
    if sizes is None:
        if len(_sizes) >= SIZES_CACHE_ENTRIES:
            _sizes.clear()
        sizes = _sizes[size_key] = tuple(zip(cols[4].tolist(), cols[5].tolist(),
                                             cols[6].tolist()))
    args = GroupedGemmArgs.trusted(list(a), list(b), dtype,
                                   dtype if out_dtype is None else out_dtype, device, sizes)
    layout = GeneralLayout(cols[0], cols[2], cols[1], cols[3], "k" if code >> 20 & 1 else "n", [],
                           packed=cols[:4])
    return args, layout
