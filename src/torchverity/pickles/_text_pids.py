"""torch's persistent ids as pickle protocol 0 writes them: text, parsed strictly.

From protocol 1 on, BINPERSID pickles a persistent id like any object; protocol 0 has
only PERSID, one line of text, so the pickler writes ``str(pid)``: the repr of the
tuple torch's ``persistent_id`` returns, e.g. in the legacy (pre-1.6) layout::

    ('storage', <class 'torch.FloatStorage'>, '94206880761632', 'cpu', 3, None)

and without the last field in the zip layout.

torch.load asserts the id is a tuple and fails on every such file, whatever
``weights_only`` says. The text is matched here against exactly the shapes torch
writes, storage classes from a fixed allowlist, and nothing in it is evaluated or
imported: a repr names a class, and ``literal_eval`` could not read one anyway.
Torch-free, so the scanner can use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from torchverity.errors import FormatError
from torchverity.pickles._torch_names import STORAGES

# The kind the scan records for a PERSID whose text no torch format writes.
TEXT_PID_UNKNOWN = "text no torch format writes"

_QUANTIZED = {"QUInt8Storage": "quint8", "QInt8Storage": "qint8", "QInt32Storage": "qint32",
              "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4"}
# A storage class's repr (its module and qualname) -> the torch dtype its elements have.
STORAGE_CLASSES: dict[str, str] = {
    **{f"torch.{name}": dtype for name, dtype in {**STORAGES, **_QUANTIZED}.items()},
    "torch.storage.UntypedStorage": "uint8",
}

# Bounded digit runs: a count past 19 digits is no storage torch wrote.
_INT = r"(?:0|[1-9][0-9]{0,18})"
_KEY = r"[0-9]{1,20}"
_LOCATION = r"[a-z][a-z0-9_]*(?::[0-9]{1,4})?"  # torch's location tags: cpu, cuda:0, ...
_STORAGE_HEAD = (rf"\('storage', <class '(?P<cls>[A-Za-z_][\w.]*)'>, '(?P<key>{_KEY})', "
                 rf"'(?P<location>{_LOCATION})', (?P<numel>{_INT})")
# The legacy format adds a view of the storage: None, or (view key, offset, size).
_VIEW = rf"\('(?P<view>{_KEY})', (?P<offset>{_INT}), (?P<size>{_INT})\)"
# A str's repr: quoted, every backslash escaping one character (no raw newline: the
# opcode's text ends at the first).
_STR = r"(?:'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\")"
_MODULE = (r"\('module', <class '(?P<cls>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)'>, "
           rf"(?:None|{_STR}), (?:None|{_STR})\)")


@cache
def _grammar(shape: str) -> re.Pattern[str]:
    """The compiled shape, compiled on first use: protocol-0 files are rare, and every
    scan of a pickle imports this module."""
    return re.compile({"legacy": _STORAGE_HEAD + rf", (?:None|{_VIEW})\)",
                       "zip": _STORAGE_HEAD + r"\)", "module": _MODULE}[shape], re.ASCII)


@dataclass(frozen=True)
class TextStorageId:
    """A storage's id: ``dtype`` is torch's name for it (``float32``); ``view`` is the
    (key, element offset, element count) of a view into the storage, as torch < 1.0 saved."""

    dtype: str
    key: str
    location: str
    numel: int
    view: tuple[str, int, int] | None


@dataclass(frozen=True)
class TextModuleId:
    """A pickled nn.Module class's id (legacy whole-model saves); its source is not kept."""

    module: str
    name: str


def parse_legacy_pid(text: str) -> TextStorageId | TextModuleId:
    """The persistent id a protocol-0 PERSID of torch's legacy (pre-1.6) format holds;
    FormatError for any other text."""
    storage = _storage_id(text, _grammar("legacy"))
    if storage is not None:
        return storage
    found = _grammar("module").fullmatch(text)
    if found is None:
        raise _not_torchs(text, "legacy (pre-1.6)")
    module, _, name = found["cls"].rpartition(".")
    return TextModuleId(module, name)


def parse_zip_pid(text: str) -> TextStorageId:
    """The storage id a protocol-0 PERSID of torch's zip format holds (it names no modules);
    FormatError for any other text."""
    storage = _storage_id(text, _grammar("zip"))
    if storage is None:
        raise _not_torchs(text, "zip")
    return storage


def _not_torchs(text: str, layout: str) -> FormatError:
    return FormatError(f"a pickle protocol 0 persistent id that torch's {layout} format never "
                       f"writes: {text[:80]!r}")


def _storage_id(text: str, shape: re.Pattern[str]) -> TextStorageId | None:
    found = shape.fullmatch(text)
    if found is None or found["cls"] not in STORAGE_CLASSES:
        return None
    view = None
    if found.groupdict().get("view") is not None:
        view = (found["view"], int(found["offset"]), int(found["size"]))
    return TextStorageId(STORAGE_CLASSES[found["cls"]], found["key"], found["location"],
                         int(found["numel"]), view)


def read_text_pid(text: str) -> TextStorageId | TextModuleId | None:
    """The id some torch format writes as this text (either layout), None for other text."""
    for parse in (parse_legacy_pid, parse_zip_pid):
        try:
            return parse(text)
        except FormatError:
            continue
    return None
