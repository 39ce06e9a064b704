"""OpenSSF model signatures through the ``model-signing`` library (extra: ``sign``).

The signature is the library's own: a Sigstore bundle holding a DSSE envelope
around an in-toto statement that lists every file's relative path and
SHA-256, the one algorithm ``model_signing verify`` checks files with. torchverity
supplies the digests (reusing fresh SHA-256 records instead of hashing again)
and, when verifying, compares them per file so a failure names
each file that is mismatched, missing or extra. Files the library never signs
(``.git``, ``.gitattributes``, ``.github``, ``.gitignore``, the signature
itself) and torchverity's own manifests are left out, as the signature records.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchverity._verify_results import EntryTally
from torchverity.digest import ALGORITHMS
from torchverity.errors import FormatError, InputError, UsageError, require_extra, shell_path
from torchverity.manifest import MANIFEST_FILES, walk_files
from torchverity.provenance._keys import (
    check_signing_certificate,
    load_certificates,
    load_private_key,
    load_public_key,
)
from torchverity.provenance._records import Digests, model_digests
from torchverity.verify import Status, VerifyEntry

GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")
DEFAULT_SIGNATURE = "model.sig"
_FEATURE = "OpenSSF model signing"


def _library() -> Any:
    require_extra("OpenSSL", extra="sign", feature=_FEATURE)
    return require_extra("model_signing", extra="sign", feature=_FEATURE)


# key: signed with a bare elliptic-curve key; certificate: with its certificate (and chain).
SigningMode = Literal["key", "certificate"]


@dataclass(frozen=True)
class SignReport:
    """What a signature was written for, and which digests were reused."""

    target: str
    signature: str
    mode: SigningMode
    files: tuple[str, ...]
    reused: dict[str, str]
    hashed: tuple[str, ...]
    ignored: tuple[str, ...]


class CheckedEntries(EntryTally):
    """Verdicts shared by signature and attestation results: the envelope, then each file."""

    valid: bool

    @property
    def ok(self) -> bool:
        return self.valid and all(e.status == "ok" for e in self.entries)


@dataclass(frozen=True)
class SignatureResult(CheckedEntries):
    """A model checked against its signature: the signature itself, then every file."""

    target: str
    record: str
    valid: bool
    signer: str
    subject: dict[str, str]
    algo: str
    entries: tuple[VerifyEntry, ...]
    ignored: tuple[str, ...] = ()
    reason: str | None = None
    kind: str = "signature"

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target, "kind": self.kind, "record": self.record, "ok": self.ok,
            "signature_valid": self.valid, "signer": self.signer, "subject": self.subject,
            "algorithm": self.algo, "ignored": list(self.ignored), "reason": self.reason,
            "counts": self.counts, "entries": self.entries_json(),
        }


# ------------------------------------------------------------------ listing


def _ignored(rel: str, ignore: Sequence[str]) -> bool:
    return any(rel == p or rel.startswith(p.rstrip("/") + "/") for p in ignore)


def model_files(root: Path, ignore: Sequence[str]) -> tuple[list[str], list[str]]:
    """Regular files under ``root`` minus ``ignore`` (relative POSIX paths), and symlinks.

    Links are listed, never followed: model-signing refuses folders that hold them.
    """
    if root.is_symlink():
        return [], ["."]
    if root.is_file():
        return ["."], []
    return walk_files(root, lambda rel: _ignored(rel, ignore))


def _inside(root: Path, signature: Path) -> list[str]:
    """The signature's path relative to ``root`` when it lies inside that folder."""
    if not root.is_dir():
        return []
    rel = os.path.relpath(os.path.abspath(signature), os.path.abspath(root))
    return [] if rel.startswith("..") else [Path(rel).as_posix()]


def _default_ignores(root: Path, signature: Path) -> list[str]:
    manifests = sorted(MANIFEST_FILES) if root.is_dir() else []
    return [*GIT_PATHS, *manifests, *_inside(root, signature)]


