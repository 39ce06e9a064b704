"""Streaming file digests and sidecar files.

A sidecar ``FILE.blake3`` (the default) holds one ``<hex>  <name>`` line, exactly
what ``b3sum`` writes, so ``b3sum -c FILE.blake3`` (run in FILE's folder) accepts
it: BLAKE3 is cryptographic and fast enough to keep up with ``torch.load``.
``FILE.sha256`` uses the same line format (``sha256sum -c`` reads it), for digests
that must match published SHA-256 ones, and so does ``FILE.xxh128``
(``xxh128sum -c`` reads it): XXH3-128, a non-cryptographic 128-bit hash several
times faster than BLAKE3, for catching accidental damage (disk, copy, download)
where no adversary is assumed; a sidecar stored beside its file protects against nothing more.
A digest here is always over the whole file with no chunking parameters, so
the algorithm, named by the extension, is all a verifier needs to rebuild it.

>>> from torchverity.digest import digest_file, write_sidecar, verify_file
>>> d = digest_file("model.pt")                      # doctest: +SKIP
>>> write_sidecar("model.pt", d)                      # doctest: +SKIP
>>> verify_file("model.pt").ok                        # doctest: +SKIP
True
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, get_args

import blake3  # the default hash: imported with this module, as hashlib is

from torchverity._formats import open_regular_raw
from torchverity.errors import FormatError, InputError, UsageError, no_such_file, shell_path

if TYPE_CHECKING:
    import queue

Algorithm = Literal["sha256", "blake3", "xxh128"]
ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)
DEFAULT_ALGO: Algorithm = "blake3"
HEX_LENGTH = {"sha256": 64, "blake3": 64, "xxh128": 32}
# Hashes that run faster than bytes are copied out of the page cache: cheapest on the
# thread that just read them (still in its cache), where slower ones go to a second core.
FASTER_THAN_COPY = frozenset({"xxh128", "blake3"})
# 8 MiB reads keep Python's per-chunk cost far below the hash's own time
# (about 128 calls per GiB) while the buffer stays small and fixed.
READ_SIZE = 8 * 1024 * 1024
_BUFFERS = 3
_STOP = bytearray()


class Hasher(Protocol):
    """What every hash object offers (hashlib and blake3 both fit)."""

    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


@dataclass(frozen=True)
class FileDigest:
    """The digest of one file, with what is needed to rebuild it."""

    path: str
    algo: str
    hexdigest: str
    size: int


def check_algo(algo: str) -> str:
    if algo not in ALGORITHMS:
        raise UsageError(
            f"unknown digest algorithm '{algo}'",
            hint=f"use one of: {', '.join(ALGORITHMS)}",
        )
    return algo


def new_hasher(algo: str = DEFAULT_ALGO, *, threads: bool = False) -> Hasher:
    """A fresh hash object; ``threads`` lets blake3 use all cores."""
    check_algo(algo)
    if algo == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
    if algo == "xxh128":
        import xxhash

        # xxh3_128's hexdigest is the canonical big-endian form xxh128sum prints.
        return xxhash.xxh3_128()
    return hashlib.sha256()


def open_for_reading(path: Path) -> io.FileIO:
    """Open unbuffered (``readinto`` fills our buffer directly), with clear errors."""
    try:
        return open_regular_raw(path)  # a pipe or device is refused: reading one may not end
    except FileNotFoundError:
        raise no_such_file(path) from None
    except IsADirectoryError:
        raise InputError(
            f"{path}: is a directory, not a file",
            path=path,
            hint=f"torchverity manifest {shell_path(path)}",
        ) from None
    except PermissionError:
        raise InputError(
            f"{path}: permission denied", path=path, hint="check the file's permissions"
        ) from None


def hash_stream(
    fh: io.RawIOBase, hasher: Hasher, progress: Callable[[int], None] | None = None
) -> int:
    """Feed everything readable from ``fh`` into ``hasher``; return the byte count.

    A reader thread fills the next buffer while this thread hashes the last
    one (both release the GIL), so the copy out of the page cache is hidden
    behind the hash and throughput matches hashing bytes already in memory.
    Memory stays at ``_BUFFERS`` fixed buffers whatever the file size.
    Small files skip the thread: one read into a buffer of their own size.
    """
    size = _remaining(fh)
    if size is not None and size < READ_SIZE:
        return _hash_small(fh, hasher, size, progress)
    return _hash_pipelined(fh, hasher, progress)


def _hash_pipelined(
    fh: io.RawIOBase, hasher: Hasher, progress: Callable[[int], None] | None
) -> int:
    import queue  # with threading: only files of READ_SIZE or more take this path
    import threading

    free: queue.Queue[bytearray] = queue.Queue()
    filled: queue.Queue[tuple[bytearray, int] | BaseException] = queue.Queue()
    for _ in range(_BUFFERS):
        free.put(bytearray(READ_SIZE))
    reader = threading.Thread(target=_read_ahead, args=(fh, free, filled), daemon=True)
    reader.start()
    total = 0
    try:
        while True:
            item = filled.get()
            if isinstance(item, BaseException):
                raise item
            buffer, n = item
            if not n:
                return total
            hasher.update(memoryview(buffer)[:n])
            total += n
            free.put(buffer)
            if progress:
                progress(n)
    finally:
        free.put(_STOP)
        reader.join()


def _remaining(fh: io.RawIOBase) -> int | None:
    try:
        return max(0, os.fstat(fh.fileno()).st_size - fh.tell())
    except (OSError, ValueError):
        return None


def _hash_small(
    fh: io.RawIOBase, hasher: Hasher, size: int, progress: Callable[[int], None] | None
) -> int:
    # One byte more than the size seen, to notice a file that grew meanwhile.
    buffer = bytearray(size + 1)
    view = memoryview(buffer)
    total = 0
    while total < len(buffer) and (n := fh.readinto(view[total:])):
        total += n
    hasher.update(view[:total])
    if progress:
        progress(total)
    if total == len(buffer):
        total += _hash_pipelined(fh, hasher, progress)
    return total


def _read_ahead(
    fh: io.RawIOBase,
    free: queue.Queue[bytearray],
    filled: queue.Queue[tuple[bytearray, int] | BaseException],
) -> None:
    while True:
        buffer = free.get()
        if buffer is _STOP:
            return
        try:
            n = fh.readinto(buffer) or 0
        except OSError as exc:
            filled.put(exc)
            return
        filled.put((buffer, n))
        if not n:
            return


def digest_file(
    path: str | os.PathLike[str],
    algo: str = DEFAULT_ALGO,
    *,
    threads: bool = True,
    progress: Callable[[int], None] | None = None,
) -> FileDigest:
    """Digest a file in one streaming pass with constant memory.

    Reads go through fixed buffers rather than mmap: a file truncated by
    another process while mapped would kill this one with SIGBUS.
    """
    p = Path(path)
    hasher = new_hasher(algo, threads=threads)
    with open_for_reading(p) as fh:
        try:
            size = hash_stream(fh, hasher, progress)
        except OSError as exc:
            raise InputError(f"{p}: cannot read: {exc.strerror or exc}", path=p) from None
    return FileDigest(path=os.fspath(p), algo=algo, hexdigest=hasher.hexdigest(), size=size)


_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def check_sha256_hex(value: str, path: Path | None = None) -> str:
    """``value`` lower-cased when it can be a SHA-256 at all; else UsageError: text that
    is no digest is a mistyped argument, not a file that differs."""
    if isinstance(value, str) and _SHA256_HEX.fullmatch(value):
        return value.lower()
    where = shell_path(path) if path is not None else "FILE"
    raise UsageError(f"the trusted SHA-256 {value!r} is not one: a SHA-256 is 64 hex digits",
                     hint="pass the whole SHA-256 the file's publisher lists (torchverity hash "
                          f"--algo sha256 {where} prints this copy's, to compare)")


def require_sha256(path: Path, trusted: str, *, refusing: str, hint: str) -> str:
    """The file's sha256 when it is the one the caller trusts; otherwise IntegrityError
    (UsageError when ``trusted`` is no SHA-256 at all)."""
    from torchverity.errors import IntegrityError

    trusted = check_sha256_hex(trusted, path)
    actual = digest_file(path, "sha256").hexdigest
    if actual != trusted.lower():
        raise IntegrityError(f"{path}: sha256 is {actual}, not the trusted {trusted}: {refusing}",
                             path=path, expected=trusted.lower(), actual=actual, hint=hint)
    return actual


def digest_files(
    paths: Iterable[str | os.PathLike[str]],
    algo: str = DEFAULT_ALGO,
    *,
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[FileDigest]:
    """Digest many files in parallel threads (both hashes release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor  # off the start-up of one-file commands

    items = list(paths)
    workers = workers or min(len(items), os.cpu_count() or 1) or 1
    # With several files in flight, one thread per file already fills the cores.
    threads = workers == 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(
            pool.map(lambda p: digest_file(p, algo, threads=threads, progress=progress), items)
        )


# ---------------------------------------------------------------- sidecars

_SIDECAR_LINE = re.compile(r"^(?P<hex>[0-9a-fA-F]+) [ *](?P<name>.+)$")


def sidecar_path(path: str | os.PathLike[str], algo: str = DEFAULT_ALGO) -> Path:
    return Path(f"{os.fspath(path)}.{check_algo(algo)}")


def find_sidecar(path: str | os.PathLike[str]) -> Path | None:
    """The first existing sidecar of ``path``, in ALGORITHMS order."""
    for algo in ALGORITHMS:
        candidate = sidecar_path(path, algo)
        if candidate.is_file():
            return candidate
    return None


def format_sidecar_line(hexdigest: str, name: str) -> str:
    """``<hex>  <name>``: the sha256sum text format."""
    return f"{hexdigest}  {name}\n"


def write_sidecar(
    path: str | os.PathLike[str], digest: FileDigest | str, algo: str | None = None
) -> Path:
    """Write ``FILE.<algo>`` atomically next to the file and return its path."""
    hexdigest = digest.hexdigest if isinstance(digest, FileDigest) else digest
    algo = algo or (digest.algo if isinstance(digest, FileDigest) else DEFAULT_ALGO)
    target = sidecar_path(path, algo)
    atomic_write_text(target, format_sidecar_line(hexdigest.lower(), Path(path).name))
    return target


def read_sidecar(sidecar: str | os.PathLike[str]) -> tuple[str, str, str]:
    """Parse a sidecar into ``(algo, hexdigest, name)``; malformed input raises FormatError."""
    p = Path(sidecar)
    algo = p.suffix.lstrip(".")
    if algo not in ALGORITHMS:
        raise FormatError(
            f"{p}: unknown sidecar algorithm '{algo}'",
            path=p,
            hint=f"sidecars end in one of: {', '.join('.' + a for a in ALGORITHMS)}",
        )
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read sidecar: {exc}", path=p) from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    match = _SIDECAR_LINE.match(lines[0]) if len(lines) == 1 else None
    if not match or len(match["hex"]) != HEX_LENGTH[algo]:
        raise FormatError(
            f"{p}: not a valid {algo} sidecar "
            f"(expected one line '<{HEX_LENGTH[algo]} hex digits>  <name>')",
            path=p,
            hint=f"rewrite it with: torchverity hash --algo {algo} --write "
                 f"{shell_path(p.with_suffix(''))}",
        )
    return algo, match["hex"].lower(), match["name"]


def fsync_path(path: Path) -> None:
    """fsync a file or folder by name (a folder's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small text file via a temp file and rename: readers never see half of it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(f"{path}: cannot write: {exc.strerror or exc}", path=path) from None
