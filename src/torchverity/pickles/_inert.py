"""Unpickle torch checkpoints without running anything from them, without ``torch.load``.

Only torch's weights_only allowlist and a few data types are resolved for real;
every other global becomes an inert placeholder class that stores the arguments
and state the pickle hands it. Storages are rebuilt here from the archive's raw
records: zip checkpoints (TorchScript archives included: their ``data.pkl`` is
read like any other, their code is never compiled), the legacy magic-number
format, plain pickles, and archives nested by ``torch.storage._load_from_bytes``
(read by this same loader, never by ``torch.load`` or ``torch.jit.load``).
A file pickled at protocol 0 holds its persistent ids as text, the repr of torch's
tuple, which no ``torch.load`` reads: :mod:`torchverity.pickles._text_pids` parses it
by torch's exact grammar, and any other text is refused.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import torch

from torchverity.errors import FormatError, UsageError
from torchverity.pickles._placeholders import Inert as Inert
from torchverity.pickles._placeholders import InertUnpickler
from torchverity.pickles._text_pids import TextModuleId, parse_legacy_pid, parse_zip_pid

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_NP_CORE = ("numpy.core", "numpy._core")
_EXTRA_REAL = {
    *(f"{c}.multiarray.{n}" for c in _NP_CORE for n in ("_reconstruct", "scalar")),
    *(f"{c}.numeric._frombuffer" for c in _NP_CORE),
    "numpy.ndarray", "numpy.dtype", "argparse.Namespace", "types.SimpleNamespace",
    "collections.OrderedDict", "collections.defaultdict", "collections.Counter",
    "collections.deque", "copyreg._reconstructor",
    *(f"builtins.{n}" for n in ("set", "frozenset", "list", "dict", "tuple", "int", "float",
                                "complex", "bytes", "bytearray", "str", "bool", "slice",
                                "range", "object")),
}
# TorchScript's pickles tag lists with these; each returns its argument.
_TORCHSCRIPT_TAGS = ("build_intlist", "build_tensorlist", "build_doublelist", "build_boollist",
                     "build_complexlist")


def _resolve_known(name: str) -> Any:
    import importlib

    module, _, attr = name.rpartition(".")
    if module.startswith("numpy.core"):
        module = module.replace("numpy.core", "numpy._core", 1)  # numpy 1.x spelling
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None


def _identity(value: Any, *_: Any) -> Any:
    return value


def _real_globals(nested: Callable[[bytes], Any]) -> dict[str, Any]:
    """Name -> object for everything the inert unpickler resolves for real."""
    from torch import _weights_only_unpickler as wo

    table: dict[str, Any] = dict(wo._get_allowed_globals())
    for name in _EXTRA_REAL:
        obj = _resolve_known(name)
        if obj is not None:
            table[name] = obj
    table.update({f"torch.jit._pickle.{n}": _identity for n in _TORCHSCRIPT_TAGS})
    table["torch.jit._pickle.restore_type_tag"] = _identity
    table["torch.storage._load_from_bytes"] = nested
    return table


def _dtype_of(storage_type: Any) -> torch.dtype:
    if storage_type is torch.UntypedStorage:
        return torch.uint8
    dtype = getattr(storage_type, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"storage record of an unknown type {storage_type!r}")
    return dtype


def _typed(untyped: torch.UntypedStorage, dtype: torch.dtype) -> Any:
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


class InertLoader:
    """One migration's inert reader: its own placeholder table, nested archives included."""

    def __init__(self) -> None:
        self.unpickler: type[InertUnpickler] = type("Unpickler", (InertUnpickler,), {
            "real": _real_globals(self.load_bytes), "placeholders": {},
        })

    @property
    def placeholders(self) -> list[str]:
        return sorted(self.unpickler.placeholders)

    def _unpickle(self, fh: IO[bytes], persistent: Callable[[Any], Any] | None = None) -> Any:
        unpickler = self.unpickler(fh)
        if persistent is not None:
            unpickler.persistent_load = persistent  # type: ignore[method-assign]
        return unpickler.load()

    def load_bytes(self, data: bytes) -> Any:
        """What ``torch.storage._load_from_bytes`` would return, read inertly."""
        return self.load(io.BytesIO(data))

    def load(self, fh: IO[bytes]) -> Any:
        head = fh.read(4)
        fh.seek(0)
        if head == b"PK\x03\x04":
            return self._load_zip(fh)
        return self._load_legacy(fh)

    def load_plain(self, fh: IO[bytes]) -> Any:
        return self._unpickle(fh)

    def _load_zip(self, fh: IO[bytes]) -> Any:
        with zipfile.ZipFile(fh) as archive:
            names = archive.namelist()
            if not names:
                raise FormatError("empty zip archive: no checkpoint inside")
            lookup = {n.lower(): n for n in names}
            prefix = names[0].split("/")[0]

            def record(name: str) -> bytes | None:
                real = lookup.get(f"{prefix}/{name}".lower())
                return archive.read(real) if real is not None else None

            order = record("byteorder")
            if order not in (None, b"little"):
                raise UsageError("big-endian checkpoints are not migrated")
            data = record("data.pkl")
            if data is None:
                raise FormatError(f"no {prefix}/data.pkl in the archive")
            loaded: dict[str, Any] = {}

            def persistent(pid: Any) -> Any:
                dtype, key = _zip_storage_id(pid)
                if key not in loaded:
                    raw = record(f"data/{key}")
                    if raw is None:
                        raise FormatError(f"tensor record data/{key} is missing")
                    untyped = torch.frombuffer(bytearray(raw), dtype=torch.uint8) \
                        .untyped_storage() if raw else torch.UntypedStorage(0)
                    loaded[key] = _typed(untyped, dtype)
                return loaded[key]

            return self._unpickle(io.BytesIO(data), persistent)

    def _load_legacy(self, fh: IO[bytes]) -> Any:
        if self._unpickle(fh) != _LEGACY_MAGIC:
            raise FormatError("not a torch checkpoint (no legacy magic number)")
        self._unpickle(fh)  # protocol version
        self._unpickle(fh)  # sys info
        storages = _LegacyStorages(_bytes_left(fh))
        resolve = self.unpickler.resolve

        def persistent(pid: Any) -> Any:
            found = _legacy_id(pid, resolve)
            return storages.get(found) if isinstance(found, _StorageId) else found

        result = self._unpickle(fh, persistent)
        for key in self._unpickle(fh):
            _fill(fh, storages.root(key))
        return result


