"""A model folder downloaded from the Hugging Face hub, with no manifest: the files its
build reads (config.json, tokenizer files, a sentence-transformers folder's
1_Pooling/config.json...) are checked against the names the hub gave them, a snapshot
entry against its blob's name, a local_dir file against its download record's etag.
torchverity.load, serve, golden and batch refuse an edited or missing one before the model
is built, naming the file, the expected and the actual digest; an intact download raises
nothing and warns of nothing, and /metadata says what vouched for the files.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from provenance_helpers import git_blob_sha1, hub_cache_from_folder, local_dir_from_folder

import torchverity
from torch_zip_artifacts import BERT_FOLDER_MODEL, bert, sentence_transformers_folder
from torchverity.checkpoint import CheckpointWarning
from torchverity.errors import HubFileMismatchError

pytest.importorskip("transformers")

REPO = "org/tiny-minilm"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
BUILD_FILES = ("1_Pooling/config.json", "2_Dense/config.json", "config.json",
               "config_sentence_transformers.json", "modules.json",
               "sentence_bert_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sentence_transformers_folder(tmp_path_factory.mktemp("st") / "minilm")


@dataclass(frozen=True)
class Download:
    """A download of ``pristine``: the folder a user loads, and what vouches for it."""

    layout: str  # "hub-cache" or "local-dir"
    folder: Path  # the snapshot folder, or the local_dir
    record: Path  # the hub repository folder (models--org--name), or the local_dir

    def edit(self, name: str, old: str, new: str) -> tuple[str, str]:
        """Edit a file as a user's editor or script would (through a snapshot's link into
        its blob); the git blob SHA-1 before and after."""
        path = self.folder / name
        before = path.read_bytes()
        assert old.encode() in before
        path.write_bytes(before.replace(old.encode(), new.encode()))
        if self.layout == "local-dir":  # saved a minute after the download
            later = path.stat().st_mtime + 60
            os.utime(path, (later, later))
        return git_blob_sha1(before), git_blob_sha1(path.read_bytes())


@pytest.fixture(params=["hub-cache", "local-dir"])
def download(request: pytest.FixtureRequest, pristine: Path, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Download:
    """The download, and beside it tvhub_model.py whose build reads its config.json."""
    if request.param == "hub-cache":
        repo = hub_cache_from_folder(tmp_path / "hf_home" / "hub", REPO, COMMIT, pristine)
        got = Download("hub-cache", repo / "snapshots" / COMMIT, repo)
    else:
        root = local_dir_from_folder(tmp_path / "minilm", COMMIT, pristine)
        got = Download("local-dir", root, root)
    (tmp_path / "tvhub_model.py").write_text(BERT_FOLDER_MODEL.format(folder=str(got.folder)))
    monkeypatch.syspath_prepend(str(tmp_path))
    return got


EDITS = {
    "config": ("config.json", '"hidden_act": "gelu"', '"hidden_act": "relu"'),
    "pooling": ("1_Pooling/config.json", '"pooling_mode_cls_token": false',
                '"pooling_mode_cls_token": true'),
    "tokenizer": ("tokenizer_config.json", "[UNK]", "[UNKNOWN]"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_file_is_refused_and_named(download: Download, edit: str) -> None:
    name, old, new = EDITS[edit]
    expected, actual = download.edit(name, old, new)
    with pytest.raises(HubFileMismatchError) as caught:
        torchverity.load(download.folder, model=bert(), sidecar="require")
    err = caught.value
    assert (err.path, err.expected, err.actual, err.algo, err.exit_code) == (
        str(download.folder / name), expected, actual, "git-sha1", 1)
    assert err.record == str(download.record) and err.status in ("damaged", "changed")
    assert expected in err.message and actual in err.message and name in err.message
    assert "force_download=True" in (err.hint or "")
    assert f"torchverity verify {download.record}" in (err.hint or "")
    with pytest.raises(HubFileMismatchError):  # the weights file given, config.json beside
        torchverity.load(download.folder / "model.safetensors", sidecar="warn")


def _is_what_huggingface_hub_reads(download: Download) -> None:
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache
    from huggingface_hub._local_folder import read_download_metadata

    if download.layout == "hub-cache":
        cache = download.record.parent
        assert not scan_cache_dir(cache).warnings
        found = try_to_load_from_cache(REPO, "1_Pooling/config.json", cache_dir=cache)
        assert found == str(download.folder / "1_Pooling" / "config.json")
    else:
        record = read_download_metadata(download.folder, "1_Pooling/config.json")
        assert record is not None and record.commit_hash == COMMIT


def test_an_intact_download_loads_with_no_warning(download: Download) -> None:
    _is_what_huggingface_hub_reads(download)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        report = torchverity.load(download.folder, model=bert(), sidecar="require",
                                  with_report=True)[1]
    assert report.model_files == BUILD_FILES and report.digest_source == "hub"
    assert (report.model_files_against, report.model_files_record) == (
        download.layout, str(download.record))


def test_a_missing_blob_is_refused(pristine: Path, tmp_path: Path) -> None:
    repo = hub_cache_from_folder(tmp_path / "hub", REPO, COMMIT, pristine)
    link = repo / "snapshots" / COMMIT / "tokenizer.json"
    blob = link.parent / os.readlink(link)
    blob.unlink()
    with pytest.raises(HubFileMismatchError, match=r"tokenizer\.json .* is missing") as caught:
        torchverity.load(link.parent, sidecar="require")
    assert (caught.value.status, caught.value.expected) == ("dangling", blob.name)


def test_a_file_the_hub_did_not_name_is_reported_not_refused(download: Download) -> None:
    """A snapshot entry copied over its link, a file added to a local_dir: a warning."""
    name = "1_Pooling/config.json" if download.layout == "hub-cache" else "added_tokens.json"
    path = download.folder / name
    if download.layout == "hub-cache":
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
    else:
        path.write_text('{"[NEW]": 7}')
    with pytest.warns(CheckpointWarning, match=rf"no name from the Hugging Face hub .*{name}"):
        report = torchverity.load(download.folder, model=bert(), sidecar="require",
                                  with_report=True)[1]
    assert name not in report.model_files and "config.json" in report.model_files


PAYLOAD = "import pathlib\npathlib.Path({sentinel!r}).write_text('ran')\n"


def test_remote_code_is_hashed_never_run(pristine: Path, tmp_path: Path) -> None:
    sentinel = tmp_path / "sentinel.txt"
    source = Path(shutil.copytree(pristine, tmp_path / "src"))
    (source / "2_Dense" / "custom_dense.py").write_text(PAYLOAD.format(sentinel=str(sentinel)))
    repo = hub_cache_from_folder(tmp_path / "hub", REPO, COMMIT, source)
    code = repo / "snapshots" / COMMIT / "2_Dense" / "custom_dense.py"
    code.write_text(code.read_text() + "# edited\n")
    with pytest.raises(HubFileMismatchError, match=r"2_Dense/custom_dense\.py"):
        torchverity.load(code.parent.parent, sidecar="require")
    assert not sentinel.exists()
    import subprocess
    import sys

    subprocess.run([sys.executable, str(code)], check=True)
    assert sentinel.read_text() == "ran"  # the payload runs under a plain interpreter


# ------------------------------------------------------------------ serve, golden, batch


def _commands(download: Download, tmp_path: Path) -> list[tuple[Any, ...]]:
    inputs = tmp_path / "inputs"
    inputs.mkdir(exist_ok=True)
    (inputs / "a.txt").write_text("a")
    weights = ("--weights", download.folder)
    return [("serve", "--model", "tvhub_model:build", *weights, "--check"),
            ("golden", "record", "--model", "tvhub_model:build", *weights, "--golden",
             tmp_path / "g.json", "--shape", "1,4", "--dtype", "int64", "--seed", "1"),
            ("batch", "run", "--inputs", inputs, "--model", "tvhub_model:build_batch",
             *weights, "--out", tmp_path / "out")]


def test_serve_golden_and_batch_refuse_before_the_build(
        download: Download, tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """Exit 1, the file and both digests in --json, and the model was never built."""
    expected, actual = download.edit(*EDITS["pooling"])
    for args in _commands(download, tmp_path):
        result = run_cli(*args[:2], "--json", *args[2:]) if args[0] != "serve" else \
            run_cli("serve", "--json", *args[1:])
        assert result.code == 1, result.err
        doc = json.loads(result.out)
        assert doc["error"] == "HubFileMismatchError", doc
        assert doc["path"] == str(download.folder / "1_Pooling" / "config.json")
        assert (doc["expected"], doc["actual"]) == (expected, actual)
        assert "Traceback" not in result.err
    assert not (tmp_path / "built.txt").exists() and not (tmp_path / "g.json").exists()


def test_serve_golden_and_batch_run_clean(download: Download, tmp_path: Path,
                                          run_cli: Callable[..., Any]) -> None:
    for args in _commands(download, tmp_path):
        result = run_cli(*args)
        assert result.code == 0, result.err
        assert "Hugging Face hub" not in result.err and "Mismatch" not in result.err, result.err
    serve = _commands(download, tmp_path)[0]
    files = json.loads(run_cli("serve", "--json", *serve[1:]).out)["weights"]["model_files"]
    assert (files["against"], files["verified"]) == (download.layout, list(BUILD_FILES))
    assert (f"model files: {len(BUILD_FILES)} verified against {download.layout} "
            f"{download.record}") in run_cli(*serve).out


def test_serve_metadata_says_what_vouched_for_the_files(download: Download) -> None:
    pytest.importorskip("fastapi")
    import torch

    from torchverity.serve._app import create_app
    from torchverity.serve._client import Client
    from uvicorn_server import start

    service = start(create_app("tvhub_model:build", download.folder, recheck_interval=None))
    try:
        with Client(service.url) as client:
            out = client.predict({"input_ids": torch.tensor([[2, 5, 6, 3]])})
            weights = client.metadata()["parameters"]["weights"]
    finally:
        service.stop()
    assert out["last_hidden_state"].shape == (1, 4, 32)
    assert weights["verified_by"] == "hub"
    assert weights["model_files"] == {
        "manifest": None, "against": download.layout, "record": str(download.record),
        "verified": list(BUILD_FILES), "unlisted": []}
