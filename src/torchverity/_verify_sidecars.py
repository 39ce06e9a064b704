"""Verifying what has no manifest: a folder by the sidecars beside its files, a file by its
folder's manifest entry; ``--exclude`` globs; the next step each status calls for.
"""

from __future__ import annotations

import fnmatch
import os
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from torchverity._formats import broken_download, download_kind, file_format
from torchverity._verify_results import VerifyEntry, VerifyResult, _damaged_tensors
from torchverity.digest import ALGORITHMS, digest_file, find_sidecar, read_sidecar, sidecar_path
from torchverity.errors import FormatError, InputError, shell_path
from torchverity.manifest import MANIFEST_FILES, list_files
from torchverity.provenance._torch_hub import refetch_hint, torch_hub_prefix

SIDECAR_SUFFIXES = tuple(f".{a}" for a in ALGORITHMS)
# The record and algorithm of a result for a file no record covers (a broken download).
NO_RECORD = "no sidecar or manifest"
NO_ALGO = "none"


def excluded(rel: str, exclude: Sequence[str]) -> bool:
    """Whether a relative POSIX path matches a glob, on the path or its file name, or on a
    folder above it or that folder's name (``sub`` and ``sub/`` skip what ``sub`` holds)."""
    parts = rel.split("/")
    paths = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    names = (*paths, *parts)
    return any(fnmatch.fnmatchcase(n, g.rstrip("/") or g) for g in exclude for n in names)


# torchverity's own records are small; a file under such a name that is not one is foreign.
_MAX_RECORD_BYTES = 1 << 20


def own_records(root: Path, files: Sequence[str], listed: Collection[str]) -> list[str]:
    """The files that are torchverity's own records (a sidecar or meta.json written by
    save, hash or migrate) of a listed file: written after the manifest, they are not
    foreign files."""
    from torchverity.checkpoint._records import META_SUFFIX

    found = []
    for rel in files:
        suffix = next((s for s in (*SIDECAR_SUFFIXES, META_SUFFIX) if rel.endswith(s)), None)
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


def broken_unrecorded(path: Path) -> FormatError | None:
    """The error naming a file as a broken download, known from its own bytes with no
    record: a Git LFS pointer under any name (an LFS-tracked file never fetched), an HTML
    page or text (a server's error message) under a weights name (an .html or .md file
    may well start like one), a weights
    file cut short, or a sharded checkpoint's index naming shards its folder lacks. None
    for anything else."""
    from torchverity.checkpoint._model_files import WEIGHTS_SUFFIXES
    from torchverity.pickles._file_format import text_download

    kind = download_kind(path)
    weights = path.name.lower().endswith(WEIGHTS_SUFFIXES)
    if kind == "lfs-pointer" or (kind in ("html", "text") and weights):
        return broken_download(path)
    if kind is None and weights:
        return text_download(path) or _cut_short(path)
    if kind is None and path.name.endswith(".index.json"):
        return _shards_missing(path)
    return None


_FETCH_AGAIN = ("copy or download the file again from its source (huggingface-cli download "
                "fetches what is incomplete), then verify it")


def _cut_short(path: Path) -> FormatError | None:
    """A weights file that ends before its own structure does: a safetensors file holding
    fewer data bytes than its header names, a zip archive (torch.save) without the central
    directory it writes last."""
    import zipfile

    try:
        fmt = file_format(path)
    except (FormatError, InputError):
        return None
    if fmt == "safetensors":
        from torchverity.checkpoint._st_header import parse_header

        try:
            parse_header(path)
        except FormatError as exc:
            reason = exc.message.removeprefix(f"{path}: ")
            return FormatError(f"{path}: {reason}", path=path, hint=_FETCH_AGAIN)
        return None
    if fmt == "pt" and not zipfile.is_zipfile(path):
        return FormatError(
            f"{path}: a torch.save archive cut short: its central directory, written last, is "
            "missing (an interrupted save, copy or download)", path=path, hint=_FETCH_AGAIN)
    return None


