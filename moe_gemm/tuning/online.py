"""Online autotune: tune a grouped_mm shape no table holds, once, and remember it on disk.

Opt-in: MOE_GEMM_AUTOTUNE=1. When grouped_mm builds the launch plan for a new signature
(once per shape: plans are cached), with a config that leaves every tuned field at "auto", no
exact entry for the shape in any table, and the current stream not capturing a CUDA graph,
the shape is tuned right there: the caller's routing (offs, read to the host once: this call
synchronizes) on fresh random operands of the same shapes, the same search as `moe-gemm tune`
within MOE_GEMM_AUTOTUNE_BUDGET_S seconds (default 30, compiles included). The winner goes into
the online cache (cache_root()/tuned/<device>.json, with library, DSL, driver, device and
kernel-source versions; an entry from other versions is ignored) and the plan is built from
it (MOE_GEMM_DISK_CACHE=0, or a cache folder that cannot be written: kept in memory, for this
process). A capturing stream never tunes (the plan then uses what the tables and rules say),
so tuning never lands on the hot path of a captured graph; nor does MOE_GEMM_TUNED_TABLES=0
(no lookup would read the result). A shape that failed to tune (out of
memory, nothing compiled) is not retried in the same process.

Covers grouped_mm's 2-D (varlen) and 3-D (batched) forms; grouped_gemm's lists use the tables
and rules only.
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
import time
import warnings
from pathlib import Path

import torch

from moe_gemm.config import GemmConfig
from moe_gemm.env import env_value
from moe_gemm.ops import heuristics, tuned
from moe_gemm.ops.versions import runtime_versions

AUTOTUNE_ENV = "MOE_GEMM_AUTOTUNE"
BUDGET_ENV = "MOE_GEMM_AUTOTUNE_BUDGET_S"  # (its default, 30 s, is declared in env.VARIABLES)
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_attempted: set[tuple] = set()
_lock = threading.Lock()


def requested(config: GemmConfig) -> bool:
    """Whether a plan for `config` should be tuned online (cheap: checked per new plan). Not
    with MOE_GEMM_TUNED_TABLES=0: no lookup would read what it wrote."""
    if not env_value(AUTOTUNE_ENV) or config.tuning_pinned or not tuned.enabled():
        return False
    # Checked here, on the caller's path: read only inside the tune, a bad budget would end
    # up as the warning of a failed tune instead of an error naming the variable.
    _budget_s()
    return True


def _budget_s() -> float:
    """MOE_GEMM_AUTOTUNE_BUDGET_S (default when unset or empty), at least 1 s; EnvError when it
    is not a positive finite number of seconds."""
    return env_value(BUDGET_ENV)


def ensure_tuned_varlen(args, config: GemmConfig) -> None:
    """Tune grouped_mm's 2-D call `args` (validation.GroupedMmArgs) if nothing exact is known."""
    T, E, N, K = args.T, args.E, args.N, args.K
    if min(T, E, N, K) <= 0:
        return
    key = tuned.Key("varlen", _NAMES[args.dtype], _NAMES[args.out_dtype], E, N, K,
                    tuned.rows_bucket(T / E))

    def shape():
        from moe_gemm.tuning.tuner import TuneShape

        ends = [min(max(0, int(v)), T) for v in args.offs.to("cpu", torch.int64).tolist()]
        counts, start = [], 0
        for e in ends:
            counts.append(max(0, e - start))
            start = max(start, e)
        counts[-1] += T - sum(counts)  # rows past offs[-1] are not computed; time them anyway
        return TuneShape("varlen", E, N, K, T, tuple(counts), key.dtype, key.out_dtype,
                         _layout(args.w), f"online E={E} N={N} K={K}")

    _ensure(args.x.device, key, T, shape)


def ensure_tuned_batched(args, config: GemmConfig) -> None:
    """Tune grouped_mm's 3-D call `args` (validation.GroupedBmmArgs) likewise."""
    G, M, N, K = args.G, args.M, args.N, args.K
    if min(G, M, N, K) <= 0:
        return
    key = tuned.Key("batched", _NAMES[args.dtype], _NAMES[args.out_dtype], G, N, K,
                    tuned.rows_bucket(M))

    def shape():
        from moe_gemm.tuning.tuner import TuneShape

        return TuneShape("batched", G, N, K, G * M, (), key.dtype, key.out_dtype,
                         _layout(args.w), f"online batched G={G} N={N} K={K}")

    _ensure(args.x.device, key, G * M, shape)


