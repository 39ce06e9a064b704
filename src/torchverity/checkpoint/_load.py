"""torchverity.load: the digest checked as the file is read, weights_only, the fingerprint
compared with meta.json.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchverity.checkpoint._folders import Target, is_model_folder, not_weights, resolve
from torchverity.checkpoint._key_map import (
    FitReport,
    KeyFit,
    partial_prefix_diagnosis,
    prefix_diagnosis,
    rename_keys,
)
from torchverity.checkpoint._load_file import _load_file
from torchverity.checkpoint._model_fit import check_against_model, state_dict_of
from torchverity.checkpoint._results import (
    CheckpointWarning,
    ExpectedDigest,
    LoadReport,
    SidecarPolicy,
)
from torchverity.errors import UsageError, shell_path

if TYPE_CHECKING:
    from torchverity.checkpoint._model_files import ModelFiles


def load(
    path: str | os.PathLike[str],
    *,
    map_location: Any = "cpu",
    model: torch.nn.Module | None = None,
    sidecar: SidecarPolicy = "warn",
    trust_sha256: str | None = None,
    with_report: bool = False,
    mmap: bool = False,
    recheck_tensors: bool = False,
    strict: bool = True,
    strip_prefix: str | Iterable[str] | None = None,
    key_map: Mapping[str, str] | None = None,
    signature: str | os.PathLike[str] | None = None,
    public_key: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
) -> Any:
    """Load a checkpoint (a file, a Hugging Face folder or its index) after verifying it.

    Returns the object, or ``(obj, LoadReport)`` with ``with_report=True``.
    With ``model`` the state is checked against it (all problems at once) and
    loaded into it. ``strip_prefix`` (e.g. ``"module."``, ``"_orig_mod."``)
    and ``key_map`` (old key prefix -> new) rename the checkpoint's keys first;
    ``strict=False`` loads what fits and reports missing and unexpected keys in
    the report and as a :class:`CheckpointWarning`. Without ``model`` the
    renamed state is returned. The file is hashed as it is read (one pass);
    when its digest is the one meta.json recorded with the fingerprint, that
    digest vouches for the content and the tensors are not hashed a second
    time: ``recheck_tensors=True`` hashes them anyway, which also catches a
    fault in this machine's memory during the load. A file with no sidecar of
    its own is checked against its folder's manifest when that lists it. With
    ``signature`` (an OpenSSF model signature, with ``public_key`` or
    ``certificate_chain``) the weights must be the signed ones: a file is checked
    in the same pass, a folder first. Unless ``sidecar="ignore"``, the files a
    model is built from in a model folder (``config.json``, tokenizer files, a
    subfolder's ``1_Pooling/config.json``...) must match the manifest covering the
    folder (:class:`~torchverity.errors.ManifestMismatchError` otherwise), or, with
    no manifest, the names a Hugging Face hub cache or ``local_dir`` download gave
    them (:class:`~torchverity.errors.HubFileMismatchError`); the report's
    ``model_files`` names them, ``model_files_against`` and ``model_files_record``
    what vouched for them.
    """
    if sidecar not in ("warn", "require", "ignore"):
        raise UsageError(f"unknown sidecar policy '{sidecar}'", hint="use warn, require or ignore")
    fit = KeyFit.of(strict, strip_prefix, key_map)
    p = Path(path)
    target = resolve(p)
    signed = _signed(target.folder if target.index is not None else None, target.file,
                     signature, public_key, certificate_chain)
    beside = _model_files(target) if sidecar != "ignore" else None
    if target.index is not None:
        from torchverity.checkpoint._sharded import load_sharded

        foreign = not_weights(target)  # a shard that is a pointer comes before the records
        if foreign is not None:
            raise foreign

        obj, report = load_sharded(target.folder, map_location=map_location, sidecar=sidecar,
                                   mmap=mmap, recheck_tensors=recheck_tensors,
                                   index=target.index)
    else:
        from torchverity.pickles._limits import check_limits

        check_limits(target.file)  # zip bombs, huge headers, deep nesting: before torch reads
        obj, report = _load_file(target.file, map_location, sidecar, trust_sha256, mmap,
                                 recheck_tensors, signed)
    if beside is not None:
        report = _with_model_files(report, beside, target.folder)
    if model is not None:
        fitted = check_against_model(obj, model, p, fit)
        report = _fitted(report, fitted, _renamed_none(fit, fitted.renamed, p))
    elif fit.renames:
        obj, renamed = rename_keys(state_dict_of(obj), fit)
        note = _renamed_none(fit, renamed, p)
        if note:
            report = dataclasses.replace(report, warnings=(*report.warnings, note))
    for text in report.warnings:
        warnings.warn(text, CheckpointWarning, stacklevel=2)
    return (obj, report) if with_report else obj


def _model_files(target: Target) -> ModelFiles | None:
    if not is_model_folder(target):
        return None  # a folder of checkpoints: no build reads files beside them
    from torchverity.checkpoint._model_files import check_model_files

    return check_model_files(target)


def _with_model_files(report: LoadReport, beside: ModelFiles, folder: Path) -> LoadReport:
    note = beside.warning(folder)
    return dataclasses.replace(report, model_files=beside.checked,
                               model_files_against=beside.against,
                               model_files_record=beside.record,
                               warnings=(*report.warnings, *([note] if note else [])))


def _renamed_none(fit: KeyFit, renamed: int, path: Path) -> str | None:
    """A rename asked for that matched no key is most likely the wrong prefix: said, not
    silently done nothing."""
    if not fit.renames or renamed:
        return None
    asked = [f"strip_prefix {p!r}" for p in fit.strip_prefixes]
    asked += [f"key_map {old!r}" for old, _new in fit.key_map]
    return (f"{path}: {', '.join(asked)} matched no checkpoint key: nothing was renamed "
            f"(torchverity inspect {shell_path(path)} lists the keys)")


def _fitted(report: LoadReport, fit: FitReport, note: str | None = None) -> LoadReport:
    notes = [*report.warnings, *([note] if note else [])]
    if fit.missing:
        notes.append(f"{report.path}: strict=False: {len(fit.missing)} model key(s) not in the "
                     f"checkpoint kept their initial values: {', '.join(fit.missing[:10])}")
    if fit.unexpected:
        notes.append(f"{report.path}: strict=False: {len(fit.unexpected)} checkpoint key(s) not "
                     f"in the model were not loaded: {', '.join(fit.unexpected[:10])}")
    diagnosis = (prefix_diagnosis(fit.missing, fit.unexpected)
                 or partial_prefix_diagnosis(fit.missing, fit.unexpected))
    if diagnosis:
        notes.append(f"{report.path}: {diagnosis}")
    return dataclasses.replace(report, model_checked=True, missing_keys=fit.missing,
                               unexpected_keys=fit.unexpected, ignored_keys=fit.ignored_buffers,
                               warnings=tuple(notes))


def _signed(folder: Path | None, file: Any, signature: Any, public_key: Any,
            chain: Sequence[Any]) -> ExpectedDigest | None:
    if signature is None:
        return None
    from torchverity.provenance import require_signed_folder, signed_record

    if folder is not None:
        require_signed_folder(folder, signature, public_key=public_key, certificate_chain=chain)
        return None
    algo, hexd, _source = signed_record(file, signature, public_key=public_key,
                                        certificate_chain=chain)
    return ExpectedDigest(algo, hexd, "signature")
