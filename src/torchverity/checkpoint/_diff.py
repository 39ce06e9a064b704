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
files larger than memory is fine (storages are memory-mapped). Two .safetensors
checkpoints (files or folders) are first compared by their headers and the hash of
each tensor's bytes, without torch: only tensors whose bytes differ are opened.

>>> import torch
>>> from torchverity.checkpoint._diff import diff
>>> a = {"w": torch.ones(4)}
>>> b = {"w": torch.tensor([1.0, 1.0, -1.0, 1.0])}
>>> diff(a, b).entries[0].describe()
'1 of 4 elements differ, first at [2]; bit-flip: bit 31 (sign); max abs 2, max rel 2'
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from torchverity.checkpoint._diff_result import DiffResult, Status, TensorDiff
from torchverity.checkpoint._fp_record import EXACT
from torchverity.errors import TorchVerityError


def diff(a: Any, b: Any, *, rtol: float = 0.0, atol: float = 0.0) -> DiffResult:
    """Compare two checkpoints: paths (.pt, .safetensors, sharded folders) or loaded objects.

    Files are read without executing code from them (see
    :func:`torchverity.checkpoint.read_unverified`).
    """
    files_a, files_b = _safetensors_files(a), _safetensors_files(b)
    if files_a is not None and files_b is not None:
        listed_a, listed_b = _listing(files_a), _listing(files_b)
        if listed_a is not None and listed_b is not None:
            return _diff_listed(a, b, listed_a, listed_b, rtol, atol)
    from torchverity.checkpoint._diff_values import ABSENT, compare

    leaves_a, label_a = _leaves(a)
    leaves_b, label_b = _leaves(b)
    names = sorted(set(leaves_a) | set(leaves_b))
    entries = tuple(compare(n, leaves_a.get(n, ABSENT), leaves_b.get(n, ABSENT), rtol, atol)
                    for n in names)
    return DiffResult(label_a, label_b, rtol, atol, entries)


def _leaves(obj: Any) -> tuple[dict[str, Any], str]:
    from torchverity._tensors import iter_leaves

    if isinstance(obj, (str, os.PathLike)):
        from torchverity.checkpoint._read import read_unverified

        return dict(iter_leaves(read_unverified(obj))), os.fspath(obj)
    return dict(iter_leaves(obj)), f"<{type(obj).__name__}>"


# name -> (dtype, shape, digest of name, dtype, shape and bytes)
_Listing = dict[str, tuple[str, tuple[int, ...], str]]


def _safetensors_files(obj: Any) -> list[Path] | None:
    """The files of a .safetensors checkpoint path; None for anything else (loaded objects,
    .pt files, paths that do not resolve), compared tensor by tensor."""
    from torchverity.checkpoint._file_fingerprint import safetensors_files

    if not isinstance(obj, (str, os.PathLike)):
        return None
    try:
        return safetensors_files(obj)
    except TorchVerityError:
        return None  # reported by the usual path, with its own wording


def _listing(files: list[Path]) -> _Listing | None:
    """The tensors of .safetensors files from their headers and hashed bytes (no torch)."""
    from torchverity.checkpoint._file_fingerprint import fingerprint_safetensors

    try:
        # Later shards win a name two shards share, as in read_unverified.
        return {e.name: (e.dtype, e.shape, e.digest) for f in files
                for e in fingerprint_safetensors(f, EXACT).entries}
    except TorchVerityError:
        return None


def _diff_listed(a: Any, b: Any, listed_a: _Listing, listed_b: _Listing, rtol: float,
                 atol: float) -> DiffResult:
    entries: dict[str, TensorDiff] = {}
    changed = []
    for name in sorted(set(listed_a) | set(listed_b)):
        one, two = listed_a.get(name), listed_b.get(name)
        if two is None or one is None:
            dtype, shape, _ = one or two  # type: ignore[misc]
            entries[name] = (TensorDiff(name, "only_in_a", dtype_a=dtype, shape_a=shape)
                             if two is None else
                             TensorDiff(name, "only_in_b", dtype_b=dtype, shape_b=shape))
        elif one[:2] != two[:2]:
            status: Status = "dtype_changed" if one[0] != two[0] else "shape_changed"
            entries[name] = TensorDiff(name, status, dtype_a=one[0], dtype_b=two[0],
                                       shape_a=one[1], shape_b=two[1])
        elif one[2] == two[2]:
            entries[name] = TensorDiff(name, "identical", dtype_a=one[0], dtype_b=two[0],
                                       shape_a=one[1], shape_b=two[1], numel=math.prod(one[1]))
        else:
            changed.append(name)
    if changed:  # only the tensors whose bytes differ are opened (torch imported then)
        entries.update(_compare_opened(a, b, changed, rtol, atol))
    return DiffResult(os.fspath(a), os.fspath(b), rtol, atol,
                      tuple(entries[n] for n in sorted(entries)))


def _compare_opened(a: Any, b: Any, names: list[str], rtol: float, atol: float,
                    ) -> dict[str, TensorDiff]:
    from torchverity._tensors import iter_leaves
    from torchverity.checkpoint._diff_values import compare
    from torchverity.checkpoint._read import read_unverified

    opened_a, opened_b = (dict(iter_leaves(read_unverified(p))) for p in (a, b))  # mmapped
    return {n: compare(n, opened_a[n], opened_b[n], rtol, atol) for n in names}
