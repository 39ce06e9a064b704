"""A model published with its torchverity manifest and downloaded from the Hugging Face hub:
in the hub cache every file of the snapshot, the manifest included, is a link into the
repository's blobs. ``verify`` and ``torchverity.load`` take the manifest through those
links (and through no other), so an intact download verifies and an edited file is named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from provenance_helpers import hub_cache_from_folder, local_dir_from_folder
from safetensors.torch import save_file

import torchverity
from torchverity.errors import ManifestMismatchError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _model(folder: Path) -> Path:
    folder.mkdir()
    save_file({"w": torch.arange(16.0).reshape(4, 4)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 4}))
    return folder


@pytest.fixture()
def snapshot(tmp_path: Path, run_cli: Callable[..., Any]) -> Path:
    """The snapshot folder of a download of a folder published with its manifest."""
    model = _model(tmp_path / "published")
    assert run_cli("manifest", str(model), "--json").code == 0
    repo = hub_cache_from_folder(tmp_path / "hub", "org/published", COMMIT, model)
    snap = repo / "snapshots" / COMMIT
    assert all((snap / n).is_symlink() for n in ("config.json", "model.safetensors",
                                                  "torchverity.manifest.json"))
    return snap


def test_an_intact_download_verifies_against_its_published_manifest(
        snapshot: Path, run_cli: Callable[..., Any]) -> None:
    done = run_cli("verify", str(snapshot), "--json")
    assert done.code == 0, done.err
    assert json.loads(done.out)["ok"] is True
    state = torchverity.load(snapshot / "model.safetensors")
    assert torch.equal(state["w"], torch.arange(16.0).reshape(4, 4))


def test_an_edited_file_of_the_download_is_named(
        snapshot: Path, run_cli: Callable[..., Any]) -> None:
    config = snapshot / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 4', '"hidden_size": 8'))
    done = run_cli("verify", str(snapshot), "--json")
    assert done.code == 1
    assert "config.json" in done.out
    with pytest.raises(ManifestMismatchError) as caught:
        torchverity.load(snapshot / "model.safetensors")
    assert os.fspath(caught.value.path) == os.fspath(config)


def test_a_snapshot_link_that_leaves_the_repositorys_blobs_is_still_refused(
        snapshot: Path, tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_text((snapshot / "config.json").read_text())
    (snapshot / "config.json").unlink()
    os.symlink(outside, snapshot / "config.json")
    done = run_cli("verify", str(snapshot), "--json")
    assert done.code == 2
    assert "goes through a symlink" in json.loads(done.out)["message"]


def test_a_local_dir_downloads_records_are_left_out_of_its_manifest(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """The hub rewrites a ``local_dir`` download's records on every download of it: a
    manifest made after the download leaves them out, and a download again raises no
    alarm."""
    from huggingface_hub._local_folder import write_download_metadata

    local = local_dir_from_folder(tmp_path / "local", COMMIT, _model(tmp_path / "model"))
    made = run_cli("manifest", str(local), "--json")
    assert made.code == 0, made.err
    assert (json.loads(made.out)["files"], json.loads(made.out)["left_out"]) == (
        2, [".cache/huggingface"])
    write_download_metadata(local, "config.json", "f" * 40, "0" * 40)  # downloaded again
    done = run_cli("verify", str(local), "--json")
    assert done.code == 0, done.out
    assert json.loads(done.out)["results"][0]["counts"]["extra"] == 0
