"""Collectives for the distributed checks: group bookkeeping, timeouts, row digests.

Every exchange here is small (16 bytes per tensor per rank) and waits with a
deadline, so a rank that died or hangs turns into a
:class:`~torchverity.errors.DistributedTimeoutError` naming the operation and,
when the rendezvous store can still tell, the ranks that never arrived.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from torchverity._tensors import host_bytes
from torchverity.checkpoint._fingerprint import checksum_tensors
from torchverity.errors import DistributedTimeoutError, UsageError

HashMode = Literal["auto", "device"]
# A check waits this long for the other ranks before giving up: long enough for
# a rank that is busy saving or evaluating, short enough to beat the 30-minute
# process-group default that makes a dead peer look like a hang.
DEFAULT_TIMEOUT_S = 300.0
_STORE_PREFIX = "torchverity/arrived/"
_ROW_BYTES = 16  # two int64 per tensor


@dataclass(frozen=True)
class Comm:
    """Where this rank stands in ``group`` and how it talks to the others.

    ``sequence`` numbers this check among the group's checks (0: not recorded
    in the store, as for the per-step flag reduction).
    """

    group: dist.ProcessGroup | None
    rank: int
    ranks: tuple[int, ...]
    index: int
    device: torch.device
    timeout: float | None
    sequence: int = 0

    @property
    def world(self) -> int:
        return len(self.ranks)


def current_rank() -> int:
    """The global rank when torch.distributed is initialised, else 0 (events carry it)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def open_comm(group: dist.ProcessGroup | None, timeout: float | None, what: str, *,
              record: bool = True) -> Comm:
    """Start one check on ``group``; ``record`` notes this rank's arrival in the store."""
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            f"{what} needs torch.distributed, which is not initialised in this process",
            hint="call torch.distributed.init_process_group() first, or launch with torchrun",
        )
    if timeout is not None and timeout <= 0:
        raise UsageError(f"timeout must be positive seconds, got {timeout}")
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    rank = dist.get_rank()
    if rank not in ranks:
        raise UsageError(
            f"{what}: rank {rank} is not a member of the given process group {list(ranks)}",
            hint="call it only on the ranks of the group (new_group returns a non-member handle)",
        )
    c = Comm(group, rank, ranks, ranks.index(rank), _comm_device(group), timeout)
    return replace(c, sequence=_record_arrival(c)) if record else c


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    # gloo moves CPU tensors; NCCL (and mixed "cpu:gloo,cuda:nccl") need the GPU.
    backend = str(dist.get_backend(group))
    if backend == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# ------------------------------------------------------------------ waiting


_sequences: dict[tuple[int, ...], int] = {}


def _arrival_key(ranks: tuple[int, ...], rank: int) -> str:
    group_id = hashlib.sha256(repr(ranks).encode()).hexdigest()[:12]
    return f"{_STORE_PREFIX}{group_id}/{rank}"


def _record_arrival(c: Comm) -> int:
    """Record in the rendezvous store that this rank reached the group's check number N.

    Counted per group, so checks on a subgroup do not make the other ranks
    look late in a later check on the whole world.
    """
    sequence = _sequences.get(c.ranks, 0) + 1
    _sequences[c.ranks] = sequence
    store = _store()
    if store is not None:
        with contextlib.suppress(RuntimeError):
            store.set(_arrival_key(c.ranks, c.rank), str(sequence))
    return sequence


def _store() -> Any:
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ImportError, ValueError):
        return None


def _absent_ranks(c: Comm) -> list[int] | None:
    """Ranks whose last recorded check is older than ours; None when the store cannot say."""
    store = _store()
    if store is None or not c.sequence:
        return None
    absent = []
    try:
        for r in c.ranks:
            key = _arrival_key(c.ranks, r)
            seen = int(store.get(key)) if store.check([key]) else 0
            if seen < c.sequence:
                absent.append(r)
    except (RuntimeError, ValueError):
        return None  # the store lives on rank 0; if that rank died, nobody can say
    return absent


def run_collective(c: Comm, what: str, launch: Callable[[], Any]) -> None:
    """Launch an async collective and wait for it within ``c.timeout`` seconds."""
    start = time.monotonic()
    try:
        launched = launch()
        for work in launched if isinstance(launched, list) else [launched]:
            if c.timeout is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=c.timeout))
    except RuntimeError as exc:
        absent = _absent_ranks(c)
        raise _timeout_error(c, what, exc, absent, time.monotonic() - start) from None


