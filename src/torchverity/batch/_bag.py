"""The output folder as a BagIt bag: payload under ``data/``, ``manifest-sha256.txt`` beside it.

The manifest is written from the journal's digests (computed from the bytes
as they were written), in the sha256sum line format of ``torchverity.manifest``,
so ``sha256sum -c manifest-sha256.txt`` and BagIt validators both accept it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torchverity.digest import atomic_write_text
from torchverity.manifest import SHA256SUM_NAME, ManifestEntry, format_sha256sum

BAGIT_TXT = "bagit.txt"
BAG_INFO_TXT = "bag-info.txt"


def write_bag(out: Path, entries: Sequence[ManifestEntry]) -> Path:
    """Write the bag declaration, its payload summary and the payload manifest."""
    ordered = sorted(entries, key=lambda e: e.path.encode())
    octets = sum(e.size for e in ordered)
    files = {
        BAGIT_TXT: "BagIt-Version: 1.0\nTag-File-Character-Encoding: UTF-8\n",
        BAG_INFO_TXT: f"Payload-Oxum: {octets}.{len(ordered)}\n"
        "Bag-Software-Agent: torchverity batch\n",
        SHA256SUM_NAME: format_sha256sum(ordered),
    }
    # Each file is fsynced; done at once, the filesystem flushes them in one journal commit.
    with ThreadPoolExecutor(max_workers=len(files)) as pool:
        for future in [pool.submit(atomic_write_text, out / n, t) for n, t in files.items()]:
            future.result()
    return out / SHA256SUM_NAME
