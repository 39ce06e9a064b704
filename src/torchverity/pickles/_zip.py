"""Zip archives as both of their readers see them, with bounded, checked member readers.

torch's reader (miniz) takes the central directory at the offset the end record
names and looks entry names up case-insensitively; Python's ``zipfile`` (numpy's
``.npz`` loader) recomputes that offset from where the end record sits, which
tolerates prepended data and lets one file hold two different directories.
Both views are parsed here; member data is read only through bounded readers.
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, cast

from torchverity.pickles._source import ByteSource, Limits, PickleError

MAX_ZIP_ENTRIES = 1_000_000
_ZIP_OK_FLAGS = 0x080E  # compression options, data descriptor, UTF-8 names
# Real pickles compress far less than this; a bomb of zeros reaches ~1000:1.
BOMB_RATIO = 200
BOMB_MIN_BYTES = 16 << 20


@dataclass(frozen=True)
class ZipMember:
    """A central-directory entry, as recorded."""

    name: str
    flags: int
    method: int
    crc: int
    csize: int
    usize: int
    header_offset: int


@dataclass(frozen=True)
class ZipView:
    """One reader's idea of the archive: which directory it reads and the members in it."""

    reader: str  # "torch" (offset as recorded) or "zipfile" (offset recomputed)
    members: tuple[ZipMember, ...]


class Inflating(io.RawIOBase):
    """A decompressing reader bounded in output size and compression ratio (zip bombs).

    Decompressor failures become :class:`PickleError`, so a walk over this reader keeps
    what it found before the damage."""

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
            try:
                self._pending = self._d.decompress(chunk)  # type: ignore[attr-defined]
            except (zlib.error, OSError, EOFError, ValueError) as exc:
                raise PickleError(f"decompression failed: {exc}", self._out) from None
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self._out += n
        if self._out > self._limit:
            raise PickleError(f"decompresses to more than {self._limit} bytes", self._out,
                              limit=True)
        if self._out > BOMB_MIN_BYTES and self._out > BOMB_RATIO * self._in:
            raise PickleError(
                f"compression ratio over {BOMB_RATIO}:1 ({self._in} bytes inflate past "
                f"{self._out}): a decompression bomb", self._out, limit=True,
            )
        return n


class Crc(io.RawIOBase):
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


class Region(io.RawIOBase):
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


def region(fh: BinaryIO, start: int, length: int) -> BinaryIO:
    return cast(BinaryIO, io.BufferedReader(Region(fh, start, length)))


# ------------------------------------------------------------------ directory


@dataclass(frozen=True)
class _EndRecord:
    """The end-of-central-directory record (zip64 aware)."""

    count: int
    cd_size: int
    cd_offset: int  # as recorded
    cd_at: int  # where the directory must sit for the end record to follow it


def _end_record(fh: BinaryIO, size: int) -> _EndRecord:
    """The end record (zip64 aware): the last one in the file's tail, as both readers find it."""
    tail_len = min(size, 22 + 65535 + 20)
    fh.seek(size - tail_len)
    tail = fh.read(tail_len)
    pos = tail.rfind(b"PK\x05\x06")
    if pos < 0 or pos + 22 > len(tail):
        raise PickleError("zip end-of-central-directory record not found (truncated?)", size)
    _, _, _, _, count, cd_size, cd_offset, _ = struct.unpack("<4sHHHHIIH", tail[pos : pos + 22])
    end_at = size - tail_len + pos
    loc = pos - 20
    if loc >= 0 and tail[loc : loc + 4] == b"PK\x06\x07":
        (z64_offset,) = struct.unpack("<Q", tail[loc + 8 : loc + 16])
        if z64_offset + 56 > size:
            raise PickleError("zip64 end record points outside the file", size)
        fh.seek(z64_offset)
        rec = fh.read(56)
        if rec[:4] != b"PK\x06\x06" or len(rec) < 56:
            raise PickleError("zip64 end-of-central-directory record is damaged", z64_offset)
        count, cd_size, cd_offset = struct.unpack("<QQQ", rec[32:56])
        end_at = size - tail_len + loc - 56
    if count > MAX_ZIP_ENTRIES:
        raise PickleError(f"zip directory claims {count} entries", size, limit=True)
    return _EndRecord(count, cd_size, cd_offset, end_at - cd_size)


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


