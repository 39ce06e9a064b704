"""The fingerprint of a checkpoint file or sharded folder, read without running code from it."""

from __future__ import annotations

import os

from torchverity._tensors import dtype_name
from torchverity.checkpoint._fingerprint import (
    DEVICE,
    Fingerprint,
    Mode,
    TensorDigest,
    _resolve_mode,
    fingerprint,
    from_entries,
    tensor_hasher,
)


def fingerprint_file(path: str | os.PathLike[str], *,
                     mode: Mode | str = "exact") -> Fingerprint:
    """Fingerprint a checkpoint file or sharded folder without executing code from it.

    A .safetensors file streams each tensor's bytes through its hash with one
    small buffer (memory stays flat whatever the size); .pt files go through
    PyTorch's restricted ``weights_only`` unpickler with memory-mapped storages.
    """
    from pathlib import Path

    import torchverity.checkpoint._safetensors as st
    from torchverity._formats import file_format
    from torchverity.checkpoint._read import read_unverified

    p = Path(path)
    algo = _resolve_mode(mode, [])
    if algo != DEVICE and p.is_file() and file_format(p) == "safetensors":
        header = st.read_header(p)
        hashers = {e.name: tensor_hasher(e.name, e.dtype, e.shape, algo, threads=True)
                   for e in header.entries}
        st.iter_tensor_bytes(p, header, lambda name, chunk: hashers[name].update(chunk))
        return from_entries(algo, [
            TensorDigest(e.name, dtype_name(e.dtype), e.shape, hashers[e.name].hexdigest())
            for e in header.entries
        ])
    return fingerprint(read_unverified(p), mode=mode)
