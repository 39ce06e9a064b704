"""Check files against their sidecars and folders against their manifests.

Verification returns a :class:`VerifyResult` listing each path as ``ok``,
``mismatched``, ``missing`` or ``extra`` with the expected and actual digests;
the caller (or the CLI) decides what fails. Inputs that cannot be checked at
all (no sidecar, no manifest, malformed records) raise typed errors instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torchverity._generation_pointer import SHARDS_IN_GENERATION, has_pointer, live_generation
from torchverity._verify_results import (
    STATUSES,
    Status,
    VerifyEntry,
    VerifyResult,
    _damaged_tensors,
)
from torchverity._verify_sidecars import (
    excluded,
    own_records,
    verify_by_manifest,
    verify_sidecars,
)
from torchverity.digest import digest_file, digest_files, find_sidecar, sidecar_path
from torchverity.errors import InputError, shell_path
from torchverity.manifest import (
    MANIFEST_FILES,
    find_manifest,
    list_files,
    read_manifest,
    resolve_inside,
)

__all__ = ["STATUSES", "Status", "VerifyEntry", "VerifyResult", "verify_directory",
           "verify_file", "verify_path"]


def verify_file(
    path: str | os.PathLike[str], *, progress: Callable[[int], None] | None = None
) -> VerifyResult:
    """Check a file against its sidecar (``FILE.sha256`` or ``FILE.blake3``); a link to
    a checkpoint of its folder (Lightning's ``last.ckpt``), against that checkpoint's.

    The sidecar is chosen as ``torchverity.load`` chooses it: the one of the
    algorithm meta.json records, or the pending one of a save killed right
    after renaming the file, when the file matches it.
    """
    from torchverity.checkpoint._records import linked_checkpoint, resolve_records

    p = linked_checkpoint(Path(path))
    records = resolve_records(p)
    sidecar, algo, expected = records.sidecar, records.algo, records.hexdigest
    listed = verify_by_manifest(p, progress) if sidecar is None else None
    if listed is not None:
        return listed
    named = _by_torch_hub_name(p, progress) if sidecar is None else None
    if named is not None:
        return named
    if sidecar is None or algo is None or expected is None:
        raise InputError(
            f"{p}: no sidecar ({sidecar_path(p).name} or {sidecar_path(p, 'blake3').name})",
            path=p,
            hint=f"record one from a trusted copy: torchverity hash --write {shell_path(p)} (or "
                 "list it in a manifest of its folder: torchverity manifest "
                 f"{shell_path(p.parent)})",
        )
    if not p.exists():
        entry = VerifyEntry(p.name, "missing", expected=expected)
    else:
        actual = digest_file(p, algo, progress=progress)
        status: Status = "ok" if actual.hexdigest == expected else "mismatched"
        entry = VerifyEntry(p.name, status, expected, actual.hexdigest, actual_size=actual.size,
                            tensors=_damaged_tensors(p) if status == "mismatched" else ())
    return VerifyResult(os.fspath(p), "file", algo, (entry,), os.fspath(sidecar),
                        certification_of([p]))


def _by_torch_hub_name(p: Path, progress: Callable[[int], None] | None
                       ) -> VerifyResult | None:
    """A torch.hub download against the SHA-256 prefix in its name (None for others)."""
    from torchverity.provenance._torch_hub import record_name, torch_hub_prefix

    prefix = torch_hub_prefix(p)
    if prefix is None or not p.is_file():
        return None
    actual = digest_file(p, "sha256", progress=progress)
    status: Status = "ok" if actual.hexdigest.startswith(prefix) else "mismatched"
    entry = VerifyEntry(p.name, status, prefix, actual.hexdigest, actual_size=actual.size,
                        tensors=_damaged_tensors(p) if status == "mismatched" else ())
    return VerifyResult(os.fspath(p), "file", "sha256", (entry,), record_name(prefix))


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
    unlisted = [rel for rel in files
                if rel not in expected and rel not in MANIFEST_FILES and not excluded(rel, exclude)]
    records = own_records(root, unlisted, expected)
    entries += [VerifyEntry(rel, "extra") for rel in unlisted if rel not in records]
    entries.sort(key=lambda e: e.path.encode())
    return VerifyResult(
        os.fspath(root), "directory", manifest.algo, tuple(entries), os.fspath(record),
        certification_of([root / e.path for e in entries if e.status != "extra"]),
        tuple(records),
    )


def certification_of(paths: list[Path]) -> dict[str, Any] | None:
    """The training guard's certification in the meta.json of any of ``paths``, or beside
    a distributed checkpoint's fingerprints (the uncertified one first: one doubtful file
    makes the whole doubtful)."""
    from torchverity.checkpoint._meta import meta_path_for, read_meta

    found = []
    for path in paths:
        meta_file = meta_path_for(path)
        record = (read_meta(meta_file).get("certification") if meta_file.is_file() else
                  _shards_certification(path) if path.name == SHARDS_IN_GENERATION else None)
        if isinstance(record, dict) and "certified" in record:
            found.append(record)
    found.sort(key=lambda c: bool(c["certified"]))
    return found[0] if found else None


def _shards_certification(path: Path) -> Any:
    import json

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None  # the manifest check reports a damaged file
    return record.get("certification") if isinstance(record, dict) else None


def _size(size: int) -> int | None:
    return size if size >= 0 else None


def verify_path(
    path: str | os.PathLike[str], *, progress: Callable[[int], None] | None = None,
    exclude: Sequence[str] = (),
) -> VerifyResult:
    """A folder is checked against its manifest (or its files' sidecars), anything else
    against its sidecar (or its folder's manifest). A folder kept in generations (a
    distributed checkpoint) is checked as the generation its pointer names."""
    p = Path(path)
    if p.is_dir():
        live = live_generation(p) if has_pointer(p) else p
        return verify_directory(live, progress=progress, exclude=exclude)
    if not p.exists() and find_sidecar(p) is None:
        raise InputError(f"{p}: no such file or directory", path=p)
    return verify_file(p, progress=progress)
