"""grouped_gemm's per-call host work and grouped_mm's repeated calls in C++ (native/), built in
the background.

grouped_mm (native/mm_call.h): a call that Python has launched through a cached plan on this
stream and thread gets an entry (remember_mm); later calls with the same shapes, strides,
dtypes, devices, alignment, config and switches are launched from it (mm_call): the output
from at::empty and the kernel through TVM-FFI's C ABI (native/ffi_call.h), 6.5-9.5 us per
call on H200 hosts against ~13 through Python (session 12).

A grouped_gemm call on lists reads every operand (dtype, device, shape, strides, address),
allocates G outputs and launches. In Python that is ~1.2 us per problem plus ~0.9 us per output
view on an H200 host; the C++ module reads the at::Tensors directly, makes the outputs as plain
tensors on one fresh allocation, and launches without entering the Python host wrapper: a
repeated call from a cached record (the uploaded metadata for the same operand addresses, the
serving loop), new operand addresses of a known problem set from its template on that stream
(metadata rows filled in C++ and copied up through a pinned ring per stream, native/upload_ring.h;
a record of their own when they come back). Only a problem set's
first launch on a stream and thread comes here (_first_calls). See general_call.cc for the
caches and what they key on.

It is compiled once per machine and torch/Python version with the system C++ compiler
(`$CXX`, else `c++`) against torch's and Python's headers (~10-20 s), into
`<cache dir>/native/<hash>/`, written under a temporary name and renamed into place. The build
starts in a background thread on the first grouped_gemm call where the kernels run (or on
`wait()` / `status()`); until it is loaded, and without a compiler or Python headers, or with
MOE_GEMM_NATIVE=0, grouped_gemm uses the Python scan (kernels/support.fast_general), which
accepts the same problem sets (tests/kernels/test_native.py compares them on random sets); the
C++ side also declines mixed B layouts (copied per call in Python) and tensors or thread states
that only torch should handle (functorch transforms, dispatch modes).
`status()` says which one runs and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialized across processes
    fcntl = None  # type: ignore[assignment]

from ..cache import cache_root
from ..capability import cute_problem
from ..config import DEFAULT_CONFIG, GemmConfig
from ..env import env_get, env_switch
from ..validation import GroupedGemmArgs
from .support import MAX_PROBLEMS, GeneralLayout

SOURCE = Path(__file__).parent / "native" / "general_call.cc"
HEADERS = tuple(Path(__file__).parent / "native" / h  # included by SOURCE
                for h in ("upload_ring.h", "ffi_call.h", "mm_call.h"))
MODULE_NAME = "_moe_gemm_native"  # general_call.cc's PyInit__moe_gemm_native
ROWS = 7  # a_ptr, b_ptr, a_ld, b_ld, M, N, K (general_call.cc's Row enum)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # general_call.cc's dtype index
_DTYPE_INDEX = {d: i for i, d in enumerate(_DTYPES)}
BUILD_TIMEOUT_S = 600

SIZES_CACHE_ENTRIES = 1024
_sizes: dict[bytes, tuple[tuple[int, int, int], ...]] = {}
_lock = threading.Lock()
# "thread": the build; "why": None once loaded, else why the Python scan runs.
_state: dict[str, object] = {}
_mod = None  # the loaded module (read on every grouped_gemm call)
_host = None  # kernels.host_sm90, bound when the module loads (no import on the hot path)
_paused = 0  # python_scan() blocks open
_devices: dict[int, torch.device] = {}
_CPU = torch.device("cpu")
# GemmConfigs by value: the module keys a config by identity, so equal configs made per call
# share one entry (hashing a frozen dataclass ~1 us; config=None, the default, skips it).
_configs: dict[object, object] = {}
CONFIGS_KEPT = 256
REQUIRE_CUDA, PDL_FLAG = 1, 2  # general_call.cc's kRequireCuda, kPdl


def _enabled() -> bool:
    return env_switch("MOE_GEMM_NATIVE")


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    return cxx if cxx else shutil.which("c++") or shutil.which("g++")


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """One build per cache dir across processes (ranks of one job start together): the
    others wait here, then find the library."""
    if fcntl is None:
        yield
        return
    with open(out_dir / "build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _python_include() -> Path:
    return Path(sysconfig.get_paths()["include"])


def _build(cxx: str) -> Path:
    torch_dir = Path(torch.__file__).parent
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    src = SOURCE.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    # The torch build (git hash) and install path, not only its version: the module links
    # against that libtorch's C++ ABI.
    tag = hashlib.sha256(
        src + f"|{torch.__version__}|{torch.version.git_version}|{torch_dir}|{sys.version}|"
              f"{cxx}|{sys.platform}|{abi}".encode()).hexdigest()[:16]
    out_dir = cache_root() / "native" / tag
    lib = out_dir / f"{MODULE_NAME}{suffix}"
    if lib.exists():
        return lib
    if not (_python_include() / "Python.h").exists():
        raise RuntimeError(f"no Python headers at {_python_include()} (install python3-dev)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        if lib.exists():  # another process built it while this one waited
            return lib
        lib_dir = torch_dir / "lib"
        fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=out_dir)
        os.close(fd)
        cmd = [*shlex.split(cxx), "-O2", "-DNDEBUG", "-std=c++17", "-shared", "-fPIC",
               "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{_python_include()}", f"-I{torch_dir / 'include'}", str(SOURCE),
               f"-L{lib_dir}", "-lc10", "-ltorch_cpu", "-ltorch_python", "-ldl",
               f"-Wl,-rpath,{lib_dir}", "-o", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
            os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide it from other users of the cache
            os.replace(tmp, lib)  # atomic: a concurrent or killed build leaves no half file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


def _load(lib: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(lib))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(lib), loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    global _host
    from . import host_sm90

    _host = host_sm90
    capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
    mod.init(capturing if torch.cuda.is_available() else None, host_sm90._local)
    _init_ffi(mod)
    return mod


def _init_ffi(mod) -> bool:
    """The TVM-FFI C entry points for grouped_mm's C++ launches (mm_call.h); without them
    (no tvm_ffi, or a layout this code does not know) entries call the kernel from Python."""
    try:
        from tvm_ffi import libinfo

        return bool(mod.init_ffi(str(libinfo.find_libtvm_ffi())))
    except Exception:  # noqa: BLE001 - the Python call still works
        return False


def _build_and_load() -> None:
    global _mod
    why: str | None
    mod = None
    if not _enabled():
        why = "disabled by MOE_GEMM_NATIVE=0"
    elif (cxx := _compiler()) is None:
        why = "no C++ compiler (set CXX or install g++)"
    else:
        try:
            mod = _load(_build(cxx))
            why = None
        except Exception as exc:  # noqa: BLE001 - the Python scan still works
            why = f"build or load failed: {exc}"
    with _lock:
        _state["why"] = why
        _state["module"] = mod
        if why is None and not _paused:
            _mod = mod


def _after_fork_in_child() -> None:
    """A fork during the build leaves the child without the build thread (and maybe with the
    lock held by it): start over in the child on the next use."""
    global _lock
    _lock = threading.Lock()
    if "why" not in _state:
        _state.pop("thread", None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def start() -> threading.Thread:
    """Starts the build (once per process); returns its thread."""
    with _lock:
        thread = _state.get("thread")
        if thread is None:
            thread = _state["thread"] = threading.Thread(
                target=_build_and_load, name="moe_gemm-native-build", daemon=True)
            thread.start()
    return thread  # type: ignore[return-value]


def wait(timeout: float | None = None) -> str:
    """Starts the build if needed, waits for it (at most `timeout` s); returns status()."""
    start().join(timeout)
    return status(wait=False)


def status(wait: bool = True) -> str:
    """'native', 'python (<why>)' or 'python (building)': what grouped_gemm uses here.
    By default waits for the build (status is a diagnostic)."""
    if wait:
        start().join()
    if "why" not in _state:
        return "python (building)" if "thread" in _state else "python (not built yet)"
    why = _state["why"]
    return "native" if why is None else f"python ({why})"


def loaded():
    """The loaded module (building first, synchronously, if needed), or None."""
    start().join()
    return _state.get("module")


@contextlib.contextmanager
def python_scan() -> Iterator[None]:
    """Within the block grouped_gemm uses the Python scan, as on a machine without a C++
    compiler (benchmarks and tests compare the two in one process; not thread-safe)."""
    global _mod, _paused
    with _lock:
        _paused += 1
        _mod = None
    try:
        yield
    finally:
        with _lock:
            _paused -= 1
            if not _paused:
                _mod = _state.get("module")


def forget() -> None:
    """Drops the module's cached problem sets and launch records (tests)."""
    mod = _state.get("module")
    if mod is not None:
        mod.forget()


