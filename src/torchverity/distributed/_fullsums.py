"""Digests of the full tensors of a sharded state, computed from the shards where they live.

A hash over a whole tensor needs its bytes in order on one device. A
position-weighted sum does not: each element contributes ``word * m(i)``
where ``i`` is its position in the *full* tensor, so every rank sums its own
shard with its global positions and the sums of all shards (one copy of each,
replicas left out) add up to the sum of the full tensor, mod 2**64. Saved on
a 4-rank mesh and loaded on 2, the same tensors give the same two sums: this
is what verifies a resharded load without gathering any tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torchverity.distributed._comm import Comm, all_gather
from torchverity.distributed._placements import is_dtensor

ALGO = "tvpos64x2-v1"
_CHUNK = 1 << 22  # elements per pass: bounds the index tensors' memory
_MASK64 = (1 << 64) - 1
_K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _s64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a (nested) state dict by dotted path, DTensors kept whole."""
    if isinstance(state, Mapping):
        for key, value in state.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from leaves(value, f"{prefix}.{i}" if prefix else str(i))
    elif hasattr(state, "state_dict") and not isinstance(state, torch.Tensor):
        yield from leaves(state.state_dict(), prefix)
    elif isinstance(state, torch.Tensor):
        yield prefix, state


def _placement(t: torch.Tensor,
               first: bool) -> tuple[torch.Tensor, list[int], list[int], bool] | None:
    """(local, global shape, global offset, counted here) or None when not summable.

    One copy of each piece is counted: a plain tensor on the group's first
    rank, a DTensor shard on the rank at coordinate 0 of every replicated dim.
    """
    if not is_dtensor(t):
        return t.detach(), list(t.shape), [0] * t.dim(), first
    dt: Any = t
    kinds = {type(p).__name__ for p in dt.placements}
    if not kinds <= {"Shard", "Replicate"}:
        return None  # strided or partial shards have no simple global offset
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    coordinate = dt.device_mesh.get_coordinate() or ()
    first_copy = all(c == 0 for c, p in zip(coordinate, dt.placements, strict=True)
                     if p.is_replicate())
    return dt.to_local().detach(), list(dt.shape), list(offset), first_copy


def _partial_sums(local: torch.Tensor, shape: list[int], offset: list[int]) -> torch.Tensor:
    size = local.element_size()
    total = torch.zeros(2, dtype=torch.int64, device=local.device)
    if local.numel() == 0:
        return total
    words = local.contiguous().view(_WORDS[size]).to(torch.int64)
    if size < 8:
        words &= (1 << (8 * size)) - 1
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    dims = [(torch.arange(n, device=local.device) + o) * s
            for n, o, s in zip(local.shape, offset, strides, strict=True)]
    rows = local.shape[0] if local.dim() else 1
    per = max(1, _CHUNK // max(1, local.numel() // rows))
    for r0 in range(0, rows, per):
        idx = _positions(dims, r0, min(rows, r0 + per), local.device)
        chunk = words.reshape(rows, -1)[r0 : r0 + per].reshape(-1)
        m1 = (idx * _s64(_K[0]) + _s64(_K[1])) | 1
        m2 = ((idx ^ _s64(_K[2])) * _s64(_K[3])) | 1
        total[0] += (chunk * m1).sum()
        total[1] += (chunk * m2).sum()
    return total


def _positions(dims: list[torch.Tensor], r0: int, r1: int, device: torch.device) -> torch.Tensor:
    if not dims:
        return torch.zeros(1, dtype=torch.int64, device=device)
    idx = dims[0][r0:r1]
    for v in dims[1:]:
        idx = idx.unsqueeze(-1) + v
    return idx.reshape(-1)


def full_sums(c: Comm, state: Any) -> dict[str, str | None]:
    """Name -> hex of the full tensor's two sums (None: placement not summable), on every rank."""
    names, rows = [], []
    for name, t in leaves(state):
        placed = _placement(t, c.index == 0) if t.element_size() in _WORDS else None
        names.append(name)
        if placed is None:
            rows.append(torch.tensor([0, 0, 0], dtype=torch.int64))
            continue
        local, shape, offset, counted = placed
        sums = _partial_sums(local, shape, offset) if counted else torch.zeros(2, dtype=torch.int64)
        rows.append(torch.cat([torch.ones(1, dtype=torch.int64), sums.cpu()]))
    stacked = torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.int64)
    gathered = all_gather(c, stacked, "the full-tensor digest exchange").cpu().tolist()
    out: dict[str, str | None] = {}
    for i, name in enumerate(names):
        if not all(g[i][0] for g in gathered):
            out[name] = None
            continue
        s1 = sum(g[i][1] for g in gathered) & _MASK64
        s2 = sum(g[i][2] for g in gathered) & _MASK64
        out[name] = f"{s1:016x}{s2:016x}"
    return out
