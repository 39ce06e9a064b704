"""Compare two checkpoints tensor by tensor, down to the bit.

Each entry is identical, only in A, only in B, changed in shape or dtype, or
changed in value. A value change reports how many elements differ, the first
differing index, the largest absolute and relative difference, and a
classification of the damage:

``bit-flip``  exactly one bit of one element changed (with which bit, and
              whether it is the sign, an exponent or a mantissa bit): the
              signature of memory or storage corruption;
``few-bits``  at most 8 bits changed in total;
``drift``     every difference lies within ``rtol``/``atol`` (``|a - b| <= atol +
              rtol * |a|``, A is the reference): numerics, not damage;
``large``     anything else.

Elements are compared by their bytes, so NaNs with equal bits are equal and
``-0.0`` differs from ``0.0``. Work runs in bounded chunks: comparing two
files larger than memory is fine (storages are memory-mapped).

>>> import torch
>>> from torchverity.checkpoint._diff import diff
>>> a = {"w": torch.ones(4)}
>>> b = {"w": torch.tensor([1.0, 1.0, -1.0, 1.0])}
>>> diff(a, b).entries[0].describe()
'1 of 4 elements differ, first at [2]; bit-flip: bit 31 (sign); max abs 2, max rel 2'
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchverity._tensors import byte_view, dtype_name, iter_leaves

Status = Literal[
    "identical", "only_in_a", "only_in_b", "shape_changed", "dtype_changed", "values_changed"
]
Kind = Literal["bit-flip", "few-bits", "drift", "large", "value"]
STATUSES: tuple[Status, ...] = (
    "identical", "only_in_a", "only_in_b", "shape_changed", "dtype_changed", "values_changed"
)
FEW_BITS = 8
_CHUNK = 1 << 22
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Mantissa bits of each floating type (the exponent sits above, the sign on top).
_MANTISSA = {
    torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7,
    torch.float8_e4m3fn: 3, torch.float8_e5m2: 2, torch.complex64: 23, torch.complex128: 52,
}
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


@dataclass(frozen=True)
class TensorDiff:
    """How one named entry differs between A and B."""

    name: str
    status: Status
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    numel: int = 0
    differing: int = 0
    flipped_bits: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    first_index: tuple[int, ...] | None = None
    kind: Kind | None = None
    bit: int | None = None  # bit-flip: position in the element, 0 = least significant
    field: str | None = None  # bit-flip: sign, exponent or mantissa (value for integers)
    within_tolerance: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "identical" or (
            self.status == "values_changed" and self.within_tolerance
        )

    def describe(self) -> str:
        """One line for people: what changed and how."""
        if self.status == "identical":
            return f"{self.dtype_a}{list(self.shape_a or ())}" if self.dtype_a else "same value"
        if self.status in ("only_in_a", "only_in_b"):
            side = "A" if self.status == "only_in_a" else "B"
            shape, dtype = (self.shape_a, self.dtype_a) if side == "A" else (
                self.shape_b, self.dtype_b)
            return f"only in {side} ({dtype}{list(shape or ())})"
        if self.status in ("shape_changed", "dtype_changed"):
            return (f"{self.dtype_a}{list(self.shape_a or ())} -> "
                    f"{self.dtype_b}{list(self.shape_b or ())}")
        if self.kind == "value":
            return "value changed"
        text = (f"{self.differing} of {self.numel} elements differ, first at "
                f"{list(self.first_index or ())}; {self.kind}")
        if self.kind == "bit-flip":
            text += f": bit {self.bit} ({self.field})"
        elif self.kind == "few-bits":
            text += f": {self.flipped_bits} bits"
        return text + f"; max abs {_num(self.max_abs)}, max rel {_num(self.max_rel)}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


@dataclass(frozen=True)
class DiffResult:
    """Every entry of A and B, sorted by name."""

    a: str
    b: str
    rtol: float
    atol: float
    entries: tuple[TensorDiff, ...]

    @property
    def equal(self) -> bool:
        """True when every entry is identical or within ``rtol``/``atol``."""
        return all(e.ok for e in self.entries)

    @property
    def changed(self) -> tuple[TensorDiff, ...]:
        return tuple(e for e in self.entries if e.status != "identical")

    @property
    def by_name(self) -> Mapping[str, TensorDiff]:
        return {e.name: e for e in self.entries}

    @property
    def counts(self) -> dict[str, int]:
        counted = Counter(e.status for e in self.entries)
        return {s: counted.get(s, 0) for s in STATUSES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "rtol": self.rtol, "atol": self.atol,
            "equal": self.equal, "counts": self.counts,
            "entries": [dict(vars(e), ok=e.ok) for e in self.changed],
        }


def diff(a: Any, b: Any, *, rtol: float = 0.0, atol: float = 0.0) -> DiffResult:
    """Compare two checkpoints: paths (.pt, .safetensors, sharded folders) or loaded objects.

    Files are read without executing code from them (see
    :func:`torchverity.checkpoint.read_unverified`).
    """
    leaves_a, label_a = _leaves(a)
    leaves_b, label_b = _leaves(b)
    names = sorted(set(leaves_a) | set(leaves_b))
    entries = tuple(_compare(n, leaves_a.get(n, _ABSENT), leaves_b.get(n, _ABSENT), rtol, atol)
                    for n in names)
    return DiffResult(label_a, label_b, rtol, atol, entries)


_ABSENT = object()


def _leaves(obj: Any) -> tuple[dict[str, Any], str]:
    if isinstance(obj, (str, os.PathLike)):
        from torchverity.checkpoint._read import read_unverified

        return dict(iter_leaves(read_unverified(obj))), os.fspath(obj)
    return dict(iter_leaves(obj)), f"<{type(obj).__name__}>"


def _compare(name: str, a: Any, b: Any, rtol: float, atol: float) -> TensorDiff:
    if b is _ABSENT:
        return _one_side(name, a, "a")
    if a is _ABSENT:
        return _one_side(name, b, "b")
    ta, tb = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
    if not (ta and tb):
        if ta != tb:
            return TensorDiff(name, "dtype_changed", _sig(a)[0], _sig(b)[0], _sig(a)[1],
                              _sig(b)[1])
        return TensorDiff(name, "identical" if _same_value(a, b) else "values_changed",
                          kind=None if _same_value(a, b) else "value")
    base = dict(dtype_a=dtype_name(a.dtype), dtype_b=dtype_name(b.dtype),
                shape_a=tuple(a.shape), shape_b=tuple(b.shape))
    if a.dtype != b.dtype:
        return TensorDiff(name, "dtype_changed", **base)  # type: ignore[arg-type]
    if a.shape != b.shape:
        return TensorDiff(name, "shape_changed", **base)  # type: ignore[arg-type]
    return _compare_values(name, a, b, rtol, atol, base)


def _one_side(name: str, value: Any, side: str) -> TensorDiff:
    dtype, shape = _sig(value)
    if side == "a":
        return TensorDiff(name, "only_in_a", dtype_a=dtype, shape_a=shape)
    return TensorDiff(name, "only_in_b", dtype_b=dtype, shape_b=shape)


def _sig(value: Any) -> tuple[str, tuple[int, ...]]:
    if isinstance(value, torch.Tensor):
        return dtype_name(value.dtype), tuple(value.shape)
    return type(value).__name__, ()


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a.hex() == b.hex()  # bitwise, like tensors
    return type(a) is type(b) and bool(a == b)


@dataclass
class _Tally:
    differing: int = 0
    bits: int = 0
    first: int | None = None
    single_xor: torch.Tensor | None = None  # bytes of the only differing element
    max_abs: float = 0.0
    max_rel: float = 0.0
    close: bool = True


def _compare_values(name: str, a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float,
                    base: dict[str, Any]) -> TensorDiff:
    elsize = a.element_size()
    word = min(elsize, 8)
    per_elem = elsize // word  # complex128 is two int64 words per element
    wa = byte_view(a).view(_WORDS[word])
    wb = byte_view(b).view(_WORDS[word])
    flat_a, flat_b = a.detach().reshape(-1), b.detach().reshape(-1)
    tally = _Tally()
    step = _CHUNK - _CHUNK % per_elem
    for start in range(0, wa.numel(), step):
        _tally_chunk(tally, wa[start : start + step], wb[start : start + step], start // per_elem,
                     per_elem, flat_a, flat_b, rtol, atol)
    numel = a.numel()
    if tally.differing == 0:
        return TensorDiff(name, "identical", numel=numel, **base)
    first = tuple(int(i) for i in torch.unravel_index(torch.tensor(tally.first), a.shape)) \
        if a.dim() else ()
    kind, bit, field = _classify(tally, a.dtype, rtol, atol)
    return TensorDiff(
        name, "values_changed", numel=numel, differing=tally.differing,
        flipped_bits=tally.bits, max_abs=tally.max_abs, max_rel=tally.max_rel,
        first_index=first, kind=kind, bit=bit, field=field, within_tolerance=tally.close,
        **base,
    )


def _tally_chunk(tally: _Tally, wa: torch.Tensor, wb: torch.Tensor, elem0: int, per_elem: int,
                 flat_a: torch.Tensor, flat_b: torch.Tensor, rtol: float, atol: float) -> None:
    xor = torch.bitwise_xor(wa, wb)
    word_diff = xor != 0
    elem_diff = word_diff.view(-1, per_elem).any(dim=1) if per_elem > 1 else word_diff
    idx = torch.nonzero(elem_diff).reshape(-1)
    if not idx.numel():
        return
    if tally.first is None:
        tally.first = elem0 + int(idx[0])
    tally.differing += idx.numel()
    tally.bits += int(_POPCOUNT[xor[word_diff].contiguous().view(torch.uint8).long()].sum())
    tally.single_xor = xor.view(-1, per_elem)[idx[0]].contiguous().view(torch.uint8) \
        if tally.differing == 1 else None
    va = flat_a[elem0 + idx].cpu()
    vb = flat_b[elem0 + idx].cpu()
    _numeric(tally, va, vb, rtol, atol)


def _numeric(tally: _Tally, va: torch.Tensor, vb: torch.Tensor, rtol: float, atol: float) -> None:
    wide = torch.complex128 if va.is_complex() else torch.float64
    va, vb = va.to(wide), vb.to(wide)
    delta = (va - vb).abs()
    scale = va.abs()  # relative to A, the reference side
    rel = torch.where(scale > 0, delta / scale.clamp_min(1e-300),
                      torch.where(delta > 0, torch.inf, 0.0))
    # NaN against a number (or NaNs with different bits) counts as an infinite change.
    delta = torch.nan_to_num(delta, nan=torch.inf)
    rel = torch.nan_to_num(rel, nan=torch.inf)
    tally.max_abs = max(tally.max_abs, float(delta.max()))
    tally.max_rel = max(tally.max_rel, float(rel.max()))
    tally.close = tally.close and bool((delta <= atol + rtol * scale).all())


def _classify(tally: _Tally, dtype: torch.dtype, rtol: float, atol: float,
              ) -> tuple[Kind, int | None, str | None]:
    if tally.differing == 1 and tally.bits == 1 and tally.single_xor is not None:
        byte = int(torch.nonzero(tally.single_xor)[0])
        bit = byte * 8 + int(tally.single_xor[byte]).bit_length() - 1
        return "bit-flip", bit, _field(dtype, bit)
    if tally.bits <= FEW_BITS:
        return "few-bits", None, None
    if tally.close and (rtol or atol):
        return "drift", None, None
    return "large", None, None


def _field(dtype: torch.dtype, bit: int) -> str:
    width = torch.empty((), dtype=dtype).element_size() * 8
    prefix = ""
    if dtype.is_complex:
        width //= 2
        prefix = "imaginary " if bit >= width else "real "
        bit %= width
    mantissa = _MANTISSA.get(dtype)
    if mantissa is not None:
        if bit == width - 1:
            return prefix + "sign"
        return prefix + ("exponent" if bit >= mantissa else "mantissa")
    if dtype.is_signed and bit == width - 1:
        return "sign"
    return "value"
