"""What ``diff``, ``inspect`` and ``fingerprint`` read before they open anything: each entry
of a checkpoint path listed without torch, tensors as (dtype, shape, digest of their bytes),
plain values as they are.

.safetensors files are listed from their headers; torch zip checkpoints (``torch.save``'s
default format) from their pickle, walked inertly (:mod:`torchverity.pickles._listing`),
with each tensor's bytes hashed straight from its stored record. A contiguous tensor's
digest is its fingerprint entry, the one its .safetensors copy gets, so the two formats
compare without torch too. Any other file (legacy pickles, TorchScript archives, a pickle
naming more than plain state-dict types) is not listed: the caller then loads it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchverity.checkpoint._diff_result import Status, TensorDiff, plain_diff
from torchverity.checkpoint._fp_record import (
    EXACT,
    Fingerprint,
    TensorDigest,
    from_entries,
    plain_tensor_hasher,
    value_digest,
)
from torchverity.checkpoint._st_fingerprint import THREADED_BYTES, checkpoint_files
from torchverity.errors import TorchVerityError


@dataclass(frozen=True)
class Where:
    """Where a tensor's elements are in a file: ``begin`` (absolute) and, for a view
    that is not laid out in row-major order, its ``strides`` in elements."""

    path: Path
    begin: int
    strides: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Listed:
    """A tensor: its dtype, shape and the digest of its bytes (and where they are, which
    does not take part in comparing two listings)."""

    dtype: str
    shape: tuple[int, ...]
    digest: str
    where: Where | None = field(default=None, compare=False)


@dataclass(frozen=True)
class _Span:
    """Where one tensor's bytes lie in its file."""

    name: str
    begin: int
    nbytes: int


# name -> a Listed tensor, or a plain value (None, bool, int, float, str)
Listing = dict[str, Any]


def listing(obj: Any, algo: str = EXACT, *, canonical: bool = False) -> Listing | None:
    """The entries of the checkpoint at path ``obj``, listed without torch, digests made
    with ``algo``; None when ``obj`` is a loaded object, or a file or shard cannot be
    listed this way. A non-contiguous view's digest covers the bytes its elements span
    and its strides (one read, no copy), or with ``canonical`` its elements gathered in
    order (with numpy): its fingerprint entry."""
    from torchverity._formats import file_format

    if not isinstance(obj, (str, os.PathLike)):
        return None
    try:
        files, sharded = checkpoint_files(obj)
        merged: Listing = {}
        for f in files:  # later shards win a name two shards share, as when loading
            fmt = file_format(f) if f.is_file() else None
            listed = (_safetensors(f, algo) if fmt == "safetensors" else
                      _torch_zip(f, sharded, algo, canonical) if fmt == "pt" else None)
            if listed is None:
                return None
            merged.update(listed)
    except TorchVerityError:
        return None  # reported by the loading path, with its own wording
    return merged


def fingerprint_of(found: Listing, algo: str) -> Fingerprint:
    """The fingerprint of a listing made with ``algo`` and ``canonical``: the one the
    loaded checkpoint gets."""
    return from_entries(algo, [
        TensorDigest(name, v.dtype, v.shape, v.digest) if isinstance(v, Listed)
        else value_digest(name, v) for name, v in found.items()])


def _safetensors(path: Path, algo: str) -> Listing:
    from torchverity.checkpoint._st_fingerprint import fingerprint_safetensors
    from torchverity.checkpoint._st_header import parse_header
    from torchverity.pickles._limits import check_safetensors_limits

    check_safetensors_limits(path)
    header = parse_header(path)
    begins = {e.name: e.begin for e in header.entries}
    return {e.name: Listed(e.dtype, e.shape, e.digest, Where(path, begins[e.name]))
            for e in fingerprint_safetensors(path, algo, header=header).entries}