def _shards_missing(index: Path) -> FormatError | None:
    """A sharded checkpoint's index that names shards its folder does not hold."""
    from torchverity.checkpoint._index import index_shards

    try:
        shards, missing = index_shards(index)
    except FormatError:
        return None  # another *.index.json, or one verify of the index reports itself
    if not missing:
        return None
    return FormatError(
        f"{index}: names {len(missing)} of its {len(shards)} shard(s) that the folder does "
        f"not hold: {', '.join(missing[:5])}", path=index,
        hint="fetch the missing shards from the checkpoint's source (huggingface-cli download "
             "fetches what is missing), then verify the folder again")


def no_record_error(path: Path) -> InputError:
    """Nothing records the digest of ``path``: no sidecar, no manifest entry, no hub name.
    When a manifest covers its folder but does not list it, that is said, with the check
    of what the manifest does list before anything is recorded again."""
    from torchverity.checkpoint._folders import record_step, unlisted

    names = [sidecar_path(path, a).name for a in ALGORITHMS]
    sidecars = f"{', '.join(names[:-1])} or {names[-1]}"
    found = unlisted(path)
    step = record_step(path)
    if found is None:
        return InputError(
            f"{path}: no sidecar ({sidecars})", path=path,
            hint=f"record one from a trusted copy: {step} (or list it in a manifest of its "
                 f"folder: torchverity manifest {shell_path(path.parent)})"
            if step.startswith("torchverity hash") else
            f"record the sharded checkpoint's folder from a trusted copy: {step}",
        )
    manifest, check = found
    return InputError(
        f"{path}: no sidecar ({sidecars}), and the manifest {manifest} does not list it "
        "(the file was added after the manifest was written, or does not belong there)",
        path=path, hint=check,
    )


def verify_sidecars(root: Path, exclude: Sequence[str] = (),
                    progress: Callable[[int], None] | None = None) -> VerifyResult:
    """A folder with no manifest: every file that has a sidecar, against it. The files no
    sidecar covers are listed as unrecorded (a broken download among them fails)."""
    files, _links = list_files(root)
    present = set(files)
    # A sidecar whose file is gone vouches for a file that should be there: missing.
    gone = sorted({rel.rsplit(".", 1)[0] for rel in files if rel.endswith(SIDECAR_SUFFIXES)
                   and rel.rsplit(".", 1)[0] not in present
                   and not excluded(rel.rsplit(".", 1)[0], exclude)})
    described = present | set(gone)  # files a sidecar is about, there or not
    candidates = [rel for rel in files if not excluded(rel, exclude)
                  and not (rel.endswith(SIDECAR_SUFFIXES)
                           and rel.rsplit(".", 1)[0] in described)]
    checked = [rel for rel in candidates if find_sidecar(root / rel) is not None]
    records = set(own_records(root, candidates, checked + gone))  # meta.json beside them
    rest = [rel for rel in candidates if rel not in checked and rel not in records]
    broken = [rel for rel in rest if broken_unrecorded(root / rel) is not None]
    if not checked and not broken and not gone:
        raise InputError(
            f"{root}: no manifest and no per-file sidecars (FILE.blake3, .sha256, .xxh128) "
            "in this folder", path=root,
            hint=f"record the folder from a trusted copy: torchverity manifest {shell_path(root)}",
        )
    entries = [check_sidecar(root / rel, rel, progress) for rel in checked]
    entries += [VerifyEntry(rel, "missing", read_sidecar(find_sidecar(root / rel) or root)[1])
                for rel in gone]
    # A shard deleted with its sidecar leaves no record of its own, but the recorded index
    # still names it: the checkpoint is incomplete.
    entries += [VerifyEntry(rel, "missing") for rel in _unlisted_shards(root, entries, gone)]
    entries.sort(key=lambda e: e.path.encode())
    algos = sorted({read_sidecar(find_sidecar(root / rel) or root)[0] for rel in checked + gone})
    return VerifyResult(os.fspath(root), "directory", "+".join(algos) or NO_ALGO,
                        tuple(entries),
                        f"{len(checked) + len(gone)} per-file sidecar(s)" if entries
                        else NO_RECORD,
                        unrecorded=tuple(rel for rel in rest if rel not in broken),
                        broken=tuple(broken))


