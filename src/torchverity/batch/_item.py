"""One item's work, the same on every engine: verified input -> model -> output bytes -> file.

The output is written as the journal requires for exactly-once: a temp file
beside the final name, fsynced, then renamed over the deterministic name. The
driver records it as committed only after that and after its folder entry is
durable too (see :class:`Durability`), so a crash leaves either nothing, a
temp file, or a renamed but uncommitted output; the next run removes both
kinds of orphan.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from torchverity.batch._inputs import InputChanged, file_digest, read_verified
from torchverity.batch._journal import CHANGED, COMMITTED, FAILED, WorkItem

TMP_SUFFIX = ".tvtmp"


@dataclass(frozen=True)
class BatchItem:
    """What the per-item function receives: the verified bytes of one input.

    ``data`` are exactly the bytes whose SHA-256 (``digest``) the input
    manifest lists; read them instead of reopening ``path``, which may have
    changed since.
    """

    key: str
    path: str
    data: bytes
    digest: str
    index: int


ItemFn = Callable[[BatchItem], Any]


@dataclass(frozen=True)
class ItemResult:
    """What happened to one attempt at one item."""

    id: int
    status: str
    output_digest: str | None = None
    output_size: int | None = None
    error: str | None = None
    payload: bytes | None = None  # only when the driver writes (Ray): bytes to store


class OutputWriteError(Exception):
    """Writing an output failed for a reason that retrying the item cannot fix."""

    def __init__(self, path: Path, error: OSError) -> None:
        self.path = path
        self.error = error
        super().__init__(f"{path}: {error.strerror or error}")


def compute(work: WorkItem, fn: ItemFn) -> tuple[ItemResult, memoryview | None]:
    """Read and verify the input, run ``fn``; return the result and the output bytes."""
    data = read_input(work)
    if isinstance(data, ItemResult):
        return data, None
    view = run_fn(work, fn, data)
    if isinstance(view, ItemResult):
        return view, None
    return committed(work, view), view


def read_input(work: WorkItem) -> bytes | ItemResult:
    """The input's verified bytes, or the ``input-changed`` result."""
    try:
        return read_verified(work.path, work.size, work.digest)
    except InputChanged as exc:
        return ItemResult(work.id, CHANGED, error=f"input changed since listing: {exc}")


def run_fn(work: WorkItem, fn: ItemFn, data: bytes) -> memoryview | ItemResult:
    """The output bytes of ``fn``, or the ``failed`` result naming its error."""
    try:
        return to_bytes(fn(BatchItem(work.key, work.path, data, work.digest, work.id)))
    except Exception as exc:  # the user's code: any error is this item's failure
        return ItemResult(work.id, FAILED, error=f"{type(exc).__name__}: {exc}")


def committed(work: WorkItem, view: memoryview) -> ItemResult:
    digest = hashlib.sha256(view).hexdigest()
    return ItemResult(work.id, COMMITTED, output_digest=digest, output_size=len(view))


def to_bytes(obj: Any) -> memoryview:
    """The bytes to store for what ``fn`` returned (bytes-like, str, tensor or state)."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return memoryview(obj).cast("B")
    if isinstance(obj, str):
        return memoryview(obj.encode("utf-8"))
    if obj is None:
        raise TypeError("the item function returned None; return bytes, str or tensors")
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer()


def temp_path(final: str, attempt: int) -> str:
    folder, name = os.path.split(final)
    return os.path.join(folder, f".{name}.{attempt}{TMP_SUFFIX}")


def write_output(out: Path, work: WorkItem, data: memoryview, *, fsync: bool) -> None:
    """Temp file, (fsync,) rename over the deterministic name. OSError -> OutputWriteError.

    ``fsync=False`` when a ``syncfs`` at the next commit point makes the file durable.
    """
    # Strings, not Paths: this runs once per item, and pathlib costs more than the syscalls.
    final = os.path.join(out, work.output)
    tmp = temp_path(final, work.attempt)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except OSError as exc:
        _discard(tmp)
        raise OutputWriteError(Path(final), exc) from None


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _discard(path: str) -> None:
    # The folder itself may be failing; the next run's cleanup removes what is left.
    with contextlib.suppress(OSError):
        os.unlink(path)


def fsync_dirs(folders: set[Path]) -> None:
    """Make renames durable: the folder entries must reach the disk before the commit."""
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EBADF):  # filesystems without dir fsync
                raise OutputWriteError(folder, exc) from None
        finally:
            os.close(fd)


EngineName = Literal["local", "ray"]
DurabilityMode = Literal["file", "group", "lazy"]
DURABILITY = get_args(DurabilityMode)


def _syncfs() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL
    return getattr(libc, "syncfs", None)


class Durability:
    """How outputs reach the disk before the journal calls them committed.

    ``group`` (default): outputs are written and renamed without their own
    fsync; each commit point first runs one ``syncfs`` on the output
    filesystem, which flushes every file and folder entry written since: the
    guarantee of ``file`` with one flush per commit point instead of one per
    item. It also waits for other programs' pending writes on that
    filesystem. Falls back to ``file`` where there is no syncfs (not Linux).
    ``file``: each output is fsynced before its rename, and its folder at the
    commit point. Works on any POSIX filesystem.
    ``lazy``: outputs are not flushed; the operating system writes them back in
    its own time. A killed process loses nothing (its writes are already in the
    page cache); after a power loss, a committed output that never reached
    the disk fails the re-hash that every rerun (and ``batch verify``) does,
    and the rerun redoes it. Only the journal is fsynced.
    """

    def __init__(self, out: Path, mode: str) -> None:
        self._syncfs = _syncfs() if mode == "group" else None
        self.lazy = mode == "lazy"
        self.per_file = self._syncfs is None and not self.lazy
        self._out = out

    def commit_point(self, folders: set[Path]) -> None:
        if self.lazy:
            return
        if self.per_file:
            fsync_dirs(folders)
            return
        assert self._syncfs is not None
        fd = os.open(self._out, os.O_RDONLY)
        try:
            if self._syncfs(fd) != 0:
                code = _ctypes_errno()
                raise OutputWriteError(self._out, OSError(code, os.strerror(code)))
        finally:
            os.close(fd)


def _ctypes_errno() -> int:
    import ctypes

    return ctypes.get_errno()


def file_sha256(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """SHA-256 and size of a stored output, or None when it is missing."""
    try:
        digest, size, _ = file_digest(path)
    except FileNotFoundError:
        return None
    return digest, size
