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
    NO_ALGO,
    NO_RECORD,
    SIDECAR_SUFFIXES,
    broken_unrecorded,
    excluded,
    no_record_error,
    own_records,
    verify_by_manifest,
    verify_sidecars,
)
from torchverity.digest import digest_file, digest_files, find_sidecar
from torchverity.errors import InputError, shell_path
from torchverity.manifest import (
    MANIFEST_FILES,
    Manifest,
    find_manifest,
    list_files,
    read_manifest,
    resolve_inside,
)

__all__ = ["STATUSES", "Status", "VerifyEntry", "VerifyResult", "verify_directory",
           "verify_file", "verify_path"]

# Hugging Face's sharded checkpoints name their index model.safetensors.index.json,
# pytorch_model.bin.index.json, diffusion_pytorch_model.safetensors.index.json...
INDEX_SUFFIX = ".index.json"


def verify_file(
    path: str | os.PathLike[str], *, progress: Callable[[int], None] | None = None
) -> VerifyResult:
    """Check a file against its sidecar (``FILE.blake3``, ``.sha256`` or ``.xxh128``); a
    link to a checkpoint of its folder (Lightning's ``last.ckpt``), against that
    checkpoint's. An index of a sharded checkpoint (``*.index.json``) stands for the
    checkpoint: the shards it names are checked too, each against its own record.

    The sidecar is chosen as ``torchverity.load`` chooses it: the one of the
    algorithm meta.json records, or the pending one of a save killed right
    after renaming the file, when the file matches it. A file no record covers
    that is a Git LFS pointer or an HTML page saved under a weights name fails as
    the broken download it is (``result.broken``).
    """
    from torchverity.checkpoint._records import linked_checkpoint

    p = linked_checkpoint(Path(path))
    result = _verify_recorded(p, progress)
    if result is None:
        raise no_record_error(p)
    # A damaged index cannot be trusted to name the shards: its own entry says what to do.
    if not p.name.endswith(INDEX_SUFFIX) or not result.ok:
        return result
    return _with_shards(result, p, progress)


def _verify_recorded(p: Path, progress: Callable[[int], None] | None) -> VerifyResult | None:
    """``p`` against its record; None when nothing records its digest (and it is no broken
    download)."""
    from torchverity.checkpoint._records import resolve_records

    records = resolve_records(p)
    sidecar, algo, expected = records.sidecar, records.algo, records.hexdigest
    listed = verify_by_manifest(p, progress) if sidecar is None else None
    if listed is not None:
        return listed
    named = _by_torch_hub_name(p, progress) if sidecar is None else None
    if named is not None:
        return named
    if sidecar is None or algo is None or expected is None:
        if p.is_file() and broken_unrecorded(p) is not None:
            return VerifyResult(os.fspath(p), "file", NO_ALGO, (), NO_RECORD, broken=(p.name,))
        return None
    if not p.exists():
        entry = VerifyEntry(p.name, "missing", expected=expected)
    else:
        actual = digest_file(p, algo, progress=progress)
        status: Status = "ok" if actual.hexdigest == expected else "mismatched"
        entry = VerifyEntry(p.name, status, expected, actual.hexdigest, actual_size=actual.size,
                            tensors=_damaged_tensors(p) if status == "mismatched" else ())
    return VerifyResult(os.fspath(p), "file", algo, (entry,), os.fspath(sidecar),
                        certification_of([p]))


def _with_shards(index_result: VerifyResult, index: Path,
                 progress: Callable[[int], None] | None) -> VerifyResult:
    """The index's result with every shard it names, each against its own record (its
    sidecar or the manifest of the folder); a shard that is gone is missing."""
    from torchverity.checkpoint._index import read_index

    shards = [index.parent / name for name in dict.fromkeys(read_index(index).values())]
    results = [index_result]
    entries = list(index_result.entries)
    unrecorded = []
    for shard in shards:
        result = _verify_recorded(shard, progress)
        if result is None and shard.exists():
            unrecorded.append(shard)
        elif result is None:
            entries.append(VerifyEntry(shard.name, "missing"))
        else:
            results.append(result)
            entries += result.entries
    if unrecorded:
        raise _unrecorded_shards(index, unrecorded)
    return VerifyResult(
        os.fspath(index), "file",
        "+".join(sorted({r.algo for r in results if r.algo != NO_ALGO})) or NO_ALGO,
        tuple(entries), _records_named(results),
        certification_of([index, *(s for s in shards if s.is_file())]),
        broken=tuple(b for r in results for b in r.broken))


