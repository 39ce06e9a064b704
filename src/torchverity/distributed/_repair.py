"""Healing a corrupted replica from the majority, without a restart.

When :func:`check_replicas` names the odd rank of every differing tensor (a
strict majority of 3 or more replicas agrees), the bytes the majority holds
are the right ones: a rank of the majority sends its copy of each differing
tensor (or shard) to the odd ranks of that replica group, which copy it into
their parameter, buffer or optimizer-state tensor in place. The check then
runs again and training continues. Without a clear majority nothing is
touched: the job must stop or roll back to a verified checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from torchverity.distributed._checks import (
    ReplicaCheckResult,
    TensorDisagreement,
    _replica_state,
    check_replicas,
)
from torchverity.distributed._comm import (
    DEFAULT_TIMEOUT_S,
    Comm,
    HashMode,
    open_comm,
    run_collective,
)
from torchverity.distributed._placements import place
from torchverity.errors import ReplicaMismatchError, UsageError

log = logging.getLogger("torchverity.distributed")

MIN_REPLICAS = 3  # a strict majority needs a third opinion


@dataclass(frozen=True)
class Repair:
    """One tensor (or shard) copied from ``source`` into ``targets``."""

    tensor: str
    shard: str
    source: int
    targets: tuple[int, ...]
    nbytes: int

    def describe(self) -> str:
        what = f"{self.tensor} {self.shard}" if self.shard else self.tensor
        to = ", ".join(map(str, self.targets))
        return f"{what}: rank {self.source} -> rank {to} ({self.nbytes} bytes)"


@dataclass(frozen=True)
class RepairReport:
    """What :func:`repair_replicas` did, the same on every rank.

    ``action`` is ``"none"`` (the replicas agreed), ``"repaired"`` (the odd
    ranks were healed and ``after`` agrees), or, from :class:`HealPolicy`
    only, ``"rollback"`` (no clear majority: roll back to a verified checkpoint).
    """

    action: Literal["none", "repaired", "rollback"]
    before: ReplicaCheckResult
    after: ReplicaCheckResult
    repairs: tuple[Repair, ...] = ()

    @property
    def ok(self) -> bool:
        return self.after.ok

    def summary(self) -> str:
        if self.action == "none":
            return self.before.summary()
        if self.action == "rollback":
            return f"not repaired, roll back: {self.before.summary()}"
        done = "; ".join(r.describe() for r in self.repairs[:5])
        more = f" (+{len(self.repairs) - 5} more)" if len(self.repairs) > 5 else ""
        return (f"repaired {len(self.repairs)} tensor(s) from the majority: {done}{more}; "
                f"then: {self.after.summary()}")


def _refusal(result: ReplicaCheckResult, why: str) -> ReplicaMismatchError:
    return ReplicaMismatchError(
        f"not repaired ({why}): {result.summary()}",
        kind=result.kind, ranks=result.odd_ranks, tensors=result.tensors, step=result.step,
        rank=result.rank,
        hint="stop and roll back to the last verified checkpoint (torchverity verify "
        "CHECKPOINT); healing needs 3 or more replicas of every differing tensor and a strict "
        "majority",
    )


def _unclear(result: ReplicaCheckResult) -> str | None:
    """Why the vote does not say which bytes are right, or None when it does."""
    for d in result.disagreements:
        if len(d.replicas or result.ranks) < MIN_REPLICAS:
            return f"{d.label} has only {len(d.replicas or result.ranks)} replicas"
        if not d.odd_ranks:
            return f"no strict majority for {d.label}"
    return None


def _local_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   names: Sequence[str]) -> dict[str, torch.Tensor]:
    all_names, values = _replica_state(model, optimizer, buffers=True)
    by_name = dict(zip(all_names, values, strict=True))
    out = {}
    for name in names:
        value = by_name.get(name)
        if not isinstance(value, torch.Tensor):
            raise UsageError(
                f"repair_replicas: {name} is not a tensor of this model and optimizer on rank "
                f"{dist.get_rank()}, so it cannot be copied from another rank",
                hint="pass the result of check_replicas on the same model and optimizer; plain "
                "hyper-parameters that differ must be set by the training script",
            )
        out[name] = place(value).local
    return out


def _exchange(c: Comm, disagreements: Sequence[TensorDisagreement],
              local: dict[str, torch.Tensor]) -> tuple[Repair, ...]:
    """Majority ranks send, odd ranks receive and copy in place; everybody else waits."""
    ops, landing, repairs = [], [], []
    for d in disagreements:
        source = d.groups[0][0]
        tensor = local[d.name]
        repairs.append(Repair(d.name, d.shard, source, d.odd_ranks,
                              tensor.numel() * tensor.element_size()))
        if c.rank == source:
            wire = tensor.to(c.device).contiguous()
            ops += [dist.P2POp(dist.isend, wire, r, c.group) for r in d.odd_ranks]
        elif c.rank in d.odd_ranks:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=c.device)
            ops.append(dist.P2POp(dist.irecv, buf, source, c.group))
            landing.append((tensor, buf))
    if ops:
        run_collective(c, "the replica repair exchange", lambda: dist.batch_isend_irecv(ops))
    with torch.no_grad():
        for tensor, buf in landing:
            tensor.copy_(buf.to(tensor.device))
    return tuple(repairs)


def repair_replicas(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    result: ReplicaCheckResult | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    step: int | None = None,
    mode: HashMode = "auto",
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> RepairReport:
    """Heal the odd replicas named by ``result`` (or by a fresh check) from the majority.

    Call it on every rank of ``group``. Each differing tensor, or shard of a
    DTensor, is sent by the first rank of its majority to the odd ranks of
    its replica group, which copy it in place (parameters, buffers and
    optimizer state keep their identity, so the optimizer and FSDP keep
    working). The check then runs again. Raises :class:`ReplicaMismatchError`
    without touching anything when the vote does not name the odd rank of
    every differing tensor (fewer than 3 replicas, or no strict majority),
    and when the replicas still differ after the repair.
    """
    before = result or check_replicas(model, optimizer, group, step=step, mode=mode,
                                      timeout=timeout)
    if before.ok:
        return RepairReport("none", before, before)
    why = _unclear(before)
    if why is not None:
        raise _refusal(before, why)
    c = open_comm(group, timeout, "repair_replicas")
    local = _local_tensors(model, optimizer, before.tensors)
    repairs = _exchange(c, before.disagreements, local)
    after = check_replicas(model, optimizer, group, step=before.step, mode=mode, timeout=timeout)
    report = RepairReport("repaired", before, after, repairs)
    for r in repairs:
        if c.rank == r.source or c.rank in r.targets:
            log.warning("rank %d: repaired %s at step %s", c.rank, r.describe(), before.step)
    if not after.ok:
        raise _refusal(after, "the replicas still differ after the repair")
    return report


class HealPolicy:
    """Check the replicas every ``every`` steps and heal them when the vote is clear.

    ``policy.after_step(step)`` goes right after ``optimizer.step()`` on every
    rank (a training guard calls it the same way). With a clear majority the
    odd ranks are repaired and training continues; otherwise
    ``on_unclear="stop"`` raises :class:`ReplicaMismatchError` on every rank
    and ``"rollback"`` returns a report with ``action="rollback"`` so the
    caller restores its last verified checkpoint.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 group: dist.ProcessGroup | None = None, *, every: int = 100,
                 on_unclear: Literal["stop", "rollback"] = "stop", mode: HashMode = "auto",
                 timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        if every < 1 or on_unclear not in ("stop", "rollback"):
            raise UsageError(f"HealPolicy: every must be >= 1 and on_unclear 'stop' or "
                             f"'rollback', got every={every}, on_unclear={on_unclear!r}")
        self._model, self._optimizer, self._group = model, optimizer, group
        self._every, self._on_unclear = every, on_unclear
        self._kw: dict[str, Any] = {"mode": mode, "timeout": timeout}
        self.reports: list[RepairReport] = []

    def after_step(self, step: int) -> RepairReport | None:
        if step % self._every:
            return None
        result = check_replicas(self._model, self._optimizer, self._group, step=step, **self._kw)
        if result.ok:
            return None
        if _unclear(result) is not None and self._on_unclear == "rollback":
            report = RepairReport("rollback", result, result)
        else:
            report = repair_replicas(self._model, self._optimizer, result, self._group,
                                     **self._kw)
        self.reports.append(report)
        return report
