"""Which record vouches for a file, and checking a file against it.

The rules are ``torchverity.load``'s: an interrupted save's pending records,
then the sidecar, then the digest in meta.json. Beyond those, a file listed in
a torchverity manifest of its folder (or the folder above) is checked against
that entry, a file that resolves to a Hugging Face cache blob named by a
SHA-256 is checked against its name, and a file in torch.hub's checkpoints
folder against the SHA-256 prefix in its name. An OpenSSF model signature beside the
file (``FILE.sig``, or ``model.sig`` in its folder or the one above) is found
here too and checked by :mod:`._signatures`. Looking for records costs a few ``stat``
calls (two for a file already found without any); a file without one is never
read here.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from torchverity.checkpoint import meta_path_for
from torchverity.checkpoint._damage import _locate_pt_damage
from torchverity.checkpoint._hashing_reader import load_while_hashing
from torchverity.checkpoint._load_file import (
    _digest_binds_fingerprint,
    _digest_mismatch,
    current_expectation,
)
from torchverity.checkpoint._meta import META_SUFFIX
from torchverity.checkpoint._results import DigestSource, ExpectedDigest
from torchverity.digest import ALGORITHMS, digest_file
from torchverity.errors import InputError, IntegrityError, shell_path
from torchverity.manifest import MANIFEST_NAME, SHA256SUM_NAME, find_manifest, read_manifest
from torchverity.provenance._torch_hub import record_name, torch_hub_prefix

_BLOB = re.compile(r"^[0-9a-f]{64}$")
_MANIFEST_LEVELS = 2  # the file's folder and the one above it
SIGNATURE = "model.sig"  # where model_signing and torchverity sign put a folder's signature
_SETTLED_NS = 1_000_000_000
_NEGATIVE_MAX = 100_000
_negative: dict[str, tuple[int, int]] = {}  # path -> its two folders' mtimes when it had none


@dataclass(frozen=True)
class Record:
    """What a file must hash to: ``source`` is sidecar, meta, manifest, hf-blob, torch-hub
    or signature (``prefix``: the record holds only the digest's first hex digits)."""

    path: Path
    algo: str
    hexdigest: str
    source: str
    record: str
    meta: dict[str, Any] | None = None
    prefix: bool = False

    @property
    def expected(self) -> ExpectedDigest | None:
        """As ``torchverity.load`` names it (for the records it reads, and signatures)."""
        if self.source in ("sidecar", "meta", "signature", "torch-hub"):
            return ExpectedDigest(self.algo, self.hexdigest, cast(DigestSource, self.source),
                                  prefix=self.prefix)
        return None

    def matches(self, actual: str) -> bool:
        return actual.startswith(self.hexdigest) if self.prefix else actual == self.hexdigest

    @property
    def bound(self) -> bool:
        """Whether meta.json's fingerprint was recorded with this very digest."""
        return _digest_binds_fingerprint(self.expected, self.meta)


def _candidates(path: str) -> list[str]:
    """Every name a record of ``path`` could have: checked with plain ``stat`` calls."""
    folder, name = os.path.split(path)
    up = os.path.dirname(folder)
    names = [f"{path}.{algo}" for algo in ALGORITHMS]
    names += [os.path.join(folder, f".{name}.{algo}.pending") for algo in ALGORITHMS]
    names.append(f"{path}{META_SUFFIX}")
    names += [os.path.join(d, m) for d in (folder, up) for m in (MANIFEST_NAME, SHA256SUM_NAME)]
    names += [sig for sig, _rel in signatures_near(path)]
    return names


def signatures_near(path: str) -> list[tuple[str, str]]:
    """Where a signature of ``path`` could be, with the file's path relative to what it signs."""
    folder, name = os.path.split(path)
    found = [(f"{path}.sig", ".")]
    rel = name
    for _ in range(_MANIFEST_LEVELS):
        found.append((os.path.join(folder, SIGNATURE), rel))
        folder, up = os.path.split(folder)
        rel = f"{up}/{rel}"
    return found


def unrecorded(path: str) -> bool:
    """Whether no record can exist for ``path``: a dozen ``stat`` calls, or two when cached.

    A negative answer is remembered with the modification times of the two folders a
    record could be in; creating any record there changes one of them. Folders changed
    in the last second are looked at afresh (their times may not have ticked yet).
    """
    folder = os.path.dirname(path)
    try:
        key = (os.stat(folder).st_mtime_ns, os.stat(os.path.dirname(folder)).st_mtime_ns)
    except OSError:
        return False
    if _negative.get(path) == key:
        return True
    if os.path.islink(path) or any(map(os.path.exists, _candidates(path))) or (
            torch_hub_prefix(Path(path)) is not None):
        return False
    if time.time_ns() - max(key) > _SETTLED_NS:
        if len(_negative) >= _NEGATIVE_MAX:
            _negative.clear()
        _negative[path] = key
    return True


def find_record(path: Path) -> Record | None:
    """The record for ``path``, or None. A record that contradicts itself raises IntegrityError."""
    if unrecorded(os.fspath(path)):
        return None
    if not path.is_file():
        return None
    expected, meta, pending = current_expectation(path, "warn")
    if expected is not None and expected.prefix:
        return Record(path, expected.algo, expected.hex, expected.source,
                      record_name(expected.hex), meta, prefix=True)
    if pending and expected is not None:
        return Record(path, expected.algo, expected.hex, expected.source,
                      f"{path.name} (pending records)", meta)
    if expected is not None and expected.source != "manifest":
        name = (f"{path.name}.{expected.algo}" if expected.source == "sidecar"
                else meta_path_for(path).name)
        return Record(path, expected.algo, expected.hex, expected.source, name, meta)
    # A manifest entry: found again here to name the manifest (and to look one folder up).
    return _manifest_record(path) or _blob_record(path)


def _manifest_record(path: Path) -> Record | None:
    absolute = Path(os.path.abspath(path))
    folder = absolute.parent
    for _ in range(_MANIFEST_LEVELS):
        try:
            manifest_file = find_manifest(folder)
        except InputError:
            folder = folder.parent
            continue
        manifest = read_manifest(manifest_file)
        rel = absolute.relative_to(folder).as_posix()
        entry = next((e for e in manifest.entries if e.path == rel), None)
        if entry is not None:
            return Record(path, manifest.algo, entry.digest, "manifest", os.fspath(manifest_file))
        folder = folder.parent
    return None


def _blob_record(path: Path) -> Record | None:
    if not path.is_symlink():
        return None
    real = path.resolve()
    if real.parent.name == "blobs" and _BLOB.match(real.name):
        return Record(path, "sha256", real.name, "hf-blob", f"Hugging Face cache blob {real.name}")
    return None


def mismatch(record: Record, actual: str) -> IntegrityError:
    """The error ``torchverity.load`` raises for this mismatch (tensors named when it can)."""
    if record.expected is not None:
        return _digest_mismatch(record.path, record.expected, actual,
                                _locate_pt_damage(record.path, record.meta))
    p = record.path
    return IntegrityError(
        f"{p}: {record.algo} digest does not match {record.record}: the file changed after it "
        f"was recorded (expected {record.hexdigest}, got {actual})",
        path=p, expected=record.hexdigest, actual=actual,
        hint=f"restore {p.name} from a verified copy; torchverity verify {shell_path(p.parent)} "
             "lists every changed file",
    )


def check_bytes(record: Record) -> IntegrityError | None:
    """One digest pass over the file: the mismatch, or None when it matches."""
    actual = digest_file(record.path, record.algo).hexdigest
    return None if record.matches(actual) else mismatch(record, actual)


def load_hashing(record: Record, load: Any) -> tuple[Any, BaseException | None,
                                                     IntegrityError | None]:
    """``load(reader)`` while the reader hashes the file: one read, as in ``torchverity.load``.

    Returns the object, the load's own exception (kept as raised) and the
    mismatch, if any. Only for loaders that run no code from the file.
    """
    obj, failure, actual = load_while_hashing(record.path, record.algo, load)
    bad = None if record.matches(actual) else mismatch(record, actual)
    return obj, failure, bad
