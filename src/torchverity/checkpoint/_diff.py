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
files larger than memory is fine (storages are memory-mapped). Checkpoints on disk
(.safetensors and ``torch.save`` zip files, single or sharded, in any mix) are first
listed without torch (headers, or the pickle walked inertly) and compared by the hash
of each tensor's bytes and by their plain values: only tensors whose bytes differ are
compared from the files' bytes, with numpy (see
:mod:`torchverity.checkpoint._diff_listing` and :mod:`torchverity.checkpoint._diff_words`).

>>> import torch
>>> from torchverity.checkpoint._diff import diff
>>> a = {"w": torch.ones(4)}
>>> b = {"w": torch.tensor([1.0, 1.0, -1.0, 1.0])}
>>> diff(a, b).entries[0].describe()
'1 of 4 elements differ, first at [2]; bit-flip: bit 31 (sign); max abs 2, max rel 2'
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchverity.checkpoint._diff_result import DiffResult, TensorDiff
from torchverity.errors import InputError, shell_path

if TYPE_CHECKING:
    from torchverity.checkpoint._diff_listing import Listing


def diff(a: Any, b: Any, *, rtol: float = 0.0, atol: float = 0.0) -> DiffResult:
    """Compare two checkpoints: paths (.pt, .safetensors, sharded folders, pipelines of
    component folders) or loaded objects.

    Files are read without executing code from them (see
    :func:`torchverity.checkpoint.read_unverified`).
    """
    from torchverity.checkpoint._diff_listing import listing
    from torchverity.checkpoint._folders import pipeline_components

    parts = pipeline_components(a) if isinstance(a, (str, os.PathLike)) else []
    if parts and isinstance(b, (str, os.PathLike)):
        return _diff_pipelines(Path(a), Path(b), [c.name for c in parts], rtol, atol)
    listed_a = listing(a)
    listed_b = listing(b) if listed_a is not None else None
    if listed_a is not None and listed_b is not None:
        return _diff_listed(a, b, listed_a, listed_b, rtol, atol)
    from torchverity.checkpoint._diff_values import ABSENT, compare

    leaves_a, label_a = _leaves(a)
    leaves_b, label_b = _leaves(b)
    names = sorted(set(leaves_a) | set(leaves_b))
    entries = tuple(compare(n, leaves_a.get(n, ABSENT), leaves_b.get(n, ABSENT), rtol, atol)
                    for n in names)
    return DiffResult(label_a, label_b, rtol, atol, entries)


def _diff_pipelines(a: Path, b: Path, names: list[str], rtol: float, atol: float,
                    ) -> DiffResult:
    """Two pipelines (diffusers' unet/, vae/...), component by component: names as
    ``unet/conv_in.weight``."""
    from torchverity.checkpoint._folders import pipeline_components

    other = [c.name for c in pipeline_components(b)]
    if other != names:
        raise InputError(
            f"{a} and {b} are not the same pipeline: components {', '.join(names)} against "
            f"{', '.join(other) or 'none'}", path=b,
            hint=f"compare one component at a time, e.g. torchverity diff "
                 f"{shell_path(a / names[0])} {shell_path(b / names[0] if other else b)}")
    entries = [replace(e, name=f"{name}/{e.name}") for name in names
               for e in diff(a / name, b / name, rtol=rtol, atol=atol).entries]
    return DiffResult(os.fspath(a), os.fspath(b), rtol, atol, tuple(entries))


def _leaves(obj: Any) -> tuple[dict[str, Any], str]:
    from torchverity._tensors import iter_leaves

    if isinstance(obj, (str, os.PathLike)):
        inert = _read_inertly(Path(obj))
        if inert is not None:
            return inert, os.fspath(obj)
        from torchverity.checkpoint._read import read_unverified

        return dict(iter_leaves(read_unverified(obj))), os.fspath(obj)
    return dict(iter_leaves(obj)), f"<{type(obj).__name__}>"


def _read_inertly(path: Path) -> dict[str, Any] | None:
    """A pickle file weights_only refuses, read inertly: its tensors, plain values and what
    its objects were (a payload is an entry of its own, so a file that carries one never
    compares equal to its clean copy). None for any other file."""
    from torchverity.pickles._file_format import checkpoint_format

    if not path.is_file() or checkpoint_format(path) not in ("pt", "pt-legacy", "pickle"):
        return None
    from torchverity.pickles._extract import refused_contents
    from torchverity.pickles._scan import scan_file

    found = refused_contents(path, scan_file(path))
    return None if found is None else {**found[1], **found[0]}


def _diff_listed(a: Any, b: Any, listed_a: Listing, listed_b: Listing, rtol: float,
                 atol: float) -> DiffResult:
    from torchverity.checkpoint._diff_listing import listed_diff

    entries: dict[str, TensorDiff] = {}
    changed = []
    for name in sorted(set(listed_a) | set(listed_b)):
        one, two = listed_a.get(name, ...), listed_b.get(name, ...)
        found = listed_diff(name, one, two)
        if found is None:  # bytes differ: compared from the files' bytes (numpy imported)
            from torchverity.checkpoint._diff_words import compare_listed

            found = compare_listed(name, one, two, rtol, atol)
        if found is None:
            changed.append(name)
        else:
            entries[name] = found
    if changed:  # what numpy cannot widen is opened (torch imported then)
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
