"""A file object that hashes a whole file, in order, while another reader reads it.

``torch.load`` reads a zip checkpoint through any seekable file object:
first the central directory at the end, then each storage record straight
into the tensor's memory with one ``readinto``. :class:`HashingReader` hands
those reads through and feeds the file's bytes to a hash in file order, so
verifying the file costs no second read: record bytes are hashed from the
buffer torch just filled, while it is still in the cache. Large reads are
split into chunks: the hash of one chunk runs on a worker thread (hashes
release the GIL) while the next chunk is read, and every chunk of a buffer is
hashed before ``readinto`` returns, so no hash ever touches memory that torch
may have freed. Without a pool, each chunk is hashed by the reading thread
right after it is copied, while it is still in that core's cache: cheaper for
a hash faster than the copy itself (XXH3) than handing it to another core.
Bytes torch skips (zip headers' padding, anything read out of order) are
read here with ``pread``: the digest always covers every byte of the file
exactly once, whatever order the reader used.

The last chunk of a large read, and a small read whole, are hashed from a copy:
torch gets its buffer back while the hash catches up, so the hash thread
always has work queued while torch reads the next record (a checkpoint is
hundreds of reads; the hash is the slower side for SHA-256).

:func:`lane` gives these pipelines long-lived worker threads: starting a
thread per save or load costs more than hashing a small checkpoint when the
machine is busy (each start waits for the new thread to be scheduled).
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torchverity.digest import READ_SIZE, Hasher, open_for_reading

_CHUNK = 1 << 20  # small enough to be hashed from the cache, large enough to amortise a call
_MAX_GAP = 1 << 20  # a jump further ahead than this is left for later (it may be read next)

_lanes: dict[str, ThreadPoolExecutor] = {}
_lanes_lock = threading.Lock()


def lane(name: str, workers: int = 1) -> ThreadPoolExecutor:
    """This process's long-lived pool ``name``; with one worker, tasks run in submission
    order (what a hash fed chunk by chunk needs). A forked child starts its own."""
    with _lanes_lock:
        pool = _lanes.get(name)
        if pool is None:
            pool = _lanes[name] = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=f"torchverity-{name}")
        return pool


def _forget_lanes() -> None:
    global _lanes_lock
    _lanes.clear()  # their threads did not survive the fork
    _lanes_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_lanes)


class HashingReader(io.RawIOBase):
    """Read ``path`` like a plain file; :meth:`hexdigest` is the digest of all of it."""

    def __init__(self, path: Path, hasher: Hasher, pool: Executor | None) -> None:
        super().__init__()
        self._fh = open_for_reading(path)
        self._hasher = hasher
        self._pool = pool
        self._done = 0  # bytes [0, _done) have been handed to the hasher, in order
        self._last: Future[Any] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._fh.seek(offset, whence)

    def tell(self) -> int:
        return self._fh.tell()

    def fileno(self) -> int:
        return self._fh.fileno()

    def close(self) -> None:
        self._wait()
        self._fh.close()
        super().close()

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        pos = self._fh.tell()
        if not self._hashes_now(pos, len(view)):
            return self._fh.readinto(view) or 0
        if pos > self._done:
            self._hash_file_range(self._done, pos)
        skip = self._done - pos
        if len(view) - skip < _CHUNK:
            n = self._fh.readinto(view) or 0
            self._feed_copy(view[skip:n])
            self._done = max(self._done, pos + n)
            return n
        n = self._read_hashing(view, skip)
        self._done = pos + n
        return n

    def hexdigest(self) -> str:
        """Hash whatever the reader has not covered yet, then the digest of the file."""
        self._hash_file_range(self._done, None)
        self._wait()
        return self._hasher.hexdigest()

    def _hashes_now(self, pos: int, n: int) -> bool:
        """Whether a read of ``[pos, pos + n)`` continues the hashed prefix."""
        return pos + n > self._done and pos - self._done <= _MAX_GAP

    def _read_hashing(self, view: memoryview, skip: int) -> int:
        """Fill ``view`` chunk by chunk, hashing each chunk while the next one is read."""
        filled, borrowed = 0, None
        try:
            while filled < len(view):
                got = self._fh.readinto(view[filled:filled + _CHUNK]) or 0
                if not got:
                    break
                end = filled + got
                if end > skip:
                    part = view[max(skip, filled):end]
                    if end < len(view):
                        self._feed(part)
                        borrowed = self._last
                    else:
                        self._feed_copy(part)
                filled = end
        finally:
            if borrowed is not None:
                borrowed.result()  # the buffer belongs to torch once we return
        return filled

    def _hash_file_range(self, start: int, end: int | None) -> None:
        """Hash ``[start, end)`` (to the end of the file when ``end`` is None) with pread."""
        fd = self._fh.fileno()
        while end is None or start < end:
            want = READ_SIZE if end is None else min(READ_SIZE, end - start)
            data = os.pread(fd, want, start)
            if not data:
                break
            self._feed(data)
            start += len(data)
        self._done = max(self._done, start)

    def _feed(self, data: bytes | memoryview) -> None:
        if self._pool is None:
            self._hasher.update(data)  # right after the copy, while the chunk is in cache
        else:
            self._last = self._pool.submit(self._hasher.update, data)

    def _feed_copy(self, data: memoryview) -> None:
        """Hash bytes of torch's buffer after this call returns: from a copy, on the pool."""
        self._feed(data if self._pool is None else bytes(data))

    def _wait(self) -> None:
        if self._last is not None:
            self._last.result()
