"""Real Lightning and Hugging Face trainers call ``optimizer.step()`` themselves; the callbacks
let the guard's update stand in for it, so the at-rest check rides in the update. The
updates stay bit-identical to the same optimizer stepped eagerly (on the CPU the guard's
update is the native one-pass kernel), a flip is caught at the next update and named,
and where the guard's update cannot stand in (a gradient scaler) the check takes two
passes and the log says why, once."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_data import Tokens

from torchverity import faults

pytest.importorskip("lightning")
pytest.importorskip("transformers")

FLIP_STEP = 12
FUSED = "fused into the update"


def _coverage(log: Path) -> list[dict[str, Any]]:
    """Every statement of coverage in the event log, the first event's included."""
    records = [json.loads(x) for x in log.read_text().splitlines()]
    return [r["coverage"] for r in records if "coverage" in r]


# ------------------------------------------------------------ Lightning

def _tiny() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.randn(160, 8), torch.randn(160, 1))


def _flip(net: torch.nn.Module) -> None:
    faults.flip_bit(net[2].weight, 5, 3)  # a low mantissa bit: no statistic moves


def _lightning(tmp_path: Path, plugins: list[Any] | None = None) -> tuple[Any, Any]:
    import lightning.pytorch as pl

    from torchverity.integrations.lightning import GuardCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _tiny()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Drill(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step == FLIP_STEP:  # after update 11, before 12
                _flip(module.net)

    torch.manual_seed(0)
    model = Tiny()
    data = _data()
    guard = GuardCallback(log=tmp_path / "events.jsonl", check_every=5, min_samples=8,
                          window=64, policies={"weights_changed": "record"})
    trainer = pl.Trainer(max_steps=30, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[Drill(), guard],
                         plugins=plugins, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return guard, model


def _reference_loop() -> torch.nn.Module:
    """What the Lightning run computes, as a plain loop."""
    torch.manual_seed(0)
    net = _tiny()
    data = _data()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    batches = [b for _ in range(2) for b in loader][:30]
    for i, (x, y) in enumerate(batches):
        if i == FLIP_STEP:
            _flip(net)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        sched.step()
    return net


def test_lightning_runs_the_fused_update_bit_identical_and_names_a_flip(tmp_path: Path) -> None:
    guard, model = _lightning(tmp_path)
    assert _coverage(tmp_path / "events.jsonl") == [{
        "windows": "every", "tensors": "parameters and optimizer state",
        "verification": FUSED, "update": "native", "arithmetic": "eager",
        "update_reason": None,
        "fallback_reason": None, "frozen_parameters": 0}]
    assert guard.fused_updates == 30  # every update was the guard's, none in two passes
    assert [(e.step, e.kind, e.suspects) for e in guard.guard.events] == [
        (FLIP_STEP, "weights_changed", ("net.2.weight",))]
    reference = _reference_loop()
    for ours, theirs in zip(model.net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    opt = guard.guard.optimizer
    assert "step" not in vars(opt) or not hasattr(vars(opt)["step"], "updates")  # put back


def test_lightning_with_a_gradient_scaler_verifies_in_two_passes_and_says_why_once(
        tmp_path: Path) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu")
    guard, _ = _lightning(tmp_path, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    said = _coverage(tmp_path / "events.jsonl")
    assert len(said) == 1 and said[0]["verification"] == "two passes"
    assert "gradient scaler" in said[0]["fallback_reason"]
    assert guard.fused_updates == 0
    assert [(e.step, e.suspects) for e in guard.guard.events if e.kind == "weights_changed"
            ] == [(FLIP_STEP, ("net.2.weight",))]


# ------------------------------------------------------------ Hugging Face


def _hf(tmp_path: Path, optim: str) -> Any:
    import transformers

    from torchverity.integrations.hf import GuardCallback

    class Drill(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                          **kw: Any) -> None:
            if state.global_step == FLIP_STEP:
                faults.flip_bit(model.transformer.h[0].mlp.c_fc.weight, 7, 3)

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                     n_positions=16)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=16, per_device_train_batch_size=8,
        learning_rate=1e-3, logging_strategy="no", save_strategy="no", report_to=[],
        disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0, optim=optim)
    guard = GuardCallback(log=tmp_path / "events.jsonl", check_every=5, min_samples=8,
                          window=32, policies={"weights_changed": "record"})
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                   train_dataset=Tokens(), callbacks=[Drill(), guard])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return guard


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_hf_trainer_runs_the_guards_update_with_either_adamw_and_names_a_flip(
        tmp_path: Path, optim: str) -> None:
    guard = _hf(tmp_path, optim)
    said = _coverage(tmp_path / "events.jsonl")
    assert len(said) == 1
    # The torch AdamW inside Accelerate's wrapper; with fused=True the native update
    # stands in for AdamW's own one-pass kernel.
    assert said[0]["verification"] == FUSED and guard.fused_updates == 16
    assert said[0]["update"] == "native"
    assert [(e.step, e.kind, e.suspects) for e in guard.guard.events] == [
        (FLIP_STEP, "weights_changed", ("transformer.h.0.mlp.c_fc.weight",))]
