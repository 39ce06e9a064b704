"""The output folder as a BagIt bag: payload under ``data/``, ``manifest-sha256.txt`` beside it.

The manifest is written from the journal's digests (computed from the bytes
as they were written), in the sha256sum line format of ``torchverity.manifest``,
so ``sha256sum -c manifest-sha256.txt`` and BagIt validators both accept it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torchverity.digest import atomic_write_text
from torchverity.manifest import SHA256SUM_NAME, ManifestEntry, format_sha256sum

BAGIT_TXT = "bagit.txt"
BAG_INFO_TXT = "bag-info.txt"


def write_bag(out: Path, entries: Sequence[ManifestEntry]) -> Path:
    """Write the bag declaration, its payload summary and the payload manifest."""
    ordered = sorted(entries, key=lambda e: e.path.encode())
    atomic_write_text(out / BAGIT_TXT, "BagIt-Version: 1.0\nTag-File-Character-Encoding: UTF-8\n")
    octets = sum(e.size for e in ordered)
    atomic_write_text(
        out / BAG_INFO_TXT,
        f"Payload-Oxum: {octets}.{len(ordered)}\nBag-Software-Agent: torchverity batch\n",
    )
    manifest = out / SHA256SUM_NAME
    atomic_write_text(manifest, format_sha256sum(ordered))
    return manifest
