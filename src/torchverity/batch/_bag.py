"""The output folder as a BagIt bag: payload under ``data/``, ``manifest-sha256.txt`` beside it.

The manifest is written from the journal's digests (computed from the bytes
as they were written), in the sha256sum line format of ``torchverity.manifest``,
so ``sha256sum -c manifest-sha256.txt`` and BagIt validators both accept it.
``bag_problems`` reads the two tag files back the way a BagIt validator does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torchverity.digest import atomic_write_text
from torchverity.errors import BatchError, TorchVerityError
from torchverity.manifest import SHA256SUM_NAME, ManifestEntry, format_sha256sum

BAGIT_TXT = "bagit.txt"
BAG_INFO_TXT = "bag-info.txt"
MAX_TAG_FILE = 1 << 20  # torchverity writes about 100 bytes; a validator reads it whole
_TAG = re.compile(r"([^:\s][^:]*):[ \t]*(.*)")


def _payload_oxum(entries: Sequence[ManifestEntry]) -> str:
    return f"{sum(e.size for e in entries)}.{len(entries)}"


def write_bag(out: Path, entries: Sequence[ManifestEntry]) -> Path:
    """Write the bag declaration, its payload summary and the payload manifest."""
    ordered = sorted(entries, key=lambda e: e.path.encode())
    files = {
        BAGIT_TXT: "BagIt-Version: 1.0\nTag-File-Character-Encoding: UTF-8\n",
        BAG_INFO_TXT: f"Payload-Oxum: {_payload_oxum(ordered)}\n"
        "Bag-Software-Agent: torchverity batch\n",
        SHA256SUM_NAME: format_sha256sum(ordered),
    }
    # Each file is fsynced; done at once, the filesystem flushes them in one journal commit.
    with ThreadPoolExecutor(max_workers=len(files)) as pool:
        for future in [pool.submit(write_text, out, n, t) for n, t in files.items()]:
            future.result()
    return out / SHA256SUM_NAME


def write_text(out: Path, name: str, text: str) -> None:
    """Replace the small text file ``out/name`` atomically (fsynced), or say what is in the way."""
    try:
        atomic_write_text(out / name, text)
    except TorchVerityError as exc:
        raise BatchError(
            exc.message, out=out,
            hint=f"move away what is at {out / name} (a folder?), or free space or fix "
            "permissions in the --out folder, then rerun the same command",
        ) from None


def bag_problems(out: Path, entries: Sequence[ManifestEntry]) -> list[tuple[str, str]]:
    """(tag file, what is wrong) for ``bagit.txt`` and ``bag-info.txt`` beside a manifest."""
    problems = []
    for name, check in ((BAGIT_TXT, _bagit_problem),
                        (BAG_INFO_TXT, lambda tags: _info_problem(tags, entries))):
        tags = _read_tags(out / name)
        problem = tags if isinstance(tags, str) else check(tags)
        if problem:
            problems.append((name, problem))
    return problems


def _read_tags(path: Path) -> dict[str, list[str]] | str:
    """A BagIt tag file's ``Label: value`` lines (continued by indented lines), or what is wrong."""
    if not path.is_file():
        return "is not a file" if path.exists() else "is missing beside manifest-sha256.txt"
    if path.stat().st_size > MAX_TAG_FILE:
        return f"is larger than {MAX_TAG_FILE} bytes: not a tag file"
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot be read as UTF-8 text ({exc})"
    tags: dict[str, list[str]] = {}
    last: list[str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if line[:1] in (" ", "\t") and last is not None:
            last[-1] += " " + line.strip()
            continue
        match = _TAG.fullmatch(line)
        if match is None:
            return f"line {number} is not 'Label: value'"
        last = tags.setdefault(match[1].strip(), [])
        last.append(match[2].strip())
    return tags


def _bagit_problem(tags: dict[str, list[str]]) -> str | None:
    if not re.fullmatch(r"\d+\.\d+", " ".join(tags.get("BagIt-Version", []))):
        return "does not declare one BagIt-Version"
    if tags.get("Tag-File-Character-Encoding") != ["UTF-8"]:
        return "does not declare Tag-File-Character-Encoding: UTF-8"
    return None


def _info_problem(tags: dict[str, list[str]], entries: Sequence[ManifestEntry]) -> str | None:
    wanted = _payload_oxum(entries)
    found = tags.get("Payload-Oxum")
    if found != [wanted]:
        return (f"Payload-Oxum is {' '.join(found) if found else 'missing'}; the committed "
                f"outputs make {wanted} (bytes.count)")
    return None
