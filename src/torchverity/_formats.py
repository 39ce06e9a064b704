"""What a file is, from its bytes: the torch-free sniffer every reader uses."""

from __future__ import annotations

import errno
import io
import os
import stat
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from torchverity.errors import (
    FormatError,
    InputError,
    no_such_file,
    not_regular,
    restore_step,
    shell_path,
    unreadable,
)

# "pt-legacy": torch.save's pre-1.6 format (a magic-number pickle, then more pickles and the
# raw storages); "pickle": any other pickle stream (pickle.dump, joblib.dump uncompressed),
# which torch.load cannot read: it takes the first pickle for the magic number and stops.
FileFormat = Literal["pt", "pt-legacy", "pickle", "safetensors"]
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on its JSON header
# The legacy magic number as torch.save pickles it with protocols 2-5 (LONG1, STOP); 4 and 5
# put a FRAME opcode before it. Protocols 0 and 1 spell it as text: no PROTO names those
# files, and torchverity.pickles._file_format walks them.
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little") + b"."
_FRAME = b"\x95"


# Opening a FIFO for reading waits for a writer; non-blocking, the open returns at once and
# the file's type is checked on the open descriptor (no window for a swap after a stat).
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def open_regular_raw(path: str | os.PathLike[str]) -> io.FileIO:
    """``path`` opened unbuffered for reading, refused unless it is a regular file: a pipe,
    socket or device raises :class:`InputError` (:func:`~torchverity.errors.not_regular`),
    never blocks; a folder raises IsADirectoryError, a missing file FileNotFoundError."""
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise not_regular(os.fspath(path), mode)
        if _NONBLOCK:
            os.set_blocking(fd, True)
        raw = io.FileIO(fd, "r", closefd=True)
    except BaseException:
        os.close(fd)
        raise
    raw.name = os.fspath(path)  # messages name the path, not the descriptor
    return raw


def open_regular(path: str | os.PathLike[str]) -> io.BufferedReader:
    """:func:`open_regular_raw`, buffered: what ``open(path, "rb")`` gives."""
    return io.BufferedReader(open_regular_raw(path))


def _bz2() -> object:
    import bz2  # imported when a file starts like one: not on every command's start-up

    return bz2.BZ2Decompressor()


def _lzma() -> object:
    import lzma

    return lzma.LZMADecompressor()


# Compression magics as joblib matches them (zlib: any 0x78 byte), with their decompressors.
COMPRESSED: tuple[tuple[bytes, str, Callable[[], object]], ...] = (
    (b"\x1f\x8b", "gzip", lambda: zlib.decompressobj(16 + zlib.MAX_WBITS)),
    (b"BZ", "bz2", _bz2),
    (b"\xfd7zXZ", "xz", _lzma),
    (b"\x5d\x00", "lzma", _lzma),
    (b"\x78", "zlib", zlib.decompressobj),
)


def is_safetensors(path: Path) -> bool:
    """Cheap sniff: a plausible header length followed by ``{``."""
    with open_regular(path) as fh:
        head = fh.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return n <= MAX_HEADER_BYTES


def _opens_with_legacy_magic(head: bytes) -> bool:
    body = head[2:]
    if body[:1] == _FRAME:
        body = body[9:]
    return body.startswith(_LEGACY_MAGIC)