@dataclass(frozen=True)
class _StorageId:
    """A legacy storage id, as torch pickled it (a tuple) or as protocol 0 spelled it."""

    dtype: torch.dtype
    key: Any
    numel: Any
    view: Any


def _zip_storage_id(pid: Any) -> tuple[torch.dtype, str]:
    """(dtype, record key) of a zip checkpoint's storage id; protocol 0 pickles its repr."""
    if isinstance(pid, str):
        # The dtype's name comes from the parser's allowlist, never from the file.
        parsed = parse_zip_pid(pid)
        return getattr(torch, parsed.dtype), parsed.key
    if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
        raise FormatError(f"unsupported persistent id {str(pid)[:60]}")
    return _dtype_of(pid[1]), str(pid[2])


def _legacy_id(pid: Any, resolve: Callable[[str, str], Any]) -> Any:
    """A legacy persistent id as a :class:`_StorageId`, or the module class it names."""
    if isinstance(pid, str):
        parsed = parse_legacy_pid(pid)
        if isinstance(parsed, TextModuleId):
            return resolve(parsed.module, parsed.name)  # a placeholder, as GLOBAL gives
        # The dtype's name comes from the parser's allowlist, never from the file.
        return _StorageId(getattr(torch, parsed.dtype), parsed.key, parsed.numel, parsed.view)
    if isinstance(pid, tuple) and pid and pid[0] == "module":
        return pid[1]
    if not isinstance(pid, tuple) or len(pid) != 6 or pid[0] != "storage":
        raise FormatError(f"unsupported persistent id {str(pid)[:60]}")
    _, storage_type, key, _, numel, view = pid
    return _StorageId(_dtype_of(storage_type), key, numel, view)


class _LegacyStorages:
    """The storages a legacy pickle names, allocated as first named: their bytes follow."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # the bytes left in the file: no storage record holds more
        self.roots: dict[Any, Any] = {}
        self.views: dict[Any, Any] = {}

    def get(self, pid: _StorageId) -> Any:
        if pid.key not in self.roots:
            if type(pid.numel) is not int or not 0 <= pid.numel * pid.dtype.itemsize <= \
                    self.limit:
                raise FormatError(f"a legacy storage record of {pid.numel!r} elements, which "
                                  f"the {self.limit} bytes left in the file cannot hold")
            nbytes = pid.numel * pid.dtype.itemsize
            self.roots[pid.key] = _typed(torch.UntypedStorage(nbytes), pid.dtype)
        if pid.view is None:
            return self.roots[pid.key]
        view_key, offset, size = pid.view
        if view_key not in self.views:
            base = self.roots[pid.key]._untyped_storage
            start = offset * pid.dtype.itemsize
            self.views[view_key] = _typed(base[start : start + size * pid.dtype.itemsize],
                                          pid.dtype)
        return self.views[view_key]

    def root(self, key: Any) -> Any:
        if key not in self.roots:
            raise FormatError(f"the legacy checkpoint lists storage {str(key)[:40]!r}, which "
                              "its pickle never names")
        return self.roots[key]


def _bytes_left(fh: IO[bytes]) -> int:
    here = fh.tell()
    end = fh.seek(0, io.SEEK_END)
    fh.seek(here)
    return end - here


def _fill(fh: IO[bytes], typed: Any) -> None:
    """A legacy storage record: element count, then the raw bytes."""
    (numel,) = struct.unpack("<q", fh.read(8))
    nbytes = numel * typed.dtype.itemsize
    untyped = typed._untyped_storage
    if nbytes != untyped.nbytes():
        raise FormatError(f"legacy storage record holds {nbytes} bytes, not {untyped.nbytes()}")
    data = fh.read(nbytes)
    if len(data) != nbytes:
        raise FormatError("legacy checkpoint ends inside a storage record")
    if nbytes:
        view = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        torch.empty(0, dtype=torch.uint8).set_(untyped).copy_(view)
