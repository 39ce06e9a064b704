"""What both trainer callbacks share: the guard they drive and the records they write."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchverity.digest import DEFAULT_ALGO, atomic_write_text, digest_file, write_sidecar
from torchverity.errors import FormatError, InputError, IntegrityError, UsageError, shell_path

if TYPE_CHECKING:
    from torchverity.training import GuardSummary, TrainingGuard

log = logging.getLogger("torchverity.integrations")


def afresh_consequence(found: tuple[Path, dict[str, Any]] | None, others: str = "") -> str:
    """What a resume without the guard's own state means, given the checkpoint it resumes
    from and the certification its meta.json recorded (None when neither is known);
    ``others``: the shell words that name the run's other checkpoints."""
    if found is None:
        return ("and so do its unresolved anomalies: checkpoints saved from now on are "
                "certified on what this run sees only. Next: run `torchverity verify` on that "
                "checkpoint (it fails an uncertified or damaged one) before trusting them, "
                "or resume from an intact copy of one saved with GuardCallback.")
    where, certification = found
    if certification.get("certified"):
        return (f"and {where} was certified when it was saved (its meta.json), so "
                "checkpoints saved from now on are certified from those weights. Next: run "
                f"`torchverity verify {shell_path(where)}` to check its files are still "
                "those.")
    return (f"but {where} was saved uncertified (its meta.json says why), and that is "
            "carried over: no checkpoint saved from these weights is certified until a "
            "rollback. Next: resume from an earlier certified checkpoint (`torchverity "
            f"verify {others}` tells them apart).")


def check_resumed(checkpoint: Path, files: list[Path]) -> None:
    """The files of the checkpoint a trainer resumed from (weights, optimizer and scheduler
    state), against what its save recorded (sidecar, or its folder's manifest). Damage
    raises before the first update: what was loaded is what every later checkpoint
    certifies. A file with no record has nothing to compare with, and its load stands as
    the trainer made it."""
    from torchverity.verify import verify_file

    bad = []
    for f in files:
        try:
            result = verify_file(f)
        except InputError:
            continue
        bad += [(result.record, e) for e in result.problems]
    if not bad:
        return
    what = "; ".join(f"{e.path} {e.status}" + (f" (tensors {', '.join(e.tensors[:5])})"
                                               if e.tensors else "") + f" against {record}"
                     for record, e in bad[:5])
    raise IntegrityError(
        f"{checkpoint}: training resumed from a checkpoint whose files do not match what its "
        f"save recorded: {what}. What the trainer loaded is not what was saved, and every "
        "checkpoint saved from it would carry the damage", path=checkpoint,
        hint=f"resume from a checkpoint that verifies: torchverity verify "
             f"{shell_path(checkpoint.parent)} lists each checkpoint's verdict")


