"""Start-up verification of the weights a service will hold.

The file's digest must be recorded somewhere the service can check before
unpickling: a sidecar (``CKPT.blake3``), the folder's manifest, or the name a
Hugging Face hub cache gave its blob. The checkpoint is then loaded with
``torchverity.load`` (``weights_only=True``), which also checks the content
fingerprint against ``CKPT.meta.json`` when present and the keys, shapes and
dtypes against the model. With an OpenSSF model signature the signature is the
record instead; an in-toto attestation, when given, must verify too and is
exposed in ``/metadata``. The files a model is built from in a model folder
(``config.json``, tokenizer files, those in its subfolders) are checked against the
folder's manifest, or with none against a Hugging Face download's names, before the
model is built.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchverity.checkpoint._folders import (
    manifest_entry,
    not_weights,
    record_step,
    resolve,
    unlisted,
)
from torchverity.checkpoint._key_map import KeyFit
from torchverity.checkpoint._model_files import ModelFiles, check_model_files
from torchverity.checkpoint._results import CheckpointWarning
from torchverity.digest import digest_file, find_sidecar
from torchverity.errors import InputError, IntegrityError, shell_path


@dataclass(frozen=True)
class WeightsInfo:
    """Where the served weights came from and how they were verified."""

    path: str
    algo: str
    digest: str
    digest_source: str  # "sidecar", "manifest", "hub" or "signature"
    file_fingerprint: str | None  # root recorded in meta.json and checked, if there was one
    missing_keys: tuple[str, ...] = ()  # loaded with strict=False: left at initial values
    unexpected_keys: tuple[str, ...] = ()  # loaded with strict=False: not loaded
    provenance: dict[str, Any] | None = None  # the signature and attestation that verified
    model_files: ModelFiles | None = None  # the build's files, and what vouched for them

    def notes(self) -> list[str]:
        """What the start-up could not verify, as warnings."""
        note = self.model_files.warning(resolve(self.path).folder) if self.model_files else None
        return [note] if note else []

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path, "algorithm": self.algo, "digest": self.digest,
            "verified_by": self.digest_source, "fingerprint_verified": self.file_fingerprint,
            "missing_keys": list(self.missing_keys),
            "unexpected_keys": list(self.unexpected_keys),
            "model_files": self.model_files.to_dict() if self.model_files else None,
            **({"provenance": self.provenance} if self.provenance else {}),
        }


def check_before_build(weights: str | os.PathLike[str]) -> ModelFiles | None:
    """The files of a model folder that a model build reads (``config.json``, tokenizer
    files...) against the manifest covering it, or the names a Hugging Face download gave
    them, before the build reads them (:class:`~torchverity.errors.ManifestMismatchError`,
    :class:`~torchverity.errors.HubFileMismatchError` when one differs); None when the
    weights are no model folder or nothing vouches for it."""
    return check_model_files(resolve(_existing(weights)))


def _existing(weights: str | os.PathLike[str]) -> Path:
    path = Path(weights)
    if not path.exists():
        raise InputError(f"{path}: no such weights file", path=path,
                         hint=f"check the path (ls {shell_path(path.parent)}): --weights takes a "
                              "checkpoint file, a Hugging Face folder or its index")
    return path


def load_verified(model: torch.nn.Module, weights: str | os.PathLike[str],
                  fit: KeyFit | None = None,
                  provenance: Mapping[str, Any] | None = None,
                  beside: ModelFiles | None = None) -> WeightsInfo:
    """Verify ``weights`` (a file, a Hugging Face folder or its index) and load them into
    ``model``, keys fitted by ``fit``; raise a typed error otherwise. ``provenance``:
    ``signature`` (with ``public_key`` or ``certificate_chain``) replaces the recorded
    digest, ``attestation`` must vouch for the same files. ``beside``: what
    :func:`check_before_build` found (the load checks those files again, in case they
    changed while the model was built)."""
    from torchverity.checkpoint._load import load

    path = _existing(weights)
    given = dict(provenance or {})
    signature, attestation = given.pop("signature", None), given.pop("attestation", None)
    target = resolve(path)
    foreign = not_weights(target)
    if foreign is not None:  # a pointer, web page or numpy file: no digest makes it weights
        raise foreign
    if signature is None and find_sidecar(target.record) is None \
            and manifest_entry(target.record) is None and not _in_hub(target.record):
        _unrecorded(target.record)
    fit = fit or KeyFit()
    with warnings.catch_warnings():  # the report carries them: notes(), missing_keys...
        warnings.simplefilter("ignore", CheckpointWarning)
        _obj, report = load(path, model=model, sidecar="ignore" if signature else "require",
                            with_report=True, strict=fit.strict, strip_prefix=fit.strip_prefixes,
                            key_map=dict(fit.key_map), signature=signature, **given)
    info = WeightsInfo(os.fspath(path), str(report.algo), str(report.digest),
                       str(report.digest_source), report.fingerprint,
                       report.missing_keys, report.unexpected_keys,
                       {"signature": os.fspath(signature)} if signature else None,
                       beside)
    if attestation is None:
        return info
    return dataclasses.replace(info, provenance={**(info.provenance or {}),
                                                 "attestation": _attested(path, attestation,
                                                                          given)})


def _attested(path: Path, attestation: str | os.PathLike[str],
              trust: dict[str, Any]) -> dict[str, Any]:
    from torchverity.provenance import verify_attestation

    result = verify_attestation(path, attestation, **trust)
    if not result.ok:
        what = result.reason or ", ".join(f"{e.path} {e.status}" for e in result.problems)
        raise IntegrityError(f"{path}: attestation {attestation} does not vouch for these "
                             f"weights: {what}", path=path,
                             hint=f"torchverity verify {shell_path(path)} --attestation "
                                  f"{shell_path(attestation)}")
    return {"path": os.fspath(attestation), "signer": result.signer,
            "subjects": [{"name": e.path, "sha256": e.expected} for e in result.entries],
            "predicate": result.predicate}


def _in_hub(path: Path) -> bool:
    """Whether a Hugging Face hub download names the file by its digest (load checks it):
    by its SHA-256, or, for a small file such as a sharded folder's index, by its git
    SHA-1, checked here (a mismatch raises)."""
    from torchverity.provenance import hub_record, require_hub_blob

    if hub_record(path) is not None:
        return True
    entry = require_hub_blob(path)
    return entry is not None and entry.status == "ok"


def _unrecorded(path: Path) -> None:
    """Refuse weights whose digest nothing records, naming a joblib file as what it is."""
    from torchverity.checkpoint._read import joblib_error

    try:
        _check_against_manifest(path)  # raises: nothing records its digest
    except IntegrityError as exc:
        raise joblib_error(path) or exc from None


def _check_against_manifest(path: Path) -> tuple[str, str]:
    """Check the file against its folder's manifest entry: ``(algo, hex)``."""
    from torchverity.manifest import find_manifest, read_manifest

    try:
        record = find_manifest(path.parent)
    except InputError:
        raise IntegrityError(
            f"{path}: no recorded digest (no sidecar {path.name}.blake3, .sha256 or .xxh128, "
            f"and no manifest in {path.parent}): refusing to serve unverified weights",
            path=path, hint=f"record it from a trusted copy: {record_step(path)}",
        ) from None
    manifest = read_manifest(record)
    entry = next((e for e in manifest.entries if e.path == path.name), None)
    if entry is None:
        found = unlisted(path)
        raise IntegrityError(
            f"{path}: not listed in {record}: refusing to serve unverified weights",
            path=path, hint=found[1] if found else f"torchverity verify {shell_path(path.parent)}",
        )
    algo = manifest.algo
    actual = digest_file(path, algo).hexdigest
    if actual != entry.digest:
        raise IntegrityError(
            f"{path}: {algo} digest does not match {record.name}: the file changed after it "
            f"was recorded (expected {entry.digest}, got {actual})",
            path=path, expected=entry.digest, actual=actual,
            hint=f"restore {path.name} from a verified copy; torchverity verify "
                 f"{shell_path(path.parent)}",
        )
    return algo, actual
