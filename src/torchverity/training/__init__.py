"""Training integrity: the guard, its rules and events.

``TrainingGuard`` catches NaN/Inf, loss and gradient spikes, weights that change between
updates (a device checksum of every parameter and optimizer-state tensor), and replays
flagged steps; policies skip, stop or roll back. ``GuardConfig`` holds its settings;
``AnomalyEvent`` and ``GuardSummary`` are what it reports (JSONL through ``log=``).
"""

from __future__ import annotations

from torchverity.training._config import GuardConfig, Reducer
from torchverity.training._events import AnomalyEvent, AnomalyWarning, GuardSummary
from torchverity.training._guard import TrainingGuard

__all__ = [
    "AnomalyEvent",
    "AnomalyWarning",
    "GuardConfig",
    "GuardSummary",
    "Reducer",
    "TrainingGuard",
]
