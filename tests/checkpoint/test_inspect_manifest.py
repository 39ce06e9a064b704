"""inspect checks a file with no sidecar against its folder's manifest entry, as load and
verify do: the weights file of a folder, each shard of a sharded one, a file a folder above
lists; the line names the record, and a mismatch is exit 1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from torchverity.checkpoint._inspect import inspect
from torchverity.errors import IntegrityError
from torchverity.manifest import MANIFEST_NAME, write_manifest


def test_a_weights_file_is_checked_against_its_folders_manifest(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    weights = folder / "pytorch_model.bin"
    torch.save({"w": torch.ones(3)}, weights)
    (folder / "config.json").write_text('{"hidden": 3}\n')
    write_manifest(folder)
    manifest = folder / MANIFEST_NAME
    intact = run_cli("inspect", folder)
    assert intact.code == 0 and f"matches {manifest} (entry pytorch_model.bin)" in intact.out
    r = inspect(folder)
    assert (r.sidecar.status, r.sidecar.source, r.sidecar.entry) == (
        "ok", "manifest", "pytorch_model.bin")
    torch.save({"w": torch.zeros(3)}, weights)  # replaced after the manifest was written
    for path in (folder, weights):
        changed = run_cli("inspect", path)
        assert changed.code == 1, changed.out
        assert f"DOES NOT MATCH {manifest} (entry pytorch_model.bin)" in changed.out
        assert "no sidecar" not in changed.out
    with pytest.raises(IntegrityError):  # what load and verify say of the same file
        torchverity.load(weights)
    assert run_cli("verify", weights).code == 1


def test_a_file_listed_by_a_manifest_above_its_folder(tmp_path: Path,
                                                      run_cli: Callable[..., Any]) -> None:
    (tmp_path / "unet").mkdir()
    weights = tmp_path / "unet" / "model.pt"
    torch.save({"w": torch.ones(2)}, weights)
    write_manifest(tmp_path)
    assert "(entry unet/model.pt)" in run_cli("inspect", weights).out
    torch.save({"w": torch.zeros(2)}, weights)
    assert inspect(weights).sidecar.status == "mismatched"
    assert run_cli("inspect", weights).code == 1


@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "bin"])
def test_each_shard_is_checked_against_its_manifest_entry(
        tmp_path: Path, safetensors: bool, run_cli: Callable[..., Any]) -> None:
    from huggingface_hub import save_torch_state_dict

    folder = tmp_path / "sharded"
    folder.mkdir()
    state = {f"layer{i}.w": torch.full((256,), float(i)) for i in range(2)}
    save_torch_state_dict(state, folder, max_shard_size=1200, safe_serialization=safetensors)
    write_manifest(folder)
    intact = run_cli("inspect", folder)
    assert intact.code == 0 and "shards      2 of 2 match their records" in intact.out
    r = inspect(folder)
    shards = sorted(r.shard_records)
    assert len(shards) == 2 and r.sidecar.source == "manifest" and r.sidecar.status == "ok"
    assert {c.status for c in r.shard_records.values()} == {"ok"}
    changed = {"layer1.w": torch.full((256,), 9.0)}  # same names, other values
    if safetensors:
        from safetensors.torch import save_file

        save_file(changed, folder / shards[1])
    else:
        torch.save(changed, folder / shards[1])
    r = inspect(folder)
    assert [r.shard_records[s].status for s in shards] == ["ok", "mismatched"]
    out = run_cli("inspect", folder)
    assert out.code == 1
    assert f"shard       {shards[1]}: blake3 " in out.out
    assert f"DOES NOT MATCH {folder / MANIFEST_NAME} (entry {shards[1]})" in out.out
    assert "shards      1 of 2 match their records" in out.out
    with pytest.raises(IntegrityError):
        torchverity.load(folder)
