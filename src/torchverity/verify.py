"""Check files against their sidecars and folders against their manifests.

Verification returns a :class:`VerifyResult` listing each path as ``ok``,
``mismatched``, ``missing`` or ``extra`` with the expected and actual digests;
the caller (or the CLI) decides what fails. Inputs that cannot be checked at
all (no sidecar, no manifest, malformed records) raise typed errors instead.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchverity._verify_sidecars import excluded, verify_by_manifest, verify_sidecars
from torchverity.digest import digest_file, digest_files, find_sidecar, read_sidecar, sidecar_path
from torchverity.errors import InputError
from torchverity.manifest import (
    MANIFEST_FILES,
    find_manifest,
    list_files,
    read_manifest,
    resolve_inside,
)

Status = Literal["ok", "mismatched", "missing", "extra"]
STATUSES: tuple[Status, ...] = ("ok", "mismatched", "missing", "extra")


@dataclass(frozen=True)
class VerifyEntry:
    path: str
    status: Status
    expected: str | None = None
    actual: str | None = None
    expected_size: int | None = None
    actual_size: int | None = None
    tensors: tuple[str, ...] = ()


@dataclass(frozen=True)
class VerifyResult:
    """The outcome for one target: a file (against its sidecar) or a folder (manifest)."""

    target: str
    kind: Literal["file", "directory"]
    algo: str
    entries: tuple[VerifyEntry, ...]
    record: str

    @property
    def ok(self) -> bool:
        return all(e.status == "ok" for e in self.entries)

    @property
    def counts(self) -> dict[str, int]:
        counted = Counter(e.status for e in self.entries)
        return {s: counted.get(s, 0) for s in STATUSES}

    @property
    def problems(self) -> tuple[VerifyEntry, ...]:
        return tuple(e for e in self.entries if e.status != "ok")

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "kind": self.kind,
            "algorithm": self.algo,
            "record": self.record,
            "ok": self.ok,
            "counts": self.counts,
            "entries": [
                {k: v for k, v in vars(e).items() if v not in (None, ())} for e in self.entries
            ],
        }


def verify_file(
    path: str | os.PathLike[str], *, progress: Callable[[int], None] | None = None
) -> VerifyResult:
    """Check a file against its sidecar (``FILE.sha256`` or ``FILE.blake3``)."""
    p = Path(path)
    sidecar = find_sidecar(p)
    listed = verify_by_manifest(p, progress) if sidecar is None else None
    if listed is not None:
        return listed
    if sidecar is None:
        raise InputError(
            f"{p}: no sidecar ({sidecar_path(p).name} or {sidecar_path(p, 'blake3').name})",
            path=p,
            hint=f"record one from a trusted copy: torchverity hash --write {p} (or list it "
                 f"in a manifest of its folder: torchverity manifest {p.parent})",
        )
    algo, expected, _name = read_sidecar(sidecar)
    if not p.exists():
        entry = VerifyEntry(p.name, "missing", expected=expected)
    else:
        actual = digest_file(p, algo, progress=progress)
        status: Status = "ok" if actual.hexdigest == expected else "mismatched"
        entry = VerifyEntry(p.name, status, expected, actual.hexdigest, actual_size=actual.size,
                            tensors=_damaged_tensors(p) if status == "mismatched" else ())
    return VerifyResult(os.fspath(p), "file", algo, (entry,), os.fspath(sidecar))


def verify_directory(
    directory: str | os.PathLike[str], *, progress: Callable[[int], None] | None = None,
    exclude: Sequence[str] = (),
) -> VerifyResult:
    """Check a folder against its manifest: ok, mismatched, missing and extra files.

    With no manifest, every file that has a sidecar is checked against it.
    Paths matching an ``exclude`` glob (on the path or the file name) are skipped.
    """
    root = Path(directory)
    if not any((root / name).is_file() for name in MANIFEST_FILES) and root.is_dir():
        return verify_sidecars(root, exclude, progress)
    record = find_manifest(root)
    manifest = read_manifest(record)
    expected = {e.path: e for e in manifest.entries if not excluded(e.path, exclude)}
    present = [rel for rel in expected if resolve_inside(root, rel, record).is_file()]
    digests = digest_files([root / rel for rel in present], manifest.algo, progress=progress)
    actual = dict(zip(present, digests, strict=True))
    entries: list[VerifyEntry] = []
    for rel, exp in expected.items():
        got = actual.get(rel)
        if got is None:
            entries.append(VerifyEntry(rel, "missing", exp.digest, expected_size=_size(exp.size)))
            continue
        same = got.hexdigest == exp.digest and exp.size in (-1, got.size)
        entries.append(
            VerifyEntry(
                rel,
                "ok" if same else "mismatched",
                exp.digest,
                got.hexdigest,
                _size(exp.size),
                got.size,
                () if same else _damaged_tensors(root / rel),
            )
        )
    files, _links = list_files(root)
    entries += [
        VerifyEntry(rel, "extra")
        for rel in files
        if rel not in expected and rel not in MANIFEST_FILES and not excluded(rel, exclude)
    ]
    entries.sort(key=lambda e: e.path.encode())
    return VerifyResult(
        os.fspath(root), "directory", manifest.algo, tuple(entries), os.fspath(record)
    )


def _damaged_tensors(path: Path) -> tuple[str, ...]:
    """For a checkpoint saved with its meta.json, the tensors the damage hit."""
    from torchverity.checkpoint._meta import meta_path_for

    if not meta_path_for(path).is_file():
        return ()  # no record of its tensors: torch is not needed (nor imported)
    from torchverity.checkpoint._damage import locate_damage

    return tuple(locate_damage(path))


def _size(size: int) -> int | None:
    return size if size >= 0 else None


def verify_path(
    path: str | os.PathLike[str], *, progress: Callable[[int], None] | None = None,
    exclude: Sequence[str] = (),
) -> VerifyResult:
    """A folder is checked against its manifest (or its files' sidecars), anything else
    against its sidecar (or its folder's manifest)."""
    p = Path(path)
    if p.is_dir():
        return verify_directory(p, progress=progress, exclude=exclude)
    if not p.exists() and find_sidecar(p) is None:
        raise InputError(f"{p}: no such file or directory", path=p)
    return verify_file(p, progress=progress)
