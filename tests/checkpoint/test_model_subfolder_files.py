"""A model folder's build also reads files in its subfolders: a sentence-transformers
folder's modules.json, 1_Pooling/config.json and 2_Dense/config.json (whose
activation_function names a class to import), a tokenizer kept in tokenizer/. With a
manifest, torchverity.load refuses a folder where any of those was edited or removed after
the manifest was written, naming the file and both digests, and warns of a file added in a
subfolder. Hidden folders (.git), __pycache__, a Trainer's checkpoint-N/ folders,
documentation and weights raise nothing; nothing in the folder runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import torchverity
from torch_zip_artifacts import bert, sentence_transformers_folder
from torchverity.checkpoint import CheckpointWarning
from torchverity.errors import ManifestMismatchError
from torchverity.manifest import write_manifest

pytest.importorskip("transformers")

# What a sentence-transformers folder's build reads, besides the weights.
BUILD_FILES = ("1_Pooling/config.json", "2_Dense/config.json", "config.json",
               "config_sentence_transformers.json", "modules.json",
               "sentence_bert_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def recorded_st(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = sentence_transformers_folder(tmp_path_factory.mktemp("st") / "minilm")
    write_manifest(folder)
    return folder


@pytest.fixture
def folder(recorded_st: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(recorded_st, tmp_path / "minilm"))


def _replace(old: str, new: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        text = path.read_text()
        assert old in text
        path.write_text(text.replace(old, new))
    return edit


EDITS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "pooling": ("1_Pooling/config.json", _replace('"pooling_mode_cls_token": false',
                                                  '"pooling_mode_cls_token": true')),
    "dense activation": ("2_Dense/config.json", _replace("activation.Tanh", "activation.ReLU")),
    "removed": ("1_Pooling/config.json", Path.unlink),
}


def _digest(folder: Path, name: str) -> str:
    files = json.loads((folder / "torchverity.manifest.json").read_text())["files"]
    return next(e["digest"] for e in files if e["path"] == name)


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_file_in_a_subfolder_is_refused_and_named(folder: Path, edit: str) -> None:
    name, change = EDITS[edit]
    want = _digest(folder, name)
    change(folder / name)
    with pytest.raises(ManifestMismatchError) as caught:
        torchverity.load(folder, model=bert(), sidecar="require")
    err = caught.value
    assert (err.path, err.expected, err.exit_code) == (str(folder / name), want, 1)
    assert err.status == ("missing" if edit == "removed" else "mismatched")
    if edit != "removed":
        assert err.actual and err.actual != want and err.actual in err.message
    assert f"torchverity verify {folder}" in (err.hint or "")
    with pytest.raises(ManifestMismatchError):  # the weights file given, config.json beside
        torchverity.load(folder / "model.safetensors", sidecar="warn")


def test_an_intact_folder_names_every_file_checked_and_warns_of_none(folder: Path) -> None:
    """No false alarm from what no build reads, added after the manifest: a git clone's
    thousands of objects, bytecode, a Trainer checkpoint, an edited model card; nor from a
    Trainer checkpoint the manifest recorded that is gone."""
    rotated = folder / "checkpoint-250"  # recorded, then rotated out by save_total_limit
    rotated.mkdir()
    (rotated / "config.json").write_text("{}")
    (rotated / "trainer_state.json").write_text('{"global_step": 250}')
    write_manifest(folder)
    shutil.rmtree(rotated)
    objects = folder / ".git" / "objects"
    for i in range(3000):
        (objects / f"{i % 256:02x}").mkdir(parents=True, exist_ok=True)
        (objects / f"{i % 256:02x}" / f"{i:038x}").write_bytes(b"x")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "custom.cpython-311.pyc").write_bytes(b"\x00")
    trainer = folder / "checkpoint-500"
    trainer.mkdir()
    (trainer / "config.json").write_text("{}")
    (trainer / "trainer_state.json").write_text('{"global_step": 500}')
    (folder / "README.md").write_text("# edited card\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        report = torchverity.load(folder, model=bert(), sidecar="require", with_report=True)[1]
    assert report.model_files == BUILD_FILES
    assert (report.model_files_against, report.model_files_record) == (
        "manifest", str(folder / "torchverity.manifest.json"))


def test_a_file_added_in_a_subfolder_is_a_warning(folder: Path) -> None:
    (folder / "1_Pooling" / "extra_config.json").write_text('{"pooling_mode_max_tokens": 1}')
    with pytest.warns(CheckpointWarning, match=r"not listed in .* 1_Pooling/extra_config\.json"):
        report = torchverity.load(folder, model=bert(), sidecar="require", with_report=True)[1]
    assert report.model_files == BUILD_FILES


def test_a_tokenizer_subfolder_is_checked(tmp_path: Path) -> None:
    """A tokenizer saved in tokenizer/ beside the model's own files."""
    import transformers

    folder = tmp_path / "model"
    bert().save_pretrained(folder)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello"]))
    transformers.BertTokenizer(str(vocab)).save_pretrained(folder / "tokenizer")
    write_manifest(folder)
    report = torchverity.load(folder, sidecar="require", with_report=True)[1]
    assert "tokenizer/tokenizer_config.json" in report.model_files
    _replace("[UNK]", "[UNKNOWN]")(folder / "tokenizer" / "tokenizer_config.json")
    with pytest.raises(ManifestMismatchError, match=r"tokenizer/tokenizer_config\.json: listed"):
        torchverity.load(folder, sidecar="require")


PAYLOAD = "import pathlib\npathlib.Path({sentinel!r}).write_text('ran')\n"


def test_remote_code_in_a_subfolder_is_hashed_never_run(folder: Path, tmp_path: Path) -> None:
    sentinel = tmp_path / "sentinel.txt"
    code = folder / "2_Dense" / "custom_dense.py"
    code.write_text(PAYLOAD.format(sentinel=str(sentinel)))
    write_manifest(folder)
    code.write_text(PAYLOAD.format(sentinel=str(sentinel)) + "# edited\n")
    with pytest.raises(ManifestMismatchError, match=r"2_Dense/custom_dense\.py: listed"):
        torchverity.load(folder, model=bert(), sidecar="require")
    assert not sentinel.exists()
    subprocess.run([sys.executable, "-c", f"import runpy; runpy.run_path({str(code)!r})"],
                   check=True)
    assert sentinel.read_text() == "ran"  # the payload runs under a plain import


@pytest.mark.parametrize("linked", ["1_Pooling/config.json", "1_Pooling"])
def test_a_listed_file_reached_through_a_link_is_refused(folder: Path, tmp_path: Path,
                                                         linked: str) -> None:
    """A link put where the manifest recorded a file, or its folder, is never followed."""
    from torchverity.errors import FormatError

    elsewhere = Path(shutil.copytree(folder / "1_Pooling", tmp_path / "elsewhere"))
    target = elsewhere if linked == "1_Pooling" else elsewhere / "config.json"
    path = folder / linked
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.symlink_to(target)
    with pytest.raises(FormatError, match=r"'1_Pooling/config\.json' goes through a symlink"):
        torchverity.load(folder, model=bert(), sidecar="require")
