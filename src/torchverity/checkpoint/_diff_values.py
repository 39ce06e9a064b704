"""Tensor values compared by their bytes, in bounded chunks: which elements differ, how
many bits flipped, the largest absolute and relative change, and what kind of damage it is
(see :mod:`torchverity.checkpoint._diff`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchverity._tensors import byte_view, dtype_name
from torchverity.checkpoint._diff_result import TensorDiff, classify, plain_diff

_CHUNK = 1 << 22
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)
ABSENT = object()  # a name one side does not hold


def compare(name: str, a: Any, b: Any, rtol: float, atol: float) -> TensorDiff:
    """How the entries ``a`` and ``b`` (tensors, plain values or :data:`ABSENT`) differ."""
    if b is ABSENT:
        return _one_side(name, a, "a")
    if a is ABSENT:
        return _one_side(name, b, "b")
    ta, tb = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
    if not (ta and tb):
        if ta != tb:
            return TensorDiff(name, "dtype_changed", _sig(a)[0], _sig(b)[0], _sig(a)[1],
                              _sig(b)[1])
        return plain_diff(name, a, b)
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


@dataclass
class _Tally:
    """What one pair of tensors differs by so far: elements, bits, the largest errors."""

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
    single = None if tally.single_xor is None else bytes(tally.single_xor.tolist())
    kind, bit, field = classify(dtype_name(a.dtype), elsize, tally.differing, tally.bits, single,
                                tally.close, rtol, atol)
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
    from torchverity.checkpoint._diff_words import extent

    wide = torch.complex128 if va.is_complex() else torch.float64
    max_abs, max_rel, close = extent(va.to(wide).numpy(), vb.to(wide).numpy(), rtol, atol)
    tally.max_abs, tally.max_rel = max(tally.max_abs, max_abs), max(tally.max_rel, max_rel)
    tally.close = tally.close and close
