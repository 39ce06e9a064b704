"""Fault drills on files: flip one bit, or cut the end off.

Used by people to rehearse (does my pipeline notice?) and by the test-suite
to prove every detector. A drill writes into a copy when asked, so the
original stays intact.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from torchverity.errors import InputError, UsageError


@dataclass(frozen=True)
class BitFlip:
    """A bit flipped in a file: where, and the byte before and after."""

    path: str
    offset: int
    bit: int
    before: int
    after: int


@dataclass(frozen=True)
class Truncation:
    """A file cut short: how many bytes went, its size before and after."""

    path: str
    removed: int
    old_size: int
    new_size: int


def _target(path: str | os.PathLike[str], output: str | os.PathLike[str] | None) -> Path:
    src = Path(path)
    if not src.is_file():
        raise InputError(f"{src}: no such file", path=src)
    if output is None:
        return src
    dst = Path(output)
    if dst.exists() and dst.samefile(src):
        return src  # "-o FILE" naming FILE itself: damage it in place
    shutil.copyfile(src, dst)
    return dst


def flip_bit(
    path: str | os.PathLike[str],
    offset: int | None = None,
    bit: int | None = None,
    *,
    seed: int | None = None,
    output: str | os.PathLike[str] | None = None,
) -> BitFlip:
    """Flip ``bit`` (0 = least significant) of the byte at ``offset``.

    Without ``offset``/``bit`` a random position is drawn from ``seed``.
    """
    target = _target(path, output)
    size = target.stat().st_size
    if size == 0:
        raise InputError(f"{target}: empty file, no bit to flip", path=target)
    rng = random.Random(seed)
    offset = rng.randrange(size) if offset is None else offset
    bit = rng.randrange(8) if bit is None else bit
    if not 0 <= offset < size:
        raise UsageError(
            f"offset {offset} is outside {target} (size {size} bytes)",
            hint=f"use an offset from 0 to {size - 1}, or a negative offset from the end",
        )
    if not 0 <= bit < 8:
        raise UsageError(f"bit {bit} is not in 0..7")
    with open(target, "r+b") as fh:
        fh.seek(offset)
        before = fh.read(1)[0]
        after = before ^ (1 << bit)
        fh.seek(offset)
        fh.write(bytes([after]))
    return BitFlip(os.fspath(target), offset, bit, before, after)


def truncate(
    path: str | os.PathLike[str], nbytes: int, *, output: str | os.PathLike[str] | None = None
) -> Truncation:
    """Remove the last ``nbytes`` bytes."""
    target = _target(path, output)
    size = target.stat().st_size
    if not 0 < nbytes <= size:
        raise UsageError(f"cannot remove {nbytes} bytes from {target} (size {size} bytes)")
    os.truncate(target, size - nbytes)
    return Truncation(os.fspath(target), nbytes, size, size - nbytes)