def _device(index: int) -> torch.device:
    dev = _devices.get(index)
    if dev is None:
        dev = _devices[index] = torch.device("cuda", index)
    return dev


def _kernels_run_on(a) -> bool:
    from ..capability import cute_problem

    a0 = a[0] if type(a) in (list, tuple) and a else None
    return isinstance(a0, torch.Tensor) and a0.is_cuda and cute_problem(a0.device) is None


def _out_index(out_dtype) -> int | None:
    if out_dtype is None:
        return -1
    if type(out_dtype) is not torch.dtype:
        return None  # validation names what is expected
    return _DTYPE_INDEX.get(out_dtype)


def general_call(a: object, b: object, out_dtype: torch.dtype | None, config: object, *,
                 require_cuda: bool = True) -> list[torch.Tensor] | None:
    """grouped_gemm(a, b) launched through the C++ module: its outputs, or None where the
    module declines (anything outside the common case, grad-requiring operands under grad
    mode, CUDA-graph capture, dispatch modes and functorch transforms) or is not loaded yet:
    the caller then takes the Python path.
    config: None or a GemmConfig whose backend is not "torch" (the caller checks)."""
    mod = _mod
    if mod is None:
        if "thread" not in _state and not _paused and require_cuda and _kernels_run_on(a):
            start()
        return None
    margs = _module_args(out_dtype, config, require_cuda)
    if margs is None:
        return None
    odt, config, req = margs
    res = mod.call(a, b, odt, config, req)
    if res is None or type(res) is list:
        return res
    return _first_calls(mod, res, a, b, odt, out_dtype, config, req)


