"""Fingerprint records without torch: entries, the root over them, and the tensor hash
primed with its entry header, so file readers can fingerprint a .safetensors file's bytes
without importing torch (see :mod:`torchverity.checkpoint._fingerprint` for the format).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torchverity.errors import FormatError, UsageError

FINGERPRINT_VERSION = 1


EXACT = "blake3"


LEGACY_EXACT = "sha256"  # the exact mode of earlier records, still verified


DEVICE = "tvsum64x2"

# The modes a user names: exact (EXACT), device (DEVICE), sha256 (LEGACY_EXACT)...
NamedMode = Literal["exact", "device", "sha256"]
# ...plus "auto", and the algorithms by name to rebuild a record in the one it names.
Mode = Literal[NamedMode, "auto", "blake3", "tvsum64x2"]


@dataclass(frozen=True)
class TensorDigest:
    """One entry of a fingerprint. ``dtype`` is torch's name without ``torch.``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str


@dataclass(frozen=True)
class Fingerprint:
    """The content fingerprint of a set of named tensors (and plain values)."""

    algo: str
    root: str
    entries: tuple[TensorDigest, ...]
    version: int = FINGERPRINT_VERSION
    _index: dict[str, TensorDigest] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index.update({e.name: e for e in self.entries})

    @property
    def tensors(self) -> Mapping[str, TensorDigest]:
        return self._index

    def differing(self, other: Fingerprint) -> list[str]:
        """Names whose digest differs, or that exist on one side only, sorted."""
        if other.algo != self.algo:
            raise UsageError(
                f"cannot compare a {self.algo} fingerprint with a {other.algo} one",
                hint="compute both with the same mode (exact or device)",
            )
        names = set(self._index) | set(other.tensors)
        return sorted(n for n in names if self._index.get(n) != other.tensors.get(n))

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "algo": self.algo,
            "root": self.root,
            "tensors": {
                e.name: {"dtype": e.dtype, "shape": list(e.shape), "digest": e.digest}
                for e in self.entries
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fingerprint:
        try:
            entries = tuple(
                TensorDigest(name, v["dtype"], tuple(int(s) for s in v["shape"]), v["digest"])
                for name, v in data["tensors"].items()
            )
            fp = cls(algo=data["algo"], root=data["root"], entries=entries,
                     version=int(data["version"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FormatError(f"not a valid fingerprint record: {exc!r}") from None
        if _root(fp.algo, entries) != fp.root:
            raise FormatError("fingerprint record is inconsistent: root does not match its entries")
        return fp


def _header(kind: str, name: str, dtype: str, shape: Sequence[int], nbytes: int) -> bytes:
    return f"torchverity-{kind}-v1\0{name}\0{dtype}\0{list(shape)}\0{nbytes}\0".encode()


def plain_tensor_hasher(name: str, dtype: str, shape: Sequence[int], nbytes: int,
                        algo: str = EXACT, *, threads: bool = False) -> Any:
    """A hash of ``algo`` primed with the entry header (``dtype`` as torch names it)."""
    header = _header("tensor", name, dtype, tuple(shape), nbytes)
    if algo == LEGACY_EXACT:
        return hashlib.sha256(header)
    if algo != EXACT:
        raise UsageError(f"'{algo}' is not an exact fingerprint algorithm",
                         hint=f"use {EXACT} (or {LEGACY_EXACT} for old records)")
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)
    h.update(header)
    return h


def value_digest(name: str, value: Any) -> TensorDigest:
    """The entry of a plain value (None, bool, int, float, str)."""
    kind = type(value).__name__ if value is not None else "none"
    text = value.hex() if isinstance(value, float) else json.dumps(value)
    payload = _header("value", name, kind, (), len(text)) + text.encode()
    return TensorDigest(name, kind, (), hashlib.sha256(payload).hexdigest())


def _root(algo: str, entries: Sequence[TensorDigest]) -> str:
    h = hashlib.sha256(f"torchverity-fingerprint-v{FINGERPRINT_VERSION}\0{algo}\0".encode())
    for e in sorted(entries, key=lambda e: e.name):
        h.update(f"{e.name}\0{e.digest}\n".encode())
    return h.hexdigest()


def from_entries(algo: str, entries: Sequence[TensorDigest]) -> Fingerprint:
    """Assemble a fingerprint (sorted entries and their root) from computed digests."""
    ordered = tuple(sorted(entries, key=lambda e: e.name))
    return Fingerprint(algo=algo, root=_root(algo, ordered), entries=ordered)
