"""Crash-safe publication of ``torch.distributed.checkpoint`` folders.

Each ``save_dcp`` writes a whole new generation (``ROOT/gen-NNNNNN/``: the DCP
files, their fingerprints and manifest) beside the live one, then rank 0
replaces ``ROOT/torchverity.current.json`` with one rename: at every instant
the folder holds the previous checkpoint or the new one, whole and verified.
The next save removes generations no pointer names and temp files of dead
processes; ``load_dcp`` reads only the generation the pointer names. A folder
without a pointer (written before generations) is read as one flat checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path

from torchverity._generation_pointer import (
    POINTER_NAME,
    generation_name,
    generation_number,
    has_pointer,
    live_generation,
    pointed_name,
    pointer_record,
)
from torchverity.digest import atomic_write_text, fsync_path
from torchverity.distributed._comm import Comm, all_gather_json
from torchverity.errors import CheckpointWriteError, TorchVerityError
from torchverity.manifest import MANIFEST_NAME

_REASONS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied"}


def data_folder(root: Path) -> Path:
    """Where the live checkpoint's files are: the generation the pointer names, or ``root``."""
    return live_generation(root) if has_pointer(root) else root


def is_temp(rel: str) -> bool:
    """A temp file of an unfinished write: never part of a checkpoint."""
    name = rel.rsplit("/", 1)[-1]
    return name.startswith(".") and ".tmp-" in name


def begin(c: Comm, root: Path) -> Path:
    """Rank 0 sweeps what killed saves left and makes the new generation's folder."""
    name, error = None, None
    if c.index == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            sweep(root, pointed_name(root))
            used = [generation_number(p.name) or 0 for p in root.iterdir()]
            name = generation_name(max([0, *used]) + 1)
            (root / name).mkdir()
        except OSError as exc:
            error = _reason(exc)
    shared = all_gather_json(c, {"name": name, "error": error}, "the new checkpoint folder")[0]
    if shared["error"]:
        raise _write_error(root, shared["error"])
    return root / shared["name"]


def publish(root: Path, generation: Path) -> None:
    """Rank 0: make the generation durable, switch the pointer to it, drop the others."""
    try:
        fsync_path(generation)
        manifest = (generation / MANIFEST_NAME).read_bytes()
        atomic_write_text(root / POINTER_NAME, pointer_record(generation.name, manifest))
        fsync_path(root)
    except OSError as exc:
        raise _write_error(root, _reason(exc)) from None
    except TorchVerityError as exc:
        raise _write_error(root, exc.message) from None
    sweep(root, generation.name)


def failed(c: Comm, root: Path, generation: Path, exc: BaseException) -> CheckpointWriteError:
    """The error every rank raises when the DCP write failed; rank 0 frees the generation."""
    if c.index == 0:
        shutil.rmtree(generation, ignore_errors=True)
    return _write_error(root, _reason(exc))


def sweep(root: Path, live: str | None) -> None:
    """Remove generations other than ``live`` and root temp files of dead processes."""
    for entry in _entries(root):
        if entry.is_dir() and generation_number(entry.name) is not None and entry.name != live:
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.is_file() and _dead_temp(entry.name):
            with contextlib.suppress(OSError):
                entry.unlink()


def _entries(root: Path) -> list[Path]:
    try:
        return sorted(root.iterdir())
    except OSError:
        return []


def _dead_temp(name: str) -> bool:
    from torchverity.checkpoint._generations import dead_temp

    return is_temp(name) and dead_temp(name)


def _reason(exc: BaseException) -> str:
    """Why a write failed, from the OSError inside (DCP wraps each rank's failure)."""
    seen: list[BaseException] = [exc]
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        # DCP keeps each rank's failure as (exception, traceback summary)
        seen += [inner for f in failures.values()
                 if isinstance(inner := f[0] if isinstance(f, tuple) else f, BaseException)]
    for item in list(seen):
        seen += [x for x in (item.__cause__, item.__context__) if x is not None]
    for item in seen:
        if isinstance(item, OSError) and item.errno in _REASONS:
            return _REASONS[item.errno]
    text = str(exc)
    if "No space left" in text:
        return "the disk is full"
    if "Read-only file system" in text:
        return "the file system is read-only"
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _write_error(root: Path, reason: str) -> CheckpointWriteError:
    intact = has_pointer(root) or (root / MANIFEST_NAME).is_file()
    previous = (f"the previous checkpoint in {root} is intact and still loads" if intact
                else f"no checkpoint was created in {root}")
    return CheckpointWriteError(
        f"cannot save the distributed checkpoint {root}: {reason}; {previous}",
        path=root, reason=reason, previous_intact=intact,
        hint="free space or fix the folder's permissions, then save again",
    )

