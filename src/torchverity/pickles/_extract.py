"""Flatten an inertly read checkpoint into named tensors plus JSON-ready data.

Used by ``migrate`` (which writes both) and by ``inert_tensors`` (which lets
inspect and fingerprint list the tensors of a file torch's weights_only loader
refuses, or that the scan finds unsafe: nothing from the file runs either way).
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchverity._formats import joblib_file_error
from torchverity.errors import FormatError, UnsafeFileError, UsageError, shell_path
from torchverity.pickles._inert import Inert, InertLoader
from torchverity.pickles._unwrap import NOT_CONFIG, hyper_value, union_text

if TYPE_CHECKING:
    from torchverity.pickles._scan import ScanResult

_BYTES_IN_META = 1 << 16


def inert_load(path: str | os.PathLike[str], fmt: str) -> tuple[Any, list[str]]:
    """Unpickle without running anything from the file; returns (object, placeholder names)."""
    loader = InertLoader()
    with open(path, "rb") as fh:
        obj = loader.load_plain(fh) if fmt == "pickle" else loader.load(fh)
    return obj, loader.placeholders


def inert_read(path: Path, scan: ScanResult) -> tuple[Any, list[str]]:
    """:func:`inert_load` of a scanned file, its reader's failures as typed errors: a file
    crafted to trip the reader (a zip whose names disagree) is reported, never a crash."""
    import pickle
    import struct
    import zipfile

    # A file the scan finds unsafe was not made by a save that went wrong: not "restore it".
    hint = (f"do not load it: the scan found it unsafe ({scan.reason})" if scan.verdict == "unsafe"
            else "the file is damaged: restore it from a good copy or download it again")
    try:
        return inert_load(path, scan.format)
    except FormatError as exc:
        if exc.path is not None:
            raise
        # The reader's own refusals (a persistent id it cannot parse) name no file.
        raise FormatError(f"{path}: {exc.message}", path=path, hint=exc.hint or hint) from None
    except UsageError:
        raise
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, struct.error,
            UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: cannot be read: {type(exc).__name__}: {exc}", path=path,
                          hint=hint) from None
    except Exception as exc:
        raise UnsafeFileError(
            f"{path}: cannot be read inertly ({type(exc).__name__}: {exc}); only a real "
            "unpickler, which runs the file's code, could read it",
            path=path, globals_found=scan.names(),
            hint=f"torchverity scan {shell_path(path)} lists what it holds; load it only in a "
                 "sandbox",
        ) from None


def inert_tensors(path: str | os.PathLike[str],
                  scan: ScanResult | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a torch checkpoint by the names ``migrate`` gives them, read inertly.

    A file the scan finds unsafe is read too: its code-running globals become inert
    placeholders like any other class, so nothing from it runs. A malformed one is
    refused with the scan's reason: the reader cannot account for all of it."""
    return inert_contents(path, scan)[0]


# The verdicts of pickles torch's weights_only loader refuses: classes outside its list
# (data classes, the user's own, TorchScript), or a global that runs code.
WEIGHTS_ONLY_REFUSES = frozenset({"needs-allowlist", "needs-review", "unsafe"})


