"""Provenance: who produced these bytes, and are they still the bytes they were.

A sidecar or manifest stored beside the files catches accidental damage;
whoever can rewrite the files can rewrite those records too. This package adds
the checks that hold against such a writer, and the ones that need no setup:

- :func:`sign_model` / :func:`verify_model`: OpenSSF model signatures (the
  ``model-signing`` library, extra ``sign``), key or certificate mode,
  interoperable with ``model_signing sign`` / ``verify``;
- :func:`verify_hub_path` (and :func:`verify_hub_cache`, :func:`verify_hub_repo`,
  :func:`verify_local_dir`): Hugging Face hub caches and ``local_dir`` downloads
  re-hashed against the names and records the hub gave them, offline, never
  following a link out of the cache; :func:`hub_blob_check` does the same for
  one file (``torchverity.load`` uses it);
- :func:`write_attestation` / :func:`verify_attestation`: an in-toto Statement v1
  over a checkpoint's files with its fingerprint and training record.

Names load lazily: ``torchverity.load`` reaches the hub check without importing
the signing library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchverity.provenance._attest import (
        AttestationResult,
        build_statement,
        verify_attestation,
        write_attestation,
    )
    from torchverity.provenance._hfcache import (
        HubEntry,
        HubResult,
        hub_blob_check,
        hub_target,
        require_hub_blob,
        verify_hub_cache,
        verify_hub_path,
        verify_hub_repo,
        verify_local_dir,
    )
    from torchverity.provenance._oms import (
        DEFAULT_SIGNATURE,
        SignatureResult,
        SignReport,
        default_signature_path,
        sign_model,
        verify_model,
    )

_LAZY = {
    "DEFAULT_SIGNATURE": "_oms", "SignReport": "_oms", "SignatureResult": "_oms",
    "default_signature_path": "_oms", "sign_model": "_oms", "verify_model": "_oms",
    "HubEntry": "_hfcache", "HubResult": "_hfcache", "hub_blob_check": "_hfcache",
    "hub_target": "_hfcache", "require_hub_blob": "_hfcache", "verify_hub_cache": "_hfcache",
    "verify_hub_path": "_hfcache", "verify_hub_repo": "_hfcache", "verify_local_dir": "_hfcache",
    "AttestationResult": "_attest", "build_statement": "_attest",
    "verify_attestation": "_attest", "write_attestation": "_attest",
}

__all__ = [
    "DEFAULT_SIGNATURE",
    "AttestationResult",
    "HubEntry",
    "HubResult",
    "SignReport",
    "SignatureResult",
    "build_statement",
    "default_signature_path",
    "hub_blob_check",
    "hub_target",
    "require_hub_blob",
    "sign_model",
    "verify_attestation",
    "verify_hub_cache",
    "verify_hub_path",
    "verify_hub_repo",
    "verify_local_dir",
    "verify_model",
    "write_attestation",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchverity.provenance' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"torchverity.provenance.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
