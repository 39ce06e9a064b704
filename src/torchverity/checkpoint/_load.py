"""torchverity.load: the digest checked as the file is read, weights_only, the fingerprint
compared with meta.json.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from torchverity.checkpoint._load_file import _load_file
from torchverity.checkpoint._model_fit import check_against_model
from torchverity.checkpoint._results import CheckpointWarning, LoadReport, SidecarPolicy
from torchverity.errors import (
    UsageError,
)


def load(
    path: str | os.PathLike[str],
    *,
    map_location: Any = "cpu",
    model: torch.nn.Module | None = None,
    sidecar: SidecarPolicy = "warn",
    trust_sha256: str | None = None,
    with_report: bool = False,
    mmap: bool = False,
    recheck_tensors: bool = False,
) -> Any:
    """Load a checkpoint (file or HF-style sharded folder) after verifying it.

    Returns the object, or ``(obj, LoadReport)`` with ``with_report=True``.
    With ``model`` the state is checked against it (all problems at once) and
    loaded into it. The file is hashed as it is read (one pass); when its
    digest is the one meta.json recorded with the fingerprint, that digest
    vouches for the content and the tensors are not hashed a second time:
    ``recheck_tensors=True`` hashes them anyway, which also catches a fault in
    this machine's memory during the load.
    """
    if sidecar not in ("warn", "require", "ignore"):
        raise UsageError(f"unknown sidecar policy '{sidecar}'", hint="use warn, require or ignore")
    p = Path(path)
    if p.is_dir():
        from torchverity.checkpoint._sharded import load_sharded

        obj, report = load_sharded(p, map_location=map_location, sidecar=sidecar, mmap=mmap,
                                   recheck_tensors=recheck_tensors)
    else:
        obj, report = _load_file(p, map_location, sidecar, trust_sha256, mmap, recheck_tensors)
    if model is not None:
        check_against_model(obj, model, p)
        report = _replace(report, model_checked=True)
    for text in report.warnings:
        warnings.warn(text, CheckpointWarning, stacklevel=2)
    return (obj, report) if with_report else obj


def _replace(report: LoadReport, **changes: Any) -> LoadReport:
    import dataclasses

    return dataclasses.replace(report, **changes)
