"""Checkpoints the guard can stand behind: certified saves, rollback, and the guard's own state.

A checkpoint is *certified* when, at the moment it is saved, an at-rest verification
of every covered tensor (the weights and optimizer state being saved) against the
record of the last update has passed, and no anomaly that may have left the weights
corrupted is unresolved: a ``weights_changed``, non-finite or replay-mismatch anomaly
whose policy let the update stand (``record`` or ``warn``), until a rollback. The
certification goes into the checkpoint's meta.json (docs/formats/checkpoint.md);
rollback only ever loads a certified checkpoint. A model of DTensor shards (FSDP2, HSDP,
tensor parallel) is checkpointed as a distributed checkpoint folder, certified by every
rank together (:mod:`~torchverity.training._sharded_checkpoints`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torchverity.training._sharded_checkpoints as sharded
from torchverity.errors import UsageError
from torchverity.training._events import AnomalyEvent, Tally
from torchverity.training._snapshot import Snapshot

if TYPE_CHECKING:
    from torchverity.training._guard import TrainingGuard

# Anomalies after which the weights may hold the fault when the update was let stand.
CORRUPTING = frozenset({"weights_changed", "nonfinite_loss", "nonfinite_grad",
                        "replay_mismatch"})
_LET_STAND = frozenset({"recorded", "warned"})


def log_checkpoint(guard: TrainingGuard, path: Path, digest: str, fingerprint: str | None,
                   certified: bool) -> None:
    """Count a checkpoint in the guard's summary and write its ``checkpoint`` event: the
    guard's own saves, and those a trainer callback records for the trainer."""
    guard._tally.checkpoints += 1
    guard._log.write({"event": "checkpoint", "step": guard.global_step, "path": str(path),
                      "digest": digest, "fingerprint": fingerprint, "certified": certified})


