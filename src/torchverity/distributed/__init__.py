"""Integrity checks across the ranks of a ``torch.distributed`` job.

In data-parallel training every replica must hold bit-identical parameters
after each step, and every rank must receive the same reduced gradients. A
GPU that computes a wrong result or a link that corrupts a gradient breaks
that silently. These checks make it loud and name the rank:

``check_replicas(model, optimizer)``
    Each rank digests its parameters, buffers and optimizer state where they
    live (no tensor leaves the device); the ranks exchange 16 bytes per tensor
    and a majority vote names the odd rank(s) and the tensors that differ.
    DTensor placements (FSDP2, HSDP, tensor parallel) decide which ranks hold
    the same shard: only those are compared with each other.
``GradientCheck(model)``
    After backward (and, with :meth:`GradientCheck.comm_hook`, right after
    each DDP bucket's all-reduce) the reduced gradients are compared the same way.
``replay_audit(model, loss_fn, batch)``
    Each rank recomputes its neighbour's micro-batch; a rank whose loss and
    gradients are not reproduced by the others is named.
``repair_replicas(model, optimizer)`` / ``HealPolicy``
    Copy the majority's bytes into the odd replica's tensors in place and
    check again, so training continues without a restart (3+ replicas).
``sharded_replay_audit(fsdp_model, loss_fn, batch)``
    The replay for pure FSDP2, where no two ranks hold the same shard: the
    ranks compare losses and each unit's gradient contribution.
``tp_forward_audit(tp_model, loss_fn, batch)``
    Inside a tensor-parallel group every rank must produce the same whole
    activations and loss: each module's output is digested and voted, and a
    rank whose forward computes wrongly is named with the first module it got wrong.
``FlagReducer(group)``
    One ``all_reduce(MAX)`` of a guard's anomaly flags, so all ranks skip,
    stop or roll back together (``TrainingGuard(reducer=FlagReducer())``).
``save_rank0`` / ``save_dcp`` / ``load_dcp``
    Verified checkpoints: rank 0 writes and re-checks while the others wait;
    ``torch.distributed.checkpoint`` folders get a manifest (each rank hashes
    the files it wrote) and are verified before anything is unpickled;
    ``read_certification(path)`` reads a training guard's verdict kept with one.

Every collective waits at most ``timeout`` seconds, so a dead or stuck rank
raises :class:`~torchverity.errors.DistributedTimeoutError` instead of hanging.

>>> import torchverity.distributed as tvd               # doctest: +SKIP
>>> result = tvd.check_replicas(ddp_model, optimizer)   # doctest: +SKIP
>>> result.raise_if_failed()                            # doctest: +SKIP
"""

from __future__ import annotations

from torchverity.distributed._checkpoint import (
    DcpLoadReport,
    load_dcp,
    read_certification,
    save_dcp,
    save_rank0,
)
from torchverity.distributed._checks import (
    FlagReducer,
    GradientCheck,
    ReplayAuditResult,
    ReplayComparison,
    ReplicaCheckResult,
    TensorDisagreement,
    check_replicas,
    replay_audit,
)
from torchverity.distributed._comm import DEFAULT_TIMEOUT_S, current_rank
from torchverity.distributed._repair import HealPolicy, Repair, RepairReport, repair_replicas
from torchverity.distributed._sharded_replay import sharded_replay_audit
from torchverity.distributed._tp_audit import tp_forward_audit

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DcpLoadReport",
    "FlagReducer",
    "GradientCheck",
    "HealPolicy",
    "Repair",
    "RepairReport",
    "ReplayAuditResult",
    "ReplayComparison",
    "ReplicaCheckResult",
    "TensorDisagreement",
    "check_replicas",
    "current_rank",
    "load_dcp",
    "read_certification",
    "repair_replicas",
    "replay_audit",
    "save_dcp",
    "save_rank0",
    "sharded_replay_audit",
    "tp_forward_audit",
]
