"""Folders as checkpoints: what a path names, as Hugging Face folders are laid out.

A folder is a sharded checkpoint when it holds an index
(``model.safetensors.index.json``, ``pytorch_model.bin.index.json``), and a
single-file one when it holds one weights file (``model.safetensors`` or
``pytorch_model.bin`` beside ``config.json``, tokenizer files and
``.gitattributes``). An index given directly names its folder's shards.
Torch-free: ``verify`` and the CLI resolve paths without importing torch.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from torchverity._generation_pointer import has_pointer
from torchverity.checkpoint._index import find_index
from torchverity.checkpoint._records import linked_checkpoint
from torchverity.errors import FormatError, InputError, shell_path

# In the order transformers' (and diffusers') from_pretrained prefers them; diffusers
# picks its default file over variants (diffusion_pytorch_model.fp16.safetensors) unless
# asked for one.
WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "diffusion_pytorch_model.safetensors",
                "diffusion_pytorch_model.bin", "model.pt", "model.pth")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


@dataclass(frozen=True)
class Target:
    """A checkpoint to read: one ``file``, or a sharded ``folder`` described by ``index``."""

    path: Path  # as given
    file: Path  # the weights file, or the index of a sharded folder
    folder: Path
    index: Path | None = None

    @property
    def record(self) -> Path:
        """The file whose sidecar and meta.json describe the checkpoint."""
        return self.index or self.file


def resolve(path: str | os.PathLike[str]) -> Target:
    """The checkpoint ``path`` names: a file (a link to a checkpoint of its folder, the
    checkpoint), an index, or a folder of either layout."""
    p = linked_checkpoint(Path(path))
    if p.is_file() and p.name.endswith(".index.json"):
        return Target(p, p, p.parent, p)
    if not p.is_dir():
        return Target(p, p, p.parent)
    if any(p.glob("*.index.json")):
        index = find_index(p)
        return Target(p, index, p, index)
    if has_pointer(p) or (p / ".metadata").is_file():
        raise InputError(
            f"{p}: a distributed checkpoint folder (torch.distributed.checkpoint): its tensors "
            "are read on every rank, with torchverity.distributed.load_dcp", path=p,
            hint="check its files and any training guard's certification: torchverity verify "
                 f"{shell_path(p)}")
    return Target(p, single_weights_file(p), p)


def is_model_folder(target: Target) -> bool:
    """Whether the weights are a model folder: given as a folder or an index, or a weights
    file with ``config.json`` beside it (a file alone in a folder of other things is not)."""
    return (target.index is not None or target.path.is_dir()
            or (target.folder / "config.json").is_file())


def single_weights_file(folder: Path) -> Path:
    """The one weights file of a single-file folder (config.json and friends beside it)."""
    for name in WEIGHT_NAMES:
        if (folder / name).is_file():
            return folder / name
    found = sorted(f for f in folder.iterdir()
                   if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    if len(found) == 1:
        return found[0]
    if not found:
        snapshot = _hub_snapshot_in(folder)
        if snapshot is not None:
            raise _hub_folder_error(folder, snapshot)
        parts = components(folder)
        if parts:
            raise _pipeline_error(folder, parts)
    listed = ", ".join(f.name for f in found) if found else "none"
    raise InputError(
        f"{folder}: folder has no *.index.json and {len(found)} weights files ({listed}), "
        "so it is neither a sharded nor a single-file checkpoint", path=folder,
        hint=_weights_hint(folder, found))


def _weights_hint(folder: Path, found: list[Path]) -> str:
    # Any command resolves folders here, so the hint names paths, never a command.
    if found:
        return "give one weights file instead of the folder, e.g. " + " or ".join(
            shlex.quote(os.fspath(f)) for f in found[:2])
    onnx = sorted(folder.glob("*.onnx"))
    if onnx:
        return f"give the ONNX model file instead: {shell_path(onnx[0])}"
    return (f"list the folder (ls {shlex.quote(os.fspath(folder))}); weights are "
            "*.safetensors or *.bin")


def _hub_snapshot_in(folder: Path) -> Path | None:
    """For a Hugging Face hub cache (``HF_HOME``, ``hub/``) or one repository of it
    (``models--ORG--NAME``): a snapshot folder to read instead, the one ``refs/main``
    names when it has one. The files of a cached model sit only under
    ``snapshots/REV/``, so the cache's own folders hold no weights; else None."""
    from torchverity.provenance._hub_paths import REPO_PREFIXES

    if folder.name.startswith(REPO_PREFIXES):
        repos = [folder]
    else:
        hub = folder / "hub" if (folder / "hub").is_dir() else folder
        repos = sorted(d for d in hub.iterdir() if d.is_dir() and d.name.startswith(
            REPO_PREFIXES) and (d / "snapshots").is_dir())
    for repo in repos:
        snaps = repo / "snapshots"
        revs = sorted(d for d in snaps.iterdir() if d.is_dir()) if snaps.is_dir() else []
        try:
            main = snaps / (repo / "refs" / "main").read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            main = None
        if main is not None and main in revs:
            return main
        if revs:
            return revs[-1]
    return None


