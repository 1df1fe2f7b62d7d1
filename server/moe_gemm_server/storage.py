"""Durable weight sets: one `<name>.safetensors` file per set in the data directory.

Every write is atomic: the bytes go to a hidden temp file in the same directory, which is
fsynced, renamed over the final name (rename is atomic on POSIX within one filesystem) and
followed by an fsync of the directory, so the rename itself survives a power cut. A crash at
any point leaves either the old file or the new one under the name, never a half file; the
hidden temp files a crash can leave behind never match a set name (names cannot start with
".") and are removed at the next start. An upload is acknowledged only after this completes;
one whose directory flush fails is renamed back out of the name (commit), so that a refused
upload is not served later.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import re
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from .codecs import (
    MAX_HEADER_BYTES,
    ST_DTYPES,
    TensorSpec,
    parse_safetensors_header,
    tensor_from_buffer,
)
from .errors import APIError, unprocessable
from .fp8_weights import check_fp8_scale

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
SUFFIX = ".safetensors"
TEMP_PREFIX = ".upload-"
TEMP_SUFFIX = ".tmp"

# A file version's identity: (inode, size, mtime_ns). A rename keeps all three, so the identity
# of a temp file is the identity its final name has once it is renamed there.
FileId = tuple[int, int, int]


def file_id_of(st: os.stat_result) -> FileId:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


# A directory's identity: (st_dev, st_ino), which directory of which filesystem a path names.
DirId = tuple[int, int]


class CommitInDoubt(OSError):
    """A commit whose directory flush failed and whose rename could not be undone: the set's
    name may hold the new version (not known to be on disk) or the previous one."""


def check_name(name: str) -> None:
    """422 unless `name` is 1-128 characters of [A-Za-z0-9._-], not starting with '.'."""
    if not NAME_RE.fullmatch(name):
        raise unprocessable(
            f"invalid weight set name {name!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "not starting with '.'"
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_weight_file(path: Path, check_values: bool = False
                     ) -> tuple[torch.Tensor, str, torch.Tensor | None]:
    """Load and check a weight file: one tensor, "w" (E, K, N) or "w_t" (E, N, K), in BF16,
    F16, F32 or FP8 (F8_E4M3, F8_E5M2); an FP8 one with its F32 "scale" (fp8_weights.py).

    check_values: also refuse (422) a tensor holding NaN or infinity: an upload's check. A
        stored file is loaded as it is (it was acknowledged; reading every value again would
        also cost each start a pass over all resident weights).

    Returns:
        (tensor on the CPU, layout "w" or "w_t", scale or None).

    Raises:
        APIError: 400 malformed safetensors, 422 wrong tensor names, rank or dtype.
    """
    with open(path, "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            n = f.readinto(view[got:])
            if not n:
                raise APIError(400, "weight file is shorter than its size")
            got += n
    specs, data_start = _weight_header(buf, len(buf))
    layout = "w" if "w" in specs else "w_t"
    spec = specs[layout]
    t = tensor_from_buffer(buf, spec.dtype, spec.shape, data_start + spec.start)
    if check_values:
        check_finite(t, layout)
    scale = None
    if "scale" in specs:
        ss = specs["scale"]
        scale = tensor_from_buffer(buf, ss.dtype, ss.shape, data_start + ss.start)
    try:
        check_fp8_scale(t, layout, scale)
    except (ValueError, TypeError) as e:
        raise unprocessable(str(e)) from None
    return t, layout, scale


def _weight_header(prefix: bytes | bytearray | memoryview, total_size: int | None
                   ) -> tuple[dict[str, TensorSpec], int]:
    """A weight file's header, parsed and checked (what can be refused without its data):
    (specs by name, where the data starts). 400 malformed, 422 names, rank, dtype, a zero
    dimension."""
    # At most two tensors ("w" or "w_t", and "scale"): a header listing more is refused before
    # its entries are checked (hundreds of thousands take seconds), its names not all echoed.
    specs, data_start, _ = parse_safetensors_header(prefix, total_size, max_tensors=2,
                                                    name_rules=_check_weight_names)
    _check_weight_names(sorted(specs))
    layout = "w" if "w" in specs else "w_t"
    spec = specs[layout]
    want = "(E, K, N)" if layout == "w" else "(E, N, K)"
    if len(spec.shape) != 3:
        raise unprocessable(f"{layout!r} must be 3-D {want}; got shape {list(spec.shape)}")
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if spec.dtype not in (torch.bfloat16, torch.float16, torch.float32) + fp8:
        # (named as the body names it: "F64", not torch's "torch.float64")
        got = next((k for k, v in ST_DTYPES.items() if v == spec.dtype), str(spec.dtype))
        raise unprocessable(f"{layout!r} must be BF16, F16, F32, F8_E4M3 or F8_E5M2; got {got}")
    if min(spec.shape) == 0:
        raise unprocessable(f"{layout!r} {want} needs every dimension >= 1; got "
                            f"{list(spec.shape)}")
    return specs, data_start


def header_in(prefix: bytes | bytearray, total_size: int | None) -> bool:
    """Whether the first bytes of a safetensors body, `prefix`, are enough for
    check_weight_header: the 8-byte length and the header it announces, or only the length
    when that alone is refused (past the cap, or past the body's `total_size`)."""
    if len(prefix) < 8:
        return False
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES or (total_size is not None and 8 + n > total_size):
        return True
    return len(prefix) >= 8 + n


def check_weight_header(prefix: bytes | bytearray, total_size: int | None) -> tuple[int, int]:
    """Check an upload from its first bytes (header_in says when they are enough): what
    read_weight_file refuses from the header alone is refused here with the same answer,
    before the data is received.

    Args:
        total_size: the body's size (its Content-Length), or None when not announced.

    Returns:
        (the body's size as the header lays it out, the bytes the set will hold resident
        (resident_nbytes: the tensor and an FP8 set's float32 scale)).
    """
    specs, data_start = _weight_header(prefix, total_size)
    spec = specs["w" if "w" in specs else "w_t"]
    scale = specs.get("scale")
    nbytes = resident_bytes(spec.end - spec.start,
                            None if scale is None else math.prod(scale.shape))
    return data_start + max(s.end for s in specs.values()), nbytes


def resident_bytes(weight_bytes: int, scale_elements: int | None) -> int:
    """The bytes a set holds once resident, as WeightSet.nbytes counts them (what
    --max-resident-bytes budgets): its weight tensor and an FP8 set's float32 scale."""
    return weight_bytes + (0 if scale_elements is None else scale_elements * 4)


def _check_weight_names(names: list[str]) -> None:
    """422 unless the tensors are "w" or "w_t", with or without "scale" (a long list of
    names is cut short in the message)."""
    weights = [n for n in names if n != "scale"]
    if weights not in (["w"], ["w_t"]) or len(names) > 2:
        shown = names[:8] + ["..."] if len(names) > 8 else names
        raise unprocessable(
            "expected one tensor, 'w' (E, K, N) or 'w_t' (E, N, K) (and 'scale' for FP8 "
            f"weights); got {f'{len(names)} tensors, ' if len(names) > 8 else ''}"
            f"{shown if names else 'none'}"
        )


# Elements checked at a time by check_finite (bounds its temporary to 16M flags / floats).
FINITE_CHUNK = 1 << 24


def check_finite(t: torch.Tensor, name: str) -> None:
    """422 if `t` holds a NaN or an infinity: a non-finite weight turns every answer that
    touches its expert into NaN / inf (as a non-finite FP8 scale would, which is refused too)."""
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), FINITE_CHUNK):
        part = flat[start:start + FINITE_CHUNK]
        if part.dtype == torch.float8_e4m3fn:
            part = part.to(torch.float16)  # (isfinite has no e4m3 kernel; every value fits)
        if not bool(torch.isfinite(part).all()):
            raise unprocessable(f"{name!r} must hold finite values; got NaN or infinity")


