"""Turn a legacy full-pickle checkpoint into a clean state_dict without running its code.

``migrate`` scans the file first (:mod:`torchverity.scan`), then unpickles it
with an *inert* unpickler: only torch's weights_only allowlist and a few data
types (numpy arrays, collections, builtin types, ``argparse.Namespace``) are
resolved; every other global becomes an inert placeholder class that stores
the arguments and state the pickle hands it and runs nothing. Storages are
rebuilt by torch itself from the archive's raw data (its own
``persistent_load``), because the inert unpickler is passed to ``torch.load``
as its ``pickle_module``.

The tensors come out as a flat state_dict: whole ``nn.Module`` objects give
the names ``model.state_dict()`` would, optimizer state is named after the
parameters it belongs to, and all other non-tensor data (epoch, config,
hyperparameters, Namespace) goes to meta.json as JSON, with tensors referred
to by name. The output is written by :func:`torchverity.save` (sidecar,
fingerprint, meta.json) and every tensor is read back and compared bit for bit.

Files with globals that run code are refused; ``trust_sha256`` (the file's
SHA-256) allows a real unpickler for files you trust.
"""

from __future__ import annotations

import base64
import math
import os
import pickle
import types
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from torchverity.errors import FormatError, IntegrityError, UnsafeFileError, UsageError
from torchverity.pickles._scan import DANGEROUS, MALFORMED, ScanResult, scan_file

_MIGRATABLE = ("torch-zip", "torch-legacy", "pickle")
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
_BYTES_IN_META = 1 << 16


# ------------------------------------------------------------ inert unpickler


class Inert:
    """Base of the placeholder classes: stores what the pickle gives it, runs nothing."""

    _tv_name: ClassVar[str] = "?"
    _tv_args: tuple[Any, ...] = ()
    _tv_state: Any = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:
        obj = object.__new__(cls)
        obj._tv_args = args + ((kwargs,) if kwargs else ())
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # REDUCE calls the class: the arguments were kept by __new__

    def __setstate__(self, state: Any) -> None:
        self._tv_state = state

    def append(self, item: Any) -> None:
        self.__dict__.setdefault("_tv_items", []).append(item)

    def extend(self, items: Any) -> None:
        self.__dict__.setdefault("_tv_items", []).extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("_tv_dict", {})[key] = value

    def __call__(self, *args: Any, **kwargs: Any) -> Inert:
        # A payload may call what an earlier call returned: record that call, run nothing.
        call = type(f"{type(self).__name__}()", (Inert,), {"_tv_name": f"{self._tv_name}(...)"})
        return call(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<inert {self._tv_name}>"


def _real_globals() -> dict[str, Any]:
    """Name -> object for everything the inert unpickler resolves for real."""
    from torch import _weights_only_unpickler as wo

    table: dict[str, Any] = dict(wo._get_allowed_globals())
    for name in _EXTRA_REAL:
        obj = _resolve_known(name)
        if obj is not None:
            table[name] = obj
    return table


def _resolve_known(name: str) -> Any:
    import importlib

    module, _, attr = name.rpartition(".")
    if module.startswith("numpy.core"):
        module = module.replace("numpy.core", "numpy._core", 1)  # numpy 1.x spelling
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None


class _InertUnpickler(pickle.Unpickler):
    """Resolves only ``_real_globals``; anything else becomes an inert placeholder class."""

    real: ClassVar[dict[str, Any]] = {}
    placeholders: ClassVar[dict[str, type]] = {}

    def find_class(self, module: str, name: str) -> Any:
        import _compat_pickle

        # Python 2 names (``__builtin__.set``) mean what pickle's own lookup maps them to.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        qual = f"{module}.{name}"
        if qual in self.real:
            return self.real[qual]
        cls = self.placeholders.get(qual)
        if cls is None:
            cls = type(name.rpartition(".")[2] or "Unknown", (Inert,), {
                "_tv_name": qual, "__module__": "torchverity.migrate.inert",
            })
            self.placeholders[qual] = cls
        return cls


def _inert_module() -> types.ModuleType:
    """A stand-in for the ``pickle`` module that torch.load accepts as ``pickle_module``."""
    module = types.ModuleType("torchverity_inert_pickle")

    def nested_checkpoint(data: bytes) -> Any:
        # pickle.dumps(tensor) embeds a whole torch.save archive: load it inertly too.
        import io

        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False,
                          pickle_module=module)

    # A subclass per migration: its tables are not shared with concurrent migrations.
    unpickler = type("Unpickler", (_InertUnpickler,), {
        "real": {**_real_globals(), "torch.storage._load_from_bytes": nested_checkpoint},
        "placeholders": {},
    })

    def load(fh: Any, **kwargs: Any) -> Any:
        return unpickler(fh, **kwargs).load()

    module.Unpickler = unpickler  # type: ignore[attr-defined]
    module.load = load  # type: ignore[attr-defined]
    module.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
    return module


