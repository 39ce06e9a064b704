"""A model folder is its weights and the files its build reads beside them (config.json,
generation_config.json, tokenizer files): with a manifest, torchverity.load and the
--weights of golden and batch refuse a folder where any of those was edited or removed
after the manifest was written, naming the file and both digests, before the model is built
from it. Clean folders, files the manifest does not list, documentation and torchverity's
own records raise nothing.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import torchverity
from torch_zip_artifacts import bert, importable_copy, tiny_ldm_pipeline
from torchverity.checkpoint import CheckpointWarning
from torchverity.digest import digest_file, write_sidecar
from torchverity.errors import ManifestMismatchError
from torchverity.manifest import write_manifest

transformers = pytest.importorskip("transformers")


def _hidden_act(folder: Path) -> None:
    """An edit that keeps every shape: the weights load, the model computes otherwise."""
    config = json.loads((folder / "config.json").read_text())
    config["hidden_act"] = "relu"
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def _generation(folder: Path) -> None:
    path = folder / "generation_config.json"
    path.write_text(path.read_text().replace('"max_new_tokens": 4', '"max_new_tokens": 400'))


def _tokenizer(folder: Path) -> None:
    path = folder / "tokenizer.json"
    path.write_text(path.read_text().replace('"hello"', '"hullo"'))


EDITS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "config": ("config.json", _hidden_act),
    "generation": ("generation_config.json", _generation),
    "tokenizer": ("tokenizer.json", _tokenizer),
    "removed": ("generation_config.json", lambda f: (f / "generation_config.json").unlink()),
}


@pytest.fixture
def folder(recorded_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the recorded folder, and tvfolder_model (its build reads config.json)."""
    copy = importable_copy(recorded_bert, tmp_path, "tvfolder_model")
    monkeypatch.syspath_prepend(str(tmp_path))
    return copy


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("sidecar", ["warn", "require"])
def test_load_refuses_a_folder_whose_model_files_changed(folder: Path, edit: str,
                                                         sidecar: str) -> None:
    name, change = EDITS[edit]
    expected = json.loads((folder / "torchverity.manifest.json").read_text())["files"]
    want = next(e["digest"] for e in expected if e["path"] == name)
    change(folder)
    with pytest.raises(ManifestMismatchError) as caught:
        torchverity.load(folder, model=bert(), sidecar=sidecar)  # type: ignore[arg-type]
    err = caught.value
    assert err.path == str(folder / name) and err.expected == want and err.exit_code == 1
    assert err.status == ("missing" if edit == "removed" else "mismatched")
    if edit != "removed":
        assert err.actual is not None and err.actual in err.message and want in err.message
    assert (err.hint or "").startswith(f"restore {name} from a verified copy (torchverity "
                                       f"verify {folder}")
    with pytest.raises(ManifestMismatchError):  # a weights file given in the folder too
        torchverity.load(folder / "model.safetensors", sidecar=sidecar)  # type: ignore[arg-type]


