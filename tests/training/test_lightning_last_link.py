"""Lightning's ``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a link to the
latest checkpoint. ``torchverity verify last.ckpt`` and ``torchverity.load`` take that
checkpoint's sidecar and certification, so the path a user resumes from verifies, and a
flipped byte in the checkpoint it names is found through it."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_data import tiny_regressor

import torchverity
from torchverity.inject import flip_bit

pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import lightning.pytorch as pl

    from torchverity.integrations.lightning import GuardCallback

    root = tmp_path_factory.mktemp("lightning")
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(160, 8), torch.randn(160, 1))
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=5,
                                        save_top_k=2, monitor="step", mode="max",
                                        save_last="link")
    trainer = pl.Trainer(max_steps=20, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[GuardCallback(log=root / "events.jsonl"), ckpt],
                         default_root_dir=root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(tiny_regressor(), torch.utils.data.DataLoader(data, batch_size=8))
    last = root / "ckpt" / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=0-step=20.ckpt"
    return root / "ckpt"


def test_verify_and_load_of_last_take_the_linked_checkpoints_records(
        run: Path, run_cli: Callable[..., Any]) -> None:
    done = run_cli("verify", str(run / "last.ckpt"), "--json")
    assert done.code == 0, done.out + done.err
    result = json.loads(done.out)["results"][0]
    assert result["target"] == str(run / "epoch=0-step=20.ckpt")
    assert result["certification"]["certified"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verified: no warning of unverified bytes
        state: Any = torchverity.load(run / "last.ckpt")
    assert state["global_step"] == 20


def test_a_flip_in_the_linked_checkpoint_is_found_through_last(run: Path,
                                                                tmp_path: Path,
        run_cli: Callable[..., Any]) -> None:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in run.iterdir():
        if f.is_symlink():
            os.symlink(os.readlink(f), copy / f.name)
        else:
            (copy / f.name).write_bytes(f.read_bytes())
    flip_bit(copy / "epoch=0-step=20.ckpt", 300, 2)
    done = run_cli("verify", str(copy / "last.ckpt"), "--json")
    assert done.code == 1
    assert json.loads(done.out)["results"][0]["entries"][0]["status"] == "mismatched"
    with pytest.raises(torchverity.IntegrityError):
        torchverity.load(copy / "last.ckpt")
