"""Git LFS pointers and HTML pages saved under weight names: named as what they are by
load, inspect, fingerprint and verify, with a next step that is not the command just run;
real checkpoints beside them are not called either.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import torchverity
from torchverity.errors import FormatError
from torchverity.manifest import write_manifest
from torchverity.report import _labels_by_step

REAL = b"\x00" * 4096


def _lfs_pointer() -> bytes:
    # What `git clone` without git-lfs leaves in place of model.safetensors.
    oid = hashlib.sha256(REAL).hexdigest()
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\n"
            f"size {len(REAL)}\n").encode()


HTML = (b"<!DOCTYPE html>\n<html lang=\"en\"><head><title>Access to model is restricted"
        b"</title></head><body>You must be authenticated to access it.</body></html>\n")


@pytest.fixture
def broken(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "model.safetensors").write_bytes(_lfs_pointer())
    (tmp_path / "pytorch_model.bin").write_bytes(HTML)
    torchverity.save({"w": torch.ones(3)}, tmp_path / "good.pt")
    return {"lfs": tmp_path / "model.safetensors", "html": tmp_path / "pytorch_model.bin",
            "good": tmp_path / "good.pt", "root": tmp_path}


@pytest.mark.parametrize("kind,words,step", [("lfs", "Git LFS pointer", "git lfs pull"),
                                             ("html", "an HTML page", "download the file")])
def test_every_reader_names_the_broken_download(broken: dict[str, Path], run_cli, kind: str,
                                                words: str, step: str) -> None:
    path = broken[kind]
    with pytest.raises(FormatError, match=words):
        torchverity.load(path)
    for command in ("inspect", "fingerprint"):
        result = run_cli(command, path)
        assert result.code == 2 and words in result.err and step in result.err
        assert f"torchverity {command} {path}" not in result.err


def test_verify_names_them_and_clean_files_pass(broken: dict[str, Path], run_cli) -> None:
    assert run_cli("inspect", broken["good"]).code == 0  # a real checkpoint: no false alarm
    good_pointer = broken["lfs"].read_bytes()
    broken["lfs"].write_bytes(REAL)
    write_manifest(broken["root"])  # recorded from the real files
    broken["lfs"].write_bytes(good_pointer)
    result = run_cli("verify", broken["root"])
    assert result.code == 1 and "Git LFS pointer" in result.err and "git lfs pull" in result.err
    with pytest.raises(FormatError, match="Git LFS pointer"):  # not "damaged"
        torchverity.load(broken["lfs"], sidecar="require")


def test_plot_labels_of_one_step_are_joined() -> None:
    marks = [(5, "loss_spike"), (5, "grad_norm"), (5, "loss_spike"), (9, "nonfinite")]
    assert _labels_by_step(marks) == [(5, "loss_spike, grad_norm"), (9, "nonfinite")]


@pytest.mark.parametrize("kind,words,step", [("lfs", "Git LFS pointer", "git lfs pull"),
                                             ("html", "an HTML page", "download the file")])
def test_verify_fails_a_broken_download_no_record_covers(broken: dict[str, Path], run_cli,
                                                         kind: str, words: str,
                                                         step: str) -> None:
    """Not 'no sidecar: record one from a trusted copy' (that would vouch for the pointer or
    the page): the broken download, with the step that fetches the real file, exit 1."""
    path = broken[kind]
    result = run_cli("verify", path)
    assert result.code == 1, result.err
    assert words in result.err and step in result.err
    assert "hash --write" not in result.err and "torchverity manifest" not in result.err
    doc = json.loads(run_cli("verify", "--json", path).out)
    assert doc["ok"] is False and doc["results"][0]["broken_downloads"] == [path.name]


def test_verify_of_a_folder_without_records_names_its_broken_downloads(
        broken: dict[str, Path], run_cli) -> None:
    root = broken["root"]
    # A model card may start like an HTML page: under a name that holds no weights, it is no
    # broken download.
    (root / "README.md").write_text("<!-- model card -->\n# tiny\n")
    for good in root.glob("good.pt*"):
        good.unlink()
    result = run_cli("verify", root)
    assert result.code == 1, result.err
    assert "Git LFS pointer" in result.err and "git lfs pull" in result.err
    assert "an HTML page" in result.err and "README.md" not in result.err
    assert "once the broken downloads are fetched again, record the folder" in result.err
    doc = json.loads(run_cli("verify", "--json", root).out)["results"][0]
    assert doc["broken_downloads"] == ["model.safetensors", "pytorch_model.bin"]
    assert doc["unrecorded"] == ["README.md"] and doc["ok"] is False


def test_verify_without_records_fails_what_a_files_own_bytes_show_incomplete(
        tmp_path: Path, run_cli) -> None:
    """Downloads and copies that stopped early, in folders transformers wrote: a
    .safetensors file cut short, a shard gone from a sharded folder, a torch.save archive
    without its central directory. No record covers them, and each fails, named, with the
    step that fetches it; the intact folders raise nothing beyond 'no record'."""
    from torch_zip_artifacts import bert, save_bin_shards

    model = bert()
    single, sharded, bins = tmp_path / "single", tmp_path / "sharded", tmp_path / "bins"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    save_bin_shards(model, bins, max_shard_size="10GB")
    for folder in (single, sharded, bins):  # intact: nothing vouches, nothing is broken
        result = run_cli("verify", folder)
        assert result.code == 2 and "no manifest and no per-file sidecars" in result.err
    weights = single / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    index = sharded / "model.safetensors.index.json"
    gone = sorted(set(json.loads(index.read_text())["weight_map"].values()))[-1]
    (sharded / gone).unlink()
    archive = bins / "pytorch_model.bin"
    archive.write_bytes(archive.read_bytes()[:-10])
    cases = [(single, "model.safetensors", "but the file holds"),
             (sharded, index.name, f"the folder does not hold: {gone}"),
             (bins, archive.name, "torch.save archive cut short")]
    for folder, name, words in cases:
        result = run_cli("verify", folder)
        assert result.code == 1, result.err
        assert words in result.err and "huggingface-cli download" in result.err, result.err
        assert "once the broken downloads are fetched again" in result.err
        doc = json.loads(run_cli("verify", "--json", folder).out)["results"][0]
        assert doc["broken_downloads"] == [name] and doc["ok"] is False
    result = run_cli("verify", archive)  # the file by itself
    assert result.code == 1 and "central directory" in result.err, result.err
