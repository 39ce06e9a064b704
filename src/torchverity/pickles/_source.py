"""Bounded byte reading for the pickle walker: limits, errors, a seekable byte source.

The source models how CPython's stream unpickler consumes bytes, pickle FRAMEs
included, and skips large payloads by seeking so that tensor data is never read.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Protocol

_CHUNK = 1 << 20
_NO_FRAME = 1 << 62


@dataclass(frozen=True)
class Limits:
    """Hard bounds on the work one pickle stream may cause."""

    max_ops: int = 20_000_000
    max_memo: int = 5_000_000
    max_stack: int = 1_000_000
    max_line: int = 1 << 16
    max_expansion: int = 100_000_000  # items an object graph may expand to (billion laughs)
    max_inflate: int = 1 << 30  # decompressed bytes per compressed stream (zip bombs)
    # Containers nested deeper than this make recursive consumers (repr, json, state-dict
    # walkers, torch's own helpers) raise RecursionError: refused before anything loads.
    max_depth: int = 500
    max_header: int = 16 << 20  # safetensors JSON header bytes (the format allows 100 MB)


class PickleError(Exception):
    """The stream cannot be parsed (or exceeds a limit); ``offset`` locates it.

    ``limit`` is True when a real loader might read on where the walk stopped (a bound was
    reached or the bytes allow two readings); False when the loader fails there too."""

    def __init__(self, message: str, offset: int, *, limit: bool = False) -> None:
        super().__init__(message)
        self.offset = offset
        self.limit = limit


class Truncated(PickleError):
    """The stream ended before STOP. ``partial``: the bytes of a text line the end cut."""

    def __init__(self, message: str, offset: int, *, partial: bytes = b"") -> None:
        super().__init__(message, offset)
        self.partial = partial


class Readable(Protocol):
    """What ByteSource needs from the stream under it (files and our readers fit)."""

    def read(self, n: int = -1, /) -> bytes: ...

    def seekable(self) -> bool: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...


class ByteSource:
    """Sequential reads over ``length`` bytes of a binary stream, with cheap skips."""

    def __init__(self, raw: Readable, length: int | None = None) -> None:
        self._raw = raw
        self._remaining = length  # bytes not yet pulled from raw (None: until EOF)
        self._buf = b""
        self._end = 0  # len(self._buf), kept to spare a call per read
        self._pos = 0
        self.offset = 0  # bytes consumed from this source
        # End of the current pickle FRAME. CPython's stream unpickler reads a field that
        # straddles it from *after* the frame (the frame's tail is dropped); pickle.loads
        # reads it contiguously. Both readings cannot be walked at once: a straddle is an error.
        self.frame_end = _NO_FRAME

    def _straddles(self, n: int, start: int | None = None) -> None:
        start = self.offset if start is None else start
        if start >= self.frame_end:
            self.frame_end = _NO_FRAME
            return
        raise PickleError(
            f"a {n}-byte field straddles the end of a pickle FRAME at offset {self.frame_end} "
            "(stream and in-memory unpicklers read different bytes there)", start, limit=True,
        )

    def start_frame(self, length: int) -> None:
        end = self.offset + length
        if self.frame_end != _NO_FRAME and self.offset < self.frame_end:
            if end > self.frame_end:
                raise PickleError("a FRAME reaches past the end of the frame holding it",
                                  self.offset, limit=True)
            return  # a frame inside a frame: the outer bound still holds
        self.frame_end = end

    def _fill(self, need: int) -> bool:
        while len(self._buf) - self._pos < need:
            want = max(_CHUNK, need)
            if self._remaining is not None:
                want = min(want, self._remaining)
            chunk = self._raw.read(want) if want > 0 else b""
            if not chunk:
                return False
            if self._remaining is not None:
                self._remaining -= len(chunk)
            self._buf = self._buf[self._pos :] + chunk
            self._end = len(self._buf)
            self._pos = 0
        return True

    def at_end(self) -> bool:
        return not self._fill(1)

    def read(self, n: int) -> bytes:
        if self.offset + n > self.frame_end:
            self._straddles(n)
        pos = self._pos
        if pos + n > self._end:
            if not self._fill(n):
                raise Truncated(f"stream ends inside a {n}-byte field", self.offset)
            pos = self._pos
        self._pos = pos + n
        self.offset += n
        return self._buf[pos : pos + n]

    def readline(self, limit: int) -> bytes:
        start = self.offset
        line = self._readline(limit)
        if self.offset > self.frame_end:
            self._straddles(self.offset - start, start)
        return line

    def _readline(self, limit: int) -> bytes:
        while True:
            end = self._buf.find(b"\n", self._pos)
            if end >= 0:
                line = self._buf[self._pos : end]
                if len(line) > limit:
                    break
                self.offset += end + 1 - self._pos
                self._pos = end + 1
                return line
            have = len(self._buf) - self._pos
            if have > limit:
                break
            if not self._fill(have + 1):
                raise Truncated("stream ends inside a text field", self.offset,
                                partial=self._buf[self._pos :])
        raise PickleError(f"text field longer than {limit} bytes", self.offset, limit=True)

    def skip(self, n: int) -> None:
        """Skip ``n`` bytes without keeping them (seeks on files: big payloads cost nothing)."""
        if self.offset + n > self.frame_end:
            self._straddles(n)
        have = len(self._buf) - self._pos
        if n <= have:
            self._pos += n
            self.offset += n
            return
        rest = n - have
        self._buf, self._pos, self._end = b"", 0, 0
        if self._remaining is not None and rest > self._remaining:
            raise Truncated(f"stream ends inside a {n}-byte payload", self.offset)
        if self._raw.seekable():
            self._raw.seek(rest, io.SEEK_CUR)
        else:
            while rest:
                chunk = self._raw.read(min(rest, _CHUNK))
                if not chunk:
                    raise Truncated(f"stream ends inside a {n}-byte payload", self.offset)
                rest -= len(chunk)
            rest = n - have
        if self._remaining is not None:
            self._remaining -= rest
        self.offset += n
