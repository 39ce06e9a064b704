"""Output paths read back from a batch journal must stay inside ``--out``.

The journal is a file on disk like any other: damaged or edited, it could name
``../elsewhere``, an absolute path, or a path through a symlink. Every one is
refused when the journal is opened, before anything is read, deleted or written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from torchverity.errors import FormatError

DATA_DIR = "data"


def output_problem(rel: object) -> str | None:
    """Why ``rel`` is not a plain ``data/...`` path inside the output folder, or None."""
    if not isinstance(rel, str) or not rel:
        return "is not a path"
    if rel.startswith("/") or os.path.isabs(rel) or "\\" in rel or "\0" in rel:
        return "is absolute"
    parts = rel.split("/")
    if len(parts) < 2 or parts[0] != DATA_DIR:
        return f"is not under {DATA_DIR}/"
    if any(part in ("", ".", "..") for part in parts):
        return "leaves its folder ('..', '.' or an empty part)"
    return None


def check_outputs(journal: Path, out: Path, outputs: Iterable[object]) -> None:
    """Refuse a journal whose outputs could reach outside ``out`` (exit 2)."""
    for rel in outputs:
        why = output_problem(rel)
        if why is not None:
            raise _refused(journal, out, f"output path {rel!r} {why}")
    link = _first_symlink(out / DATA_DIR)
    if link is not None:
        raise _refused(journal, out, f"{link.relative_to(out)} is a symbolic link")


def _first_symlink(data: Path) -> Path | None:
    """A symlink at or under ``data``: outputs are only ever written as plain files."""
    if data.is_symlink():
        return data
    for folder, dirs, files in os.walk(data):
        for name in (*dirs, *files):
            if os.path.islink(os.path.join(folder, name)):
                return Path(folder, name)
    return None


def _refused(journal: Path, out: Path, detail: str) -> FormatError:
    return FormatError(
        f"{journal}: {detail}; nothing outside {out} is read, deleted or written",
        path=journal,
        hint="restore the journal from a backup, or rerun with --force to start the job "
             "again in this folder",
    )