def mm_call(x: object, w: object, offs: object, out: object, config: object,
            out_dtype: object, *, require_cuda: bool = True) -> torch.Tensor | bool | None:
    """grouped_mm launched from the C++ module's entry for this call (native/mm_call.h): the
    output; False where it has no entry yet (the caller's plan launches, then remember_mm);
    None where it declines or is not loaded (the Python path decides)."""
    mod = _mod
    if mod is None:
        if ("thread" not in _state and not _paused and type(x) is torch.Tensor
                and x.is_cuda and cute_problem(x.device) is None):
            start()
        return None
    margs = _module_args(out_dtype, config, require_cuda)
    if margs is None:
        return None
    odt, config, req = margs
    return mod.mm_call(x, w, offs, out, config, odt, req)


def _module_args(out_dtype: object, config: object, require_cuda: bool
                 ) -> tuple[int, object, int] | None:
    """(out dtype index, the interned config, req flags) for the module's calls; None where
    it cannot take them (validation on the Python path names what is wrong)."""
    odt = _out_index(out_dtype)
    if odt is None or (config is not None and type(config) is not GemmConfig):
        return None
    if config is not None:
        config = _configs.get(config) or _intern(config)
    return odt, config, (REQUIRE_CUDA if require_cuda else 0) | (PDL_FLAG if _host.PDL else 0)


def remember_mm(x: object, w: object, offs: object, out: object, config: object,
                out_dtype: object, plan: object, *, require_cuda: bool = True) -> bool:
    """After `plan` (host_sm90.MmPlan / BmmPlan) launched this call: the C++ entry that
    launches the same call from now on, on this stream and thread. False where the plan has
    none (host visitor, trivial sizes, views rewritten per call, a capture under way)."""
    mod = _mod
    if mod is None:
        return False
    margs = _module_args(out_dtype, config, require_cuda)
    entry = plan.native_entry() if margs is not None else None  # type: ignore[attr-defined]
    if entry is None:
        return False
    odt, config, req = margs  # type: ignore[misc]
    kernel, args, out_shape, raw = entry
    inner = getattr(kernel, "_tvm_ffi_function", None)
    handle = inner.__chandle__() if inner is not None and hasattr(inner, "__chandle__") else 0
    idx = x.device.index if require_cuda else 0  # type: ignore[attr-defined]
    stream = _host._raw_stream(idx) if require_cuda else 0
    return bool(mod.remember_mm(x, w, offs, out, config, odt, req, kernel, handle, args,
                                out_shape, _DTYPE_INDEX[plan.out_dtype], raw, stream))  # type: ignore[attr-defined]