def default_signature_path(model: str | os.PathLike[str]) -> Path:
    p = Path(model)
    return p / DEFAULT_SIGNATURE if p.is_dir() else p.with_name(p.name + ".sig")


# ------------------------------------------------------------------ signing


class _Prehashed:
    """Stands in for ``model_signing.hashing.Config``: hands over digests already known."""

    def __init__(self, manifest: Any) -> None:
        self._manifest = manifest

    def hash(self, model_path: Any, **_: Any) -> Any:
        return self._manifest


def _build_manifest(root: Path, digests: Digests, ignore: Sequence[str]) -> Any:
    ms = _library()
    from model_signing._hashing import hashing as ms_hashing

    items = [ms.manifest.FileManifestItem(path=pathlib.PurePosixPath(rel),
                                          digest=ms_hashing.Digest(digests.algo,
                                                                   bytes.fromhex(hx)))
             for rel, hx in digests.hexdigests.items()]
    serialization = ms.manifest._FileSerialization(digests.algo, False,
                                                    [Path(p) for p in ignore])
    name = root.name or os.path.basename(root.resolve())
    return ms.manifest.Manifest(name, items, serialization)


def _signer_config(private_key: Path, certificate: Path | None, chain: Sequence[Path],
                   password: str | None) -> tuple[Any, SigningMode]:
    ms = _library()
    key = load_private_key(private_key, password)
    if certificate is None:
        if chain:
            raise UsageError("--chain needs --certificate", hint="pass the leaf certificate too")
        return ms.signing.Config().use_elliptic_key_signer(
            private_key=private_key,
            password=password.encode() if password is not None else None), "key"
    check_signing_certificate(certificate, key)
    load_certificates(chain, "certificate chain")
    if password is not None:
        raise UsageError("certificate signing takes an unencrypted key",
                         hint="decrypt it: openssl ec -in key.pem -out plain.pem")
    return ms.signing.Config().use_certificate_signer(
        private_key=private_key, signing_certificate=certificate,
        certificate_chain=list(chain)), "certificate"


def sign_model(
    model: str | os.PathLike[str],
    *,
    private_key: str | os.PathLike[str],
    signature: str | os.PathLike[str] | None = None,
    certificate: str | os.PathLike[str] | None = None,
    chain: Sequence[str | os.PathLike[str]] = (),
    password: str | None = None,
) -> SignReport:
    """Write an OpenSSF model signature for a folder or file; ``model_signing verify`` reads it.

    Keys, certificates and the folder are checked before anything is written;
    the signature appears atomically (temp file, rename).
    """
    root = existing(model)
    if root.is_symlink():
        raise InputError(f"{root}: is a symlink; OpenSSF signatures cover regular files only",
                         path=root, hint=f"sign what it points to: {root.resolve()}")
    sig = Path(signature) if signature is not None else default_signature_path(root)
    if not sig.parent.is_dir():
        raise InputError(f"{sig.parent}: no such folder for the signature", path=sig)
    config, mode = _signer_config(Path(private_key), Path(certificate) if certificate else None,
                                  [Path(c) for c in chain], password)
    ignore = _default_ignores(root, sig)
    files, links = model_files(root, ignore)
    if links:
        raise InputError(
            f"{root}: holds symlinks ({', '.join(links[:3])}); OpenSSF signatures cover "
            "regular files only", path=root,
            hint="replace the links with the files they point to, then sign again")
    if not files:
        raise InputError(f"{root}: no files to sign", path=root)
    # SHA-256: `model_signing verify` hashes with it whatever the signature names, so
    # only SHA-256 records (manifest --algo sha256, save(algo="sha256")) are reused.
    digests = model_digests(root, files, "sha256")
    manifest = _build_manifest(root, digests, ignore)
    _write_signature(config.set_hashing_config(_Prehashed(manifest)), root, sig)
    return SignReport(os.fspath(root), os.fspath(sig), mode, tuple(files), digests.reused,
                      digests.hashed, tuple(ignore))


