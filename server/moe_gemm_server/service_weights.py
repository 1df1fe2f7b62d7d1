"""The Service's weight sets: upload, check, warm, persist and install; delete.

An upload is streamed to a temp file in the data directory, read and checked, copied to the
device and warmed (Engine.prepare_weights) outside the weights lock, then committed to disk
atomically and swapped in under it: the set is acknowledged only when durable, and a failed
upload leaves the previous version as it was. The commit and the swap run to their end even
if the request is cancelled meanwhile (disk and memory then agree). An upload with the same
content as one of the same name still in progress (a PUT repeated after a timeout) waits for
that one and answers with its outcome. Held by a mixin the Service inherits; the resident
budget an upload is admitted under is resident_budget.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from starlette.requests import Request

from moe_gemm_server.engine import Engine, WeightSet, is_out_of_memory

from .codecs import encode_safetensors, json_dtype, json_tensor3, parse_json_object
from .config import Settings
from .errors import APIError, unavailable, unprocessable
from .faults import is_no_space
from .limits import BODY_FLAG, WEIGHT_FLAG, BodyLimit, BodyTooLarge, content_length, read_body
from .metrics import Metrics, StatsBook
from .resident_budget import ResidentBudget
from .storage import (
    CommitInDoubt,
    WeightStore,
    check_name,
    check_weight_header,
    header_in,
    read_weight_file,
    resident_bytes,
)

if TYPE_CHECKING:
    from .sync import StoreWatcher

# Records keep the service's logger name (what operators filter on).
log = logging.getLogger("moe_gemm_server.service")

WRITE_CHUNK = 4 << 20

SAFETENSORS_TYPES = ("application/octet-stream", "application/safetensors",
                     "application/x-safetensors")


def media_type(request: Request) -> str | None:
    """The Content-Type's media type, lowercased, without its parameters; None where the
    request has no Content-Type (its body is then read as safetensors). A header naming no
    type (`; charset=utf-8`) gives "", which no route takes (415), rather than passing for
    an absent one."""
    raw = request.headers.get("content-type")
    return None if raw is None else raw.split(";")[0].strip().lower()


# A safetensors header longer than this is checked in a worker thread (a long one takes a while
# to parse, and on the event loop that would stall every other request).
OFF_LOOP_HEADER_BYTES = 1 << 20

T = TypeVar("T")


@dataclass(eq=False)  # (one upload is equal only to itself: list.remove must not compare tensors)
class Upload:
    """An upload past its checks and not yet installed or failed (or a load of a set another
    server wrote: sync.py): what it stores, and, once `done` is set, the set it committed and
    installed (None: it failed, or it was a load, whose file this server did not commit)."""

    tensor: torch.Tensor
    layout: str
    scale: torch.Tensor | None
    nbytes: int
    done: asyncio.Event = field(default_factory=asyncio.Event)
    ws: WeightSet | None = None

    def same(self, tensor: torch.Tensor, layout: str, scale: torch.Tensor | None) -> bool:
        """Whether an upload of (tensor, layout, scale) stores the same set, bit for bit."""
        return (layout == self.layout and _same_bits(tensor, self.tensor)
                and (scale is None) == (self.scale is None)
                and (scale is None or _same_bits(scale, self.scale)))


def upload_limit(settings: Settings, content_type: str) -> BodyLimit:
    """The body limit of a weight upload. Safetensors is streamed to disk: --max-weight-bytes.
    JSON is parsed whole in memory, as Python objects several times its size (and holding the
    interpreter for seconds per 100 MB), so it also takes --max-body-bytes, as JSON bodies
    on every other route do: the smaller of the two."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == "application/json" and settings.max_body_bytes < settings.max_weight_bytes:
        return BodyLimit(settings.max_body_bytes, BODY_FLAG)
    return BodyLimit(settings.max_weight_bytes, WEIGHT_FLAG)


