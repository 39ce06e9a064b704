"""Replay: re-run a step from its RNG state on the same batch and compare (``step_fn``).

Two uses: the ``replay`` policy re-runs a flagged step to classify it (``transient``:
the re-run differs, suspect hardware; ``reproducible``: the batch or the
optimisation), and ``replay_every=K`` audits every K-th step by running it twice
before its update. Tolerance 0 (loss bits and gradient checksums) under
deterministic algorithms, else a relative 1e-6 on the loss and gradient norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchverity.training._checksum import checksums
from torchverity.training._config import GuardConfig

RngState = tuple[torch.Tensor, tuple[torch.Tensor, ...]]


def torch_rng() -> RngState:
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
    return torch.get_rng_state(), cuda


def set_torch_rng(state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1]:
        torch.cuda.set_rng_state_all(list(state[1]))


@dataclass
class History:
    """What a replay of one step needs: its batch, RNG state and original results."""

    batch: Any
    rng: RngState
    grad_sums: torch.Tensor
    loss: torch.Tensor
    grad_norms: torch.Tensor


class Replayer:
    """Keeps the steps since the last flag read and re-runs them on demand."""

    def __init__(self, config: GuardConfig, optimizer: torch.optim.Optimizer,
                 params: list[torch.Tensor], names: tuple[str, ...],
                 step_fn: Callable[[Any], torch.Tensor] | None,
                 norms: Callable[[], torch.Tensor], enabled: bool) -> None:
        self.config, self.optimizer, self.step_fn = config, optimizer, step_fn
        self._params, self._names, self._norms = params, names, norms
        self.enabled = enabled
        self.history: dict[int, History] = {}
        self.rng_next: RngState | None = torch_rng() if enabled else None
        self._zero = torch.zeros((), dtype=torch.float32, device=params[0].device)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else self._zero for p in self._params]

    def remember(self, step: int, batch: Any, loss: torch.Tensor, gvec: torch.Tensor) -> None:
        assert self.rng_next is not None
        self.history[step] = History(batch, self.rng_next, checksums(self._grads()), loss, gvec)

    def _rerun(self, batch: Any, rng: RngState) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``step_fn`` again from ``rng``; returns (loss, grad checksums); grads are left."""
        assert self.step_fn is not None
        saved = torch_rng()
        set_torch_rng(rng)
        try:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.step_fn(batch)
            loss.backward()
        finally:
            set_torch_rng(saved)
        return loss.detach().float().mean(), checksums(self._grads())

    def tolerance(self) -> float:
        if self.config.replay_tolerance is not None:
            return self.config.replay_tolerance
        return 0.0 if torch.are_deterministic_algorithms_enabled() else 1e-6

    def audit(self, batch: Any, loss: torch.Tensor) -> torch.Tensor:
        """Device flag per parameter: the replay's gradient differs from the original."""
        assert self.rng_next is not None
        first_sums, first_norms = checksums(self._grads()), self._norms()
        loss2, sums2 = self._rerun(batch, self.rng_next)
        tol = self.tolerance()
        if tol == 0:
            per_param = (first_sums != sums2).any(dim=1)
            loss_diff = loss.view(1).view(torch.int32) != loss2.view(1).view(torch.int32)
        else:
            norms2 = self._norms()
            per_param = ~torch.isclose(first_norms, norms2, rtol=tol, atol=0.0, equal_nan=True)
            loss_diff = ~torch.isclose(loss, loss2, rtol=tol, atol=0.0, equal_nan=True).view(1)
        return (per_param | loss_diff).float()

    def replay(self, step: int) -> tuple[str, tuple[str, ...]]:
        """Re-run a flagged step (parameters are still as they were then) and classify it."""
        hist = self.history.get(step)
        if hist is None:
            return "unavailable", ()
        loss2, sums2 = self._rerun(hist.batch, hist.rng)
        norms2 = self._norms()
        self.optimizer.zero_grad(set_to_none=True)
        tol = self.tolerance()
        if tol == 0:
            a, b = hist.grad_sums.cpu().tolist(), sums2.cpu().tolist()
            same = [x == y for x, y in zip(a, b, strict=True)]
        else:
            close = torch.isclose(hist.grad_norms, norms2, rtol=tol, atol=0.0, equal_nan=True)
            same = close.cpu().tolist()
        differing = tuple(n for n, ok in zip(self._names, same, strict=True) if not ok)
        l1, l2 = float(hist.loss), float(loss2)
        same_loss = l1 == l2 or (math.isnan(l1) and math.isnan(l2)) or (
            abs(l1 - l2) <= tol * abs(l1))
        return ("reproducible" if same_loss and not differing else "transient"), differing