def _write_signature(config: Any, root: Path, sig: Path) -> None:
    tmp = sig.with_name(f".{sig.name}.tmp-{os.getpid()}")
    try:
        config.sign(root, tmp)
        os.replace(tmp, sig)
    except OSError as exc:
        raise InputError(f"{sig}: cannot write: {exc.strerror or exc}", path=sig) from None
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------ verifying


def _read_bundle(sig: Path) -> Any:
    _library()
    from model_signing._signing import sign_sigstore_pb

    if not sig.is_file():
        raise InputError(f"{sig}: no such signature file", path=sig,
                         hint="sign first: torchverity sign MODEL --key KEY.pem --signature "
                              f"{shell_path(sig)}")
    try:
        return sign_sigstore_pb.Signature.read(sig)
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise FormatError(
            f"{sig}: not an OpenSSF model signature (Sigstore bundle): "
            f"{type(exc).__name__}: {exc}", path=sig,
            hint="ask for the signature again from whoever published the model",
        ) from None


def _verifier(public_key: Path | None, chain: Sequence[Path]) -> tuple[Any, str]:
    from model_signing._signing import sign_certificate, sign_ec_key

    if (public_key is None) == (not chain):
        raise UsageError("verify a signature with exactly one of --public-key or --certificate",
                         hint="torchverity verify MODEL --signature model.sig --public-key pub.pem")
    if public_key is not None:
        load_public_key(public_key)
        return sign_ec_key.Verifier(public_key), f"key {public_key}"
    load_certificates(chain, "certificate chain")
    return sign_certificate.Verifier(list(chain)), "certificate chain " + ", ".join(
        str(c) for c in chain)


def _signer_of(bundle: Any, trust: str) -> str:
    material = bundle.verification_material
    chain = getattr(material, "x509_certificate_chain", None)
    if chain is not None and chain.certificates:
        from cryptography import x509

        leaf = x509.load_der_x509_certificate(chain.certificates[0].raw_bytes)
        return f"certificate {leaf.subject.rfc4514_string()} (trusted via {trust})"
    key = getattr(material, "public_key", None)
    hint = getattr(key, "hint", None) if key is not None else None
    return f"key sha256:{hint} ({trust})" if hint else trust


