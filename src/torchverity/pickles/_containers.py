"""Find every pickle stream in a file without trusting its container.

Formats: torch zip checkpoints (read the way torch's reader does: names from
the central directory, data at the local header's offset, CRCs ignored by
torch but checked here for pickle entries), the legacy torch format (a
sequence of pickles followed by raw storages), plain pickle files (several
concatenated streams), numpy ``.npy``/``.npz`` (object arrays are pickles),
joblib files (array bytes inline in the pickle; compressed variants), and
safetensors (no pickle at all). Tensor data is never read: storages are
skipped by offset.

Each stream is walked by :mod:`torchverity.pickles._ops`; container anomalies
(odd zip flags, local/central name mismatch, bad CRC, trailing bytes,
decompression beyond the bound) are reported as ``problems``.
"""

from __future__ import annotations

import ast
import bz2
import io
import lzma
import math
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import BinaryIO, cast

from torchverity.pickles._ops import (
    MISSING,
    Build,
    ByteSource,
    GlobalRef,
    Item,
    Limits,
    PickleError,
    StreamReport,
    Value,
    const_str,
    dict_get,
    first_arg,
    ref_of,
    walk_stream,
)

TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
MAX_ZIP_ENTRIES = 1_000_000
_ZIP_OK_FLAGS = 0x080E  # compression options, data descriptor, UTF-8 names
_JOBLIB_WRAPPER = "joblib.numpy_pickle.NumpyArrayWrapper"
_DTYPE_CODE = re.compile(r"^[<>|=]?(?P<kind>[biufcSUVmM?])(?P<size>\d{0,4})(?:\[\w+\])?$")


@dataclass
class Entry:
    """One pickle-bearing part of a file (a zip entry, or the file itself)."""

    name: str
    streams: list[StreamReport] = field(default_factory=list)
    base: int | None = None  # where the entry's bytes start in the file (None: compressed)


@dataclass
class Nested:
    """An archive inside a pickle's bytes, loaded by ``torch.storage._load_from_bytes``."""

    entry: str
    ref: GlobalRef
    offset: int
    container: Container | None  # None: could not be scanned


