"""Tensor values of two checkpoint files compared with numpy, from their mapped bytes: what
``diff`` reports for a listed tensor whose bytes differ, without importing torch.

The result is the one :mod:`torchverity.checkpoint._diff_values` gives for the loaded
tensors (the tests hold the two to that): elements compared by their bytes in bounded
chunks, the flipped bits counted, and the differing elements alone widened to float64
(complex128) for the largest absolute and relative change. Dtypes numpy cannot widen
here (float8 variants other than e4m3fn and e5m2, complex32) are left to torch.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from torchverity.checkpoint._diff_result import TensorDiff, classify
from torchverity.pickles._torch_names import ITEMSIZE

if TYPE_CHECKING:
    from torchverity.checkpoint._diff_listing import Listed, Where

_CHUNK = 1 << 22  # words compared at once
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)

Widen = Callable[[np.ndarray], np.ndarray]  # an element's words -> float64 or complex128


def _as(numpy_type: type) -> Widen:
    return lambda words: words.view(numpy_type).astype(
        np.complex128 if np.issubdtype(numpy_type, np.complexfloating) else np.float64)


def _bfloat16(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _float8_table(exponent_bits: int, bias: int, finite_max_code: bool) -> np.ndarray:
    """The value of each of the 256 codes of a float8 format (``finite_max_code``: e4m3fn,
    whose all-ones exponent is a number except for the NaN of all-ones mantissa)."""
    mantissa_bits = 7 - exponent_bits
    values = np.empty(256, dtype=np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
        mantissa = code & ((1 << mantissa_bits) - 1)
        top = (1 << exponent_bits) - 1
        if exponent == top and (not finite_max_code or mantissa == (1 << mantissa_bits) - 1):
            values[code] = math.nan if finite_max_code or mantissa else sign * math.inf
        elif exponent == 0:
            values[code] = sign * math.ldexp(mantissa, 1 - bias - mantissa_bits)
        else:
            values[code] = sign * math.ldexp((1 << mantissa_bits) + mantissa,
                                             exponent - bias - mantissa_bits)
    return values


_E4M3FN = _float8_table(4, 7, True)
_E5M2 = _float8_table(5, 15, False)

_WIDEN: dict[str, Widen] = {
    "float64": _as(np.float64), "float32": _as(np.float32), "float16": _as(np.float16),
    "bfloat16": _bfloat16,
    "float8_e4m3fn": lambda words: _E4M3FN[words], "float8_e5m2": lambda words: _E5M2[words],
    "complex64": _as(np.complex64), "complex128": _as(np.complex128),
    "bool": lambda words: (words != 0).astype(np.float64),
    "uint8": _as(np.uint8), "int8": _as(np.int8),
    "int16": _as(np.int16), "uint16": _as(np.uint16), "int32": _as(np.int32),
    "uint32": _as(np.uint32), "int64": _as(np.int64), "uint64": _as(np.uint64),
}


def compare_listed(name: str, a: Listed, b: Listed, rtol: float, atol: float,
                   ) -> TensorDiff | None:
    """How the values of two listed tensors of one dtype and shape differ, read from their
    files; None when numpy cannot widen the dtype or a location is unknown."""
    widen = _WIDEN.get(a.dtype)
    if widen is None or a.where is None or b.where is None:
        return None
    itemsize = ITEMSIZE[a.dtype]
    word = min(itemsize, 8)
    per_elem = itemsize // word  # complex128: two 8-byte words per element
    numel = math.prod(a.shape)
    tally = _Tally()
    wa = _words(a.where, a.shape, itemsize, word)
    wb = _words(b.where, b.shape, itemsize, word)
    step = _CHUNK - _CHUNK % per_elem
    for start in range(0, wa.size, step):
        tally.chunk(wa[start:start + step], wb[start:start + step], start // per_elem,
                    per_elem, widen, rtol, atol)
    base = dict(dtype_a=a.dtype, dtype_b=b.dtype, shape_a=a.shape, shape_b=b.shape)
    if tally.differing == 0:
        return TensorDiff(name, "identical", numel=numel, **base)  # type: ignore[arg-type]
    assert tally.first is not None
    first = tuple(int(i) for i in np.unravel_index(tally.first, a.shape)) if a.shape else ()
    kind, bit, field = classify(a.dtype, itemsize, tally.differing, tally.bits,
                                tally.single_xor, tally.close, rtol, atol)
    return TensorDiff(
        name, "values_changed", numel=numel, differing=tally.differing,
        flipped_bits=tally.bits, max_abs=tally.max_abs, max_rel=tally.max_rel,
        first_index=first, kind=kind, bit=bit, field=field, within_tolerance=tally.close,
        **base,  # type: ignore[arg-type]
    )


def _words(where: Where, shape: tuple[int, ...], itemsize: int, word: int) -> np.ndarray:
    """The tensor's elements as one flat array of words, mapped from its file (a view not
    in row-major order is gathered into one copy, as torch's ``reshape`` does). The map
    stays open while an array points into it, and closes with the last one."""
    numel = math.prod(shape)
    with open(where.path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if where.strides is None:
        return np.frombuffer(mm, dtype=_WORD[word], count=numel * itemsize // word,
                             offset=where.begin)
    rows = np.ndarray((*shape, itemsize), np.uint8, buffer=mm, offset=where.begin,
                      strides=(*(s * itemsize for s in where.strides), 1))
    return np.ascontiguousarray(rows).view(_WORD[word]).reshape(-1)


@dataclass
class _Tally:
    """What one pair of tensors differs by so far: elements, bits, the largest errors."""

    differing: int = 0
    bits: int = 0
    first: int | None = None
    single_xor: bytes | None = None  # the only differing element's XOR, while there is one
    max_abs: float = 0.0
    max_rel: float = 0.0
    close: bool = True

    def chunk(self, wa: np.ndarray, wb: np.ndarray, elem0: int, per_elem: int, widen: Widen,
              rtol: float, atol: float) -> None:
        xor = np.bitwise_xor(wa, wb)
        word_diff = xor != 0
        elem_diff = word_diff.reshape(-1, per_elem).any(axis=1) if per_elem > 1 else word_diff
        idx = np.flatnonzero(elem_diff)
        if not idx.size:
            return
        if self.first is None:
            self.first = elem0 + int(idx[0])
        self.differing += idx.size
        self.bits += int(_POPCOUNT[xor[word_diff].view(np.uint8)].sum())
        self.single_xor = (xor.reshape(-1, per_elem)[idx[0]].tobytes()
                           if self.differing == 1 else None)
        pick = (idx[:, None] * per_elem + np.arange(per_elem)).reshape(-1)
        with np.errstate(all="ignore"):  # a NaN's or an infinity's widening is no error
            self._numeric(widen(wa[pick]), widen(wb[pick]), rtol, atol)

    def _numeric(self, va: np.ndarray, vb: np.ndarray, rtol: float, atol: float) -> None:
        max_abs, max_rel, close = extent(va, vb, rtol, atol)
        self.max_abs, self.max_rel = max(self.max_abs, max_abs), max(self.max_rel, max_rel)
        self.close = self.close and close


def extent(va: np.ndarray, vb: np.ndarray, rtol: float, atol: float,
           ) -> tuple[float, float, bool]:
    """The largest absolute and relative change (relative to A) of the widened differing
    elements, and whether all are within the tolerances: one computation for both ways of
    reading tensors, so that their results agree to the last bit."""
    with np.errstate(all="ignore"):  # NaNs and infinities are counted as infinite below
        delta = np.abs(va - vb)
        scale = np.abs(va)
        rel = np.where(scale > 0, delta / np.maximum(scale, 1e-300),
                       np.where(delta > 0, np.inf, 0.0))
        # NaN (against a number, or NaNs of other bits) is an infinite change; an infinite
        # one is counted as the largest float
        delta = np.nan_to_num(delta, nan=np.inf)
        rel = np.nan_to_num(rel, nan=np.inf)
        return float(delta.max()), float(rel.max()), bool((delta <= atol + rtol * scale).all())
