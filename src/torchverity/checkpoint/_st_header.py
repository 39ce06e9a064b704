"""The .safetensors header read without torch: strict validation, dtype names, streaming.

Lets commands that only list or hash a .safetensors file (inspect, fingerprint,
verify) run without importing torch; :mod:`torchverity.checkpoint._safetensors`
builds tensors on top of it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torchverity._formats import MAX_HEADER_BYTES
from torchverity.errors import FormatError, shell_path

# safetensors dtype code -> (torch's dtype name, bytes per element)
DTYPE_NAMES = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2),
    "U16": ("uint16", 2), "I32": ("int32", 4), "U32": ("uint32", 4), "I64": ("int64", 8),
    "U64": ("uint64", 8), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "F32": ("float32", 4), "F64": ("float64", 8), "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1), "C64": ("complex64", 8),
}
ITEMSIZE = {code: size for code, (_name, size) in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class RawEntry:
    """One header entry; ``begin``/``end`` are absolute file offsets."""

    name: str
    code: str  # the safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.code][0]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class RawHeader:
    """A validated .safetensors header, its dtypes as the file's codes (no torch)."""

    entries: tuple[RawEntry, ...]  # in file order
    metadata: dict[str, str]
    data_start: int
    file_size: int


class Span(Protocol):
    """Where a tensor's bytes lie in a file (``begin`` absolute)."""

    @property
    def name(self) -> str: ...

    @property
    def begin(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


def stream_tensor_bytes(path: Path, entries: Sequence[Span],
                        feed: Callable[[str, memoryview], None], chunk: int = 8 << 20) -> None:
    """Stream every tensor's bytes (in the order given) through ``feed`` with one reused
    buffer."""
    # Sized to the largest tensor: a small file costs no 8 MiB allocation.
    buf = memoryview(bytearray(max(1, min(chunk, max((e.nbytes for e in entries), default=1)))))
    chunk = len(buf)
    with open(path, "rb", buffering=0) as fh:
        for e in entries:
            if fh.tell() != e.begin:
                fh.seek(e.begin)
            left = e.nbytes
            while left:
                n = fh.readinto(buf[: min(left, chunk)])
                if not n:
                    raise _bad(path, f"file ended inside tensor '{e.name}'")
                feed(e.name, buf[:n])
                left -= n


def parse_header(path: Path) -> RawHeader:
    """Parse and validate the header; any lie raises :class:`FormatError`."""
    size = os.stat(path).st_size
    with open(path, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) < 8:
            raise _bad(path, f"file is {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", raw_len)
        if n > MAX_HEADER_BYTES:
            raise _bad(path, f"header length {n} exceeds the 100 MB limit")
        if 8 + n > size:
            raise _bad(path, f"header length {n} runs past the end of the {size}-byte file "
                             "(truncated?)")
        raw = fh.read(n)
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _bad(path, f"header is not valid JSON: {exc}") from None
    except RecursionError:
        raise _bad(path, "header is nested too deeply to be a safetensors header") from None
    if not isinstance(data, dict):
        raise _bad(path, "header is not a JSON object")
    metadata = _metadata(path, data.pop("__metadata__", None))
    entries = sorted((_entry(path, name, v, 8 + n) for name, v in data.items()),
                     key=lambda e: (e.begin, e.end))
    _check_layout(path, entries, 8 + n, size)
    return RawHeader(tuple(entries), metadata, 8 + n, size)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"name '{key}' appears twice")
        out[key] = value
    return out


def _metadata(path: Path, meta: Any) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise _bad(path, "__metadata__ must map strings to strings")
    return dict(meta)


def _entry(path: Path, name: str, v: Any, data_start: int) -> RawEntry:
    if not isinstance(v, dict):
        raise _bad(path, f"tensor '{name}': entry is not an object")
    code = v.get("dtype")
    if not isinstance(code, str) or code not in ITEMSIZE:
        raise _bad(path, f"tensor '{name}': unknown dtype {v.get('dtype')!r}")
    shape, offsets = v.get("shape"), v.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
        raise _bad(path, f"tensor '{name}': shape {shape!r} is not a list of non-negative ints")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets))
            or offsets[0] > offsets[1]):
        raise _bad(path, f"tensor '{name}': data_offsets {offsets!r} are not [begin, end]")
    expected = math.prod(shape) * ITEMSIZE[code]
    if offsets[1] - offsets[0] != expected:
        raise _bad(path, f"tensor '{name}': data_offsets span {offsets[1] - offsets[0]} bytes "
                         f"but shape {shape} x {v['dtype']} needs {expected}")
    return RawEntry(name, code, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_layout(path: Path, entries: list[RawEntry], data_start: int, size: int) -> None:
    cursor = data_start
    for e in entries:
        if e.begin < cursor:
            raise _bad(path, f"tensor '{e.name}' overlaps the previous tensor "
                             f"(starts at data offset {e.begin - data_start}, "
                             f"previous ends at {cursor - data_start})")
        if e.begin > cursor:
            raise _bad(path, f"gap of {e.begin - cursor} bytes before tensor '{e.name}'")
        cursor = e.end
    if cursor > size:
        raise _bad(path, f"tensors need {cursor - data_start} data bytes but the file holds "
                         f"{size - data_start} (truncated?)")
    if cursor < size:
        raise _bad(path, f"{size - cursor} unexpected bytes after the last tensor")


def _bad(path: Path, what: str) -> FormatError:
    return FormatError(
        f"{path}: not a valid .safetensors file: {what}", path=path,
        hint=f"torchverity inspect {shell_path(path)}; restore the file from a verified copy",
    )
