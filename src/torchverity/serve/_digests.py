"""RFC 9530 digest values: parsing Content-Digest and Repr-Digest, checking and formatting
them, choosing an algorithm from Want-Content-Digest.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torchverity.serve._problem import (
    DIGEST_INVALID,
    DIGEST_MISMATCH,
    DIGEST_UNSUPPORTED,
    Problem,
    ProblemError,
)
from torchverity.serve._structured_fields import FieldSyntaxError, parse_dictionary

HASHES: dict[str, Callable[[], Any]] = {"sha-256": hashlib.sha256, "sha-512": hashlib.sha512}
DIGEST_SIZES = {"sha-256": 32, "sha-512": 64}


# What this side prefers, sent with "unsupported" and "required" answers.
WANT_VALUE = "sha-256=10, sha-512=5"


def _invalid(field: str, reason: str, algorithm: str | None = None) -> ProblemError:
    entry = {"header": field, "reason": reason}
    if algorithm:
        entry["algorithm"] = algorithm
    return ProblemError(
        Problem(
            400, DIGEST_INVALID, "Invalid Digest Values",
            f"the {field} field is not valid: {reason}",
            {"invalid-digests": [entry]},
        )
    )


def parse_digest_field(value: str, field: str = "content-digest") -> dict[str, bytes]:
    """The supported digests a ``Content-Digest``-style field asks for: ``{algo: raw bytes}``.

    Raises :class:`ProblemError` (400) for a malformed field, a digest of the
    wrong form or length, or a field naming no supported algorithm.
    """
    try:
        members = parse_dictionary(value)
    except FieldSyntaxError as exc:
        raise _invalid(field, str(exc)) from None
    if not members:
        raise _invalid(field, "the field is empty")
    wanted: dict[str, bytes] = {}
    unsupported: list[str] = []
    for algo, digest in members.items():
        if algo not in HASHES:
            unsupported.append(algo)
            continue
        if not isinstance(digest, bytes):
            raise _invalid(field, "the value is not a byte sequence (:base64:)", algo)
        if len(digest) != DIGEST_SIZES[algo]:
            reason = f"a {algo} digest has {DIGEST_SIZES[algo]} bytes, got {len(digest)}"
            raise _invalid(field, reason, algo)
        wanted[algo] = digest
    if not wanted:
        raise ProblemError(
            Problem(
                400, DIGEST_UNSUPPORTED, "Unsupported Hashing Algorithms",
                f"the {field} field names no supported algorithm "
                f"({', '.join(sorted(unsupported))}); use sha-256 or sha-512",
                {"unsupported-algorithms": [{"algorithm": a, "header": field}
                                            for a in unsupported]},
                {"Want-Content-Digest": WANT_VALUE},
            )
        )
    return wanted


def check_digests(field: str, expected: Mapping[str, bytes], hashers: Mapping[str, Any]) -> None:
    """Compare each expected digest with its hasher in constant time; raise on mismatch.

    The answer names the algorithms that failed, never the computed values.
    """
    failed = [
        algo for algo, digest in expected.items()
        if not hmac.compare_digest(hashers[algo].digest(), digest)
    ]
    if failed:
        raise ProblemError(
            Problem(
                400, DIGEST_MISMATCH, "Mismatching Digest Values",
                f"the content does not match its {field} ({', '.join(failed)}): "
                "it was changed or truncated on the way; resend it",
                {"mismatching-digests": [{"algorithm": a, "header": field} for a in failed]},
            )
        )


def new_hashers(algorithms: Iterable[str]) -> dict[str, Any]:
    return {algo: HASHES[algo]() for algo in algorithms}


def format_digest(algorithm: str, data: bytes | memoryview | Iterable[bytes]) -> str:
    """A ``Content-Digest`` value for ``data`` (bytes or an iterable of chunks)."""
    hasher = HASHES[algorithm]()
    for chunk in [data] if isinstance(data, (bytes, memoryview)) else data:
        hasher.update(chunk)
    return f"{algorithm}=:{base64.b64encode(hasher.digest()).decode()}:"


def verify_digest(field_value: str, data: bytes, field: str = "content-digest") -> None:
    """Check ``data`` against a digest field value; raise :class:`ProblemError` otherwise."""
    expected = parse_digest_field(field_value, field)
    hashers = new_hashers(expected)
    for hasher in hashers.values():
        hasher.update(data)
    check_digests(field, expected, hashers)


def choose_algorithm(want: str | None, default: str | None) -> str | None:
    """The algorithm a ``Want-Content-Digest`` prefers (highest weight above 0), or ``default``.

    An absent or malformed preference falls back to ``default``; a valid one
    that accepts no supported algorithm means: send no digest.
    """
    if want is None:
        return default
    try:
        members = parse_dictionary(want)
    except FieldSyntaxError:
        return default
    weights = {
        algo: weight for algo, weight in members.items()
        if algo in HASHES and isinstance(weight, int) and not isinstance(weight, bool)
        and 0 < weight <= 10
    }
    if not weights:
        return None
    return max(sorted(weights), key=lambda a: weights[a])
