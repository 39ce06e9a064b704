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
_HTML = re.compile(  # a UTF-8 byte order mark first is still a page (Windows tools add one)
    rb"^(?:\xef\xbb\xbf)?\s*(?:<!doctype html|<html|<head|<body|<\?xml[^>]*>\s*<html)", re.I)
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


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# msgpack's map markers: fixmap of 1-15 entries, map16, map32 (an empty fixmap, 0x80, is
# pickle's PROTO: never taken for msgpack here).
_MSGPACK_MAPS = frozenset(range(0x81, 0x90)) | {0xDE, 0xDF}
_MSGPACK_MAP_HEADER = {0xDE: 3, 0xDF: 5}


def _msgpack_str(head: bytes, pos: int) -> bool:
    """A msgpack string (fixstr, str8/16/32) of UTF-8 at ``pos`` (cut by the sample: fine)."""
    if pos >= len(head):
        return False
    marker = head[pos]
    if 0xA0 <= marker <= 0xBF:
        start, n = pos + 1, marker & 0x1F
    elif marker in (0xD9, 0xDA, 0xDB):
        width = {0xD9: 1, 0xDA: 2, 0xDB: 4}[marker]
        start = pos + 1 + width
        n = int.from_bytes(head[pos + 1 : start], "big")
    else:
        return False
    text = head[start : start + n]
    if len(text) < n:  # the sample ends inside the string: a character may be cut there
        text = text[: max(0, len(text) - 3)]
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def flax_msgpack(head: bytes) -> bool:
    """A msgpack map whose first key is a string: what ``flax.serialization.to_bytes`` writes
    (the parameter tree, keyed by module names)."""
    if not head or head[0] not in _MSGPACK_MAPS:
        return False
    return _msgpack_str(head, 1 + _MSGPACK_MAP_HEADER.get(head[0], 0))


def sentencepiece_model(head: bytes) -> bool:
    """A sentencepiece ModelProto: its first field is ``pieces`` (1, a message), whose first
    field is the piece (1, a UTF-8 string), then its score (2, a float) and type (3)."""
    if not head.startswith(b"\x0a"):
        return False
    outer = _varint(head, 1)
    if outer is None or outer[0] < 2:
        return False
    end = outer[1] + outer[0]
    pos = outer[1]
    if head[pos : pos + 1] != b"\x0a":
        return False
    inner = _varint(head, pos + 1)
    if inner is None or inner[1] + inner[0] > min(end, len(head)):
        return False
    try:
        head[inner[1] : inner[1] + inner[0]].decode("utf-8")
    except UnicodeDecodeError:
        return False
    pos = inner[1] + inner[0]
    while pos < min(end, len(head)):  # score (fixed32) and type (varint), nothing else
        if head[pos] == 0x15:
            pos += 5
        elif head[pos] == 0x18 and (kind := _varint(head, pos + 1)) is not None:
            pos = kind[1]
        else:
            return False
    return pos == end or end > len(head)


def no_pickle_format(head: bytes) -> str | None:
    """The format of a non-pickle file Hugging Face repos hold beside the weights, known by
    its own structure: ``"hdf5"`` (tf_model.h5), ``"msgpack"`` (flax_model.msgpack),
    ``"sentencepiece"`` (tokenizer.model); else None. Only a name for what the file is: that
    no unpickler runs anything in it is the walk's to show."""
    if head.startswith(HDF5_SIGNATURE):
        return "hdf5"
    if flax_msgpack(head):
        return "msgpack"
    if sentencepiece_model(head):
        return "sentencepiece"
    return None


def onnx_external_data(path: str, *, max_bytes: int = 1 << 28) -> str | None:
    """The ``.onnx`` model beside ``path`` that stores tensors in it (external data: raw
    tensor bytes, ``model.onnx.data``), found by the ``location`` entry its TensorProtos
    carry; None when no model beside it names it (models over ``max_bytes`` are not read)."""
    import os

    folder, name = os.path.split(path)
    wanted = name.encode("utf-8", "surrogateescape")
    # StringStringEntryProto {key: "location", value: <the file name>}, as protobuf writes it.
    needles = [b"\x0a\x08location\x12" + _encode_varint(len(v)) + v
               for v in (wanted, b"./" + wanted)]
    try:
        siblings = sorted(e.path for e in os.scandir(folder or ".")
                          if e.name.lower().endswith(".onnx") and e.is_file())
    except OSError:
        return None
    for model in siblings[:32]:
        if _holds(model, needles, max_bytes):
            return os.path.basename(model)
    return None


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _holds(path: str, needles: list[bytes], max_bytes: int) -> bool:
    from torchverity._formats import open_regular

    overlap = max(len(n) for n in needles)
    try:
        with open_regular(path) as fh:
            tail, read = b"", 0
            while read < max_bytes:
                chunk = fh.read(1 << 20)
                if not chunk:
                    return False
                window = tail + chunk
                if any(n in window for n in needles):
                    return True
                tail, read = window[-overlap:], read + len(chunk)
    except Exception:  # unreadable beside the file: it names nothing we can see
        return False
    return False


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
