"""Engine: what a long-running process needs around the ops.

A server (or any long-lived caller) keeps expert weights resident on one device and runs many
small matmuls against them. The Engine owns exactly that state and nothing HTTP-shaped:

- the device (CUDA if available, else CPU) and the backend the ops will pick there;
- resident weight sets (name -> (E, K, N) tensor on the device), swapped in atomically;
- warm-up: before a weight set becomes visible it is run once per kernel configuration the
  heuristics can pick for it (moe_gemm.heuristics, swept over row counts up to `max_rows`),
  with both output dtypes a request can ask for, and the ad-hoc grouped_gemm path once per
  configuration reachable from representative shapes; so the cute backend compiles before
  the first real request (a CuTe DSL compile takes seconds; a request must not wait for one);
- optional tuning at start (`tune=True`): each set's shapes are tuned by the online autotuner
  (moe_gemm.tuning.online, results cached on disk) before the warm-up, and every set reports
  the kernel config each warmed row count runs and where it came from (a tuned table or the
  rules) in `WeightSet.kernels`;
- one CUDA stream and one lock, so launches from worker threads never interleave;
- `grouped_mm_many` / `grouped_gemm_many`: several callers' problems merged into ONE grouped
  launch and split back, which is what a dynamic batcher needs. For the MoE form the rows of
  all requests are regrouped per expert (request 0's rows of expert e, then request 1's, ...)
  so that the merged problem is again a plain `grouped_mm` with no padding, and each caller
  gets exactly its own rows back.

Tensors come in on any device and results go back on the CPU (the caller serializes them).
Out-of-memory, of the GPU or of host memory (the CPU engine's, or host staging buffers), is
reported as `EngineOutOfMemory` (on a GPU after freeing the allocator's cache), so a server can
answer one request with 503 (an upload 507) and carry on.

The Engine inherits its warm-up (engine_warmup.py) and its launches (engine_launches.py) from
one mixin each; this module holds the weight sets, the lock and the streams.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

from moe_gemm.capability import cute_problem
from moe_gemm.config import GemmConfig
from moe_gemm.ops.tuned import enabled as tables_on
from moe_gemm.ops.validation import SUPPORTED_DTYPES, shape_text

from .engine_launches import LaunchMixin
from .engine_warmup import WarmUpMixin
from .fp8_weights import FP8_DTYPES, check_fp8_scale

__all__ = ["Engine", "EngineOutOfMemory", "WeightSet", "is_out_of_memory", "resolve_device"]

log = logging.getLogger(__name__)

Layout = Literal["w", "w_t"]

_DEVICE_OOM: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "OutOfMemoryError", None),
                getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None
)
# Host memory that cannot be had: torch's CPU allocator raises a plain RuntimeError, told
# apart by its text ("can't allocate memory" from torch 2.4, "not enough memory" before).
_HOST_OOM_TEXTS = ("DefaultCPUAllocator: can't allocate memory",
                   "DefaultCPUAllocator: not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says that device or host memory ran out (an allocation that failed:
    the engine stays usable)."""
    if isinstance(exc, (EngineOutOfMemory, *_DEVICE_OOM, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc) for t in _HOST_OOM_TEXTS)


class EngineOutOfMemory(RuntimeError):
    """The device ran out of memory for one launch; the engine is still usable."""