class Recovery:
    """Saves, certifies and rolls back to checkpoints of one guard's model and optimizer."""

    def __init__(self, guard: TrainingGuard, checkpoint_dir: Path | None) -> None:
        self.guard = guard
        self.dir = checkpoint_dir
        self.checkpoints: list[Path] = []
        self.certified: list[Path] = []
        self.unresolved: list[AnomalyEvent] = []
        self.since_checkpoint = 0

    def note(self, events: list[AnomalyEvent]) -> None:
        """Events just acted on: those that leave the weights in doubt stay unresolved."""
        self.unresolved.extend(e for e in events
                               if e.kind in CORRUPTING and e.action in _LET_STAND)

    # ------------------------------------------------------------ certification

    def certify(self) -> dict[str, Any]:
        """Verify the covered tensors at rest now (flags not read yet are read first) and
        say whether a checkpoint of them can be certified, and on what grounds. Of a
        sharded model: for every rank's shards, agreed by all ranks (call it on each)."""
        g = self.guard
        g.flush()
        changed = g._rest.changed()
        n_params = len(g._names)
        coverage = g._rest.coverage()
        at_rest = "unavailable" if changed is None else ("failed" if changed else "passed")
        unresolved = [{"step": e.step, "kind": e.kind, "suspects": list(e.suspects)}
                      for e in self.unresolved]
        state = max(len(g._rest.names) - n_params, 0) if changed is not None else 0
        frozen = g._rest.frozen
        n_frozen = len(frozen.names) if changed is not None and frozen.record is not None else 0
        record = {
            "certified": at_rest == "passed" and not unresolved,
            "step": g.global_step,
            "verified": {"at_rest": at_rest,
                         "tensors": n_params + state + n_frozen if changed is not None else 0,
                         "parameters": n_params, "optimizer_state": state,
                         "frozen_parameters": n_frozen,
                         "windows": coverage["windows"],
                         "verification": coverage["verification"]},
            "changed": list(changed or ()),
            "unresolved": unresolved,
            "guard": dataclasses.asdict(g.summary()),
        }
        return sharded.agree(record) if g._sharded else record

    # ------------------------------------------------------------ guard state

    def rules_state(self) -> dict[str, Any]:
        # One layout for both rule engines: a checkpoint loads into either.
        g = self.guard
        rules = g._engine()
        state: dict[str, Any] = {"step": g.global_step, "stats": rules.stats.state_dict(),
                                 "prev_loss": rules.prev_loss_tensor()}
        if rules.ratio_stats is not None:
            state["ratio_stats"] = rules.ratio_stats.state_dict()
        return state

    def load_rules_state(self, state: dict[str, Any]) -> None:
        rules = self.guard._engine()
        rules.stats.load_state_dict(state["stats"])
        if rules.ratio_stats is not None and "ratio_stats" in state:
            rules.ratio_stats.load_state_dict(state["ratio_stats"])
        rules.reset_rules(state["prev_loss"])

    def state_dict(self) -> dict[str, Any]:
        """Rolling windows, rule state, counters and unresolved anomalies (for trainers'
        checkpoints; reading it reads the pending flags first)."""
        g = self.guard
        g.flush()
        tally = g._tally
        return {**self.rules_state(), "tally": {
            "anomalies": dict(tally.anomalies), "replays": dict(tally.replays),
            "skipped": tally.skipped, "rollbacks": tally.rollbacks,
            "checkpoints": tally.checkpoints},
            "unresolved": [e.to_dict() for e in self.unresolved]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        g = self.guard
        self.load_rules_state(state)
        g.global_step = int(state["step"])
        t = state.get("tally", {})
        g._tally = Tally()
        g._tally.anomalies.update(t.get("anomalies", {}))
        g._tally.replays.update(t.get("replays", {}))
        g._tally.skipped = int(t.get("skipped", 0))
        g._tally.rollbacks = int(t.get("rollbacks", 0))
        g._tally.checkpoints = int(t.get("checkpoints", 0))
        self.unresolved = [AnomalyEvent(e["step"], e["kind"], e["policy"], e["action"],
                                        e["values"], e["thresholds"], tuple(e["suspects"]),
                                        e["rank"]) for e in state.get("unresolved", [])]

    def carry(self, certification: dict[str, Any]) -> None:
        """Take over what left a checkpoint uncertified (its meta.json's certification),
        for a resume whose own guard state is gone: its unresolved anomalies stay
        unresolved, and a failed at-rest verification at that save counts as one, so
        nothing saved from these weights is certified until a rollback."""
        taken = [AnomalyEvent(int(u["step"]), str(u["kind"]), "record", "recorded", {}, {},
                              tuple(map(str, u.get("suspects", ()))))
                 for u in certification.get("unresolved", ()) if isinstance(u, dict)
                 and isinstance(u.get("step"), int) and isinstance(u.get("kind"), str)]
        verified = certification.get("verified")
        if isinstance(verified, dict) and verified.get("at_rest") == "failed":
            step = certification.get("step")
            taken.append(AnomalyEvent(step if isinstance(step, int) else 0, "weights_changed",
                                      "record", "recorded", {}, {},
                                      tuple(map(str, certification.get("changed", ())))))
        self.unresolved.extend(taken)

    # ------------------------------------------------------------ saving

    def save(self) -> Path:
        """Save model, optimizer, guard statistics and RNG states with ``torchverity.save``,
        with the certification in its meta.json; of a sharded model, a distributed
        checkpoint folder with the certification beside its fingerprints."""
        from torchverity.checkpoint._save import save
        from torchverity.determinism import capture_rng

        g = self.guard
        g.wait()
        if self.dir is None:
            raise UsageError("save_checkpoint() needs checkpoint_dir= given to TrainingGuard")
        certification = self.certify()
        if g._sharded:
            path = self._sharded_path()
            digest = sharded.save(g, path, certification, self.rules_state())
            fingerprint = None
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = self.dir / f"guard-step{g.global_step:08d}.pt"
            state = {"model": g.model.state_dict(), "optimizer": g.optimizer.state_dict(),
                     "guard": self.rules_state(), "rng": capture_rng().to_state()}
            report = save(state, path, meta={"torchverity_guard_step": g.global_step},
                          certification=certification)
            digest, fingerprint = report.digest, report.fingerprint
        self.checkpoints.append(path)
        if certification["certified"]:
            self.certified.append(path)
        self.since_checkpoint = 0
        log_checkpoint(g, path, digest, fingerprint, certification["certified"])
        self._prune()
        return path

    def _sharded_path(self) -> Path:
        """A folder of its own for every save (a second save at one step never replaces a
        certified checkpoint); the same name on every rank, whose lists agree."""
        assert self.dir is not None
        base = self.dir / f"guard-step{self.guard.global_step:08d}"
        path, n = base, 1
        while path in self.checkpoints:
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        return path

    def _prune(self) -> None:
        keep = self.guard.config.keep_checkpoints
        newest_certified = self.certified[-1] if self.certified else None
        for old in list(self.checkpoints):
            if len(self.checkpoints) <= keep:
                break
            if old == newest_certified:
                continue  # what a rollback would load: never pruned
            self.checkpoints.remove(old)
            if old in self.certified:
                self.certified.remove(old)
            if self.guard._sharded:
                sharded.remove(self.guard, old)
                continue
            for p in old.parent.glob(old.name + "*"):
                p.unlink(missing_ok=True)

    def maybe_save(self) -> None:
        """At a clean read, every ``checkpoint_every`` steps: save if it can be certified."""
        every = self.guard.config.checkpoint_every
        if self.dir is None or every is None or self.since_checkpoint < every:
            return
        self.guard.wait()
        doubtful = bool(self.unresolved or self.guard._rest.changed())
        if self.guard._sharded:  # every rank saves, or none
            doubtful = sharded.any_rank(doubtful, "the checkpoint decision")
        if doubtful:  # never keep a doubtful one
            return
        self.save()

    # ------------------------------------------------------------ rollback

    def rollback(self, step: int | None) -> Path:
        """Reload the newest certified checkpoint (verified by ``torchverity.load``; of a
        sharded model, by ``load_dcp`` on every rank together)."""
        from torchverity.checkpoint._load import load
        from torchverity.determinism import RngState, restore_rng

        g = self.guard
        g.wait()
        if g._sharded:
            path = sharded.choose(self.certified)
            state = sharded.load(g, path)
        elif not self.certified:
            raise UsageError("no certified checkpoint to roll back to",
                             hint="give checkpoint_dir= (the guard saves one when it starts)")
        else:
            path = self.certified[-1]
            state = load(path, sidecar="require")
            g.model.load_state_dict(state["model"])
            g.optimizer.load_state_dict(state["optimizer"])
        self.load_rules_state(state["guard"])
        restore_rng(RngState.from_state(state["rng"]))
        self.unresolved.clear()
        g._upd.snapshot = Snapshot()
        g.refresh()
        g._tally.rollbacks += 1
        g._log.write({"event": "rollback", "step": g.global_step, "anomaly_step": step,
                      "checkpoint": str(path), "restored_step": int(state["guard"]["step"])})
        return path

