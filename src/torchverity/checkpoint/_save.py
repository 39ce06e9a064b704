"""torchverity.save: one file or a sharded folder, atomic, with its sidecar and meta.json."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchverity.checkpoint._meta import _json_ready
from torchverity.checkpoint._results import SaveReport
from torchverity.checkpoint._save_file import save_file
from torchverity.digest import (
    DEFAULT_ALGO,
    check_algo,
)


def _writing_rank(all_ranks: bool) -> bool:
    dist = torch.distributed
    if all_ranks or not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == 0


def save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    meta: Mapping[str, Any] | None = None,
    seed: int | None = None,
    data: str | os.PathLike[str] | None = None,
    algo: str = DEFAULT_ALGO,
    all_ranks: bool = False,
    shard_bytes: int | None = None,
    shard_format: str = "safetensors",
    certification: Mapping[str, Any] | None = None,
) -> SaveReport:
    """Atomically save ``obj`` (.pt, or .safetensors for flat tensor maps) with sidecar and meta.

    ``meta`` is your own JSON-ready metadata (epoch, step, metrics, config).
    ``data`` names the training data: a file (its digest is recorded) or a
    folder (its manifest root). Under torch.distributed only rank 0 writes
    unless ``all_ranks=True`` (then give each rank its own path). With
    ``shard_bytes`` ``path`` is a folder that receives Hugging Face style
    shards (``shard_format`` safetensors or pt) and an index. ``certification`` is a
    training guard's at-rest verification of what is saved (single files).
    """
    target = Path(path)
    check_algo(algo)
    user_meta = _json_ready(meta, "meta")
    if not _writing_rank(all_ranks):
        return SaveReport(os.fspath(target), algo, "", "", None, None, written=False)
    if shard_bytes is not None:
        from torchverity.checkpoint._sharded import save_sharded

        return save_sharded(obj, target, shard_bytes=shard_bytes, shard_format=shard_format,
                            meta=meta, seed=seed, data=data, algo=algo)
    return save_file(obj, target, user_meta=user_meta, seed=seed, data=data, algo=algo,
                     certification=_json_ready(certification, "certification"))