@dataclass
class Container:
    """What the file is and where its pickles are."""

    format: str
    entries: list[Entry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    torch_entry: str | None = None  # the entry torch.load unpickles (zip checkpoints)
    nested: list[Nested] = field(default_factory=list)


@dataclass(frozen=True)
class ZipMember:
    name: str
    flags: int
    method: int
    crc: int
    csize: int
    usize: int
    header_offset: int


# ------------------------------------------------------------------ readers


# Real pickles compress far less than this; a bomb of zeros reaches ~1000:1.
_BOMB_RATIO = 200
_BOMB_MIN_BYTES = 16 << 20


class _Inflating(io.RawIOBase):
    """A decompressing reader bounded in output size and compression ratio (zip bombs)."""

    def __init__(self, raw: BinaryIO, decompressor: object, limit: int) -> None:
        self._raw, self._d, self._limit, self._out, self._in = raw, decompressor, limit, 0, 0
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        while not self._pending:
            if getattr(self._d, "eof", False):
                return 0
            chunk = self._raw.read(1 << 16)
            if not chunk:
                return 0
            self._in += len(chunk)
            self._pending = self._d.decompress(chunk)  # type: ignore[attr-defined]
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self._out += n
        if self._out > self._limit:
            raise PickleError(f"decompresses to more than {self._limit} bytes", self._out)
        if self._out > _BOMB_MIN_BYTES and self._out > _BOMB_RATIO * self._in:
            raise PickleError(
                f"compression ratio over {_BOMB_RATIO}:1 ({self._in} bytes inflate past "
                f"{self._out}): a decompression bomb", self._out,
            )
        return n


class _Crc(io.RawIOBase):
    """Pass-through reader that computes the CRC-32 of everything read."""

    def __init__(self, raw: BinaryIO, length: int) -> None:
        self._raw, self._left, self.crc = raw, length, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        data = self._raw.read(min(len(buffer), self._left))
        n = len(data)
        buffer[:n] = data
        self._left -= n
        self.crc = zlib.crc32(data, self.crc)
        return n

    def drain(self) -> None:
        while self._left and self.read(1 << 20):
            pass


def _walk_all(
    src: ByteSource, limits: Limits, entry: Entry, on_build: Callable[[Build, ByteSource], None]
) -> None:
    """Walk every stream until the source ends: appended pickles are found too."""
    while True:
        report = walk_stream(src, limits, on_build)
        entry.streams.append(report)
        if report.error is not None or src.at_end():
            return


def _joblib_hook(limits: Limits, entry: Entry) -> Callable[[Build, ByteSource], None]:
    """joblib writes array bytes right after a NumpyArrayWrapper's BUILD: skip or walk them."""

    def hook(build: Build, src: ByteSource) -> None:
        ref = ref_of(build.inst.callee)
        if build.inst.kind != "made" or ref is None or ref.qualname != _JOBLIB_WRAPPER:
            return
        _skip_joblib_array(build, src, limits, entry)

    return hook


def _dtype_code(value: Item) -> str | None:
    return const_str(first_arg(value))


def _skip_joblib_array(build: Build, src: ByteSource, limits: Limits, entry: Entry) -> None:
    state = build.state
    code = _dtype_code(dict_get(state, "dtype"))
    shape = dict_get(state, "shape")
    if code == "O8" or code == "O":
        nested = walk_stream(src, limits, _joblib_hook(limits, entry))  # object arrays are pickles
        entry.streams.append(nested)
        if nested.error:
            raise PickleError(f"object array pickle: {nested.error}", src.offset)
        return
    match = _DTYPE_CODE.match(code or "")
    dims = shape.items if type(shape) is Value and shape.kind == "tuple" else None
    if not match or dims is None or not all(isinstance(d, int) and d >= 0 for d in dims):
        raise PickleError("joblib array with a dtype or shape that cannot be read", src.offset)
    itemsize = int(match["size"] or 1) * (4 if match["kind"] == "U" else 1)
    align = dict_get(state, "numpy_array_alignment_bytes")
    if align is not MISSING and align is not None:
        src.skip(src.read(1)[0])  # padding length byte, then the padding
    src.skip(math.prod(dims) * itemsize)


# ---------------------------------------------------------------------- zip


def _find_eocd(fh: BinaryIO, size: int) -> tuple[int, int, int]:
    """(entry count, central directory size, central directory offset), zip64 aware."""
    tail_len = min(size, 22 + 65535 + 20)
    fh.seek(size - tail_len)
    tail = fh.read(tail_len)
    pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 or pos + 22 > len(tail):
        raise PickleError("zip end-of-central-directory record not found (truncated?)", size)
    _, _, _, _, count, cd_size, cd_offset, _ = struct.unpack("<4sHHHHIIH", tail[pos : pos + 22])
    loc = pos - 20
    if loc >= 0 and tail[loc : loc + 4] == b"PK\x06\x07":
        (z64_offset,) = struct.unpack("<Q", tail[loc + 8 : loc + 16])
        fh.seek(z64_offset)
        rec = fh.read(56)
        if rec[:4] != b"PK\x06\x06" or len(rec) < 56:
            raise PickleError("zip64 end-of-central-directory record is damaged", z64_offset)
        count, cd_size, cd_offset = struct.unpack("<QQQ", rec[32:56])
    if count > MAX_ZIP_ENTRIES or cd_offset + cd_size > size:
        raise PickleError("zip central directory points outside the file", size)
    return count, cd_size, cd_offset


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[pos : pos + 4])
        body = extra[pos + 4 : pos + 4 + length]
        if tag == 1:
            values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
            if offset == 0xFFFFFFFF and values:
                offset = values.pop(0)
        pos += 4 + length
    return usize, csize, offset


