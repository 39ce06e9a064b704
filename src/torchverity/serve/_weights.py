"""Start-up verification of the weights a service will hold.

The file's digest must be recorded somewhere the service can check before
unpickling: a sidecar (``CKPT.sha256``) or the folder's manifest. The
checkpoint is then loaded with ``torchverity.load`` (``weights_only=True``),
which also checks the content fingerprint against ``CKPT.meta.json`` when
present and the keys, shapes and dtypes against the model. With an OpenSSF
model signature the signature is the record instead; an in-toto attestation,
when given, must verify too and is exposed in ``/metadata``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchverity.checkpoint._folders import manifest_entry, resolve
from torchverity.checkpoint._key_map import KeyFit
from torchverity.digest import digest_file, find_sidecar
from torchverity.errors import InputError, IntegrityError


@dataclass(frozen=True)
class WeightsInfo:
    """Where the served weights came from and how they were verified."""

    path: str
    algo: str
    digest: str
    digest_source: str  # "sidecar", "manifest" or "signature"
    file_fingerprint: str | None  # root recorded in meta.json and checked, if there was one
    provenance: dict[str, Any] | None = None  # the signature and attestation that verified

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path, "algorithm": self.algo, "digest": self.digest,
            "verified_by": self.digest_source, "fingerprint_verified": self.file_fingerprint,
            **({"provenance": self.provenance} if self.provenance else {}),
        }


def load_verified(model: torch.nn.Module, weights: str | os.PathLike[str], *,
                  signature: str | os.PathLike[str] | None = None,
                  public_key: str | os.PathLike[str] | None = None,
                  certificate_chain: Sequence[str | os.PathLike[str]] = (),
                  attestation: str | os.PathLike[str] | None = None) -> WeightsInfo:
    """Verify ``weights`` and load them into ``model``; raise a typed error otherwise."""
    path = Path(weights)
    if not path.exists():
        raise InputError(f"{path}: no such weights file", path=path)
    trust = {"public_key": public_key, "certificate_chain": certificate_chain}
    info = _load_signed(model, path, signature, trust) if signature is not None else \
        _load_recorded(model, path)
    if attestation is None:
        return info
    return dataclasses.replace(info, provenance={**(info.provenance or {}),
                                                 "attestation": _attested(path, attestation,
                                                                          trust)})


def _load_signed(model: torch.nn.Module, path: Path, signature: str | os.PathLike[str],
                 trust: dict[str, Any]) -> WeightsInfo:
    from torchverity.checkpoint._load import load

    _obj, report = load(path, model=model, sidecar="ignore", signature=signature,
                        with_report=True, **trust)
    return WeightsInfo(os.fspath(path), "sha256", str(report.digest), "signature",
                       report.fingerprint, {"signature": os.fspath(signature)})


def _attested(path: Path, attestation: str | os.PathLike[str],
              trust: dict[str, Any]) -> dict[str, Any]:
    from torchverity.provenance import verify_attestation

    result = verify_attestation(path, attestation, **trust)
    if not result.ok:
        what = result.reason or ", ".join(f"{e.path} {e.status}" for e in result.problems)
        raise IntegrityError(f"{path}: attestation {attestation} does not vouch for these "
                             f"weights: {what}", path=path,
                             hint=f"torchverity verify {path} --attestation {attestation}")
    return {"path": os.fspath(attestation), "signer": result.signer,
            "subjects": [{"name": e.path, "sha256": e.expected} for e in result.entries],
            "predicate": result.predicate}


def _load_recorded(model: torch.nn.Module, path: Path) -> WeightsInfo:
    from torchverity.checkpoint._load import load

    if find_sidecar(path) is not None or path.is_dir():
        _obj, report = load(path, model=model, sidecar="require", with_report=True)
        return WeightsInfo(os.fspath(path), str(report.algo), str(report.digest), "sidecar",
                           report.fingerprint)
    algo, digest = _check_against_manifest(path)
    _obj, report = load(path, model=model, sidecar="ignore", with_report=True)
    return WeightsInfo(os.fspath(path), algo, digest, "manifest", report.fingerprint)


def _check_against_manifest(path: Path) -> tuple[str, str]:
    """Check the file against its folder's manifest entry: ``(algo, hex)``."""
    from torchverity.manifest import find_manifest, read_manifest

    try:
        record = find_manifest(path.parent)
    except InputError:
        raise IntegrityError(
            f"{path}: no recorded digest (no {path.name}.sha256 sidecar and no manifest in "
            f"{path.parent}): refusing to serve unverified weights",
            path=path, hint=f"record it from a trusted copy: torchverity hash --write {path}",
        ) from None
    manifest = read_manifest(record)
    entry = next((e for e in manifest.entries if e.path == path.name), None)
    if entry is None:
        raise IntegrityError(
            f"{path}: not listed in {record}: refusing to serve unverified weights",
            path=path, hint=f"torchverity hash --write {path}, or rebuild the manifest",
        )
    algo = manifest.algo
    actual = digest_file(path, algo).hexdigest
    if actual != entry.digest:
        raise IntegrityError(
            f"{path}: {algo} digest does not match {record.name}: the file changed after it "
            f"was recorded (expected {entry.digest}, got {actual})",
            path=path, expected=entry.digest, actual=actual,
            hint=f"restore {path.name} from a verified copy; torchverity verify {path.parent}",
        )
    return algo, actual
