"""Guard settings and the cross-rank reducer protocol, shared by the guard and both rule engines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from torchverity.errors import UsageError


class Reducer(Protocol):
    """Combines the device-side flag vector across ranks (e.g. one ``all_reduce(MAX)``)."""

    def reduce(self, flags: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class GuardConfig:
    """Detector settings. Every field can be passed to :class:`TrainingGuard` by name."""

    check_every: int = 10
    window: int = 128
    min_samples: int = 64
    sigma: float = 6.0
    rel_floor: float = 1e-3
    abs_floor: float = 1e-8
    rel_change: float | None = 5.0
    rel_patience: int = 3
    per_layer: bool = False
    update_ratio: bool = False
    at_rest: bool = True
    rest_every: int = 1  # every update window verified at rest; N: one window in N (opt-down)
    rest_weighted: bool = False
    optimizer_state: bool = True
    frozen_parameters: bool = True  # requires_grad=False parameters verified at rest too
    fused: bool | None = None  # at-rest check inside the update's own pass; None: where it can
    native: bool = True  # fused on CPU float32: the one-pass kernel, bit for bit the eager step
    # which step the fused update reproduces bit for bit: optimizer.step() itself, or
    # torch.compile(optimizer.step) ("compiled", which native=False also implies)
    arithmetic: str = "eager"
    fused_skip: bool = True
    host_skip: bool | None = None
    overlap: bool = False
    defer_record: bool = False  # CPU: the at-rest record on a helper, beside the next forward
    stats: str = "auto"  # "host": rules on floats (CPU default), "device": on tensors
    replay_every: int | None = None
    replica_every: int | None = None  # distributed: vote the replicas every N updates, heal
    replay_tolerance: float | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2

    def validate(self) -> None:
        for name in ("check_every", "window", "rel_patience", "keep_checkpoints", "rest_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                hint = ("rest_every=1 verifies every update window, at_rest=False none"
                        if name == "rest_every" else None)
                raise UsageError(f"TrainingGuard: {name} must be an integer >= 1, not {value!r}",
                                 hint=hint)
        if not 1 <= self.min_samples <= self.window:
            raise UsageError("TrainingGuard: min_samples must be between 1 and window")
        if self.arithmetic not in ("eager", "compiled"):
            raise UsageError(f"TrainingGuard: unknown arithmetic='{self.arithmetic}'",
                             hint="arithmetic='eager' (optimizer.step() itself) or 'compiled' "
                                  "(torch.compile(optimizer.step))")
        if self.stats not in ("auto", "host", "device"):
            raise UsageError(f"TrainingGuard: unknown stats='{self.stats}'",
                             hint="stats='auto' (host on the CPU), 'host' or 'device'")
        for name in ("replay_every", "checkpoint_every", "replica_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"TrainingGuard: {name} must be >= 1 or None")
