"""Preflight for loaders: the scan's bounds, checked before torch sees the file's bytes.

torch inflates every deflated zip record to the size the archive claims, parses
any safetensors header it is given, and rebuilds whatever nesting a pickle
describes; ``check_limits`` refuses a file that would make it do unbounded
work, with a :class:`~torchverity.errors.FormatError` naming the bound. It
never imports torch and reads no tensor data. A zip checkpoint as torch writes
it (one pickle, ``<prefix>/data.pkl``, stored) reads only its central
directory and that pickle, walked for the bounds alone; every other file gets
the scan's full model of every reading.

>>> from torchverity.pickles import check_limits
>>> check_limits("model.pt")                       # doctest: +SKIP
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from torchverity.errors import shell_path
from torchverity.pickles._source import Limits, PickleError

if TYPE_CHECKING:
    from torchverity.pickles._containers import Container
    from torchverity.pickles._zip import ZipView

# A data.pkl larger than this is walked by the full scan, which streams it.
_FAST_PICKLE_BYTES = 256 << 20


def _refuse(path: Path, what: str) -> None:
    from torchverity.errors import FormatError

    raise FormatError(
        f"{path}: refused before loading: {what}", path=path,
        hint=f"torchverity scan {shell_path(path)} shows every reading of the file",
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
    # The zip reader loads only for a file that needs it, the full scan only for a file
    # not laid out as torch writes it.
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
            problems: list[str] = []
            try:
                views = zip_views(fh, size, problems)
                for view in views:
                    for problem in inflation_problems(view.members, size, bounds):
                        _refuse(p, problem)
                if _torch_zip_within_bounds(fh, views, problems, bounds):
                    return
            except PickleError as exc:
                if exc.limit:
                    _refuse(p, str(exc))
                return  # not readable as a zip: the loader reports that itself
        from torchverity.pickles._containers import scan_fh

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


def _torch_zip_within_bounds(fh: BinaryIO, views: list[ZipView], problems: list[str],
                             limits: Limits) -> bool:
    """True when the archive is laid out as torch writes it and its pickle is within bounds.

    Raises PickleError (``limit=True``, the entry named) where the pickle exceeds one;
    False leaves the file to the full scan.
    """
    from torchverity.pickles._bounds import Unsure, walk_bounds
    from torchverity.pickles._zip import check_member, data_start

    if problems or len(views) != 1 or not views[0].members:
        return False
    members = views[0].members
    pickles = [m for m in members if m.name.lower().endswith(".pkl")]
    wanted = f"{members[0].name.split('/')[0]}/data.pkl"
    if len(pickles) != 1 or pickles[0].name != wanted:
        return False
    member = pickles[0]
    if not check_member(member, problems) or member.method != 0 \
            or member.csize > _FAST_PICKLE_BYTES:
        return False
    fh.seek(data_start(fh, member, problems))
    data = fh.read(member.csize)
    if problems or len(data) != member.csize or b"_load_from_bytes" in data:
        return False  # a nested archive's loader: the full scan opens what it reads
    try:
        walk_bounds(data, limits)
    except Unsure:
        return False
    except PickleError as exc:
        raise PickleError(f"{member.name}: {exc}", exc.offset, limit=True) from None
    return True
