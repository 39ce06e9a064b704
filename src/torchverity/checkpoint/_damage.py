"""Which tensors of a damaged file changed: the file's fingerprint against its meta.json."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchverity.checkpoint._file_fingerprint import fingerprint_file
from torchverity.checkpoint._fingerprint import exact_algo
from torchverity.checkpoint._meta import _meta_fingerprint, meta_path_for, read_meta


def _locate_pt_damage(p: Path, meta: Mapping[str, Any] | None) -> list[str]:
    return locate_damage(p, meta) if meta is not None else []


def locate_damage(path: str | os.PathLike[str],
                  meta: Mapping[str, Any] | None = None) -> list[str]:
    """Name the tensors of a damaged checkpoint that differ from its meta.json.

    Used to say *where* a file whose digest no longer matches was hit. Reads
    .safetensors by streaming and .pt through PyTorch's restricted
    ``weights_only`` unpickler with memory-mapped storages, so nothing from
    the file runs. Returns ``[]`` when there is no usable meta.json or the
    damage hit the container itself (then no tensor can be named).
    """
    p = Path(path)
    try:
        meta = meta if meta is not None else read_meta(p)
        recorded = _meta_fingerprint(meta, meta_path_for(p))
        return recorded.differing(fingerprint_file(p, mode=exact_algo(recorded)))
    except Exception:  # a damaged pickle or header: the file-level verdict stands alone
        return []
