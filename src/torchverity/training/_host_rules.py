"""The guard's detectors on Python floats, for parameters on the CPU.

On the CPU there is no host-device synchronisation to avoid: reading a CPU
tensor is a load from memory. The device path (:mod:`torchverity.training._stats`
and the flag tensors in :mod:`torchverity.training._guard`) spends about a hundred tiny
torch operator calls per step on the rolling statistics, thresholds and flags,
each several microseconds of dispatch on the CPU. Here the guard reads the
per-parameter gradient norms and the loss once per step (one ``tolist``) and runs
the same rules on floats: the same rolling window, warm-up, sigma rule and floors
(:class:`HostRollingStats` has :class:`~torchverity.training._stats.RollingStats`'s
semantics and checkpoint layout), the same relative-change rule, the same skip and
latch decisions, and the same flat row per step, which the guard turns into events
with the code it uses for the device rows.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from torchverity.training._config import GuardConfig, Reducer
from torchverity.training._events import KIND_INDEX, KINDS, LATCHING, SKIPPING
from torchverity.training._rows import build_row


class HostRollingStats:
    """Per-column rolling mean/std over the last ``window`` accepted rows, on floats.

    Same rule as :class:`~torchverity.training._stats.RollingStats`: threshold
    ``mean + sigma * max(std, rel_floor * |mean| + abs_floor)`` over the filled
    slots, unbiased variance, ready once ``min_samples`` rows were accepted. The
    variance is taken as ``(sum(x*x) - sum(x) * mean) / (n - 1)`` (two C-level sums
    per column): it differs from the centred sum only by rounding, far below the
    ``rel_floor`` that bounds the deviation used wherever the two could differ.
    """

    def __init__(self, dim: int, window: int) -> None:
        self.window = window
        # Column-major ring: unfilled slots stay 0.0, so sums over a column are sums over
        # the filled slots, as the device buffer's masked sums are.
        self.cols = [[0.0] * window for _ in range(dim)]
        self.count = 0
        self.pos = 0
        self._cache: tuple[tuple[float, int, float, float], tuple[list[float], bool]] | None = None

    def threshold(self, sigma: float, min_samples: int, rel_floor: float,
                  abs_floor: float) -> tuple[list[float], bool]:
        """``(threshold per column, ready)``; recomputed only after an accepted push."""
        key = (sigma, min_samples, rel_floor, abs_floor)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        n = max(self.count, 1)
        dof = max(n - 1, 1)
        thresholds = []
        for col in self.cols:
            total = sum(col)
            mean = total / n
            var = max(sum(map(operator.mul, col, col)) - total * mean, 0.0) / dof
            floor = rel_floor * abs(mean) + abs_floor
            thresholds.append(mean + sigma * max(math.sqrt(var), floor))
        result = thresholds, self.count >= min_samples
        self._cache = key, result
        return result

    def push(self, values: list[float], accept: bool) -> None:
        """Append ``values`` when ``accept``; no-op otherwise."""
        if not accept:
            return
        for col, value in zip(self.cols, values, strict=True):
            col[self.pos] = value
        self.pos = (self.pos + 1) % self.window
        self.count = min(self.count + 1, self.window)
        self._cache = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The device statistics' layout: checkpoints load into either path."""
        buf = torch.tensor(self.cols, dtype=torch.float32).t().contiguous()
        return {"buf": buf, "count": torch.tensor(self.count), "pos": torch.tensor(self.pos)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.cols = state["buf"].t().tolist()
        self.count = int(state["count"])
        self.pos = int(state["pos"])
        self._cache = None


@dataclass
class HostPending:
    """What ``check`` leaves for ``step`` on the host path: one step's values as floats."""

    flags: list[float]  # per kind, in KINDS order
    metrics: list[float]  # loss, grad norm (+ per-parameter norms with per_layer)
    thresholds: list[float]  # loss, grad norm
    gvec: list[float]
    layer: list[float]
    replay: list[float]
    rest: list[float] = field(default_factory=list)
    rest_names: tuple[str, ...] = ()
    decision: tuple[list[float], bool, bool] | None = None  # flags, any hit, applied
    undo: bool = False  # a copy was taken before the update: restore it on a skip

    @property
    def loss(self) -> float:
        return self.metrics[0]


class HostDetectors:
    """Rolling statistics, relative-change rule, flags and skip decision on floats."""

    def __init__(self, config: GuardConfig, n: int, policies: dict[str, str]) -> None:
        self.config = config
        self.n = n
        self.stats = HostRollingStats(2 + (n if config.per_layer else 0), config.window)
        self.ratio_stats = HostRollingStats(n, config.window) if config.update_ratio else None
        self._skip = [policies[k] in SKIPPING for k in KINDS]
        self._latch = [policies[k] in LATCHING for k in KINDS]
        self.latched = False
        self.prev_loss = 0.0
        self.has_prev = False
        self.consec = 0

    def _threshold(self, stats: HostRollingStats) -> tuple[list[float], bool]:
        cfg = self.config
        return stats.threshold(cfg.sigma, cfg.min_samples, cfg.rel_floor, cfg.abs_floor)

    def detect(self, loss: float, gvec: list[float], replay: list[float] | None) -> HostPending:
        """The step's flags from its loss and per-parameter gradient norms (before the update)."""
        gnorm = math.sqrt(math.fsum(g * g for g in gvec))
        metrics = [loss, gnorm, *gvec] if self.config.per_layer else [loss, gnorm]
        thr, ready = self._threshold(self.stats)
        finite_loss = math.isfinite(loss)
        finite_g = [math.isfinite(g) for g in gvec]
        nf_grad = not all(finite_g)
        layer = ([float(ready and g > t and ok) for g, t, ok in zip(gvec, thr[2:], finite_g,
                                                                        strict=True)]
                 if self.config.per_layer else [0.0] * self.n)
        flags = [0.0] * len(KINDS)
        flags[KIND_INDEX["nonfinite_loss"]] = float(not finite_loss)
        flags[KIND_INDEX["nonfinite_grad"]] = float(nf_grad)
        flags[KIND_INDEX["loss_spike"]] = float(ready and loss > thr[0] and finite_loss)
        flags[KIND_INDEX["grad_norm_spike"]] = float(ready and gnorm > thr[1] and not nf_grad)
        flags[KIND_INDEX["loss_jump"]] = float(self._loss_jump(loss, finite_loss))
        flags[KIND_INDEX["layer_grad_spike"]] = float(any(layer))
        flags[KIND_INDEX["replay_mismatch"]] = float(any(replay)) if replay else 0.0
        return HostPending(flags, metrics, thr[:2], gvec, layer,
                           replay if replay is not None else [0.0] * self.n)

    def _loss_jump(self, loss: float, finite: bool) -> bool:
        cfg = self.config
        if cfg.rel_change is None:
            return False
        # The device rule, on floats: a NaN change compares false there too.
        change = abs(loss - self.prev_loss) / (abs(self.prev_loss) + cfg.abs_floor)
        jump = self.has_prev and finite and change > cfg.rel_change
        self.consec = self.consec + 1 if jump else 0
        if finite:
            self.prev_loss, self.has_prev = loss, True
        return self.consec >= cfg.rel_patience

    def ratio_flags(self, ratio: list[float]) -> list[float]:
        """Update-ratio spikes per parameter (``update_ratio=True``)."""
        assert self.ratio_stats is not None
        thr, ready = self._threshold(self.ratio_stats)
        return [float(ready and r > t and math.isfinite(r))
                for r, t in zip(ratio, thr, strict=True)]

    def decide(self, flags: list[float], reducer: Reducer | None
               ) -> tuple[list[float], bool, bool]:
        """``(flags, any flag, applied)``, flags combined across ranks by ``reducer``."""
        if reducer is not None:
            flags = reducer.reduce(torch.tensor(flags)).tolist()
        hit = [f > 0 for f in flags]
        skip = self.latched or any(h and s for h, s in zip(hit, self._skip, strict=True))
        self.latched = self.latched or any(h and s for h, s in zip(hit, self._latch,
                                                                   strict=True))
        return flags, any(hit), not skip

    def conclude(self, pending: HostPending, applied: bool, hit: bool, flags: list[float],
                 ratio: list[float], ratio_hit: list[float]) -> list[float]:
        """After the update: push accepted statistics; the step's row (the device layout)."""
        accept = applied and not hit
        self.stats.push(pending.metrics, accept)
        if self.ratio_stats is not None:
            self.ratio_stats.push(ratio, accept)
        return build_row(_joined, flags=flags, loss_gnorm=pending.metrics[:2],
                         thresholds=pending.thresholds, applied=[float(applied)],
                         gvec=pending.gvec, layer=pending.layer, ratio=ratio,
                         ratio_hit=ratio_hit, replay=pending.replay, rest=pending.rest)

    def reset_rules(self, prev_loss: torch.Tensor | float) -> None:
        """After a rollback: the restored loss, no jump streak."""
        self.prev_loss = float(prev_loss)
        self.consec = 0

    def prev_loss_tensor(self) -> torch.Tensor:
        return torch.tensor(self.prev_loss, dtype=torch.float32)

    def clear_latch(self) -> None:
        self.latched = False


def _joined(parts: Sequence[list[float]]) -> list[float]:
    return [x for part in parts for x in part]