def zip_members(fh: BinaryIO, size: int) -> list[ZipMember]:
    """The central directory, in order (the order torch's reader sees)."""
    count, cd_size, cd_offset = _find_eocd(fh, size)
    fh.seek(cd_offset)
    src = ByteSource(fh, cd_size)
    members: list[ZipMember] = []
    for _ in range(count):
        head = src.read(46)
        if head[:4] != b"PK\x01\x02":
            raise PickleError("zip central directory entry is damaged", cd_offset + src.offset)
        fields = struct.unpack("<4sHHHHHHIIIHHHHHII", head)
        flags, method, crc, csize, usize = fields[3], fields[4], fields[7], fields[8], fields[9]
        name_len, extra_len, comment_len, offset = fields[10], fields[11], fields[12], fields[16]
        name = src.read(name_len).decode("utf-8", "replace")
        extra = src.read(extra_len)
        src.skip(comment_len)
        usize, csize, offset = _zip64_extra(extra, usize, csize, offset)
        members.append(ZipMember(name, flags, method, crc, csize, usize, offset))
    return members


def _data_start(fh: BinaryIO, member: ZipMember, problems: list[str]) -> int:
    fh.seek(member.header_offset)
    head = fh.read(30)
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        raise PickleError(f"{member.name}: local header missing", member.header_offset)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    local_name = fh.read(name_len).decode("utf-8", "replace")
    if local_name != member.name:
        problems.append(
            f"zip entry name mismatch: central directory says {member.name!r}, local header "
            f"says {local_name!r} (tools disagree on which name the data has)"
        )
    return member.header_offset + 30 + name_len + extra_len


def _is_storage(name: str) -> bool:
    parts = name.split("/")
    return len(parts) >= 3 and parts[-2] == "data" and not name.endswith(".pkl")


def _member_reader(
    fh: BinaryIO, member: ZipMember, problems: list[str], limits: Limits
) -> _Crc:
    start = _data_start(fh, member, problems)
    fh.seek(start)
    if member.method == 0:
        return _Crc(fh, member.csize)
    raw = cast(BinaryIO, io.BufferedReader(_Crc(fh, member.csize)))
    inflate = _Inflating(raw, zlib.decompressobj(-15), limits.max_inflate)
    # The recorded size is not trusted: the inflater enforces the bound itself.
    return _Crc(cast(BinaryIO, io.BufferedReader(inflate)), limits.max_inflate + 1)


def _check_member(member: ZipMember, problems: list[str]) -> bool:
    if member.flags & ~_ZIP_OK_FLAGS:
        problems.append(
            f"{member.name}: unusual zip flag bits 0x{member.flags:04x} "
            "(encryption or patch data): the entry cannot be checked"
        )
        return False
    if member.method not in (0, 8):
        problems.append(f"{member.name}: zip compression method {member.method} is not supported")
        return False
    return True


def _looks_like_pickle(
    fh: BinaryIO, member: ZipMember, problems: list[str], limits: Limits
) -> bool:
    if member.name.endswith(".pkl"):
        return True
    if _is_storage(member.name) or member.csize == 0:
        return False
    reader = _member_reader(fh, member, problems, limits)
    head = reader.read(2)
    return len(head) == 2 and head[0] == 0x80 and head[1] <= 5


def _walk_member(fh: BinaryIO, member: ZipMember, limits: Limits, container: Container) -> None:
    entry = Entry(member.name)
    if member.method == 0:
        entry.base = _data_start(fh, member, [])
    container.entries.append(entry)
    reader = _member_reader(fh, member, container.problems, limits)
    _walk_all(ByteSource(reader), limits, entry, _joblib_hook(limits, entry))
    if entry.streams[-1].error is None:
        reader.drain()
        if reader.crc != member.crc:
            container.problems.append(
                f"{member.name}: CRC-32 mismatch (recorded {member.crc:08x}, data "
                f"{reader.crc:08x}): the pickle was changed after the archive was written"
            )
    if len(entry.streams) > 1:
        container.problems.append(
            f"{member.name}: {len(entry.streams)} pickle streams in one entry "
            "(data appended after the first STOP)"
        )


