"""The files of a model folder that a model is built from, checked before the model is
built or loaded: against the folder's manifest, or else against the names a Hugging Face
hub download gave them.

A model is its weights and the files its build reads beside them and in its subfolders:
``config.json``, ``generation_config.json``, tokenizer and processor files, vocabularies,
chat templates, remote code (``*.py``), a sentence-transformers model's ``modules.json``
and ``1_Pooling/config.json``, a ``scheduler/`` or ``tokenizer/`` folder. When the weights
are a model folder (a folder or an index given as the weights, or a weights file beside
``config.json``):

- a manifest covering that folder vouches for the files it lists: each is hashed
  (streamed) and must match its entry, and a missing one fails too
  (:class:`ManifestMismatchError`);
- with no such manifest, a hub cache snapshot (``models--ORG--NAME/snapshots/REV``)
  vouches for each file by its blob's name, and a ``local_dir`` download by the etag
  its download record holds (:class:`HubFileMismatchError`).

Left out, as no model build reads them: weights files (the load checks the ones it
reads), hidden files and folders (``.git``, ``.cache``), ``__pycache__``, a Trainer's
checkpoint folders (``checkpoint-500/`` holds ``trainer_state.json``), torchverity's own
records (sidecars, meta.json, signatures, attestations) and documentation (``*.md``,
licences, images). A file the record does not vouch for (not in the manifest, a snapshot
file that is no link into ``blobs/``, a file with no download record) is reported, not
refused. Nothing is opened but to be hashed. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torchverity.checkpoint._folders import Target, covering_manifest, is_model_folder, not_weights
from torchverity.digest import ALGORITHMS, digest_files
from torchverity.errors import HubFileMismatchError, ManifestMismatchError, shell_path
from torchverity.manifest import (
    MANIFEST_FILES,
    Manifest,
    ManifestEntry,
    read_manifest,
    resolve_inside,
)
from torchverity.provenance import HubEntry, hub_file_checks
from torchverity.provenance._hub_paths import local_dir_of, snapshot_of

# Weights of any format: the load checks those it reads, and the others are large and are
# not read by this model's build.
WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack",
                    ".onnx", ".onnx_data", ".ot", ".gguf", ".tflite")
_RECORDS = (*(f".{a}" for a in ALGORITHMS), ".meta.json", ".pending", ".sig", ".intoto.json",
            ".index.json")
_DOCS = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")
_DOC_NAMES = ("license", "licence", "notice", "copying")
# A subfolder holding this is a Trainer checkpoint: a model of its own, read when given.
_TRAINER_CHECKPOINT = "trainer_state.json"

Against = Literal["manifest", "hub-cache", "local-dir"]


@dataclass(frozen=True)
class ModelFiles:
    """What the check of a model folder's files found: what vouched for them (``against``:
    a manifest, a hub cache's blob names or a ``local_dir`` download's records; ``record``:
    that manifest, the hub repository folder or the download folder), the files that
    matched, and the files it does not vouch for. Paths are relative to the weights'
    folder (``1_Pooling/config.json``)."""

    record: str
    checked: tuple[str, ...]
    unlisted: tuple[str, ...]
    against: Against = "manifest"

    @property
    def manifest(self) -> str | None:
        return self.record if self.against == "manifest" else None

    def to_dict(self) -> dict[str, object]:
        return {"manifest": self.manifest, "against": self.against, "record": self.record,
                "verified": list(self.checked), "unlisted": list(self.unlisted)}

    def warning(self, folder: Path) -> str | None:
        if not self.unlisted:
            return None
        shown = ", ".join(self.unlisted[:10])
        if self.against == "manifest":
            return (f"{folder}: {len(self.unlisted)} file(s) beside the weights are not listed "
                    f"in {self.record}, so they were not verified: {shown} (once checked, "
                    f"record the folder again: torchverity manifest "
                    f"{shell_path(Path(self.record).parent)})")
        return (f"{folder}: {len(self.unlisted)} file(s) beside the weights have no name from "
                f"the Hugging Face hub to check them against ({_unnamed(self.against)}), so "
                f"they were not verified: {shown} (download them again with huggingface_hub, "
                f"or, once checked, record the folder: torchverity manifest "
                f"{shell_path(folder)})")


def _unnamed(against: Against) -> str:
    return ("copied files, not links into the cache's blobs/" if against == "hub-cache"
            else "no download record")


def read_by_build(name: str) -> bool:
    """Whether a model build may read a file of this name beside its weights."""
    lower = name.lower()
    return not (lower.startswith(".") or lower.endswith(WEIGHTS_SUFFIXES + _RECORDS + _DOCS)
                or lower.startswith(_DOC_NAMES))


def check_model_files(target: Target) -> ModelFiles | None:
    """Check the files a model folder's build reads against the manifest covering it
    (:class:`ManifestMismatchError` for the first that differs or is missing), or, with no
    manifest for it, against the names a hub cache snapshot or ``local_dir`` download gave
    them (:class:`HubFileMismatchError`); None when the weights are not a model folder or
    nothing vouches for it. Weights that are not weights (a Git LFS pointer, a web page)
    are named before a manifest's mismatch."""
    if not is_model_folder(target):
        return None
    own = frozenset({target.file.name, target.record.name})
    found = covering_manifest(target.folder)
    if found is not None:
        manifest = read_manifest(found[0])
        if any(e.path.startswith(found[1]) for e in manifest.entries):
            return _against_manifest(target, found[0], found[1], manifest, own)
    # A manifest far above that records none of this folder's files says nothing of it.
    return _against_hub(target, own)


