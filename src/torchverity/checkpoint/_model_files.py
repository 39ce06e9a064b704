"""The files beside the weights that a model is built from, checked against the folder's
manifest before the model is built or loaded.

A model is its weights and the files its build reads beside them: ``config.json``,
``generation_config.json``, tokenizer and processor files, vocabularies, chat templates,
remote code (``*.py``). When the weights are a model folder (a folder or an index given
as the weights, or a weights file beside ``config.json``) and a manifest covers that
folder, every file it lists beside the weights is hashed (streamed) and must match its
entry; a missing one fails too. Left out, as no model build reads them: weights files
(the load checks the ones it reads), hidden files, torchverity's own records (sidecars,
meta.json, signatures, attestations) and documentation (``*.md``, licences, images).
A file beside the weights that the manifest does not list is reported, not refused: the
manifest vouches for what it lists. Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torchverity.checkpoint._folders import Target, covering_manifest, not_weights
from torchverity.digest import ALGORITHMS, digest_files
from torchverity.errors import ManifestMismatchError, shell_path
from torchverity.manifest import MANIFEST_FILES, read_manifest, resolve_inside

# Weights of any format: the load checks those it reads, and the others are large and are
# not read by this model's build.
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx",
            ".onnx_data", ".ot", ".gguf", ".tflite")
_RECORDS = (*(f".{a}" for a in ALGORITHMS), ".meta.json", ".pending", ".sig", ".intoto.json",
            ".index.json")
_DOCS = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp")
_DOC_NAMES = ("license", "licence", "notice", "copying")


@dataclass(frozen=True)
class ModelFiles:
    """What the check of a model folder's files found: the manifest, the files it lists
    that matched, and the files beside the weights that it does not list."""

    manifest: str
    checked: tuple[str, ...]
    unlisted: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"manifest": self.manifest, "verified": list(self.checked),
                "unlisted": list(self.unlisted)}

    def warning(self, folder: Path) -> str | None:
        if not self.unlisted:
            return None
        shown = ", ".join(self.unlisted[:10])
        return (f"{folder}: {len(self.unlisted)} file(s) beside the weights are not listed in "
                f"{self.manifest}, so they were not verified: {shown} (once checked, record "
                f"the folder again: torchverity manifest {shell_path(Path(self.manifest).parent)})")


def read_by_build(name: str) -> bool:
    """Whether a model build may read a file of this name beside its weights."""
    lower = name.lower()
    return not (lower.startswith(".") or lower.endswith(_WEIGHTS + _RECORDS + _DOCS)
                or lower.startswith(_DOC_NAMES))


def is_model_folder(target: Target) -> bool:
    """Whether the weights are a model folder: given as a folder or an index, or a weights
    file with ``config.json`` beside it (a file alone in a folder of other things is not)."""
    return (target.index is not None or target.path.is_dir()
            or (target.folder / "config.json").is_file())


def check_model_files(target: Target) -> ModelFiles | None:
    """Check the files beside the weights of a model folder against the manifest covering
    it (:class:`ManifestMismatchError` for the first that differs or is missing); None when
    the weights are not a model folder or no manifest covers it. Weights that are not
    weights (a Git LFS pointer, a web page) are named first."""
    found = covering_manifest(target.folder) if is_model_folder(target) else None
    if found is None:
        return None
    foreign = not_weights(target)
    if foreign is not None:
        raise foreign
    record, prefix = found
    manifest = read_manifest(record)
    if not any(_beside(e.path, prefix) for e in manifest.entries):
        return None  # a manifest far above that records none of this folder's files
    own = {target.file.name, target.record.name}
    listed = {e.path[len(prefix):]: e for e in manifest.entries
              if _beside(e.path, prefix) and _checked(e.path[len(prefix):], own)}
    present = [n for n in sorted(listed)
               if resolve_inside(record.parent, prefix + n, record).is_file()]
    digests = digest_files([target.folder / n for n in present], manifest.algo)
    actual = {n: d.hexdigest for n, d in zip(present, digests, strict=True)}
    for name, entry in sorted(listed.items()):
        if actual.get(name) != entry.digest:
            raise _mismatch(target.folder / name, record, manifest.algo, entry.digest,
                            actual.get(name))
    beside = sorted(e.name for e in os.scandir(target.folder)
                    if e.is_file(follow_symlinks=False) and _checked(e.name, own))
    return ModelFiles(os.fspath(record), tuple(present),
                      tuple(n for n in beside if n not in listed))


def _beside(path: str, prefix: str) -> bool:
    """Whether a manifest path names a file directly in the folder of ``prefix``."""
    return path.startswith(prefix) and "/" not in path[len(prefix):]


def _checked(name: str, weights: set[str]) -> bool:
    """A file beside the weights that a build may read (not the weights loaded, not a
    manifest)."""
    return name not in weights and name not in MANIFEST_FILES and read_by_build(name)


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
