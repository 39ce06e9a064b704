"""A real Hugging Face Trainer resumed every way its users resume: the guard's rolling
windows, counters and unresolved anomalies come back from the checkpoint folder itself,
wherever that folder now is (copied outside ``output_dir``, the latest in ``output_dir``,
named in ``TrainingArguments``, the callback rebuilt by the Trainer); a clean resume raises
nothing; a folder whose guard state is missing or edited is named in one warning and its
state is not used."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_data import tiny_gpt2_trainer

from torchverity import faults

transformers = pytest.importorskip("transformers")
from torchverity.integrations.hf import GuardCallback  # noqa: E402

NAME = "transformer.h.0.mlp.c_fc.weight"
FLIP_STEP = 12  # a mantissa bit flipped before this step's forward: only the at-rest check sees it
OPTIONS: dict[str, Any] = {"check_every": 5, "min_samples": 8, "window": 32,
                           "policies": {"weights_changed": "record"}}


class Probe(transformers.TrainerCallback):  # type: ignore[misc]
    """Flips a bit before ``flip_step``; reads the guard's state before the run's first step
    (what was restored) and at every save, before the guard records that checkpoint (as the
    Trainer took it for trainer_state.json). The guard is looked up in the Trainer, which may
    have rebuilt it."""

    def __init__(self, flip_step: int | None) -> None:
        self.trainer: Any = None
        self.flip_step = flip_step
        self.begin: dict[str, Any] | None = None
        self.saved: dict[int, dict[str, Any]] = {}

    def guard(self) -> GuardCallback:
        return next(cb for cb in self.trainer.callback_handler.callbacks
                    if isinstance(cb, GuardCallback))

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                      **kw: Any) -> None:
        if self.begin is None:
            self.begin = self.guard().guard.state_dict()
        if state.global_step == self.flip_step:
            faults.flip_bit(model.transformer.h[0].mlp.c_fc.weight, 7, 3)

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.saved[state.global_step] = self.guard().guard.state_dict()


@dataclass
class Run:
    out: Path
    probe: Probe
    warnings: list[str] = field(default_factory=list)

    @property
    def guard(self) -> GuardCallback:
        return self.probe.guard()


def _train(out: Path, log: Path, *, steps: int, flip_step: int | None = None,
           resume: str | bool | None = None, caplog: Any = None, **arguments: Any) -> Run:
    probe = Probe(flip_step)
    probe.trainer = tiny_gpt2_trainer(out, [probe, GuardCallback(log=log, **OPTIONS)],
                                      steps=steps, **arguments)
    if caplog is not None:
        caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe.trainer.train(resume_from_checkpoint=resume)
    said = [] if caplog is None else [r.getMessage() for r in caplog.records
                                      if r.name.startswith("torchverity")]
    return Run(out, probe, said)


@pytest.fixture(scope="module")
def flipped(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """20 steps, a flip at step 12 left standing: checkpoints 5, 10 certified, 15, 20 not."""
    root = tmp_path_factory.mktemp("flipped")
    run = _train(root / "out", root / "events.jsonl", steps=20, flip_step=FLIP_STEP)
    assert [(e.step, e.kind, e.suspects) for e in run.guard.guard.events] == [
        (FLIP_STEP, "weights_changed", (NAME,))]
    assert [_certified(run.out / f"checkpoint-{s}") for s in (5, 10, 15, 20)] == [
        True, True, False, False]
    return run


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """15 clean steps: checkpoints 5, 10, 15, all certified."""
    root = tmp_path_factory.mktemp("clean")
    return _train(root / "out", root / "events.jsonl", steps=15)


def _certification(folder: Path) -> dict[str, Any]:
    meta = json.loads((folder / "model.safetensors.meta.json").read_text())
    return dict(meta["certification"])


def _certified(folder: Path) -> bool:
    return bool(_certification(folder)["certified"])


def _copy(folder: Path, to: Path) -> Path:
    """The checkpoint folder copied elsewhere, as one moved to another machine."""
    return Path(shutil.copytree(folder, to / "elsewhere" / folder.name))


def _assert_same(restored: Any, saved: Any, where: str = "state") -> None:
    """Equal to the bit: tensors by dtype, shape and bytes; floats NaN-aware."""
    if isinstance(saved, torch.Tensor):
        assert isinstance(restored, torch.Tensor), where
        assert (restored.dtype, restored.shape) == (saved.dtype, saved.shape), where
        assert restored.numpy().tobytes() == saved.numpy().tobytes(), where
    elif isinstance(saved, dict):
        assert isinstance(restored, dict) and restored.keys() == saved.keys(), where
        for key in saved:
            _assert_same(restored[key], saved[key], f"{where}.{key}")
    elif isinstance(saved, list):
        assert isinstance(restored, list) and len(restored) == len(saved), where
        for i, (r, s) in enumerate(zip(restored, saved, strict=True)):
            _assert_same(r, s, f"{where}.{i}")
    elif isinstance(saved, float) and saved != saved:
        assert restored != restored, where
    else:
        assert restored == saved, where


def test_resume_from_a_folder_copied_outside_output_dir_restores_the_guard_state(
        flipped: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = flipped.probe.saved[15]
    assert saved["unresolved"][0]["step"] == FLIP_STEP and int(saved["stats"]["count"]) == 14
    copy = _copy(flipped.out / "checkpoint-15", tmp_path)
    resumed = _train(tmp_path / "other-out", tmp_path / "resumed.jsonl", steps=25,
                     resume=str(copy), caplog=caplog)
    assert resumed.probe.begin is not None
    _assert_same(resumed.probe.begin, saved)  # windows, rule state, counters, unresolved
    assert resumed.warnings == []
    assert resumed.guard.guard.events == []  # no false alarm
    assert resumed.guard.summary is not None
    assert resumed.guard.summary.anomalies == {"weights_changed": 1}  # step 12's came back
    for step in (20, 25):  # the flip is still unresolved: nothing saved after it is certified
        cert = _certification(tmp_path / "other-out" / f"checkpoint-{step}")
        assert not cert["certified"] and cert["verified"]["at_rest"] == "passed"
        assert [(u["step"], u["suspects"]) for u in cert["unresolved"]] == [(FLIP_STEP, [NAME])]


@pytest.mark.parametrize("way", ["latest", "arguments", "rebuilt"])
def test_a_clean_resume_restores_the_state_and_raises_nothing(
        clean: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture, way: str) -> None:
    """``train(resume_from_checkpoint=True)`` in a copy of the run's output_dir; a folder
    outside it named in ``TrainingArguments.resume_from_checkpoint`` and passed on, as the
    example scripts do; and the callback rebuilt by the Trainer from the checkpoint
    (``restore_callback_states_from_checkpoint=True``)."""
    arguments: dict[str, Any] = {}
    out = tmp_path / "out"
    if way == "latest":
        shutil.copytree(clean.out, out)
        resume: str | bool = True
        step = 15
    else:
        step = 10
        resume = str(_copy(clean.out / "checkpoint-10", tmp_path))
        arguments = ({"resume_from_checkpoint": resume} if way == "arguments" else
                     {"restore_callback_states_from_checkpoint": True})
    log = tmp_path / "resumed.jsonl"
    resumed = _train(out, log, steps=25, resume=resume, caplog=caplog, **arguments)
    assert resumed.probe.begin is not None
    _assert_same(resumed.probe.begin, clean.probe.saved[step])
    assert resumed.warnings == [] and resumed.guard.guard.events == []
    assert resumed.guard.summary is not None and resumed.guard.summary.anomalies == {}
    assert all(_certified(out / f"checkpoint-{s}") for s in range(step + 5, 30, 5))
    if way == "rebuilt":  # the Trainer's own, built from the options saved with the run
        assert resumed.guard.log_path == str(clean.out.parent / "events.jsonl")
        assert resumed.guard.guard_options == OPTIONS


def _edit_guard_entry(folder: Path, how: str) -> None:
    path = folder / "trainer_state.json"
    state = json.loads(path.read_text())
    if how == "missing":  # as saved by a run without the callback
        state["stateful_callbacks"].pop("GuardCallback", None)
    else:  # the unresolved flip hidden, the digest left as it was
        state["stateful_callbacks"]["GuardCallback"]["guard"]["state"]["unresolved"] = []
    path.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("how", ["tampered", "missing"])
def test_a_missing_or_tampered_guard_state_is_reported_once_and_not_used(
        flipped: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str) -> None:
    copy = _copy(flipped.out / "checkpoint-15", tmp_path)
    _edit_guard_entry(copy, how)
    resumed = _train(tmp_path / "other-out", tmp_path / "resumed.jsonl", steps=20,
                     resume=str(copy), caplog=caplog)
    [said] = resumed.warnings
    assert "checkpoint-15" in said and "torchverity verify" in said
    assert "start afresh" in said
    begin = resumed.probe.begin
    assert begin is not None  # nothing of the edited record was taken
    assert int(begin["stats"]["count"]) == 0 and begin["tally"]["anomalies"] == {}
    cert = _certification(tmp_path / "other-out" / "checkpoint-20")
    if how == "tampered":
        assert "failed verification" in said and "SHA-256" in said
        assert str(flipped.out / "checkpoint-15") in said  # where it was saved
        # Found where the record says it was saved (the same trainer_state.json): its
        # meta.json's certification is carried over, the hidden flip with it.
        assert "saved uncertified" in said and "carried over" in said
        assert not cert["certified"] and cert["verified"]["at_rest"] == "passed"
        assert [(u["step"], u["suspects"]) for u in cert["unresolved"]] == [(FLIP_STEP, [NAME])]
    else:  # copied elsewhere and named to train() only: no callback can tell where it is
        assert "holds no guard state" in said and "certified on what this run sees" in said
        assert cert["certified"]


def _strip_guard_entries(out: Path) -> None:
    for folder in out.glob("checkpoint-*"):
        _edit_guard_entry(folder, "missing")


def test_a_resume_without_guard_state_carries_the_folders_uncertified_verdict(
        flipped: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Resumed from the latest folder of output_dir (``resume_from_checkpoint=True``),
    saved without the guard's state: the folder's meta.json said uncertified, so nothing
    saved from those weights is certified."""
    out = Path(shutil.copytree(flipped.out, tmp_path / "out"))
    _strip_guard_entries(out)
    resumed = _train(out, tmp_path / "resumed.jsonl", steps=25, resume=True, caplog=caplog)
    [said] = resumed.warnings
    assert "holds no guard state" in said and "saved uncertified" in said
    assert f"torchverity verify {out}/checkpoint-*" in said
    assert resumed.guard.guard.events == []  # carried, not raised again
    cert = _certification(out / "checkpoint-25")
    assert not cert["certified"] and cert["verified"]["at_rest"] == "passed"
    assert [(u["step"], u["kind"], u["suspects"]) for u in cert["unresolved"]] == [
        (FLIP_STEP, "weights_changed", [NAME])]


def test_a_resume_without_guard_state_from_a_certified_folder_certifies_again(
        clean: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = Path(shutil.copytree(clean.out, tmp_path / "out"))
    _strip_guard_entries(out)
    resumed = _train(out, tmp_path / "resumed.jsonl", steps=25, resume=True, caplog=caplog)
    [said] = resumed.warnings
    assert "was certified when it was saved" in said
    assert f"torchverity verify {out / 'checkpoint-15'}" in said
    assert resumed.guard.guard.events == []
    assert all(_certified(out / f"checkpoint-{s}") for s in (20, 25))