@dataclass(frozen=True)
class WeightSet:
    """One resident expert weight tensor.

    Attributes:
        name: the set's name.
        w: [E, K, N] on the engine's device; for layout "w_t" a transposed view of the
            uploaded [E, N, K] tensor (the ops take either unit stride).
        layout: "w" if uploaded as [E, K, N], "w_t" if uploaded as [E, N, K].
        version: increases every time a set is installed, so callers can tell a replaced set
            from the one they validated against; 0 for a set prepared and not yet installed.
    """

    name: str
    w: torch.Tensor  # (E, K, N)
    layout: Layout
    version: int
    created: float = field(default_factory=time.time)
    # Per warmed row count: {"rows", "config" (a name as `moe-gemm tune` prints it),
    # "source" ("table:exact" | "table:neighbours" | "rules", "+waves" where the whole-wave
    # fit moved the tile)}; cute only.
    kernels: tuple[dict[str, object], ...] = ()
    # FP8 sets (w float8): the decoding scales in the op's orientation (fp8_weights.py):
    # (E, K/128, ceil(N/128)) block-wise, (E, N) per channel, (E,) per expert; else None.
    scale: torch.Tensor | None = None
    granularity: str | None = None  # "block" | "row" | "tensor" for FP8 sets

    @property
    def request_dtypes(self) -> tuple[torch.dtype, ...]:
        """The activation dtypes requests may send: the set's own or float32 (FP8 sets: any
        of bfloat16, float16, float32; the engine quantizes them)."""
        if self.scale is not None:
            return (torch.bfloat16, torch.float16, torch.float32)
        return (self.dtype,) if self.dtype == torch.float32 else (self.dtype, torch.float32)

    @property
    def act_dtype(self) -> torch.dtype:
        """The activation dtype a request sends by default (bfloat16 for FP8 sets)."""
        return torch.bfloat16 if self.scale is not None else self.dtype

    @property
    def E(self) -> int:
        return self.w.shape[0]

    @property
    def K(self) -> int:
        return self.w.shape[1]

    @property
    def N(self) -> int:
        return self.w.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.w.dtype

    @property
    def nbytes(self) -> int:
        scale = 0 if self.scale is None else self.scale.numel() * 4
        return self.w.numel() * self.w.element_size() + scale

    def info(self) -> dict[str, object]:
        """Plain-data description (name, experts, k, n, dtype, bytes, layout, and the kernels
        its warmed row counts run when the cute backend serves it)."""
        info: dict[str, object] = {
            "name": self.name,
            "experts": self.E,
            "k": self.K,
            "n": self.N,
            "dtype": str(self.dtype).removeprefix("torch."),
            "bytes": self.nbytes,
            "layout": self.layout,
        }
        if self.scale is not None:
            info["scales"] = self.granularity
        if self.kernels:
            info["kernels"] = [dict(k) for k in self.kernels]
        return info


