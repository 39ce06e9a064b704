"""Cross-rank replay through a sharded (FSDP2) model: no rank holds the full model.

Under pure FSDP no two ranks hold the same shard, so there is nothing to vote
on; what can still be compared is *computation*. Each rank runs its own
micro-batch and its neighbour's through the sharded model, with the
all-gathers happening as in training. At each FSDP unit's reduce-scatter the
input (this rank's full gradient contribution for that unit, before any
reduction) is digested instead of being reduced, so two ranks that computed
the same micro-batch must produce the same digests, unit by unit, and the
same loss. A rank that computes wrongly fails both comparisons it takes part
in and is named. Gradients, buffers and the RNG state are left as they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchverity.distributed._checks import (
    Batch,
    LossFn,
    ReplayAuditResult,
    _replay_comparisons,
    _replay_suspects,
)
from torchverity.distributed._comm import (
    DEFAULT_TIMEOUT_S,
    HashMode,
    all_gather,
    digest_rows,
    open_comm,
    row_bytes,
)
from torchverity.distributed._placements import is_dtensor, rank_coordinates
from torchverity.distributed._replay import exchange_batch
from torchverity.errors import UsageError


class _DigestingReduceScatter:
    """An FSDP2 reduce-scatter that records the digest of its input and reduces nothing.

    The output is zero-filled so FSDP's bookkeeping proceeds; the audit puts
    the real gradients back afterwards.
    """

    def __init__(self, slot: list[torch.Tensor | None], mode: HashMode) -> None:
        self._slot = slot
        self._mode = mode

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        self._slot.append(digest_rows([input_tensor], self._mode, input_tensor.device)[0])
        output_tensor.zero_()


def _fsdp_units(model: torch.nn.Module) -> list[tuple[str, Any]]:
    from torch.distributed.fsdp import FSDPModule

    units = [(name or "(root)", m) for name, m in model.named_modules()
             if isinstance(m, FSDPModule)]
    if not units:
        raise UsageError(
            "sharded_replay_audit: the model has no fully_shard (FSDP2) module",
            hint="use torchverity.distributed.replay_audit for DDP or unsharded models",
        )
    return units


def _param_groups(unit: Any) -> list[Any]:
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None or any(not hasattr(g, "_reduce_scatter_comm") for g in groups):
        raise UsageError(
            "sharded_replay_audit: this torch version's FSDP2 does not expose its reduce-scatter",
            hint="use torch 2.8 or later, or audit with replay_audit on an unsharded copy",
        )
    return list(groups)


def _row_groups(units: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Each FSDP parameter group with the name of its row (one group per unit, usually)."""
    out = []
    for name, unit in units:
        groups = _param_groups(unit)
        for k, group in enumerate(groups):
            suffix = f" (group {k})" if len(groups) > 1 else ""
            out.append((f"{name} gradient contribution{suffix}", group))
    return out


class _Recording:
    """Install digesting reduce-scatters on every FSDP parameter group; restore them on exit."""

    def __init__(self, groups: list[tuple[str, Any]], mode: HashMode) -> None:
        self.slots: list[list[torch.Tensor | None]] = [[] for _ in groups]
        self._saved = [(g, g._reduce_scatter_comm) for _, g in groups]
        self._mode = mode

    def __enter__(self) -> _Recording:
        # Set on each group (as FSDPModule.set_custom_reduce_scatter does), which also
        # covers units with several parameter groups.
        for (group, _), slot in zip(self._saved, self.slots, strict=True):
            group._reduce_scatter_comm = _DigestingReduceScatter(slot, self._mode)
        return self

    def __exit__(self, *exc: object) -> None:
        for group, comm in self._saved:
            group._reduce_scatter_comm = comm

    def rows(self, device: torch.device) -> list[torch.Tensor]:
        missing = torch.zeros(2, dtype=torch.int64, device=device)  # a unit that got no gradient
        return [slot[0].to(device) if slot and slot[0] is not None else missing
                for slot in self.slots]


def _replay_one(model: torch.nn.Module, loss_fn: LossFn, batch: Any,
                groups: list[tuple[str, Any]], seed: int, mode: HashMode,
                device: torch.device) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = list(model.buffers())
    saved = [b.detach().clone() for b in buffers]
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        for p in params:
            p.grad = None
        with _Recording(groups, mode) as rec, torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            loss = loss_fn(model, batch)
            loss.backward()
        if not any(rec.slots):
            raise UsageError(
                "sharded_replay_audit: no FSDP unit reduce-scattered a gradient during the "
                "replay (gradient sync is off, e.g. inside gradient accumulation)",
                hint="call the audit after the optimizer step, with "
                "model.set_requires_gradient_sync(True)",
            )
        loss_row = digest_rows([loss.detach()], mode, device)[0]
        return torch.stack([loss_row, *rec.rows(device)])
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)


def sharded_replay_audit(
    model: torch.nn.Module,
    loss_fn: LossFn,
    batch: Batch,
    *,
    group: dist.ProcessGroup | None = None,
    step: int | None = None,
    seed: int = 0,
    mode: HashMode = "auto",
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> ReplayAuditResult:
    """Replay the next rank's micro-batch through the FSDP2-sharded model and compare.

    ``loss_fn(model, batch)`` returns the scalar loss of one micro-batch.
    ``group`` is the group FSDP shards over (all ranks by default); call it
    on every rank of it. The comparison covers the loss and, per FSDP unit,
    the gradient contribution handed to its reduce-scatter; results name the
    unit (``"layers.0 gradient contribution"``). With 3 or more ranks a rank
    whose every comparison fails is named. Each audit costs two extra
    forward and backward passes with their all-gathers and no reduce-scatter.
    """
    c = open_comm(group, timeout, "sharded_replay_audit")
    groups = _row_groups(_fsdp_units(model))
    neighbour, batch_bytes = exchange_batch(c, batch)
    own = _replay_one(model, loss_fn, batch, groups, seed, mode, c.device)
    other = _replay_one(model, loss_fn, neighbour, groups, seed, mode, c.device)
    gathered = all_gather(c, torch.stack([own, other]), "the sharded replay digest exchange").cpu()
    names = ["loss", *(name for name, _ in groups)]
    comparisons = _replay_comparisons(c, names, gathered)
    dtensors: list[Any] = [p for p in model.parameters() if is_dtensor(p)]
    mesh = dtensors[0].device_mesh if dtensors else None
    return ReplayAuditResult(
        rank=c.rank, ranks=c.ranks, comparisons=comparisons,
        suspects=_replay_suspects(c.ranks, comparisons),
        bytes_exchanged=batch_bytes + row_bytes(2 * len(names), c.world),
        step=step,
        coordinates=rank_coordinates(mesh, c.ranks) if mesh is not None else (),
    )