def mm_stats() -> tuple[int, int, int] | None:
    """(entries, entries made so far, launches from entries so far), or None if not loaded."""
    mod = _state.get("module")
    return None if mod is None else mod.mm_stats()


def _intern(config: object) -> object:
    if len(_configs) >= CONFIGS_KEPT:
        _configs.clear()
    return _configs.setdefault(config, config)


def _first_calls(mod, res, a, b, odt, out_dtype, config, req):
    """A problem set seen for the first time, or its first launch on this stream and thread:
    register, then launch (later operand addresses get their launch records in C++).
    A new problem set every call (row counts that change) comes here every call: keep it lean."""
    host = _host
    require_cuda = bool(req & REQUIRE_CUDA)
    if len(res) == 2:  # a new problem set: its GeneralShape and output layout
        code, cols = res
        device = _device(code >> 4 & 255) if require_cuda else _CPU
        if require_cuda and cute_problem(device) is not None:
            return None
        sizes = tuple(zip(*np.frombuffer(cols, dtype=np.int64).reshape(ROWS, -1)[4:].tolist()))
        dtype = _DTYPES[code & 15]
        odtype = dtype if out_dtype is None else out_dtype
        shape = host.general_shape(sizes, dtype, odtype, "k" if code >> 20 & 1 else "n",
                                   config or DEFAULT_CONFIG, host.sm_count(device), False,
                                   env_get("MOE_GEMM_L2_HINTS"))
        block_shape, offsets = shape.output_layout()
        mod.remember_shape(cols, code, odt, req, config, shape, _DTYPE_INDEX[odtype],
                           block_shape, offsets, shape.static.tobytes(),
                           None if shape.order_np is None else shape.order_np.tobytes())
        res = mod.call(a, b, odt, config, req)
        if res is None or type(res) is list or len(res) == 2:
            return res if type(res) is list else None
    shape, outs, d_base, code, cols = res
    if shape.total == 0:
        return outs  # every problem empty: nothing to launch
    device = _device(code >> 4 & 255) if require_cuda else _CPU
    # The stream's raw handle: metadata uploads on it go through the module's pinned ring and
    # the driver's copy (upload_ring.h) rather than torch's, this one too.
    stream = host._raw_stream(code >> 4 & 255) if require_cuda else 0
    rows = mod.upload_rows(cols, code, odt, req, config, stream)
    if rows is None:  # the problem set was forgotten meanwhile: the rows are made here
        c = np.frombuffer(cols, dtype=np.int64).reshape(ROWS, -1)
        rows = shape.metadata(c[0], c[1], c[2], c[3]).to(device, non_blocking=True)
    record = host.general_record(shape, device, rows)
    mod.remember_launch(cols, code, odt, req, config, record, stream)
    kernel, args, raw = record
    kernel(*args, d_base)
    host._local.raw = raw
    return outs


def native_general(a: object, b: object, out_dtype: torch.dtype | None, *,
                   require_cuda: bool = True) -> tuple[GroupedGemmArgs, GeneralLayout] | None:
    """support.fast_general's result from the C++ scan, or None where it declines or is not
    loaded (the tests compare the two scans with it; grouped_gemm uses general_call)."""
    mod = _mod
    if mod is None or type(a) not in (list, tuple) or type(b) not in (list, tuple):
        return None
    G = len(a)
    if G == 0 or G > MAX_PROBLEMS or len(b) != G:
        return None
    odt = _out_index(out_dtype)
    if odt is None:
        return None
    res = mod.scan(a, b, odt, 1 if require_cuda else 0)
    if res is None:
        return None
    code, raw = res
    cols = np.frombuffer(raw, dtype=np.int64).reshape(ROWS, G)
    dtype = _DTYPES[code & 15]
    device = _device(code >> 4 & 255) if require_cuda else a[0].device
    # The (M, N, K) tuples of a problem set seen before, by the bytes of its size columns.
    size_key = raw[4 * 8 * G:]
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