def _torch_zip(path: Path, shard: bool, algo: str, canonical: bool) -> Listing | None:
    from torchverity.pickles._listing import ITEMSIZE, ListedTensor, list_torch_zip

    found = list_torch_zip(path, weights=shard)
    if found is None:
        return None
    tensors = {n: t for n, t in found.items() if isinstance(t, ListedTensor)}
    hashers, gathered = {}, []
    for name, t in tensors.items():
        nbytes = ITEMSIZE[t.dtype] * math.prod(t.shape)  # the header a .safetensors copy gets
        h = plain_tensor_hasher(name, t.dtype, t.shape, nbytes, algo,
                                threads=t.nbytes >= THREADED_BYTES)
        if not t.contiguous and canonical:
            gathered.append(name)
        elif not t.contiguous:  # the span holds more than the elements: never a plain digest
            h.update(f"strided\0{list(t.strides)}\0".encode())
        hashers[name] = h
    _stream(path, [_Span(n, t.begin, t.nbytes) for n, t in tensors.items()
                   if n not in gathered], lambda name, chunk: hashers[name].update(chunk))
    if gathered:
        _gather(path, {n: tensors[n] for n in gathered}, hashers)
    return {n: Listed(v.dtype, v.shape, hashers[n].hexdigest(),
                      Where(path, v.begin, None if v.contiguous else v.strides))
            if n in tensors else v for n, v in found.items()}


def _gather(path: Path, views: dict[str, Any], hashers: dict[str, Any]) -> None:
    """Feed each non-contiguous view's elements, in row-major order, to its hash: the
    canonical bytes torch's ``contiguous()`` gives (one copy of the view, as there)."""
    import mmap

    import numpy as np

    from torchverity.pickles._listing import ITEMSIZE

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for name, t in views.items():
            item = ITEMSIZE[t.dtype]  # elements as raw byte rows: every dtype alike
            view = np.ndarray((*t.shape, item), np.uint8, buffer=mm, offset=t.begin,
                              strides=(*(s * item for s in t.strides), 1))
            hashers[name].update(np.ascontiguousarray(view).data)
            del view  # the map closes only once no array points into it


def _stream(path: Path, spans: list[_Span], feed: Any) -> None:
    from torchverity.checkpoint._st_header import stream_tensor_bytes

    stream_tensor_bytes(path, sorted(spans, key=lambda s: s.begin), feed)


def listed_diff(name: str, one: Any, two: Any) -> TensorDiff | None:
    """How two listed entries differ (either may be absent: ``...``); None when both are
    tensors of one dtype and shape whose bytes differ (to be opened and compared)."""
    if two is ...:
        dtype, shape = _sig(one)
        return TensorDiff(name, "only_in_a", dtype_a=dtype, shape_a=shape)
    if one is ...:
        dtype, shape = _sig(two)
        return TensorDiff(name, "only_in_b", dtype_b=dtype, shape_b=shape)
    if not (isinstance(one, Listed) and isinstance(two, Listed)):
        if isinstance(one, Listed) or isinstance(two, Listed):  # a tensor against a value
            (dtype_a, shape_a), (dtype_b, shape_b) = _sig(one), _sig(two)
            return TensorDiff(name, "dtype_changed", dtype_a, dtype_b, shape_a, shape_b)
        return plain_diff(name, one, two)
    base = dict(dtype_a=one.dtype, dtype_b=two.dtype, shape_a=one.shape, shape_b=two.shape)
    if (one.dtype, one.shape) != (two.dtype, two.shape):
        status: Status = "dtype_changed" if one.dtype != two.dtype else "shape_changed"
        return TensorDiff(name, status, **base)  # type: ignore[arg-type]
    if one.digest == two.digest:
        return TensorDiff(name, "identical", numel=math.prod(one.shape),
                          **base)  # type: ignore[arg-type]
    return None


def _sig(entry: Any) -> tuple[str, tuple[int, ...]]:
    """As :func:`torchverity.checkpoint._diff_values.compare` names an entry's type."""
    if isinstance(entry, Listed):
        return entry.dtype, entry.shape
    return type(entry).__name__, ()
