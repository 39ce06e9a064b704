"""One checkpoint file written atomically: torch serializes, one thread hashes the bytes behind
it, one fingerprints the tensors; the sidecar and meta.json are published with the file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import torchverity.checkpoint._safetensors as st
from torchverity._tensors import iter_leaves
from torchverity.checkpoint._atomic import (
    SYNC_LANE,
    SYNC_WORKERS,
    _atomic_target,
    _HashingWriter,
    _StableMemory,
)
from torchverity.checkpoint._fingerprint import (
    fingerprint,
)
from torchverity.checkpoint._hashing_reader import lane
from torchverity.checkpoint._meta import _data_record, meta_path_for, meta_record
from torchverity.checkpoint._results import SaveReport
from torchverity.digest import (
    ALGORITHMS,
    format_sidecar_line,
    new_hasher,
    sidecar_path,
)
from torchverity.errors import (
    FormatError,
)

log = logging.getLogger("torchverity.checkpoint")


def save_file(obj: Any, target: Path, *, user_meta: Any, seed: int | None,
              data: str | os.PathLike[str] | None, algo: str,
              certification: Any = None) -> SaveReport:
    """Write one checkpoint file (``.safetensors`` for flat tensor maps, else ``.pt``)."""
    fmt = "safetensors" if target.suffix == ".safetensors" else "pt"
    payload = st.check_writable(obj, target) if fmt == "safetensors" else obj
    _check_fingerprintable(payload, target)
    data_record = _data_record(data, algo) if data is not None else None
    sidecar, meta_file = sidecar_path(target, algo), meta_path_for(target)
    hasher = new_hasher(algo)
    with _atomic_target(target) as staged:
        # Three threads: torch serializes and writes, one thread hashes the
        # written bytes behind it, one fingerprints the tensors in memory.
        fp_future = lane("fingerprint").submit(fingerprint, payload, mode="exact", workers=1)
        writer = _HashingWriter(staged.fd, hasher, _StableMemory(payload), lane("save-hash"))
        try:
            if fmt == "safetensors":
                st.write_tensors(payload, writer)
            else:
                torch.save(payload, writer)  # type: ignore[arg-type]
            writer.flush()
        except Exception:
            writer.drain()  # no hash may read the payload's memory after we return
            if writer.error is not None:
                raise writer.error from None
            raise
        # The disk flush starts while the hashes catch up and meta.json is
        # built; the fsync in _atomic_target then finds little left to do.
        staged.flushing = lane(SYNC_LANE, SYNC_WORKERS).submit(os.fsync, staged.fd)
        writer.finish()
        digest, fp = hasher.hexdigest(), fp_future.result()
        record = meta_record(target, fmt, algo, digest, writer.size, fp, seed, data_record,
                              user_meta, certification)
        staged.companions[sidecar] = format_sidecar_line(digest, target.name)
        staged.companions[meta_file] = json.dumps(record, indent=2) + "\n"
        # A sidecar of another algorithm describes the file being replaced.
        staged.stale = tuple(sidecar_path(target, a) for a in ALGORITHMS if a != algo)
    log.info("saved %s (%s %s, fingerprint %s)", target, algo, digest, fp.root)
    return SaveReport(os.fspath(target), algo, digest, fp.root, os.fspath(sidecar),
                      os.fspath(meta_file), writer.size)



def _check_fingerprintable(payload: Any, target: Path) -> None:
    """Refuse what the fingerprint (and a weights_only load) cannot hold, before writing."""
    whole = _whole_object(payload, "")
    if whole is not None:
        name, kind = whole
        raise FormatError(
            f"cannot save {target}: '{name or '<root>'}' is a whole {kind} object, which only "
            "an unsafe full-pickle load can read back", path=target,
            hint=f"save its state_dict() instead (e.g. {{'{name or 'model'}': "
                 f"{name.rsplit('.', 1)[-1] or 'model'}.state_dict()}})",
        )
    try:
        for _ in iter_leaves(payload):
            pass
    except FormatError as exc:
        raise FormatError(
            f"cannot save {target}: {exc.message}", path=target,
            hint="save tensors, state_dicts and plain values (what torch.load(weights_only="
                 "True) reads back); put other objects in meta=",
        ) from None


def _whole_object(obj: Any, prefix: str) -> tuple[str, str] | None:
    """The first module or optimizer object inside ``obj`` (not its state_dict)."""
    if isinstance(obj, torch.nn.Module):
        return prefix, "torch.nn.Module"
    if isinstance(obj, torch.optim.Optimizer):
        return prefix, "torch.optim.Optimizer"
    if isinstance(obj, Mapping):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = _whole_object(value, f"{prefix}.{key}" if prefix else str(key))
        if found:
            return found
    return None