# ------------------------------------------------------------------ which files


def build_files(folder: Path, own: frozenset[str] = frozenset()) -> dict[str, bool]:
    """The files (and links) under ``folder`` a model build may read, as relative POSIX
    paths in UTF-8 byte order, each with whether it is a link; ``own`` names weights
    files directly in ``folder``. Never follows a link, never descends into a folder no
    build reads: one ``scandir`` per folder it reads, one ``stat`` per subfolder."""
    found: dict[str, bool] = {}
    todo = [""]
    while todo:
        rel = todo.pop()
        try:
            with os.scandir(folder / rel) as entries:
                listed = list(entries)
        except OSError:
            continue  # a folder that cannot be listed holds nothing this check can vouch for
        for entry in listed:
            path = rel + entry.name
            if entry.is_dir(follow_symlinks=False):
                if _descends(entry.name, Path(entry.path)):
                    todo.append(path + "/")
            elif _checked(path, own):
                found[path] = entry.is_symlink()
    return {n: found[n] for n in sorted(found, key=str.encode)}


def _descends(name: str, path: Path) -> bool:
    return not (name.startswith(".") or name == "__pycache__"
                or (path / _TRAINER_CHECKPOINT).is_file())


def _checked(rel: str, own: frozenset[str]) -> bool:
    """A file a build may read (not the weights loaded, not a manifest)."""
    name = rel.rsplit("/", 1)[-1]
    return (rel not in own and name not in MANIFEST_FILES and read_by_build(name))


def _read_dirs(folder: Path, listed: frozenset[str]) -> dict[str, bool]:
    """For each folder of the manifest's paths (relative to ``folder``; ``""`` itself),
    whether a build reads it: none it skips by name, no Trainer checkpoint (on disk or as
    the manifest recorded it), and inside a folder a build reads. A stat per folder."""
    dirs = {rel.rpartition("/")[0] for rel in listed} - {""}
    ancestors = {"/".join(d.split("/")[:i]) for d in dirs for i in range(1, d.count("/") + 2)}
    reads = {"": True}
    for d in sorted(ancestors, key=lambda d: d.count("/")):
        parent, _, name = d.rpartition("/")
        reads[d] = (reads[parent] and f"{d}/{_TRAINER_CHECKPOINT}" not in listed
                    and _descends(name, folder / d))
    return reads


# ------------------------------------------------------------------ against a manifest


def _against_manifest(target: Target, record: Path, prefix: str, manifest: Manifest,
                      own: frozenset[str]) -> ModelFiles:
    foreign = not_weights(target)
    if foreign is not None:
        raise foreign
    under = {e.path[len(prefix):]: e for e in manifest.entries if e.path.startswith(prefix)}
    reads = _read_dirs(target.folder, frozenset(under))
    listed = {rel: e for rel, e in under.items()
              if reads[rel.rpartition("/")[0]] and _checked(rel, own)}
    walked = build_files(target.folder, own)
    if prefix:  # the folder itself is no link (the walk below it follows none)
        resolve_inside(record.parent, prefix.rstrip("/"), record)
    # A file the walk found as no link is there; any other is resolved (a link refused).
    present = [n for n in sorted(listed, key=str.encode) if walked.get(n) is False
               or resolve_inside(record.parent, prefix + n, record).is_file()]
    digests = digest_files([target.folder / n for n in present], manifest.algo)
    actual = {n: d.hexdigest for n, d in zip(present, digests, strict=True)}
    _require_listed(target.folder, record, manifest.algo, listed, actual)
    return ModelFiles(os.fspath(record), tuple(present),
                      tuple(n for n in walked if n not in listed))


