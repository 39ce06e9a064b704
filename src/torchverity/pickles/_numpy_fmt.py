"""numpy and joblib layouts: where their pickles are and how far their raw array bytes run.

numpy stores an array with an object dtype (``'O'``, ``'object'``, a structured
field of object type) as a pickle after the ``.npy`` header; the dtype is
decided by numpy's own parser of that header. joblib writes each array's bytes
inline after its ``NumpyArrayWrapper`` BUILD and skips them on load by the
unpickled dtype's real item size; an object array there is a nested pickle.
"""

from __future__ import annotations

import math
import re
import struct
from typing import Any

from torchverity.pickles._ops import (
    MISSING,
    TRUNCATED,
    Build,
    ByteSource,
    Item,
    Limits,
    PickleError,
    Value,
    const_str,
    dict_get,
    first_arg,
    ref_of,
)

JOBLIB_WRAPPERS = frozenset({
    "joblib.numpy_pickle.NumpyArrayWrapper",
    "sklearn.externals.joblib.numpy_pickle.NumpyArrayWrapper",
})
NPY_MAGIC = b"\x93NUMPY"
# The dtype codes numpy.dtype accepts as short strings (checked before numpy parses them).
_DTYPE_CODE = re.compile(r"^[<>|=]?[?bBhHiIlLqQpPefdgFDGSUVOMmbiufcat]\d{0,5}(?:\[\w+\])?$")


def npy_header(src: ByteSource, limits: Limits, name: str) -> Any:
    """Read a .npy header (the magic included) and return numpy's dtype for it, parsed by
    numpy's own header reader (Python 2 headers and every version included)."""
    import io

    magic = src.read(8)
    if magic[:6] != NPY_MAGIC:
        raise PickleError(f"{name}: not a .npy file", 0)
    size_len = 2 if magic[6] == 1 else 4
    length = src.read(size_len)
    (header_len,) = struct.unpack("<H" if size_len == 2 else "<I", length)
    if header_len > limits.max_line:
        raise PickleError(f"{name}: .npy header too long", src.offset, limit=True)
    import tokenize

    header = io.BytesIO(length + src.read(header_len))
    try:
        _, _, dtype = _header_reader(magic[6], magic[7])(header, max_header_size=limits.max_line)
    except (ValueError, SyntaxError, KeyError, TypeError, IndexError, MemoryError,
            RecursionError, tokenize.TokenError):
        raise PickleError(f"{name}: .npy header cannot be parsed", src.offset) from None
    return dtype


def _header_reader(major: int, minor: int) -> Any:
    """numpy's reader for this format version (3.0: UTF-8 headers, read by its private one)."""
    from numpy.lib import format as npformat

    if (major, minor) == (1, 0):
        return npformat.read_array_header_1_0
    if (major, minor) == (2, 0):
        return npformat.read_array_header_2_0
    if (major, minor) != (3, 0):
        raise PickleError(f".npy format version {major}.{minor} is unknown", 6)
    import importlib

    impl = importlib.import_module("numpy.lib._format_impl")  # numpy 2.x

    def read(fh: Any, max_header_size: int) -> Any:
        return impl._read_array_header(fh, (3, 0), max_header_size=max_header_size)

    return read


def wrapper_class(inst: Value) -> str | None:
    """The class of an object a pickle made, as joblib's isinstance check would see it."""
    callee = ref_of(inst.callee)
    if callee is None:
        return None
    if callee.qualname == "copyreg._reconstructor":
        first = ref_of(first_arg(inst))
        return first.qualname if first is not None else None
    return callee.qualname


def _itemsize(dtype: Item) -> int:
    """numpy's item size for an unpickled ``numpy.dtype(code, ...)`` plus its BUILD state."""
    code = const_str(first_arg(dtype))
    if code is None or not _DTYPE_CODE.match(code):
        raise PickleError(f"joblib array dtype {code!r} cannot be read", 0)
    import numpy

    try:
        parsed = numpy.dtype(code)
    except (TypeError, ValueError):
        raise PickleError(f"joblib array dtype {code!r} is unknown to numpy", 0) from None
    state = dtype.state if type(dtype) is Value else None
    items = state.items if type(state) is Value and state.kind == "tuple" else []
    # Flexible and structured dtypes take their size from the state (numpy's __setstate__).
    if parsed.kind in "USV" and len(items) >= 6:
        elsize = items[5]
        if not isinstance(elsize, int) or elsize < 0:
            raise PickleError("joblib array dtype state has no valid item size", 0)
        return elsize
    return int(parsed.itemsize)


def joblib_array(build: Build, src: ByteSource) -> str:
    """Skip one joblib array's inline bytes; return 'object' when a nested pickle follows."""
    state = build.state
    dtype = dict_get(state, "dtype")
    shape = dict_get(state, "shape")
    if TRUNCATED in (dtype, shape) or dtype is MISSING:
        raise PickleError("joblib array wrapper state cannot be read completely", src.offset,
                          limit=True)
    code = const_str(first_arg(dtype)) or ""
    if code.lstrip("<>|=").startswith("O"):
        return "object"
    dims = shape.items if type(shape) is Value and shape.kind == "tuple" else None
    if dims is None or shape.truncated or not all(isinstance(d, int) and d >= 0 for d in dims):
        raise PickleError("joblib array with a shape that cannot be read", src.offset)
    try:
        itemsize = _itemsize(dtype)
    except PickleError as exc:
        raise PickleError(str(exc), src.offset, limit=True) from None
    align = dict_get(state, "numpy_array_alignment_bytes")
    if align is TRUNCATED:
        raise PickleError("joblib array wrapper state cannot be read", src.offset, limit=True)
    if align is not MISSING and align is not None:
        src.skip(src.read(1)[0])  # padding length byte, then the padding
    src.skip(math.prod(dims) * itemsize)
    return "data"