def existing(path: str | os.PathLike[str]) -> Path:
    """The model or checkpoint path to sign, attest or verify; a missing one says so."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file or directory", path=p,
                         hint="check the path: give the model folder or checkpoint file itself")
    return p


def open_bundle(sig: Path, public_key: str | os.PathLike[str] | None,
                chain: Sequence[str | os.PathLike[str]]) -> tuple[Any, Any, str]:
    """The Sigstore bundle at ``sig``, the verifier for the key or chain, and the signer."""
    bundle = _read_bundle(sig)
    verifier, trust = _verifier(Path(public_key) if public_key else None, [Path(c) for c in chain])
    return bundle, verifier, _signer_of(bundle.bundle, trust)


def _mode_mismatch(bundle: Any, with_key: bool) -> str:
    material = bundle.verification_material
    if getattr(material, "certificate", None):
        return ("it is a Sigstore (keyless) signature, checked against the public Sigstore "
                "logs: verify it online with model_signing verify sigstore MODEL --signature "
                "SIG --identity WHO --identity_provider ISSUER")
    chain = getattr(material, "x509_certificate_chain", None)
    by_certificate = chain is not None and bool(chain.certificates)
    if with_key and by_certificate:
        return "it was signed with a certificate: verify it with --certificate CA.pem"
    if not with_key and not by_certificate:
        return "it was signed with a key, not a certificate: verify it with --public-key PUB.pem"
    return ""


def _expected(sig: Path, public_key: str | os.PathLike[str] | None,
              chain: Sequence[str | os.PathLike[str]]) -> tuple[Any, str, str]:
    """The signed manifest, the signer, and why it was refused (None when it verified)."""
    from cryptography.exceptions import InvalidSignature

    bundle, verifier, signer = open_bundle(sig, public_key, chain)
    mismatch = _mode_mismatch(bundle.bundle, bool(public_key))
    if mismatch:
        return None, signer, mismatch
    try:
        return verifier.verify(bundle), signer, ""
    except InvalidSignature:
        return None, signer, "the signature does not match its content under this key"
    except Exception as exc:  # OpenSSL chain errors, key mismatch, payload checks
        return None, signer, f"{type(exc).__name__}: {exc}"


def verify_model(
    model: str | os.PathLike[str],
    signature: str | os.PathLike[str],
    *,
    public_key: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
) -> SignatureResult:
    """Check the signature, then every file it lists: ok, mismatched, missing, extra."""
    root, sig = existing(model), Path(signature)
    expected, signer, reason = _expected(sig, public_key, certificate_chain)
    if expected is None:
        return SignatureResult(os.fspath(root), os.fspath(sig), False, signer, {}, "",
                               (), reason=reason)
    params = expected.serialization_type
    ignore = [*GIT_PATHS, *params.get("ignore_paths", ()), *_inside(root, sig)]
    want = {rd.identifier: rd.digest for rd in expected.resource_descriptors()}
    algo = next(iter(want.values())).algorithm if want else params.get("hash_type", "sha256")
    actual = _actual_digests(root, params, sorted(set(ignore)))
    entries = _compare(root, want, actual)
    subject = {"name": expected.model_name, "files": str(len(want))}
    return SignatureResult(os.fspath(root), os.fspath(sig), True, signer, subject, algo,
                           entries, tuple(sorted(set(ignore))))


def _actual_digests(root: Path, params: dict[str, Any],
                    ignore: list[str]) -> dict[str, tuple[str, int] | None]:
    """Each present file's digest under the signature's own serialization (None: a link)."""
    files, links = model_files(root, ignore)
    blobs = _hub_blobs(root, links)
    found: dict[str, tuple[str, int] | None] = dict.fromkeys(links)
    if params.get("method") == "files" and params.get("hash_type") in ("sha256", "blake3"):
        from torchverity.digest import digest_files

        paths = {rel: root / rel if rel != "." else root for rel in files} | blobs
        for rel, d in zip(paths, digest_files(paths.values(), params["hash_type"]), strict=True):
            found[rel] = (d.hexdigest, d.size)
        return found
    # Shards or blake2: let the library hash with the parameters the signature records.
    ms = _library()
    config = ms.hashing.Config()
    # Signatures name the digest ("blake2b") where the hashing config wants "blake2".
    algo = {"blake2b": "blake2"}.get(params["hash_type"], params["hash_type"])
    kwargs = {"hashing_algorithm": algo, "ignore_paths": [Path(p) for p in ignore],
              "allow_symlinks": False}
    if params.get("method") == "shards":
        # The signed payload is a protobuf Struct: its numbers come back as floats.
        config.use_shard_serialization(shard_size=int(params["shard_size"]), **kwargs)
    else:
        config.use_file_serialization(**kwargs)
    config.set_ignored_paths(paths=ignore)
    for rd in config.hash(root).resource_descriptors():
        found[rd.identifier] = (rd.digest.digest_hex, -1)
    return found


def _hub_blobs(root: Path, links: list[str]) -> dict[str, Path]:
    """In a Hugging Face snapshot, the blob each link names, for links that stay inside
    their repository's ``blobs/`` (checked from the link text; nothing else is followed)."""
    from torchverity.provenance._hfcache import link_target, snapshot_of

    found: dict[str, Path] = {}
    for rel in links:
        where = snapshot_of(root / rel)
        if where is None:
            continue
        status, blob, _why = link_target(root / rel, where[0])
        if status is None and blob is not None:
            found[rel] = blob
    return found


