"""Watched writes: ``torch.save`` and ``safetensors.torch.save_file`` to a path.

Lightning (Trainer and Fabric) serializes a checkpoint into memory and copies
the bytes to the file, so it is watched one level up, where the path is
known: ``TorchCheckpointIO.save_checkpoint`` to a local path runs the real
``torch.save`` straight into the staged temp file (no copy in memory), and
``remove_checkpoint`` takes the checkpoint's records with it.

The real serializer writes into ``torchverity.save``'s machinery: a temp file
beside the target, every byte hashed on its way to disk, fsync, the sidecar
and meta.json staged as pending files, then the renames. A process killed at
any instant leaves the previous checkpoint and its records intact. Saves to
streams (``BytesIO``, sockets) pass straight through.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torchverity.protection._session import Session, active
from torchverity.protection._state import Event, caller_site, inside
from torchverity.protection._watch_load import MARK


def _target(f: Any) -> Path | None:
    if not isinstance(f, (str, os.PathLike)):
        return None
    target = Path(os.fspath(f))
    # Anything torch would fail on keeps torch's own error; a save through a
    # symbolic link keeps writing into the file it points to.
    usable = target.parent.is_dir() and not target.is_dir() and not target.is_symlink()
    return target if usable else None


def watch_torch_save(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        session = active()
        target = _target(f) if session is not None else None
        if session is None or target is None:
            return original(obj, f, *args, **kwargs)
        with inside():
            atomic_save(session, obj, target, "pt", "torch.save",
                        lambda writer: original(obj, writer, *args, **kwargs))
        return None

    setattr(save, MARK, original)
    return save


def watch_save_file(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_file(tensors: Any, filename: Any, metadata: Any = None) -> Any:
        session = active()
        target = _target(filename) if session is not None else None
        if session is None or target is None:
            return original(tensors, filename, metadata)
        import torchverity.checkpoint._safetensors as st

        with inside():
            payload = st.check_writable(tensors, target)
            atomic_save(session, payload, target, "safetensors", "safetensors.torch.save_file",
                        lambda writer: st.write_tensors(payload, writer, metadata))
        return None

    setattr(save_file, MARK, original)
    return save_file


def _local_path(path: Any) -> Path | None:
    """A local file path (``file://`` included); None for other file systems."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    text = os.fspath(path)
    text = text.removeprefix("file://")
    return None if "://" in text else Path(text)


def watch_checkpoint_io_save(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_checkpoint(self: Any, checkpoint: Any, path: Any,
                        storage_options: Any = None) -> Any:
        session = active()
        local = _local_path(path) if session is not None and storage_options is None else None
        if session is None or local is None:
            return original(self, checkpoint, path, storage_options)
        local.parent.mkdir(parents=True, exist_ok=True)  # as Lightning does
        target = _target(local)
        if target is None:
            return original(self, checkpoint, path, storage_options)
        import torch

        with inside():
            atomic_save(session, checkpoint, target, "pt", "TorchCheckpointIO.save_checkpoint",
                        lambda writer: torch.save(checkpoint, writer))
        return None

    setattr(save_checkpoint, MARK, original)
    return save_checkpoint


def watch_checkpoint_io_remove(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def remove_checkpoint(self: Any, path: Any) -> Any:
        result = original(self, path)
        local = _local_path(path) if active() is not None else None
        if local is not None and not local.exists():
            from torchverity.checkpoint import meta_path_for
            from torchverity.digest import ALGORITHMS, sidecar_path

            for record in [*(sidecar_path(local, a) for a in ALGORITHMS), meta_path_for(local)]:
                record.unlink(missing_ok=True)
        return result

    setattr(remove_checkpoint, MARK, original)
    return remove_checkpoint


def atomic_save(session: Session, payload: Any, target: Path, fmt: str, api: str,
                write: Callable[[Any], Any]) -> None:
    """``write(file)`` into a staged temp file; publish it with its sidecar (and meta.json)."""
    from torchverity.checkpoint import fingerprint
    from torchverity.checkpoint._atomic import _atomic_target, _HashingWriter, _StableMemory
    from torchverity.digest import DEFAULT_ALGO, new_hasher

    hasher = new_hasher(DEFAULT_ALGO)
    fingerprintable = _fingerprintable(payload)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchverity-hash") as pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchverity-fp") as fp_pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchverity-sync") as sync_pool, \
            _atomic_target(target) as staged:
        fp_future = (fp_pool.submit(fingerprint, payload, mode="exact", workers=1)
                     if fingerprintable else None)
        stable = _StableMemory(payload if fingerprintable else {})
        writer = _HashingWriter(staged.fd, hasher, stable, pool)
        try:
            write(writer)
            writer.flush()
        except Exception:
            if writer.error is not None:
                raise writer.error from None
            raise
        staged.flushing = sync_pool.submit(os.fsync, staged.fd)  # as torchverity.save does
        writer.finish()
        digest = hasher.hexdigest()
        _stage_records(staged, target, fmt, api, digest, writer.size,
                       fp_future.result() if fp_future is not None else None)
    session.emit(Event("saved", api, f"{api} wrote {target} atomically with its sidecar"
                       + (" and meta.json" if fp_future is not None else ""), os.fspath(target),
                       caller_site(),
                       {"algo": DEFAULT_ALGO, "digest": digest, "size": writer.size}), loud=False)


def _stage_records(staged: Any, target: Path, fmt: str, api: str, digest: str, size: int,
                   fp: Any) -> None:
    """The sidecar, meta.json when ``fp`` describes the content, and what they replace."""
    from torchverity.checkpoint import meta_path_for
    from torchverity.checkpoint._meta import meta_record
    from torchverity.digest import ALGORITHMS, DEFAULT_ALGO, format_sidecar_line, sidecar_path

    staged.companions[sidecar_path(target)] = format_sidecar_line(digest, target.name)
    meta_file = meta_path_for(target)
    # Records of another algorithm (and a meta.json this save cannot write)
    # describe the file being replaced.
    stale = tuple(sidecar_path(target, a) for a in ALGORITHMS if a != DEFAULT_ALGO)
    if fp is not None:
        record = meta_record(target, fmt, DEFAULT_ALGO, digest, size, fp, None, None,
                             {"saved_by": api})
        staged.companions[meta_file] = json.dumps(record, indent=2) + "\n"
    else:
        stale += (meta_file,)
    staged.stale = stale


def _fingerprintable(payload: Any) -> bool:
    """Whether meta.json can describe ``payload`` (tensors, containers, plain values)."""
    from torchverity.checkpoint._save_file import _check_fingerprintable
    from torchverity.errors import FormatError

    try:
        _check_fingerprintable(payload, Path("checkpoint"))
    except FormatError:
        return False
    return True
