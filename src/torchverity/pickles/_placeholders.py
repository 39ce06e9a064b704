"""Inert placeholders: what an unpickler gets for a global it must not resolve (torch-free).

:class:`InertUnpickler` resolves only the names in its ``real`` table; any other
global becomes a subclass of :class:`Inert` that keeps the arguments and state the
pickle hands it and runs nothing. The migrate reader fills ``real`` with torch's
weights_only allowlist; the zip listing (:mod:`torchverity.pickles._listing`)
with torch-free stand-ins.
"""

from __future__ import annotations

import pickle
from typing import Any, ClassVar


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



class InertUnpickler(pickle.Unpickler):
    """Resolves only ``real``; anything else becomes an inert placeholder class."""

    real: ClassVar[dict[str, Any]] = {}
    placeholders: ClassVar[dict[str, type]] = {}

    def find_class(self, module: str, name: str) -> Any:
        return self.resolve(module, name)

    @classmethod
    def resolve(cls, module: str, name: str) -> Any:
        """``find_class`` without an unpickler: a protocol-0 persistent id names a class in
        its text, which the unpickler never looks up."""
        import _compat_pickle

        # Python 2 names (``__builtin__.set``) mean what pickle's own lookup maps them to.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        qual = f"{module}.{name}"
        if qual in cls.real:
            return cls.real[qual]
        made = cls.placeholders.get(qual)
        if made is None:
            made = type(name.rpartition(".")[2] or "Unknown", (Inert,), {
                "_tv_name": qual, "__module__": "torchverity.migrate.inert",
            })
            cls.placeholders[qual] = made
        return made
