"""Replicas over one data directory: each notices the weight sets the others write or delete.

Several servers (Kubernetes replicas on a ReadWriteMany volume, Ray Serve replicas on one
host or a shared file system) can share one data directory. An upload through any of them
writes `<name>.safetensors` atomically (storage.py: temp file, fsync, rename), so the others
only ever see a whole file. Each server rescans the directory every --sync-interval-s seconds
and, for every file whose identity (inode, size, mtime) differs from the one it loaded, loads,
checks, warms and installs it; a set whose file is gone is removed. A set that cannot be loaded
(corrupt, over the budget) is logged once per file version and left out.

So an upload acknowledged by one replica is served by every replica within one interval (plus
the load and warm-up time), and a replica started later loads everything at start. Serving
never waits for a rescan: the scan and loads run in worker threads, and a set is swapped in
atomically as for an upload.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import TYPE_CHECKING

from .errors import APIError
from .service_weights import resident_nbytes
from .storage import FileId, file_id_of

if TYPE_CHECKING:
    from .service import Service

log = logging.getLogger(__name__)

class StoreWatcher:
    """What this server loaded from the data directory, and the rescans that catch up."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.loaded: dict[str, FileId] = {}  # name -> the file version installed
        self.failed: dict[str, FileId] = {}  # name -> a file version that could not load
        self.rescans = 0

    def file_id(self, name: str) -> FileId | None:
        try:
            st = os.stat(self.service.store.path_for(name))
        except FileNotFoundError:
            return None
        return file_id_of(st)

    def record(self, name: str, fid: FileId | None) -> None:
        """This server installed `name` from the file version `fid` (or removed it: None)."""
        self.failed.pop(name, None)
        if fid is None:
            self.loaded.pop(name, None)
        else:
            self.loaded[name] = fid

    async def rescan(self) -> int:
        """One pass: load new or changed sets, drop deleted ones. Returns the changes made."""
        svc = self.service
        assert svc.engine is not None and svc._weights_lock is not None
        self.rescans += 1
        try:
            names = await asyncio.to_thread(svc.store.names)
        except OSError as e:
            # The directory itself is unreadable (unmounted, moved, permissions): that says
            # nothing about which sets were deleted, so every resident set stays served.
            log.warning("cannot list the data directory %s (%s); resident weight sets are kept",
                        svc.store.root, e.strerror or e)
            return 0
        on_disk = {n: fid for n in names if (fid := self.file_id(n)) is not None}
        changes = 0
        gone = set(self.loaded) - set(on_disk)
        if gone:
            # A file listed but not found by its stat may be a delete, or the directory
            # moved away between the two: only a listing taken after the stat tells them apart.
            try:
                listed_now = set(await asyncio.to_thread(svc.store.names))
            except OSError as e:
                log.warning("cannot list the data directory %s (%s); resident weight sets are "
                            "kept", svc.store.root, e.strerror or e)
                return 0
            gone -= listed_now
        for name in gone:
            async with svc._weights_lock:
                if self.file_id(name) is None and name in self.loaded:
                    gone = svc.engine.remove_weights(name)
                    self.record(name, None)
                    svc.stats.forget(name, None if gone is None else gone.version)
                    changes += 1
                    log.info("weight set %r removed (deleted by another server)", name)
        for name, fid in sorted(on_disk.items()):
            if self.loaded.get(name) == fid or self.failed.get(name) == fid:
                continue
            changes += await self._load(name, fid)
        if changes:
            svc._update_weight_metrics()
        return changes

    async def _load(self, name: str, fid: FileId) -> int:
        svc = self.service
        assert svc.engine is not None and svc._weights_lock is not None
        try:
            tensor, layout, scale = await asyncio.to_thread(svc.store.load, name)
            svc._check_budget(name, resident_nbytes(tensor, scale))
            ws = await asyncio.to_thread(functools.partial(svc.engine.prepare_weights, name,
                                                           tensor, layout, scale=scale))
        except FileNotFoundError:
            return 0  # deleted meanwhile: the next pass sees it
        except Exception as e:
            if svc._check_fatal(e):
                raise
            msg = e.message if isinstance(e, APIError) else f"{type(e).__name__}: {e}"
            self.failed[name] = fid
            svc.load_errors[name] = msg
            svc.metrics.weight_load_errors.inc()
            log.error("could not load weight set %r written by another server: %s", name, msg)
            return 0
        async with svc._weights_lock:
            # Install only if the file is still the version read (an upload through this
            # server, which holds the lock while it commits, may have replaced it since).
            if self.file_id(name) != fid:
                return 0
            old = svc.engine.install(ws)
            self.record(name, fid)
            svc.load_errors.pop(name, None)
        log.info("weight set %r %s from the shared data directory: %s", name,
                 "reloaded" if old else "loaded", ws.info())
        return 1

    async def run(self, interval_s: float) -> None:
        """Rescan every `interval_s` seconds until cancelled (errors are logged, not fatal)."""
        while True:
            await asyncio.sleep(interval_s)
            if self.service.fatal_error is not None or self.service.draining:
                return
            try:
                await self.rescan()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bad pass must not end the watching
                if self.service.fatal_error is not None:
                    return
                log.exception("rescan of the data directory failed")
