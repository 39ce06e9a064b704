"""What a file is, from its bytes: the torch-free sniffer every reader uses."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Literal

from torchverity.errors import (
    FormatError,
    InputError,
    restore_step,
    shell_path,
    unreadable,
)

FileFormat = Literal["pt", "pt-legacy", "safetensors"]
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on its JSON header


def is_safetensors(path: Path) -> bool:
    """Cheap sniff: a plausible header length followed by ``{``."""
    with open(path, "rb") as fh:
        head = fh.read(9)
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return n <= MAX_HEADER_BYTES


def file_format(path: str | os.PathLike[str]) -> FileFormat:
    """What kind of checkpoint a file is, from its bytes (never its name alone)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a folder", path=p,
                         hint="folders load through their *.index.json: torchverity inspect "
                              f"{shell_path(p)}")
    try:
        size = p.stat().st_size
        with open(p, "rb") as fh:
            head = fh.read(512)
    except FileNotFoundError:
        raise InputError(f"{p}: no such file", path=p, hint="check the path") from None
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
        return "pt-legacy"
    if is_safetensors(p):
        return "safetensors"
    broken = broken_download(p)
    if broken is not None:
        raise broken
    if p.suffix.lower() == ".onnx" and head[:1] == b"\x08":
        raise FormatError(
            f"{p}: an ONNX model, not a PyTorch checkpoint: it does not load into a module",
            path=p, hint=f"run it with onnxruntime; torchverity inspect {shell_path(p)} lists its "
                         f"initializers and torchverity fingerprint {shell_path(p)} covers them",
        )
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
    (name_len,) = struct.unpack_from("<H", head, 26)
    name = head[30 : 30 + name_len].decode("utf-8", "replace")
    if name_len == 0 or name_len > len(head) - 30 or "/" in name:
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


def download_kind(path: Path) -> str | None:
    """``"lfs-pointer"`` or ``"html"`` when a file is one of the two common broken downloads."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(512)
    except OSError:
        return None
    if head.startswith(LFS_POINTER):
        return "lfs-pointer"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith((b"<!doctype html", b"<html", b"<head", b"<!--")) or b"<html" in text:
        return "html"
    return None


def broken_download(path: Path) -> FormatError | None:
    """The error naming a Git LFS pointer or an HTML page saved under a weights name."""
    kind = download_kind(path)
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
