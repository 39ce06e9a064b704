"""What a file is, from its bytes: the torch-free sniffer every reader uses."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Literal

from torchverity.errors import (
    FormatError,
    InputError,
)

FileFormat = Literal["pt", "pt-legacy", "safetensors"]
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on its JSON header


def is_safetensors(path: Path) -> bool:
    """Cheap sniff: a plausible header length followed by ``{``."""
    with open(path, "rb") as fh:
        head = fh.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return n <= MAX_HEADER_BYTES


def file_format(path: str | os.PathLike[str]) -> FileFormat:
    """What kind of checkpoint a file is, from its bytes (never its name alone)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a folder", path=p,
                         hint=f"folders load through their *.index.json: torchverity inspect {p}")
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(16)
    except FileNotFoundError:
        raise InputError(f"{p}: no such file", path=p, hint="check the path") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read: {exc.strerror or exc}", path=p) from None
    if size == 0:
        raise FormatError(f"{p}: file is empty (0 bytes): not a checkpoint", path=p,
                          hint="the save that wrote it was probably interrupted; "
                               "restore the previous checkpoint")
    if head.startswith(b"PK\x03\x04"):
        return "pt"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pt-legacy"
    if is_safetensors(p):
        return "safetensors"
    raise FormatError(
        f"{p}: not a checkpoint (neither a PyTorch zip/pickle nor .safetensors; "
        f"starts with {head[:8]!r})", path=p,
        hint=f"check the path; torchverity inspect {p} shows what torchverity sees",
    )
