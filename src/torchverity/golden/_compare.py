"""Comparing tensors: dtype-aware tolerances, bitwise equality, the first element that differs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from torchverity._tensors import dtype_name
from torchverity.errors import UsageError

Scope = Literal["repeat", "cross"]
# exact: any bit difference fails; tolerance: within the dtype's (rtol, atol) below.
CompareMode = Literal["exact", "tolerance"]


# (rtol, atol) per dtype. "repeat": the same computation twice on one device,
# where only reduced-precision rounding may legitimately move results (the
# torch.testing defaults). "cross": another device, library version or
# compiler; float32 allows TF32, which cuDNN uses for convolutions by default.
_TOLERANCES: dict[Scope, dict[torch.dtype, tuple[float, float]]] = {
    "repeat": {
        torch.float64: (1e-7, 1e-7),
        torch.float32: (1.3e-6, 1e-5),
        torch.float16: (1e-3, 1e-5),
        torch.bfloat16: (1.6e-2, 1e-5),
    },
    "cross": {
        torch.float64: (1e-5, 1e-8),
        torch.float32: (1e-3, 1e-4),
        torch.float16: (1e-2, 1e-3),
        torch.bfloat16: (5e-2, 1e-2),
    },
}


def tolerance(dtype: torch.dtype, scope: Scope = "repeat") -> tuple[float, float]:
    """Default ``(rtol, atol)`` for ``dtype``; integers and bools compare exactly."""
    return _TOLERANCES[scope].get(dtype, (0.0, 0.0))


@dataclass(frozen=True)
class Comparison:
    """How one output tensor compares with its reference.

    ``worst_index`` is the element whose difference is largest relative to
    what the tolerance allows there (the first failing element to look at).
    """

    name: str
    identical: bool
    within_tolerance: bool
    max_abs_diff: float
    mismatched: int
    numel: int
    worst_index: tuple[int, ...] | None
    expected: float | None
    actual: float | None
    rtol: float
    atol: float

    @property
    def where(self) -> str | None:
        if self.worst_index is None:
            return None
        return f"output '{self.name}' at {_fmt_index(self.worst_index)}"


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """The multi-dimensional index of flat position ``flat`` in ``shape``."""
    index = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size) if size else (flat, 0)
        index.append(rest)
    return tuple(reversed(index))


def _fmt_index(index: Sequence[int]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def compare_tensors(
    name: str, expected: torch.Tensor, actual: torch.Tensor, rtol: float, atol: float
) -> Comparison:
    """Compare bitwise and within ``atol + rtol*|expected|`` (NaN equals NaN)."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        raise UsageError(
            f"output '{name}' changed form: {dtype_name(expected.dtype)}{list(expected.shape)}"
            f" -> {dtype_name(actual.dtype)}{list(actual.shape)}"
        )
    exp = expected.detach().to(actual.device)
    identical = bitwise_equal(exp, actual.detach())
    if identical or exp.numel() == 0:
        return Comparison(name, True, True, 0.0, 0, exp.numel(), None, None, None, rtol, atol)
    e, a = exp.double(), actual.detach().double()
    both_nan = torch.isnan(e) & torch.isnan(a)
    diff = torch.where(both_nan, torch.zeros_like(e), (a - e).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)  # NaN on one side only is infinitely off
    allowed = atol + rtol * e.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    excess = diff / allowed.clamp_min(torch.finfo(torch.float64).tiny)
    bad = diff > allowed
    flat = int(torch.argmax(excess.reshape(-1)).item())
    index = unravel(flat, tuple(e.shape))
    return Comparison(
        name=name,
        identical=False,
        within_tolerance=not bool(bad.any()),
        max_abs_diff=float(diff.max()),
        mismatched=int(bad.sum()),
        numel=e.numel(),
        worst_index=index,
        expected=float(e.reshape(-1)[flat]),
        actual=float(a.reshape(-1)[flat]),
        rtol=rtol,
        atol=atol,
    )


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (-0.0 differs from 0.0; NaN payloads count)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    from torchverity._tensors import byte_view

    return bool(torch.equal(byte_view(a), byte_view(b)))
