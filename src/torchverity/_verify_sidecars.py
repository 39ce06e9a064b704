"""Verifying what has no manifest: a folder by the sidecars beside its files, a file by its
folder's manifest entry; ``--exclude`` globs; the next step each status calls for.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from torchverity._formats import broken_download
from torchverity._verify_results import VerifyEntry, VerifyResult, _damaged_tensors
from torchverity.digest import ALGORITHMS, digest_file, find_sidecar, read_sidecar
from torchverity.errors import FormatError, InputError, shell_path
from torchverity.manifest import list_files
from torchverity.provenance._torch_hub import refetch_hint, torch_hub_prefix

_SIDECAR_SUFFIXES = tuple(f".{a}" for a in ALGORITHMS)


def excluded(rel: str, exclude: Sequence[str]) -> bool:
    """Whether a relative POSIX path matches a glob (on the path or its file name)."""
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel, g) or fnmatch.fnmatchcase(name, g) for g in exclude)


# torchverity's own records are small; a file under such a name that is not one is foreign.
_MAX_RECORD_BYTES = 1 << 20


def own_records(root: Path, files: Sequence[str], listed: Collection[str]) -> list[str]:
    """The files that are torchverity's own records (a sidecar or meta.json written by
    save, hash or migrate) of a listed file: written after the manifest, they are not
    foreign files."""
    from torchverity.checkpoint._records import META_SUFFIX

    found = []
    for rel in files:
        suffix = next((s for s in (*_SIDECAR_SUFFIXES, META_SUFFIX) if rel.endswith(s)), None)
        if suffix is None or rel[: -len(suffix)] not in listed:
            continue
        if _is_record(root / rel, rel[: -len(suffix)].rsplit("/", 1)[-1], suffix == META_SUFFIX):
            found.append(rel)
    return found


def _is_record(path: Path, of_name: str, meta: bool) -> bool:
    import json

    try:
        if path.stat().st_size > _MAX_RECORD_BYTES:
            return False
        if meta:
            return isinstance(json.loads(path.read_bytes()), dict)
        return read_sidecar(path)[2] == of_name
    except (OSError, ValueError, RecursionError, InputError, FormatError):
        return False


def verify_sidecars(root: Path, exclude: Sequence[str] = (),
                    progress: Callable[[int], None] | None = None) -> VerifyResult:
    """A folder with no manifest: every file that has a sidecar, against it."""
    files, _links = list_files(root)
    present = set(files)
    checked = [rel for rel in files if not excluded(rel, exclude)
               and not (rel.endswith(_SIDECAR_SUFFIXES) and rel.rsplit(".", 1)[0] in present)
               and find_sidecar(root / rel) is not None]
    if not checked:
        raise InputError(
            f"{root}: no manifest and no per-file sidecars (FILE.sha256, .blake3, .xxh128) "
            "in this folder", path=root,
            hint=f"record the folder from a trusted copy: torchverity manifest {shell_path(root)}",
        )
    entries = [check_sidecar(root / rel, rel, progress) for rel in checked]
    algos = sorted({read_sidecar(find_sidecar(root / rel) or root)[0] for rel in checked})
    return VerifyResult(os.fspath(root), "directory", "+".join(algos), tuple(entries),
                        f"{len(entries)} per-file sidecar(s)")


def check_sidecar(path: Path, rel: str, progress: Callable[[int], None] | None,
                  ) -> VerifyEntry:
    sidecar = find_sidecar(path)
    assert sidecar is not None
    algo, expected, _name = read_sidecar(sidecar)
    actual = digest_file(path, algo, progress=progress)
    if actual.hexdigest == expected:
        return VerifyEntry(rel, "ok", expected, actual.hexdigest, actual_size=actual.size)
    return VerifyEntry(rel, "mismatched", expected, actual.hexdigest, actual_size=actual.size,
                       tensors=_damaged_tensors(path))


def verify_by_manifest(path: Path, progress: Callable[[int], None] | None,
                       ) -> VerifyResult | None:
    """A file with no sidecar, against its folder's manifest entry (None when unlisted)."""
    from torchverity.checkpoint._folders import manifest_entry

    listed = manifest_entry(path) if path.parent.is_dir() else None
    if listed is None:
        return None
    algo, expected, record = listed
    if not path.exists():
        entry = VerifyEntry(path.name, "missing", expected=expected)
    else:
        actual = digest_file(path, algo, progress=progress)
        ok = actual.hexdigest == expected
        entry = VerifyEntry(path.name, "ok" if ok else "mismatched", expected,
                            actual.hexdigest, actual_size=actual.size,
                            tensors=() if ok else _damaged_tensors(path))
    return VerifyResult(os.fspath(path), "file", algo, (entry,), os.fspath(record))


def advice(result: VerifyResult) -> list[str]:
    """One next step per kind of problem: an extra file is not damage."""
    counts = result.counts
    target = shell_path(result.target)
    steps = []
    for entry in result.problems:
        broken = broken_download(_entry_path(result, entry.path))
        if broken is not None:
            steps.append(f"{broken.message}; next: {broken.hint}")
    if counts["mismatched"] and torch_hub_prefix(Path(result.target)) is not None:
        steps.append(f"mismatched: the download was damaged after torch.hub checked it; "
                     f"{refetch_hint(target)}")
    elif counts["mismatched"]:
        steps.append("mismatched: the content changed since it was recorded; restore those "
                     "files from a good copy, then rerun torchverity verify")
    if counts["missing"]:
        steps.append("missing: copy those files from the source (or the record is stale: "
                     "rebuild it from a trusted copy with torchverity manifest "
                     f"{target})")
    if counts["extra"]:
        steps.append("extra: files the record does not list; if they belong, record them "
                     f"(torchverity manifest {target}), else remove them or skip them with "
                     "--exclude GLOB")
    return steps


def _entry_path(result: VerifyResult, rel: str) -> Path:
    target = Path(result.target)
    return target / rel if result.kind == "directory" else target