def _read_directory(
    fh: BinaryIO, size: int, at: int, rec: _EndRecord, shift: int, problems: list[str]
) -> tuple[ZipMember, ...]:
    if at < 0 or at + rec.cd_size > size:
        raise PickleError("zip central directory points outside the file", size)
    fh.seek(at)
    src = ByteSource(fh, rec.cd_size)
    members: list[ZipMember] = []
    for _ in range(rec.count):
        head = src.read(46)
        if head[:4] != b"PK\x01\x02":
            raise PickleError("zip central directory entry is damaged", at + src.offset)
        fields = struct.unpack("<4sHHHHHHIIIHHHHHII", head)
        flags, method, crc, csize, usize = fields[3], fields[4], fields[7], fields[8], fields[9]
        name_len, extra_len, comment_len, offset = fields[10], fields[11], fields[12], fields[16]
        name = src.read(name_len).decode("utf-8", "replace")
        extra = src.read(extra_len)
        src.skip(comment_len)
        usize, csize, offset = _zip64_extra(extra, usize, csize, offset)
        members.append(ZipMember(name, flags, method, crc, csize, usize, offset + shift))
    if src.offset != rec.cd_size:
        problems.append(
            f"zip directory holds {rec.cd_size} bytes but its {rec.count} entries use "
            f"{src.offset}: torch counts entries, Python's zipfile reads to the size"
        )
    return tuple(members)


def zip_views(fh: BinaryIO, size: int, problems: list[str]) -> list[ZipView]:
    """The archive as torch reads it and, when it differs, as Python's zipfile reads it."""
    rec = _end_record(fh, size)
    shift = rec.cd_at - rec.cd_offset
    if shift == 0:
        return [ZipView("torch", _read_directory(fh, size, rec.cd_offset, rec, 0, problems))]
    problems.append(
        f"the zip end record puts the central directory at {rec.cd_offset} but it sits at "
        f"{rec.cd_at} (data prepended, or two directories): torch and Python's zipfile read "
        "different archives"
    )
    views: list[ZipView] = []
    for reader, at, move in (("torch", rec.cd_offset, 0), ("zipfile", rec.cd_at, shift)):
        try:
            views.append(ZipView(reader, _read_directory(fh, size, at, rec, move, problems)))
        except PickleError as exc:
            problems.append(f"{reader} view of the zip: {exc}")
    return views


# A distributed checkpoint's data file holds one torch.save archive per item, one after
# another; its reader torch.loads each from the offsets its .metadata records.
MAX_STACKED = 1_000_000
_SEARCH_CHUNK = 1 << 20


def stacked_archives(fh: BinaryIO, size: int) -> list[ZipView] | None:
    """The archives of a file that is two or more whole zip archives one after another, each
    read as torch reads it from its own start (member offsets made absolute); None for
    anything else. Only a file whose tail does not describe a single archive is searched:
    this reads the whole file."""
    try:
        rec = _end_record(fh, size)
        if rec.cd_at == rec.cd_offset:
            return None  # one archive: the usual reading applies
    except PickleError:
        pass  # a zip64 end record placed relative to an archive that starts later
    views: list[ZipView] = []
    start = 0
    while start < size:
        fh.seek(start)
        if fh.read(4) != b"PK\x03\x04" or len(views) >= MAX_STACKED:
            return None
        found = _archive_end(fh, start, size)
        if found is None:
            return None
        end, rec = found
        problems: list[str] = []
        members = _read_directory(fh, size, start + rec.cd_offset, rec, start, problems)
        if problems:
            return None
        views.append(ZipView(f"archive at byte {start}", members))
        start = end
    return views if len(views) > 1 else None


