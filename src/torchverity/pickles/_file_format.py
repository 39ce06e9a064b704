"""What kind of checkpoint a file is, agreeing with the scan on pickles no magic announces.

:func:`torchverity._formats.file_format` knows a pickle by its PROTO opcode (``0x80``),
and torch's legacy format by the magic number its first pickle holds; protocols 0 and 1
have no PROTO, and a protocol-0 pickle is printable text. Such a file is one the scan
walks as a pickle, so inspect, fingerprint and load take it as one (``pt-legacy`` when
its first pickle is the magic number, else ``pickle``) instead of calling it no
checkpoint; a text file that every unpickler fails on before it runs anything is still
no checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchverity._formats import (
    FileFormat,
    broken_download,
    file_format,
    open_regular,
    text_sample,
)
from torchverity.errors import FormatError, InputError

# The scan's formats for a file whose bytes are read as a pickle stream from the start.
_PICKLE_FORMATS = frozenset({"pickle", "torch-legacy"})


def _walked_as_pickle(path: str) -> FileFormat | None:
    # Only for files no magic names: a .safetensors or zip file never imports the scanner.
    from torchverity.pickles._containers import scan_container
    from torchverity.pickles._source import Limits, PickleError

    try:
        container = scan_container(path, Limits())
    except (PickleError, OSError):  # no reading of it at all: the sniffer's answer stands
        return None
    if container.format not in _PICKLE_FORMATS or all(e.alternate for e in container.entries):
        return None
    return "pt-legacy" if container.format == "torch-legacy" else "pickle"


def checkpoint_format(path: str | os.PathLike[str]) -> FileFormat:
    """``file_format``, with a pickle the scan walks from the first byte as ``pt-legacy``
    (torch's legacy format) or ``pickle``."""
    try:
        return file_format(path)
    except FormatError:
        walked = _walked_as_pickle(os.fspath(path))
        if walked is not None:
            return walked
        raise


def text_download(path: Path) -> FormatError | None:
    """:func:`~torchverity._formats.broken_download` for a file under a weights name,
    text whose first byte is a pickle opcode included ("Not Found", "Internal Server
    Error"): that one is a broken download only when the scan shows every unpickler gives
    up on it before it calls anything; a protocol-0 pickle stays a pickle."""
    found = broken_download(path)
    if found is not None:
        return found
    try:
        with open_regular(path) as fh:
            if text_sample(fh.read(512)) is None:
                return None
    except (OSError, InputError):
        return None
    from torchverity.pickles._containers import scan_container  # text only: rare, and slower
    from torchverity.pickles._source import Limits, PickleError

    try:
        container = scan_container(os.fspath(path), Limits())
    except (PickleError, OSError, InputError):
        return None
    return broken_download(path, no_pickle=True) if container.format == "text" else None


# The scan's formats of a file read as pickles (joblib's included).
_SCANNED_PICKLES = frozenset({"torch-legacy", "pickle", "joblib"})


def named_format(fmt: str, scan: Any) -> str:
    """The format a file is reported as: the sniffer's ``fmt``, told apart by its ``scan``
    (or None) where bytes alone do not tell (TorchScript, pickles no magic announces)."""
    if scan is not None and scan.format == "torchscript":
        return "torchscript"  # a torch.jit.save archive: torch's zip layout, holding code
    if scan is not None and fmt in ("pt-legacy", "pickle") and scan.format in _SCANNED_PICKLES:
        # The scan reads the magic number however it is spelled; the sniffer by its bytes.
        return "pt-legacy" if scan.format == "torch-legacy" else "pickle"
    return fmt