def file_format(path: str | os.PathLike[str]) -> FileFormat:
    """What kind of checkpoint a file is, from its bytes (never its name alone)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a folder", path=p,
                         hint="folders load through their *.index.json: torchverity inspect "
                              f"{shell_path(p)}")
    try:
        with open_regular(p) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(512)
    except FileNotFoundError:
        raise no_such_file(p) from None
    except OSError as exc:
        raise unreadable(p, exc) from None
    if size == 0:
        raise FormatError(f"{p}: file is empty (0 bytes): not a checkpoint", path=p,
                          hint="the save that wrote it was probably interrupted; "
                               "restore the previous checkpoint")
    not_torch = numpy_or_foreign_zip(p, head)
    if not_torch is not None:
        raise not_torch
    if head.startswith(b"PK\x03\x04"):
        return "pt"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pt-legacy" if _opens_with_legacy_magic(head) else "pickle"
    if is_safetensors(p):
        return "safetensors"
    foreign = foreign_format(p, head)
    if foreign is not None:
        raise foreign
    if p.suffix.lower() == ".safetensors" and head[:8] == bytes(8):
        raise FormatError(f"{p}: a damaged .safetensors file: its header length is 0 (the "
                          "header was never written, or was zeroed)", path=p,
                          hint=restore_step(p))
    raise FormatError(
        f"{p}: not a checkpoint (neither a PyTorch zip/pickle nor .safetensors; "
        f"starts with {head[:8]!r})", path=p,
        hint="check the path and how the file was made (the file command names many formats: "
             f"file {shell_path(p)})",
    )


def foreign_format(path: Path, head: bytes | None = None) -> FormatError | None:
    """The error naming a file that is something other than a checkpoint, known from its
    first bytes: a numpy array or archive, a Git LFS pointer or HTML page, an ONNX model,
    a compressed joblib file. None for anything else, checkpoints and damaged files alike."""
    head = _first_bytes(path, head)
    if head is None:
        return None
    if head.startswith(b"\x93NUMPY") or (head.startswith(b"PK\x03\x04")
                                         and _first_zip_entry(head).lower().endswith(".npy")):
        return numpy_or_foreign_zip(path, head)
    broken = broken_download(path, head)
    if broken is not None:
        return broken
    if path.suffix.lower() == ".onnx" and head[:1] == b"\x08":
        return FormatError(
            f"{path}: an ONNX model, not a PyTorch checkpoint: it does not load into a module",
            path=path, hint=f"run it with onnxruntime; torchverity inspect {shell_path(path)} "
                            f"lists its initializers and torchverity fingerprint "
                            f"{shell_path(path)} covers them")
    packed = compressed_pickle(head)
    return None if packed is None else joblib_file_error(path, packed)


def compressed_pickle(head: bytes) -> str | None:
    """The compression (``"zlib"``, ``"gzip"``...) of a file whose first bytes decompress to
    a pickle, as ``joblib.dump(..., compress=...)`` writes it; else None."""
    for magic, name, make in COMPRESSED:
        if not head.startswith(magic):
            continue
        try:
            out = make().decompress(head)  # type: ignore[attr-defined]
        except Exception:  # the decompressor's own error (zlib.error, lzma.LZMAError,
            return None  # OSError...): not this compression
        return name if out[:1] == b"\x80" and out[1:2] in (b"\x02", b"\x03", b"\x04",
                                                             b"\x05") else None
    return None


def joblib_file_error(path: Path, compression: str | None = None) -> FormatError:
    """A joblib file is a pickle, but of numpy arrays read by joblib, never by torch.load."""
    article = "an" if compression in ("xz", "lzma") else "a"
    what = f"{article} {compression}-compressed joblib file (joblib.dump with compress=...)" \
        if compression else "a joblib file (joblib.dump)"
    return FormatError(f"{path}: {what}, not a PyTorch checkpoint: it holds numpy arrays and "
                       "Python objects that torch.load cannot read", path=path,
                       hint=f"torchverity scan {shell_path(path)} names every class joblib.load "
                            "would build; load it with joblib.load only if you trust them")


def _first_zip_entry(head: bytes) -> str:
    if len(head) < 30:
        return ""
    (name_len,) = struct.unpack_from("<H", head, 26)
    return head[30 : 30 + name_len].decode("utf-8", "replace")


def numpy_or_foreign_zip(path: Path, head: bytes) -> FormatError | None:
    """The error for numpy's .npy/.npz files and zips torch.save did not write.

    torch.save puts every zip entry in one folder and torch.load refuses an archive
    whose first entry is not in one, so such a zip is never a torch checkpoint."""
    scan = f"torchverity scan {shell_path(path)}"
    if head.startswith(b"\x93NUMPY"):
        return FormatError(
            f"{path}: a numpy .npy array file (numpy.save), not a PyTorch checkpoint", path=path,
            hint=f"{scan} says whether it holds pickled objects; numpy.load(path, "
                 "allow_pickle=False) reads a plain array")
    if not head.startswith(b"PK\x03\x04") or len(head) < 30:
        return None
    name = _first_zip_entry(head)
    if not name or len(name.encode("utf-8", "replace")) > len(head) - 30 or "/" in name:
        return None
    if name.lower().endswith(".npy"):
        return FormatError(
            f"{path}: a numpy .npz archive (numpy.savez), not a PyTorch checkpoint", path=path,
            hint=f"{scan} says whether its arrays hold pickled objects; numpy.load(path, "
                 "allow_pickle=False) reads plain arrays")
    return FormatError(
        f"{path}: a zip archive torch.save did not write (its first entry {name!r} is not in "
        "a folder, as torch.save's are), so torch.load cannot read it", path=path,
        hint=f"check how the file was made: unzip -l {shell_path(path)} lists its entries")


LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def _first_bytes(path: Path, head: bytes | None) -> bytes | None:
    """``head`` when the caller already read the file's first 512 bytes, else those bytes
    (None when the file cannot be read: the caller's own open reports that)."""
    if head is not None:
        return head
    try:
        with open_regular(path) as fh:
            return fh.read(512)
    except (OSError, InputError):
        return None


# Names a download of weights is saved under; text there is a server's answer instead.
TEXT_DOWNLOAD_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
# The bytes pickle opcodes are spelled with (pickletools.opcodes): an unpickler reads the
# first byte of a stream as an opcode and fails at once on any other.
PICKLE_OPCODES = frozenset(b"().012BCFGIJKLMNPQRSTUVX]abcdeghijlopqrstu}"
                           + bytes(range(0x80, 0x99)))
_BOM = b"\xef\xbb\xbf"


def text_sample(head: bytes) -> str | None:
    """``head`` as text (a UTF-8 byte order mark dropped) when it is printable UTF-8, tabs
    and line ends allowed and a character cut by the end of the sample too; else None."""
    body = head.removeprefix(_BOM)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(body) - 4:
            return None
        text = body[: exc.start].decode("utf-8")
    if not text.strip() or not all(c.isprintable() or c in "\t\n\r" for c in text):
        return None
    return text


def download_kind(path: Path, head: bytes | None = None, *, no_pickle: bool = False,
                  weights: bool = False) -> str | None:
    """``"lfs-pointer"``, ``"html"`` or ``"text"`` when a file is a broken download: a Git
    LFS pointer, an HTML page, or text (a JSON or XML error, a plain message) under a
    weights name (``head``: its first 512 bytes, when already read).

    Text counts only when no unpickler can read it: its first byte is no pickle opcode,
    or the caller has walked it and ``no_pickle`` says every unpickler gives up on it
    before it calls anything (a protocol-0 pickle is printable text too). ``weights``: the
    file holds weights whatever its name (a shard an index names)."""
    head = _first_bytes(path, head)
    if head is None:
        return None
    if head.startswith(LFS_POINTER):
        return "lfs-pointer"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith((b"<!doctype html", b"<html", b"<head", b"<!--")) or b"<html" in text:
        return "html"
    named = weights or path.name.lower().endswith(TEXT_DOWNLOAD_SUFFIXES)
    if named and text_sample(head) is not None and (no_pickle or head[0] not in PICKLE_OPCODES):
        return "text"
    return None


def _text_words(head: bytes) -> str:
    """What a text download is, with its first line: ``JSON: '{"error": ...}'``."""
    text = (text_sample(head) or "").lstrip()
    kind = ("XML" if text.startswith("<") else "JSON" if text.startswith(("{", "[")) else
            "plain text")
    words = " ".join(text.split())  # an XML error's code is on a later line
    return f"{kind}: {words[:100] + ('...' if len(words) > 100 else '')!r}"


def broken_download(path: Path, head: bytes | None = None, *, no_pickle: bool = False,
                    weights: bool = False) -> FormatError | None:
    """The error naming a Git LFS pointer, an HTML page or text saved under a weights name
    (``no_pickle`` and ``weights``: as for :func:`download_kind`)."""
    head = _first_bytes(path, head)
    kind = download_kind(path, head, no_pickle=no_pickle, weights=weights)
    if kind == "text" and head is not None:
        return FormatError(
            f"{path}: a text file ({_text_words(head)}), not the weights: a server's error "
            "message or other text was saved under the weights' name", path=path,
            hint="download the file again from its direct URL (on the Hugging Face Hub: "
                 f".../resolve/<revision>/{path.name}, with a token for gated models)",
        )
    if kind == "lfs-pointer":
        return FormatError(
            f"{path}: a Git LFS pointer file ({path.stat().st_size} bytes), not the weights: "
            "the clone or download fetched the pointer, not the LFS object it names", path=path,
            hint=f"fetch the real file: git lfs install && git lfs pull --include "
                 f"'{path.name}' (or download it again with huggingface_hub)",
        )
    if kind == "html":
        return FormatError(
            f"{path}: an HTML page, not the weights: a login, error or redirect page was "
            "saved under the weights' name", path=path,
            hint="download the file again from its direct URL (on the Hugging Face Hub: "
                 f".../resolve/<revision>/{path.name}, with a token for gated models)",
        )
    return None
