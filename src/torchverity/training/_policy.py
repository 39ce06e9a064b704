"""Policies per anomaly kind: resolved from the guard's arguments, and what acting means."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

from torchverity.errors import TrainingAnomalyError, UsageError, shell_path
from torchverity.training._events import (
    ACTIONS,
    DEFAULT_POLICIES,
    KIND_INDEX,
    KINDS,
    POLICIES,
    AnomalyEvent,
)


def resolve_policies(policy: str | None, policies: Mapping[str, str] | None,
                     checkpoint_dir: str | Path | None) -> dict[str, str]:
    """The policy of every kind: defaults, ``rollback`` for changes at rest when there are
    checkpoints to go back to, then ``policy=`` for all, then ``policies=`` per kind."""
    resolved = dict(DEFAULT_POLICIES)
    if checkpoint_dir is not None:
        resolved["weights_changed"] = "rollback"
    if policy is not None:
        resolved = dict.fromkeys(KINDS, policy)
    resolved.update(policies or {})
    for kind, pol in resolved.items():
        if kind not in KIND_INDEX:
            raise UsageError(f"unknown anomaly kind '{kind}'", hint=f"kinds: {', '.join(KINDS)}")
        if pol not in POLICIES:
            raise UsageError(f"unknown policy '{pol}' for {kind}",
                             hint=f"policies: {', '.join(POLICIES)}")
    return resolved


def check_policy_needs(policies: dict[str, str], checkpoint_dir: str | Path | None,
                       step_fn: object, replay_every: int | None) -> None:
    used = set(policies.values())
    if "rollback" in used and checkpoint_dir is None:
        raise UsageError(
            "policy 'rollback' needs checkpoint_dir= (where verified checkpoints go)")
    if ("replay" in used or replay_every) and step_fn is None:
        raise UsageError(
            "replay needs step_fn=: a function that runs forward on a batch, returns the loss",
            hint="then call guard.train_step(batch), or guard.check(loss, batch=batch)",
        )


def resolve_actions(events: list[AnomalyEvent], replay: Callable[[int], str]
                    ) -> list[AnomalyEvent]:
    """Replay and rollback act once, for the first step that asked; later steps of the
    same read were held by the latch, so for them the action taken was a skip."""
    first: dict[str, int] = {}
    for e in events:
        if e.policy in ("replay", "rollback"):
            first.setdefault(e.policy, e.step)
    verdict = replay(first["replay"]) if "replay" in first else None
    resolved = []
    for e in events:
        if e.policy in first and e.step != first[e.policy]:
            e = dataclasses.replace(e, action=ACTIONS["skip"])
        elif e.policy == "replay":
            e = dataclasses.replace(e, replay=verdict)
        resolved.append(e)
    return resolved


def stop_error(event: AnomalyEvent, log_path: Path | None) -> TrainingAnomalyError:
    where = f"; replay says {event.replay}" if event.replay else ""
    hint = (f"see every event with: torchverity report {shell_path(log_path)}"
            if log_path else "pass log='events.jsonl' to TrainingGuard to keep events")
    return TrainingAnomalyError(
        f"training anomaly at {event.describe()}{where}",
        step=event.step, kind=event.kind, values=event.values, thresholds=event.thresholds,
        suspects=event.suspects, rank=event.rank, hint=hint,
    )
