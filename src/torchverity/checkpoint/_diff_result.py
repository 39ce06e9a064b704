"""What ``diff`` reports: one :class:`TensorDiff` per named entry, gathered in a
:class:`DiffResult` (torch-free: the CLI builds them from listings and hashes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal[
    "identical", "only_in_a", "only_in_b", "shape_changed", "dtype_changed", "values_changed"
]
Kind = Literal["bit-flip", "few-bits", "drift", "large", "value"]
STATUSES: tuple[Status, ...] = (
    "identical", "only_in_a", "only_in_b", "shape_changed", "dtype_changed", "values_changed"
)


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
    # A changed plain value (epoch, lr, a step count): both values, shortened, so that the
    # line says what changed to what without a second inspect of each file.
    value_a: str | None = None
    value_b: str | None = None

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
            if self.value_a is None or self.value_b is None:
                return "value changed"
            return f"value changed: {self.value_a} -> {self.value_b}"
        text = (f"{self.differing} of {self.numel} elements differ, first at "
                f"{list(self.first_index or ())}; {self.kind}")
        if self.kind == "bit-flip":
            text += f": bit {self.bit} ({self.field})"
        elif self.kind == "few-bits":
            text += f": {self.flipped_bits} bits"
        return text + f"; max abs {_num(self.max_abs)}, max rel {_num(self.max_rel)}"


def _same_value(a: Any, b: Any) -> bool:
    """Two plain (non-tensor) values are equal: same type, and floats bit for bit."""
    if isinstance(a, float) and isinstance(b, float):
        return a.hex() == b.hex()  # bitwise, like tensors
    return type(a) is type(b) and bool(a == b)


def plain_diff(name: str, a: Any, b: Any) -> TensorDiff:
    """How two plain values differ (``value`` when they do)."""
    if _same_value(a, b):
        return TensorDiff(name, "identical")
    return TensorDiff(name, "values_changed", kind="value", value_a=_shown(a),
                      value_b=_shown(b))


_SHOWN = 60


def _shown(value: Any) -> str:
    """A value as the diff line shows it: its repr, cut to a line's share."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


FEW_BITS = 8
# Mantissa bits of each floating type (the exponent sits above, the sign on top; a complex
# number is two of its parts, real then imaginary).
_MANTISSA = {
    "float64": 52, "float32": 23, "float16": 10, "bfloat16": 7, "float8_e4m3fn": 3,
    "float8_e5m2": 2, "complex32": 10, "complex64": 23, "complex128": 52,
}
_SIGNED = frozenset({"int8", "int16", "int32", "int64"})


def classify(dtype: str, itemsize: int, differing: int, bits: int, single_xor: bytes | None,
             close: bool, rtol: float, atol: float) -> tuple[Kind, int | None, str | None]:
    """The kind of a value change, and for one flipped bit which bit and field: from the
    count of differing elements and flipped bits, and the XOR of the only differing
    element's bytes (little-endian) when there is one."""
    if differing == 1 and bits == 1 and single_xor is not None:
        byte = next(i for i, x in enumerate(single_xor) if x)
        bit = byte * 8 + single_xor[byte].bit_length() - 1
        return "bit-flip", bit, _field(dtype, itemsize * 8, bit)
    if bits <= FEW_BITS:
        return "few-bits", None, None
    if close and (rtol or atol):
        return "drift", None, None
    return "large", None, None


def _field(dtype: str, width: int, bit: int) -> str:
    prefix = ""
    if dtype.startswith("complex"):
        width //= 2
        prefix = "imaginary " if bit >= width else "real "
        bit %= width
    mantissa = _MANTISSA.get(dtype)
    if mantissa is not None:
        if bit == width - 1:
            return prefix + "sign"
        return prefix + ("exponent" if bit >= mantissa else "mantissa")
    if dtype in _SIGNED and bit == width - 1:
        return "sign"
    return "value"


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
