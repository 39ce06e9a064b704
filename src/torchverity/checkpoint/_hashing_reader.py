"""A file object that hashes a whole file, in order, while another reader reads it.

``torch.load`` reads a zip checkpoint through any seekable file object:
first the central directory at the end, then each storage record straight
into the tensor's memory with one ``readinto``. :class:`HashingReader` hands
those reads through and feeds the file's bytes to a hash in file order, so
verifying the file costs no second read: record bytes are hashed from the
buffer torch just filled, while it is still in the cache, and every byte of a
buffer is hashed before ``readinto`` returns, so no hash ever touches memory
that torch may have freed. Bytes torch skips (zip headers' padding, anything
read out of order) are read here with ``pread``: the digest always covers
every byte of the file exactly once, whatever order the reader used.

How a large read is shared between cores depends on the hash:

- faster than the copy out of the page cache (BLAKE3, XXH3), with ``split=True``:
  two threads fill each read, a worker reading the tails of its chunks while this
  thread reads the heads and hashes each chunk as soon as it is in
  (:func:`read_split`). The worker's share comes from the measured speeds of the
  copy and the hash: when the copy is slow (fresh memory to fault in, as in a new
  process) both threads read; when it is as fast as the hash (memory the
  allocator reuses) the worker reads nearly all and this thread hashes.
- slower than the copy (SHA-256), with a pool: the hash of each chunk runs on the
  worker while this thread reads the next. The last chunk of a large read, and a
  small read whole, are hashed from a copy: torch gets its buffer back while the
  hash catches up, so the worker always has work queued while torch reads the
  next record (a checkpoint is hundreds of reads).
- with neither, each chunk is hashed by the reading thread right after the copy.

:func:`lane` gives these pipelines long-lived worker threads: starting a
thread per save or load costs more than hashing a small checkpoint when the
machine is busy (each start waits for the new thread to be scheduled).
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from torchverity.digest import FASTER_THAN_COPY, READ_SIZE, Hasher, new_hasher, open_for_reading

_CHUNK = 1 << 20  # small enough to be hashed from the cache, large enough to amortise a call
SMALL_READ = _CHUNK  # a read this small is done whole on one thread: a hand-off costs more
_MAX_GAP = 1 << 20  # a jump further ahead than this is left for later (it may be read next)
_SPLIT_CHUNK = 4 << 20  # few thread hand-offs per record, and still in cache when hashed
_MIN_SPLIT = 256 << 10

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


def cpu_count() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def load_reader(path: Path, algo: str) -> HashingReader:
    """The reader a verified load goes through, for ``algo`` on this machine's cores.

    A hash slower than the copy (SHA-256) runs on a second core beside the
    reading one; a faster one runs on the reading thread, with a second core
    reading alongside (:meth:`HashingReader` with ``split``).
    """
    if algo not in FASTER_THAN_COPY:
        return HashingReader(path, new_hasher(algo), lane("load-hash"))
    if cpu_count() > 1:
        return HashingReader(path, new_hasher(algo), lane("load-read"), split=True)
    return HashingReader(path, new_hasher(algo), None)


def load_while_hashing(path: Path, algo: str,
                       load: Callable[[HashingReader], Any]) -> tuple[Any, Exception | None, str]:
    """``load(reader)`` through :func:`load_reader`: one read of ``path`` feeds both.

    Returns the object (None when the load raised), the load's own exception, kept
    for the caller to judge once the digest says whether the file is damaged, and
    the file's digest. Only for loaders that run no code from the file: they read
    bytes whose digest is not known yet.
    """
    obj: Any = None
    failure: Exception | None = None
    reader = load_reader(path, algo)
    try:
        obj = load(reader)
    except Exception as exc:
        failure = exc
    finally:
        actual = reader.hexdigest()
        reader.close()
    return obj, failure, actual


class HashingReader(io.RawIOBase):
    """Read ``path`` like a plain file; :meth:`hexdigest` is the digest of all of it."""

    def __init__(self, path: Path, hasher: Hasher, pool: Executor | None, *,
                 split: bool = False) -> None:
        super().__init__()
        self._fh = open_for_reading(path)
        self._hasher = hasher
        self._pool = None if split else pool
        self._reader = pool if split else None
        self._balance = Balance()
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
        if len(view) - skip < SMALL_READ:
            n = self._fh.readinto(view) or 0
            self._feed_copy(view[skip:n])
            self._done = max(self._done, pos + n)
            return n
        n = (self._read_split(view, skip, pos, self._reader) if self._reader is not None
             else self._read_hashing(view, skip))
        self._done = max(self._done, pos + n)
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

    def _read_split(self, view: memoryview, skip: int, pos: int, reader: Executor) -> int:
        def consume(a: int, b: int) -> None:
            if b > skip:
                self._hasher.update(view[max(a, skip):b])

        filled = read_split(self._fh.fileno(), view, pos, reader, consume, self._balance)
        self._fh.seek(pos + filled)
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


class Balance:
    """The worker's share of each chunk in :func:`read_split`, from measured speeds.

    Per chunk this thread reads ``1 - share`` and hashes it all while the worker reads
    ``share``: both finish together when ``share = 1/2 + hash/(2 * copy)`` (seconds per
    byte), so the hash hides behind the worker's read. Copy and hash speeds are summed
    over every chunk so far; one reader's reads share one balance.
    """

    def __init__(self) -> None:
        self.share = 0.65  # BLAKE3 against a copy into fresh memory, until measured
        self._copy_s = self._hash_s = 0.0  # both threads' reads; this thread's hashing
        self._copied = self._hashed = 0

    def copied(self, seconds: float, n: int) -> None:
        self._copy_s += seconds
        self._copied += n

    def hashed(self, seconds: float, n: int) -> None:
        self._hash_s += seconds
        self._hashed += n
        if self._copy_s > 0 and self._hashed:
            ratio = (self._hash_s / self._hashed) / (self._copy_s / self._copied)
            self.share = min(1.0, 0.5 + ratio / 2)

    def split(self, a: int, b: int) -> tuple[int, int, int]:
        """``(a, m, b)``: this thread reads ``[a, m)``, the worker ``[m, b)`` (page-aligned)."""
        return a, a + (int((b - a) * (1 - self.share)) & ~0xFFF), b


def read_split(fd: int, view: memoryview, pos: int, reader: Executor,
               consume: Callable[[int, int], None], balance: Balance) -> int:
    """Fill ``view`` from file offset ``pos`` with this thread and ``reader``'s.

    The worker is handed the tails of every chunk at once and reads them in order
    without waiting for this thread, which reads each chunk's head and then calls
    ``consume(a, b)`` on the whole chunk ``view[a:b]``, in order, as soon as its tail
    is in. Returns the bytes filled, fewer only where the file ends; no read is still
    writing into ``view`` on return.
    """
    chunks = _plan(len(view), balance)
    tails = [reader.submit(_timed_pread, fd, view[m:b], pos + m) for _, m, b in chunks]
    try:
        for (a, m, b), tail in zip(chunks, tails, strict=True):
            head, seconds = _timed_pread(fd, view[a:m], pos + a)
            got, tail_seconds = tail.result()
            balance.copied(seconds + tail_seconds, head + got)
            if head < m - a or got < b - m:  # the file ended: keep what is contiguous
                filled = a + head if head < m - a else m + got
                if filled > a:
                    consume(a, filled)
                return filled
            start = time.perf_counter()
            consume(a, b)
            balance.hashed(time.perf_counter() - start, b - a)
        return len(view)
    finally:
        for tail in tails:
            tail.cancel()  # a read not yet started never starts
        wait(tails)


def _plan(n: int, balance: Balance) -> list[tuple[int, int, int]]:
    """The chunks of an ``n``-byte read as ``(a, m, b)``: this thread reads ``[a, m)``,
    the worker ``[m, b)``. Both read half of the first chunk: there is nothing to hash
    until it is in. The last chunks halve in size, since the last is hashed with
    nothing left to read beside it."""
    chunks, a = [], 0
    while a < n:
        size = max(_MIN_SPLIT, min(_SPLIT_CHUNK, (n - a) // 2))
        b = n if n - a - size < _MIN_SPLIT else a + size
        chunks.append((a, a + ((b - a) // 2 & ~0xFFF), b) if a == 0 else balance.split(a, b))
        a = b
    return chunks


def _timed_pread(fd: int, view: memoryview, offset: int) -> tuple[int, float]:
    start = time.perf_counter()
    return _pread_into(fd, view, offset), time.perf_counter() - start


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; fewer bytes only where the file ends."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            break
        got += n
    return got
