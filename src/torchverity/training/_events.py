"""Anomaly kinds, policies, events and the JSONL event log of :class:`TrainingGuard`.

The log format is documented in ``docs/formats/events.md``: one JSON object
per line, each with ``event``, ``time`` and ``rank``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from torchverity._jsonable import to_jsonable

EVENTS_VERSION = 1

# Order matters: it is the layout of the device-side flag vector.
KINDS = (
    "nonfinite_loss",
    "nonfinite_grad",
    "loss_spike",
    "grad_norm_spike",
    "loss_jump",
    "layer_grad_spike",
    "update_ratio_spike",
    "weights_changed",
    "replay_mismatch",
)
KIND_INDEX = {k: i for i, k in enumerate(KINDS)}
POLICIES = ("record", "warn", "skip", "stop", "rollback", "replay")
# Policies whose step must not be applied, and those that also hold later
# steps until the host has acted (stop raises, rollback and replay need the
# parameters as they were at the anomalous step).
SKIPPING = frozenset({"skip", "stop", "rollback", "replay"})
LATCHING = frozenset({"stop", "rollback", "replay"})

DEFAULT_POLICIES: dict[str, str] = {
    "nonfinite_loss": "skip",
    "nonfinite_grad": "skip",
    "loss_spike": "skip",
    "grad_norm_spike": "skip",
    "loss_jump": "warn",
    "layer_grad_spike": "warn",
    "update_ratio_spike": "warn",
    "weights_changed": "stop",
    "replay_mismatch": "stop",
}

ACTIONS = {
    "record": "recorded",
    "warn": "warned",
    "skip": "skipped",
    "stop": "stopped",
    "rollback": "rolled_back",
    "replay": "replayed",
}


class AnomalyWarning(UserWarning):
    """Emitted for anomalies under the ``warn`` policy."""


@dataclass(frozen=True)
class AnomalyEvent:
    """One anomaly the host has read: where, what, and what was done."""

    step: int
    kind: str
    policy: str
    action: str
    values: dict[str, float]
    thresholds: dict[str, float]
    suspects: tuple[str, ...]
    rank: int = 0
    replay: str | None = None

    def describe(self) -> str:
        vals = ", ".join(f"{k}={_fmt(v)}" for k, v in self.values.items())
        thr = ", ".join(f"{k}>{_fmt(v)}" for k, v in self.thresholds.items())
        text = f"step {self.step}: {self.kind} ({vals}"
        text += f"; threshold {thr})" if thr else ")"
        if self.suspects:
            more = f" (+{len(self.suspects) - 5} more)" if len(self.suspects) > 5 else ""
            text += f" in {', '.join(self.suspects[:5])}{more}"
        return text

    def to_dict(self) -> dict[str, Any]:
        data = {"event": "anomaly", "step": self.step, "kind": self.kind, "policy": self.policy,
                "action": self.action, "values": self.values, "thresholds": self.thresholds,
                "suspects": list(self.suspects), "rank": self.rank}
        if self.replay is not None:
            data["replay"] = self.replay
        return data


def _fmt(value: float) -> str:
    return f"{value:.6g}"


@dataclass(frozen=True)
class GuardSummary:
    """Totals over a guarded run, written as the last event of the log."""

    steps: int
    anomalies: dict[str, int]
    skipped: int
    rollbacks: int
    replays: dict[str, int]
    checkpoints: int
    stopped: bool
    rank: int = 0

    @property
    def clean(self) -> bool:
        return not self.anomalies


@dataclass
class Tally:
    """Mutable counters behind :class:`GuardSummary`."""

    anomalies: Counter[str] = field(default_factory=Counter)
    replays: Counter[str] = field(default_factory=Counter)
    skipped: int = 0
    rollbacks: int = 0
    checkpoints: int = 0
    stopped: bool = False

    def summary(self, steps: int, rank: int) -> GuardSummary:
        return GuardSummary(steps, dict(self.anomalies), self.skipped, self.rollbacks,
                            dict(self.replays), self.checkpoints, self.stopped, rank)


class EventLog:
    """Append-only JSONL writer; ``path=None`` keeps nothing on disk."""

    def __init__(self, path: str | Path | None, rank: int = 0) -> None:
        self.rank = rank
        self.path: Path | None = None
        self._fh: IO[str] | None = None
        if path is not None:
            p = Path(path)
            if rank:
                p = p.with_name(f"{p.stem}.rank{rank}{p.suffix}")
            p.parent.mkdir(parents=True, exist_ok=True)
            self.path = p
            self._fh = p.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        data = {"event": record["event"], "time": round(time.time(), 3), "rank": self.rank}
        data.update(record)
        self._fh.write(json.dumps(to_jsonable(data), allow_nan=False) + "\n")

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
