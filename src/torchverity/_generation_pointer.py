"""The pointer of a folder kept in generations: ``torchverity.current.json`` names the
generation subfolder that is the checkpoint now, and the digest of that generation's
manifest (docs/formats/distributed.md). Torch-free: ``verify`` reads it.

A save writes a whole new generation beside the live one, then replaces the pointer
with one rename: a reader sees the old generation or the new one, never a mix.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from torchverity.errors import FormatError, IntegrityError

POINTER_NAME = "torchverity.current.json"
POINTER_FORMAT = "torchverity-generation-pointer"
POINTER_VERSION = 1
MANIFEST_IN_GENERATION = "torchverity.manifest.json"
SHARDS_IN_GENERATION = "torchverity.shards.json"  # a DCP generation's fingerprints
GENERATION = re.compile(r"^gen-(\d{6,})$")
_HINT = "restore the folder from a copy, or save the checkpoint again"


def generation_name(number: int) -> str:
    return f"gen-{number:06d}"


def pointer_record(generation: str, manifest_bytes: bytes) -> str:
    """The pointer's text (its only writer)."""
    return json.dumps({
        "format": POINTER_FORMAT, "version": POINTER_VERSION, "current": generation,
        "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
    }, indent=2) + "\n"


def has_pointer(root: Path) -> bool:
    return (root / POINTER_NAME).is_file()


def live_generation(root: Path) -> Path:
    """The generation folder the pointer names, after checking it and its manifest's digest."""
    pointer = root / POINTER_NAME
    data = _read_pointer(pointer)
    current = root / data["current"]
    manifest = current / MANIFEST_IN_GENERATION
    try:
        actual = hashlib.sha256(manifest.read_bytes()).hexdigest()
    except OSError as exc:
        raise IntegrityError(
            f"{pointer}: names {data['current']}, whose manifest cannot be read "
            f"({exc.strerror or exc}): the live checkpoint is missing", path=pointer,
            hint=_HINT) from None
    if actual != data["manifest_sha256"]:
        raise IntegrityError(
            f"{pointer}: the manifest of {data['current']} is not the one the pointer records "
            f"(sha256 {actual}, recorded {data['manifest_sha256']})", path=pointer,
            expected=data["manifest_sha256"], actual=actual, hint=_HINT)
    return current


def _read_pointer(pointer: Path) -> dict[str, Any]:
    try:
        data = json.loads(pointer.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{pointer}: not a readable pointer record: {exc}", path=pointer,
                          hint=_HINT) from None
    ok = (isinstance(data, dict) and data.get("format") == POINTER_FORMAT
          and data.get("version") == POINTER_VERSION
          and isinstance(data.get("current"), str) and GENERATION.match(data["current"])
          and isinstance(data.get("manifest_sha256"), str))
    if not ok:
        raise FormatError(f"{pointer}: not a {POINTER_FORMAT} v{POINTER_VERSION} record",
                          path=pointer, hint=_HINT)
    return data


def generation_number(name: str) -> int | None:
    match = GENERATION.match(name)
    return int(match.group(1)) if match else None


def pointed_name(root: Path) -> str | None:
    """The generation the pointer names (unchecked), or None with no readable pointer."""
    pointer = root / POINTER_NAME
    if not pointer.is_file():
        return None
    try:
        return str(_read_pointer(pointer)["current"])
    except FormatError:
        return None