def refused_contents(path: str | os.PathLike[str], scan: ScanResult,
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """:func:`inert_contents` of a pickle weights_only refuses (None for one it reads):
    inspect and diff show such a file's tensors and plain values without running it."""
    return inert_contents(path, scan) if scan.verdict in WEIGHTS_ONLY_REFUSES else None


def inert_contents(path: str | os.PathLike[str], scan: ScanResult | None = None,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`inert_tensors`, and the plain values beside them (numbers, strings, booleans,
    None; hyper-parameters of data classes unwrapped) by dotted name, from one read.
    ``scan`` is the file's scan when the caller has made it already."""
    from torchverity.pickles._scan import next_step, scan_file

    p = Path(path)
    scan = scan or scan_file(p)
    if scan.verdict == "malformed":
        raise FormatError(f"{p}: cannot be read, even inertly: the scan found it malformed "
                          f"({scan.reason})", path=p, hint=next_step(scan))
    if scan.format == "joblib":
        raise joblib_file_error(p)
    obj, _ = inert_read(p, scan)
    extractor = Extractor()
    try:
        tree = extractor.value(obj, "")
    except RecursionError:
        raise FormatError(f"{p}: the object nests too deeply to read", path=p) from None
    return extractor.tensors, dict(_plain_leaves(tree, ""))


# Markers that say what an object was (a class, a callable the loader would have called,
# a type, what only a repr could show): leaves too, so that two files that differ in them
# do not read alike (a payload beside the same tensors).
_SHOWN_MARKERS = ("$class", "$type", "$repr")


def _plain_leaves(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The plain values of an extracted tree, and the markers naming what its objects were
    (``x.$class``); tensors left out. Named as the loaded object's leaves are."""
    if isinstance(tree, Mapping):
        if "$tensor" in tree:
            return
        for key, value in tree.items():
            if key in _SHOWN_MARKERS:
                yield _join(path, key), value
            elif not key.startswith("$"):
                yield from _plain_leaves(value, _join(path, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _plain_leaves(value, _join(path, str(i)))
    elif path:
        yield path, tree


@dataclass
class Extractor:
    """Flatten an unpickled object into named tensors plus JSON (tensors by reference)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # id(tensor) -> first name
    skipped: list[str] = field(default_factory=list)
    _active: dict[int, str] = field(default_factory=dict)  # id -> path, while encoded
    _alive: list[torch.Tensor] = field(default_factory=list)  # keeps ids in `names` unique

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, str]:
        known = self.names.get(id(t))
        if known is not None:
            return {"$tensor": known}
        name = path or "tensor"
        while name in self.tensors:
            name += "_"
        self.tensors[name] = t.detach()
        self.names[id(t)] = name
        self._alive.append(t)
        return {"$tensor": name}

    def value(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._any_tensor(obj, path)
        if obj is None or isinstance(obj, (bool, int, str)):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else repr(obj)
        referent = self._active.get(id(obj))
        if referent is not None:
            return {"$cycle": referent}
        self._active[id(obj)] = path
        try:
            return self._compound(obj, path)
        finally:
            del self._active[id(obj)]

    def _any_tensor(self, t: torch.Tensor, path: str) -> Any:
        """Strided tensors by name; nested and sparse ones as their strided parts."""
        if t.is_nested:
            return {"$nested": [self.tensor(c, _join(path, str(i)))["$tensor"]
                                for i, c in enumerate(t.unbind())]}
        if t.layout == torch.sparse_coo:
            return {"$sparse_coo": {"indices": self.tensor(t._indices(), _join(path, "indices")),
                                    "values": self.tensor(t._values(), _join(path, "values")),
                                    "size": list(t.shape)}}
        if t.layout == torch.sparse_csr:
            return {"$sparse_csr": {
                "crow": self.tensor(t.crow_indices(), _join(path, "crow_indices")),
                "col": self.tensor(t.col_indices(), _join(path, "col_indices")),
                "values": self.tensor(t.values(), _join(path, "values")),
                "size": list(t.shape)}}
        if t.layout != torch.strided or t.is_quantized:
            raise UsageError(f"{path}: tensors of layout {t.layout} (quantized: "
                             f"{t.is_quantized}) are not migrated",
                             hint="dequantize or densify them in trusted code first")
        return self.tensor(t, path)

    def _compound(self, obj: Any, path: str) -> Any:
        import numpy as np

        plain = hyper_value(obj)
        if plain is not NOT_CONFIG:
            return self.value(plain, path) if plain is not obj else None
        if isinstance(obj, type):
            return {"$type": getattr(obj, "_tv_name", f"{obj.__module__}.{obj.__qualname__}")}
        if isinstance(obj, Inert):
            union = union_text(obj)
            return {"$type": union} if union is not None else self._inert(obj, path)
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
        if arr.dtype.names:  # structured: one entry per field
            return {"$structured": {f: self._ndarray(arr[f], _join(path, f))
                                    for f in arr.dtype.names}}
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
        state = _attributes(state)
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


def _is_slots_state(state: Any) -> bool:
    """pickle's ``(instance dict or None, slot values)`` state of a class with __slots__."""
    return (isinstance(state, tuple) and len(state) == 2
            and (state[0] is None or isinstance(state[0], Mapping))
            and isinstance(state[1], Mapping))


def _is_dunder(key: Any) -> bool:
    return isinstance(key, str) and key.startswith("__") and key.endswith("__")


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (Mapping, list, tuple, set, frozenset))
                             and not value)


def _attributes(state: Any) -> Any:
    """An object's state as one mapping of its attributes where the pickle splits them, so
    a config class reads as its fields whatever way it stores them; other states as given.

    A pydantic model pickles ``{"__dict__": fields, "__pydantic_extra__": ...,
    "__pydantic_fields_set__": ..., ...}``: its fields become the keys, and the
    bookkeeping entries stay only when they hold something."""
    if _is_slots_state(state):
        return {**(state[0] or {}), **state[1]}
    if (isinstance(state, Mapping) and isinstance(state.get("__dict__"), Mapping)
            and all(_is_dunder(k) for k in state)):
        extra = {k: v for k, v in state.items() if k != "__dict__" and not _is_empty(v)}
        return {**state["__dict__"], **extra}
    return state


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
