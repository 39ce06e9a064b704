"""Digests torchverity already recorded, reused when they are still fresh.

A digest recorded by ``torchverity manifest`` or beside a file by
``torchverity.save`` / ``torchverity hash --write`` describes the file as it was
when the record was written. It is reused for signing only when the file has
not been modified since (its mtime is not after the record's) and, where the
record holds one, its size still matches; otherwise the file is hashed again.
A fault that changes bytes without touching the mtime (a flipped bit on disk)
is then signed as the recorded, good content, and verification points at it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torchverity.digest import digest_files, read_sidecar, sidecar_path
from torchverity.errors import TorchVerityError
from torchverity.manifest import MANIFEST_NAME, SHA256SUM_NAME, read_manifest


@dataclass(frozen=True)
class Digests:
    """Each file's digest under ``algo``, and where each came from."""

    algo: str
    hexdigests: dict[str, str]
    reused: dict[str, str]  # path -> the record it came from
    hashed: tuple[str, ...]


def _mtime(path: Path) -> int | None:
    try:
        return os.stat(path, follow_symlinks=False).st_mtime_ns
    except OSError:
        return None


def _fresh(path: Path, record_mtime: int, size: int = -1) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return st.st_mtime_ns <= record_mtime and size in (-1, st.st_size)


def _from_manifest(root: Path, wanted: set[str], algo: str) -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for name in (MANIFEST_NAME, SHA256SUM_NAME):
        record = root / name
        mtime = _mtime(record)
        if mtime is None:
            continue
        try:
            manifest = read_manifest(record)
        except TorchVerityError:
            continue  # an unreadable record is just not reused
        if manifest.algo != algo:
            continue
        for e in manifest.entries:
            if e.path in wanted and e.path not in found and _fresh(root / e.path, mtime, e.size):
                found[e.path] = (e.digest, name)
    return found


def _from_sidecar(root: Path, rel: str, algo: str) -> tuple[str, str] | None:
    path = root / rel if rel != "." else root
    side = sidecar_path(path, algo)
    mtime = _mtime(side)
    if mtime is None or not _fresh(path, mtime):
        return None
    try:
        _algo, hexd, name = read_sidecar(side)
    except TorchVerityError:
        return None
    return (hexd, side.name) if name == path.name else None


def model_digests(root: Path, files: list[str], algo: str) -> Digests:
    """``algo`` digests of ``files`` (relative to ``root``; ``"."`` when ``root`` is the
    file), reusing fresh records of the same algorithm."""
    folder = root if root.is_dir() else root.parent
    recorded = _from_manifest(folder, set(files), algo) if root.is_dir() else {}
    for rel in files:
        if rel not in recorded and (hit := _from_sidecar(root, rel, algo)) is not None:
            recorded[rel] = hit
    todo = [rel for rel in files if rel not in recorded]
    paths = [root / rel if rel != "." else root for rel in todo]
    digests = {rel: d.hexdigest for rel, d in zip(todo, digest_files(paths, algo), strict=True)}
    hexdigests = {rel: recorded[rel][0] if rel in recorded else digests[rel] for rel in files}
    return Digests(algo, hexdigests, {rel: src for rel, (_h, src) in recorded.items()},
                   tuple(todo))