def guard_options_for(model: torch.nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """The guard's options for ``model``: of a sharded one, its ranks' flags combined by
    default (``FlagReducer``), so that every rank acts on a flag together; on its own, the
    rank whose shard flipped would stop or skip alone while the others wait in their
    next collective."""
    from torchverity.distributed._placements import is_dtensor

    if "reducer" in options or not any(is_dtensor(p) for p in model.parameters()):
        return options
    from torchverity.distributed import FlagReducer

    return {**options, "reducer": FlagReducer()}


class GuardCallbackBase:
    """What both trainer callbacks hold; ``framework`` names the trainer in messages."""

    framework = "trainer"

    def __init__(self, *, log: str | Path | None = None, record_checkpoints: bool = True,
                 **guard_options: Any) -> None:
        if "step_fn" in guard_options:
            raise UsageError(f"the {self.framework} callback does not replay steps",
                             hint="use TrainingGuard in a plain loop for replay audits")
        super().__init__()
        self.log_path = log
        self.record_checkpoints = record_checkpoints
        self.guard_options = guard_options
        self.guard: TrainingGuard | None = None
        self.summary: GuardSummary | None = None
        self.checkpoints: list[CheckpointRecord] = []
        self._restored: dict[str, Any] | None = None  # guard state from a resumed checkpoint
        self._step: GuardedStep | None = None

    def certification(self) -> dict[str, Any] | None:
        """The guard's at-rest verification of the weights as they are now (being saved)."""
        return self.guard.certify() if self.guard is not None else None

    @property
    def sharded(self) -> bool:
        """Whether the guarded model is sharded (its ranks certify checkpoints together)."""
        return self.guard is not None and self.guard._sharded

    def _record(self, records: list[CheckpointRecord],
                certification: dict[str, Any] | None, *, keep: bool = True) -> None:
        """Keep the records of one checkpoint the trainer saved (unless ``keep`` is false: a
        rank that did not write them) and log it in the guard's event log and summary, as
        the guard's own saves are (``torchverity report`` counts them). The event names its
        first file with a fingerprint (the weights), else its first."""
        if keep:
            self.checkpoints.extend(records)
        if self.guard is None or not records:
            return
        from torchverity.training._recovery import log_checkpoint

        main = next((r for r in records if r.fingerprint is not None), records[0])
        log_checkpoint(self.guard, Path(main.path), main.digest, main.fingerprint,
                       bool(certification and certification.get("certified")))

    def _start_guard(self, guard: TrainingGuard) -> None:
        self.guard, self._step = guard, None
        if self._restored is not None:
            guard.load_state_dict(self._restored)
            self._restored = None
        if guard.fused:  # the trainer's optimizer.step() becomes the guard's update
            self._step = GuardedStep(guard)

    def _before_update(self, reason: str | None) -> None:
        """After ``check()``: the two-pass verification, unless the guard's update stands
        in for the trainer's ``optimizer.step()``."""
        assert self.guard is not None
        if self._step is None:
            self.guard.before_update(reason)

    @property
    def fused_updates(self) -> int:
        """Updates the guard ran in place of the trainer's ``optimizer.step()``, with the
        at-rest check inside them (0 when it verifies in two passes)."""
        return self._step.updates if self._step is not None else 0

    def _stop_guard(self) -> None:
        if self._step is not None:
            self._step.remove()
        if self.guard is not None:
            self.summary = self.guard.close()


class GuardedStep:
    """The guard's update standing in for ``optimizer.step()``, which a trainer calls
    itself: the at-rest check then rides in the guard's update (one pass over each
    tensor) instead of two passes of its own.

    Installed on the optimizer instance (the class and other instances are untouched)
    and removed when training ends. A closure (Lightning's: forward, backward, then
    ``on_before_optimizer_step``, where the callback calls ``check()``) is evaluated
    first, as torch's optimizers do. A call with no ``check()`` before it (nothing to
    decide on: a training step that returned no loss) runs the optimizer's own step and
    records the tensors again; so does a call from inside the guard.
    """

    def __init__(self, guard: TrainingGuard) -> None:
        self.guard = guard
        self.optimizer = guard.optimizer
        # An instance attribute already there (an LR scheduler's counting wrapper) is
        # what the optimizer's own step is, and what goes back at the end.
        self._own = vars(self.optimizer).get("step")
        self._inside = False
        self.updates = 0  # updates the guard ran in place of the trainer's step
        if hasattr(self._own, "_wrapped_by_lr_sched"):
            self._wrapped_by_lr_sched = True  # the fused update counts its calls too
        self.optimizer.step = self  # type: ignore[method-assign]

    def __call__(self, closure: Callable[[], Any] | None = None) -> Any:
        if self._inside:
            return self._original(closure)
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        self._inside = True
        try:
            if not self.guard.checked:
                self._original(None)
                self.guard.refresh()
                return result
            self.guard.update()
            self.updates += 1
        finally:
            self._inside = False
        return result

    def _original(self, closure: Callable[[], Any] | None) -> Any:
        if self._own is not None:
            return self._own(closure)
        return type(self.optimizer).step(self.optimizer, closure)

    def remove(self) -> None:
        if vars(self.optimizer).get("step") is self:
            if self._own is not None:
                self.optimizer.step = self._own
            else:
                del self.optimizer.step


@dataclass(frozen=True)
class CheckpointRecord:
    """What was recorded next to a checkpoint file written by a trainer."""

    path: str
    algo: str
    digest: str
    fingerprint: str | None
    sidecar: str
    meta: str | None


def record_checkpoint_file(
    path: str | os.PathLike[str], content: Any = None, *, source: str,
    user: dict[str, Any] | None = None, algo: str = DEFAULT_ALGO,
    certification: dict[str, Any] | None = None,
) -> CheckpointRecord:
    """Write the sidecar and, when ``content`` (the object saved) is given, the meta.json.

    ``content`` must be what loading the file returns, so that
    ``torchverity.load`` can compare fingerprints; objects that cannot be
    fingerprinted (custom classes in hyperparameters) get the sidecar only.
    """
    from torchverity.checkpoint._fingerprint import fingerprint
    from torchverity.checkpoint._meta import meta_path_for, meta_record

    p = Path(path)
    digest = digest_file(p, algo)
    sidecar = write_sidecar(p, digest)
    if content is None:
        return CheckpointRecord(str(p), algo, digest.hexdigest, None, str(sidecar), None)
    try:
        fp = fingerprint(content, mode="exact")
    except FormatError as exc:
        log.warning("%s: sidecar written, no meta.json: %s", p, exc.message)
        return CheckpointRecord(str(p), algo, digest.hexdigest, None, str(sidecar), None)
    file_format = "safetensors" if p.suffix == ".safetensors" else "pt"
    record = meta_record(p, file_format, algo, digest.hexdigest, digest.size, fp, None, None,
                         {"source": source, **(user or {})}, certification)
    meta = meta_path_for(p)
    atomic_write_text(meta, json.dumps(record, indent=2) + "\n")
    return CheckpointRecord(str(p), algo, digest.hexdigest, fp.root, str(sidecar), str(meta))
