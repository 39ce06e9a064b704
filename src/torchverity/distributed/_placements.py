"""Which ranks hold the same bytes: replica groups derived from DTensor placements.

A DTensor (FSDP2, HSDP, tensor parallel) says on which mesh dimensions it is
replicated (``Replicate()``) and on which it is split (``Shard``,
``_StridedShard``) or pending a reduction (``Partial``). Two ranks hold the
same local shard exactly when their mesh coordinates agree on every dimension
that is not replicated, so those coordinates are the key of the tensor's
replica group. A plain tensor (DDP, a norm outside the TP plan) is replicated
on every rank of the group. Mesh dimensions are matched by name, so a tensor
on a sub-mesh (``mesh["dp"]``) is compared with its copies on the sibling
sub-meshes, as FSDP+TP lays norms out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchverity._tensors import dtype_name
from torchverity.distributed._comm import HashMode, row_algo

MAX_MESH_DIMS = 8  # mesh dimension names a check can tell apart (the header has room for these)
HEADER_LEN = 4 + MAX_MESH_DIMS  # count, layout digest (2), number of dims, coordinates


@dataclass(frozen=True)
class Placed:
    """One value as this rank holds it: its local bytes and what it is a piece of."""

    local: Any
    sharded: tuple[str, ...]  # mesh dims on which the tensor is not replicated
    layout: str  # global shape, placements and mesh: equal on every rank of a sound job
    coords: tuple[tuple[str, int], ...]  # this rank's coordinates on the tensor's mesh


def mesh_dim_names(mesh: Any) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    if names:
        return tuple(names)
    # An unnamed mesh: name each dimension by its position and the mesh's shape.
    shape = "x".join(map(str, mesh.mesh.shape))
    return tuple(f"dim{i}of{shape}" for i in range(mesh.ndim))


def is_dtensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and hasattr(value, "placements") and hasattr(
        value, "device_mesh")


def place(value: Any) -> Placed:
    """The local piece of ``value`` and the mesh dimensions its replica group is keyed by."""
    if not isinstance(value, torch.Tensor):
        return Placed(value, (), f"value:{type(value).__name__}", ())
    if not is_dtensor(value):
        t = value.detach()
        return Placed(t, (), f"{dtype_name(t.dtype)}{list(t.shape)}", ())
    dt: Any = value  # a DTensor; torch's stubs type it as a plain Tensor
    mesh = dt.device_mesh
    names = mesh_dim_names(mesh)
    sharded = tuple(n for n, p in zip(names, dt.placements, strict=True)
                    if not p.is_replicate())
    coordinate = mesh.get_coordinate() or ()
    sizes = list(zip(names, mesh.mesh.shape, strict=True))
    layout = (f"{dtype_name(value.dtype)}{list(value.shape)} "
              f"{[str(p) for p in dt.placements]} on {sizes}")
    return Placed(dt.to_local().detach(), sharded, layout,
                  tuple(zip(names, (int(c) for c in coordinate), strict=True)))


def layout_digest(names: Sequence[str], placed: Sequence[Placed],
                  mode: HashMode) -> tuple[int, int]:
    """Digest of what is compared; local shapes are left out (uneven shards differ legitimately)."""
    h = hashlib.sha256(b"torchverity-dist-layout-v2\0")
    for name, p in zip(names, placed, strict=True):
        h.update(f"{name}\0{p.layout}\0{row_algo(p.local, mode)}\n".encode())
    digest = h.digest()
    return (int.from_bytes(digest[:8], "little", signed=True),
            int.from_bytes(digest[8:16], "little", signed=True))


def mesh_dims(placed: Sequence[Placed]) -> tuple[tuple[str, int], ...]:
    """This rank's coordinate on every mesh dimension any tensor lives on, sorted by name."""
    coords: dict[str, int] = {}
    for p in placed:
        coords.update(p.coords)
    return tuple(sorted(coords.items()))


@dataclass(frozen=True)
class Layout:
    """Every rank's coordinates, as gathered in the header exchange."""

    ranks: tuple[int, ...]
    dims: tuple[str, ...]
    coords: tuple[tuple[int, ...], ...]  # coords[i][d]: group index i on dims[d] (-1: none)

    def where(self, index: int) -> str:
        """``replicate=1, shard=0`` for the rank at group index ``index``."""
        return ", ".join(f"{d}={c}" for d, c in zip(self.dims, self.coords[index], strict=True)
                         if c >= 0)

    def key(self, index: int, sharded: Sequence[str]) -> tuple[int, ...]:
        return tuple(self.coords[index][self.dims.index(d)] for d in sharded)

    def replica_groups(self, sharded: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Group indices that hold the same shard, in order of their first member."""
        by_key: dict[tuple[int, ...], list[int]] = {}
        for i in range(len(self.ranks)):
            by_key.setdefault(self.key(i, sharded), []).append(i)
        return tuple(tuple(g) for g in by_key.values())


def header_row(count: int, digest: tuple[int, int],
               dims: tuple[tuple[str, int], ...]) -> list[int]:
    """``[n, layout digest (2), number of dims, coordinates padded with -1]``."""
    coords = [c for _, c in dims][:MAX_MESH_DIMS]
    return [count, *digest, len(dims), *coords, *([-1] * (MAX_MESH_DIMS - len(coords)))]


def layout_from(ranks: tuple[int, ...], dims: tuple[tuple[str, int], ...],
                header: torch.Tensor) -> Layout:
    names = tuple(d for d, _ in dims)
    rows = header.tolist()
    return Layout(ranks, names, tuple(tuple(r[4 : 4 + len(names)]) for r in rows))


def shard_label(layout: Layout, sharded: tuple[str, ...], group: Sequence[int]) -> str:
    """``shard (shard=1)`` for a group holding one shard; empty for a whole replicated tensor."""
    if not sharded:
        return ""
    key = layout.key(group[0], sharded)
    return "shard (" + ", ".join(f"{d}={c}" for d, c in zip(sharded, key, strict=True)) + ")"


def rank_coordinates(mesh: Any, ranks: Sequence[int]) -> tuple[tuple[int, str], ...]:
    """``(rank, "replicate=1, shard=0")`` for each of ``ranks`` found in ``mesh``."""
    names = mesh_dim_names(mesh)
    grid = mesh.mesh
    out = []
    for r in ranks:
        hit = (grid == r).nonzero()
        if len(hit):
            where = ", ".join(f"{n}={int(c)}" for n, c in zip(names, hit[0].tolist(), strict=True))
            out.append((r, where))
    return tuple(out)