def _archive_end(fh: BinaryIO, start: int, size: int) -> tuple[int, _EndRecord] | None:
    """Where the archive that starts at ``start`` ends, and its end record: the first end
    record after ``start`` whose directory (and zip64 record) sits where it says, counted
    from ``start``. Bytes inside a member that merely look like an end record fail that."""
    pos, tail = start, b""
    while pos < size:
        fh.seek(pos)
        block = tail + fh.read(min(_SEARCH_CHUNK, size - pos))
        base = pos - len(tail)
        at = block.find(b"PK\x05\x06")
        while at >= 0:
            checked = _end_at(fh, start, base + at, size)
            if checked is not None:
                return checked
            at = block.find(b"PK\x05\x06", at + 1)
        pos = base + len(block)
        tail = block[-3:]
    return None


def _end_at(fh: BinaryIO, start: int, q: int, size: int) -> tuple[int, _EndRecord] | None:
    fh.seek(q)
    rec = fh.read(22)
    if len(rec) < 22:
        return None
    _, _, _, _, count, cd_size, cd_offset, comment = struct.unpack("<4sHHHHIIH", rec)
    directory_end = q
    if q - 20 >= start:
        fh.seek(q - 20)
        loc = fh.read(20)
        if loc[:4] == b"PK\x06\x07":
            (z64,) = struct.unpack("<Q", loc[8:16])
            fh.seek(start + z64)
            big = fh.read(56)
            if len(big) < 56 or big[:4] != b"PK\x06\x06":
                return None
            (length,) = struct.unpack("<Q", big[4:12])
            if start + z64 + 12 + length != q - 20:
                return None
            count, cd_size, cd_offset = struct.unpack("<QQQ", big[32:56])
            directory_end = start + z64
    if start + cd_offset + cd_size != directory_end or q + 22 + comment > size:
        return None
    if count > MAX_ZIP_ENTRIES:
        raise PickleError(f"zip directory claims {count} entries", q, limit=True)
    return q + 22 + comment, _EndRecord(count, cd_size, cd_offset, start + cd_offset)


def data_start(fh: BinaryIO, member: ZipMember, problems: list[str]) -> int:
    if member.header_offset < 0:
        raise PickleError(f"{member.name}: local header offset points before the file", 0)
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


def member_reader(fh: BinaryIO, member: ZipMember, problems: list[str], limits: Limits) -> Crc:
    start = data_start(fh, member, problems)
    fh.seek(start)
    if member.method == 0:
        return Crc(fh, member.csize)
    raw = cast(BinaryIO, io.BufferedReader(Crc(fh, member.csize)))
    inflate = Inflating(raw, zlib.decompressobj(-15), limits.max_inflate)
    # The recorded size is not trusted: the inflater enforces the bound itself.
    return Crc(cast(BinaryIO, io.BufferedReader(inflate)), limits.max_inflate + 1)


def check_member(member: ZipMember, problems: list[str]) -> bool:
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


def head_of(fh: BinaryIO, member: ZipMember, limits: Limits, n: int = 8) -> bytes:
    """The first bytes of a member (what a reader sniffs), read through a bounded reader."""
    if member.csize == 0:
        return b""
    try:
        return member_reader(fh, member, [], limits).read(n) or b""
    except PickleError:
        return b""


def inflation_problems(members: tuple[ZipMember, ...], size: int, limits: Limits) -> list[str]:
    """What torch would allocate for deflated members (it trusts the recorded sizes)."""
    out: list[str] = []
    total = 0
    for m in members:
        if m.method == 0:
            continue
        total += m.usize
        ratio_bomb = m.usize > BOMB_MIN_BYTES and m.usize > BOMB_RATIO * max(m.csize, 1)
        if m.usize > limits.max_inflate or ratio_bomb:
            out.append(f"{m.name}: {m.csize} compressed bytes claim {m.usize} when inflated "
                       "(a decompression bomb): refused before torch inflates it")
    if total > max(limits.max_inflate, BOMB_RATIO * size) and not out:
        out.append(f"deflated entries claim {total} bytes in all: refused before torch "
                   "inflates them")
    return out
