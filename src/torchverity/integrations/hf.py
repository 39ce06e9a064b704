"""Hugging Face ``TrainerCallback``: TrainingGuard detectors and policies, verified checkpoints.

    from torchverity.integrations.hf import GuardCallback
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[GuardCallback(log="ev.jsonl")])

The loss is taken from the model's output (``output.loss``, what every
Transformers model returns when labels are given) by a forward hook, averaged
over gradient-accumulation micro-batches; ``on_pre_optimizer_step`` computes
the flags, ``on_optimizer_step`` concludes the step. For SGD, Adam and AdamW the
guard's update stands in for the torch optimizer's ``step()`` (inside
Accelerate's wrapper), so the at-rest check of every window rides in the update;
the Trainer's default ``optim="adamw_torch_fused"`` (AdamW's own one-pass kernel)
is reproduced by the native update on the CPU; elsewhere, as with a gradient
scaler (fp16) or another optimizer, the check takes two passes and the guard's
first log event says why (``optim="adamw_torch"`` gives the compiled update). Note that the Trainer
clips gradients before ``on_pre_optimizer_step``, so the gradient-norm rule sees clipped norms (NaN
and Inf still show), and that with ``logging_nan_inf_filter=True`` (its
default) the Trainer itself reads the loss on the host every step.

On every save, once the guard has verified the weights at rest, each weight file of
``checkpoint-N/`` gets a sidecar, the safetensors model file a meta.json with its
fingerprint and the guard's certification, and the folder gets a
``torchverity.manifest.json``, so ``torchverity verify checkpoint-N`` checks it.
A sharded model's ranks combine their flags (a ``FlagReducer`` unless ``reducer=`` is
given) and certify every save together.

The guard's state travels in the folder's ``trainer_state.json``: the callback is a
stateful callback (``ExportableState``), and its entry there holds the state as a
record with its own digest (:mod:`~torchverity.integrations._guard_record`). So the
state comes back however training resumes (``train(resume_from_checkpoint=True)``, a
path inside or outside ``output_dir``, a folder copied from another machine); a
resumed folder without it, or whose record fails verification, is named in one
warning and the guard starts afresh. With
``restore_callback_states_from_checkpoint=True`` the Trainer replaces this callback by
one rebuilt from the options saved in that entry (those that are JSON values).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from torchverity._jsonable import to_jsonable
from torchverity.errors import (
    FormatError,
    IntegrityError,
    UsageError,
    require_extra,
    shell_path,
)
from torchverity.integrations._common import (
    CheckpointRecord,
    GuardCallbackBase,
    afresh_consequence,
    check_resumed,
    guard_options_for,
    log,
    record_checkpoint_file,
)
from torchverity.integrations._guard_record import decode_record, encode_record
from torchverity.training import TrainingGuard
from torchverity.verify import certification_of

_transformers = require_extra("transformers", extra="hf", feature="the Hugging Face callback")
_TrainerCallback: Any = _transformers.TrainerCallback
_ExportableState: Any = _transformers.trainer_callback.ExportableState

__all__ = ["GuardCallback"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class GuardCallback(GuardCallbackBase, _TrainerCallback, _ExportableState):
    """Runs a :class:`TrainingGuard` inside ``Trainer.train``; options are TrainingGuard's."""

    framework = "Hugging Face"

    def __init__(self, *, log: str | Path | None = None, record_checkpoints: bool = True,
                 **guard_options: Any) -> None:
        super().__init__(log=log, record_checkpoints=record_checkpoints, **guard_options)
        self._losses: list[torch.Tensor] = []
        self._hook: Any = None
        self._reason: str | None = None
        self._run: tuple[Any, Any] | None = None  # the TrainingArguments and TrainerState

    def state(self) -> dict[str, Any]:
        """This callback's entry in ``trainer_state.json``, taken by the Trainer as it saves
        a checkpoint: the options it was built with and, during training, the guard's
        state at that checkpoint."""
        entry: dict[str, Any] = {"args": _json_options(self), "attributes": {}}
        if self._run is not None and self.guard is not None:
            args, state = self._run
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            entry["guard"] = encode_record(self.guard.state_dict(), state.global_step,
                                           str(folder))
        return entry

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        name = type(self).__name__
        carried = None
        if state.global_step:
            self._restored, carried = _resumed_state(args, state, name)
            folder = _resumed_folder(args, state, None)
            if folder is not None:
                check_resumed(folder, sorted(f for f in folder.iterdir()
                                             if f.suffix in _WEIGHT_SUFFIXES))
        # The Trainer updates only the entries its trainer_state.json already has: resumed
        # from a folder saved without this callback, its next save would fail (KeyError).
        state.stateful_callbacks.setdefault(name, {})
        self._run = (args, state)
        optimizer, self._reason = _torch_optimizer(optimizer)
        self._start_guard(TrainingGuard(model, optimizer, log=self.log_path,
                                        start_step=state.global_step,
                                        fused_unavailable=self._reason,
                                        **guard_options_for(model, self.guard_options)))
        if carried is not None and self.guard is not None:
            self.guard._recovery.carry(carried)
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
        if not self.record_checkpoints or not (state.is_world_process_zero or self.sharded):
            return
        # A sharded model's ranks agree on the certification together; otherwise rank 0's.
        certification = self.certification()
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            self._record(record_checkpoint_folder(folder, state.global_step, certification),
                         certification)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._run = None
        self._stop_guard()


