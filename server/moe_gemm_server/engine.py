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
GPU out-of-memory is reported as `EngineOutOfMemory` after freeing the allocator's cache, so a
server can answer one request with 503 and carry on.
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
from moe_gemm.ops.api import grouped_gemm, grouped_mm
from moe_gemm.ops.validation import SUPPORTED_DTYPES

from .fp8_weights import FP8_DTYPES, check_fp8_scale, fp8_mm, fp8_warm_choices

__all__ = ["Engine", "EngineOutOfMemory", "WeightSet", "resolve_device"]

log = logging.getLogger(__name__)

Layout = Literal["w", "w_t"]

# Row counts each weight set is warmed at when the heuristics cannot be asked (see
# Engine.warmup_rows_for); with the cute backend the ladder comes from the heuristics. On the
# CPU the torch backend compiles nothing: one tiny run proves the weights work.
DEFAULT_WARMUP_ROWS_CUDA = (1, 64, 512, 4096)
DEFAULT_WARMUP_ROWS_CPU = (1,)
# Rows per expert tune_weights tunes at (times E): decode to prefill, a factor of 8 apart.
TUNE_ROWS_PER_EXPERT = (1 / 8, 1, 8, 64, 512)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# Representative ad-hoc problem shapes (M, N, K): together they reach every tile / schedule /
# stage choice of heuristics.choose_general (short and long K, narrow and wide N, few and
# many rows); only the first shape per distinct choice is run.
_GEMM_WARMUP_SHAPES = tuple(
    (m, n, k) for m in (1, 64, 65, 128) for n in (64, 192, 256) for k in (64, 1024, 1088, 4096)
)

# Staging buffers larger than this are not kept between launches (see Engine._buffer).
_MAX_BUFFER_BYTES = 512 << 20

_OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "OutOfMemoryError", None),
                getattr(torch.cuda, "OutOfMemoryError", None)) if t is not None
)


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
            from the one they validated against.
    """

    name: str
    w: torch.Tensor  # (E, K, N)
    layout: Layout
    version: int
    created: float = field(default_factory=time.time)
    # Per warmed row count: {"rows", "config" (a name as `moe-gemm tune` prints it),
    # "source" ("table:exact" | "table:nearest" | "table:model" | "rules")}; cute only.
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
    return dev


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


class Engine:
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
            raise ValueError(f"{layout} must be 3-D {want}; got shape {_shape(tensor)}")
        if tensor.dtype not in SUPPORTED_DTYPES + FP8_DTYPES:
            raise TypeError(
                f"{layout} must be bfloat16, float16, float32 or FP8 (float8_e4m3fn, "
                f"float8_e5m2, with its scale); got {str(tensor.dtype)[6:]}"
            )
        if min(tensor.shape) == 0:
            raise ValueError(f"{layout} {want} needs every dimension >= 1; got {_shape(tensor)}")
        granularity = check_fp8_scale(tensor, layout, scale)  # (None for 16/32-bit sets)
        # The copy runs on the warm-up stream (synchronized on exit), outside the launch lock,
        # so a large upload does not stall launches of the sets already resident.
        with self._oom_guard(), self._on_stream(self._warm_stream):
            stored = self._to_device(tensor.detach()).contiguous()
            stored_scale = (None if scale is None
                            else self._to_device(scale.detach().float()).contiguous())
        w = stored if layout == "w" else stored.transpose(1, 2)
        if stored_scale is not None and granularity == "block" and layout == "w_t":
            stored_scale = stored_scale.transpose(1, 2)  # blocks follow their weights
        ws = WeightSet(name=name, w=w, layout=layout, version=next(self._versions),
                       scale=stored_scale, granularity=granularity)
        if warm:
            self.warm_up(ws)
            ws = dataclasses.replace(ws, kernels=self.kernel_report(ws))
            for k in ws.kernels:
                log.info("weight set %r: %s rows -> %s (%s)", name, k["rows"], k["config"],
                         k["source"])
        return ws

    def install(self, ws: WeightSet) -> WeightSet | None:
        """Make `ws` visible under its name; returns the set it replaced, if any."""
        with self._registry_lock:
            old = self._weights.get(ws.name)
            self._weights[ws.name] = ws
            return old

    def add_weights(
        self, name: str, tensor: torch.Tensor, layout: Layout = "w", *, warm: bool = True,
        scale: torch.Tensor | None = None,
    ) -> WeightSet:
        """prepare_weights + install. Returns the installed WeightSet."""
        ws = self.prepare_weights(name, tensor, layout, warm=warm, scale=scale)
        self.install(ws)
        return ws

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

    # ------------------------------------------------------------------ warm-up

    def warm_up(self, ws: WeightSet | None = None) -> None:
        """Run every configuration that will be served, so none compiles on a request.

        With `ws`, that set at each of `warmup_rows` and with both output dtypes a request can
        ask for (the set's own dtype, and float32 for float32 activations). Without, every
        resident set plus the ad-hoc grouped_gemm path for bf16, fp16 and fp32.
        """
        if ws is None:
            for one in self.weight_sets():
                self.warm_up(one)
            self.warm_up_grouped_gemm()
            return
        act = ws.act_dtype
        out_dtypes = [act] + ([torch.float32] if act != torch.float32 else [])
        if self.tune and self.backend == "cute" and ws.scale is None:
            self.tune_weights(ws)
        with self._warming():
            for T in self.warmup_rows_for(ws):
                # values do not matter for a compile; built on the device, no host round trip
                counts = _spread(T, ws.E)
                for out_dtype in out_dtypes:
                    # an FP8 set's activations come in the output dtype and are quantized
                    x = torch.ones(T, ws.K, dtype=act if ws.scale is None else out_dtype,
                                   device=self.device)
                    if self.device.type == "cuda":  # filled on this stream; used on ours
                        torch.cuda.current_stream(self.device).synchronize()
                    self.grouped_mm_many(ws, [(x, counts)], out_dtype=out_dtype)

    def warmup_rows_for(self, ws: WeightSet) -> tuple[int, ...]:
        """The row counts `warm_up(ws)` runs: one per kernel configuration the heuristics
        pick for T = 1 .. max_rows (probing T around powers of two and of T / E, where the
        heuristics' thresholds lie), or `warmup_rows` when given."""
        if self.warmup_rows is not None:
            return self.warmup_rows
        if self.backend != "cute":
            return DEFAULT_WARMUP_ROWS_CPU
        try:
            from moe_gemm.capability import sm_count
            from moe_gemm.ops.heuristics import choose_varlen

            nsm = sm_count(self.device)
            # thresholds are on rows per expert (T / E): probe at and just past each power
            # of two of it, and at plain powers of two of T
            bits = range(self.max_rows.bit_length())
            cands = {1 << i for i in bits} | {(1 << i) + 1 for i in bits}
            cands |= {ws.E << i for i in bits} | {(ws.E << i) + ws.E for i in bits}
            cands = {t for t in cands if 0 < t <= self.max_rows} | {self.max_rows}
            if ws.scale is not None:
                return fp8_warm_choices(ws, self.config, sorted(cands))[0]
            first: dict[object, int] = {}
            name = self._device_name()
            for T in sorted(cands):
                c = choose_varlen(self.config, T, ws.E, ws.N, ws.K, nsm, device=name,
                                  dtype=_DTYPE_NAMES.get(ws.dtype, "bfloat16"))
                key = (c.schedule, c.visitor, c.tile_m, c.tile_n, c.stages, c.l2_hints,
                       c.epi_whole, c.cluster_m, c.cluster_n, c.tail_split)
                first.setdefault(key, T)
            return tuple(sorted(first.values()))
        except Exception:  # noqa: BLE001 - heuristics API changed: fall back to a fixed ladder
            log.warning("could not enumerate kernel choices; warming a fixed row ladder",
                        exc_info=True)
            return DEFAULT_WARMUP_ROWS_CUDA

    def _device_name(self) -> str | None:
        """The GPU's name (what tuned tables are keyed by), None on the CPU."""
        if self.device.type != "cuda":
            return None
        from moe_gemm.capability import device_name

        return device_name(self.device)

    def tune_rows_for(self, ws: WeightSet) -> tuple[int, ...]:
        """Row counts tune_weights tunes: E x TUNE_ROWS_PER_EXPERT, within max_rows. Steps of
        8x leave every row count within 1.5 buckets of a tuned one (the tables answer up to 2
        buckets away)."""
        rows = {max(1, int(ws.E * r)) for r in TUNE_ROWS_PER_EXPERT}
        return tuple(sorted(t for t in rows if t <= self.max_rows))

    def tune_weights(self, ws: WeightSet) -> None:
        """Tune `ws`'s shapes once each (online autotune, disk-cached), evenly routed."""
        from moe_gemm.tuning import online

        layout = "ENK" if ws.w.stride(1) == 1 else "EKN"
        for T in self.tune_rows_for(ws):
            counts = [int(c) for c in _spread(T, ws.E).tolist()]
            t0 = time.monotonic()
            online.tune_once(self.device, ws.E, ws.N, ws.K, T, counts, dtype=ws.dtype,
                             layout=layout)
            log.info("weight set %r: tuned %d rows in %.1fs", ws.name, T, time.monotonic() - t0)

    def kernel_report(self, ws: WeightSet) -> tuple[dict[str, object], ...]:
        """For each warmed row count: the kernel config it runs and where that came from."""
        if self.backend != "cute":
            return ()
        if ws.scale is not None:
            return fp8_warm_choices(ws, self.config, self.warmup_rows_for(ws))[1]
        try:
            from moe_gemm.capability import sm_count
            from moe_gemm.ops.heuristics import choose_varlen, tuned_hit
            from moe_gemm.tuning.space import fields_of, name_of

            nsm, name = sm_count(self.device), self._device_name()
            dtype = _DTYPE_NAMES.get(ws.dtype, "bfloat16")
            report = []
            for T in self.warmup_rows_for(ws):
                if T <= 0:
                    continue
                c = choose_varlen(self.config, T, ws.E, ws.N, ws.K, nsm, device=name,
                                  dtype=dtype)
                hit = tuned_hit("varlen", self.config, nsm, device=name, dtype=dtype,
                                shape=(T, ws.E, ws.N, ws.K))
                report.append({"rows": T, "config": name_of(fields_of(c, "varlen")),
                               "source": "rules" if hit is None else f"table:{hit.how}"})
            return tuple(report)
        except Exception:  # noqa: BLE001 - a report must never fail a weight upload
            log.warning("could not report the kernel choices of %r", ws.name, exc_info=True)
            return ()

    def _gemm_warmup_shapes(self) -> list[tuple[int, int, int]]:
        if self.backend != "cute":
            return [(1, 64, 64), (128, 64, 64)]
        try:
            from moe_gemm.capability import sm_count
            from moe_gemm.ops.heuristics import choose_general

            nsm = sm_count(self.device)
            first: dict[object, tuple[int, int, int]] = {}
            for shape in _GEMM_WARMUP_SHAPES:
                c = choose_general(self.config, (shape,), nsm)
                key = (c.schedule, c.visitor, c.tile_m, c.tile_n, c.stages, c.l2_hints,
                       c.epi_whole, c.cluster_m, c.cluster_n, c.tail_split)
                first.setdefault(key, shape)
            return list(first.values())
        except Exception:  # noqa: BLE001
            log.warning("could not enumerate grouped_gemm choices; warming fixed shapes",
                        exc_info=True)
            return [(1, 256, 64), (128, 256, 1088), (128, 256, 4096), (128, 128, 64)]

    def warm_up_grouped_gemm(
        self, dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float16, torch.float32)
    ) -> None:
        """Run the ad-hoc grouped GEMM once per dtype and per kernel configuration reachable
        from representative shapes (row-major operands, as the server receives them)."""
        gen = torch.Generator(device="cpu").manual_seed(0)
        shapes = self._gemm_warmup_shapes()
        with self._warming():
            for dtype in dtypes:
                if dtype in self._warmed_gemm:
                    continue
                for m, n, k in shapes:
                    a = [torch.randn(m, k, generator=gen).to(dtype)]
                    b = [torch.randn(k, n, generator=gen).to(dtype)]
                    self.grouped_gemm_many([(a, b)])
                self._warmed_gemm.add(dtype)

    # ------------------------------------------------------------------ launches

    def grouped_mm(
        self,
        ws: WeightSet | str,
        x: torch.Tensor,
        counts: torch.Tensor,
        *,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """One request: y [T, N] = rows of x grouped by `counts` times each expert's weights.

        Args:
            ws: a WeightSet or the name of a resident one.
            x: [T, K], the set's dtype or float32 (converted to the set's dtype).
            counts: [E] integer rows per expert, non-negative, summing to T.
            out_dtype: dtype of y; default x's dtype.

        Returns:
            y [T, N] on the CPU.
        """
        return self.grouped_mm_many(ws, [(x, counts)], out_dtype=out_dtype)[0]

    def grouped_mm_many(
        self,
        ws: WeightSet | str,
        requests: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        out_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """Several requests against one weight set in ONE grouped launch.

        Request r's rows for expert e are placed after the rows of requests 0..r-1 for the
        same expert, so the merged input is again grouped by expert (offs = cumulative sum
        of the summed counts) and no padding is needed; the output rows are scattered back to
        each request's own order.

        Args:
            ws: a WeightSet or the name of a resident one.
            requests: (x_r [T_r, K], counts_r [E]) pairs; every x_r has one dtype, the set's
                or float32.
            out_dtype: dtype of every y_r; default the x_r dtype.

        Returns:
            [y_r [T_r, N]] on the CPU, in request order.

        Raises:
            KeyError: no resident set of that name.
            TypeError / ValueError: shapes, dtypes or counts that do not fit the set.
            EngineOutOfMemory: the launch did not fit in device memory.
        """
        if isinstance(ws, str):
            ws = self.get_weights(ws)
        if not requests:
            return []
        xs, cs = self._check_mm_requests(ws, requests)
        odt = out_dtype if out_dtype is not None else xs[0].dtype
        if odt not in SUPPORTED_DTYPES:
            raise TypeError(f"out_dtype must be bfloat16, float16 or float32; got {odt}")
        rows = [x.shape[0] for x in xs]
        C = torch.stack(cs)  # (R, E) int64 on the CPU
        total = sum(rows)
        offs = torch.cumsum(C.sum(0), 0).to(torch.int32)
        if len(xs) == 1:
            with self._launch():
                x_dev = self._to_device(xs[0])
                y = self._mm(ws, x_dev, self._to_device(offs), odt)
                y_host = y.to("cpu")
                self._count_launch()
            return [y_host]
        perm = _merge_permutation(C, rows)
        K, N = ws.K, ws.N
        with self._launch():
            # Staging buffers are kept between launches (pinned on CUDA: one DMA each way):
            # a fresh host allocation of a large merged batch costs more in page faults than
            # the copies themselves.
            x_cat = self._buffer("x_host", (total, K), xs[0].dtype, "cpu")
            torch.cat(xs, out=x_cat)
            perm_dev = self._to_device(perm)
            if self.device.type == "cpu":
                x_m = self._buffer("x_merged", (total, K), xs[0].dtype, "cpu")
                torch.index_select(x_cat, 0, perm_dev, out=x_m)
                if x_m.dtype != ws.dtype and ws.scale is None:
                    x_m = self._buffer("x_cast", (total, K), ws.dtype, "cpu").copy_(x_m)
                y_m = self._buffer("y_merged", (total, N), odt, "cpu")
                self._mm(ws, x_m, offs, odt, out=y_m)
                y_req = self._buffer("y_host", (total, N), odt, "cpu")
                y_req.index_copy_(0, perm_dev, y_m)
            else:
                x_dev = x_cat.to(self.device, non_blocking=True)
                x_m = x_dev.index_select(0, perm_dev)
                y = self._mm(ws, x_m, self._to_device(offs), odt)
                y_dev = torch.empty_like(y)
                y_dev.index_copy_(0, perm_dev, y)
                y_req = self._buffer("y_host", (total, N), odt, "cpu")
                y_req.copy_(y_dev)
            # the buffers are reused by the next launch: hand out copies
            outs = [t.clone() for t in y_req.split(rows)]
            self._count_launch()
        return outs

    def _mm(self, ws: WeightSet, x: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """The set's grouped GEMM: grouped_mm, or for an FP8 set the activations quantized
        on the device and scaled_grouped_mm (fp8_weights.fp8_mm)."""
        if ws.scale is not None:
            return fp8_mm(ws, x, offs, out_dtype, self.config, out)
        x = x.to(ws.dtype)
        if out is not None:
            return grouped_mm(x, ws.w, offs, out=out, config=self.config)
        return grouped_mm(x, ws.w, offs, config=self.config, out_dtype=out_dtype)

    def _count_launch(self) -> None:
        if not getattr(self._tls, "warming", False):
            self.launches += 1  # serving launches (under the lock)

    def _buffer(self, name: str, shape: tuple[int, int], dtype: torch.dtype, where: str
                ) -> torch.Tensor:
        """A [shape] view of a persistent staging buffer (grown geometrically, pinned when on
        the host of a CUDA engine). Only for launches under the lock; very large requests get
        a plain allocation so the engine does not hold gigabytes between batches."""
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if nbytes > _MAX_BUFFER_BYTES:
            return torch.empty(shape, dtype=dtype, device=where)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, 2 * (buf.numel() if buf is not None else 0), 1 << 20)
            size = min(size, _MAX_BUFFER_BYTES)
            pin = where == "cpu" and self.device.type == "cuda"
            buf = torch.empty(size, dtype=torch.uint8, device=where, pin_memory=pin)
            self._buffers[name] = buf
        return buf[:nbytes].view(dtype).view(shape)

    def grouped_gemm_many(
        self,
        requests: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]],
        *,
        out_dtype: torch.dtype | None = None,
    ) -> list[list[torch.Tensor]]:
        """Several requests' ad-hoc problem lists in ONE grouped_gemm launch.

        Args:
            requests: (a_list, b_list) per request, a_i [M_i, K_i], b_i [K_i, N_i]; one dtype
                across all requests.
            out_dtype: dtype of every d_i; default the inputs' dtype.

        Returns:
            Per request, its [d_i [M_i, N_i]] on the CPU.
        """
        if not requests:
            return []
        a_all: list[torch.Tensor] = []
        b_all: list[torch.Tensor] = []
        sizes = []
        for r, (a, b) in enumerate(requests):
            if len(a) != len(b):
                raise ValueError(
                    f"request {r}: expected one b per a; got {len(a)} a and {len(b)} b"
                )
            a_all.extend(a)
            b_all.extend(b)
            sizes.append(len(a))
        with self._launch():
            a_dev = [self._to_device(t) for t in a_all]
            b_dev = [self._to_device(t) for t in b_all]
            d = grouped_gemm(a_dev, b_dev, config=self.config, out_dtype=out_dtype)
            d_host = [t.to("cpu") for t in d]
            self._count_launch()
        out, i = [], 0
        for n in sizes:
            out.append(d_host[i:i + n])
            i += n
        return out

    def grouped_gemm(
        self, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], *,
        out_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """One request's ad-hoc problems: [a_i @ b_i] on the CPU."""
        return self.grouped_gemm_many([(a, b)], out_dtype=out_dtype)[0]

    # ------------------------------------------------------------------ helpers

    def _check_mm_requests(
        self, ws: WeightSet, requests: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        xs, cs = [], []
        dtype = None
        for r, (x, counts) in enumerate(requests):
            if not isinstance(x, torch.Tensor) or not isinstance(counts, torch.Tensor):
                raise TypeError(f"request {r}: x and counts must be torch.Tensors")
            if x.dim() != 2 or x.shape[1] != ws.K:
                raise ValueError(
                    f"request {r}: x must be (T, K) = (T, {ws.K}) for weight set "
                    f"{ws.name!r}; got {_shape(x)}"
                )
            if x.dtype not in ws.request_dtypes:
                if ws.scale is not None:
                    raise TypeError(
                        f"request {r}: x must be bfloat16, float16 or float32 (weight set "
                        f"{ws.name!r} is FP8: the engine quantizes activations); got "
                        f"{str(x.dtype)[6:]}")
                allowed = "" if ws.dtype == torch.float32 else " or float32"
                raise TypeError(
                    f"request {r}: x must be {str(ws.dtype)[6:]} (the weight set's dtype)"
                    f"{allowed}; got {str(x.dtype)[6:]}"
                )
            if dtype is None:
                dtype = x.dtype
            elif x.dtype != dtype:
                raise TypeError(
                    f"request {r}: x is {str(x.dtype)[6:]} but request 0 is "
                    f"{str(dtype)[6:]}; one launch takes one dtype"
                )
            if counts.dim() != 1 or counts.shape[0] != ws.E:
                raise ValueError(
                    f"request {r}: counts must be (E,) = ({ws.E},) for weight set "
                    f"{ws.name!r}; got {_shape(counts)}"
                )
            if counts.dtype.is_floating_point or counts.dtype == torch.bool:
                raise TypeError(f"request {r}: counts must be integers; got {counts.dtype}")
            c = counts.detach().to("cpu", torch.int64)
            if ws.E and int(c.min()) < 0:
                raise ValueError(f"request {r}: counts must be >= 0; got min {int(c.min())}")
            if ws.E and int(c.max()) > x.shape[0]:  # checked before the sum, which could wrap
                raise ValueError(f"request {r}: counts must be <= T = {x.shape[0]}; got max "
                                 f"{int(c.max())}")
            if int(c.sum()) != x.shape[0]:
                raise ValueError(
                    f"request {r}: counts must sum to T = {x.shape[0]}; they sum to "
                    f"{int(c.sum())}"
                )
            xs.append(x)
            cs.append(c)
        return xs, cs

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
        except _OOM_ERRORS as e:  # type: ignore[misc]
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise EngineOutOfMemory(f"out of memory on {self.device}: {e}") from None


def _spread(T: int, E: int) -> torch.Tensor:
    """[E] int64 counts summing to T, as even as possible (warm-up routing)."""
    counts = torch.full((E,), T // E, dtype=torch.int64)
    counts[: T % E] += 1
    return counts


def _merge_permutation(C: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """perm [total] int64: merged row j takes concatenated-input row perm[j].

    C is (R, E) counts. Merged order is expert-major, request-minor: block (e, r) holds
    request r's rows for expert e. In the concatenated input, request r starts at
    sum(rows[:r]) and its expert-e rows start sum(C[r, :e]) after that.
    """
    R, E = C.shape
    row_start = torch.tensor([0] + rows[:-1], dtype=torch.int64).cumsum(0)  # (R,)
    src = row_start[:, None] + (torch.cumsum(C, 1) - C)  # (R, E) source block starts
    sizes = C.t().reshape(-1)  # (E*R,) in merged order
    src_flat = src.t().reshape(-1)
    dst_flat = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    return torch.repeat_interleave(src_flat - dst_flat, sizes, output_size=total) + torch.arange(
        total, dtype=torch.int64
    )