def tune_once(device: torch.device, E: int, N: int, K: int, T: int, counts: list[int], *,
              dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype | None = None,
              layout: str = "ENK") -> None:
    """Tune grouped_mm(x (T, K), w (E, K, N), offs) for this routing once, as a call with
    MOE_GEMM_AUTOTUNE=1 would (a server tuning its weight sets at start); a shape with an
    exact table entry, or already tried in this process, is left alone."""
    if not isinstance(device, torch.device) or device.type != "cuda":
        # (a CPU device reached torch.cuda's capture query: an obscure RuntimeError from a
        # CPU-only torch; where CUDA is present, device_name read the current GPU's name and
        # the tune failed on the CPU tensors, a warning)
        raise ValueError(f"tune_once tunes the kernels on a CUDA device (a torch.device); got "
                         f"{device!r}")
    if min(T, E, N, K) <= 0 or len(counts) != E or sum(counts) != T:
        raise ValueError(f"tune_once needs E counts summing to T > 0; got E={E}, T={T}, "
                         f"{len(counts)} counts summing to {sum(counts)}")
    key = tuned.Key("varlen", _NAMES[dtype], _NAMES[out_dtype or dtype], E, N, K,
                    tuned.rows_bucket(T / E))

    def shape():
        from moe_gemm.tuning.tuner import TuneShape

        return TuneShape("varlen", E, N, K, T, tuple(counts), key.dtype, key.out_dtype,
                         layout, f"E={E} N={N} K={K}")

    _ensure(device, key, T, shape)


def _layout(w: torch.Tensor) -> str:
    return "ENK" if w.stride(-2) == 1 else "EKN"  # K contiguous: the (E, N, K) storage


def _ensure(device: torch.device, key: tuned.Key, rows: int, make_shape) -> None:
    from moe_gemm.capability import device_name, sm_count

    if torch.cuda.is_current_stream_capturing():
        return
    name = device_name(device)
    nsm = sm_count(device)
    with _lock:
        if (name, key) in _attempted:
            return
        _attempted.add((name, key))
        hit = tuned.lookup(name, key, rows, nsm)
        if hit is not None and hit.how == "exact":
            return
        try:
            entry, samples = _tune(make_shape(), device, name)
        except Exception as exc:  # noqa: BLE001 - tuning is an optimisation: never fail a call
            warnings.warn(f"moe_gemm: online autotune of {key} failed ({type(exc).__name__}: "
                          f"{exc}); using the tables and rules", RuntimeWarning, stacklevel=4)
            return
        if entry is not None:
            try:
                store(name, nsm, entry, samples)
            except OSError as exc:  # a cache folder that cannot be written: never fail a call
                path = tuned.online_path(name)
                tuned._warn_once(f"{path}:write", f"cannot write the online autotune cache "
                                 f"{path} ({exc}); results are kept in memory")
                remember(name, nsm, entry, samples)


def _tune(shape, device: torch.device, name: str):
    from moe_gemm.capability import sm_count
    from moe_gemm.tuning.compile_pool import CompilePool
    from moe_gemm.tuning.runner import ShapeRunner, stage1_keys
    from moe_gemm.tuning.tuner import tune_shape

    t0 = time.monotonic()
    torch.cuda.synchronize(device)
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20)
    with CompilePool() as pool:
        pool.submit(stage1_keys(shape, sm_count(device)))
        runner = ShapeRunner(shape, device, pool, l2_bytes=l2, mem_fraction=0.25)
        try:
            left = _budget_s() - (time.monotonic() - t0)
            res = tune_shape(shape, runner, deadline=time.monotonic() + max(1.0, left),
                             out_itemsize=runner.d.itemsize)
        finally:
            runner.close()
    return res.entry(), res.samples()


def remember(device: str, nsm: int, entry: dict, samples: list[dict]) -> None:
    """Add an entry to this process's in-memory online results and make lookups see it."""
    from moe_gemm.tuning import table_io

    with tuned._lock:
        doc = tuned._memory.get(device) or table_io.new_table(
            device, nsm, runtime_versions(device), {})
        table_io.add_result(doc, entry, samples)
        tuned._memory[device] = doc
    tuned.bump_generation()
    heuristics.clear_caches()


def store(device: str, nsm: int, entry: dict, samples: list[dict]) -> Path | None:
    """Add an entry to the online cache (locked, atomic) and make lookups see it; with the disk
    cache off (MOE_GEMM_DISK_CACHE=0), to this process's memory only (returns None)."""
    from moe_gemm.ops.kernel_cache import disk_cache_enabled
    from moe_gemm.tuning import table_io

    if not disk_cache_enabled():
        remember(device, nsm, entry, samples)
        return None
    path = tuned.online_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    versions = runtime_versions(device)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = None
        with contextlib.suppress(OSError, ValueError):
            # read_table leaves out the entries and samples the reader skips: add_result keys
            # every one it keeps, and one that does not parse would fail the caller's call.
            old = table_io.read_table(path, device)
            tuned.parse_table(old, str(path), device, versions)  # other versions: start anew
            doc = old
        if doc is None:
            doc = table_io.new_table(device, nsm, versions, {})
        table_io.add_result(doc, entry, samples)
        table_io.write(path, doc)
    tuned.bump_generation()
    heuristics.clear_caches()
    return path