def test_a_clean_folder_loads_and_names_what_was_checked(folder: Path) -> None:
    """No false alarm, also once the folder gained what no build reads: an edited README,
    .gitattributes, a sidecar written after the manifest."""
    (folder / ".gitattributes").write_text("*.bin filter=lfs diff=lfs merge=lfs -text\n")
    (folder / "README.md").write_text("# tiny bert\n")
    weights = folder / "model.safetensors"
    write_sidecar(weights, digest_file(weights, "blake3"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        _obj, report = torchverity.load(folder, model=bert(), sidecar="require",
                                        with_report=True)
    assert report.model_files == ("config.json", "generation_config.json", "tokenizer.json",
                                  "tokenizer_config.json")
    assert torchverity.load(folder, sidecar="ignore", with_report=True)[1].model_files == ()


def test_a_file_the_manifest_does_not_list_is_a_warning(folder: Path) -> None:
    (folder / "added_tokens.json").write_text('{"[NEW]": 7}')
    with pytest.warns(CheckpointWarning, match=r"not listed in .* added_tokens\.json") as seen:
        torchverity.load(folder, model=bert(), sidecar="require")
    assert f"torchverity manifest {folder}" in str(seen[0].message)


def test_a_weights_file_in_a_folder_of_other_things_checks_only_itself(tmp_path: Path) -> None:
    """Without config.json beside it, a weights file is not a model folder: the other files
    its manifest lists are not the model's, and are not read."""
    bert().save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "notes.txt").write_text("v1")
    write_manifest(tmp_path)
    (tmp_path / "notes.txt").write_text("v2")
    report = torchverity.load(tmp_path / "model.safetensors", sidecar="require",
                              with_report=True)[1]
    assert report.digest_source == "manifest" and report.model_files == ()


def _golden(action: str, folder: Path, tmp_path: Path) -> tuple[str, ...]:
    return ("golden", action, "--model", "tvfolder_model:build", "--weights", folder,
            "--golden", tmp_path / "g.json", *(("--shape", "1,4", "--dtype", "int64",
                                                "--seed", "1") if action == "record" else ()))


def _batch(folder: Path, tmp_path: Path) -> tuple[Any, ...]:
    inputs = tmp_path / "inputs"
    inputs.mkdir(exist_ok=True)
    (inputs / "a.txt").write_text("a")
    return ("batch", "run", "--inputs", inputs, "--model", "tvfolder_model:build_batch",
            "--weights", folder, "--out", tmp_path / "out")


@pytest.mark.parametrize("edit", ["config", "tokenizer"])
def test_golden_and_batch_refuse_before_the_build(folder: Path, tmp_path: Path, edit: str,
                                                  run_cli: Callable[..., Any]) -> None:
    """Exit 1, the file and both digests in --json, and the model was never built."""
    name, change = EDITS[edit]
    change(folder)
    for args in (_golden("record", folder, tmp_path), _batch(folder, tmp_path)):
        result = run_cli(*args[:2], "--json", *args[2:])
        assert result.code == 1, result.err
        doc = json.loads(result.out)
        assert doc["error"] == "ManifestMismatchError" and doc["path"] == str(folder / name)
        assert doc["expected"] and doc["actual"] and "torchverity verify" in doc["hint"]
        assert "Traceback" not in result.err
    assert not (tmp_path / "built.txt").exists()
    assert not (tmp_path / "g.json").exists()


def test_golden_and_batch_run_clean_on_a_recorded_folder(folder: Path, tmp_path: Path,
                                                         run_cli: Callable[..., Any]) -> None:
    for args in (_golden("record", folder, tmp_path), _golden("check", folder, tmp_path),
                 _batch(folder, tmp_path)):
        result = run_cli(*args)
        assert result.code == 0, result.err
        assert "not listed" not in result.err and "Manifest" not in result.err


def test_golden_and_batch_warn_of_an_unlisted_file_as_their_own(
        folder: Path, tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    (folder / "added_tokens.json").write_text('{"[NEW]": 7}')
    for args in (_golden("record", folder, tmp_path), _batch(folder, tmp_path)):
        result = run_cli(*args)
        assert result.code == 0, result.err
        assert f"warning: {folder}: 1 file(s) beside the weights are not listed" in result.err
        assert "added_tokens.json" in result.err and "CheckpointWarning" not in result.err


def test_a_pipeline_component_is_checked_against_the_root_manifest(tmp_path: Path) -> None:
    """One manifest at a diffusers pipeline's root: a component's config.json is its own;
    another component's edit does not concern it. A manifest far above that lists none of a
    folder's files says nothing about it."""
    pytest.importorskip("diffusers")
    root = tiny_ldm_pipeline(tmp_path / "ddpm")
    write_manifest(root)
    other = root / "vqvae" / "config.json"
    other.write_text(other.read_text().replace('"latent_channels": 2', '"latent_channels": 3'))
    report = torchverity.load(root / "unet", sidecar="require", with_report=True)[1]
    assert report.model_files == ("config.json",)
    with pytest.raises(ManifestMismatchError, match=r"vqvae/config\.json"):
        torchverity.load(root / "vqvae", sidecar="require")
    (tmp_path / "notes.txt").write_text("not a model")
    write_manifest(tmp_path)  # lists ddpm/... and notes.txt
    snapshot = Path(shutil.copytree(root / "unet", tmp_path / "hub" / "snapshot"))
    weights = snapshot / "diffusion_pytorch_model.safetensors"
    write_sidecar(weights, digest_file(weights, "sha256"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert torchverity.load(snapshot, sidecar="require",
                                with_report=True)[1].model_files == ()