def _hub_folder_error(folder: Path, snapshot: Path) -> InputError:
    repo = snapshot.parent.parent
    kind = ("a Hugging Face hub repository folder" if repo == folder
            else "a Hugging Face hub cache")
    return InputError(
        f"{folder}: {kind}: a cached model's files are in its snapshot folders "
        "(models--ORG--NAME/snapshots/REVISION), not here", path=folder,
        # A path, never a command: every command that reads a checkpoint resolves it here.
        hint=f"give a snapshot folder instead, e.g. {shell_path(snapshot)}")


def _holds_weights(folder: Path) -> bool:
    return any(f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name.endswith(".index.json"))
               for f in folder.iterdir())


def components(folder: Path) -> list[Path]:
    """Sub-folders holding weights: the components of a diffusers pipeline (unet/, vae/...)."""
    return sorted(d for d in folder.iterdir()
                  if d.is_dir() and not d.name.startswith(".") and _holds_weights(d))


def pipeline_components(path: str | os.PathLike[str]) -> list[Path]:
    """The component folders of a pipeline root (no weights or index of its own), else []."""
    p = Path(path)
    if not p.is_dir() or _holds_weights(p):
        return []
    return components(p)


def _pipeline_error(folder: Path, parts: list[Path]) -> InputError:
    kind = ("a diffusers pipeline (model_index.json)" if (folder / "model_index.json").is_file()
            else "a folder of components")
    names = ", ".join(d.name for d in parts)
    return InputError(
        f"{folder}: {kind} with no weights of its own: they are in component folders, each a "
        f"checkpoint read on its own: {names}", path=folder,
        hint=f"give one component folder instead, e.g. {shell_path(parts[0])} (torchverity "
             f"inspect {shell_path(folder)} shows every component)")


def not_weights(target: Target) -> FormatError | None:
    """The error naming the first file of ``target`` (its weights file, or each shard its
    index lists) that is something else: a Git LFS pointer, an HTML page, a numpy or
    joblib file. Reads the first bytes of each, nothing more."""
    from torchverity._formats import foreign_format
    from torchverity.checkpoint._index import read_index

    files = [target.file] if target.index is None else [
        target.folder / s for s in sorted(set(read_index(target.index).values()))]
    for file in files:
        found = foreign_format(file) if file.is_file() else None
        if found is not None:
            return found
    return None


def record_step(path: Path) -> str:
    """The command that records ``path``'s digest from a trusted copy: for a file of a
    sharded folder (its index or a shard) the folder's manifest, which records every shard
    at once; else its sidecar."""
    if any(path.parent.glob("*.index.json")):
        return f"torchverity manifest {shell_path(path.parent)}"
    return f"torchverity hash --write {shell_path(path)}"


def covering_manifest(folder: Path) -> tuple[Path, str] | None:
    """The manifest in ``folder``, or in the nearest folder above that has one (a
    pipeline's root lists ``unet/...``), and the prefix of ``folder``'s paths in it
    (``""`` or ``"unet/"``); else None."""
    from torchverity.manifest import MANIFEST_NAME, SHA256SUM_NAME

    here = folder.absolute()
    for above in (here, *here.parents):
        record = next((above / n for n in (MANIFEST_NAME, SHA256SUM_NAME)
                       if (above / n).is_file()), None)
        if record is not None:
            rel = here.relative_to(above).as_posix()
            return record, "" if rel == "." else f"{rel}/"
    return None


def unlisted(path: Path) -> tuple[Path, str] | None:
    """For a file with no record of its own in a folder a manifest covers: the manifest (as
    the user's own path reaches it) and the next step, which checks what the manifest does
    list before anything is recorded again (a renamed or added file is no proof of
    anything). None when no manifest covers the folder."""
    found = covering_manifest(path.parent) if path.parent.is_dir() else None
    if found is None:
        return None
    manifest = found[0] if path.is_absolute() else Path(os.path.relpath(found[0]))
    folder = shell_path(manifest.parent)
    return manifest, (f"check the files the manifest lists: torchverity verify {folder}; if "
                      f"{path.name} belongs there, record it from a trusted copy: torchverity "
                      f"hash --write {shell_path(path)} (or record the folder again: "
                      f"torchverity manifest {folder})")


def manifest_entry(path: Path) -> tuple[str, str, Path] | None:
    """``(algo, hex, manifest)`` for a file listed in the manifest of its folder, or of the
    nearest folder above that has one, else None."""
    from torchverity.manifest import read_manifest

    found = covering_manifest(path.parent)
    if found is None:
        return None
    record, prefix = found
    manifest = read_manifest(record)
    entry = next((e for e in manifest.entries if e.path == prefix + path.name), None)
    return None if entry is None else (manifest.algo, entry.digest, record)
