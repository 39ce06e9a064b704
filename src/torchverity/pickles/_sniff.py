"""What a file is, from its first bytes: the formats that hold no pickle, and the magics.

Recognised here: Git LFS pointer files and HTML pages (the two common broken
downloads saved under a weights name), ONNX models (protobuf), plain text
(JSON, tokenizer files, sidecars, ``.gitattributes``), safetensors headers,
tar archives, and the compression magics joblib dispatches on.
"""

from __future__ import annotations

import re
import struct
import tarfile
from typing import BinaryIO

from torchverity._formats import COMPRESSED, MAX_HEADER_BYTES

HEAD_BYTES = 4096
_LFS = re.compile(rb"^version https://git-lfs\.github\.com/spec/v\d+\r?\noid sha256:[0-9a-f]{64}")
_HTML = re.compile(rb"^\s*(?:<!doctype html|<html|<head|<body|<\?xml[^>]*>\s*<html)", re.I)
# ModelProto fields (number -> wire type) an ONNX file starts with.
_ONNX_FIELDS = {1: 0, 2: 2, 3: 2, 4: 2, 5: 0, 6: 2, 7: 2, 8: 2, 14: 2, 20: 2, 25: 2}

UNSUPPORTED_COMPRESSED = {b"ZF": "joblib < 0.9.3 compressed format", b"\x04\x22\x4d\x18": "lz4"}


def lfs_pointer(head: bytes) -> bool:
    return bool(_LFS.match(head))


def html_page(head: bytes) -> bool:
    return bool(_HTML.match(head))


def text_file(head: bytes) -> bool:
    """Printable UTF-8 (tabs and newlines allowed): JSON, YAML, sidecars, tokenizer files."""
    if not head:
        return False
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # a character cut by the end of the sample is fine
            return False
        text = head[: exc.start].decode("utf-8")
    return all(c.isprintable() or c in "\t\n\r" for c in text)


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None


def onnx_model(head: bytes) -> bool:
    """A protobuf ModelProto: ir_version first, then known fields with their wire types."""
    if not head.startswith(b"\x08"):
        return False
    pos, fields = 0, 0
    while pos < len(head) and fields < 4:
        key = _varint(head, pos)
        if key is None:
            return fields >= 2
        (tag, pos), number, wire = key, key[0] >> 3, key[0] & 7
        if _ONNX_FIELDS.get(number) != wire:
            return False
        if wire == 0:
            step = _varint(head, pos)
            if step is None:
                return False
            if number == 1 and not 1 <= step[0] <= 64:
                return False
            pos = step[1]
        else:
            length = _varint(head, pos)
            if length is None:
                return False
            pos = length[1] + length[0]
        fields += 1
        del tag
    return fields >= 2


def safetensors_header(head: bytes, size: int) -> int | None:
    """The header length when the file starts like safetensors, else None."""
    if len(head) < 9:
        return None
    (n,) = struct.unpack("<Q", head[:8])
    if 2 <= n <= size - 8 and head[8:9] == b"{":
        return n
    return None


def broken_safetensors(head: bytes, size: int) -> str | None:
    """Why a file that starts like safetensors cannot be read as one, else None.

    A header length of 0, or a JSON header that runs past the end of the file (a cut copy).
    """
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head[:8])
    if n == 0 and size == 8:
        return "safetensors header length is 0 (8 bytes in all): no header, no tensors"
    # Above safetensors' own bound the "length" is other bytes ("template{" is text).
    if head[8:9] == b"{" and size - 8 < n <= MAX_HEADER_BYTES:
        return (f"safetensors header of {n} bytes runs past the end of the file ({size} bytes): "
                "the file is cut short")
    return None


def compressed(head: bytes) -> tuple[str, object] | None:
    for magic, name, make in COMPRESSED:
        if head.startswith(magic):
            return name, make()
    return None


def tar_members(fh: BinaryIO) -> dict[str, tarfile.TarInfo] | None:
    """The members torch's tar loader would see, or None when ``tarfile`` cannot open it."""
    fh.seek(0)
    try:
        with tarfile.open(fileobj=fh, mode="r:") as tar:
            return {m.name: m for m in tar.getmembers()}
    except (tarfile.TarError, EOFError, OSError, ValueError):
        return None
    finally:
        fh.seek(0)
