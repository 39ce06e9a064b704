"""Atomic publication: a file is written beside its target, hashed as written, fsynced and
renamed over it with its companions, so a kill at any instant leaves the previous version or
the new one.
"""

from __future__ import annotations

import errno
import glob
import os
import secrets
import socket
import stat
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchverity._tensors import iter_leaves
from torchverity.checkpoint._hashing_reader import lane
from torchverity.checkpoint._records import pending_name, settle
from torchverity.digest import (
    fsync_path,
)
from torchverity.errors import (
    CheckpointWriteError,
    InputError,
    TorchVerityError,
)

_SMALL_WRITE = 1 << 16  # torch.save makes many tiny writes (zip headers): batch them
_BATCH = 1 << 20
# fsyncs run together (they share journal commits): the file's early flush, its final
# fsync and one per companion file.
SYNC_LANE, SYNC_WORKERS = "sync", 4


class _StableMemory:
    """Address ranges of the CPU tensors being saved.

    ``save`` holds a reference to every one of them until it returns, so bytes
    inside them stay valid after ``write()`` returns and may be hashed later.
    """

    def __init__(self, payload: Any) -> None:
        ranges = set()
        for _, value in iter_leaves(payload):
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                if storage.nbytes():
                    ranges.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        self._starts, self._ends = [], []
        for start, end in sorted(ranges):
            self._starts.append(start)
            self._ends.append(end)

    def holds(self, view: memoryview) -> bool:
        import bisect

        import numpy as np

        addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and addr + len(view) <= self._ends[i]


class _HashingWriter:
    """A write-only file object that hashes every byte on its way to disk.

    The hash runs on its own thread, behind the writes, so it overlaps the
    serialization of the next storage instead of stalling it. Bytes inside the
    tensors being saved (see :class:`_StableMemory`) are queued by reference,
    small writes are gathered into buffers this writer owns; only a large
    write of memory owned by torch (e.g. a device tensor's temporary host
    copy, which may be freed when ``write`` returns) waits for its hash.
    One worker thread hashes in submission order.
    """

    def __init__(self, fd: int, hasher: Any, stable: _StableMemory,
                 pool: Executor) -> None:
        self._fd = fd
        self._hasher = hasher
        self._stable = stable
        self._pool = pool
        self._last: Future[Any] | None = None
        self._pending = bytearray()
        self.size = 0
        self.error: OSError | None = None  # torch.save replaces our OSError with its own

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.size += n
        if n < _SMALL_WRITE:
            self._pending += view
            if len(self._pending) >= _BATCH:
                self.flush()
            return n
        self.flush()
        self._emit(view, wait=not self._stable.holds(view))
        return n

    def flush(self) -> None:
        if self._pending:
            owned, self._pending = self._pending, bytearray()
            self._emit(memoryview(owned), wait=False)

    def finish(self) -> None:
        """Write what is buffered and wait until every byte is hashed."""
        self.flush()
        self.drain()

    def drain(self) -> None:
        """Wait until the hash has consumed every byte handed to it (none is read later)."""
        if self._last is not None:
            self._last.result()

    def _emit(self, view: memoryview, wait: bool) -> None:
        self._last = self._pool.submit(self._hasher.update, view)
        try:
            _write_all(self._fd, view)
        except OSError as exc:
            self.error = exc
            raise
        finally:
            if wait:
                self._last.result()


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view) :]


@dataclass
class _Staged:
    """A save in progress: the temp file's fd, the small companion files to publish
    and the files that describe the old checkpoint only (removed once it is replaced)."""

    fd: int
    companions: dict[Path, str]
    stale: tuple[Path, ...] = ()
    flushing: Future[None] | None = None  # an fsync of ``fd`` started early (its error counts)