def scan_zip(fh: BinaryIO, size: int, limits: Limits) -> Container:
    members = zip_members(fh, size)
    names = [m.name for m in members]
    if names and all(n.endswith(".npy") for n in names):
        return _scan_npz(fh, members, limits)
    container = Container("torch-zip" if any(n.endswith("/data.pkl") for n in names) else "zip")
    if members:
        container.torch_entry = names[0].split("/")[0] + "/data.pkl"
    if container.format == "torch-zip" and container.torch_entry not in names:
        container.problems.append(
            f"torch reads {container.torch_entry!r} (prefix of the first entry) and it is absent"
        )
    if len(set(names)) != len(names):
        container.problems.append("duplicate entry names in the zip central directory")
    for member in members:
        if not _check_member(member, container.problems):
            continue
        if _looks_like_pickle(fh, member, container.problems, limits):
            _walk_member(fh, member, limits, container)
    return container


def _scan_npz(fh: BinaryIO, members: list[ZipMember], limits: Limits) -> Container:
    container = Container("npz")
    for member in members:
        if not _check_member(member, container.problems):
            continue
        reader = _member_reader(fh, member, container.problems, limits)
        entry = Entry(member.name)
        _scan_npy_stream(ByteSource(reader), limits, entry, container)
    return container


# ---------------------------------------------------------------------- npy


def _scan_npy_stream(src: ByteSource, limits: Limits, entry: Entry, container: Container) -> None:
    magic = src.read(8)
    if magic[:6] != b"\x93NUMPY":
        raise PickleError(f"{entry.name}: not a .npy file", 0)
    size_len = 2 if magic[6] == 1 else 4
    (header_len,) = struct.unpack("<H" if size_len == 2 else "<I", src.read(size_len))
    if header_len > limits.max_line:
        raise PickleError(f"{entry.name}: .npy header too long", src.offset)
    try:
        header = ast.literal_eval(src.read(header_len).decode("latin-1"))
        descr = header["descr"]
    except (ValueError, SyntaxError, KeyError, TypeError, MemoryError):
        raise PickleError(f"{entry.name}: .npy header cannot be parsed", src.offset) from None
    if "O" in repr(descr):  # object fields are stored as a pickle
        container.entries.append(entry)
        _walk_all(src, limits, entry, _joblib_hook(limits, entry))


# ------------------------------------------------------------------- pickles


def _scan_pickle_file(
    src: ByteSource, limits: Limits, name: str, fmt: str, base: int | None
) -> Container:
    container = Container(fmt)
    entry = Entry(name, base=base)
    container.entries.append(entry)
    first = walk_stream(src, limits, _joblib_hook(limits, entry))
    entry.streams.append(first)
    result = first.result
    if first.error is None and result == TORCH_LEGACY_MAGIC:
        container.format = "torch-legacy"
        container.torch_entry = name
        # protocol version, sys info, the object, the storage keys; raw storages follow.
        for _ in range(4):
            report = walk_stream(src, limits)
            entry.streams.append(report)
            if report.error is not None:
                break
        return container
    if first.error is None and not src.at_end():
        _walk_all(src, limits, entry, _joblib_hook(limits, entry))
        container.problems.append(
            f"{len(entry.streams)} pickle streams in one file (data appended after the first STOP)"
        )
    if any(g.qualname == _JOBLIB_WRAPPER for s in entry.streams for g in s.globals):
        container.format = "joblib"
    return container