def inert_load(path: str | os.PathLike[str], fmt: str) -> tuple[Any, list[str]]:
    """Unpickle without running anything from the file; returns (object, placeholder names)."""
    import warnings

    module = _inert_module()
    with warnings.catch_warnings():
        # Legacy files make torch compare a module's saved source with the placeholder's.
        warnings.filterwarnings("ignore", "Couldn't retrieve source code", UserWarning)
        if fmt == "pickle":
            with open(path, "rb") as fh:
                obj = module.load(fh)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=False, pickle_module=module)
    return obj, sorted(module.Unpickler.placeholders)


# ------------------------------------------------------------ extraction


@dataclass
class _Extractor:
    """Flatten an unpickled object into named tensors plus JSON (tensors by reference)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # id(tensor) -> first name
    skipped: list[str] = field(default_factory=list)
    _active: set[int] = field(default_factory=set)

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, str]:
        known = self.names.get(id(t))
        if known is not None:
            return {"$tensor": known}
        name = path or "tensor"
        while name in self.tensors:
            name += "_"
        self.tensors[name] = t.detach()
        self.names[id(t)] = name
        return {"$tensor": name}

    def value(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else repr(obj)
        if id(obj) in self._active:
            return {"$cycle": path}
        self._active.add(id(obj))
        try:
            return self._compound(obj, path)
        finally:
            self._active.discard(id(obj))

    def _compound(self, obj: Any, path: str) -> Any:
        import numpy as np

        if isinstance(obj, Inert):
            return self._inert(obj, path)
        if isinstance(obj, torch.nn.Module):
            return self._module_real(obj, path)
        if isinstance(obj, torch.optim.Optimizer):
            return {"$class": _qualname(obj), **self.mapping(obj.state_dict(), path)}
        if isinstance(obj, Mapping):
            return self.mapping(obj, path)
        if isinstance(obj, (list, tuple)):
            return [self.value(v, _join(path, str(i))) for i, v in enumerate(obj)]
        if isinstance(obj, (set, frozenset)):
            return {"$set": [self.value(v, path) for v in sorted(obj, key=repr)]}
        if isinstance(obj, np.ndarray):
            return self._ndarray(obj, path)
        if isinstance(obj, np.generic):
            return self.value(obj.item(), path)
        if isinstance(obj, (bytes, bytearray)):
            return self._bytes(bytes(obj), path)
        if isinstance(obj, (torch.device, torch.dtype)):
            return str(obj)
        if hasattr(obj, "__dict__") and type(obj).__module__ in ("argparse", "types"):
            return {"$class": _qualname(obj), **self.mapping(vars(obj), path)}
        return {"$repr": repr(obj)[:200]}

    def mapping(self, obj: Mapping[Any, Any], path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, val in obj.items():
            name = self._key(key)
            out[name] = self.value(val, _join(path, name))
        return out

    def _key(self, key: Any) -> str:
        if isinstance(key, torch.Tensor):
            return self.names.get(id(key), f"<tensor {tuple(key.shape)}>")
        return key if isinstance(key, str) else str(key)

    def _ndarray(self, arr: Any, path: str) -> Any:
        if arr.dtype.hasobject:
            return [self.value(v, _join(path, str(i))) for i, v in enumerate(arr.ravel().tolist())]
        return {"$ndarray": self.tensor(torch.from_numpy(arr.copy()), path)["$tensor"]}

    def _bytes(self, data: bytes, path: str) -> Any:
        if len(data) > _BYTES_IN_META:
            self.skipped.append(f"{path}: {len(data)} bytes of raw data (not JSON)")
            return {"$bytes": len(data)}
        return {"$base64": base64.b64encode(data).decode("ascii")}

    def _inert(self, obj: Inert, path: str) -> Any:
        state = obj._tv_state
        if isinstance(state, Mapping) and "_parameters" in state and "_modules" in state:
            return self._module_state(obj._tv_name, state, path)
        out: dict[str, Any] = {"$class": obj._tv_name}
        if obj._tv_args:
            out["args"] = self.value(list(obj._tv_args), _join(path, "args"))
        if isinstance(state, Mapping):
            out.update(self.mapping(state, path))
        elif state is not None:
            out["state"] = self.value(state, path)
        extra = obj.__dict__
        if "_tv_items" in extra:
            out["items"] = self.value(extra["_tv_items"], path)
        if "_tv_dict" in extra:
            out["dict"] = self.mapping(extra["_tv_dict"], path)
        return out

    def _module_state(self, cls_name: str, state: Mapping[str, Any], path: str) -> Any:
        """A pickled nn.Module: tensors named exactly as ``module.state_dict()`` names them."""
        transient = state.get("_non_persistent_buffers_set") or set()
        for kind in ("_parameters", "_buffers"):
            for name, t in (state.get(kind) or {}).items():
                if isinstance(t, torch.Tensor) and name not in transient:
                    self.tensor(t, _join(path, name))
        config = {
            k: self.value(v, _join(path, k)) for k, v in state.items()
            if not k.startswith("_") and k != "training"
            and isinstance(v, (int, float, str, bool, type(None), tuple, list))
        }
        children = {
            name: self.value(child, _join(path, name))
            for name, child in (state.get("_modules") or {}).items() if child is not None
        }
        return {"$class": cls_name, "config": config, "modules": children}

    def _module_real(self, module: torch.nn.Module, path: str) -> Any:
        for name, t in module.state_dict(keep_vars=True).items():
            self.tensor(t, _join(path, name))
        return {"$class": _qualname(module)}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


# ------------------------------------------------------------ checks


def _check_archive_crcs(path: Path) -> int:
    """CRC-32 of every stored tensor record against the archive (torch.load never checks)."""
    checked = 0
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if "/data/" not in info.filename or info.filename.endswith(".pkl"):
                    continue
                with archive.open(info) as fh:
                    # zipfile checks the CRC when the entry has been read to its end.
                    while fh.read(1 << 22):
                        pass
                checked += 1
    except zipfile.BadZipFile as exc:
        raise IntegrityError(
            f"{path}: tensor data in the archive is damaged: {exc}", path=path,
            hint=f"restore a good copy (torchverity verify {path} checks it against its sidecar)",
        ) from None
    return checked


def _writable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views and shared storages become compact copies (safetensors needs that); others stay."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        storage = t.untyped_storage()
        compact = (t.is_contiguous() and t.storage_offset() == 0
                   and storage.nbytes() == t.numel() * t.element_size())
        key = storage.data_ptr()
        out[name] = t if compact and key not in seen else t.contiguous().clone()
        seen.add(key)
    return out


def _verify_output(target: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    from torchverity._tensors import byte_view
    from torchverity.checkpoint._load import load

    loaded = load(target, sidecar="require")
    missing = sorted(set(tensors) - set(loaded))
    differ = [
        name for name, t in tensors.items()
        if name in loaded and (loaded[name].dtype != t.dtype or loaded[name].shape != t.shape
                               or not torch.equal(byte_view(loaded[name]), byte_view(t)))
    ]
    if missing or differ:
        raise IntegrityError(
            f"{target}: migrated tensors differ from the source: {(missing + differ)[:5]}",
            path=target, tensors=missing + differ,
            hint="the output is not trustworthy: delete it and report this",
        )


# ------------------------------------------------------------ public API


@dataclass(frozen=True)
class MigrateResult:
    """What ``migrate`` wrote and how it got there."""

    source: str
    target: str
    mode: str  # "inert" (nothing from the file ran) or "trusted" (a real unpickler, by digest)
    tensors: int
    placeholders: tuple[str, ...]
    digest: str
    fingerprint: str
    sidecar: str | None
    meta_path: str | None
    verified: bool
    crc_checked: int = 0
    skipped: tuple[str, ...] = ()
    scan_verdict: str = ""


def _refuse(scan: ScanResult, path: Path) -> None:
    if scan.verdict == MALFORMED:
        raise FormatError(f"{path}: cannot be migrated: {scan.reason}", path=path,
                          hint=f"torchverity scan {path} shows what is wrong")
    if scan.format not in _MIGRATABLE:
        raise UsageError(f"{path}: {scan.format} files are not migrated (no torch checkpoint)",
                         hint="migrate reads torch .pt/.pth/.bin/.ckpt files and plain pickles")
    dangerous = scan.names(DANGEROUS)
    if dangerous:
        raise UnsafeFileError(
            f"{path}: refused: the file holds globals that run code or touch the system: "
            f"{', '.join(dangerous[:5])}",
            path=path, globals_found=dangerous,
            hint=f"do not load it; if you made it yourself, torchverity migrate {path} NEW "
                 "--trust-sha256 <its sha256>",
        )


def _is_torchscript(path: Path, fmt: str) -> bool:
    if fmt != "torch-zip":
        return False
    with zipfile.ZipFile(path) as archive:
        return any(n.endswith("/constants.pkl") for n in archive.namelist())


def _check_trust(path: Path, trust_sha256: str) -> None:
    from torchverity.digest import digest_file

    actual = digest_file(path, "sha256").hexdigest
    if actual != trust_sha256.lower():
        raise IntegrityError(
            f"{path}: sha256 is {actual}, not the trusted {trust_sha256}: refusing to unpickle",
            path=path, expected=trust_sha256.lower(), actual=actual,
            hint="--trust-sha256 must name this exact file (sha256sum shows it)",
        )


def migrate(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    trust_sha256: str | None = None,
    algo: str = "sha256",
) -> MigrateResult:
    """Write ``target`` (.safetensors or .pt) with the tensors of ``source`` and a meta.json."""
    from torchverity.checkpoint._save import save

    src, dst = Path(source), Path(target)
    if src.resolve() == dst.resolve():
        raise UsageError("migrate writes a new file: give a different target path")
    scan = scan_file(src)
    if trust_sha256 is None:
        _refuse(scan, src)
    else:
        _check_trust(src, trust_sha256)
    if _is_torchscript(src, scan.format) and trust_sha256 is None:
        raise UsageError(f"{src}: a TorchScript archive holds code; migrate does not run it",
                         hint="load it with torch.jit.load only if you trust it")
    crc_checked = _check_archive_crcs(src) if scan.format == "torch-zip" else 0
    obj, placeholders, mode = _unpickle(src, scan, trust_sha256)
    extractor = _Extractor()
    meta_tree = extractor.value(obj, "")
    if not extractor.tensors:
        raise FormatError(f"{src}: no tensors found to migrate", path=src)
    tensors = _writable(extractor.tensors)
    meta = {"source": src.name, "mode": mode, "placeholders": placeholders,
            "content": meta_tree, "skipped": extractor.skipped}
    report = save(tensors, dst, meta=meta, algo=algo)
    _verify_output(dst, tensors)
    return MigrateResult(
        os.fspath(src), os.fspath(dst), mode, len(tensors), tuple(placeholders), report.digest,
        report.fingerprint, report.sidecar, report.meta_path, True, crc_checked,
        tuple(extractor.skipped), scan.verdict,
    )


def _unpickle(src: Path, scan: ScanResult, trust_sha256: str | None) -> tuple[Any, list[str], str]:
    try:
        obj, placeholders = inert_load(src, scan.format)
        return obj, placeholders, "inert"
    except Exception as exc:
        if trust_sha256 is None:
            raise UnsafeFileError(
                f"{src}: inert migration is impossible ({type(exc).__name__}: {exc}); a real "
                "unpickler would be needed, which runs the file's code",
                path=src, globals_found=scan.names(),
                hint=f"only for a file you trust: torchverity migrate {src} NEW "
                     "--trust-sha256 <its sha256>",
            ) from None
    # The caller named this file's digest (checked above): a real unpickler may run it.
    return torch.load(src, map_location="cpu", weights_only=False), [], "trusted"

