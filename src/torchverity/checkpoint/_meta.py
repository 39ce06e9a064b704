"""The meta.json record beside a checkpoint: environment, data digest, fingerprint, caller's
metadata (docs/formats/checkpoint.md).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchverity.checkpoint._fp_record import (
    Fingerprint,
)
from torchverity.checkpoint._records import (
    META_FORMAT,
    META_SUFFIX,
    META_VERSION,
    meta_path_for,
)
from torchverity.checkpoint._records import (
    read_meta_file as _read_meta_file,
)
from torchverity.digest import (
    digest_file,
)
from torchverity.errors import (
    FormatError,
    InputError,
    UsageError,
)


def _json_ready(value: Any, what: str) -> Any:
    if value is None:
        return None
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{what} must be JSON-ready (numbers, strings, lists, dicts): {exc}",
                         hint="convert tensors with .item() or .tolist() first") from None
    return value


def _data_record(data: str | os.PathLike[str], algo: str) -> dict[str, Any]:
    p = Path(data)
    if p.is_file():
        d = digest_file(p, algo)
        return {"path": os.fspath(p), "kind": "file", "algo": algo, "digest": d.hexdigest,
                "size": d.size}
    if p.is_dir():
        from torchverity.manifest import build_manifest

        m = build_manifest(p, algo)
        return {"path": os.fspath(p), "kind": "manifest", "algo": algo, "digest": m.root,
                "files": len(m.entries)}
    raise InputError(f"data={os.fspath(p)!r}: no such file or folder", path=p,
                     hint="pass the training data file or folder whose digest to record")


def environment() -> dict[str, Any]:
    """Versions and platform recorded in every meta.json."""
    import torch  # only savers call this: reading a meta.json stays torch-free

    from torchverity import __version__

    cuda = torch.version.cuda
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "torchverity": __version__,
        "torch": torch.__version__,
        "cuda": cuda,
        "cudnn": cudnn,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git_commit(os.getcwd()),
    }


@functools.lru_cache(maxsize=8)
def _git_commit(cwd: str) -> str | None:
    """HEAD of the repository around ``cwd``, asked once per folder: a process runs
    the code it imported, whatever later commits do to the checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=False, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def meta_record(target: Path, fmt: str, algo: str, digest: str, size: int, fp: Fingerprint,
                 seed: int | None, data: dict[str, Any] | None, user: Any,
                 certification: Any = None) -> dict[str, Any]:
    """The ``FILE.meta.json`` document (docs/formats/checkpoint.md); its only writer.
    ``certification``: a training guard's at-rest verification of what was saved."""
    record = {
        "format": META_FORMAT,
        "version": META_VERSION,
        "file": target.name,
        "file_format": fmt,
        "size": size,
        "digest": {"algo": algo, "hex": digest},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment(),
        "seed": seed,
        "data": data,
        "fingerprint": fp.to_dict(),
        "user": user,
    }
    if certification is not None:
        record["certification"] = certification
    return record


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check ``FILE.meta.json`` (pass the checkpoint or the meta file)."""
    p = Path(path)
    return _read_meta_file(p if p.name.endswith(META_SUFFIX) else meta_path_for(p))


def _meta_fingerprint(meta: Mapping[str, Any], mp: Path) -> Fingerprint:
    try:
        return Fingerprint.from_dict(meta["fingerprint"])
    except (KeyError, TypeError, ValueError, AttributeError, FormatError) as exc:
        raise FormatError(f"{mp}: fingerprint record is damaged: {exc}", path=mp,
                          hint="restore meta.json, or re-save the checkpoint") from None


def certification_doubts(cert: Mapping[str, Any]) -> list[str]:
    """Why a training guard's certification of a checkpoint says uncertified, in words."""
    verified = cert.get("verified") or {}
    why = []
    if cert.get("changed"):
        why.append(f"changed at rest: {', '.join(cert['changed'])}")
    for u in cert.get("unresolved") or []:
        why.append(f"unresolved {u['kind']} at step {u['step']}"
                   + (f" in {', '.join(u['suspects'])}" if u.get("suspects") else ""))
    if verified.get("at_rest") == "unavailable":
        why.append("no at-rest verification was possible")
    return why
