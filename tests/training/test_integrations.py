"""Lightning and Hugging Face callbacks on real (tiny) trainers: faults caught and named, clean
runs silent, every saved checkpoint verifiable."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_data import Tokens, tiny_regressor

import torchverity
from torchverity import faults

pytest.importorskip("lightning")
pytest.importorskip("transformers")


# ------------------------------------------------------------ Lightning


def _lightning_run(tmp_path: Path, fault_step: int | None) -> tuple[Any, Any, Path]:
    import lightning.pytorch as pl

    from torchverity.integrations.lightning import GuardCallback

    class Drill(pl.Callback):
        def __init__(self, injector: faults.FaultInjector) -> None:
            self.injector = injector

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.injector.begin_step(trainer.global_step)

    torch.manual_seed(0)
    model = tiny_regressor(torch.optim.Adam)
    injector = faults.FaultInjector(model)
    if fault_step is not None:
        injector.gradient("net.2.weight", step=fault_step, index=3, value=math.nan)
    data = torch.utils.data.TensorDataset(torch.randn(160, 8), torch.randn(160, 1))
    log = tmp_path / "events.jsonl"
    guard = GuardCallback(log=log, check_every=5, min_samples=8, window=32)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10,
                                        save_top_k=-1)
    trainer = pl.Trainer(max_steps=30, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Drill(injector), guard, ckpt],
                         default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return guard, model, log


def test_lightning_callback_catches_a_nan_gradient_and_names_it(tmp_path: Path) -> None:
    guard, model, log = _lightning_run(tmp_path, fault_step=12)
    assert [(e.step, e.kind, e.action, e.suspects) for e in guard.guard.events] == [
        (12, "nonfinite_grad", "skipped", ("net.2.weight",))
    ]
    assert guard.summary.steps == 30 and guard.summary.skipped == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert records[-1]["event"] == "summary"


def test_lightning_clean_run_is_silent_and_checkpoints_are_verifiable(tmp_path: Path,
                                                                      run_cli: Any) -> None:
    guard, _, log = _lightning_run(tmp_path, fault_step=None)
    assert guard.guard.events == [] and guard.summary.clean
    saved = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(saved) == 3 and len(guard.checkpoints) == 3
    _assert_reported(run_cli, log, saved, [10, 20, 30], code=0)
    for path in saved:
        assert torchverity.verify_file(path).ok
        meta = json.loads(Path(f"{path}.meta.json").read_text())
        assert meta["user"]["source"] == "lightning"
        trusted = torchverity.digest_file(path, "sha256").hexdigest
        obj = torchverity.load(path, sidecar="require", trust_sha256=trusted)
        assert "state_dict" in obj  # digest and fingerprint both checked by load
    # The smallest corruption of a saved checkpoint is now caught.
    from torchverity.inject import flip_bit

    flip_bit(saved[0], offset=saved[0].stat().st_size // 2, bit=0)
    assert not torchverity.verify_file(saved[0]).ok


# ------------------------------------------------------------ Hugging Face


def _hf_run(tmp_path: Path, fault_step: int | None) -> Any:
    import transformers

    from torchverity.integrations.hf import GuardCallback

    class Drill(transformers.TrainerCallback):  # type: ignore[misc]
        def __init__(self, injector: faults.FaultInjector) -> None:
            self.injector = injector

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.injector.begin_step(state.global_step)

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    injector = faults.FaultInjector(model)
    if fault_step is not None:
        injector.gradient("transformer.h.0.mlp.c_fc.weight", step=fault_step, index=5,
                          value=math.inf)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=20, per_device_train_batch_size=8,
        learning_rate=1e-3, logging_strategy="no", save_strategy="steps", save_steps=10,
        report_to=[], disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0,
    )
    guard = GuardCallback(log=tmp_path / "events.jsonl", check_every=5, min_samples=8,
                          window=32)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(96),
                                   callbacks=[Drill(injector), guard])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return guard


def test_hf_callback_catches_an_inf_gradient_and_records_checkpoints(tmp_path: Path,
                                                                     run_cli: Any) -> None:
    guard = _hf_run(tmp_path, fault_step=7)
    events = [(e.step, e.kind, e.suspects[:1]) for e in guard.guard.events]
    assert events == [(7, "nonfinite_grad", ("transformer.h.0.mlp.c_fc.weight",))]
    assert guard.summary.skipped == 1 and guard.summary.steps == 20
    folders = sorted((tmp_path / "out").glob("checkpoint-*"))
    assert [f.name for f in folders] == ["checkpoint-10", "checkpoint-20"]
    for folder in folders:
        model_file = folder / "model.safetensors"
        assert torchverity.verify_file(model_file).ok
        _, report = torchverity.load(model_file, sidecar="require", with_report=True)
        assert report.fingerprint_verified
        assert torchverity.verify_path(folder).ok  # the manifest covers the whole folder
    assert len(guard.checkpoints) >= 2
    _assert_reported(run_cli, tmp_path / "events.jsonl",
                     [f / "model.safetensors" for f in folders], [10, 20], code=1)


def _assert_reported(run_cli: Any, log: Path, files: list[Path], steps: list[int], *,
                     code: int) -> None:
    """The checkpoints the trainer saved are in the guard's log, its summary and the report
    (which exits 1 when the run had an anomaly)."""
    from torchverity.report import summarize

    records = [json.loads(x) for x in log.read_text().splitlines()]
    events = [r for r in records if r["event"] == "checkpoint"]
    assert sorted(e["path"] for e in events) == sorted(map(str, files))
    assert [e["step"] for e in events] == steps
    assert all(e["fingerprint"] and e["certified"] and len(e["digest"]) == 64 for e in events)
    assert records[-1]["event"] == "summary" and records[-1]["checkpoints"] == len(files)
    assert summarize(log).checkpoints == len(files)
    res = run_cli("report", log)
    assert res.code == code and f"checkpoints {len(files)}" in res.out


def test_hf_clean_run_is_silent(tmp_path: Path) -> None:
    guard = _hf_run(tmp_path, fault_step=None)
    assert guard.guard.events == [] and guard.summary.clean


# ------------------------------------------------------------ base install


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("torchverity.integrations.lightning", "lightning.pytorch", "lightning"),
        ("torchverity.integrations.hf", "transformers", "hf"),
    ],
)
def test_missing_extra_names_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, module: str, blocked: str, extra: str
) -> None:
    import importlib
    import sys

    from torchverity.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, blocked, None)  # as if not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(MissingExtraError) as info:
        importlib.import_module(module)
    assert info.value.hint == f"pip install 'torchverity[{extra}]'"


@pytest.mark.parametrize(("module", "framework"), [
    ("torchverity.integrations.lightning", "Lightning"),
    ("torchverity.integrations.hf", "Hugging Face"),
])
def test_callbacks_refuse_a_step_fn_with_the_same_message(module: str, framework: str) -> None:
    import importlib

    from torchverity.errors import UsageError

    callback = importlib.import_module(module).GuardCallback
    assert callback(log=None).checkpoints == []
    with pytest.raises(UsageError) as info:
        callback(step_fn=lambda batch: batch)
    assert str(info.value) == (
        f"the {framework} callback does not replay steps\n"
        "  next: use TrainingGuard in a plain loop for replay audits"
    )