@contextmanager
def _atomic_target(target: Path) -> Iterator[_Staged]:
    """Stage a temp file beside ``target``; on success publish it and its companions.

    Companions (sidecar, meta.json) are fully written and fsynced as
    ``.NAME.pending`` files *before* the checkpoint is renamed, then renamed
    after it. A crash between those renames leaves the new checkpoint with its
    records still pending; ``load`` finds them because they match the file's
    digest (see :func:`torchverity.checkpoint._records.resolve_records`).
    """
    folder = target.parent
    if not folder.is_dir():
        raise InputError(f"{folder}: folder does not exist, cannot save {target.name}",
                         path=folder, hint=f"mkdir -p {folder}")
    old = _OldVersion.of(target)
    temps: list[tuple[Path, Path]] = [(_temp_name(target), target)]
    staged = _Staged(-1, {})
    try:
        _sweep_stale_temps(target)
        _settle_quietly(target)
        staged.fd = os.open(temps[0][0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        yield staged
        if old.mode is not None:
            os.fchmod(staged.fd, old.mode)
        companions = [(pending_name(final), final) for final in staged.companions]
        temps.extend(companions)
        _sync_together(staged.fd, {tmp: staged.companions[final] for tmp, final in companions})
        if staged.flushing is not None:
            staged.flushing.result()  # a write-back error is reported to one fsync only
        os.close(staged.fd)
        staged.fd = -1
        for tmp, final in temps:
            os.replace(tmp, final)
        for stale in staged.stale:
            stale.unlink(missing_ok=True)
        fsync_path(folder)
    except OSError as exc:
        raise _write_error(target, exc, old.mode is not None) from None
    finally:
        old.release()
        if staged.fd >= 0:
            if staged.flushing is not None:
                with suppress(OSError):  # the save failed already; its fd may not outlive it
                    staged.flushing.result()
            os.close(staged.fd)
        for tmp, _ in temps:
            with suppress(OSError):  # a read-only folder refuses even this; nothing to remove
                tmp.unlink(missing_ok=True)


class _OldVersion:
    """The file a save replaces, held open until the new one is published.

    Freeing a replaced file's pages and blocks is a real share of a save (tens
    of milliseconds per 100 MB on ext4). With the old inode still open, the rename
    only swaps the name, and the freeing happens when this process closes it,
    on a background thread, after the save has returned. Its cached pages are
    dropped early, also in the background, so the new file's pages take their
    place instead of the page cache growing by a checkpoint's size (evicting
    other files, or on a VM faulting in memory the host had taken back). The
    file itself is untouched: a crash still leaves it intact.
    """

    def __init__(self, fd: int, mode: int | None) -> None:
        self.fd, self.mode = fd, mode

    @classmethod
    def of(cls, target: Path) -> _OldVersion:
        try:
            # Non-blocking: a FIFO at the target must not hang the save here.
            fd = os.open(target, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
                         | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            try:
                return cls(-1, stat.S_IMODE(target.stat().st_mode))  # exists, unreadable
            except OSError:
                return cls(-1, None)
        try:
            info = os.fstat(fd)
        except OSError:
            os.close(fd)
            return cls(-1, None)
        if not stat.S_ISREG(info.st_mode) or not hasattr(os, "posix_fadvise"):
            os.close(fd)
            return cls(-1, stat.S_IMODE(info.st_mode))
        lane("release").submit(_drop_cached_pages, fd)
        return cls(fd, stat.S_IMODE(info.st_mode))

    def release(self) -> None:
        if self.fd >= 0:
            lane("release").submit(os.close, self.fd)  # after its page drop: one worker, in order
            self.fd = -1


def _settle_quietly(target: Path) -> None:
    """Publish the pending records of a killed save that describe the file at ``target``.

    Damaged old records are left for this save to replace.
    """
    with suppress(TorchVerityError):
        settle(target)


def _drop_cached_pages(fd: int) -> None:
    with suppress(OSError):  # advice only
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _temp_prefix(final: Path) -> str:
    # The host name keeps a save on a shared file system from sweeping another
    # machine's temp file whose pid merely does not exist here.
    return f".{final.name}.tmp-{socket.gethostname()}-"


def _temp_name(final: Path) -> Path:
    return final.with_name(f"{_temp_prefix(final)}{os.getpid()}-{secrets.token_hex(4)}")


def _sync_together(fd: int, companions: dict[Path, str]) -> None:
    """fsync ``fd`` and write and fsync every companion, all at once.

    Concurrent fsyncs share the file system's journal commits instead of
    paying one commit each, one after another.
    """
    pool = lane(SYNC_LANE, SYNC_WORKERS)
    jobs = [pool.submit(os.fsync, fd)]
    jobs += [pool.submit(_write_synced, path, text) for path, text in companions.items()]
    for job in jobs:
        job.result()


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _sweep_stale_temps(target: Path) -> None:
    """Remove temp files of earlier saves whose process died (kill -9, power loss)."""
    prefix = _temp_prefix(target)
    for tmp in target.parent.glob(f"{glob.escape(prefix)}*"):
        pid = tmp.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_error(target: Path, exc: OSError, existed: bool) -> CheckpointWriteError:
    reasons = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EFBIG: "the file is larger than this process may write",
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied in the folder",
        errno.EPERM: "permission denied in the folder",
    }
    reason = reasons.get(exc.errno or 0, exc.strerror or str(exc))
    previous = (f"the previous {target.name} is intact" if existed
                else f"no file was created at {target}")
    return CheckpointWriteError(
        f"cannot save {target}: {reason}; {previous}", path=target, reason=reason,
        previous_intact=existed,
        hint="free space or fix the folder's permissions, then save again",
    )
