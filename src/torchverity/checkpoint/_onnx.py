"""ONNX models as weight files: their initializers listed and fingerprinted (extra ``onnx``).

Read with ``onnx.load(load_external_data=False)``: protobuf parsing runs nothing
from the file. Initializers become the fingerprint's entries by name, so the
fingerprint covers every weight the exported graph holds. Listing and fingerprinting
need no torch (numpy arrays hashed as torch would hash the same tensors); torch is
imported only for initializers of a dtype numpy does not share with torch (bfloat16).

Initializers kept in an external data file (``torch.onnx.export`` writes
``model.onnx.data`` beside ``model.onnx`` for all but tiny models) are read here rather
than by onnx's loader, so that each one's ``location`` is checked before any file is
opened: a plain relative name inside the model's folder, reached through no link that
leaves it (a hub cache snapshot's link to its own blob excepted), its byte range within
the file. Their bytes stream through the hash; only the torch fallback holds them.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import TYPE_CHECKING, Any

from torchverity._formats import open_regular, open_regular_raw
from torchverity.errors import FormatError, require_extra, shell_path, unreadable

if TYPE_CHECKING:
    from torchverity.checkpoint._fp_record import Fingerprint

# numpy dtypes whose name, element size and bytes are torch's too
_SHARED_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                            "float32", "float64", "complex64", "complex128"})

_CHUNK = 8 << 20  # external data streams through the hash in pieces of this size
_REEXPORT = "re-export the model (torch.onnx.export) or restore the file from a verified copy"


class ExternalDataError(FormatError):
    """An ONNX model's external data is missing, cut short, unreadable or outside its
    folder: the model file itself may be intact, so the step names the data file."""


def _unreadable(data: Path, exc: OSError) -> ExternalDataError:
    found = unreadable(data, exc)
    return ExternalDataError(found.message, path=data, hint=found.hint)


def is_onnx(path: Path) -> bool:
    """An ``.onnx`` name and a protobuf ModelProto start (field 1, ir_version, a varint)."""
    if path.suffix.lower() != ".onnx" or not path.is_file():
        return False
    with open(path, "rb") as fh:
        return fh.read(1) == b"\x08"


def onnx_initializers(path: Path) -> dict[str, Any]:
    """Every initializer of the graph (and its subgraphs' top level) as a CPU tensor."""
    import torch

    return {name: torch.from_numpy(array.copy()) for name, array in _arrays(path).items()}


@dataclass(frozen=True)
class _External:
    """Where an initializer's bytes lie: ``length`` bytes at ``offset`` of ``file``."""

    file: Path
    offset: int
    length: int


def _load(path: Path) -> Any:
    onnx = require_extra("onnx", extra="onnx", feature=f"reading {path.name}")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise FormatError(f"{path}: not a readable ONNX model: {exc}", path=path,
                          hint=_REEXPORT) from None


def _is_external(init: Any) -> bool:
    from onnx import TensorProto

    return bool(init.data_location == TensorProto.EXTERNAL)


def _arrays(path: Path) -> dict[str, Any]:
    from onnx import TensorProto, numpy_helper

    tensors = {}
    for init in _load(path).graph.initializer:
        if _is_external(init):
            # The torch fallback builds every tensor in memory anyway: read this one's bytes
            # (checked as the streaming path checks them) into an inline copy of it.
            where = _external(path, init)
            inline = TensorProto()
            inline.CopyFrom(init)
            del inline.external_data[:]
            inline.data_location = TensorProto.DEFAULT
            inline.raw_data = _read_range(where)
            init = inline
        tensors[init.name] = numpy_helper.to_array(init)
    return tensors


def _external(path: Path, init: Any) -> _External:
    """The checked place of an external initializer's bytes; an error naming the model,
    the initializer and the data file when the place is unsafe, missing or short."""
    entries = {e.key: e.value for e in init.external_data}
    where = f"{path}: initializer '{init.name}'"
    location = entries.get("location", "")
    _check_location(path, where, location)
    data = path.parent / location
    try:
        offset = int(entries.get("offset", "0"))
        length = int(entries["length"]) if "length" in entries else None
    except ValueError:
        raise ExternalDataError(f"{where}: external data offset or length is not a number "
                                f"({entries.get('offset')!r}, {entries.get('length')!r})",
                                path=path, hint=_REEXPORT) from None
    if offset < 0 or (length is not None and length < 0):
        raise ExternalDataError(f"{where}: external data offset or length is negative",
                                path=path, hint=_REEXPORT)
    size = _data_file_size(path, where, data)
    expected = _expected_nbytes(init)
    if length is None:
        length = expected if expected is not None else size - offset
    if expected is not None and length != expected:
        raise ExternalDataError(
            f"{where}: its external data length is {length} bytes but its dtype and shape "
            f"({list(init.dims)}) take {expected}", path=path, hint=_REEXPORT)
    if offset + length > size:
        raise ExternalDataError(
            f"{data}: holds {size} bytes, but {where} needs bytes {offset} to "
            f"{offset + length}: the data file is incomplete or from another export",
            path=data,
            hint=f"copy {shell_path(data.name)} again from where the model was exported or "
                 f"downloaded, beside {shell_path(path)}")
    return _External(data, offset, length)


def _check_location(path: Path, where: str, location: str) -> None:
    """Refuse a location that names no file, or one outside the model's folder."""
    hint = ("re-export the model with its data file beside it (torch.onnx.export writes "
            "MODEL.onnx.data there); an ONNX file whose data lies elsewhere is not read")
    if not location or "\0" in location:
        raise ExternalDataError(f"{where}: external data has no file name", path=path, hint=hint)
    posix, windows = PurePosixPath(location), PureWindowsPath(location)
    if (posix.is_absolute() or windows.is_absolute() or windows.drive
            or location.startswith(("/", "\\"))):
        raise ExternalDataError(f"{where}: external data location {location!r} is an absolute "
                                "path, outside the model's folder; it was not read", path=path,
                                hint=hint)
    if ".." in posix.parts or ".." in windows.parts:
        raise ExternalDataError(f"{where}: external data location {location!r} leaves the "
                                "model's folder; it was not read", path=path, hint=hint)
    folder = path.parent
    data = folder / location
    from torchverity.provenance._hub_paths import blob_link

    # A hub cache snapshot links each file to its repository's blob: that link is the
    # hub's, not the model's, and leads to the repository's own content.
    if blob_link(folder, location):
        return
    inside = os.path.realpath(folder)
    if os.path.commonpath([inside, os.path.realpath(data)]) != inside:
        raise ExternalDataError(
            f"{where}: external data location {location!r} is a link leading outside the "
            "model's folder; it was not read", path=path,
            hint=f"replace the link with a copy of the file it points to (cp --remove-"
                 f"destination \"$(readlink -f {shell_path(data)})\" {shell_path(data)})")


def _data_file_size(path: Path, where: str, data: Path) -> int:
    try:
        st = data.stat()
    except FileNotFoundError:
        raise ExternalDataError(
            f"{where}: stored in the external data file {data}, which does not exist",
            path=data,
            hint=f"copy {shell_path(data.name)} from where the model was exported or "
                 f"downloaded into {shell_path(data.parent)} (torch.onnx.export writes it "
                 "beside the .onnx file)") from None
    except OSError as exc:
        raise _unreadable(data, exc) from None
    if not stat.S_ISREG(st.st_mode):
        raise ExternalDataError(f"{where}: its external data file {data} is not a regular file",
                                path=data, hint=f"put the data file itself at {shell_path(data)}")
    return st.st_size


def _expected_nbytes(init: Any) -> int | None:
    """The bytes an initializer's dtype and shape take; None for a dtype whose elements
    are not whole bytes (4-bit types) or have no fixed size (strings)."""
    from onnx import TensorProto

    packed = {getattr(TensorProto, n, None) for n in ("INT4", "UINT4", "FLOAT4E2M1")}
    if init.data_type in (TensorProto.STRING, TensorProto.UNDEFINED) or init.data_type in packed:
        return None
    itemsize = _itemsize(init)
    if itemsize is None:
        return None
    n = 1
    for d in init.dims:
        n *= int(d)
    return n * itemsize


def _itemsize(init: Any) -> int | None:
    from onnx import helper

    try:
        return int(helper.tensor_dtype_to_np_dtype(init.data_type).itemsize)
    except (KeyError, ValueError, TypeError):
        return None


def _read_range(where: _External) -> bytes:
    try:
        with open_regular(where.file) as fh:
            fh.seek(where.offset)
            data = fh.read(where.length)
    except OSError as exc:
        raise _unreadable(where.file, exc) from None
    if len(data) != where.length:  # shrank since its size was checked
        raise ExternalDataError(f"{where.file}: ends before byte {where.offset + where.length}",
                                path=where.file, hint="copy the data file again, then retry")
    return data


def _stream_range(where: _External, hasher: Any) -> None:
    """Feed ``where``'s bytes to ``hasher`` through one bounded buffer."""
    buffer = bytearray(min(_CHUNK, max(where.length, 1)))
    view = memoryview(buffer)
    left = where.length
    try:
        with open_regular_raw(where.file) as fh:
            fh.seek(where.offset)
            while left:
                n = fh.readinto(view[:min(left, len(buffer))]) or 0
                if n == 0:
                    raise ExternalDataError(
                        f"{where.file}: ends before byte {where.offset + where.length}",
                        path=where.file, hint="copy the data file again, then retry")
                hasher.update(view[:n])
                left -= n
    except OSError as exc:
        raise _unreadable(where.file, exc) from None


Row = tuple[str, str, tuple[int, ...], int]


def onnx_contents(path: Path, algo: str) -> tuple[list[Row], Fingerprint] | None:
    """``([(name, dtype, shape, nbytes)], fingerprint)`` of the initializers, without torch;
    None when one has a dtype numpy does not share with torch (then
    :func:`onnx_initializers` reads them)."""
    from onnx import numpy_helper

    from torchverity.checkpoint._fp_record import TensorDigest, from_entries, plain_tensor_hasher
    from torchverity.checkpoint._st_fingerprint import THREADED_BYTES

    model = _load(path)
    inits = list(model.graph.initializer)
    if any(_dtype_name(i) not in _SHARED_DTYPES for i in inits):
        return None
    rows, entries = [], []
    for init in inits:
        dtype, shape = _dtype_name(init), tuple(int(n) for n in init.dims)
        if _is_external(init):
            where = _external(path, init)
            hasher = plain_tensor_hasher(init.name, dtype, shape, where.length, algo,
                                         threads=where.length >= THREADED_BYTES)
            _stream_range(where, hasher)
            nbytes = where.length
        else:
            array = numpy_helper.to_array(init)
            # Little-endian as the fingerprint hashes them; the array's bytes viewed, not
            # copied, where they already are.
            array = array.astype(array.dtype.newbyteorder("<"), copy=False)
            data = _byte_view(array)
            hasher = plain_tensor_hasher(init.name, dtype, shape, data.nbytes, algo)
            hasher.update(data)
            nbytes = data.nbytes
        rows.append((init.name, dtype, shape, nbytes))
        entries.append(TensorDigest(init.name, dtype, shape, hasher.hexdigest()))
    return rows, from_entries(algo, entries)


def _dtype_name(init: Any) -> str:
    from onnx import helper

    try:
        return str(helper.tensor_dtype_to_np_dtype(init.data_type).name)
    except (KeyError, ValueError, TypeError):
        return ""


def _byte_view(array: Any) -> memoryview:
    import numpy as np

    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
