"""``torchverity serve --weights FOLDER`` serves the model the folder's manifest recorded: a
config.json or tokenizer file edited after the manifest was written stops the start (exit
1, the file and both digests named) before the model is built from it; a clean folder
serves over real HTTP and names the files it verified in /metadata.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torch_zip_artifacts import importable_copy
from uvicorn_server import start

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
import torch

from torchverity.errors import ManifestMismatchError
from torchverity.serve._app import create_app
from torchverity.serve._client import Client


@pytest.fixture
def folder(recorded_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    copy = importable_copy(recorded_bert, tmp_path, "tvserve_folder_model")
    monkeypatch.syspath_prepend(str(tmp_path))
    return copy


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize(("name", "old", "new"), [
    ("config.json", '"hidden_act": "gelu"', '"hidden_act": "relu"'),
    ("tokenizer_config.json", "[UNK]", "[UNKNOWN]"),
])
def test_serve_refuses_a_folder_whose_model_files_changed(
        folder: Path, tmp_path: Path, name: str, old: str, new: str,
        run_cli: Callable[..., Any]) -> None:
    recorded = {e["path"]: e["digest"] for e in
                json.loads((folder / "torchverity.manifest.json").read_text())["files"]}
    _edit(folder / name, old, new)
    args = ("--model", "tvserve_folder_model:build", "--weights", folder, "--check")
    result = run_cli("serve", *args)
    assert result.code == 1, result.err
    assert f"{folder / name}: listed in" in result.err and recorded[name] in result.err
    assert "next: restore" in result.err and "Traceback" not in result.err
    doc = json.loads(run_cli("serve", "--json", *args).out)
    assert doc["error"] == "ManifestMismatchError" and doc["expected"] == recorded[name]
    assert doc["actual"] and doc["actual"] != recorded[name]
    assert not (tmp_path / "built.txt").exists()  # refused before the build read the file
    with pytest.raises(ManifestMismatchError):
        create_app("tvserve_folder_model:build", folder / "model.safetensors")


def test_serve_answers_from_a_clean_folder(folder: Path, run_cli: Callable[..., Any]) -> None:
    """Over real HTTP; /metadata names the files checked; a file added after the manifest
    is a warning, not a refusal."""
    (folder / "added_tokens.json").write_text('{"[NEW]": 7}')
    result = run_cli("serve", "--model", "tvserve_folder_model:build", "--weights", folder,
                     "--check")
    assert result.code == 0, result.err
    assert "not listed in" in result.err and "added_tokens.json" in result.err
    (folder / "added_tokens.json").unlink()
    service = start(create_app("tvserve_folder_model:build", folder, recheck_interval=None))
    try:
        with Client(service.url) as client:
            out = client.predict({"input_ids": torch.tensor([[2, 5, 6, 3]])})
            weights = client.metadata()["parameters"]["weights"]
        assert out["last_hidden_state"].shape == (1, 4, 32)
        manifest = str(folder / "torchverity.manifest.json")
        assert weights["model_files"] == {
            "manifest": manifest, "against": "manifest", "record": manifest,
            "verified": ["config.json", "generation_config.json", "tokenizer.json",
                         "tokenizer_config.json"], "unlisted": []}
    finally:
        service.stop()


def test_serve_checks_a_sentence_transformers_folder_s_subfolders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_cli: Callable[..., Any]) -> None:
    """1_Pooling/config.json decides how token vectors become one embedding: edited after
    the manifest, the start stops before the build; intact, --check names it verified."""
    from torch_zip_artifacts import BERT_FOLDER_MODEL, sentence_transformers_folder
    from torchverity.manifest import write_manifest

    folder = sentence_transformers_folder(tmp_path / "minilm")
    write_manifest(folder)
    (tmp_path / "tvserve_st_model.py").write_text(BERT_FOLDER_MODEL.format(folder=str(folder)))
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ("serve", "--json", "--model", "tvserve_st_model:build", "--weights", folder,
            "--check")
    result = run_cli(*args)
    assert result.code == 0, result.err
    files = json.loads(result.out)["weights"]["model_files"]
    assert "1_Pooling/config.json" in files["verified"] and not files["unlisted"]
    (tmp_path / "built.txt").unlink()
    pooling = folder / "1_Pooling" / "config.json"
    _edit(pooling, '"pooling_mode_mean_tokens": true', '"pooling_mode_mean_tokens": false')
    result = run_cli(*args)
    assert result.code == 1, result.err
    doc = json.loads(result.out)
    assert doc["error"] == "ManifestMismatchError" and doc["path"] == str(pooling)
    assert not (tmp_path / "built.txt").exists()
