"""A real transformers save_pretrained / from_pretrained round trip with one flipped bit."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from protect_helpers import flip_tensor_bit  # noqa: E402

import torchverity  # noqa: E402
from torchverity.errors import IntegrityError  # noqa: E402
from torchverity.protection import protected  # noqa: E402


def _tiny() -> transformers.BertModel:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=32)
    return transformers.BertModel(config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded save_pretrained folder written with the switch on."""
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    folder = tmp_path_factory.mktemp("bert")
    with protected("refuse"):
        _tiny().save_pretrained(folder, max_shard_size="20KB")
    return folder


def _events(log: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["kind"] == kind]


def test_save_pretrained_shards_get_records_and_load_back_verified(
        saved: Path, tmp_path: Path) -> None:
    shards = sorted(saved.glob("*.safetensors"))
    assert len(shards) == 2
    for shard in shards:  # transformers' own save_file call, made atomic and recorded
        assert torchverity.load(shard, sidecar="require", with_report=True)[1].verified
    log = tmp_path / "log.jsonl"
    with protected("refuse", log=log):
        model = transformers.BertModel.from_pretrained(saved)
    reference = _tiny().state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    assert len(_events(log, "verified")) == 2
    assert _events(log, "mismatch") == _events(log, "refused") == []


def test_one_flipped_bit_in_a_shard_is_refused_or_reported(saved: Path, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(saved, folder)
    shard = sorted(folder.glob("*.safetensors"))[1]
    flip_tensor_bit(shard, bit=4)
    log = tmp_path / "refuse.jsonl"
    with pytest.raises(IntegrityError) as caught, protected("refuse", log=log):
        transformers.BertModel.from_pretrained(folder)
    assert caught.value.path == str(shard) and caught.value.tensors
    [refused] = _events(log, "refused")
    assert refused["api"] == "safetensors.safe_open"
    assert "transformers/modeling_utils.py" in refused["where"]

    log = tmp_path / "warn.jsonl"
    with protected("warn", log=log):
        transformers.BertModel.from_pretrained(folder)
    [mismatch] = _events(log, "mismatch")
    assert mismatch["path"] == str(shard) and caught.value.tensors[0] in mismatch["message"]


def test_a_folder_saved_without_the_switch_is_checked_against_its_manifest(
        tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    _tiny().save_pretrained(folder)
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    torchverity.write_manifest(folder)
    flip_tensor_bit(folder / "model.safetensors")
    with pytest.raises(IntegrityError, match=r"torchverity\.manifest\.json"), protected("refuse"):
        transformers.BertModel.from_pretrained(folder)


def test_from_the_environment_a_later_import_of_transformers_is_watched(
        saved: Path, tmp_path: Path, hooked_python: str) -> None:
    from protect_helpers import run_python

    folder = tmp_path / "copy"
    shutil.copytree(saved, folder)
    flip_tensor_bit(sorted(folder.glob("*.safetensors"))[0])
    done = run_python("""
        import sys
        assert "safetensors" not in sys.modules and "transformers" not in sys.modules
        import transformers
        from torchverity.errors import IntegrityError
        try:
            transformers.BertModel.from_pretrained(sys.argv[1])
        except IntegrityError as exc:
            print("refused", exc.tensors)
            sys.exit(3)
    """, python=hooked_python, env={"TORCHVERITY_PROTECT": "refuse"}, args=(str(folder),))
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout.startswith("refused ['")