def host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory: /proc/meminfo's MemAvailable (what can be
    allocated without swapping; MemFree leaves out the page cache the kernel gives back),
    within the cgroup's limit where one is set (a container sees the host's totals there).

    Raises:
        OSError, ValueError, KeyError: not Linux, or a file that does not read as expected.
    """
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024  # (kB)
    available, total = fields["MemAvailable"], fields["MemTotal"]
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                used = int(f.read())
            total = min(total, int(limit))
            available = min(available, max(0, int(limit) - used))
    except OSError:
        pass  # (no cgroup v2 memory controller, or not readable: the host's numbers stand)
    return available, total


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """"auto"/None -> cuda (current device) if available, else cpu; otherwise as given.

    Raises:
        ValueError: a CUDA device was asked for where none is visible.
    """
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]'; got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was requested but no CUDA GPU is visible")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} does not exist ({torch.cuda.device_count()} visible)"
            )
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]'; got {device!r}")
    elif dev.index not in (None, 0):
        # torch takes "cpu:1" and places tensors on the one CPU device: a typo for cuda:1
        # would serve from the CPU without a word.
        raise ValueError(f"device {device!r}: the CPU has index 0 only (did you mean cuda?)")
    else:
        dev = torch.device("cpu")
    return dev


class Engine(WarmUpMixin, LaunchMixin):
    """Resident expert weights and serialized grouped launches on one device.

    Args:
        device: "auto" (default: CUDA if available, else CPU), "cpu", "cuda" or "cuda:i".
        config: the GemmConfig every launch uses (default: all automatic).
        warmup_rows: row counts T each weight set is run at before it becomes visible;
            default: one T per kernel configuration the heuristics choose for T up to
            `max_rows` (cute backend), (1,) with the torch backend.
        max_rows: the most rows one launch will carry (the warm-up sweeps up to it).
        tune: tune each weight set's shapes with the online autotuner before warming it
            (cute backend only; TUNE_ROWS_PER_EXPERT x E rows, up to max_rows; each new shape
            takes up to MOE_GEMM_AUTOTUNE_BUDGET_S seconds once, then comes from the disk
            cache).

    Thread safety: every public method may be called from any thread. Launches are
    serialized by one lock and run on the engine's own CUDA stream; warm-up launches run on
    a second stream without it (a compile must not stall serving); installing or removing a
    set never waits for a launch.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        config: GemmConfig | None = None,
        warmup_rows: Sequence[int] | None = None,
        max_rows: int = 65536,
        tune: bool = False,
    ) -> None:
        if config is not None and not isinstance(config, GemmConfig):
            raise TypeError(f"config must be a moe_gemm.GemmConfig or None; got {config!r}")
        self.device = resolve_device(device)
        self.config = config or GemmConfig()
        if warmup_rows is not None and any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in warmup_rows
        ):
            raise ValueError(f"warmup_rows must be non-negative ints; got {list(warmup_rows)}")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive int; got {max_rows!r}")
        self.warmup_rows = tuple(warmup_rows) if warmup_rows is not None else None
        self.max_rows = max_rows
        self.tune = bool(tune)
        why_not = cute_problem(self.device)
        if self.config.backend == "torch":
            self.backend, self.backend_reason = "torch", "backend='torch' was configured"
        elif why_not is None:
            self.backend, self.backend_reason = "cute", None
        else:
            if self.config.backend == "cute":
                raise RuntimeError(f"backend='cute' cannot run on {self.device}: {why_not}")
            self.backend, self.backend_reason = "torch", why_not
        if self.tune and self.backend != "cute":
            # (tuning picks among our kernels' configs; the torch backend has none)
            log.warning("tuning at start is skipped: the engine runs the torch backend (%s)",
                        self.backend_reason)
        elif self.tune and not tables_on():
            log.warning("tuning at start is skipped: MOE_GEMM_TUNED_TABLES=0 turns the tables "
                        "off, so no launch would read what it finds")
        self._lock = threading.RLock()  # launches
        # The registry has its own lock: swapping a set in must not wait for a launch.
        self._registry_lock = threading.Lock()
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        # Warm-up launches (which may compile for seconds) run on their own stream and
        # without the lock, so adding a weight set to a live engine does not stall serving.
        self._warm_stream = torch.cuda.Stream(self.device) if cuda else None
        self._tls = threading.local()
        self._buffers: dict[str, torch.Tensor] = {}
        self._weights: dict[str, WeightSet] = {}
        self._versions = itertools.count(1)
        self._warmed_gemm: set[torch.dtype] = set()
        self.launches = 0

    # ------------------------------------------------------------------ weight sets

    def prepare_weights(
        self, name: str, tensor: torch.Tensor, layout: Layout = "w", *, warm: bool = True,
        scale: torch.Tensor | None = None,
    ) -> WeightSet:
        """Validate, move to the device and warm up a weight set without installing it.

        Args:
            name: the set's name (any string; the server validates names).
            tensor: [E, K, N] for layout "w", [E, N, K] for layout "w_t"; bf16, fp16 or fp32,
                or FP8 (float8_e4m3fn / float8_e5m2) with its `scale`.
            layout: "w" or "w_t".
            warm: run the warm-up ladder (compiles the kernels this set will use).
            scale: an FP8 tensor's float32 decoding scale (w ~= fp8 * scale) in the
                tensor's own orientation: 128x128 blocks ([E, K/128, ceil(N/128)] for "w",
                [E, ceil(N/128), K/128] for "w_t"), per output channel [E, N], or per
                expert [E] / one value; requests are then quantized by the engine
                (1x128 groups per token for block scales, per token otherwise).

        Returns:
            A WeightSet to pass to `install`.

        Raises:
            TypeError: not a tensor, or an unsupported dtype.
            ValueError: not 3-D, a zero dimension, or an unknown layout.
            EngineOutOfMemory: the device cannot hold it.
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights must be a torch.Tensor; got {type(tensor).__name__}")
        if layout not in ("w", "w_t"):
            raise ValueError(f"layout must be 'w' (E, K, N) or 'w_t' (E, N, K); got {layout!r}")
        want = "(E, K, N)" if layout == "w" else "(E, N, K)"
        if tensor.dim() != 3:
            raise ValueError(f"{layout} must be 3-D {want}; got shape {shape_text(tensor)}")
        if tensor.dtype not in SUPPORTED_DTYPES + FP8_DTYPES:
            raise TypeError(
                f"{layout} must be bfloat16, float16, float32 or FP8 (float8_e4m3fn, "
                f"float8_e5m2, with its scale); got {str(tensor.dtype)[6:]}"
            )
        if min(tensor.shape) == 0:
            raise ValueError(f"{layout} {want} needs every dimension >= 1; got "
                             f"{shape_text(tensor)}")
        granularity = check_fp8_scale(tensor, layout, scale)  # (None for 16/32-bit sets)
        # An FP8 set is kept as its "w_t" equivalent whatever the upload's layout: the FP8
        # WGMMA reads w K-major only (ops/scaled_support.py), so an (E, K, N) set stored as
        # sent would be refused by the kernel and every request would dequantize the whole
        # set in the torch backend instead. Its block scales follow (a checkpoint's
        # (E, ceil(N/128), K/128) layout, the one the staged scales load with no copy).
        k_major = layout == "w_t" or granularity is not None
        src, src_scale = tensor.detach(), None if scale is None else scale.detach().float()
        # The copy runs on the warm-up stream (synchronized on exit), outside the launch lock,
        # so a large upload does not stall launches of the sets already resident.
        with self._oom_guard(), self._on_stream(self._warm_stream):
            if layout == "w" and k_major:  # (transposed where it lies: one copy on the device)
                src = src.transpose(1, 2).contiguous()
                if granularity == "block":
                    src_scale = src_scale.transpose(1, 2).contiguous()
            stored = self._to_device(src).contiguous()
            stored_scale = None if src_scale is None else self._to_device(src_scale).contiguous()
        w = stored.transpose(1, 2) if k_major else stored
        if stored_scale is not None and granularity == "block":
            stored_scale = stored_scale.transpose(1, 2)  # (E, K/128, ceil(N/128)) view
        ws = WeightSet(name=name, w=w, layout=layout, version=0, scale=stored_scale,
                       granularity=granularity)
        if warm:
            with self._oom_guard():  # (its inputs are allocated outside the launches' guard)
                self.warm_up(ws)
            ws = dataclasses.replace(ws, kernels=self.kernel_report(ws))
            for k in ws.kernels:
                log.info("weight set %r: %s rows -> %s (%s)", name, k["rows"], k["config"],
                         k["source"])
        return ws

    def install(self, ws: WeightSet) -> WeightSet | None:
        """Make `ws` visible under its name, numbered with the next version; returns the set
        it replaced, if any."""
        return self._install(ws)[1]

    def _install(self, ws: WeightSet) -> tuple[WeightSet, WeightSet | None]:
        """install(), returning (the set installed, the set it replaced or None).

        The version is drawn here, in the order sets become visible, not when they were
        prepared: uploads warm concurrently and finish in any order, and a set prepared first
        but installed last must not carry an older version than the one it replaced or one
        deleted before it (statistics retire a deleted set's requests by version:
        metrics.StatsBook.forget)."""
        with self._registry_lock:
            ws = dataclasses.replace(ws, version=next(self._versions))
            old = self._weights.get(ws.name)
            self._weights[ws.name] = ws
            return ws, old

    def add_weights(
        self, name: str, tensor: torch.Tensor, layout: Layout = "w", *, warm: bool = True,
        scale: torch.Tensor | None = None,
    ) -> WeightSet:
        """prepare_weights + install. Returns the installed WeightSet."""
        ws = self.prepare_weights(name, tensor, layout, warm=warm, scale=scale)
        return self._install(ws)[0]

    def remove_weights(self, name: str) -> WeightSet | None:
        """Forget a weight set (launches already holding it finish). Returns it, or None."""
        with self._registry_lock:
            return self._weights.pop(name, None)

    def get_weights(self, name: str) -> WeightSet:
        """The resident set called `name`. Raises KeyError if there is none."""
        ws = self._weights.get(name)
        if ws is None:
            raise KeyError(name)
        return ws

    def weight_sets(self) -> list[WeightSet]:
        """All resident sets, sorted by name."""
        return sorted(self._weights.values(), key=lambda ws: ws.name)

    @property
    def resident_bytes(self) -> int:
        return sum(ws.nbytes for ws in list(self._weights.values()))

    def free_memory(self) -> tuple[int, int] | None:
        """(free, total) bytes, at this moment, of the memory weight sets are held in: the
        GPU's, or the host's for the CPU engine; None where the platform does not tell.

        On a GPU the caching allocator's reserved but unused blocks count as free: this
        process allocates from them first, and cudaMemGetInfo counts them as used."""
        try:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                cached = (torch.cuda.memory_reserved(self.device)
                          - torch.cuda.memory_allocated(self.device))
                return free + cached, total
            return host_memory()
        except (RuntimeError, OSError, ValueError, KeyError):
            return None

    # ------------------------------------------------------------------ helpers

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=False)

    @contextmanager
    def _on_stream(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    @contextmanager
    def _launch(self) -> Iterator[None]:
        if getattr(self._tls, "warming", False):
            with self._oom_guard(), self._on_stream(self._warm_stream):
                yield
        else:
            with self._lock, self._oom_guard(), self._on_stream(self._stream):
                yield

    @contextmanager
    def _warming(self) -> Iterator[None]:
        previous = getattr(self._tls, "warming", False)
        self._tls.warming = True
        try:
            yield
        finally:
            self._tls.warming = previous

    @contextmanager
    def _oom_guard(self) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, MemoryError) as e:
            if isinstance(e, EngineOutOfMemory) or not is_out_of_memory(e):
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            what = f"memory on {self.device}" if isinstance(e, _DEVICE_OOM) else "host memory"
            raise EngineOutOfMemory(f"out of {what}: {e}") from None
