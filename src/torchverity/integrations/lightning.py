"""PyTorch Lightning callback: TrainingGuard detectors and policies, verified checkpoints.

    from torchverity.integrations.lightning import GuardCallback
    trainer = lightning.Trainer(callbacks=[GuardCallback(log="events.jsonl")])

Hooks used: ``on_before_backward`` (keeps the loss tensor), then
``on_before_optimizer_step`` (flags computed, after the closure's backward) and
``on_train_batch_end`` (decision, at-rest record, host read every ``check_every``
steps). For SGD, Adam and AdamW the guard's update stands in for the
optimizer's ``step`` (which Lightning calls with its closure), so the at-rest check
of every window rides in the update; with a gradient scaler (``16-mixed``), a
precision plugin that steps the optimizer its own way (DeepSpeed, XLA) or another
optimizer it takes two passes, and the guard's first log event says why. The
trainer's ``CheckpointIO`` is wrapped so every file it saves gets, once the guard
has verified the weights at rest, a sidecar and a meta.json with the fingerprint of
the saved dictionary and the guard's certification. Of a sharded model
(``ModelParallelStrategy``: FSDP2, tensor parallel) every rank verifies its own shards
when a checkpoint is saved and the ranks agree on the certification; a distributed
checkpoint folder gets a manifest (every rank's shard files) and its ``meta.pt`` the
meta.json with that certification. The guard's state is the
callback's ``state_dict`` (saved in every checkpoint, restored on resume). Replay
needs a step function and is not offered here; use the plain-loop guard for it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from torchverity.checkpoint._records import linked_checkpoint
from torchverity.digest import ALGORITHMS
from torchverity.errors import UsageError, require_extra, shell_path
from torchverity.integrations._common import (
    CheckpointRecord,
    GuardCallbackBase,
    afresh_consequence,
    check_resumed,
    guard_options_for,
    log,
    record_checkpoint_file,
)
from torchverity.training import TrainingGuard
from torchverity.verify import certification_of

__all__ = ["GuardCallback"]

_pl = require_extra("lightning.pytorch", extra="lightning", feature="the Lightning callback")
_plugins = require_extra("lightning.fabric.plugins", extra="lightning",
                         feature="the Lightning callback")
_METADATA_FILENAME: str = require_extra(
    "lightning.fabric.utilities.load", extra="lightning",
    feature="the Lightning callback")._METADATA_FILENAME
_Callback: Any = _pl.Callback
_CheckpointIO: Any = _plugins.CheckpointIO
_precision = _pl.plugins.precision
# Precision plugins whose optimizer_step ends in ``optimizer.step(closure=...)`` when no
# gradient scaler is in use: there the guard's update can stand in for the step.
_PLAIN_STEPS = (_precision.Precision.optimizer_step, _precision.MixedPrecision.optimizer_step,
                _precision.FSDPPrecision.optimizer_step)


def _stepping_reason(plugin: Any) -> str | None:
    """Why the guard's update cannot stand in for ``optimizer.step()`` under this
    precision plugin; None when it can."""
    if getattr(plugin, "scaler", None) is not None:
        return "the trainer steps the optimizer through a gradient scaler (16-bit AMP)"
    if type(plugin).optimizer_step not in _PLAIN_STEPS:
        return f"{type(plugin).__name__} steps the optimizer its own way"
    return None


class _RecordingIO(_CheckpointIO):
    """Delegates to the trainer's CheckpointIO, then records what was written."""

    def __init__(self, inner: Any, callback: GuardCallback) -> None:
        self.inner = inner
        self.callback = callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        if self.callback.sharded:
            return  # only rank 0 writes here: every rank certifies in _CertifiedSave
        # The dictionary shares the live tensors' storage: verifying them at rest now
        # verifies what was just written.
        certification = self.callback.certification()
        self.callback._record(_record_saved(Path(path), checkpoint, certification),
                              certification)

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        return self.inner.load_checkpoint(path, *args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        for suffix in (*(f".{a}" for a in ALGORITHMS), ".meta.json"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)

    def teardown(self) -> None:
        self.inner.teardown()


def _record_saved(path: Path, checkpoint: dict[str, Any],
                  certification: dict[str, Any] | None) -> list[CheckpointRecord]:
    """Sidecar and meta.json of the file the trainer saved; of a distributed checkpoint
    folder (``ModelParallelStrategy``), those of its ``meta.pt`` (what ``checkpoint``
    holds once the strategy has taken the sharded state out) and a manifest of the
    folder, which covers every rank's shard files."""
    from torchverity.manifest import write_manifest

    user = {"global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}
    target = path / _METADATA_FILENAME if path.is_dir() else path
    records = [record_checkpoint_file(target, checkpoint, source="lightning", user=user,
                                      certification=certification)]
    if path.is_dir():
        write_manifest(path)
    return records


class _CertifiedSave:
    """The strategy's ``save_checkpoint`` (which every rank calls) for a sharded model:
    after it the ranks verify their shards at rest together, rank 0 records what was
    written (the file its CheckpointIO wrote, or the distributed checkpoint folder that
    ``ModelParallelStrategy`` writes without one) and every rank's event log gets the
    checkpoint with the agreed verdict. Installed on the strategy instance."""

    def __init__(self, strategy: Any, callback: GuardCallback) -> None:
        self.strategy, self.callback = strategy, callback
        self._inner = strategy.save_checkpoint
        strategy.save_checkpoint = self

    def __call__(self, checkpoint: dict[str, Any], filepath: Any,
                 storage_options: Any = None) -> None:
        self._inner(checkpoint, filepath, storage_options=storage_options)
        if not self.callback.sharded:
            return
        from torchverity.distributed._comm import DEFAULT_TIMEOUT_S, all_gather_json, open_comm

        certification = self.callback.certification()
        records = (_record_saved(Path(filepath), checkpoint, certification)
                   if self.strategy.is_global_zero else [])
        what = "the checkpoint record exchange"
        comm = open_comm(None, DEFAULT_TIMEOUT_S, f"GuardCallback: {what}")
        main = [dataclasses.asdict(r) for r in records[:1]]
        written = all_gather_json(comm, main, what)[0]
        self.callback._record(records or [CheckpointRecord(**r) for r in written],
                              certification, keep=bool(records))


class GuardCallback(GuardCallbackBase, _Callback):
    """Runs a :class:`TrainingGuard` inside ``Trainer.fit``; options are TrainingGuard's."""

    framework = "Lightning"

    def __init__(self, *, log: str | Path | None = None, record_checkpoints: bool = True,
                 **guard_options: Any) -> None:
        super().__init__(log=log, record_checkpoints=record_checkpoints, **guard_options)
        self._loss: torch.Tensor | None = None
        self._updating = False
        self._reason: str | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not self.record_checkpoints or stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy.checkpoint_io, _RecordingIO):
            strategy.checkpoint_io = _RecordingIO(strategy.checkpoint_io, self)
        if not isinstance(vars(strategy).get("save_checkpoint"), _CertifiedSave):
            _CertifiedSave(strategy, self)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise UsageError("GuardCallback guards exactly one optimizer",
                             hint="use TrainingGuard per optimizer in manual optimization")
        if trainer.ckpt_path:
            check_resumed(Path(trainer.ckpt_path), [Path(trainer.ckpt_path)])
        options = dict(guard_options_for(pl_module, self.guard_options))
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            # AMP's GradScaler drives the optimizer's found_inf itself.
            options.setdefault("fused_skip", False)
        self._reason = _stepping_reason(trainer.precision_plugin)
        restored = self._restored is not None
        self._start_guard(TrainingGuard(pl_module, trainer.optimizers[0], log=self.log_path,
                                        start_step=trainer.global_step,
                                        fused_unavailable=self._reason, **options))
        if trainer.ckpt_path and not restored:
            self._resumed_without_state(Path(trainer.ckpt_path), trainer.global_step)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        loss, self._loss = self._loss, None
        if self.guard is None or loss is None:
            return
        self.guard.check(loss)
        self._before_update(self._reason)
        self._updating = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.guard is not None and self._updating:
            self._updating = False
            self.guard.after_update()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop_guard()

    def _resumed_without_state(self, path: Path, step: int) -> None:
        """Resumed from a checkpoint that holds no guard state: said once; the verdict its
        meta.json recorded at its save is kept when it was uncertified."""
        certification = certification_of([linked_checkpoint(path)])
        found = (path, certification) if certification is not None else None
        if found is not None and not found[1].get("certified") and self.guard is not None:
            self.guard._recovery.carry(found[1])
        log.warning(
            "torchverity: training resumed at global step %d from %s, but that checkpoint "
            "holds no guard state (saved without GuardCallback, or by an older torchverity). "
            "The guard's rolling windows and counters start afresh, %s", step, path,
            afresh_consequence(found, f"{shell_path(path.parent)}/*.ckpt"))

    def state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict()} if self.guard is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("guard")
