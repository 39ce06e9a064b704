"""Preflight for loaders: the scan's bounds, checked before torch sees the file's bytes.

torch inflates every deflated zip record to the size the archive claims, parses
any safetensors header it is given, and rebuilds whatever nesting a pickle
describes; ``check_limits`` refuses a file that would make it do unbounded
work, with a :class:`~torchverity.errors.FormatError` naming the bound. It
never imports torch and reads no tensor data.

>>> from torchverity.pickles import check_limits
>>> check_limits("model.pt")                       # doctest: +SKIP
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from torchverity.pickles._source import Limits

if TYPE_CHECKING:
    from torchverity.pickles._containers import Container


def _refuse(path: Path, what: str) -> None:
    from torchverity.errors import FormatError

    raise FormatError(
        f"{path}: refused before loading: {what}", path=path,
        hint=f"torchverity scan {path} shows every reading of the file",
    )


def _limit_errors(container: Container) -> list[str]:
    out = list(container.bounds)
    for entry in container.entries:
        out += [f"{entry.name}: {r.error}" for r in entry.streams
                if r.error is not None and r.error_limit]
    for nested in container.nested:
        if nested.container is not None:
            out += _limit_errors(nested.container)
    return out


def _check_safetensors(path: Path, limits: Limits) -> None:
    with open(path, "rb") as fh:
        head = fh.read(8)
        size = os.fstat(fh.fileno()).st_size
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        # A length past the end is damage, which the loader's own checks report (with the
        # sidecar's verdict); a header that is really there and huge is refused here.
        if limits.max_header < n <= size - 8:
            _refuse(path, f"safetensors header of {n} bytes is over the {limits.max_header}-byte "
                          "bound")


def check_safetensors_limits(path: str | os.PathLike[str], *,
                             limits: Limits | None = None) -> None:
    """The bound for a reader that parses a .safetensors file itself (never a pickle
    reader): its header's size. Cheaper than :func:`check_limits`, which also walks every
    reading torch's loaders could make of the bytes."""
    _check_safetensors(Path(path), limits or Limits())


def check_limits(path: str | os.PathLike[str], *, limits: Limits | None = None) -> None:
    """Raise FormatError if loading ``path`` would exceed the scan's bounds; else return."""
    # The scan's walkers (pickle, zip) load only for a file that needs them.
    from torchverity.pickles._containers import scan_fh
    from torchverity.pickles._ops import PickleError
    from torchverity.pickles._zip import inflation_problems, zip_views

    p = Path(path)
    bounds = limits or Limits()
    if p.is_dir() or not p.exists():
        return
    if p.suffix == ".safetensors":
        _check_safetensors(p, bounds)
    with open(p, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if fh.read(4) in (b"PK\x03\x04", b"PK\x05\x06"):
            try:
                for view in zip_views(fh, size, []):
                    for problem in inflation_problems(view.members, size, bounds):
                        _refuse(p, problem)
            except PickleError:
                return  # not readable as a zip: the loader reports that itself
        fh.seek(0)
        try:
            container = scan_fh(fh, size, bounds, p.name, 0)
        except PickleError as exc:
            if exc.limit:
                _refuse(p, str(exc))
            return
    errors = _limit_errors(container)
    if errors:
        _refuse(p, errors[0])
