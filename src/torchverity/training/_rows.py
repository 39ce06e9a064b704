"""The per-step row both rule engines produce, defined once, and what the host reads from it.

A row is one flat vector per step: the flag of each kind (in ``KINDS`` order), the
loss and gradient norm, their thresholds, whether the update was applied, then five
per-parameter blocks (gradient norms, per-layer hits, update ratios, ratio hits,
replay differences) and one flag per tensor verified at rest. The device engine
concatenates tensors (read in one transfer at the next flag read), the host engine
lists of floats; :func:`build_row` is the layout for both and :func:`parse_row` its
inverse. :class:`Rules` is what the guard asks of either engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from torchverity.training._events import ACTIONS, KINDS, AnomalyEvent

N_SCALARS = 5  # loss, grad_norm, loss threshold, grad-norm threshold, applied
T = TypeVar("T")


class RollingState(Protocol):
    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


class Rules(Protocol):
    """The part of a rule engine (host floats or device tensors) the guard drives alike."""

    stats: Any
    ratio_stats: Any

    def reset_rules(self, prev_loss: Any) -> None: ...

    def prev_loss_tensor(self) -> torch.Tensor: ...

    def clear_latch(self) -> None: ...


def build_row(cat: Callable[[Sequence[T]], T], *, flags: T, loss_gnorm: T, thresholds: T,
              applied: T, gvec: T, layer: T, ratio: T, ratio_hit: T, replay: T, rest: T) -> T:
    """The row, in its one layout; ``cat`` joins the pieces (``torch.cat`` or lists)."""
    return cat([flags, loss_gnorm, thresholds, applied, gvec, layer, ratio, ratio_hit, replay,
                rest])


@dataclass(frozen=True)
class Row:
    """One step's detector row, still on the device or as host floats."""

    step: int
    row: torch.Tensor | list[float]  # device path: a tensor read at the flush; host: floats
    rest_names: tuple[str, ...]


def row_values(rows: list[Row]) -> list[list[float]]:
    """Each row's values: device rows read in one transfer, host rows as they are."""
    tensors = [r.row for r in rows if isinstance(r.row, torch.Tensor)]
    flat = torch.cat(tensors).cpu().tolist() if tensors else []
    out, offset = [], 0
    for r in rows:
        if isinstance(r.row, torch.Tensor):
            size = r.row.numel()
            out.append(flat[offset: offset + size])
            offset += size
        else:
            out.append(r.row)
    return out


@dataclass(frozen=True)
class RowContext:
    """Host copy of one step's row, turned into event values and suspects per kind."""

    names: tuple[str, ...]
    flags: list[float]
    loss: float
    gnorm: float
    loss_thr: float
    gnorm_thr: float
    applied: bool
    gvec: list[float]
    layer: list[float]
    ratio: list[float]
    ratio_hit: list[float]
    replay: list[float]
    rest_names: tuple[str, ...]
    rest: list[float]

    def _named(self, flags: list[float]) -> tuple[str, ...]:
        return tuple(n for n, f in zip(self.names, flags, strict=True) if f > 0)

    def _top(self, k: int = 3) -> tuple[str, ...]:
        # NaN norms sort last: the finite largest contributors are the suspects.
        pairs = zip(self.gvec, self.names, strict=True)
        ranked = sorted(pairs, key=lambda x: -x[0] if x[0] == x[0] else 0)
        return tuple(n for _, n in ranked[:k])

    def describe(self, kind: str) -> tuple[dict[str, float], dict[str, float], tuple[str, ...]]:
        base = {"loss": self.loss, "grad_norm": self.gnorm}
        if kind in ("nonfinite_loss", "nonfinite_grad"):
            return base, {}, self._named([0.0 if math.isfinite(g) else 1.0 for g in self.gvec])
        if kind == "loss_spike":
            return base, {"loss": self.loss_thr}, self._top()
        if kind == "grad_norm_spike":
            return base, {"grad_norm": self.gnorm_thr}, self._top()
        if kind == "loss_jump":
            return base, {}, ()
        if kind == "layer_grad_spike":
            hit = self._named(self.layer)
            return {f"grad_norm[{n}]": self.gvec[self.names.index(n)] for n in hit}, {}, hit
        if kind == "update_ratio_spike":
            hit = self._named(self.ratio_hit)
            return {f"update_ratio[{n}]": self.ratio[self.names.index(n)] for n in hit}, {}, hit
        if kind == "weights_changed":
            hit = tuple(n for n, f in zip(self.rest_names, self.rest, strict=True) if f > 0)
            return base, {}, hit
        return base, {}, self._named(self.replay)

    def events(self, step: int, policies: dict[str, str], rank: int) -> list[AnomalyEvent]:
        """One event per kind flagged in this row, with its policy's action."""
        events = []
        for kind, flag in zip(KINDS, self.flags, strict=True):
            if flag > 0:
                policy = policies[kind]
                values, thresholds, suspects = self.describe(kind)
                events.append(AnomalyEvent(step, kind, policy, ACTIONS[policy], values,
                                           thresholds, suspects, rank))
        return events


def parse_row(values: list[float], names: tuple[str, ...], rest_names: tuple[str, ...]
              ) -> RowContext:
    """The inverse of :func:`build_row`, on the values read back."""
    k, n = len(KINDS), len(names)
    loss, gnorm, loss_thr, gnorm_thr, applied = values[k: k + N_SCALARS]
    vec = values[k + N_SCALARS:]
    gvec, layer, ratio, ratio_hit, replay = (vec[i * n: (i + 1) * n] for i in range(5))
    return RowContext(names, values[:k], loss, gnorm, loss_thr, gnorm_thr, bool(applied),
                      gvec, layer, ratio, ratio_hit, replay, rest_names, vec[5 * n:])
