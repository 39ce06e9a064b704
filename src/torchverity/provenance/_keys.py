"""Signing keys and certificates, checked before anything is hashed or written.

model-signing accepts elliptic-curve keys on P-256, P-384 and P-521 only and
reports anything else with a bare exception from deep inside; these checks
turn every such case into a message that names the file and what to use.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchverity.errors import FormatError, InputError, UsageError

CURVES = ("secp256r1", "secp384r1", "secp521r1")
_KEYGEN_HINT = (
    "create a P-256 key pair: openssl ecparam -name prime256v1 -genkey -noout -out key.pem && "
    "openssl ec -in key.pem -pubout -out pub.pem"
)


def write_key_pair(folder: Path, name: str = "key") -> tuple[Path, Path]:
    """A fresh ECDSA P-256 key pair as PEM files ``NAME.pem`` and ``NAME.pub.pem``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    priv, pub = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def _read(path: str | Path, what: str) -> bytes:
    p = Path(path)
    try:
        return p.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{p}: no such {what}", path=p) from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read {what}: {exc.strerror or exc}", path=p) from None


def _check_curve(key: Any, path: Path, what: str) -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    public = key.public_key() if hasattr(key, "public_key") else key
    if not isinstance(public, ec.EllipticCurvePublicKey):
        kind = type(public).__name__.removeprefix("_").replace("PublicKey", "")
        raise UsageError(
            f"{path}: {what} is a {kind or 'non-EC'} key; OpenSSF model signatures use "
            f"elliptic-curve keys ({', '.join(CURVES)})",
            hint=_KEYGEN_HINT,
        )
    if public.curve.name not in CURVES:
        raise UsageError(
            f"{path}: {what} is on curve {public.curve.name}; supported: {', '.join(CURVES)}",
            hint=_KEYGEN_HINT,
        )


def load_private_key(path: str | Path, password: str | None = None) -> Any:
    """The EC private key in ``path`` (PEM), or a typed error saying what is wrong."""
    from cryptography.hazmat.primitives import serialization

    p = Path(path)
    data = _read(p, "private key")
    try:
        key = serialization.load_pem_private_key(
            data, password.encode() if password is not None else None
        )
    except TypeError as exc:
        raise UsageError(f"{p}: {exc}", hint="pass --password, or use an unencrypted key") \
            from None
    except ValueError as exc:
        raise FormatError(
            f"{p}: not a PEM private key ({exc})", path=p, hint=_KEYGEN_HINT
        ) from None
    _check_curve(key, p, "the private key")
    return key


def load_public_key(path: str | Path) -> Any:
    from cryptography.hazmat.primitives import serialization

    p = Path(path)
    data = _read(p, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        if b"PRIVATE KEY" in data:
            raise UsageError(
                f"{p}: is a private key; verification takes the public key",
                hint=f"openssl ec -in {p} -pubout -out pub.pem",
            ) from None
        raise FormatError(f"{p}: not a PEM public key ({exc})", path=p, hint=_KEYGEN_HINT) \
            from None
    _check_curve(key, p, "the public key")
    return key


def load_certificates(paths: Sequence[str | Path], what: str) -> list[Any]:
    """Every certificate in the PEM files ``paths`` (a file may hold several)."""
    from cryptography import x509

    certs: list[Any] = []
    for path in paths:
        p = Path(path)
        data = _read(p, what)
        try:
            certs += x509.load_pem_x509_certificates(data)
        except ValueError as exc:
            raise FormatError(f"{p}: not a PEM certificate ({exc})", path=p,
                              hint="pass PEM files (-----BEGIN CERTIFICATE-----)") from None
    return certs


def check_signing_certificate(cert_path: str | Path, private_key: Any) -> Any:
    """The leaf certificate, refused when expired, not yet valid, or for another key."""
    p = Path(cert_path)
    (cert, *_rest) = load_certificates([p], "certificate") or [None]
    if cert is None:
        raise FormatError(f"{p}: holds no certificate", path=p)
    now = datetime.datetime.now(datetime.timezone.utc)
    if cert.not_valid_after_utc < now:
        raise UsageError(
            f"{p}: certificate expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
            "a signature made with it would not be trusted",
            hint="renew the certificate (same key is fine) and sign again",
        )
    if cert.not_valid_before_utc > now:
        raise UsageError(
            f"{p}: certificate is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC",
            hint="check this machine's clock, or wait until the certificate is valid",
        )
    if cert.public_key() != private_key.public_key():
        raise UsageError(
            f"{p}: certificate is for another key than the private key given",
            hint="pass the certificate issued for this key",
        )
    return cert
