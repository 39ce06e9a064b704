"""Both trainer callbacks with the settings most runs add: gradient accumulation and bf16
mixed precision (autocast on the CPU). A clean run raises nothing and certifies every
checkpoint; a flip at rest is reported at the next update, named, and no checkpoint saved
after it is certified."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_data import tiny_gpt2_trainer, tiny_regressor

from torchverity import faults

pytest.importorskip("lightning")
pytest.importorskip("transformers")

FLIP_STEP = 7
STEPS = 12  # checkpoints at updates 5 and 10 (and the last, 12, for Hugging Face)


def _certified(metas: list[Path]) -> dict[int, bool]:
    out = {}
    for meta in metas:
        record = json.loads(meta.read_text())["certification"]
        out[int(record["step"])] = bool(record["certified"])
    return out


def _hf(tmp_path: Path, flip: bool) -> tuple[list[Any], dict[int, bool]]:
    import transformers

    from torchverity.integrations.hf import GuardCallback

    class Drill(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                          **kw: Any) -> None:
            if flip and state.global_step == FLIP_STEP:
                faults.flip_bit(model.transformer.h[0].mlp.c_fc.weight, 7, 30)

    guard = GuardCallback(log=tmp_path / "events.jsonl", check_every=5, min_samples=8,
                          window=32, policies={"weights_changed": "record"})
    trainer = tiny_gpt2_trainer(tmp_path / "out", [Drill(), guard], steps=STEPS,
                                gradient_accumulation_steps=2, bf16=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    metas = list((tmp_path / "out").glob("checkpoint-*/model.safetensors.meta.json"))
    return guard.guard.events, _certified(metas)


def _lightning(tmp_path: Path, flip: bool) -> tuple[list[Any], dict[int, bool]]:
    import lightning.pytorch as pl

    from torchverity.integrations.lightning import GuardCallback

    class Drill(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            if flip and trainer.global_step == FLIP_STEP and not getattr(self, "done", False):
                self.done = True  # accumulation: this step starts with two batches
                faults.flip_bit(module.net[2].weight, 5, 30)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(320, 8), torch.randn(320, 1))
    guard = GuardCallback(log=tmp_path / "events.jsonl", check_every=5, min_samples=8,
                          window=64, policies={"weights_changed": "record"})
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5,
                                        save_top_k=-1)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Drill(), guard, ckpt], default_root_dir=tmp_path,
                         accumulate_grad_batches=2, precision="bf16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(tiny_regressor(), torch.utils.data.DataLoader(data, batch_size=8))
    return guard.guard.events, _certified(list((tmp_path / "ckpt").glob("*.ckpt.meta.json")))


RUNS = {"hf": (_hf, "transformer.h.0.mlp.c_fc.weight", [5, 10, 12]),
        "lightning": (_lightning, "net.2.weight", [5, 10])}


@pytest.mark.parametrize("trainer", sorted(RUNS))
def test_accumulated_bf16_runs_certify_clean_and_name_a_flip(tmp_path: Path,
                                                              trainer: str) -> None:
    run, name, saved = RUNS[trainer]
    events, certified = run(tmp_path / "clean", False)
    assert events == [] and certified == dict.fromkeys(saved, True)
    events, certified = run(tmp_path / "flip", True)
    changed = [(e.step, e.suspects) for e in events if e.kind == "weights_changed"]
    assert changed[0] == (FLIP_STEP, (name,))
    assert certified == {s: s < FLIP_STEP for s in saved}