def _unlisted_shards(root: Path, entries: list[VerifyEntry], gone: list[str]) -> list[str]:
    """The shards that an intact, recorded index names and the folder lacks, beyond those
    a sidecar already reports missing."""
    from torchverity.checkpoint._index import index_shards

    missing = []
    for e in entries:
        if e.status != "ok" or not e.path.endswith(".index.json"):
            continue
        try:
            _shards, absent = index_shards(root / e.path)
        except FormatError:
            continue  # another kind of *.index.json
        folder = e.path.rpartition("/")[0]
        missing += [f"{folder}/{s}" if folder else s for s in absent]
    return sorted(set(missing) - set(gone))


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
    if not path.is_absolute():  # the manifest as the user's own path reaches it
        record = Path(os.path.relpath(record))
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
    """One next step per kind of problem: an extra file is not damage, and a broken download
    is fetched again, never restored from a record nor recorded."""
    target = shell_path(result.target)
    # A manifest records a folder: for an index, the folder of its shards.
    folder = shell_path(Path(result.target).parent) if result.kind == "file" \
        and len(result.entries) > 1 else target
    if result.kind == "directory" and Path(result.record).name in MANIFEST_FILES:
        folder = shell_path(Path(result.record).parent)  # a manifest above records it
    steps = []
    broken_paths = set(result.broken)
    for rel in (*(e.path for e in result.problems), *result.broken):
        path = _entry_path(result, rel)
        broken = broken_unrecorded(path) if rel in broken_paths else broken_download(path)
        if broken is not None:
            broken_paths.add(rel)
            # Each step is printed after the target: the file verified says it once.
            what = broken.message.removeprefix(f"{path}: ")
            named = "" if os.fspath(path) == result.target else f"{rel}: "
            steps.append(f"{named}{what}; next: {broken.hint}")
    renamed = _renamed(result)
    for old, new in renamed.items():
        back = f"mv {shell_path(_entry_path(result, new))} {shell_path(_entry_path(result, old))}"
        steps.append(f"renamed: {new} holds the recorded bytes of the missing {old}; if the "
                     f"name is what changed, rename it back: {back}")
    told = set(renamed) | set(renamed.values())
    counts = Counter(e.status for e in result.problems
                     if e.path not in broken_paths and e.path not in told)
    # Recording the folder now would vouch for the broken downloads in it.
    fetched = "once the broken downloads are fetched again, " if broken_paths else ""
    if counts["mismatched"] and torch_hub_prefix(Path(result.target)) is not None:
        steps.append(f"mismatched: the download was damaged after torch.hub checked it; "
                     f"{refetch_hint(target)}")
    elif counts["mismatched"]:
        steps.append("mismatched: the content changed since it was recorded; restore those "
                     "files from a good copy, then rerun torchverity verify")
    if counts["missing"]:
        steps.append("missing: copy those files from the source (or the record is stale: "
                     f"{fetched}rebuild it from a trusted copy with torchverity manifest "
                     f"{folder})")
    if counts["extra"]:
        steps.append("extra: files the record does not list; if they belong, "
                     f"{fetched}record them (torchverity manifest {folder}), else remove them "
                     "or skip them with --exclude GLOB")
    if result.unrecorded:
        steps.append(f"unrecorded: no sidecar covers {len(result.unrecorded)} file(s), so "
                     "nothing vouches for them (checked: only the files with a sidecar); to "
                     f"cover every file, {fetched}record the folder from a trusted copy: "
                     f"torchverity manifest {target}")
    return steps


def _renamed(result: VerifyResult) -> dict[str, str]:
    """Missing files whose recorded digest an extra file holds: old name -> new name."""
    by_digest = {e.actual: e.path for e in result.problems
                 if e.status == "extra" and e.actual is not None}
    return {e.path: by_digest[e.expected] for e in result.problems
            if e.status == "missing" and e.expected in by_digest}


def _entry_path(result: VerifyResult, rel: str) -> Path:
    target = Path(result.target)
    return target / rel if result.kind == "directory" else target.parent / rel
