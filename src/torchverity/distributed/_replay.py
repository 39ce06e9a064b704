"""Cross-rank replay: pass micro-batches around the ring and recompute them.

Each rank sends its micro-batch to the previous rank in the group and
receives the next rank's, so every batch is computed twice, by two different
devices, with the same parameters and the same RNG seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchverity.distributed._comm import Comm, HashMode, all_gather, digest_rows, run_collective
from torchverity.errors import UsageError

_MAX_DIMS = 8
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)


def _flatten(batch: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """The batch's tensors and a function that rebuilds the same structure from others."""
    if isinstance(batch, torch.Tensor):
        return [batch], lambda ts: ts[0]
    if isinstance(batch, Mapping) and all(isinstance(v, torch.Tensor) for v in batch.values()):
        keys = list(batch)
        return [batch[k] for k in keys], lambda ts: dict(zip(keys, ts, strict=True))
    if isinstance(batch, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in batch):
        kind = type(batch)
        return list(batch), lambda ts: ts if kind is list else tuple(ts)
    raise UsageError(
        f"replay_audit: cannot send a micro-batch of type {type(batch).__name__} to another rank",
        hint="pass a tensor, a list/tuple of tensors or a dict of tensors",
    )


def _shape_row(t: torch.Tensor) -> list[int]:
    if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
        raise UsageError(
            f"replay_audit: cannot send a {t.dtype} tensor of {t.dim()} dimensions",
            hint=f"micro-batch tensors need at most {_MAX_DIMS} dimensions and a plain dtype",
        )
    dims = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
    return [_DTYPES.index(t.dtype), t.dim(), *dims]


def exchange_batch(c: Comm, batch: Any) -> tuple[Any, int]:
    """Send this rank's micro-batch to the previous rank; return the next rank's and bytes sent."""
    tensors, rebuild = _flatten(batch)
    header = torch.tensor([_shape_row(t) for t in tensors], dtype=torch.int64)
    shapes = all_gather(c, header, "the replay batch shape exchange").tolist()
    prev_rank = c.ranks[(c.index - 1) % c.world]
    next_index = (c.index + 1) % c.world
    send = [t.detach().to(c.device).contiguous() for t in tensors]
    recv = [
        torch.empty(row[2 : 2 + row[1]], dtype=_DTYPES[row[0]], device=c.device)
        for row in shapes[next_index]
    ]
    ops = [dist.P2POp(dist.isend, t, prev_rank, c.group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, c.ranks[next_index], c.group) for t in recv]
    run_collective(c, "the replay micro-batch exchange", lambda: dist.batch_isend_irecv(ops))
    received = [r.to(t.device) for r, t in zip(recv, tensors, strict=True)]
    return rebuild(received), sum(t.numel() * t.element_size() for t in send)


def replay_rows(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    params: Sequence[tuple[str, torch.nn.Parameter]],
    seed: int,
    mode: HashMode,
    device: torch.device,
) -> torch.Tensor:
    """Digests of the loss and of every parameter's gradient for one micro-batch."""
    buffers = list(module.buffers())
    # A forward in train mode updates running statistics; the audit must not.
    saved = [b.detach().clone() for b in buffers]
    cuda = sorted({p.device.index or 0 for _, p in params if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            loss = loss_fn(module, batch)
            grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved, strict=True):
                b.copy_(s)
    return digest_rows([loss.detach(), *grads], mode, device)
