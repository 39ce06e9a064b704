"""Real Lightning and Hugging Face trainers with a bit flipped in a weight between two updates:
caught at the next update and named, rolled back to a certified checkpoint; checkpoints saved
while the flip is unresolved are marked uncertified and ``torchverity verify`` fails them; the
guard's state is restored when training resumes."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_data import tiny_gpt2_trainer, tiny_regressor

import torchverity
from torchverity import faults
from torchverity.cli import main as cli_main

pytest.importorskip("lightning")
pytest.importorskip("transformers")

FLIP_STEP = 12


def _meta(path: Path) -> dict[str, Any]:
    return json.loads(Path(f"{path}.meta.json").read_text())


def _cli(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli_main(list(argv))
    return code, out.getvalue()


# ------------------------------------------------------------ Lightning


def _lightning(tmp_path: Path, policy: str, steps: int = 30, flip: bool = True,
               resume: Path | None = None, flip_step: int = FLIP_STEP) -> tuple[Any, Any]:
    import lightning.pytorch as pl

    from torchverity.integrations.lightning import GuardCallback

    class Drill(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            if flip and trainer.global_step == flip_step:  # e.g. after update 11, before 12
                faults.flip_bit(module.net[2].weight, 5, 30)

    torch.manual_seed(0)
    model = tiny_regressor()
    data = torch.utils.data.TensorDataset(torch.randn(160, 8), torch.randn(160, 1))
    options: dict[str, Any] = {"policies": {"weights_changed": policy}}
    if policy == "rollback":
        options.update(checkpoint_dir=tmp_path / "guard", checkpoint_every=5)
    guard = GuardCallback(log=tmp_path / "events.jsonl", check_every=5, min_samples=8,
                          window=64, **options)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5,
                                        save_top_k=-1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Drill(), guard, ckpt], default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8),
                    ckpt_path=str(resume) if resume else None)
    return guard, model


def test_lightning_flip_is_caught_named_and_rolled_back_to_a_certified_checkpoint(
        tmp_path: Path) -> None:
    guard, model = _lightning(tmp_path, "rollback")
    # An exponent bit: the loss turns non-finite too (those updates are skipped); the
    # at-rest check names the tensor.
    assert [(e.step, e.kind, e.action, e.suspects) for e in guard.guard.events
            if e.kind == "weights_changed"] == [
        (FLIP_STEP, "weights_changed", "rolled_back", ("net.2.weight",))]
    assert {e.step for e in guard.guard.events} == {FLIP_STEP}
    records = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    rollback = next(r for r in records if r["event"] == "rollback")
    assert rollback["anomaly_step"] == FLIP_STEP and rollback["restored_step"] == 10
    saved_at = {r["path"]: r["certified"] for r in records if r["event"] == "checkpoint"}
    assert saved_at[rollback["checkpoint"]] is True  # rollback only goes to certified ones
    assert all(torch.isfinite(p).all() for p in model.parameters())
    saved = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(saved) == 6
    for path in saved:  # each holds weights the guard verified at rest when it was saved
        cert = _meta(path)["certification"]
        assert cert["certified"] and cert["verified"]["at_rest"] == "passed"
        assert cert["verified"]["tensors"] == 4 + 4 * 3  # parameters, AdamW state
        state = torch.load(path, weights_only=True)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values())
    assert _cli("verify", str(saved[-1]))[0] == 0


def test_lightning_checkpoints_saved_while_a_flip_is_unresolved_are_uncertified(
        tmp_path: Path) -> None:
    guard, _ = _lightning(tmp_path, "record")
    assert [(e.step, e.kind, e.suspects) for e in guard.guard.events
            if e.kind == "weights_changed"] == [(FLIP_STEP, "weights_changed", ("net.2.weight",))]
    saved = sorted((tmp_path / "ckpt").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    certified = [_meta(p)["certification"]["certified"] for p in saved]
    assert certified == [True, True, False, False, False, False]  # steps 5, 10 | 15 ... 30
    unresolved = _meta(saved[2])["certification"]["unresolved"]
    assert unresolved == [{"step": FLIP_STEP, "kind": "weights_changed",
                           "suspects": ["net.2.weight"]}]
    code, out = _cli("verify", str(saved[2]))
    assert code == 1 and "UNCERTIFIED" in out and "net.2.weight" in out
    code, out = _cli("inspect", str(saved[2]))
    assert "guard       UNCERTIFIED (saved while the guard had doubts: unresolved " \
        f"weights_changed at step {FLIP_STEP} in net.2.weight)" in out
    assert "certified by the training guard at step 5" in _cli("verify", str(saved[0]))[1]


def test_lightning_guard_state_is_saved_and_restored_on_resume(tmp_path: Path) -> None:
    first, _ = _lightning(tmp_path, "record", steps=20, flip=False)
    stats = first.guard._host.stats
    assert stats.count == 20
    last = sorted((tmp_path / "ckpt").glob("*step=20*.ckpt"))[0]
    assert torch.load(last, weights_only=True)["callbacks"]
    resumed, _ = _lightning(tmp_path, "record", steps=30, flip=False, resume=last)
    # 20 accepted steps came back with the checkpoint, 10 more were added.
    assert resumed.guard._host.stats.count == 30
    assert resumed.summary.steps == 30 and resumed.guard.events == []


def test_lightning_a_flip_before_the_first_update_after_a_resume_is_caught(
        tmp_path: Path) -> None:
    """The window from the save of step 20 to the first update after the resume is a window
    between two updates too: a flip in it is caught and named, and what is saved after it
    is uncertified."""
    _lightning(tmp_path, "record", steps=20, flip=False)
    last = sorted((tmp_path / "ckpt").glob("*step=20*.ckpt"))[0]
    resumed, _ = _lightning(tmp_path, "record", steps=30, resume=last, flip_step=20)
    assert [(e.step, e.suspects) for e in resumed.guard.events
            if e.kind == "weights_changed"] == [(20, ("net.2.weight",))]
    later = [p for p in (tmp_path / "ckpt").glob("*.ckpt") if "step=25" in p.name
             or "step=30" in p.name]
    assert len(later) == 2 and not any(_meta(p)["certification"]["certified"] for p in later)


def test_lightning_resume_from_a_checkpoint_damaged_on_disk_stops_before_training(
        tmp_path: Path) -> None:
    _lightning(tmp_path, "record", steps=20, flip=False)
    last = sorted((tmp_path / "ckpt").glob("*step=20*.ckpt"))[0]
    checkpoint = torch.load(last, weights_only=True)
    faults.flip_bit(checkpoint["state_dict"]["net.0.weight"], 3, 12)
    torch.save(checkpoint, last)  # its sidecar and meta.json are the save's
    with pytest.raises(torchverity.IntegrityError) as caught:
        _lightning(tmp_path / "resumed", "record", steps=30, flip=False, resume=last)
    assert "training resumed from a checkpoint whose files do not match" in str(
        caught.value) and "state_dict.net.0.weight" in str(caught.value)
    assert not (tmp_path / "resumed" / "ckpt").exists()  # nothing saved from those weights


def _without_guard_state(path: Path) -> Path:
    """The checkpoint as a run without the callback (or an older torchverity) saves it."""
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint.pop("callbacks")
    stripped = path.with_name(f"stripped-{path.name}")
    torch.save(checkpoint, stripped)
    Path(f"{path}.meta.json").replace(Path(f"{stripped}.meta.json"))
    return stripped


@pytest.mark.parametrize("flip", [True, False])
def test_lightning_resume_without_guard_state_keeps_the_checkpoints_verdict(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, flip: bool) -> None:
    """Resumed from a checkpoint without the guard's state: an uncertified one (a flip at
    step 12 left standing) stays so for everything saved from its weights; a certified one
    raises nothing and certifies again."""
    first = tmp_path / "first"
    _lightning(first, "record", steps=20, flip=flip)
    stripped = _without_guard_state(sorted((first / "ckpt").glob("*step=20*.ckpt"))[0])
    caplog.clear()
    resumed, _ = _lightning(tmp_path / "resumed", "record", steps=30, flip=False,
                            resume=stripped)
    [said] = [r.getMessage() for r in caplog.records if r.name.startswith("torchverity")]
    assert "holds no guard state" in said and "start afresh" in said
    # The flip is carried over, not raised again (the exponent flip keeps the loss
    # non-finite, so those updates are still skipped).
    assert [e for e in resumed.guard.events if e.kind == "weights_changed"] == []
    assert flip or resumed.guard.events == []
    saved = sorted((tmp_path / "resumed" / "ckpt").glob("*.ckpt"),
                   key=lambda p: p.stat().st_mtime)
    certs = [_meta(p)["certification"] for p in saved if "step=2" in p.name or "step=3" in p.name]
    assert len(certs) == 2  # steps 25 and 30
    if flip:
        assert "saved uncertified" in said and f"{first / 'ckpt'}/*.ckpt" in said
        for cert in certs:
            assert not cert["certified"] and cert["verified"]["at_rest"] == "passed"
            assert cert["unresolved"] == [{"step": FLIP_STEP, "kind": "weights_changed",
                                           "suspects": ["net.2.weight"]}]
    else:
        assert "was certified when it was saved" in said
        assert all(cert["certified"] for cert in certs)


# ------------------------------------------------------------ Hugging Face


def _hf(tmp_path: Path, policy: str, *, steps: int = 20, flip: tuple[int, int] = (FLIP_STEP, 30),
        optim: str = "adamw_torch_fused", resume: Path | None = None,
        log: str = "events.jsonl") -> Any:
    """A run of the tiny GPT-2; ``flip`` = (step, bit) flipped before that step's forward."""
    import transformers

    from torchverity.integrations.hf import GuardCallback

    class Drill(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                          **kw: Any) -> None:
            if state.global_step == flip[0]:
                faults.flip_bit(model.transformer.h[0].mlp.c_fc.weight, 7, flip[1])

    options: dict[str, Any] = {"policies": {"weights_changed": policy}}
    if policy == "rollback":
        options.update(checkpoint_dir=tmp_path / "guard", checkpoint_every=5)
    guard = GuardCallback(log=tmp_path / log, check_every=5, min_samples=8, window=32,
                          **options)
    trainer = tiny_gpt2_trainer(tmp_path / "out", [Drill(), guard], steps=steps, optim=optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return guard


@pytest.mark.parametrize("policy", ["rollback", "record"])
def test_hf_flip_is_caught_named_and_only_clean_checkpoints_are_certified(
        tmp_path: Path, policy: str) -> None:
    guard = _hf(tmp_path, policy)
    name = "transformer.h.0.mlp.c_fc.weight"
    first = next(e for e in guard.guard.events if e.kind == "weights_changed")
    action = "rolled_back" if policy == "rollback" else "recorded"
    assert (first.step, first.kind, first.action, first.suspects) == (
        FLIP_STEP, "weights_changed", action, (name,))
    folders = sorted((tmp_path / "out").glob("checkpoint-*"), key=lambda f: int(f.name[11:]))
    assert [f.name for f in folders] == [f"checkpoint-{s}" for s in (5, 10, 15, 20)]
    certified = [_meta(f / "model.safetensors")["certification"]["certified"] for f in folders]
    if policy == "rollback":
        assert certified == [True] * 4  # the flip never reached a saved checkpoint
        records = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        restored = next(r for r in records if r["event"] == "rollback")
        saved_at = {r["path"]: r["certified"] for r in records if r["event"] == "checkpoint"}
        assert restored["anomaly_step"] == FLIP_STEP and saved_at[restored["checkpoint"]]
    else:
        assert certified == [True, True, False, False]
        code, out = _cli("verify", str(folders[2]))
        assert code == 1 and "UNCERTIFIED" in out and name in out
    entry = json.loads((folders[-1] / "trainer_state.json").read_text())["stateful_callbacks"]
    assert entry["GuardCallback"]["guard"]["global_step"] == 20
    assert _cli("verify", str(folders[0]))[0] == 0


def _certified(folder: Path) -> bool:
    return bool(_meta(folder / "model.safetensors")["certification"]["certified"])


def test_hf_resume_from_a_checkpoint_damaged_on_disk_stops_before_training(
        tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _hf(tmp_path, "record", steps=10, flip=(-1, 0))
    weights = tmp_path / "out" / "checkpoint-10" / "model.safetensors"
    tensors = load_file(weights)
    faults.flip_bit(tensors["transformer.h.0.mlp.c_fc.weight"], 5, 12)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(torchverity.IntegrityError) as caught:
        _hf(tmp_path, "record", steps=20, flip=(-1, 0), resume=weights.parent,
            log="resumed.jsonl")
    assert "model.safetensors mismatched" in str(caught.value)
    assert "transformer.h.0.mlp.c_fc.weight" in str(caught.value)
    assert not (tmp_path / "out" / "checkpoint-15").exists()


def test_hf_a_flip_before_the_first_update_after_a_resume_is_caught(tmp_path: Path) -> None:
    name = "transformer.h.0.mlp.c_fc.weight"
    _hf(tmp_path, "record", steps=10, flip=(-1, 0))
    out = tmp_path / "out"
    resumed = _hf(tmp_path, "record", steps=20, flip=(10, 3), resume=out / "checkpoint-10",
                  log="resumed.jsonl")
    assert [(e.step, e.kind, e.suspects) for e in resumed.guard.events] == [
        (10, "weights_changed", (name,))]
    assert [_certified(out / f"checkpoint-{s}") for s in (15, 20)] == [False, False]


def test_hf_resume_restores_the_guard_state_and_keeps_catching_flips(tmp_path: Path) -> None:
    """A run with a flip at step 12 (checkpoints 5, 10 certified; 15, 20 not), resumed from
    checkpoint-15 with the fused update: the rolling windows, counters and the unresolved
    flip come back; no false alarm; a flip at step 22 is caught and named; every checkpoint
    saved after it stays uncertified. Resumed from the certified checkpoint-10 instead, the
    next checkpoint is certified again."""
    name = "transformer.h.0.mlp.c_fc.weight"
    low_bit = (FLIP_STEP, 3)  # a mantissa bit: only the at-rest check sees it
    first = _hf(tmp_path, "record", flip=low_bit, optim="adamw_torch")
    out = tmp_path / "out"
    assert [_certified(out / f"checkpoint-{s}") for s in (5, 10, 15, 20)] == [
        True, True, False, False]
    accepted = first.guard._host.stats.count  # the flagged update was not pushed
    assert accepted == 19

    resumed = _hf(tmp_path, "record", steps=30, flip=(22, 3), optim="adamw_torch",
                  resume=out / "checkpoint-15", log="resumed.jsonl")
    assert resumed.fused_updates == 15
    assert [(e.step, e.kind, e.suspects) for e in resumed.guard.events] == [
        (22, "weights_changed", (name,))]
    assert resumed.guard._host.stats.count == min(14 + 14, 32)  # 14 restored, 14 accepted
    assert resumed.summary.anomalies == {"weights_changed": 2}  # step 12's came back too
    assert [_certified(out / f"checkpoint-{s}") for s in (20, 25, 30)] == [False] * 3
    unresolved = _meta(out / "checkpoint-30" / "model.safetensors")["certification"][
        "unresolved"]
    assert [(u["step"], u["suspects"]) for u in unresolved] == [(12, [name]), (22, [name])]
    code, out_text = _cli("verify", str(out / "checkpoint-25"))
    assert code == 1 and "UNCERTIFIED" in out_text

    clean = _hf(tmp_path, "record", steps=15, flip=(-1, 0), optim="adamw_torch",
                resume=out / "checkpoint-10", log="clean.jsonl")
    assert clean.guard.events == [] and clean.guard._host.stats.count == 15
    assert _certified(out / "checkpoint-15")
    assert _cli("verify", str(out / "checkpoint-15"))[0] == 0
