"""Hugging Face ``TrainerCallback``: TrainingGuard detectors and policies, verified checkpoints.

    from torchverity.integrations.hf import GuardCallback
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[GuardCallback(log="ev.jsonl")])

The loss is taken from the model's output (``output.loss``, what every
Transformers model returns when labels are given) by a forward hook, averaged
over gradient-accumulation micro-batches; ``on_pre_optimizer_step`` computes
the flags, ``on_optimizer_step`` concludes the step. For SGD, Adam and AdamW the
guard's compiled update stands in for the torch optimizer's ``step()`` (inside
Accelerate's wrapper), so the at-rest check of every window rides in the update;
the Trainer's default ``optim="adamw_torch_fused"`` runs AdamW's own fused kernel,
which nothing can be compiled into: there, as with a gradient scaler (fp16) or
another optimizer, the check takes two passes and the guard's first log event says
why (``optim="adamw_torch"`` gives the compiled update). Note that the Trainer
clips gradients before ``on_pre_optimizer_step``, so the gradient-norm rule sees clipped norms (NaN
and Inf still show), and that with ``logging_nan_inf_filter=True`` (its
default) the Trainer itself reads the loss on the host every step.

On every save, once the guard has verified the weights at rest, each weight file of
``checkpoint-N/`` gets a sidecar, the safetensors model file a meta.json with its
fingerprint and the guard's certification, the guard's state goes to
``torchverity_guard.pt`` (restored when training resumes from that folder), and the
folder gets a ``torchverity.manifest.json``, so ``torchverity verify checkpoint-N``
checks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchverity.errors import UsageError, require_extra
from torchverity.integrations._common import (
    CheckpointRecord,
    GuardCallbackBase,
    log,
    record_checkpoint_file,
)
from torchverity.training import TrainingGuard

_TrainerCallback: Any = require_extra(
    "transformers", extra="hf", feature="the Hugging Face callback"
).TrainerCallback

__all__ = ["GuardCallback"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
GUARD_STATE = "torchverity_guard.pt"


class GuardCallback(GuardCallbackBase, _TrainerCallback):
    """Runs a :class:`TrainingGuard` inside ``Trainer.train``; options are TrainingGuard's."""

    framework = "Hugging Face"

    def __init__(self, *, log: str | Path | None = None, record_checkpoints: bool = True,
                 **guard_options: Any) -> None:
        super().__init__(log=log, record_checkpoints=record_checkpoints, **guard_options)
        self._losses: list[torch.Tensor] = []
        self._hook: Any = None
        self._reason: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if state.global_step:
            self._restored = _guard_state(args, state.global_step)
        optimizer, self._reason = _torch_optimizer(optimizer)
        self._start_guard(TrainingGuard(model, optimizer, log=self.log_path,
                                        start_step=state.global_step,
                                        fused_unavailable=self._reason, **self.guard_options))
        self._hook = model.register_forward_hook(self._capture_loss)

    def _capture_loss(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if not module.training:
            return
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is None:
            return
        if not self._losses:
            raise UsageError(
                "GuardCallback saw no loss in the model's output",
                hint="pass labels so the model returns .loss (custom compute_loss is not seen)",
            )
        loss = torch.stack(self._losses).mean()
        self._losses.clear()
        self.guard.check(loss)
        self._before_update(self._reason)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.after_update()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.record_checkpoints or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            certification = self.certification()
            if self.guard is not None:
                from torchverity.checkpoint._save import save

                save(self.guard.state_dict(), folder / GUARD_STATE)
            self._record(record_checkpoint_folder(folder, state.global_step, certification),
                         certification)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._stop_guard()


def _torch_optimizer(optimizer: Any) -> tuple[Any, str | None]:
    """The torch optimizer inside the Trainer's (Accelerate's wrapper), and why the
    guard's update cannot stand in for its ``step()`` (None when it can)."""
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError:  # an older Trainer steps the torch optimizer itself
        return optimizer, None
    if not isinstance(optimizer, AcceleratedOptimizer):
        return optimizer, None
    if type(optimizer).step is not AcceleratedOptimizer.step:
        return optimizer, f"{type(optimizer).__name__} steps the optimizer its own way"
    if optimizer.scaler is not None:
        return optimizer.optimizer, ("the trainer steps the optimizer through a gradient "
                                     "scaler (fp16)")
    return optimizer.optimizer, None


def _guard_state(args: Any, step: int) -> dict[str, Any] | None:
    """The guard state saved with the checkpoint training resumes from, if any."""
    from torchverity.checkpoint._load import load

    resume = getattr(args, "resume_from_checkpoint", None)
    folders = [Path(resume)] if isinstance(resume, str) else []
    folders.append(Path(args.output_dir) / f"checkpoint-{step}")
    for folder in folders:
        if (folder / GUARD_STATE).is_file():
            return load(folder / GUARD_STATE, sidecar="require")
    log.warning("torchverity: resuming at step %d without the guard's state (no %s in %s): "
                "its rolling windows and counters start afresh", step, GUARD_STATE,
                " or ".join(str(f) for f in folders))
    return None


def record_checkpoint_folder(folder: Path, step: int | None = None,
                             certification: dict[str, Any] | None = None
                             ) -> list[CheckpointRecord]:
    """Sidecars for the weight files, meta.json for safetensors (with the guard's
    certification), a manifest for the folder."""
    from torchverity.checkpoint._safetensors import read_header, read_tensors
    from torchverity.manifest import write_manifest

    records = []
    for path in sorted(p for p in folder.iterdir()
                       if p.suffix in _WEIGHT_SUFFIXES and p.name != GUARD_STATE):
        # safetensors holds only tensors: reading it back runs no code.
        content = read_tensors(path, read_header(path)) if path.suffix == ".safetensors" else None
        records.append(record_checkpoint_file(path, content, source="hf",
                                              user={"global_step": step},
                                              certification=certification))
    write_manifest(folder)
    return records