_COMPRESSED: tuple[tuple[bytes, str, Callable[[], object]], ...] = (
    (b"\x1f\x8b", "gzip", lambda: zlib.decompressobj(16 + zlib.MAX_WBITS)),
    (b"BZh", "bz2", bz2.BZ2Decompressor),
    (b"\xfd7zXZ", "xz", lzma.LZMADecompressor),
    (b"\x5d\x00\x00", "lzma", lzma.LZMADecompressor),
)
_ZLIB_HEADS = (b"\x78\x01", b"\x78\x5e", b"\x78\x9c", b"\x78\xda")


def _decompressor(head: bytes) -> tuple[str, object] | None:
    for magic, name, make in _COMPRESSED:
        if head.startswith(magic):
            return name, make()
    if head[:2] in _ZLIB_HEADS:
        return "zlib", zlib.decompressobj()
    return None


def _is_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= min(size - 8, 100_000_000) and head[8:9] == b"{"


@contextmanager
def _opened(path: str) -> Iterator[tuple[BinaryIO, int]]:
    with open(path, "rb") as fh:
        fh.seek(0, io.SEEK_END)
        size = fh.tell()
        fh.seek(0)
        yield fh, size


class _Region(io.RawIOBase):
    """``length`` bytes of a file from ``start``, seen as a file of their own."""

    def __init__(self, fh: BinaryIO, start: int, length: int) -> None:
        self._fh, self._start, self._length, self._pos = fh, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self._length - self._pos))
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(n)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def scan_container(path: str, limits: Limits) -> Container:
    """Identify the file's format by its bytes (never its name) and walk every pickle in it."""
    with _opened(path) as (fh, size):
        return _scan_fh(fh, size, limits, path, 0)


def _scan_fh(fh: BinaryIO, size: int, limits: Limits, name: str, depth: int) -> Container:
    head = fh.read(16)
    fh.seek(0)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        container = scan_zip(fh, size, limits)
    elif head.startswith(b"\x93NUMPY"):
        container = Container("npy")
        _scan_npy_stream(ByteSource(fh, size), limits, Entry(name), container)
    elif head.startswith(b"7z\xbc\xaf\x27\x1c"):
        raise PickleError("7z archive: unpack it and scan the files inside", 0)
    elif _is_safetensors(head, size):
        container = Container("safetensors")
    elif (packed := _decompressor(head)) is not None:
        kind, decompressor = packed
        raw = io.BufferedReader(_Inflating(fh, decompressor, limits.max_inflate))
        container = _scan_pickle_file(ByteSource(raw), limits, name, f"pickle+{kind}", None)
    else:
        container = _scan_pickle_file(ByteSource(fh, size), limits, name, "pickle", 0)
    _scan_nested(fh, container, limits, depth)
    return container


_NESTED_LOADER = "torch.storage._load_from_bytes"
MAX_NESTING = 3


def _scan_nested(fh: BinaryIO, container: Container, limits: Limits, depth: int) -> None:
    """Scan archives that pickle.dumps(tensor) embeds as bytes (loaded with a full unpickler)."""
    for entry in container.entries:
        for report in entry.streams:
            for offset, via, made in report.calls:
                ref = ref_of(made.callee)
                if via != "REDUCE" or ref is None or ref.qualname != _NESTED_LOADER:
                    continue
                inner = _open_nested(fh, entry, first_arg(made), limits, depth)
                container.nested.append(Nested(entry.name, ref, offset, inner))


def _open_nested(
    fh: BinaryIO, entry: Entry, arg: Item, limits: Limits, depth: int
) -> Container | None:
    if depth >= MAX_NESTING:
        return None
    if isinstance(arg, bytes):
        region: BinaryIO = io.BytesIO(arg)
        size = len(arg)
    elif type(arg) is Value and arg.kind == "blob" and entry.base is not None:
        start, size = arg.const
        region = cast(BinaryIO, io.BufferedReader(_Region(fh, entry.base + start, size)))
    else:
        return None
    try:
        return _scan_fh(region, size, limits, "nested", depth + 1)
    except PickleError as exc:
        return Container("unknown", problems=[f"nested archive: {exc}"])
