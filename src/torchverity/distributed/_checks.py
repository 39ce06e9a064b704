"""Cross-replica checks: parameters, gradients, replays, flag reduction."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchverity.distributed._comm import (
    DEFAULT_TIMEOUT_S,
    Comm,
    HashMode,
    all_gather,
    all_reduce_max,
    digest_rows,
    open_comm,
    row_bytes,
)
from torchverity.distributed._placements import (
    HEADER_LEN,
    MAX_MESH_DIMS,
    Layout,
    Placed,
    header_row,
    layout_digest,
    layout_from,
    mesh_dims,
    place,
    shard_label,
)
from torchverity.distributed._replay import exchange_batch, replay_rows
from torchverity.errors import ReplicaMismatchError, UsageError

_NO_THIRD_OPINION = (
    "with two replicas the faulty one cannot be named without a third opinion: run "
    "torchverity.distributed.replay_audit with 3 or more ranks, or compare each rank with the "
    "last verified checkpoint"
)
_NOTHING_TO_VOTE = (
    "nothing to vote on for them; cover them with verified sharded checkpoints and, under "
    "FSDP2, torchverity.distributed.sharded_replay_audit"
)


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class TensorDisagreement:
    """One tensor (or one shard of it) whose digest is not the same on all its replicas.

    ``groups`` lists global ranks that agree with each other, largest group
    first; ``odd_ranks`` are those outside a strict majority (empty when no
    value holds more than half of the replicas). ``replicas`` are the ranks
    that hold this piece and were compared; ``shard`` says which shard it is
    (``"shard (shard=1)"``, the mesh coordinates on the sharded dimensions),
    empty for a tensor replicated whole.
    """

    name: str
    groups: tuple[tuple[int, ...], ...]
    odd_ranks: tuple[int, ...]
    shard: str = ""
    replicas: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.name} {self.shard}" if self.shard else self.name


@dataclass(frozen=True)
class ReplicaCheckResult:
    """The same outcome on every rank of the group, so all ranks can act alike.

    ``tensors_checked`` counts the tensors that have a replica on another rank;
    ``unreplicated`` those held by one rank only (sharded on every mesh
    dimension, as under pure FSDP), which no vote can cover. ``coordinates``
    maps each global rank to its mesh coordinates (``replicate=0, shard=1``)
    when any tensor is a DTensor.
    """

    kind: str
    rank: int
    ranks: tuple[int, ...]
    tensors_checked: int
    bytes_exchanged: int
    disagreements: tuple[TensorDisagreement, ...]
    step: int | None = None
    unreplicated: int = 0
    coordinates: tuple[tuple[int, str], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.disagreements

    @property
    def tensors(self) -> list[str]:
        return list(dict.fromkeys(d.name for d in self.disagreements))

    @property
    def odd_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for d in self.disagreements for r in d.odd_ranks}))

    @property
    def attributed(self) -> bool:
        """Every disagreement has a majority, so the odd ranks are known."""
        return bool(self.disagreements) and all(d.odd_ranks for d in self.disagreements)

    def where(self, rank: int) -> str:
        """``rank 3 (replicate=1, shard=1)``: a global rank with its mesh coordinates."""
        coords = dict(self.coordinates).get(rank)
        return f"rank {rank} ({coords})" if coords else f"rank {rank}"

    def _whole_world(self) -> bool:
        """Every disagreement is over all ranks of plain tensors (DDP): the short message."""
        return not self.coordinates and all(
            not d.shard and d.replicas in ((), self.ranks) for d in self.disagreements)

    def summary(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        if self.ok:
            return self._ok_summary(where)
        if not self._whole_world():
            return self._placed_summary(where)
        world = len(self.ranks)
        names = _short_list(self.tensors)
        count = f"{len(self.disagreements)} of {self.tensors_checked} tensors"
        if self.attributed:
            odd = ", ".join(map(str, self.odd_ranks))
            return (f"rank {odd} disagrees with the majority of {world} ranks in {self.kind}"
                    f"{where}: {count} differ: {names}")
        if world == 2:
            return (f"ranks {self.ranks[0]} and {self.ranks[1]} disagree in {self.kind}{where}: "
                    f"{count} differ: {names}; {_NO_THIRD_OPINION}")
        return (f"{self.kind} disagree across {world} ranks{where} with no majority: {count} "
                f"differ: {names}")

    def _ok_summary(self, where: str) -> str:
        scope = (f"within every replica group of the {len(self.ranks)} ranks" if self.coordinates
                 else f"on all {len(self.ranks)} ranks")
        text = (f"{self.kind} agree {scope}{where}: "
                f"{self.tensors_checked} tensors compared, {self.bytes_exchanged} bytes exchanged")
        if self.unreplicated and self.kind == "forward outputs":
            text += f"; {self.unreplicated} outputs are shards of an activation, not compared"
        elif self.unreplicated:
            text += (f"; {self.unreplicated} tensors are held by one rank only (sharded on "
                     f"every mesh dimension): {_NOTHING_TO_VOTE}")
        return text

    def _placed_summary(self, where: str) -> str:
        parts = []
        for d in self.disagreements[:5]:
            if d.odd_ranks:
                odd = ", ".join(self.where(r) for r in d.odd_ranks)
                parts.append(f"{odd} disagrees with the majority of {len(d.replicas)} replicas "
                             f"of {d.label} (ranks {', '.join(map(str, d.replicas))})")
            else:
                held = ", ".join(self.where(r) for r in d.replicas)
                parts.append(f"{held} hold different {d.label} with no majority")
        more = (f" (+{len(self.disagreements) - 5} more)" if len(self.disagreements) > 5 else "")
        pairs = any(len(d.replicas) == 2 and not d.odd_ranks for d in self.disagreements)
        tail = f"; {_NO_THIRD_OPINION}" if pairs else ""
        return (f"{self.kind} differ between replicas{where}: {'; '.join(parts)}{more}{tail}")

    def raise_if_failed(self) -> ReplicaCheckResult:
        """Raise :class:`ReplicaMismatchError` on every rank when the ranks disagree."""
        if not self.ok:
            raise ReplicaMismatchError(
                self.summary(),
                kind=self.kind,
                ranks=self.odd_ranks,
                tensors=self.tensors,
                step=self.step,
                rank=self.rank,
                hint=self._hint(),
            )
        return self

    def _hint(self) -> str:
        healable = self.kind == "parameters" and self.attributed and all(
            len(d.replicas or self.ranks) >= 3 for d in self.disagreements)
        if not healable:
            return _recovery_hint(self.odd_ranks)
        return ("heal in place from the majority with torchverity.distributed.repair_replicas("
                "model, optimizer, result), or " + _recovery_hint(self.odd_ranks))


def _recovery_hint(odd: Sequence[int]) -> str:
    who = f"rank {', '.join(map(str, odd))}" if odd else "the job"
    return (f"stop and restart {who} from the last verified checkpoint (torchverity verify "
            "CHECKPOINT); if the same rank is named again, take its device out of service")


def _short_list(names: Sequence[str], limit: int = 5) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ------------------------------------------------------------------ comparing


Recorded = Sequence[tuple[torch.Tensor, tuple[str, ...]]]


def _compare(c: Comm, kind: str, names: Sequence[str], values: Sequence[Any], mode: HashMode,
             step: int | None, recorded: Recorded = ()) -> ReplicaCheckResult:
    """Exchange per-tensor digests (two tiny all_gathers) and vote inside each replica group.

    ``recorded`` holds digest rows taken earlier (DDP buckets, FSDP2 units),
    each with the mesh dimensions it is sharded on; they come first and
    ``names`` starts with their labels. Each value's DTensor placements decide
    which ranks hold the same bytes (see ``_placements``).
    """
    placed = [Placed(None, sharded, f"recorded {list(sharded)}", ()) for _, sharded in recorded]
    placed += [place(v) for v in values]
    dims = mesh_dims(placed)
    if len(dims) > MAX_MESH_DIMS:
        raise UsageError(f"{kind}: the tensors live on {len(dims)} mesh dimensions; a check "
                         f"tells at most {MAX_MESH_DIMS} apart",
                         hint="name the mesh dimensions (init_device_mesh(mesh_dim_names=...))")
    head = header_row(len(names), layout_digest(names, placed, mode), dims)
    header = all_gather(c, torch.tensor(head, dtype=torch.int64),
                        f"the {kind} layout exchange").cpu()
    _check_layout(c, kind, header[:, :4], step)
    layout = layout_from(c.ranks, dims, header)
    rows = digest_rows([p.local for p in placed[len(recorded):]], mode, c.device)
    if recorded:
        rows = torch.cat([*(row.to(c.device) for row, _ in recorded), rows])
    gathered = all_gather(c, rows, f"the {kind} digest exchange").cpu()
    disagreements, compared = _vote_placed(layout, names, [p.sharded for p in placed], gathered)
    return ReplicaCheckResult(
        kind=kind,
        rank=c.rank,
        ranks=c.ranks,
        tensors_checked=compared,
        bytes_exchanged=row_bytes(len(names), c.world) + c.world * HEADER_LEN * 8,
        disagreements=disagreements,
        step=step,
        unreplicated=len(names) - compared,
        coordinates=tuple((r, layout.where(i)) for i, r in enumerate(c.ranks))
        if layout.dims else (),
    )


def _vote_placed(layout: Layout, names: Sequence[str], sharded: Sequence[tuple[str, ...]],
                 gathered: torch.Tensor) -> tuple[tuple[TensorDisagreement, ...], int]:
    """Vote each tensor inside the groups of ranks that hold the same piece of it.

    Returns the disagreements (in tensor order) and how many tensors had a replica.
    """
    by_pattern: dict[tuple[str, ...], list[int]] = {}
    for i, s in enumerate(sharded):
        by_pattern.setdefault(s, []).append(i)
    found: list[tuple[int, int, TensorDisagreement]] = []
    compared = 0
    for pattern, indices in by_pattern.items():
        groups = [g for g in layout.replica_groups(pattern) if len(g) > 1]
        if not groups:
            continue
        compared += len(indices)
        columns = torch.tensor(indices, dtype=torch.int64)
        for g in groups:
            ranks = tuple(layout.ranks[x] for x in g)
            sub = gathered[torch.tensor(g, dtype=torch.int64)][:, columns]
            label = shard_label(layout, pattern, g)
            for position, d in _vote_indexed(ranks, indices, names, sub):
                found.append((position, g[0], TensorDisagreement(
                    d.name, d.groups, d.odd_ranks, label, ranks)))
    found.sort(key=lambda item: (item[0], item[1]))
    return tuple(d for _, _, d in found), compared


def _check_layout(c: Comm, kind: str, header: torch.Tensor, step: int | None) -> None:
    rows = [tuple(r) for r in header.tolist()]
    if len(set(rows)) == 1:
        return
    groups = _groups(c.ranks, rows)
    odd = _odd(groups, c.world)
    raise ReplicaMismatchError(
        f"ranks {list(c.ranks)} do not hold the same set of {kind} (names, dtypes, shapes or "
        f"placements differ; groups that agree: {[list(g) for g in groups]}), so they cannot "
        "be compared",
        kind=f"{kind}-layout", ranks=odd, step=step, rank=c.rank,
        hint="build the model and optimizer identically on every rank and call the check at the "
        "same point (after optimizer.step()) on all of them",
    )


def _groups(ranks: Sequence[int], values: Sequence[Any]) -> tuple[tuple[int, ...], ...]:
    by_value: dict[Any, list[int]] = {}
    for r, v in zip(ranks, values, strict=True):
        by_value.setdefault(v, []).append(r)
    return tuple(tuple(g) for g in sorted(by_value.values(), key=lambda g: (-len(g), g[0])))


def _odd(groups: Sequence[Sequence[int]], world: int) -> tuple[int, ...]:
    if len(groups[0]) * 2 <= world:
        return ()
    return tuple(sorted(r for g in groups[1:] for r in g))


def _vote(ranks: Sequence[int], names: Sequence[str],
          gathered: torch.Tensor) -> tuple[TensorDisagreement, ...]:
    """``gathered`` is ``[world, n, 2]``; only differing rows reach Python."""
    differs = (gathered != gathered[:1]).any(dim=2).any(dim=0)
    out = []
    for i in differs.nonzero().flatten().tolist():
        groups = _groups(ranks, [tuple(r) for r in gathered[:, i].tolist()])
        out.append(TensorDisagreement(names[i], groups, _odd(groups, len(ranks))))
    return tuple(out)


def _vote_indexed(ranks: Sequence[int], indices: Sequence[int], names: Sequence[str],
                  gathered: torch.Tensor) -> list[tuple[int, TensorDisagreement]]:
    """:func:`_vote` over the columns ``indices`` of ``names``, each result with its position."""
    found = _vote(ranks, [names[i] for i in indices], gathered)
    position = {names[i]: i for i in indices}
    return [(position[d.name], d) for d in found]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP/DataParallel wrappers, so names carry no ``module.`` prefix."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return model


# ------------------------------------------------------------------ replicas


_PLAIN = (bool, int, float, str, tuple, type(None))


def _replica_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   buffers: bool) -> tuple[list[str], list[Any]]:
    module = _unwrap(model)
    skip = set() if buffers else {n for n, _ in module.named_buffers()}
    names: list[str] = []
    values: list[Any] = []
    for name, value in module.state_dict(keep_vars=True).items():
        if name in skip:
            continue
        names.append(name)
        values.append(value)
    if optimizer is not None:
        param_names = {id(p): n for n, p in module.named_parameters()}
        for position, (p, state) in enumerate(optimizer.state.items()):
            pname = param_names.get(id(p), f"state{position}")  # a tensor outside the model
            for key, value in state.items():
                names.append(f"optimizer.{pname}.{key}")
                values.append(value)
        for i, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if key != "params" and isinstance(value, _PLAIN):
                    names.append(f"optimizer.param_groups.{i}.{key}")
                    values.append(value)
    return names, values


def check_replicas(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    step: int | None = None,
    buffers: bool = True,
    mode: HashMode = "auto",
    timeout: float | None = DEFAULT_TIMEOUT_S,
) -> ReplicaCheckResult:
    """Compare this rank's parameters, buffers (and optimizer state) with the other replicas.

    Call it on every rank of ``group`` (all ranks by default) at the same
    point, e.g. after ``optimizer.step()`` every N steps. For DTensors (FSDP2,
    HSDP, tensor parallel, FSDP+TP) the placements decide which ranks hold the
    same local shard, and each shard is voted only among those; plain tensors
    are compared across the whole group. Accelerator tensors are digested on
    their device; CPU tensors through a zero-copy 128-bit BLAKE3
    (``mode="device"`` forces the device sums everywhere). Only 16 bytes per
    tensor per rank are exchanged. Every rank returns the same result; call
    :meth:`ReplicaCheckResult.raise_if_failed` to stop on disagreement.

    Pass ``buffers=False`` when buffers legitimately differ between ranks:
    plain BatchNorm under DDP keeps per-rank running statistics until the next
    forward broadcasts rank 0's (SyncBatchNorm keeps them equal).
    """
    c = open_comm(group, timeout, "check_replicas")
    names, values = _replica_state(model, optimizer, buffers)
    return _compare(c, "parameters", names, values, mode, step)


# ------------------------------------------------------------------ gradients

CommHook = Callable[[Any, "dist.GradBucket"], "torch.futures.Future[torch.Tensor]"]
_UNIT_OFFSET = 1 << 20  # FSDP unit rows sort after DDP buckets


class GradientCheck:
    """Verify that every rank holds the same reduced gradients.

    With FSDP2/HSDP/TP the gradients are DTensors, compared like
    :func:`check_replicas` compares parameters: each reduced shard among the
    ranks whose placements say they hold the same one.

    Post-backward use (works with DDP and with manual all-reduce)::

        check = GradientCheck(ddp_model)
        loss.backward()
        check.check(step=step).raise_if_failed()   # before optimizer.step()

    With ``ddp_model.register_comm_hook(None, check.comm_hook())`` each bucket
    is also digested right after its all-reduce, on the communication path, so
    a mismatch names the bucket as well as the parameters. ``comm_hook(inner)``
    wraps any other hook (e.g. fp16 compression) instead of the plain all-reduce.
    For FSDP2, :meth:`fsdp_hook` does the same for each unit's reduced shard.
    """

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup | None = None, *,
                 mode: HashMode = "auto", timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        self._module = _unwrap(model)
        self._group = group
        self._mode = mode
        self._timeout = timeout
        self._params = [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]
        self._param_names = {id(p): n for n, p in self._params}
        self._buckets: dict[int, tuple[str, torch.Tensor, tuple[str, ...]]] = {}

    def comm_hook(self, inner: CommHook | None = None) -> CommHook:
        """A DDP communication hook that digests each bucket after ``inner`` reduced it."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        reduce = inner or allreduce_hook

        def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            label = self._bucket_label(bucket)
            index = bucket.index()

            def record(fut: torch.futures.Future[Any]) -> torch.Tensor:
                value = fut.value()
                reduced = value[0] if isinstance(value, (list, tuple)) else value
                # Digest rows are enqueued on the tensor's device: no host sync here.
                self._buckets[index] = (label, digest_rows([reduced], self._mode, reduced.device),
                                        ())
                return reduced

            return reduce(state, bucket).then(record)

        # DDP inspects the annotations, which postponed evaluation turned into strings.
        hook.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        return hook

    def _bucket_label(self, bucket: dist.GradBucket) -> str:
        names = [self._param_names.get(id(p), "?") for p in bucket.parameters()]
        return f"bucket {bucket.index()} ({_short_list(names, 3)})"

    def fsdp_hook(self, inner: Callable[[torch.Tensor], None] | None = None) -> None:
        """Digest each FSDP2 unit's reduced gradient shard as FSDP hands it over.

        Installs :meth:`FSDPModule.set_all_reduce_hook` on every unit: under
        HSDP it sees the shard after the replicate all-reduce, under pure FSDP
        after the reduce-scatter. ``inner`` runs first (an all-reduce hook you
        already use). A row is compared across the ranks that hold the same
        shard of every parameter of the unit; mismatches name the unit.
        """
        for index, (label, unit, sharded) in enumerate(self._fsdp_units()):

            def hook(reduced: torch.Tensor, index: int = index, label: str = label,
                     sharded: tuple[str, ...] = sharded) -> None:
                if inner is not None:
                    inner(reduced)
                row = digest_rows([reduced], self._mode, reduced.device)
                self._buckets[_UNIT_OFFSET + index] = (label, row, sharded)

            try:
                unit.set_all_reduce_hook(hook)
            except ValueError as exc:  # several parameter groups in one unit
                raise UsageError(f"GradientCheck.fsdp_hook: {label}: {exc}",
                                 hint="use check() after backward for this model") from None

    def _fsdp_units(self) -> list[tuple[str, Any, tuple[str, ...]]]:
        from torch.distributed.fsdp import FSDPModule

        units = [(n, m) for n, m in self._module.named_modules() if isinstance(m, FSDPModule)]
        if not units:
            raise UsageError("GradientCheck.fsdp_hook: the model has no fully_shard (FSDP2) module",
                             hint="use comm_hook() for DDP, or check() after backward")
        owned: dict[str, list[tuple[str, torch.nn.Parameter]]] = {n: [] for n, _ in units}
        for pname, p in self._params:  # a parameter belongs to its innermost unit
            holders = [u for u in owned if not u or pname.startswith(f"{u}.")]
            if holders:
                owned[max(holders, key=len)].append((pname, p))
        out = []
        for name, unit in units:
            dims: dict[str, None] = {}
            for _, p in owned[name]:
                dims.update(dict.fromkeys(place(p).sharded))
            label = f"unit {name or '(root)'} ({_short_list([n for n, _ in owned[name]], 3)})"
            out.append((label, unit, tuple(dims)))
        return out

    def check(self, step: int | None = None) -> ReplicaCheckResult:
        """Compare the gradients (and any recorded buckets or units) of the last backward pass."""
        c = open_comm(self._group, self._timeout, "GradientCheck")
        buckets = [self._buckets[i] for i in sorted(self._buckets)]
        self._buckets.clear()
        names = [label for label, _, _ in buckets] + [f"{n}.grad" for n, _ in self._params]
        values: list[Any] = [p.grad for _, p in self._params]
        recorded = [(row, sharded) for _, row, sharded in buckets]
        return _compare(c, "gradients", names, values, self._mode, step, recorded)


