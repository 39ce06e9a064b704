"""The input manifest: list a job's inputs once, then re-verify each when it is read.

An input's identity is its key (its path relative to the inputs folder, or to
the list file's folder) and the SHA-256 of its bytes at listing time. Workers
read an input exactly once, hash the very bytes they hand to the model, and
compare with the manifest, so a file that changed after listing is never
processed with the wrong bytes (not even when it changes between a check and
a read: there is no second read).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from torchverity.errors import InputError, UsageError

DIGEST_ALGO = "sha256"
# Defined here (not in _journal, which imports this module) so listing can skip job folders.
JOURNAL_NAME = "batch-journal.sqlite"
# Files up to this size are read in one call: cheaper than a streaming pass with its
# fixed 8 MiB buffer, which dominates for the many small files of a batch.
WHOLE_READ_MAX = 8 * 1024 * 1024
# The listing hashes on all cores only when a sample of the inputs has this median size.
THREADED_LISTING_MIN_BYTES = 64 * 1024
_SAMPLE = 16
# Read size once an input turns out larger than expected (it grew: the digest check fails).
_READ_MORE = 1 << 20


@dataclass(frozen=True)
class InputRecord:
    """One line of the input manifest."""

    key: str
    path: str
    size: int
    mtime_ns: int
    digest: str


class InputChanged(Exception):
    """The input's bytes are not those listed in the manifest (or it is gone)."""


