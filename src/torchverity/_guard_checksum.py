"""Per-tensor device checksums for the guard's at-rest check, a few passes over the data.

The guard checksums every parameter and optimizer-state tensor twice per step
(after the update, before the next one), so the cost must stay near a copy.
Each tensor's bytes are read as 32-bit words ``w`` and two sums modulo 2**32
are taken, both with native int32 wrap-around arithmetic:

* ``s1 = sum(w)``: any change confined to one word changes it, so every
  single-bit flip, in any dtype, is always caught;
* ``s2 = sum(w[i] * m[i mod 2**20] * q[i div 2**20])`` with fixed random odd
  multipliers ``m`` and ``q``: position-dependent, so swapped elements and
  several changes that cancel in ``s1`` still show, except by a ~2**-32
  coincidence.

Small tensors of the same device are packed into one buffer (one copy) and
summed per tensor through a cumulative sum read at each tensor's end, so the
number of ops does not grow with the number of tensors. Both the record and
the verification are computed here; the values are not comparable with
:func:`torchverity.fingerprint.device_checksum`. No host-device synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchverity.fingerprint import byte_view

_SPAN = 1 << 20  # words with distinct multipliers; also the size of a packed buffer
_SMALL = 1 << 16  # tensors up to this many words are packed; larger ones need no copy
_MAX_CHUNKS = 1 << 16  # chunk multipliers: tensors up to 2**36 words (256 GiB)
_multipliers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Odd int32 multipliers, generated once per device from a fixed seed."""
    if device not in _multipliers:
        gen = torch.Generator().manual_seed(0x7E57AB1E)
        m = torch.randint(-(2**31), 2**31, (_SPAN,), dtype=torch.int64, generator=gen) | 1
        q = torch.randint(-(2**31), 2**31, (_MAX_CHUNKS,), dtype=torch.int64, generator=gen) | 1
        _multipliers[device] = (m.to(torch.int32).to(device), q.to(torch.int32).to(device))
    return _multipliers[device]


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (zero-padded to a multiple of 4 bytes)."""
    flat = byte_view(tensor)
    pad = -flat.numel() % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    try:
        return flat.view(torch.int32)
    except RuntimeError:  # a view whose byte offset is not 4-aligned
        return flat.clone().view(torch.int32)


def _nwords(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // 4)


class PackedChecksum:
    """Computes ``[n, 2]`` int32 checksums of a list of tensors; caches the packing plan."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, str], ...] = ()
        self._groups: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        self._large: list[int] = []

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, 2, dtype=torch.int32)
        key = tuple((_nwords(t), str(t.device)) for t in tensors)
        if key != self._key:
            self._plan(key)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for members, ends, mult in self._groups:
            sums = _packed_sums([tensors[i] for i in members], ends, mult)
            for row, i in enumerate(members):
                out[i] = sums[row]
        for i in self._large:
            out[i] = _large_sums(tensors[i])
        return torch.stack([o for o in out if o is not None])

    def _plan(self, key: tuple[tuple[int, str], ...]) -> None:
        self._key, self._groups, self._large = key, [], []
        by_device: dict[str, list[int]] = {}
        for i, (words, dev) in enumerate(key):
            if words > _SMALL:
                self._large.append(i)
            else:
                by_device.setdefault(dev, []).append(i)
        for dev, members in by_device.items():
            group: list[int] = []
            total = 0
            for i in members:
                if group and total + key[i][0] > _SPAN:
                    self._add_group(group, key, torch.device(dev))
                    group, total = [], 0
                group.append(i)
                total += key[i][0]
            self._add_group(group, key, torch.device(dev))

    def _add_group(self, group: list[int], key: tuple[tuple[int, str], ...],
                   device: torch.device) -> None:
        ends: list[int] = []
        for i in group:
            ends.append((ends[-1] if ends else 0) + key[i][0])
        m, _ = _tables(device)
        self._groups.append((group, torch.tensor(ends, dtype=torch.int64, device=device),
                             m[: ends[-1]]))


def _packed_sums(tensors: list[torch.Tensor], ends: torch.Tensor,
                 mult: torch.Tensor) -> torch.Tensor:
    words = torch.cat([_words(t) for t in tensors])
    both = torch.stack([words, words * mult])
    # A leading zero column makes each tensor's sums "cumsum at its end minus at its start".
    cs = torch.cumsum(torch.nn.functional.pad(both, (1, 0)), dim=1, dtype=torch.int32)
    at_end = cs.index_select(1, ends)
    starts = torch.cat([cs[:, :1], at_end[:, :-1]], dim=1)
    return (at_end - starts).t()


def _large_sums(tensor: torch.Tensor) -> torch.Tensor:
    words = _words(tensor)
    m, q = _tables(words.device)
    full, rest = divmod(words.numel(), _SPAN)
    s1 = words.sum(dtype=torch.int32)
    per_chunk = (words[: full * _SPAN].view(full, _SPAN) * m).sum(dim=1, dtype=torch.int32)
    s2 = (per_chunk * q[:full]).sum(dtype=torch.int32)
    if rest:
        tail = (words[full * _SPAN:] * m[:rest]).sum(dtype=torch.int32)
        s2 = s2 + tail * q[full]
    return torch.stack([s1, s2])
