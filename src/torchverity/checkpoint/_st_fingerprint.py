"""Fingerprints streamed from .safetensors files, and the files a checkpoint path names,
without torch: one small buffer per file, whatever the size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from torchverity.checkpoint._fp_record import (
    EXACT,
    Fingerprint,
    TensorDigest,
    from_entries,
    plain_tensor_hasher,
)

if TYPE_CHECKING:
    from torchverity.checkpoint._st_header import RawHeader
    from torchverity.digest import Hasher

# Below this, starting blake3's thread pool and splitting the work costs more than it saves.
THREADED_BYTES = 1 << 20


def checkpoint_files(path: str | os.PathLike[str]) -> tuple[list[Path], bool]:
    """The files of a checkpoint file, Hugging Face folder or index (shards in name order),
    and whether they are the shards of an index."""
    from torchverity.checkpoint._folders import resolve
    from torchverity.checkpoint._index import read_index

    target = resolve(path)
    if target.index is None:
        return [target.file], False
    return [target.folder / s for s in sorted(set(read_index(target.index).values()))], True


def safetensors_files(path: str | os.PathLike[str]) -> list[Path] | None:
    """The .safetensors files of a checkpoint file, Hugging Face folder or index (shards in
    name order); None when one of them is missing or not .safetensors."""
    from torchverity._formats import file_format

    files, _ = checkpoint_files(path)
    if all(f.is_file() and file_format(f) == "safetensors" for f in files):
        return files
    return None


def fingerprint_safetensors(path: Path, algo: str = EXACT, *, header: RawHeader | None = None,
                            whole: Hasher | None = None) -> Fingerprint:
    """Stream a .safetensors file's tensor bytes through their entry hashes (no torch).

    ``header`` is the file's parsed header when the caller has it; ``whole`` is also fed
    every byte of the file in order, header included, so one read gives the file's digest
    too (the header's layout checks leave no byte outside a tensor).
    """
    from torchverity.checkpoint._st_header import parse_header, stream_tensor_bytes

    header = header or parse_header(path)
    hashers = {e.name: plain_tensor_hasher(e.name, e.dtype_name, e.shape, e.nbytes, algo,
                                           threads=e.nbytes >= THREADED_BYTES)
               for e in header.entries}
    if whole is None:
        stream_tensor_bytes(path, header.entries,
                            lambda name, chunk: hashers[name].update(chunk))
    else:
        with open(path, "rb") as fh:
            whole.update(fh.read(header.data_start))
        stream_tensor_bytes(path, header.entries,
                            lambda name, chunk: _feed(hashers[name], whole, chunk))
    return from_entries(algo, [
        TensorDigest(e.name, e.dtype_name, e.shape, hashers[e.name].hexdigest())
        for e in header.entries
    ])


def _feed(tensor: Hasher, whole: Hasher, chunk: memoryview) -> None:
    tensor.update(chunk)
    whole.update(chunk)