def list_inputs(spec: Path, *, exclude: Path | None = None,
                skip_missing: bool = False) -> list[InputRecord]:
    """List a folder (recursively, sorted) or a list file (one path per line) and digest all.

    ``skip_missing``: a list file may name files that are gone (a rerun compares the
    listing with the journal, where a deleted input is a removed one, not an error).
    """
    if spec.is_dir():
        keyed = _walk(spec.resolve(), exclude.resolve() if exclude else None)
    elif spec.is_file():
        keyed = _read_list(spec, skip_missing)
    else:
        raise InputError(
            f"{spec}: no such folder or list file",
            path=spec,
            hint="--inputs takes a folder of input files or a text file with one path per line",
        )
    if not keyed:
        raise InputError(f"{spec}: no input files found", path=spec)
    if not _hashing_dominates(keyed):
        return sorted(_records(keyed), key=lambda r: r.key)
    # One task per thread, not per file: a future per small file costs more than its hash.
    threads = min(_cpu_count(), len(keyed))
    chunks = [keyed[i::threads] for i in range(threads)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        done = list(pool.map(_records, chunks))
    return sorted((r for chunk in done for r in chunk), key=lambda r: r.key)


def _hashing_dominates(keyed: list[tuple[str, str]]) -> bool:
    """Whether the inputs (judged by a sample) are large enough for threads to pay.

    Hashing releases the GIL, so large inputs hash on every core at once; for
    small ones Python's per-file work dominates, which threads only fight over
    (4,000 x 10 KiB: 18 us per file on one thread, 21-27 us on two).
    """
    sizes = []
    for _, path in keyed[:: max(1, len(keyed) // _SAMPLE)]:
        try:
            sizes.append(os.stat(path).st_size)
        except OSError:
            continue  # _record names the error
    return bool(sizes) and sorted(sizes)[len(sizes) // 2] >= THREADED_LISTING_MIN_BYTES


def _records(keyed: list[tuple[str, str]]) -> list[InputRecord]:
    return [_record(key, path) for key, path in keyed]


def _record(key: str, path: str) -> InputRecord:
    try:
        digest, size, mtime_ns = file_digest(path)
    except FileNotFoundError:
        raise InputError(f"{path}: vanished while the inputs were listed", path=path) from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}", path=path) from None
    return InputRecord(key, path, size, mtime_ns, digest)


def file_digest(path: str | os.PathLike[str]) -> tuple[str, int, int]:
    """SHA-256, size and mtime (ns) of a file (an input or a stored output), from one open.

    Listing thousands of small inputs is bound by Python's per-file work, not by
    hashing: a second stat by name, a file object or a streaming pass with its
    fixed buffers cost more than the hash, so files up to ``WHOLE_READ_MAX`` are
    read in one call on the bare descriptor.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_size <= WHOLE_READ_MAX:
            data = read_all(fd, st.st_size)
            return hashlib.sha256(data).hexdigest(), len(data), st.st_mtime_ns
        from torchverity.digest import hash_stream, new_hasher

        hasher = new_hasher(DIGEST_ALGO)
        with io.FileIO(fd, "r", closefd=False) as fh:
            size = hash_stream(fh, hasher)
        return hasher.hexdigest(), size, st.st_mtime_ns
    finally:
        os.close(fd)


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _walk(root: Path, exclude: Path | None) -> list[tuple[str, str]]:
    """(key, path) of every regular file under ``root`` (symlinks to files count; symlinked
    folders are not entered, as with ``os.walk``); unreadable folders are skipped."""
    found: list[tuple[str, str]] = []
    # Strings and DirEntry types, no Path per file: listing thousands of small inputs
    # with pathlib cost more than hashing them.
    _scan(os.fspath(root), "", os.fspath(exclude) if exclude else None, found)
    return sorted(found)


def _scan(folder: str, prefix: str, exclude: str | None, found: list[tuple[str, str]]) -> None:
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir():
            # Output folders may live inside the inputs folder: never list a job's outputs.
            skip = entry.is_symlink() or entry.path == exclude or os.path.exists(
                os.path.join(entry.path, JOURNAL_NAME))
            if not skip:
                _scan(entry.path, f"{prefix}{entry.name}/", exclude, found)
        elif entry.is_file():
            found.append((prefix + entry.name, entry.path))


def _read_list(list_file: Path, skip_missing: bool) -> list[tuple[str, str]]:
    base = list_file.resolve().parent
    try:
        lines = list_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{list_file}: cannot read the input list: {exc}",
                         path=list_file) from None
    found: dict[str, Path] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        path = (base / line.strip()).resolve()
        key = _list_key(path, base)
        if key in found:
            raise UsageError(
                f"{list_file}:{number}: '{line.strip()}' is listed twice",
                hint="each input may appear once: an input is one item with one output",
            )
        if not path.is_file():
            if skip_missing:
                continue
            raise InputError(f"{list_file}:{number}: {path}: no such file", path=path)
        found[key] = path
    return sorted((key, os.fspath(path)) for key, path in found.items())


def _list_key(path: Path, base: Path) -> str:
    """Relative to the list's folder when inside it, else the absolute path without its root."""
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.as_posix().lstrip("/")


def manifest_root(records: Sequence[InputRecord]) -> str:
    """One digest over the whole input manifest (its sha256sum lines, sorted by key)."""
    h = hashlib.sha256()
    for line in manifest_lines(records):
        h.update(line.encode())
    return h.hexdigest()


def manifest_lines(records: Sequence[InputRecord]) -> Iterator[str]:
    """``<hex>  <key>`` lines: ``sha256sum -c`` run in the inputs folder checks them."""
    for r in sorted(records, key=lambda r: r.key):
        yield f"{r.digest}  {r.key}\n"


def read_verified(path: str, size: int, digest: str) -> bytes:
    """Read an input once and return its bytes if they are the listed ones.

    Raises :class:`InputChanged` naming what differs; the caller records the
    item as ``input-changed`` and never runs the model on these bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise InputChanged("the input file is gone") from None
    try:
        now = os.fstat(fd).st_size
        if now != size:
            raise InputChanged(f"size is {now} bytes, was {size} when listed")
        data = read_all(fd, size)
    finally:
        os.close(fd)
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise InputChanged(f"sha256 is {actual[:16]}…, was {digest[:16]}… when listed")
    return data


def read_all(fd: int, size: int) -> bytes:
    """Every byte left in ``fd``, expected to be ``size``: one read, then the one that sees
    the end. Plain ``os.read`` calls: a file object per small input cost more than its hash."""
    parts = [os.read(fd, size + 1)]
    while parts[-1]:
        parts.append(os.read(fd, max(size, _READ_MORE)))
    return parts[0] if len(parts) == 2 else b"".join(parts)
