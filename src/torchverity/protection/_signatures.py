"""OpenSSF model signatures beside a loaded file: which key to trust, and what it vouches for.

A file is signed when ``FILE.sig`` exists, or ``model.sig`` in its folder or
the folder above (where ``model_signing sign`` and ``torchverity sign`` put
it). With a key or certificate chain to trust, the signature is verified once
per signature file (again only when that file changes), and the loaded file is
then hashed against its signed digest in the pass that reads it. Without one,
the signature cannot be checked, and the switch says so once per signature.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchverity.digest import ALGORITHMS
from torchverity.errors import IntegrityError, shell_path
from torchverity.protection._records import Record, signatures_near
from torchverity.protection._session import Session
from torchverity.protection._state import CHAIN_ENV, PUBLIC_KEY_ENV, Event, caller_site


def _stat_key(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def signature_record(session: Session, path: Path, record: Record | None) -> Record | None:
    """The signed digest of ``path`` when a signature covers it, else ``record``.

    Raises IntegrityError when the signature does not verify under the trusted
    key or does not list the file.
    """
    for sig, rel in signatures_near(os.fspath(path)):
        key = _stat_key(sig)
        if key is not None:
            return _from_signature(session, path, record, sig, rel, key)
    return record


def _from_signature(session: Session, path: Path, record: Record | None, sig: str, rel: str,
                    key: tuple[int, int, int]) -> Record | None:
    trust = session.trust
    if not trust.given:
        first = sig not in session.signatures.unchecked
        session.signatures.unchecked.add(sig)
        session.emit(Event(
            "unchecked-signature", "protect",
            f"{path} is signed ({sig}) but no key to trust was given, so its signature is not "
            "checked; give one: protect(public_key='pub.pem'), torchverity run --public-key "
            f"pub.pem, or {PUBLIC_KEY_ENV}=pub.pem (certificates: certificate_chain=, "
            f"--certificate, {CHAIN_ENV})", os.fspath(path), caller_site(),
            {"signature": sig}), loud=first)
        return record
    signed = _verified(session, path, sig, key)
    found = signed.digests.get(rel) if signed.method == "files" else None
    if signed.method == "files" and found is None:
        raise IntegrityError(
            f"{path}: not covered by signature {sig} (signed by {signed.signer}): the file "
            "was added after the model was signed", path=path,
            hint=f"torchverity verify {shell_path(os.path.dirname(sig))} --signature "
                 f"{shell_path(sig)} "
                 f"--{'public-key' if trust.public_key else 'certificate'} PEM lists every file")
    if found is None or found[0] not in ALGORITHMS:  # pieces of files, or blake2
        _check_folder(session, path, sig, key, rel)
        return record
    algo, hexdigest = found
    same = record is not None and (record.algo, record.hexdigest) == found
    return Record(path, algo, hexdigest, "signature", f"{os.path.basename(sig)} (signed by "
                  f"{signed.signer})", record.meta if same and record is not None else None)


def _verified(session: Session, path: Path, sig: str, key: tuple[int, int, int]) -> Any:
    """The signature's digests, verified once per signature file (a failure raises each time)."""
    from torchverity.provenance import signed_digests

    cache = session.signatures
    cached = cache.entries.get(sig)
    if cached is not None and cached[0] == key:
        return cached[1]
    trust = session.trust
    signed = signed_digests(path, sig, public_key=trust.public_key,
                            certificate_chain=trust.certificate_chain)
    cache.entries[sig] = (key, signed)
    return signed


def _check_folder(session: Session, path: Path, sig: str, key: tuple[int, int, int],
                  rel: str) -> None:
    """A signature without a digest per file torchverity computes: the whole signed folder
    is checked by the signing library's own hashing, once per signature file."""
    from torchverity.provenance import require_signed_folder

    cache = session.signatures
    if cache.folders_checked.get(sig) == key:
        return
    root = path if rel == "." else Path(os.path.dirname(sig))
    trust = session.trust
    require_signed_folder(root, sig, public_key=trust.public_key,
                          certificate_chain=trust.certificate_chain)
    cache.folders_checked[sig] = key
