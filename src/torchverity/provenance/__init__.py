"""Provenance: who produced these bytes, and are they still the bytes they were.

A sidecar or manifest stored beside the files catches accidental damage;
whoever can rewrite the files can rewrite those records too. This package adds
the checks that hold against such a writer, and the ones that need no setup:

- :func:`sign_model` / :func:`verify_model`: OpenSSF model signatures (the
  ``model-signing`` library, extra ``sign``), key or certificate mode,
  interoperable with ``model_signing sign`` / ``verify``;
- :func:`verify_hub_cache` / :func:`verify_local_dir`: Hugging Face hub caches
  and ``local_dir`` downloads re-hashed against the names and records the hub
  gave them, offline, never following a link out of the cache;
  :func:`hub_blob_check` does the same for one file (``torchverity.load`` uses it);
- :func:`write_attestation` / :func:`verify_attestation`: in-toto Statement v1
  over a checkpoint's files with its fingerprint and training record.
"""

from __future__ import annotations

from torchverity.provenance._oms import (
    DEFAULT_SIGNATURE,
    SignatureResult,
    SignReport,
    default_signature_path,
    sign_model,
    verify_model,
)

__all__ = [
    "DEFAULT_SIGNATURE",
    "SignReport",
    "SignatureResult",
    "default_signature_path",
    "sign_model",
    "verify_model",
]
