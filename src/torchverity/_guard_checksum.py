"""Per-tensor device checksums of many tensors in a fixed, small number of ops.

:func:`torchverity.fingerprint.checksum_tensors` runs about a dozen ops per
tensor; a model plus its optimizer state has hundreds of tensors, so the
guard's per-step cost would be dominated by op launches. Here small tensors
of the same element size are packed into one word buffer (one copy), weighted
by two odd multipliers of their position in the buffer, and summed per tensor
through a cumulative sum read at each tensor's end. Any change confined to one
element of a tensor changes that tensor's sums (an odd multiplier is
invertible modulo 2**64), which is all the at-rest check needs: both the
record and the verification are computed here, so the values never have to
match :func:`~torchverity.fingerprint.device_checksum`. Large tensors go
through ``device_checksum`` itself, whose op count is negligible next to
their size. No host-device synchronisation anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchverity.fingerprint import byte_view, device_checksum

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PACK_LIMIT = 1 << 20  # elements per packed buffer: bounds the int64 temporaries (32 MiB)
_K1, _K2, _K3, _K4 = (
    -7046029254386353131, 7195997281048129561, 6364136223846793005, 1442695040888963407
)


class PackedChecksum:
    """Computes ``[n, 2]`` int64 checksums of a list of tensors; caches the packing plan."""

    def __init__(self) -> None:
        self._key: tuple[tuple[int, int, str], ...] = ()
        self._plan: list[tuple[list[int], torch.Tensor]] = []
        self._large: list[int] = []

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(0, 2, dtype=torch.int64)
        key = tuple((t.numel(), t.element_size(), str(t.device)) for t in tensors)
        if key != self._key:
            self._build(key, tensors[0].device)
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for members, ends in self._plan:
            sums = _packed([tensors[i] for i in members], ends)
            for row, i in enumerate(members):
                out[i] = sums[row]
        for i in self._large:
            out[i] = device_checksum(tensors[i])
        return torch.stack([o for o in out if o is not None])

    def _build(self, key: tuple[tuple[int, int, str], ...], device: torch.device) -> None:
        self._key, self._plan, self._large = key, [], []
        by_size: dict[tuple[int, str], list[int]] = {}
        for i, (numel, size, dev) in enumerate(key):
            if numel > _PACK_LIMIT:
                self._large.append(i)
            else:
                by_size.setdefault((min(size, 8), dev), []).append(i)
        for (_, dev), members in by_size.items():
            group: list[int] = []
            total = 0
            for i in members + [-1]:
                if i == -1 or (group and total + key[i][0] > _PACK_LIMIT):
                    self._add_group(group, key, torch.device(dev))
                    group, total = [], 0
                if i != -1:
                    group.append(i)
                    total += key[i][0]

    def _add_group(self, group: list[int], key: tuple[tuple[int, int, str], ...],
                   device: torch.device) -> None:
        if not group:
            return
        ends, pos = [], 0
        for i in group:
            pos += key[i][0]
            ends.append(pos)
        self._plan.append((group, torch.tensor(ends, dtype=torch.int64, device=device)))


def _packed(tensors: list[torch.Tensor], ends: torch.Tensor) -> torch.Tensor:
    size = min(tensors[0].element_size(), 8)
    words = torch.cat([byte_view(t).view(_WORD[size]) for t in tensors]).to(torch.int64)
    if size < 8:
        words &= (1 << (8 * size)) - 1
    idx = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
    m1 = (idx * _K1 + _K2) | 1
    m2 = ((idx ^ _K3) * _K4) | 1
    # A leading zero makes every tensor's sum "cumsum at its end minus at its start".
    sums = torch.stack([(words * m1), (words * m2)], dim=1)
    cs = torch.cat([torch.zeros(1, 2, dtype=torch.int64, device=words.device),
                    torch.cumsum(sums, dim=0)])
    at_end = cs.index_select(0, ends)
    starts = torch.cat([cs[:1], at_end[:-1]])
    return at_end - starts