def _timeout_error(
    c: Comm, what: str, exc: BaseException, absent: list[int] | None, elapsed: float
) -> DistributedTimeoutError:
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    who = (
        f"; rank(s) {', '.join(map(str, absent))} never reached this check"
        if absent else ""
    )
    if c.timeout is None or elapsed >= 0.9 * c.timeout:
        limit = f"{c.timeout:g} s" if c.timeout is not None else "the process group's timeout"
        failure = f"did not complete across ranks {list(c.ranks)} within {limit}"
    else:
        failure = f"failed across ranks {list(c.ranks)} after {elapsed:.1f} s: a peer dropped out"
    return DistributedTimeoutError(
        f"rank {c.rank}: {what} {failure}{who} ({detail})",
        operation=what,
        rank=c.rank,
        missing_ranks=absent or [],
        timeout=c.timeout,
        hint="check the logs of the other ranks (a rank died or is stuck), then restart the job "
        "from the last verified checkpoint (torchverity verify CHECKPOINT)",
    )


def all_gather(c: Comm, tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Gather ``tensor`` from every rank of the group into a ``[world, ...]`` tensor."""
    local = tensor.to(c.device).contiguous()
    out = torch.empty((c.world, *local.shape), dtype=local.dtype, device=c.device)
    views = list(out.unbind(0))
    run_collective(c, what, lambda: dist.all_gather(views, local, group=c.group, async_op=True))
    return out


def all_reduce_max(c: Comm, tensor: torch.Tensor, what: str) -> None:
    """In-place MAX across the group; no host synchronisation unless a timeout is set on gloo."""
    run_collective(
        c, what,
        lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=c.group, async_op=True),
    )


# ------------------------------------------------------------------ row digests


def _split64(digest: bytes) -> tuple[int, int]:
    return (int.from_bytes(digest[:8], "little", signed=True),
            int.from_bytes(digest[8:16], "little", signed=True))


def value_row(value: Any) -> tuple[int, int]:
    """Two int64 from a plain (non-tensor) value such as a learning rate."""
    return _split64(hashlib.sha256(repr(value).encode()).digest())


def _host_row(tensor: torch.Tensor) -> tuple[int, int]:
    import blake3

    # On the CPU a 128-bit BLAKE3 of the zero-copy bytes is several times faster
    # than the position-weighted sums, and cryptographic besides.
    return _split64(blake3.blake3(host_bytes(tensor)).digest(length=16))


def row_algo(value: Any, mode: HashMode) -> str:
    if not isinstance(value, torch.Tensor):
        return "value-sha256"
    if mode == "device" or value.device.type != "cpu":
        return "tvsum64x2"
    return "blake3-128"


def digest_rows(values: Sequence[Any], mode: HashMode, device: torch.device) -> torch.Tensor:
    """An ``[n, 2]`` int64 tensor on ``device``: one 128-bit digest per value.

    Accelerator tensors are summed where they live (no host copy, no sync);
    only the 16-byte results travel.
    """
    out = torch.empty(len(values), 2, dtype=torch.int64, device=device)
    on_device: dict[torch.device, list[int]] = {}
    host: list[int] = []
    host_rows: list[tuple[int, int]] = []
    for i, v in enumerate(values):
        if row_algo(v, mode) == "tvsum64x2":
            on_device.setdefault(v.device, []).append(i)
        else:
            host.append(i)
            host_rows.append(_host_row(v) if isinstance(v, torch.Tensor) else value_row(v))
    for dev_indices in on_device.values():
        sums = checksum_tensors([values[i] for i in dev_indices])
        out[torch.tensor(dev_indices, device=device)] = sums.to(device)
    if host:
        out[torch.tensor(host, device=device)] = torch.tensor(host_rows, dtype=torch.int64).to(
            device
        )
    return out


def row_bytes(n: int, world: int) -> int:
    """Size of the gathered digests of ``n`` tensors."""
    return world * n * _ROW_BYTES


def all_gather_json(c: Comm, obj: Any, what: str) -> list[Any]:
    """Gather one JSON-ready value per rank (no pickle: ranks never unpickle each other's data)."""
    import json

    data = json.dumps(obj, sort_keys=True).encode()
    sizes = all_gather(c, torch.tensor([len(data)], dtype=torch.int64), what).flatten().tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = all_gather(c, buf, what).cpu().numpy()
    return [json.loads(bytes(gathered[i, :n])) for i, n in enumerate(sizes)]


def broadcast_status(c: Comm, failed: bool, what: str) -> bool:
    """Tell every rank whether the group's first rank failed; doubles as a barrier."""
    status = torch.tensor([int(failed)], dtype=torch.int64, device=c.device)
    run_collective(c, what, lambda: dist.broadcast(status, src=c.ranks[0], group=c.group,
                                                   async_op=True))
    return bool(status.item())
