"""Per-parameter gradient norms, the detectors' one read of the gradients per step."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from torchverity.training._checksum import balanced_cut, run_beside
from torchverity.training._distributed_hook import any_sharded, clip_sharded, local_shard


class GradNorms:
    """``torch._foreach_norm`` of the guarded parameters' gradients, float32, one list;
    with a helper thread, half of the bytes are read there."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params
        self._cut = balanced_cut([p.numel() * p.element_size() for p in params])
        self._zero = torch.zeros((), dtype=torch.float32, device=params[0].device)
        self._sharded = any_sharded(params)

    def stacked(self, pool: ThreadPoolExecutor | None = None) -> torch.Tensor:
        return torch.stack(self.norms(pool))

    def norms(self, pool: ThreadPoolExecutor | None = None) -> list[torch.Tensor]:
        """Per-parameter gradient norms (0-dim; zero for a missing gradient)."""
        grads = [p.grad for p in self._params]
        if self._sharded:  # this rank's shards of DTensor gradients
            grads = [local_shard(g) for g in grads]
        present = [g for g in grads if g is not None]
        if len(present) == len(grads):
            cut = self._cut
            if pool is None or cut == len(grads):
                return list(torch._foreach_norm(present, 2, dtype=torch.float32))
            # Per tensor the same norms whichever list computes them; half on the helper.
            first, second = run_beside(
                pool,
                lambda: torch._foreach_norm(present[:cut], 2, dtype=torch.float32),
                lambda: torch._foreach_norm(present[cut:], 2, dtype=torch.float32))
            return [*first, *second]
        norms = iter(torch._foreach_norm(present, 2, dtype=torch.float32) if present else [])
        return [next(norms) if g is not None else self._zero for g in grads]


def clip_with_norms(params: list[torch.Tensor], norms: torch.Tensor, max_norm: float, *,
                    sharded: bool, read_coefficient: bool) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` from per-parameter norms already taken; returns the total.

    ``read_coefficient``: reading the clip coefficient is a memory load (CPU), so an
    update that needs no clipping skips torch's multiply by 1.0 of every gradient.
    """
    if sharded:  # the norm of the whole model, not of this rank's shards
        return clip_sharded(params, max_norm)
    total = torch.linalg.vector_norm(norms)
    if read_coefficient and float(torch.clamp(max_norm / (total + 1e-6), max=1.0)) == 1:
        return total
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