class WeightsMixin(ResidentBudget):
    """Service's weight-set methods (Service inherits them).

    They use the Service's settings, engine, store, watcher, metrics and stats, the weights
    lock (one install or delete at a time), the resident budget (ResidentBudget, which
    counts the bytes reserved by uploads in flight), and `_check_fatal` (a device error
    during an upload is the process's end).
    """

    settings: Settings
    engine: Engine | None
    store: WeightStore
    watcher: StoreWatcher
    metrics: Metrics
    stats: StatsBook
    not_ready_reason: str
    _weights_lock: asyncio.Lock | None
    _uploads: dict[str, list[Upload]]  # name -> uploads and loads of it in progress

    async def weight_set(self, name: str) -> WeightSet:
        """The resident set `name`: 422 for a name no set can have (as PUT and DELETE answer),
        507 or 503 for a stored set left out of memory (sync.StoreWatcher.left_out), 404 for
        any other name. A name not resident costs one look at the data directory first
        (sync.StoreWatcher.load_new): a set another server sharing it has just written is
        loaded and served now, not 404 until the next rescan."""
        assert self.engine is not None
        check_name(name)
        try:
            return self.engine.get_weights(name)
        except KeyError:
            pass
        try:
            await self.watcher.load_new(name)
        except Exception as e:
            if self._check_fatal(e):
                raise unavailable(f"not ready: {self.not_ready_reason}") from None
            raise
        try:
            return self.engine.get_weights(name)
        except KeyError:
            pass
        error = self.watcher.left_out(name)
        if error is None:
            raise APIError(404, f"unknown weight set {name!r}")
        raise error

    def not_loaded(self) -> list[dict[str, object]]:
        """The stored sets left out of memory, by name: {"name", "status", "error"} (what a
        request for one is answered), for the listing. A resident set whose newer file failed
        to load is served, so not one of them."""
        assert self.engine is not None
        resident = {ws.name for ws in self.engine.weight_sets()}
        out = []
        for name in sorted(set(self.watcher.failed) - resident):
            error = self.watcher.left_out(name)
            if error is not None:
                out.append({"name": name, "status": error.status, "error": error.message})
        return out

    def _update_weight_metrics(self) -> None:
        assert self.engine is not None
        self.metrics.resident_bytes.set(self.engine.resident_bytes)
        self.metrics.weight_sets.set(len(self.engine.weight_sets()))

    async def put_weights(self, name: str, request: Request) -> tuple[WeightSet, bool]:
        """Receive, check, warm, persist and install a weight set. Returns (set, created)."""
        assert self.engine is not None and self._weights_lock is not None
        check_name(name)
        _check_no_encoding(request)
        what = (f"weight set {name!r} was not stored and its previous version, if any, is "
                "unchanged")
        temps = contextlib.ExitStack()
        try:
            # (held locked while the upload runs: a server starting on a shared directory
            # removes only the temp files of crashed uploads, storage.cleanup_temp)
            temp = temps.enter_context(self.store.temp_file())
            # Checked once the temp file exists, before the body is received: it is then on
            # the directory the sets came from, and if that goes before the commit, the rename
            # of the temp file out of it fails (507) rather than storing the set elsewhere.
            await asyncio.to_thread(self._check_data_dir, what)
            await asyncio.to_thread(self._check_obstruction, name, what)
            ctype = media_type(request)
            if ctype == "application/json":
                limit = upload_limit(self.settings, ctype)
                body = await read_body(request, limit.bytes, allow_encoding=False,
                                       flag=limit.flag)
                data = await asyncio.to_thread(_json_weights, body)
                await asyncio.to_thread(_write_file, temp, data)
            elif ctype is None or ctype in SAFETENSORS_TYPES:
                declared = content_length(request.scope)
                await _stream_to_file(request, temp, self.settings.max_weight_bytes,
                                      lambda head: self._check_header(name, head, declared))
            else:
                raise APIError(415, f"unsupported Content-Type {ctype!r}; send safetensors "
                                    "(application/octet-stream) or application/json")
            tensor, layout, scale = await asyncio.to_thread(read_weight_file, temp, True)
            twin = await self._twin_of(name, tensor, layout, scale)
            if twin is not None:
                log.info("weight set %r: the same content as an upload of it that was in "
                         "progress, which stored it: %s", name, twin.info())
                return twin, False
            nbytes = resident_nbytes(tensor, scale)
            with self._reserve(name, nbytes), self._in_progress(
                    name, Upload(tensor, layout, scale, nbytes)) as upload:
                try:
                    ws = await asyncio.to_thread(functools.partial(
                        self.engine.prepare_weights, name, tensor, layout, scale=scale))
                except (ValueError, TypeError) as e:
                    raise unprocessable(str(e)) from None
                async with self._weights_lock:
                    # (a stored set left out of memory is replaced, not created: it was no
                    # unknown set, 404, but a 507 or a 503)
                    left_out = name in self.watcher.failed
                    old = await _to_the_end(self._commit_and_install(temp, ws, upload))
            created = old is None and not left_out
            log.info("weight set %r %s: %s", name, "created" if created else "replaced",
                     ws.info())
            return ws, created
        except CommitInDoubt as e:
            raise in_doubt_error(self.store.root, e, f"weight set {name!r} was renamed into "
                                 "place, and the rename could not be undone: the set may be "
                                 "stored or not (GET it, or upload it again)") from None
        except OSError as e:
            if is_no_space(e):
                raise APIError(507, f"the data directory {self.store.root} is full "
                                    f"({e.strerror}); {what}", reason="no_space") from None
            if e.errno == errno.EFBIG:
                raise APIError(507, f"the data directory {self.store.root} cannot hold a file "
                                    f"this large ({e.strerror}: a file-size limit of the "
                                    f"filesystem or of the process); {what}",
                               reason="no_space") from None
            raise storage_error(self.store.root, e, what) from None
        except Exception as e:
            if self._check_fatal(e):
                raise unavailable(f"not ready: {self.not_ready_reason}") from None
            if is_out_of_memory(e):  # (the device's, or the host's: reading the body too)
                raise APIError(507, f"weight set {name!r} does not fit in device memory "
                                    f"({self.memory_report()}): {e}; delete a set or set "
                                    "--max-resident-bytes", reason="out_of_memory") from None
            raise
        finally:
            temps.close()

    async def _commit_and_install(self, temp: Path, ws: WeightSet, upload: Upload
                                  ) -> WeightSet | None:
        """Commit the upload's file and swap its set in (under the weights lock); returns the
        version it replaced."""
        assert self.engine is not None
        # The identity of the file we wrote, not of whatever holds the name now (another
        # replica's rename may already have replaced ours: storage.commit).
        fid = await asyncio.to_thread(self.store.commit, temp, ws.name)
        old = self.engine.install(ws)
        self.watcher.record(ws.name, fid)
        self._update_weight_metrics()
        upload.ws = ws
        return old

    @contextlib.contextmanager
    def _in_progress(self, name: str, upload: Upload) -> Iterator[Upload]:
        """Count `upload` among the uploads of `name` in progress until the block ends, then
        tell those waiting for it (_twin_of) its outcome."""
        self._uploads.setdefault(name, []).append(upload)
        try:
            yield upload
        finally:
            self._uploads[name].remove(upload)
            if not self._uploads[name]:
                del self._uploads[name]
            upload.done.set()

    async def _twin_of(self, name: str, tensor: torch.Tensor, layout: str,
                       scale: torch.Tensor | None) -> WeightSet | None:
        """The set stored by an upload of `name` in progress with this same content, once it
        is stored: a PUT repeated because its answer did not come in time (a client's retry
        after a timeout) is then answered with the outcome of the first one, rather than 507
        for counting the same bytes twice against the budget while the first one goes on to
        store the set. None if there is none, or it failed (this upload then goes on alone, as
        it does after a load of the same set from the directory: that one ends with the set
        resident, so its bytes are no longer counted twice, but not committed by this server
        (the other one may still undo its rename: storage.commit), so it acknowledges nothing)."""
        for upload in list(self._uploads.get(name, ())):
            if await asyncio.to_thread(upload.same, tensor, layout, scale):
                await upload.done.wait()
                if upload.ws is not None:
                    return upload.ws
        return None

    async def _check_header(self, name: str, head: bytearray, declared: int | None) -> bool:
        """Refuse a safetensors upload from its first bytes, with the answer its whole body
        would get: a malformed header (400), tensors the route does not take (422), a body over
        --max-weight-bytes by the header's own layout (413, when no Content-Length said so
        before), a set over the resident budget (507). A multi-GB body is then neither
        received nor written to disk to be refused. Returns False until the header is in."""
        if not header_in(head, declared):
            return False
        if len(head) > OFF_LOOP_HEADER_BYTES:
            size, nbytes = await asyncio.to_thread(check_weight_header, head, declared)
        else:
            size, nbytes = check_weight_header(head, declared)
        if declared is None and size > self.settings.max_weight_bytes:
            raise BodyTooLarge(self.settings.max_weight_bytes, flag=WEIGHT_FLAG)
        # (checked again, and reserved, once it is read; not now when an upload of this name
        # and size is in progress: this one may be a retry of it, told apart by its content)
        if not any(u.nbytes == nbytes for u in self._uploads.get(name, ())):
            self._check_budget(name, nbytes)
        return True

    def _check_obstruction(self, name: str, what: str) -> None:
        """409 where the set's file name in the data directory holds something other than a
        file (a directory made there by hand): no upload can be renamed over it, and no delete
        removes it; an operator must."""
        thing = self.store.obstruction(name)
        if thing is not None:
            raise APIError(409, f"the data directory {self.store.root} holds {thing} at "
                                f"{self.store.path_for(name).name}, where weight set {name!r} "
                                f"would be stored; {what} (remove it from the data directory)")

    def _check_data_dir(self, what: str) -> None:
        """507 while the data directory's path names another directory than the one the
        resident sets were loaded from (sync.py: a volume unmounted from under it): a set
        written there now would be hidden once the volume is back, a delete there would
        remove nothing, and both would be acknowledged."""
        home = self.watcher.home
        if home is None:
            return
        try:
            here = self.store.dir_id()
        except OSError as e:
            raise storage_error(self.store.root, e, what) from None
        if here != home:
            raise APIError(507, f"the data directory {self.store.root} is not the directory "
                                "the resident weight sets were loaded from (its volume "
                                f"unmounted?); {what}; restart the server if the volume was "
                                "replaced on purpose", reason="not_writable")

    async def delete_weights(self, name: str) -> None:
        assert self.engine is not None and self._weights_lock is not None
        async with self._weights_lock:
            await asyncio.to_thread(self._check_data_dir, f"weight set {name!r} was not deleted")
            await asyncio.to_thread(self._check_obstruction, name, "nothing was deleted")
            on_disk, ws = await _to_the_end(self._delete(name))
        if not on_disk and ws is None:
            raise APIError(404, f"unknown weight set {name!r}")
        self.stats.forget(name, None if ws is None else ws.version)
        log.info("weight set %r deleted", name)

    async def _delete(self, name: str) -> tuple[bool, WeightSet | None]:
        """Delete the set's file, then drop it from memory (under the weights lock):
        (whether there was a file, the set dropped)."""
        assert self.engine is not None
        try:
            on_disk = await asyncio.to_thread(self.store.delete, name)
        except CommitInDoubt as e:
            raise in_doubt_error(self.store.root, e, f"weight set {name!r} was deleted, and "
                                 "its file could not be put back: the set may be deleted or "
                                 "not (GET it, or delete it again)") from None
        except OSError as e:
            raise storage_error(self.store.root, e, f"weight set {name!r} was not "
                                "deleted") from None
        ws = self.engine.remove_weights(name)
        self.watcher.record(name, None)
        self._update_weight_metrics()
        return on_disk, ws


