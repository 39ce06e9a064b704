"""Naming a tensor-parallel rank whose forward pass computes wrongly.

Inside a tensor-parallel group every rank runs the same micro-batch, and wherever
the plan makes an activation whole again (after a rowwise layer's all-reduce, in the
norms and activations that follow, the output and the loss) every rank must hold the
same bytes. Each rank digests every module's output as the forward pass produces it;
the group exchanges 16 bytes per output and votes. A rank outside a strict majority
is named with the first module whose output it got wrong. Outputs that differ on
every rank are shards of an activation (a colwise layer's slice) and are not
compared; neither is a fault inside a sharded matmul, which the next all-reduce hands
to every rank alike (only a second computation of the same shard could show it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from torchverity.distributed._checks import (
    Batch,
    LossFn,
    ReplicaCheckResult,
    TensorDisagreement,
    _compare,
    _unwrap,
)
from torchverity.distributed._comm import DEFAULT_TIMEOUT_S, HashMode, digest_rows, open_comm
from torchverity.distributed._placements import is_dtensor, place, rank_coordinates


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None


class _OutputDigests:
    """Forward hooks on every module: the digest of each output, in the order produced."""

    def __init__(self, model: torch.nn.Module, mode: HashMode) -> None:
        self.rows: list[tuple[str, torch.Tensor, tuple[str, ...]]] = []
        self._mode = mode
        self._handles = [m.register_forward_hook(self._hook(name or "(root)"))
                         for name, m in model.named_modules()]

    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            out = _first_tensor(output)
            if out is None:
                return
            p = place(out)  # a DTensor output keeps its placements: shards are not voted
            self.rows.append((f"{name} output", digest_rows([p.local], self._mode,
                                                            p.local.device), p.sharded))
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _forward(model: torch.nn.Module, loss_fn: LossFn, batch: Any, seed: int,
             mode: HashMode) -> list[tuple[str, torch.Tensor, tuple[str, ...]]]:
    buffers = list(model.buffers())
    saved = [b.detach().clone() for b in buffers]
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    digests = _OutputDigests(model, mode)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            loss = loss_fn(model, batch)
        local = place(loss).local.detach()
        return [*digests.rows, ("loss", digest_rows([local], mode, local.device), ())]
    finally:
        digests.close()
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)


def _keep(d: TensorDisagreement) -> bool:
    """A disagreement that says something: a majority, or over what must be whole."""
    return bool(d.odd_ranks) or d.name == "loss"


def tp_forward_audit(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batch: Batch,
    *,
    group: dist.ProcessGroup | None = None,
    step: int | None = None,
    seed: int = 0,
    mode: HashMode = "auto",
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> ReplicaCheckResult:
    """Run ``batch`` forward on every rank of the tensor-parallel ``group`` and vote.

    ``loss_fn(model, batch)`` returns the scalar loss; every rank of ``group`` (the
    TP group: ``mesh["tp"].get_group()``, all ranks by default) passes the same batch,
    and every rank of the job runs the audit together (the forward pass has its own
    collectives). Nothing is trained: no gradient, buffers and RNG state as they were.
    The result names each rank outside a strict majority, module by module
    (``"3 output"``, ``"loss"``), with its mesh coordinates; with two TP ranks a
    differing loss is reported without a culprit. ``unreplicated`` counts the
    outputs that are shards of an activation.
    """
    c = open_comm(group, timeout, "tp_forward_audit")
    module = _unwrap(model)
    rows = _forward(module, loss_fn, batch, seed, mode)
    names = [name for name, _, _ in rows]
    result = _compare(c, "forward outputs", names, [], mode, step,
                      [(row, sharded) for _, row, sharded in rows])
    kept = tuple(d for d in result.disagreements if _keep(d))
    shards = len({d.name for d in result.disagreements if not _keep(d)})
    dtensors: list[Any] = [p for p in module.parameters() if is_dtensor(p)]
    coords = rank_coordinates(dtensors[0].device_mesh, c.ranks) if dtensors else ()
    return dataclasses.replace(
        result, disagreements=kept, coordinates=coords or result.coordinates,
        tensors_checked=result.tensors_checked - shards,
        unreplicated=result.unreplicated + shards)