def _json_options(callback: GuardCallback) -> dict[str, Any]:
    """The options the callback was built with that are JSON values (what the Trainer
    rebuilds it from with ``restore_callback_states_from_checkpoint=True``)."""
    options = {"log": callback.log_path, "record_checkpoints": callback.record_checkpoints,
               **callback.guard_options}
    kept = {}
    for name, value in options.items():
        value = to_jsonable(value)
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            continue  # a reducer object, say: not something a JSON file can hold
        kept[name] = value
    return kept


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


def _resumed_state(args: Any, state: Any, name: str
                   ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(guard state, certification to carry)`` for a resume: the guard state saved in the
    ``trainer_state.json`` that training resumes from (the Trainer passes its content as
    ``state``). When it is not there or fails verification, it is not used, and one warning
    says so; the certification that the checkpoint's meta.json recorded at its save is then
    carried over when it was uncertified and the folder can be found."""
    entry = (state.stateful_callbacks or {}).get(name)
    if isinstance(entry, list):  # several callbacks of the class: the first with a state
        entry = next((e for e in entry if isinstance(e, dict) and "guard" in e), None)
    record = entry.get("guard") if isinstance(entry, dict) else None
    saved_in = record.get("saved_in") if isinstance(record, dict) else None
    saved_in = saved_in if isinstance(saved_in, str) else None
    label = f"checkpoint-{state.global_step}"
    if saved_in is not None:
        label += f", saved as {saved_in}"
    if record is None:
        why = ("its trainer_state.json holds no guard state (saved without GuardCallback, "
               "or by an older torchverity)")
    else:
        try:
            return decode_record(record, state.global_step), None
        except (FormatError, IntegrityError) as exc:
            why = ("the guard state in its trainer_state.json failed verification and is "
                   f"not used: {exc.message}")
    folder = _resumed_folder(args, state, saved_in)
    certification = certification_of(
        [p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES]) if folder else None
    found = (folder, certification) if folder and certification else None
    _warn_afresh(label, state.global_step, why, found)
    if found is not None and not found[1].get("certified"):
        return None, found[1]
    return None, None


def _resumed_folder(args: Any, state: Any, saved_in: str | None) -> Path | None:
    """The checkpoint folder training resumes from, where it can be told: the Trainer
    names it to no callback, so the candidates are the folders it would be (named in the
    arguments, the latest in ``output_dir``, where the record says it was saved), and the
    one whose trainer_state.json is the state resumed."""
    named = args.resume_from_checkpoint if isinstance(args.resume_from_checkpoint, str) else None
    for candidate in (named, str(Path(args.output_dir) / f"checkpoint-{state.global_step}"),
                      saved_in):
        if candidate is None:
            continue
        try:
            saved = json.loads((Path(candidate) / "trainer_state.json").read_text("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        if (isinstance(saved, dict) and saved.get("global_step") == state.global_step
                and saved.get("log_history") == state.log_history):
            return Path(candidate)
    return None


def _warn_afresh(label: str, step: int, why: str,
                 found: tuple[Path, dict[str, Any]] | None) -> None:
    log.warning(
        "torchverity: training resumed at global step %d from the checkpoint folder %s, "
        "but %s. The guard's rolling windows and counters start afresh, %s",
        step, label, why,
        afresh_consequence(found, f"{shell_path(found[0].parent)}/checkpoint-*" if found else ""))


def record_checkpoint_folder(folder: Path, step: int | None = None,
                             certification: dict[str, Any] | None = None
                             ) -> list[CheckpointRecord]:
    """Sidecars for the weight files, meta.json for safetensors (with the guard's
    certification), a manifest for the folder."""
    from torchverity.checkpoint._safetensors import read_header, read_tensors
    from torchverity.manifest import write_manifest

    records = []
    for path in sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES):
        # safetensors holds only tensors: reading it back runs no code.
        content = read_tensors(path, read_header(path)) if path.suffix == ".safetensors" else None
        records.append(record_checkpoint_file(path, content, source="hf",
                                              user={"global_step": step},
                                              certification=certification))
    write_manifest(folder)
    return records
