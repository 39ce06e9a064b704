"""A strict .safetensors reader and a writer that hashes while it writes.

Format: an 8-byte little-endian header length N, N bytes of JSON (tensor name
-> ``{"dtype", "shape", "data_offsets": [begin, end]}`` plus an optional
``__metadata__`` of strings), then one flat data buffer. The format has no
checksum, so the reader trusts nothing: a header that lies (offsets that
overlap, leave gaps or run past the end, sizes that do not match shape x dtype,
duplicate names, trailing bytes) is refused before any tensor is built.

The ``safetensors`` package is only a test dependency: the tests prove that
files written here load there and the other way round.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from torchverity._tensors import host_bytes
from torchverity.checkpoint._hashing_reader import SMALL_READ, Balance, read_split
from torchverity.checkpoint._st_header import _bad, parse_header, stream_tensor_bytes
from torchverity.errors import FormatError

_ALIGN = 8
DTYPES: dict[str, torch.dtype] = {  # codes as in _st_header.DTYPE_NAMES
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One header entry; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated .safetensors header, its dtypes as torch's."""

    entries: tuple[TensorInfo, ...]  # in file order
    metadata: dict[str, str]
    data_start: int
    file_size: int


# ------------------------------------------------------------------ reading


def read_header(path: Path) -> Header:
    """Parse and validate the header; any lie raises :class:`FormatError`."""
    raw = parse_header(path)
    return Header(tuple(TensorInfo(e.name, DTYPES[e.code], e.shape, e.begin, e.end)
                        for e in raw.entries), raw.metadata, raw.data_start, raw.file_size)


Feed = Callable[[str, memoryview], None]


class Writer(Protocol):
    def write(self, data: Any, /) -> int: ...


def read_tensors(path: Path, header: Header, feed: Feed | None = None,
                 reader: Executor | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor straight into its own memory (one pass, no extra copy).

    ``feed(name, chunk)`` sees each chunk as it lands (name ``""`` for the
    header bytes), so callers hash the file and the tensors in the same pass.
    With ``reader`` a worker thread reads part of each large tensor alongside
    this one, which feeds the chunk before meanwhile (see :func:`read_split`).
    """
    tensors: dict[str, torch.Tensor] = {}
    balance = Balance()
    with open(path, "rb", buffering=0) as fh:
        head = fh.read(header.data_start)
        if feed:
            feed("", memoryview(head))
        for e in header.entries:
            t = torch.empty(e.shape, dtype=e.dtype)
            if e.nbytes:
                target = memoryview(t.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                if reader is not None and e.nbytes >= SMALL_READ:
                    _fill_split(fh, target, path, e.name, feed, reader, balance)
                else:
                    _fill(fh, target, path, e.name, feed)
            tensors[e.name] = t
    return tensors


def iter_tensor_bytes(path: Path, header: Header, feed: Feed, chunk: int = 8 << 20) -> None:
    """Stream every tensor's bytes through ``feed`` with one small reused buffer."""
    stream_tensor_bytes(path, header.entries, feed, chunk)


def _fill(fh: Any, target: memoryview, path: Path, name: str, feed: Feed | None) -> None:
    pos, step = 0, 8 << 20
    while pos < len(target):
        n = fh.readinto(target[pos : pos + step])
        if not n:
            raise _bad(path, f"file ended inside tensor '{name}'")
        if feed:
            feed(name, target[pos : pos + n])
        pos += n


def _fill_split(fh: Any, target: memoryview, path: Path, name: str, feed: Feed | None,
                reader: Executor, balance: Balance) -> None:
    def consume(a: int, b: int) -> None:
        if feed:
            feed(name, target[a:b])

    pos = fh.tell()
    filled = read_split(fh.fileno(), target, pos, reader, consume, balance)
    if filled < len(target):
        raise _bad(path, f"file ended inside tensor '{name}'")
    fh.seek(pos + filled)


# ------------------------------------------------------------------ writing


def plan(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None) -> bytes:
    """The header bytes (length prefix included) for ``tensors`` in :func:`order`."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)  # keeps the data buffer 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def order(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Largest element size first, then by name: every tensor stays aligned."""
    return sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))


def check_writable(tensors: Mapping[str, Any], path: Path) -> dict[str, torch.Tensor]:
    """Only flat ``name -> tensor`` maps of supported dtypes can be .safetensors."""
    if not isinstance(tensors, Mapping):
        raise FormatError(
            f"{path}: .safetensors holds a flat name -> tensor map, got {type(tensors).__name__}",
            path=path, hint="save a state_dict, or use a .pt path for nested checkpoints",
        )
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not isinstance(name, str):
            raise FormatError(
                f"{path}: entry '{name}' is a {type(t).__name__}, .safetensors holds only tensors",
                path=path, hint="use a .pt path for checkpoints with optimizer state or scalars",
            )
        if t.dtype not in CODES:
            raise FormatError(f"{path}: tensor '{name}' has dtype {t.dtype}, which .safetensors "
                              "cannot store", path=path, hint="use a .pt path")
        out[name] = t
    return out


def write_tensors(tensors: Mapping[str, torch.Tensor], fh: Writer,
                  metadata: Mapping[str, str] | None = None) -> None:
    """Write header then data; ``fh`` sees each tensor's bytes in one call."""
    fh.write(plan(tensors, metadata))
    for name in order(tensors):
        data = host_bytes(tensors[name])
        if len(data):
            fh.write(data)


def map_tensors(path: Path, header: Header) -> dict[str, torch.Tensor]:
    """Tensors backed by a private memory map of the file: nothing is read until used.

    For inspection and comparison of files that may not fit in memory; pages
    are copy-on-write, so the file itself never changes.
    """
    import mmap

    if header.file_size == header.data_start:
        return {e.name: torch.empty(e.shape, dtype=e.dtype) for e in header.entries}
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    base = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps the map alive
    tensors = {}
    for e in header.entries:
        raw = base[e.begin : e.end]
        if e.begin % e.dtype.itemsize:
            raw = raw.clone()  # misaligned data (legal, rare): copy to aligned memory
        tensors[e.name] = raw.view(e.dtype).reshape(e.shape)
    return tensors