def _compare(root: Path, want: dict[str, Any],
             actual: dict[str, tuple[str, int] | None]) -> tuple[VerifyEntry, ...]:
    def label(rel: str) -> str:
        return root.name if rel == "." else rel

    entries: list[VerifyEntry] = []
    for rel, digest in want.items():
        got = actual.get(rel)
        if rel not in actual:
            entries.append(VerifyEntry(label(rel), "missing", digest.digest_hex))
        elif got is None:  # a symlink where a signed file was
            entries.append(VerifyEntry(label(rel), "mismatched", digest.digest_hex, "symlink"))
        else:
            status: Status = "ok" if got[0] == digest.digest_hex else "mismatched"
            entries.append(VerifyEntry(label(rel), status, digest.digest_hex, got[0],
                                       actual_size=got[1] if got[1] >= 0 else None))
    entries += [VerifyEntry(label(rel), "extra") for rel in actual if rel not in want]
    entries.sort(key=lambda e: e.path.encode())
    return tuple(entries)


# ------------------------------------------------------------------ loading


@dataclass(frozen=True)
class SignedDigests:
    """What a verified signature vouches for: each signed file's digest by relative path.

    ``method`` is the signature's serialization: ``files`` (one digest per file,
    ``digests`` maps each path to ``(algo, hex)``) or ``shards`` (pieces of files,
    checked with :func:`verify_model`).
    """

    signature: str
    signer: str
    model_name: str
    method: str
    digests: dict[str, tuple[str, str]]


def signed_digests(
    path: str | os.PathLike[str],
    signature: str | os.PathLike[str],
    *,
    public_key: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
) -> SignedDigests:
    """Check the signature only (no file is hashed); IntegrityError naming ``path`` if it fails."""
    from torchverity.errors import IntegrityError

    p, sig = Path(path), Path(signature)
    expected, signer, reason = _expected(sig, public_key, certificate_chain)
    if expected is None:
        raise IntegrityError(
            f"{p}: signature {sig} does not verify ({reason}); refusing to load", path=p,
            hint=f"torchverity verify {shell_path(p.parent)} --signature {shell_path(sig)} "
                 "--public-key PUB.pem")
    digests = {rd.identifier: (rd.digest.algorithm, rd.digest.digest_hex)
               for rd in expected.resource_descriptors()}
    method = str(expected.serialization_type.get("method", "files"))
    return SignedDigests(os.fspath(sig), signer, expected.model_name, method, digests)


def signed_record(
    path: str | os.PathLike[str],
    signature: str | os.PathLike[str],
    *,
    public_key: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
) -> tuple[str, str, str]:
    """``(algo, hex, "signature")`` for a file the signature covers, once it verifies.

    Only the signature is checked here (no hashing): a loader that hashes the
    file as it reads it compares the digest, so the weights are read once.
    The signature may cover the file itself or a folder holding it.
    """
    from torchverity.errors import IntegrityError

    p, sig = Path(path), Path(signature)
    signed = signed_digests(p, sig, public_key=public_key, certificate_chain=certificate_chain)
    absolute = Path(os.path.abspath(p))
    candidates = ["."] + [absolute.relative_to(a).as_posix() for a in absolute.parents
                          if a.name == signed.model_name]
    for rel in candidates:
        found = signed.digests.get(rel)
        if found is not None and found[0] in ALGORITHMS:
            return found[0], found[1], "signature"
    raise IntegrityError(
        f"{p}: not covered by signature {sig} (signed by {signed.signer}, over "
        f"'{signed.model_name}')", path=p,
        hint=f"pass the signature of this model, or check the folder: torchverity verify "
             f"DIR --signature {sig}")


def require_signed_folder(
    folder: str | os.PathLike[str],
    signature: str | os.PathLike[str],
    *,
    public_key: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
) -> SignatureResult:
    """:func:`verify_model`, raising :class:`IntegrityError` unless everything verifies."""
    from torchverity.errors import IntegrityError

    result = verify_model(folder, signature, public_key=public_key,
                          certificate_chain=certificate_chain)
    if result.ok:
        return result
    what = result.reason or ", ".join(f"{e.path} {e.status}" for e in result.problems[:10])
    raise IntegrityError(
        f"{folder}: signature {signature} refuses these weights: {what}", path=os.fspath(folder),
        hint=f"torchverity verify {shell_path(folder)} --signature {shell_path(signature)} "
             "lists every file")