def _require_listed(folder: Path, record: Path, algo: str, listed: dict[str, ManifestEntry],
                    actual: dict[str, str]) -> None:
    for name in sorted(listed, key=str.encode):
        entry = listed[name]
        if actual.get(name) != entry.digest:
            raise _mismatch(folder / name, record, algo, entry.digest, actual.get(name))


def _mismatch(path: Path, record: Path, algo: str, expected: str,
              actual: str | None) -> ManifestMismatchError:
    what = ("is missing" if actual is None else
            f"does not match: the file changed after it was recorded (expected {algo} "
            f"{expected}, got {actual})")
    return ManifestMismatchError(
        f"{path}: listed in {record} but {what}; a model built from this folder would not "
        "be the recorded one", path=path, manifest=record, algo=algo, expected=expected,
        actual=actual,
        hint=f"restore {path.name} from a verified copy (torchverity verify "
             f"{shell_path(record.parent)} lists every file that differs); if the change is "
             f"meant, record the folder again: torchverity manifest {shell_path(record.parent)}")


# ------------------------------------------------------------------ against the hub


def _hub_origin(target: Target) -> tuple[Against, Path] | None:
    """Where the weights were downloaded: a hub cache repository (``models--ORG--NAME``)
    or a ``local_dir`` download folder; None when neither. A few ``stat`` calls."""
    snapshot = snapshot_of(target.file)
    if snapshot is not None:
        return "hub-cache", snapshot[0]
    root = local_dir_of(target.file)
    return ("local-dir", root) if root is not None else None


def _against_hub(target: Target, own: frozenset[str]) -> ModelFiles | None:
    origin = _hub_origin(target)
    if origin is None:
        return None
    against, record = origin
    names = list(build_files(target.folder, own))
    entries = hub_file_checks([target.folder / n for n in names])
    for name, entry in zip(names, entries, strict=True):
        if entry is not None and not entry.ok:
            raise _hub_mismatch(target.folder / name, against, record, entry)
    return ModelFiles(os.fspath(record), _named(names, entries, ("ok",)),
                      _named(names, entries, (None, "unchecked")), against)


def _named(names: Iterable[str], entries: Iterable[HubEntry | None],
           statuses: tuple[str | None, ...]) -> tuple[str, ...]:
    return tuple(n for n, e in zip(names, entries, strict=True)
                 if (e.status if e is not None else None) in statuses)


def _hub_mismatch(path: Path, against: Against, record: Path,
                  entry: HubEntry) -> HubFileMismatchError:
    named = "its blob's name" if against == "hub-cache" else "the etag of its download record"
    what = (f"does not match {named}: the file changed after it was downloaded (expected "
            f"{entry.algo} {entry.blob}, got {entry.actual})" if entry.actual else
            f"cannot be checked against {named}: {entry.detail or entry.status}")
    return HubFileMismatchError(
        f"{path}: {entry.path} of a Hugging Face hub "
        f"{'cache snapshot' if against == 'hub-cache' else 'local_dir download'} {what}; a "
        "model built from this folder would not be the downloaded one",
        path=path, record=record, algo=entry.algo, expected=entry.blob, actual=entry.actual,
        status=entry.status, hint=_download_again(entry, against, record))


def _download_again(entry: HubEntry, against: Against, record: Path) -> str:
    if against == "hub-cache":
        repo = record.name.partition("--")[2].replace("--", "/")
        again = (f"hf_hub_download({repo!r}, {entry.path!r}, revision={entry.revision!r}, "
                 "force_download=True)")
    else:
        again = (f"hf_hub_download(REPO_ID, {entry.path!r}, local_dir={os.fspath(record)!r}, "
                 "force_download=True)")
    return (f"download it again with huggingface_hub ({again}), then check every file: "
            f"torchverity verify {shell_path(record)}")