async def _to_the_end(aw: Awaitable[T]) -> T:
    """Await `aw` to its end even if the caller is cancelled meanwhile, then raise the
    cancellation. For a change of the data directory and the same change in memory: the file
    operation runs in a worker thread that a cancellation does not stop, so the memory side
    must run too (else the new file would be served only after the next rescan or restart,
    though the request was never answered, while this server serves the old version)."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})  # (unlike a plain await, leaves the task running)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled and task.exception() is None:
        raise asyncio.CancelledError
    return task.result()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def in_doubt_error(root: Path, e: OSError, what: str) -> APIError:
    """507 for a change of the data directory whose flush failed and could not be undone
    (storage.CommitInDoubt): `what` says what happened and what the client can do."""
    return APIError(507, f"the data directory {root} could not be flushed ({e.strerror}) "
                         f"after {what}", reason="not_writable")


def storage_error(root: Path, e: OSError, what: str) -> APIError:
    """507 for a data directory that cannot be written (read-only, permissions, I/O error):
    not a server bug (500), and the message says which directory and why."""
    return APIError(507, f"the data directory {root} cannot be written "
                         f"({e.strerror or type(e).__name__}); {what}", reason="not_writable")


def resident_nbytes(tensor: torch.Tensor, scale: torch.Tensor | None) -> int:
    """storage.resident_bytes of a loaded set."""
    return resident_bytes(tensor.numel() * tensor.element_size(),
                          None if scale is None else scale.numel())


def _check_no_encoding(request: Request) -> None:
    """415 for a compressed upload, JSON or safetensors alike (docs/HTTP-API.md: weight uploads
    take no encoding; a safetensors upload is streamed to disk as sent), before reading it."""
    enc = request.headers.get("content-encoding", "identity").strip().lower()
    if enc not in ("", "identity"):
        raise APIError(415, f"weight uploads take no Content-Encoding; got {enc!r}")


async def _stream_to_file(request: Request, path: Path, limit: int,
                          check_head: Callable[[bytearray], Awaitable[bool]] | None = None
                          ) -> None:
    """Write the body to `path` as it arrives (at most `limit` bytes, else 413).

    check_head: given the body's first bytes as they arrive, True once it has checked them
        (it raises to refuse the body); the rest of the body is not read before it returns.
    """
    total = 0
    buf = bytearray()
    head: bytearray | None = bytearray() if check_head is not None else None
    f = await asyncio.to_thread(open, path, "wb")
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise BodyTooLarge(limit, flag=WEIGHT_FLAG)
            if head is not None and check_head is not None:
                head += chunk
                if await check_head(head):
                    head = None
            buf += chunk
            if len(buf) >= WRITE_CHUNK:
                data, buf = bytes(buf), bytearray()
                await asyncio.to_thread(f.write, data)
        if buf:
            await asyncio.to_thread(f.write, bytes(buf))
        await asyncio.to_thread(f.flush)
    except APIError as e:
        # Refused with the rest of the body unread: the connection cannot carry another
        # request (uvicorn closes it); say so, as the 413 from Content-Length does.
        e.headers.setdefault("Connection", "close")
        raise
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
