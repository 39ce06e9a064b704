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
  one file (:func:`hub_file_checks` for several, hashed in parallel), and
  :func:`hub_record` hands ``torchverity.load`` the digest a hub file must
  have, so it is checked in the pass that reads it;
- :func:`signed_record` / :func:`require_signed_folder`: the same for a model
  signature (``torchverity.load(..., signature=...)``); :func:`signed_digests`
  gives every signed file's digest once the signature verifies;
- :func:`write_attestation` / :func:`verify_attestation`: an in-toto Statement v1
  over a checkpoint's files with its fingerprint and training record.

Names load lazily: ``torchverity.load`` reaches the hub check without importing
the signing library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchverity._lazy import attach

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
        hub_file_checks,
        hub_record,
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
        SignedDigests,
        SignReport,
        default_signature_path,
        require_signed_folder,
        sign_model,
        signed_digests,
        signed_record,
        verify_model,
    )

__all__ = [
    "DEFAULT_SIGNATURE",
    "AttestationResult",
    "HubEntry",
    "HubResult",
    "SignReport",
    "SignatureResult",
    "SignedDigests",
    "build_statement",
    "default_signature_path",
    "hub_blob_check",
    "hub_file_checks",
    "hub_record",
    "hub_target",
    "require_hub_blob",
    "require_signed_folder",
    "sign_model",
    "signed_digests",
    "signed_record",
    "verify_attestation",
    "verify_hub_cache",
    "verify_hub_path",
    "verify_hub_repo",
    "verify_local_dir",
    "verify_model",
    "write_attestation",
]


__getattr__, __dir__ = attach(__name__, __file__)
