"""The guard's detectors on device tensors, for parameters on an accelerator.

Nothing here reads a value back to the host: the rolling statistics and their
thresholds (:class:`~torchverity.training._stats.RollingStats`), the relative-change
rule, the flags, the latch and the skip decision are tensors on the parameters'
device, and each step's flag row is concatenated there for the guard to read in
one transfer every ``check_every`` steps. :mod:`torchverity.training._host_rules` runs the
same rules on floats when the parameters are on the CPU (``stats="auto"``);
``stats="device"`` picks this path anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torchverity.training._config import GuardConfig, Reducer
from torchverity.training._events import KINDS, LATCHING, SKIPPING
from torchverity.training._rows import build_row
from torchverity.training._stats import RollingStats


@dataclass
class DevicePending:
    """What ``check`` leaves on the device for ``step``."""

    parts: list[torch.Tensor]  # one 0-dim flag per kind, in KINDS order
    metrics: torch.Tensor  # loss, grad norm (+ per-parameter norms with per_layer)
    thresholds: torch.Tensor  # loss, grad norm
    loss: torch.Tensor
    gnorm: torch.Tensor
    gvec: torch.Tensor
    layer_vec: torch.Tensor
    replay_vec: torch.Tensor
    rest_vec: torch.Tensor
    rest_names: tuple[str, ...]
    decision: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # flags, hit, applied
    undo: bool = False  # a copy was taken before the update: select after it


class DeviceDetectors:
    """Rolling statistics, relative-change rule, flags and skip decision as device tensors."""

    def __init__(self, config: GuardConfig, n: int, policies: dict[str, str],
                 device: torch.device) -> None:
        self.config = config
        self.skip_mask = torch.tensor([policies[k] in SKIPPING for k in KINDS], device=device)
        self.latch_mask = torch.tensor([policies[k] in LATCHING for k in KINDS], device=device)
        self.latched = torch.zeros((), dtype=torch.bool, device=device)
        self.false = torch.zeros((), dtype=torch.bool, device=device)
        self.zeros_n = torch.zeros(n, dtype=torch.float32, device=device)
        self.false_n = torch.zeros(n, dtype=torch.bool, device=device)
        self._empty = torch.zeros(0, dtype=torch.float32, device=device)
        self.stats = RollingStats(2 + (n if config.per_layer else 0), config.window, device)
        self.ratio_stats = RollingStats(n, config.window, device) if config.update_ratio else None
        self.prev_loss = torch.zeros((), dtype=torch.float32, device=device)
        self._has_prev = torch.zeros((), dtype=torch.bool, device=device)
        self._consec = torch.zeros((), dtype=torch.int64, device=device)

    def _threshold(self, stats: RollingStats) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        return stats.threshold(cfg.sigma, cfg.min_samples, cfg.rel_floor, cfg.abs_floor)

    def detect(self, loss: torch.Tensor, gvec: torch.Tensor, replay_vec: torch.Tensor | None
               ) -> DevicePending:
        """The step's flags from its loss and per-parameter gradient norms (before the update);
        ``weights_changed`` and ``update_ratio_spike`` are filled in later by the guard."""
        cfg = self.config
        gnorm = torch.linalg.vector_norm(gvec)
        metrics = torch.stack([loss, gnorm])
        if cfg.per_layer:
            metrics = torch.cat([metrics, gvec])
        thr, ready = self._threshold(self.stats)
        over = metrics > thr
        finite_loss, finite_g = torch.isfinite(loss), torch.isfinite(gvec)
        nf_grad = ~finite_g.all()
        layer_vec = (ready & over[2:] & finite_g) if cfg.per_layer else self.false_n
        parts = [
            ~finite_loss,
            nf_grad,
            ready & over[0] & finite_loss,
            ready & over[1] & ~nf_grad,
            self._loss_jump(loss, finite_loss),
            layer_vec.any() if cfg.per_layer else self.false,
            self.false,  # update_ratio_spike: known after the update
            self.false,  # weights_changed: set before the update, next to the copy
            self.false if replay_vec is None else replay_vec.bool().any(),
        ]
        return DevicePending(parts, metrics, thr[:2], loss, gnorm, gvec, layer_vec,
                             self.zeros_n if replay_vec is None else replay_vec, self._empty, ())

    def _loss_jump(self, loss: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        if self.config.rel_change is None:
            return self.false
        # The floor keeps a loss that has converged to ~0 from turning noise into "jumps".
        change = (loss - self.prev_loss).abs() / (self.prev_loss.abs() + self.config.abs_floor)
        jump = self._has_prev & finite & (change > self.config.rel_change)
        self._consec.copy_(torch.where(jump, self._consec + 1, 0))
        self.prev_loss.copy_(torch.where(finite, loss, self.prev_loss))
        self._has_prev.logical_or_(finite)
        return self._consec >= self.config.rel_patience

    def decide(self, pending: DevicePending, reducer: Reducer | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(flags, hit, applied)``, flags combined across ranks by ``reducer``."""
        flags = torch.stack(pending.parts).float()
        if reducer is not None:
            flags = reducer.reduce(flags)
        hit = flags > 0
        skip = (hit & self.skip_mask).any() | self.latched
        self.latched.logical_or_((hit & self.latch_mask).any())
        return flags, hit, ~skip

    def ratio_flags(self, ratio: torch.Tensor) -> torch.Tensor:
        """Update-ratio spikes per parameter (``update_ratio=True``)."""
        assert self.ratio_stats is not None
        thr, ready = self._threshold(self.ratio_stats)
        return ready & (ratio > thr) & torch.isfinite(ratio)

    def conclude(self, pending: DevicePending, flags: torch.Tensor, applied: torch.Tensor,
                 accept: torch.Tensor, ratio: torch.Tensor, ratio_vec: torch.Tensor
                 ) -> torch.Tensor:
        """After the update: push accepted statistics, precompute the next thresholds; the
        step's row (one cat, which promotes bool to float)."""
        for stats, values in ((self.stats, pending.metrics), (self.ratio_stats, ratio)):
            if stats is not None:
                stats.push(values, accept)
                self._threshold(stats)
        return build_row(_cat, flags=flags, loss_gnorm=pending.metrics[:2],
                         thresholds=pending.thresholds, applied=applied.view(1),
                         gvec=pending.gvec, layer=pending.layer_vec, ratio=ratio,
                         ratio_hit=ratio_vec, replay=pending.replay_vec, rest=pending.rest_vec)

    def reset_rules(self, prev_loss: torch.Tensor) -> None:
        """After a rollback: the restored loss, no jump streak."""
        self.prev_loss.copy_(prev_loss)
        self._consec.zero_()

    def prev_loss_tensor(self) -> torch.Tensor:
        return self.prev_loss.clone()

    def clear_latch(self) -> None:
        self.latched.zero_()


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(parts))  # promotes the bool pieces to float
