"""Output paths read back from a batch journal must stay inside ``--out``.

The journal is a file on disk like any other: damaged or edited, it could name
``../elsewhere``, an absolute path, or a path through a symlink. Every one is
refused when the journal is opened, before anything is read, deleted or written;
so is a folder at an output's name or a file where a folder of outputs belongs.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable, Iterator
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
    """Refuse a journal whose outputs could reach outside ``out``, or whose output names are
    taken by something other than a file (exit 2)."""
    names: set[str] = set()
    for rel in outputs:
        why = output_problem(rel)
        if why is not None:
            raise _refused(journal, out, f"output path {rel!r} {why}")
        names.add(str(rel))
    found = _first_misfit(out, names)
    if found is not None:
        raise _refused(journal, out, found, hint="move it out of the folder (a run writes "
                       "only plain files there), then rerun the same command")


def _first_misfit(out: Path, names: set[str]) -> str | None:
    """A symlink at or under ``data/`` (outputs are only ever written as plain files), a folder
    at an output's name, or a file where a folder of outputs belongs."""
    data = out / DATA_DIR
    if data.is_symlink():
        return f"{DATA_DIR} is a symbolic link"
    if data.exists() and not data.is_dir():
        return f"{DATA_DIR} is a file where the folder of outputs belongs"
    folders = {parent for name in names for parent in _parents(name)}
    stack = [(data, DATA_DIR)] if data.is_dir() else []
    while stack:
        folder, prefix = stack.pop()
        try:
            entries = list(os.scandir(folder))  # file types from the listing: no stat per file
        except OSError as exc:
            return f"{prefix} cannot be listed ({exc.strerror or exc})"
        for entry in entries:
            rel = f"{prefix}/{entry.name}"
            if entry.is_symlink():
                return f"{rel} is a symbolic link"
            if entry.is_dir():
                if rel in names:
                    return f"{rel} is a folder where an output file belongs"
                stack.append((Path(entry.path), rel))
            elif rel in folders:
                return f"{rel} is a file where a folder of outputs belongs"
    return None


def _parents(name: str) -> Iterator[str]:
    """``data/a/b/x.out`` -> ``data/a/b``, ``data/a`` (not ``data`` itself)."""
    parent = posixpath.dirname(name)
    while parent != DATA_DIR and parent:
        yield parent
        parent = posixpath.dirname(parent)


def _refused(journal: Path, out: Path, detail: str,
             hint: str = "restore the journal from a backup, or rerun with --force to start "
             "the job again in this folder") -> FormatError:
    return FormatError(
        f"{journal}: {detail}; nothing outside {out} is read, deleted or written",
        path=journal,
        hint=hint,
    )
