"""A model published with its torchverity manifest and downloaded from the Hugging Face hub:
in the hub cache every file of the snapshot, the manifest included, is a link into the
repository's blobs. ``verify`` and ``torchverity.load`` take the manifest through those
links (and through no other), so an intact download verifies and an edited file is named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from provenance_helpers import hub_cache_from_folder, local_dir_from_folder
from safetensors.torch import save_file

import torchverity
from torchverity.errors import ManifestMismatchError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchverity", *args, "--json"],
                          capture_output=True, text=True, timeout=120)


def _model(folder: Path) -> Path:
    folder.mkdir()
    save_file({"w": torch.arange(16.0).reshape(4, 4)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 4}))
    return folder


@pytest.fixture()
def snapshot(tmp_path: Path) -> Path:
    """The snapshot folder of a download of a folder published with its manifest."""
    model = _model(tmp_path / "published")
    assert _cli("manifest", str(model)).returncode == 0
    repo = hub_cache_from_folder(tmp_path / "hub", "org/published", COMMIT, model)
    snap = repo / "snapshots" / COMMIT
    assert all((snap / n).is_symlink() for n in ("config.json", "model.safetensors",
                                                  "torchverity.manifest.json"))
    return snap


def test_an_intact_download_verifies_against_its_published_manifest(snapshot: Path) -> None:
    done = _cli("verify", str(snapshot))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
    state = torchverity.load(snapshot / "model.safetensors")
    assert torch.equal(state["w"], torch.arange(16.0).reshape(4, 4))


def test_an_edited_file_of_the_download_is_named(snapshot: Path) -> None:
    config = snapshot / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 4', '"hidden_size": 8'))
    done = _cli("verify", str(snapshot))
    assert done.returncode == 1
    assert "config.json" in done.stdout
    with pytest.raises(ManifestMismatchError) as caught:
        torchverity.load(snapshot / "model.safetensors")
    assert os.fspath(caught.value.path) == os.fspath(config)


def test_a_snapshot_link_that_leaves_the_repositorys_blobs_is_still_refused(
        snapshot: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_text((snapshot / "config.json").read_text())
    (snapshot / "config.json").unlink()
    os.symlink(outside, snapshot / "config.json")
    done = _cli("verify", str(snapshot))
    assert done.returncode == 2
    assert "goes through a symlink" in json.loads(done.stdout)["message"]


def test_a_local_dir_downloads_records_are_left_out_of_its_manifest(tmp_path: Path) -> None:
    """The hub rewrites a ``local_dir`` download's records on every download of it: a
    manifest made after the download leaves them out, and a download again raises no
    alarm."""
    from huggingface_hub._local_folder import write_download_metadata

    local = local_dir_from_folder(tmp_path / "local", COMMIT, _model(tmp_path / "model"))
    made = _cli("manifest", str(local))
    assert made.returncode == 0, made.stderr
    assert (json.loads(made.stdout)["files"], json.loads(made.stdout)["left_out"]) == (
        2, [".cache/huggingface"])
    write_download_metadata(local, "config.json", "f" * 40, "0" * 40)  # downloaded again
    done = _cli("verify", str(local))
    assert done.returncode == 0, done.stdout
    assert json.loads(done.stdout)["results"][0]["counts"]["extra"] == 0
