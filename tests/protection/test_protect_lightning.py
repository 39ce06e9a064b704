"""A real Lightning Trainer resuming from a checkpoint damaged on disk."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning")
omegaconf = pytest.importorskip("omegaconf")

import torch  # noqa: E402
from protect_helpers import flip_tensor_bit  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import torchverity  # noqa: E402
from torchverity.errors import IntegrityError  # noqa: E402
from torchverity.protection import protected  # noqa: E402
from torchverity.verify import verify_file  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)  # omegaconf hyper-parameters, as real projects keep them
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _trainer(root: Path, epochs: int) -> Any:
    return L.Trainer(default_root_dir=root, max_epochs=epochs, logger=False, accelerator="cpu",
                     enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A checkpoint folder written by Trainer.fit and recorded with ``torchverity manifest``."""
    logging.getLogger("lightning").setLevel(logging.ERROR)
    root = tmp_path_factory.mktemp("lightning")
    torch.manual_seed(0)
    _trainer(root, 1).fit(Regressor(omegaconf.OmegaConf.create({"lr": 0.1})), _data())
    [ckpt] = (root / "checkpoints").glob("*.ckpt")
    torchverity.write_manifest(ckpt.parent)
    return root, ckpt


def _resume(root: Path, ckpt: Path, policy: str, log: Path) -> None:
    model = Regressor(omegaconf.OmegaConf.create({"lr": 0.1}))
    with protected(policy, log=log):  # type: ignore[arg-type]
        # The checkpoint holds omegaconf objects: Lightning loads it as a full pickle.
        _trainer(root, 2).fit(model, _data(), ckpt_path=ckpt, weights_only=False)


def _kinds(log: Path) -> list[str]:
    return [json.loads(x)["kind"] for x in log.read_text().splitlines()]


def test_a_clean_resume_is_verified_against_the_manifest(
        trained: tuple[Path, Path], tmp_path: Path) -> None:
    _root, ckpt = trained
    copy_root = tmp_path / "run"
    (copy_root / "checkpoints").mkdir(parents=True)
    for f in ckpt.parent.iterdir():
        (copy_root / "checkpoints" / f.name).write_bytes(f.read_bytes())
    log = tmp_path / "log.jsonl"
    _resume(copy_root, copy_root / "checkpoints" / ckpt.name, "refuse", log)
    kinds = _kinds(log)
    assert "verified" in kinds and "unsafe-load" in kinds  # weights_only=False is named
    assert not {"mismatch", "refused", "swallowed"} & set(kinds)


def test_a_damaged_checkpoint_is_refused_under_refuse_and_reported_under_warn(
        trained: tuple[Path, Path], tmp_path: Path) -> None:
    root, ckpt = trained
    flip_tensor_bit(ckpt, bit=2)
    log = tmp_path / "refuse.jsonl"
    with pytest.raises(IntegrityError, match=r"does not match .*torchverity\.manifest\.json"):
        _resume(root, ckpt, "refuse", log)
    [refused] = [json.loads(x) for x in log.read_text().splitlines()
                 if json.loads(x)["kind"] == "refused"]
    assert refused["path"] == str(ckpt)
    assert "lightning/fabric/utilities/cloud_io.py" in refused["where"]

    log = tmp_path / "warn.jsonl"
    _resume(root, ckpt, "warn", log)  # the run goes on ...
    assert "mismatch" in _kinds(log)  # ... and says what it loaded


def test_checkpoints_saved_under_the_switch_get_records_and_a_damaged_one_is_refused(
        tmp_path: Path) -> None:
    logging.getLogger("lightning").setLevel(logging.ERROR)
    log = tmp_path / "save.jsonl"
    torch.manual_seed(0)
    with protected("refuse", log=log):
        _trainer(tmp_path, 1).fit(Regressor(omegaconf.OmegaConf.create({"lr": 0.1})), _data())
    [ckpt] = (tmp_path / "checkpoints").glob("*.ckpt")
    names = {p.name for p in ckpt.parent.iterdir()}
    assert f"{ckpt.name}.blake3" in names  # and no temp or pending file is left behind
    assert names <= {ckpt.name, f"{ckpt.name}.blake3", f"{ckpt.name}.meta.json"}
    [saved] = [json.loads(x) for x in log.read_text().splitlines()
               if json.loads(x)["kind"] == "saved"]
    assert saved["api"] == "TorchCheckpointIO.save_checkpoint" and saved["path"] == str(ckpt)
    assert verify_file(ckpt).ok  # the sidecar is torchverity's own

    _resume(tmp_path, ckpt, "refuse", tmp_path / "clean.jsonl")  # a clean resume verifies
    assert "verified" in _kinds(tmp_path / "clean.jsonl")
    [ckpt] = (tmp_path / "checkpoints").glob("epoch=1-*.ckpt")  # the resumed run's own
    assert (ckpt.parent / f"{ckpt.name}.blake3").is_file()
    flip_tensor_bit(ckpt, bit=4)
    with pytest.raises(IntegrityError, match=rf"{ckpt.name}\.blake3"):
        _resume(tmp_path, ckpt, "refuse", tmp_path / "refuse.jsonl")


def test_checkpoints_removed_by_lightning_take_their_records_along(tmp_path: Path) -> None:
    logging.getLogger("lightning").setLevel(logging.ERROR)
    keep_last = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_top_k=1,
                                                    every_n_epochs=1)
    trainer = L.Trainer(default_root_dir=tmp_path, max_epochs=3, logger=False,
                        accelerator="cpu", enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[keep_last])
    with protected("refuse"):
        trainer.fit(Regressor(omegaconf.OmegaConf.create({"lr": 0.1})), _data())
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    [ckpt] = [n for n in names if n.endswith(".ckpt")]
    assert all(n.startswith(ckpt) for n in names), names  # no orphaned sidecars
    assert f"{ckpt}.blake3" in names
