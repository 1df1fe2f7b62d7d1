"""The Service's weight sets: upload, check, warm, persist and install; delete.

An upload is streamed to a temp file in the data directory, read and checked, copied to the
device and warmed (Engine.prepare_weights) outside the weights lock, then committed to disk
atomically and swapped in under it: the set is acknowledged only when durable, and a failed
upload leaves the previous version as it was. Held by a mixin the Service inherits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from starlette.requests import Request

from moe_gemm_server.engine import Engine, EngineOutOfMemory, WeightSet

from .codecs import encode_safetensors, json_dtype, json_tensor3, parse_json_object
from .config import Settings
from .errors import APIError, unavailable, unprocessable
from .faults import is_no_space
from .limits import WEIGHT_FLAG, BodyTooLarge, read_body
from .metrics import Metrics, StatsBook
from .storage import WeightStore, check_name, read_weight_file

if TYPE_CHECKING:
    from .sync import StoreWatcher

# Records keep the service's logger name (what operators filter on).
log = logging.getLogger("moe_gemm_server.service")

WRITE_CHUNK = 4 << 20

SAFETENSORS_TYPES = ("", "application/octet-stream", "application/safetensors",
                     "application/x-safetensors")


class WeightsMixin:
    """Service's weight-set methods (Service inherits them).

    They use the Service's settings, engine, store, watcher, metrics and stats, the weights
    lock (one install or delete at a time), the bytes reserved by uploads in flight, and
    `_check_fatal` (a device error during an upload is the process's end).
    """

    settings: Settings
    engine: Engine | None
    store: WeightStore
    watcher: StoreWatcher
    metrics: Metrics
    stats: StatsBook
    not_ready_reason: str
    _weights_lock: asyncio.Lock | None
    _reserved_bytes: int

    def weight_set(self, name: str) -> WeightSet:
        """The resident set `name`: 422 for a name no set can have (as PUT and DELETE answer),
        404 for a valid name that is not resident."""
        assert self.engine is not None
        check_name(name)
        try:
            return self.engine.get_weights(name)
        except KeyError:
            raise APIError(404, f"unknown weight set {name!r}") from None

    def _update_weight_metrics(self) -> None:
        assert self.engine is not None
        self.metrics.resident_bytes.set(self.engine.resident_bytes)
        self.metrics.weight_sets.set(len(self.engine.weight_sets()))

    async def put_weights(self, name: str, request: Request) -> tuple[WeightSet, bool]:
        """Receive, check, warm, persist and install a weight set. Returns (set, created)."""
        assert self.engine is not None and self._weights_lock is not None
        check_name(name)
        _check_no_encoding(request)
        temps = contextlib.ExitStack()
        try:
            # (held locked while the upload runs: a server starting on a shared directory
            # removes only the temp files of crashed uploads, storage.cleanup_temp)
            temp = temps.enter_context(self.store.temp_file())
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype == "application/json":
                body = await read_body(request, self.settings.max_weight_bytes,
                                       allow_encoding=False, flag=WEIGHT_FLAG)
                data = await asyncio.to_thread(_json_weights, body)
                await asyncio.to_thread(_write_file, temp, data)
            elif ctype in SAFETENSORS_TYPES:
                await _stream_to_file(request, temp, self.settings.max_weight_bytes)
            else:
                raise APIError(415, f"unsupported Content-Type {ctype!r}; send safetensors "
                                    "(application/octet-stream) or application/json")
            tensor, layout, scale = await asyncio.to_thread(read_weight_file, temp, True)
            nbytes = resident_nbytes(tensor, scale)
            self._check_budget(name, nbytes)
            self._reserved_bytes += nbytes  # no await since the check: admission is atomic
            try:
                try:
                    ws = await asyncio.to_thread(functools.partial(
                        self.engine.prepare_weights, name, tensor, layout, scale=scale))
                except (ValueError, TypeError) as e:
                    raise unprocessable(str(e)) from None
                async with self._weights_lock:
                    # The identity of the file we wrote, not of whatever holds the name now
                    # (another replica's rename may already have replaced ours: storage.commit).
                    fid = await asyncio.to_thread(self.store.commit, temp, name)
                    old = self.engine.install(ws)
                    self.watcher.record(name, fid)
                    self._update_weight_metrics()
            finally:
                self._reserved_bytes -= nbytes
            log.info("weight set %r %s: %s", name, "replaced" if old else "created", ws.info())
            return ws, old is None
        except EngineOutOfMemory as e:
            self.metrics.rejections.labels("out_of_memory").inc()
            raise APIError(507, f"weight set {name!r} does not fit in device memory "
                                f"({self.engine.resident_bytes} bytes held by "
                                f"{len(self.engine.weight_sets())} resident set(s)): {e}; "
                                "delete a set or set --max-resident-bytes") from None
        except OSError as e:
            if is_no_space(e):
                self.metrics.rejections.labels("no_space").inc()
                raise APIError(507, f"the data directory {self.store.root} is full "
                                    f"({e.strerror}); weight set {name!r} was not stored and "
                                    "its previous version, if any, is unchanged") from None
            raise storage_error(self.store.root, e, f"weight set {name!r} was not stored and "
                                "its previous version, if any, is unchanged") from None
        except Exception as e:
            if self._check_fatal(e):
                raise unavailable(f"not ready: {self.not_ready_reason}") from None
            raise
        finally:
            temps.close()

    def _check_budget(self, name: str, nbytes: int) -> None:
        """507 if a set of `nbytes` would take the resident sets past --max-resident-bytes
        (a replaced set's bytes count as freed: the swap releases them)."""
        budget = self.settings.max_resident_bytes
        if budget is None:
            return
        assert self.engine is not None
        try:
            replaced = self.engine.get_weights(name).nbytes
        except KeyError:
            replaced = 0
        resident = self.engine.resident_bytes + self._reserved_bytes
        if resident - replaced + nbytes > budget:
            self.metrics.rejections.labels("over_budget").inc()
            # "free" counts the replaced version's bytes; say so, or the free bytes and the
            # bytes held would not add up to the budget
            freed = (f", {replaced} of them by the version of {name!r} this upload replaces"
                     if replaced else "")
            raise APIError(
                507,
                f"weight set {name!r} needs {nbytes} bytes but only "
                f"{max(0, budget - resident + replaced)} of the {budget}-byte resident budget "
                f"(--max-resident-bytes) are free ({resident} bytes held by "
                f"{len(self.engine.weight_sets())} set(s) and uploads in progress{freed}); "
                "delete a set or raise the budget",
            )

    async def delete_weights(self, name: str) -> None:
        assert self.engine is not None and self._weights_lock is not None
        async with self._weights_lock:
            try:
                on_disk = await asyncio.to_thread(self.store.delete, name)
            except OSError as e:
                raise storage_error(self.store.root, e, f"weight set {name!r} was not "
                                    "deleted") from None
            ws = self.engine.remove_weights(name)
            self.watcher.record(name, None)
            self._update_weight_metrics()
        if not on_disk and ws is None:
            raise APIError(404, f"unknown weight set {name!r}")
        self.stats.forget(name, None if ws is None else ws.version)
        log.info("weight set %r deleted", name)


def storage_error(root: Path, e: OSError, what: str) -> APIError:
    """507 for a data directory that cannot be written (read-only, permissions, I/O error):
    not a server bug (500), and the message says which directory and why."""
    return APIError(507, f"the data directory {root} cannot be written "
                         f"({e.strerror or type(e).__name__}); {what}")


def resident_nbytes(tensor: torch.Tensor, scale: torch.Tensor | None) -> int:
    """The bytes a set will hold once resident, as WeightSet.nbytes counts them: the tensor
    and an FP8 set's float32 scale (what --max-resident-bytes budgets)."""
    return tensor.numel() * tensor.element_size() + (0 if scale is None else scale.numel() * 4)


def _check_no_encoding(request: Request) -> None:
    """415 for a compressed upload, JSON or safetensors alike (docs/HTTP-API.md: weight uploads
    take no encoding; a safetensors upload is streamed to disk as sent), before reading it."""
    enc = request.headers.get("content-encoding", "identity").strip().lower()
    if enc not in ("", "identity"):
        raise APIError(415, f"weight uploads take no Content-Encoding; got {enc!r}")


async def _stream_to_file(request: Request, path: Path, limit: int) -> None:
    total = 0
    buf = bytearray()
    f = await asyncio.to_thread(open, path, "wb")
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise BodyTooLarge(limit, flag=WEIGHT_FLAG)
            buf += chunk
            if len(buf) >= WRITE_CHUNK:
                data, buf = bytes(buf), bytearray()
                await asyncio.to_thread(f.write, data)
        if buf:
            await asyncio.to_thread(f.write, bytes(buf))
        await asyncio.to_thread(f.flush)
    finally:
        await asyncio.to_thread(f.close)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _json_weights(body: bytearray) -> bytes:
    """{"w" | "w_t": [[[...]]], "dtype"} -> a safetensors body."""
    obj = parse_json_object(body)
    dtype = json_dtype(obj)
    names = [k for k in obj if k != "dtype"]
    if names not in (["w"], ["w_t"]):
        raise unprocessable("expected exactly one field 'w' (E, K, N) or 'w_t' (E, N, K) "
                            f"(plus 'dtype'); got {names}")
    hint = "(E, K, N)" if names[0] == "w" else "(E, N, K)"
    return encode_safetensors({names[0]: json_tensor3(names[0], obj[names[0]], dtype, hint)})