def _records_named(results: list[VerifyResult]) -> str:
    """What vouched for an index and its shards: the manifest by name, sidecars counted
    (a torchverity save gives each shard its own)."""
    records = [r.record for r in results if r.record != NO_RECORD]
    sidecars = {r for r in records if r.endswith(SIDECAR_SUFFIXES)
                or r.endswith(tuple(f"{s}.pending" for s in SIDECAR_SUFFIXES))}
    named = [r for r in dict.fromkeys(records) if r not in sidecars]
    if sidecars:
        named.append(f"{len(sidecars)} sidecar(s)")
    return ", ".join(named) or NO_RECORD


def _unrecorded_shards(index: Path, shards: list[Path]) -> InputError:
    names = ", ".join(s.name for s in shards)
    folder = shell_path(index.parent)
    return InputError(
        f"{index}: {len(shards)} shard(s) it names have no record to check them against (no "
        f"sidecar, not in a manifest of the folder): {names}", path=index,
        hint=f"record the whole checkpoint from a trusted copy: torchverity manifest {folder}",
    )


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

    A folder with no manifest of its own is checked against the nearest manifest above
    that lists files in it (a pipeline's root lists ``unet/...``); with none, every file
    that has a sidecar is checked against it. Paths matching an ``exclude`` glob (on the
    path, the file name or a folder above it) are skipped; the recorded ones are named.
    """
    root = Path(directory)
    found = _manifest_over(root)
    if found is None:
        return verify_sidecars(root, exclude, progress)
    record, manifest, prefix = found
    listed = {e.path[len(prefix):]: e for e in manifest.entries if e.path.startswith(prefix)}
    expected = {rel: e for rel, e in listed.items() if not excluded(rel, exclude)}
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
                if rel not in listed and rel not in MANIFEST_FILES and not excluded(rel, exclude)]
    records = own_records(root, unlisted, expected)
    extra = [rel for rel in unlisted if rel not in records]
    entries += _extras(root, extra, [e for e in entries if e.status == "missing"], manifest.algo)
    entries.sort(key=lambda e: e.path.encode())
    return VerifyResult(
        os.fspath(root), "directory", manifest.algo, tuple(entries), os.fspath(record),
        certification_of([root / e.path for e in entries if e.status != "extra"]),
        tuple(records), skipped=tuple(sorted(set(listed) - set(expected))),
    )


def _extras(root: Path, extra: list[str], missing: list[VerifyEntry], algo: str,
            ) -> list[VerifyEntry]:
    """The extra files, each hashed when its size is that of a missing one: a file renamed
    after it was recorded is then told by its digest (``actual``)."""
    sizes = {e.expected_size for e in missing if e.expected_size is not None}
    entries = []
    for rel in extra:
        path = root / rel
        if sizes and path.is_file() and not path.is_symlink() and path.stat().st_size in sizes:
            found = digest_file(path, algo)
            entries.append(VerifyEntry(rel, "extra", actual=found.hexdigest,
                                       actual_size=found.size))
        else:
            entries.append(VerifyEntry(rel, "extra"))
    return entries


def _manifest_over(root: Path) -> tuple[Path, Manifest, str] | None:
    """The manifest that records ``root`` (its own, or the nearest above that lists files
    in it), read, with the prefix of ``root``'s paths in it; None when none does."""
    if any((root / name).is_file() for name in MANIFEST_FILES) or not root.is_dir():
        record = find_manifest(root)  # a path that is no folder is refused here
        return record, read_manifest(record), ""
    from torchverity.checkpoint._folders import covering_manifest

    found = covering_manifest(root)
    if found is None or not found[1]:
        return None
    above, prefix = found
    manifest = read_manifest(above)
    if not any(e.path.startswith(prefix) for e in manifest.entries):
        return None  # the manifest above records other files, not this folder's
    # The manifest as the user's own path reaches it.
    return (above if root.is_absolute() else Path(os.path.relpath(above))), manifest, prefix


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


def _missing_hint(p: Path) -> str:
    """Where to look for a missing path, and the folder check that names every missing
    file when a manifest above lists this one."""
    from torchverity.checkpoint._folders import covering_manifest
    from torchverity.errors import missing_path_hint

    hint = missing_path_hint(p)
    folder = p.parent
    found = covering_manifest(folder) if folder.is_dir() else None
    if found is None:
        return hint
    record, prefix = found
    top = record.parent
    shown = top if p.is_absolute() else Path(os.path.relpath(top))
    listed = any(e.path == prefix + p.name for e in _manifest_entries(record))
    if listed:
        return (f"{hint}; its folder's manifest lists it: torchverity verify "
                f"{shell_path(shown)} checks every file the manifest lists")
    return hint


def _manifest_entries(record: Path) -> tuple[Any, ...]:
    from torchverity.errors import TorchVerityError
    from torchverity.manifest import read_manifest

    try:
        return tuple(read_manifest(record).entries)
    except TorchVerityError:
        return ()  # a damaged manifest is reported when its folder is verified


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
        raise InputError(f"{p}: no such file or directory", path=p, hint=_missing_hint(p))
    return verify_file(p, progress=progress)
