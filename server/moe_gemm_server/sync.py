"""Replicas over one data directory: each notices the weight sets the others write or delete.

Several servers (Kubernetes replicas on a ReadWriteMany volume, Ray Serve replicas on one
host or a shared file system) can share one data directory. An upload through any of them
writes `<name>.safetensors` atomically (storage.py: temp file, fsync, rename), so the others
only ever see a whole file. Each server rescans the directory every --sync-interval-s seconds
and, for every file whose identity (inode, size, mtime) differs from the one it loaded, loads,
checks, warms and installs it; a set whose file is gone is removed. A set that cannot be loaded
(corrupt, over the budget) is logged once per file version and left out; one left out for the
budget alone is loaded by a later pass once its bytes fit (they may have been held only for a
while, by an upload in progress or a set since deleted), its file not read again before then.

So an upload acknowledged by one replica is served by every replica within one interval (plus
the load and warm-up time), and a replica started later loads everything at start. A request
for a set that is not resident does not wait for that interval: it looks at the set's own file
(one stat, `load_new`) and loads a version not tried yet before it answers, so a client that
reads back what it has just uploaded, through any replica, never meets a 404 (a set only
replaced, still resident here in its old version, waits for the rescan). One load of a name
runs at a time (`load_once`): the requests and the rescan that want it join it. Serving
never waits for a rescan: the scan and loads run in worker threads, and a set is swapped in
atomically as for an upload. A set loaded here holds its bytes in the resident budget from its
check to its install, as an upload does (resident_budget.ResidentBudget._reserve).

A listing says which sets were deleted only if it is a listing of the directory they were
loaded from. A shared volume unmounted from under the data directory leaves its mountpoint, an
empty directory of the parent filesystem, that lists fine: read as deletes, every set would be
dropped (every request 404 while ready said 200). So the watcher keeps the identity
(st_dev, st_ino) of the directory the sets came from (`home`); a directory that is now another
one and holds none of the resident sets is taken for the volume gone, not for deletes: the
pass changes nothing, a warning is logged once, uploads and deletes answer 507 (they would
land on the wrong filesystem), and syncing resumes when the path is that directory again, or
lists resident sets again (the volume remounted: a new st_dev). Every set deleted from the
directory itself is still a delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import stat
from typing import TYPE_CHECKING

from moe_gemm_server.engine import is_out_of_memory

from .errors import WEIGHT_SET_UNREADABLE, APIError
from .resident_budget import OverBudget
from .service_weights import Upload, resident_nbytes
from .storage import DirId, FileId, file_id_of

if TYPE_CHECKING:
    from .service import Service

log = logging.getLogger(__name__)

class StoreWatcher:
    """What this server loaded from the data directory, and the rescans that catch up."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.loaded: dict[str, FileId] = {}  # name -> the file version installed
        self.failed: dict[str, FileId] = {}  # name -> a file version that could not load
        # name -> the resident bytes of a failed version left out for the budget alone
        self.waiting: dict[str, int] = {}
        # names whose failed version did not fit (the budget, device memory): 507, not 503
        self.unfit: set[str] = set()
        self.rescans = 0
        # The directory the resident sets come from (set at the start, then by every pass
        # that takes the listing for the truth), and whether the path now names another one.
        self.home: DirId | None = None
        self.away = False
        # name -> the load of it in progress (a rescan's, or one a request for it started):
        # whoever else wants the set loaded joins it rather than reading the file twice
        self.loading: dict[str, asyncio.Task[int]] = {}

    def file_id(self, name: str) -> FileId | None:
        """The identity of the set's file, None where there is none (a directory or another
        entry that is no file at that name is none either: the listing skips it too, and a
        load of it would fail for good, making the name 503 instead of 404)."""
        try:
            st = os.stat(self.service.store.path_for(name))
        except FileNotFoundError:
            return None
        return file_id_of(st) if stat.S_ISREG(st.st_mode) else None

    def record(self, name: str, fid: FileId | None) -> None:
        """This server installed `name` from the file version `fid` (or removed it: None)."""
        self.forget_failure(name)
        if fid is None:
            self.loaded.pop(name, None)
        else:
            self.loaded[name] = fid

    def record_failure(self, name: str, fid: FileId, exc: BaseException) -> None:
        """The file version `fid` of `name` could not be loaded (`exc`): it is not tried again,
        unless it was refused for the budget alone and its bytes fit now (retry)."""
        self.failed[name] = fid
        if isinstance(exc, OverBudget):
            self.waiting[name] = exc.nbytes
        else:
            self.waiting.pop(name, None)
        if isinstance(exc, OverBudget) or is_out_of_memory(exc):
            self.unfit.add(name)
        else:
            self.unfit.discard(name)

    def forget_failure(self, name: str) -> None:
        """`name` is installed, removed or its file gone: no failed version of it is kept."""
        self.failed.pop(name, None)
        self.waiting.pop(name, None)
        self.unfit.discard(name)
        self.service.load_errors.pop(name, None)

    def left_out(self, name: str) -> APIError | None:
        """The answer to a request for `name` whose stored file could not be loaded (None
        where no failure of it is known): a set that exists on disk is not "unknown" (404).
        507 where it did not fit (the budget, device memory), the status of an upload that
        does not fit, quoting the memory in use at this moment (the load's numbers may be long
        out of date); 503 where its file could not be read as a set, with the code
        WEIGHT_SET_UNREADABLE and no Retry-After: retrying does not cure it, an upload or a
        delete of the set does."""
        if name not in self.failed:
            return None
        why = self.service.load_errors.get(name, "it could not be loaded")
        if name in self.unfit:
            every = self.service.settings.sync_interval_s
            if name not in self.waiting:  # (device memory: no rescan tries it again)
                when = "delete a set, then upload it again (or restart the server)"
            elif every > 0:
                when = ("it is loaded once it fits, by a request for it or a rescan of the data "
                        f"directory (every {every:g} s)")
            else:
                when = ("it is loaded once it fits, by a request for it (rescans are off: "
                        "--sync-interval-s 0) or a restart")
            return APIError(507, f"weight set {name!r} is stored but not loaded, as it does not "
                                 f"fit: {self._unfit_now(name, why)}; {when}",
                            reason="over_budget" if name in self.waiting else "out_of_memory")
        return APIError(503, f"weight set {name!r} is stored but its file could not be loaded: "
                             f"{why}; upload it again or delete it", reason="not_loaded",
                        code=WEIGHT_SET_UNREADABLE)

    def _unfit_now(self, name: str, why: str) -> str:
        """Why the stored set `name` is left out of memory, in the numbers of this moment:
        for the budget, what it needs against what is free now; for device memory, the load's
        error (`why`) and what the device holds and has free now."""
        svc = self.service
        nbytes = self.waiting.get(name)
        if nbytes is None:
            return f"its load ran out of memory ({why}); now {svc.memory_report()}"
        if svc.fits_budget(name, nbytes):  # (room made since: the next load takes it)
            return (f"it needs {nbytes} bytes, which were not free when it was loaded; now "
                    f"{svc.budget_report(name)}")
        return f"it needs {nbytes} bytes but only {svc.budget_report(name)}"

    def retry(self, name: str) -> bool:
        """Whether the failed version of `name` was refused for the budget and fits now (a
        check of numbers only: no pass reads its file until then)."""
        nbytes = self.waiting.get(name)
        return nbytes is not None and self.service.fits_budget(name, nbytes)

    async def rescan(self) -> int:
        """One pass: load new or changed sets, drop deleted ones. Returns the changes made."""
        svc = self.service
        assert svc.engine is not None and svc._weights_lock is not None
        self.rescans += 1
        try:
            here = await asyncio.to_thread(svc.store.dir_id)  # (taken before the listing)
            names = await asyncio.to_thread(svc.store.names)
        except OSError as e:
            # The directory itself is unreadable (unmounted, moved, permissions): that says
            # nothing about which sets were deleted, so every resident set stays served.
            log.warning("cannot list the data directory %s (%s); resident weight sets are kept",
                        svc.store.root, e.strerror or e)
            return 0
        if self._elsewhere(here, names):
            return 0
        for name in set(self.failed) - set(names):  # (failed files deleted since)
            self.forget_failure(name)
        on_disk = {n: fid for n in names if (fid := self.file_id(n)) is not None}
        changes = 0
        gone = set(self.loaded) - set(on_disk)
        if gone:
            # A file listed but not found by its stat may be a delete, or the directory
            # moved away between the two: only a listing taken after the stat tells them apart,
            # and only if the path still names the directory it named before the first one.
            try:
                listed_now = set(await asyncio.to_thread(svc.store.names))
                there = await asyncio.to_thread(svc.store.dir_id)
            except OSError as e:
                log.warning("cannot list the data directory %s (%s); resident weight sets are "
                            "kept", svc.store.root, e.strerror or e)
                return 0
            if there != here:
                return 0  # (changed during this pass: the next one sees where it settled)
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
            if self.loaded.get(name) == fid or (self.failed.get(name) == fid
                                                and not self.retry(name)):
                continue
            changes += await self.load_once(name, fid)
        if changes:
            svc._update_weight_metrics()
        self.home = here
        return changes

    def _elsewhere(self, here: DirId, names: list[str]) -> bool:
        """True when the data directory's path names another directory than the one the
        resident sets came from and lists none of them: a volume unmounted from under it (or
        another directory put in its place), which says nothing about deletes (module
        docstring). Logs when that begins (once, not at every pass) and when it ends."""
        if self.home is None or here == self.home or not self.loaded or (
                set(names) & set(self.loaded)):
            if self.away:
                self.away = False
                log.info("the data directory %s is back (it is the directory the resident "
                         "weight sets came from, or lists them again); syncing resumes",
                         self.service.store.root)
            return False
        if not self.away:
            self.away = True
            log.warning(
                "the data directory %s is now another directory (filesystem %d, inode %d; the "
                "resident weight sets came from filesystem %d, inode %d) and lists none of "
                "the %d resident set(s): taken for its volume unmounted, not for deletes. The "
                "resident sets are kept, uploads and deletes are refused (507) and syncing "
                "waits until it is back", self.service.store.root, here[0], here[1],
                self.home[0], self.home[1], len(self.loaded))
        return True

    async def load_new(self, name: str) -> None:
        """Load `name` now if the data directory holds a version of it this server has not
        tried: what a request for a set that is not resident does before it answers 404, so
        that a set another server has just written is served at once, not after the next
        rescan. It costs one stat of the set's file (no listing: a client asking for unknown
        names makes no rescans). As in a rescan, a version that failed to load is not read
        again, unless it was left out for the budget alone and fits now."""
        svc = self.service
        assert svc.engine is not None
        if svc.draining or svc.fatal_error is not None:
            return  # (as the rescans, which stop then)
        fid = await asyncio.to_thread(self.file_id, name)
        if fid is None or fid == self.loaded.get(name) or (
                fid == self.failed.get(name) and not self.retry(name)):
            return
        # An upload of the set through this server in progress (the file may be its own,
        # committed and not yet installed): what it installs is what the request wants, not
        # a second read and warm-up of the same file.
        for upload in list(svc._uploads.get(name, ())):
            await upload.done.wait()
        with contextlib.suppress(KeyError):
            svc.engine.get_weights(name)
            return
        await self.load_once(name, fid)

    async def load_once(self, name: str, fid: FileId) -> int:
        """_load, or the load of `name` already in progress: one read of the file however
        many ask for it at once. The load runs to its end even if the caller is cancelled."""
        task = self.loading.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(name, fid))
            self.loading[name] = task
            task.add_done_callback(lambda done: self._loaded(name, done))
        return await asyncio.shield(task)

    def _loaded(self, name: str, task: asyncio.Task[int]) -> None:
        """The load `task` of `name` has ended: the next one wanting the set starts anew."""
        if self.loading.get(name) is task:
            del self.loading[name]

    async def cancel_loads(self) -> None:
        """Cancel the loads in progress (the server stops) and wait for them to end."""
        tasks = list(self.loading.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _load(self, name: str, fid: FileId) -> int:
        svc = self.service
        assert svc.engine is not None and svc._weights_lock is not None
        with contextlib.ExitStack() as reservation:
            try:
                tensor, layout, scale = await asyncio.to_thread(svc.store.load, name)
                # Its bytes count in the budget until it is installed (or fails): an upload
                # through this server meanwhile must not pass a check that misses them.
                nbytes = resident_nbytes(tensor, scale)
                reservation.enter_context(svc._reserve(name, nbytes))
                # (an upload of the same content meanwhile, a retry, waits for this load
                # rather than being refused for these bytes counted twice)
                reservation.enter_context(svc._in_progress(
                    name, Upload(tensor, layout, scale, nbytes)))
                ws = await asyncio.to_thread(functools.partial(svc.engine.prepare_weights, name,
                                                               tensor, layout, scale=scale))
            except FileNotFoundError:
                return 0  # deleted meanwhile: the next pass sees it
            except Exception as e:
                if svc._check_fatal(e):
                    raise
                msg = e.message if isinstance(e, APIError) else f"{type(e).__name__}: {e}"
                self.record_failure(name, fid, e)
                svc.load_errors[name] = msg
                svc.metrics.weight_load_errors.inc()
                log.error("could not load weight set %r written by another server: %s", name,
                          msg)
                return 0
            async with svc._weights_lock:
                # Install only if the file is still the version read (an upload through this
                # server, which holds the lock while it commits, may have replaced it since).
                if self.file_id(name) != fid:
                    return 0
                old = svc.engine.install(ws)
                self.record(name, fid)
                svc._update_weight_metrics()
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
