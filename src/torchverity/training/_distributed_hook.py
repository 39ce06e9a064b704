"""The guard on a distributed run: each rank's own shards at rest, replicas voted and healed.

Under FSDP2, HSDP and tensor parallelism parameters, gradients and optimizer state are
DTensors. The guard reads the local piece of each (the bytes this rank holds and
updates), so gradient norms and the at-rest verification cover exactly this rank's
shards, and a tensor verified at rest is named with its shard's mesh coordinates
(``0.weight shard (dp=1)``); every event carries the rank. The fused at-rest check does
not compile DTensors: such a guard verifies its local shards in two passes.

With ``replica_every=N`` the guard compares the replicas after every N-th update
(:func:`~torchverity.distributed.check_replicas`: 16 bytes per tensor, voted inside
each replica group the placements define). A mismatch with a clear majority (3 or more
replicas, a strict majority for every differing tensor) is healed in place from the
majority (:func:`~torchverity.distributed.repair_replicas`); the repair is logged (the
tensor and shard, the source and healed ranks with their mesh coordinates) and training
goes on. Without one nothing is touched: the guard stops, raising
:class:`~torchverity.errors.ReplicaMismatchError` on every rank, or, when the
``weights_changed`` policy is ``rollback``, rolls back to its last certified checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchverity.distributed._checks import ReplicaCheckResult, check_replicas
from torchverity.distributed._placements import is_dtensor, place
from torchverity.distributed._repair import RepairReport, repair_replicas
from torchverity.errors import ReplicaMismatchError, UsageError

if TYPE_CHECKING:
    from torchverity.training._guard import TrainingGuard

log = logging.getLogger("torchverity.training")


# ------------------------------------------------------------------ local shards


def local_shard(tensor: Any) -> Any:
    """This rank's piece of a DTensor; any other value as it is.

    The DTensor's own local tensor, the same object on every call (``to_local()`` on a
    parameter makes a new view each time), so the at-rest record keeps recognising it.
    """
    if not is_dtensor(tensor):
        return tensor
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor.to_local()


def shard_suffix(tensor: Any) -> str:
    """`` shard (dp=1)``: the mesh coordinates of this rank's shard; empty when whole."""
    if not is_dtensor(tensor):
        return ""
    p = place(tensor)
    coords = dict(p.coords)
    return " shard (" + ", ".join(f"{d}={coords[d]}" for d in p.sharded) + ")" if (
        p.sharded) else ""


def local_params(params: Sequence[torch.Tensor], names: Sequence[str]
                 ) -> tuple[list[torch.Tensor], tuple[str, ...]]:
    """The local pieces of ``params`` and their at-rest names (with shard coordinates)."""
    return ([local_shard(p) for p in params],
            tuple(n + shard_suffix(p) for n, p in zip(names, params, strict=True)))


def any_sharded(params: Sequence[torch.Tensor]) -> bool:
    return any(is_dtensor(p) for p in params)


def clip_sharded(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` on DTensor gradients: the norm of the whole model needs
    every rank's shards, which the guard's per-shard norms do not have."""
    total = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    return total.full_tensor() if is_dtensor(total) else total  # type: ignore[attr-defined]


# ------------------------------------------------------------------ replicas


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class DistributedHook:
    """The guard's distributed collaborator: what a sharded model allows, and the replica
    check every ``replica_every`` updates, which heals or refuses."""

    def __init__(self, guard: TrainingGuard, every: int | None) -> None:
        if guard.checkpoint_dir is not None and guard._sharded and guard.reducer is None and (
                _distributed()):
            raise UsageError(
                "TrainingGuard: checkpoint_dir= on a model of DTensor shards (FSDP2, HSDP, "
                "tensor parallel) saves and rolls back on every rank together, so every rank "
                "must act on the same anomalies",
                hint="pass reducer=torchverity.distributed.FlagReducer() (and the same "
                "checkpoint_dir on every rank)")
        self._guard = guard
        self._every = every
        self.reports: list[RepairReport] = []

    def after_update(self, step: int) -> None:
        g, every = self._guard, self._every
        if every is None or (step + 1 - g._start_step) % every or not _distributed():
            return
        result = check_replicas(g.model, g.optimizer, step=step)
        if result.ok:
            return
        try:
            report = repair_replicas(g.model, g.optimizer, result)
        except ReplicaMismatchError as refusal:
            self._refuse(result, refusal)
            return
        self.reports.append(report)
        if any(g.rank in r.targets for r in report.repairs):
            g.refresh()  # the healed bytes are the record of this window now
        self._write(step, "repaired", result, repairs=[_repair_record(result, r)
                                                       for r in report.repairs])

    def _refuse(self, result: ReplicaCheckResult, refusal: ReplicaMismatchError) -> None:
        g = self._guard
        if g.policies["weights_changed"] == "rollback":
            self._write(result.step, "rolled_back", result, reason=refusal.message)
            g.rollback(result.step)
            return
        self._write(result.step, "stopped", result, reason=refusal.message)
        g._tally.stopped = True
        g._log.flush()
        raise refusal

    def _write(self, step: int | None, action: str, result: ReplicaCheckResult,
               **extra: Any) -> None:
        record = {"event": "replicas", "step": step, "action": action,
                  "summary": result.summary(), "ranks": list(result.odd_ranks),
                  "tensors": result.tensors, **extra}
        self._guard._log.write(record)
        if action == "repaired":
            log.warning("torchverity: rank %d: step %s: replicas healed from the majority: %s",
                        self._guard.rank, step, "; ".join(
                            _describe(r) for r in record.get("repairs", ())))


def _repair_record(result: ReplicaCheckResult, repair: Any) -> dict[str, Any]:
    coords = dict(result.coordinates)
    return {"tensor": repair.tensor, "shard": repair.shard, "source": repair.source,
            "source_coordinates": coords.get(repair.source, ""),
            "targets": list(repair.targets),
            "target_coordinates": [coords.get(r, "") for r in repair.targets],
            "bytes": repair.nbytes}


def _describe(r: dict[str, Any]) -> str:
    what = f"{r['tensor']} {r['shard']}" if r["shard"] else r["tensor"]
    src = f"rank {r['source']}" + (f" ({r['source_coordinates']})" if r["source_coordinates"]
                                   else "")
    dst = ", ".join(f"rank {t}" + (f" ({c})" if c else "")
                    for t, c in zip(r["targets"], r["target_coordinates"], strict=True))
    return f"{what} copied from {src} into {dst}"