class WeightStore:
    """The data directory: `<name>.safetensors` per weight set, written atomically."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).expanduser()
        # entries names() skipped as unreadable (warned about once, not at every rescan)
        self._unreadable: set[str] = set()
        self.root.mkdir(parents=True, exist_ok=True)
        if not os.access(self.root, os.W_OK):
            raise PermissionError(f"data directory {self.root} is not writable")

    def path_for(self, name: str) -> Path:
        check_name(name)
        return self.root / f"{name}{SUFFIX}"

    def obstruction(self, name: str) -> str | None:
        """What stands at the set's file name that is not a regular file (a directory an
        operator made there, a socket), for a message; None where the name is free or holds a
        file (a symlink to one included). Such an entry is no set (names() skips it), cannot
        be replaced by an upload's rename, nor removed by a delete."""
        try:
            mode = os.stat(self.path_for(name)).st_mode
        except OSError:  # (absent, a dangling link: free; unreachable: the operation says)
            return None
        if stat.S_ISREG(mode):
            return None
        return "a directory" if stat.S_ISDIR(mode) else "an entry that is not a regular file"

    def new_temp(self) -> Path:
        """A fresh hidden temp path in the data directory (same filesystem as the sets)."""
        return self.root / f"{TEMP_PREFIX}{uuid.uuid4().hex}{TEMP_SUFFIX}"

    @contextlib.contextmanager
    def temp_file(self) -> Iterator[Path]:
        """A fresh, empty temp file, held under an exclusive flock until the block ends and
        then removed (if it was not committed): cleanup_temp leaves it alone meanwhile."""
        while True:
            temp = self.new_temp()
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            with contextlib.suppress(OSError):  # (a file system without locks: as unlocked)
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                # (a cleanup may have removed it between the open and the lock: take another)
                if os.stat(temp).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            yield temp
        finally:
            try:
                temp.unlink(missing_ok=True)
            finally:
                os.close(fd)

    def cleanup_temp(self) -> int:
        """Remove temp files left by a crash (those no live upload holds locked); returns how
        many."""
        n = 0
        for p in self.root.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                continue
            except OSError as e:  # (as below: one leftover must not keep the start from ending)
                log.warning("cannot remove the partial upload %s: %s", p, e.strerror or e)
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # an upload in progress, here or in a server sharing the directory
                except OSError:
                    pass  # (a file system without locks: removed, as unlocked)
                p.unlink()
                n += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                # Not removable (another user's file in a sticky directory, a directory of that
                # name, an I/O error): it is never loaded (no set name starts with "."), and
                # failing here would leave the server not ready for good.
                log.warning("cannot remove the partial upload %s: %s", p, e.strerror or e)
            finally:
                os.close(fd)
        if n:
            log.warning("removed %d partial upload(s) left in %s", n, self.root)
            _fsync_dir(self.root)
        return n

    def dir_id(self) -> DirId:
        """The identity of the directory the data directory's path names now. A volume
        unmounted from under the path leaves its mountpoint, an empty directory of the parent
        filesystem: another st_dev, and another st_ino (which also tells a bind mount from the
        same filesystem, or a directory renamed into the path, from the one that was there).

        Raises:
            OSError: the path names nothing (gone, moved) or cannot be reached.
        """
        st = os.stat(self.root)
        return (st.st_dev, st.st_ino)

    def names(self) -> list[str]:
        """Names of the stored sets (files whose stem is a valid name), sorted.

        Raises:
            OSError: the directory itself cannot be listed (gone, unmounted, no permission).
                (Path.glob answers [] then, which reads as every set deleted: sync.py would
                drop them all from memory.)
        """
        out = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                stem = entry.name[: -len(SUFFIX)]
                if not (entry.name.endswith(SUFFIX) and NAME_RE.fullmatch(stem)):
                    continue
                try:
                    is_file = entry.is_file()
                except OSError as e:
                    # One entry that cannot be followed (a symlink loop, a link into a
                    # directory this user may not search) is not a readable set: skipped, as
                    # a dangling symlink is. Raised, it made the whole listing fail: a server
                    # starting never became ready, and a running one stopped syncing.
                    if stem not in self._unreadable:
                        self._unreadable.add(stem)
                        log.warning("skipping %s in the data directory: %s", entry.name,
                                    e.strerror or e)
                    continue
                self._unreadable.discard(stem)
                if is_file:
                    out.append(stem)
        return sorted(out)

    def commit(self, temp: Path, name: str) -> FileId:
        """fsync `temp`, rename it to the set's file, fsync the directory.

        Returns the identity of the file this call renamed into place, taken from `temp`
        before the rename: another server sharing the directory may rename its own upload over
        the name right after ours, and a stat of the name would then return that one's
        identity beside our data (sync.py would never reload the winner's file).

        Raises:
            OSError: nothing was stored; the name holds the version it held before. A failed
                flush of the directory undoes the rename (the previous file, kept by a hidden
                hard link until the flush, is put back): left in place, the refused upload
                would be served after the next rescan or restart.
            CommitInDoubt: the flush failed and so did the undo: the name may hold either
                version.
        """
        final = self.path_for(name)
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
            fid = file_id_of(os.fstat(fd))
        finally:
            os.close(fd)
        had, kept = self._keep(final)
        try:
            os.replace(temp, final)
            try:
                _fsync_dir(self.root)
            except OSError as e:
                self._undo(final, fid, had, kept, e)
                raise
        finally:
            if kept is not None:
                with contextlib.suppress(OSError):
                    kept.unlink(missing_ok=True)
        return fid

    def _keep(self, final: Path) -> tuple[bool, Path | None]:
        """(whether the set has a file now, a hidden hard link to it), so that commit can put
        that version back; the link is None where the filesystem has none. A crash leaves the
        link as a temp file, removed at the next start."""
        kept = self.new_temp()
        try:
            os.link(final, kept)
        except FileNotFoundError:
            return False, None
        except OSError as e:  # (no hard links here: a failed flush cannot restore the file)
            log.warning("cannot keep the previous version of %s while it is replaced (%s)",
                        final.name, e.strerror or e)
            return True, None
        return True, kept

    def _undo(self, final: Path, fid: FileId, had: bool, kept: Path | None,
              cause: OSError) -> None:
        """Take back the rename of the file `fid` to `final` (its directory's flush failed):
        the previous version `kept` goes back under the name, or the name is removed if it had
        none (`had`). A file another server renamed over ours meanwhile is left alone (its
        upload replaced ours). Raises CommitInDoubt when that cannot be done."""
        try:
            try:
                ours = file_id_of(os.stat(final)) == fid
            except FileNotFoundError:
                ours = False  # (deleted meanwhile, through another server: nothing to undo)
            if ours:
                if kept is not None:
                    os.replace(kept, final)
                elif had:
                    raise OSError(errno.ENOTSUP, "its previous version was not kept")
                else:
                    os.unlink(final)
        except OSError as e:
            log.error("the flush of %s failed (%s) after %s was renamed into place, and the "
                      "rename could not be undone (%s): it may be served", self.root,
                      cause.strerror or cause, final.name, e.strerror or e)
            raise CommitInDoubt(cause.errno, cause.strerror) from e
        try:
            _fsync_dir(self.root)
        except OSError as e:
            # The undo is in place (served as it is now), only not known to be on disk.
            log.error("the flush of %s failed again (%s) after %s was put back to its "
                      "previous version", self.root, e.strerror or e, final.name)

    def write(self, name: str, data: bytes) -> None:
        """Atomically store `data` as the set's file."""
        with self.temp_file() as temp:
            with open(temp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self.commit(temp, name)

    def delete(self, name: str) -> bool:
        """Remove the set's file durably; False if there was none.

        Raises:
            OSError: nothing was deleted. A failed flush of the directory after the unlink
                puts the file back (kept by a hidden hard link until the flush), as commit
                undoes its rename: left gone, the set a 507 called "not deleted" would vanish
                from the other replicas at their next rescan and from this one at a restart.
            CommitInDoubt: the flush failed and the file could not be put back: the set may
                be deleted or not.
        """
        final = self.path_for(name)
        had, kept = self._keep(final)
        if not had:
            return False
        try:
            try:
                final.unlink()
            except FileNotFoundError:
                return False  # (deleted meanwhile, through another server)
            try:
                _fsync_dir(self.root)
            except OSError as e:
                self._restore(final, kept, e)
                raise
            return True
        finally:
            if kept is not None:
                with contextlib.suppress(OSError):
                    kept.unlink(missing_ok=True)

    def _restore(self, final: Path, kept: Path | None, cause: OSError) -> None:
        """Put a deleted file back under its name (its directory's flush failed): the kept
        link is linked back, unless another server's upload took the name meanwhile (that
        version stays). Raises CommitInDoubt when that cannot be done."""
        try:
            if kept is None:
                raise OSError(errno.ENOTSUP, "the file was not kept")
            os.link(kept, final)
        except FileExistsError:
            return
        except OSError as e:
            log.error("the flush of %s failed (%s) after %s was deleted, and it could not be "
                      "put back (%s)", self.root, cause.strerror or cause, final.name,
                      e.strerror or e)
            raise CommitInDoubt(cause.errno, cause.strerror) from e
        with contextlib.suppress(OSError):
            _fsync_dir(self.root)

    def load(self, name: str) -> tuple[torch.Tensor, str, torch.Tensor | None]:
        return read_weight_file(self.path_for(name))