# ------------------------------------------------------------------ replay

Batch = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class ReplayComparison:
    """Rank ``batch_of`` computed its own micro-batch; ``replayed_by`` recomputed it."""

    batch_of: int
    replayed_by: int
    tensors: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.tensors


@dataclass(frozen=True)
class ReplayAuditResult:
    """Cross-rank replay outcome, identical on every rank."""

    rank: int
    ranks: tuple[int, ...]
    comparisons: tuple[ReplayComparison, ...]
    suspects: tuple[int, ...]
    bytes_exchanged: int
    step: int | None = None
    coordinates: tuple[tuple[int, str], ...] = ()  # mesh coordinates by global rank, if any

    @property
    def ok(self) -> bool:
        return all(cmp.ok for cmp in self.comparisons)

    @property
    def failed(self) -> tuple[ReplayComparison, ...]:
        return tuple(cmp for cmp in self.comparisons if not cmp.ok)

    @property
    def attributed(self) -> bool:
        return bool(self.suspects)

    @property
    def tensors(self) -> list[str]:
        return sorted({t for cmp in self.failed for t in cmp.tensors})

    def summary(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        if self.ok:
            return (f"replay audit{where}: all {len(self.ranks)} micro-batches reproduced "
                    "bit for bit by a neighbour rank")
        pairs = "; ".join(
            f"batch of rank {cmp.batch_of} replayed by rank {cmp.replayed_by}: "
            f"{_short_list(cmp.tensors, 3)} differ" for cmp in self.failed
        )
        if self.suspects:
            coords = dict(self.coordinates)
            who = ", ".join(f"{r} ({coords[r]})" if r in coords else str(r) for r in self.suspects)
            return (f"replay audit{where}: rank {who} computes results no other rank reproduces "
                    f"({pairs})")
        if len(self.ranks) == 2:
            return f"replay audit{where}: the two ranks disagree ({pairs}); {_NO_THIRD_OPINION}"
        return (f"replay audit{where}: results differ but no rank fails all its comparisons, "
                f"a transient fault is likely; rerun the audit ({pairs})")

    def raise_if_failed(self) -> ReplayAuditResult:
        if not self.ok:
            raise ReplicaMismatchError(
                self.summary(), kind="replay", ranks=self.suspects, tensors=self.tensors,
                step=self.step, rank=self.rank, hint=_recovery_hint(self.suspects),
            )
        return self


def replay_audit(
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
    """Recompute the next rank's micro-batch here and compare loss and gradient digests.

    ``loss_fn(module, batch)`` returns the scalar loss of one micro-batch
    (``module`` is the model without its DDP wrapper, so no gradient is
    all-reduced). Each rank computes its own batch and its neighbour's with the
    same parameters and the same RNG seed, so dropout matches; ``.grad``,
    buffers and the RNG state are left as they were. The comparison is exact:
    on GPUs enable ``torch.use_deterministic_algorithms(True)`` for the audit.
    With 3 or more ranks a rank whose every comparison fails is named.
    """
    c = open_comm(group, timeout, "replay_audit")
    module = _unwrap(model)
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    neighbour, batch_bytes = exchange_batch(c, batch)
    own = replay_rows(module, loss_fn, batch, params, seed, mode, c.device)
    other = replay_rows(module, loss_fn, neighbour, params, seed, mode, c.device)
    gathered = all_gather(c, torch.stack([own, other]), "the replay digest exchange").cpu()
    names = ["loss", *(f"{n}.grad" for n, _ in params)]
    comparisons = _replay_comparisons(c, names, gathered)
    return ReplayAuditResult(
        rank=c.rank, ranks=c.ranks, comparisons=comparisons,
        suspects=_replay_suspects(c.ranks, comparisons),
        bytes_exchanged=batch_bytes + row_bytes(2 * len(names), c.world),
        step=step,
    )


def _replay_comparisons(c: Comm, names: Sequence[str],
                        gathered: torch.Tensor) -> tuple[ReplayComparison, ...]:
    """``gathered[i, 0]``: rank i's own batch; ``gathered[i, 1]``: its replay of rank i+1's."""
    out = []
    for i in range(c.world):
        j = (i - 1) % c.world  # rank j replayed rank i's batch
        differs = (gathered[i, 0] != gathered[j, 1]).any(dim=1)
        tensors = tuple(names[k] for k in differs.nonzero().flatten().tolist())
        out.append(ReplayComparison(c.ranks[i], c.ranks[j], tensors))
    return tuple(out)


def _replay_suspects(ranks: Sequence[int],
                     comparisons: Sequence[ReplayComparison]) -> tuple[int, ...]:
    # A faulty rank spoils both comparisons it takes part in (its own batch and
    # its replay of the next one); a healthy neighbour spoils at most one.
    if len(ranks) < 3:
        return ()
    suspects = []
    for r in ranks:
        mine = [cmp for cmp in comparisons if r in (cmp.batch_of, cmp.replayed_by)]
        if mine and all(not cmp.ok for cmp in mine):
            suspects.append(r)
    return tuple(suspects)


# ------------------------------------------------------------------ guard


class FlagReducer:
    """Combine a guard's device-side anomaly flags across ranks with one ``all_reduce(MAX)``.

    Implements the reducer protocol of :class:`torchverity.TrainingGuard`: a
    flag raised on any rank is raised on all, so every rank skips, stops or
    rolls back the same step. The reduction is enqueued on the flags' device
    (no host sync on NCCL); outside torch.distributed it returns ``flags``.
    Leave ``timeout`` at None on NCCL: waiting with a deadline blocks the host
    every step; the process group's timeout and NCCL's watchdog cover hangs.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *,
                 timeout: float | None = None) -> None:
        self._group = group
        self._timeout = timeout
        self._comm: Comm | None = None

    def reduce(self, flags: torch.Tensor) -> torch.Tensor:
        if not (dist.is_available() and dist.is_initialized()):
            return flags
        if self._comm is None:
            self._comm = open_comm(self._group, self._timeout, "FlagReducer", record=False)
        if self._comm.world == 1:
            return flags
        # gloo has no MAX for bool; int32 holds every flag value we use.
        wire = torch.int32 if flags.dtype == torch.bool else flags.dtype
        buf = flags.to(device=self._comm.device, dtype=wire, copy=True)
        all_reduce_max(self._comm, buf, "combining anomaly flags")
        return buf.to(device=flags.device, dtype=flags.dtype)
