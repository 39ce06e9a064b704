"""diff of torch.save zip checkpoints lists and hashes them without torch, with exactly the
result of loading both files: views, non-contiguous tensors, every dtype, plain values,
real Lightning checkpoints and Hugging Face .bin folders; malicious files never run.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_free_probe import cli
from torch_zip_artifacts import bert, flip, lightning_checkpoints, save_bin_shards, state
from torchverity.checkpoint._diff import diff
from torchverity.checkpoint._diff_result import DiffResult
from torchverity.checkpoint._read import read_unverified


def _loaded_diff(a: Path, b: Path) -> DiffResult:
    """What diff gives when it loads both files and compares the tensors (the reference)."""
    return replace(diff(read_unverified(a), read_unverified(b)), a=str(a), b=str(b))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ptdiff")
    torch.save(state(), root / "a.pt")
    torch.save(state(), root / "copy.pth")
    torch.save(state(epoch=4) | {"name": "run-2", "lr": 0.2, "done": True}, root / "plain.bin")
    flipped = state()
    flip(flipped["model"]["w"], 5, 30)
    flip(flipped["model"]["base"], 3 * 8 + 3, 0)  # seen through rows, t and every3 too
    torch.save(flipped, root / "flipped.ckpt")
    return {p.stem: p for p in root.iterdir()}


def test_identical_torch_save_files_diff_without_torch(saved: dict[str, Path]) -> None:
    got = cli("diff", saved["a"], saved["copy"])
    assert got["code"] == 0 and got["torch"] is False
    assert diff(saved["a"], saved["copy"]) == _loaded_diff(saved["a"], saved["copy"])
    n = len(diff(saved["a"], saved["copy"]).entries)
    assert f"equal: {n} entries ({n} identical)" in str(got["out"])


def test_a_changed_plain_value_diffs_without_torch(saved: dict[str, Path]) -> None:
    got = cli("diff", "--json", saved["a"], saved["plain"])
    assert got["code"] == 1 and got["torch"] is False
    entries = json.loads(str(got["out"]))["entries"]
    assert {e["name"]: e["kind"] for e in entries} == {
        "epoch": "value", "name": "value", "lr": "value", "done": "value"}
    want = _loaded_diff(saved["a"], saved["plain"])
    assert diff(saved["a"], saved["plain"]) == want
    assert entries == json.loads(json.dumps(want.to_dict()["entries"]))


def test_a_flipped_bit_is_located_through_views(saved: dict[str, Path]) -> None:
    got = cli("diff", "--json", saved["a"], saved["flipped"])
    assert got["code"] == 1  # torch is imported to classify the two changed storages
    by_name = {e["name"]: e for e in json.loads(str(got["out"]))["entries"]}
    w = by_name["model.w"]
    assert (w["kind"], w["bit"], w["field"], w["first_index"]) == (
        "bit-flip", 30, "exponent", [0, 5])
    assert set(by_name) == {"model.w", "model.base", "model.rows", "model.t", "model.every3"}
    assert diff(saved["a"], saved["flipped"]) == _loaded_diff(saved["a"], saved["flipped"])


def test_views_and_their_contiguous_copies_are_identical(saved: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """Different layouts of equal values hash differently; opened, they compare equal."""
    packed = state()
    packed["model"] = {k: v.detach().contiguous().clone() for k, v in packed["model"].items()}
    torch.save(packed, tmp_path / "packed.pt")
    result = diff(saved["a"], tmp_path / "packed.pt")
    assert result.equal and not result.changed
    assert result == _loaded_diff(saved["a"], tmp_path / "packed.pt")


def test_a_pt_and_a_safetensors_file_compare_without_torch(saved: dict[str, Path],
                                                          tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().clone() for k, v in state()["model"].items()
               if v.dtype != torch.complex128}  # .safetensors has no complex128
    torch.save(tensors, tmp_path / "weights.pt")
    save_file(tensors, tmp_path / "weights.safetensors")
    got = cli("diff", tmp_path / "weights.pt", tmp_path / "weights.safetensors")
    assert got["code"] == 0 and got["torch"] is False
    flip(tensors["h"], 2, 15)
    save_file(tensors, tmp_path / "flipped.safetensors")
    pair = (tmp_path / "weights.pt", tmp_path / "flipped.safetensors")
    assert diff(*pair) == _loaded_diff(*pair)
    assert [e.name for e in diff(*pair).changed] == ["h"]
    views = cli("diff", saved["a"], tmp_path / "weights.safetensors")  # views against copies
    assert views["code"] == 1  # the .safetensors side has no plain values
    assert diff(saved["a"], tmp_path / "weights.safetensors") == _loaded_diff(
        saved["a"], tmp_path / "weights.safetensors")


def test_lightning_checkpoints_diff_as_when_loaded(tmp_path: Path) -> None:
    import omegaconf

    first, second = lightning_checkpoints(tmp_path / "plain", {"width": 4, "lr": 0.01})
    copy = Path(shutil.copy(first, tmp_path / "copy.ckpt"))
    same = cli("diff", first, copy)
    assert same["code"] == 0 and same["torch"] is False
    result = diff(first, second)
    assert result == _loaded_diff(first, second)
    assert {"global_step", "state_dict.layer.weight"} <= {e.name for e in result.changed}
    # omegaconf hyper-parameters: weights_only refuses their classes, so the files are read
    # inertly, their plain values and hyper-parameters compared beside the tensors
    cfg = omegaconf.OmegaConf.create({"model": {"width": 4}, "lr": 0.01})
    first, second = lightning_checkpoints(tmp_path / "omegaconf", cfg)
    result, loaded = diff(first, second), _loaded_diff(first, second)
    tensors = {e.name for e in loaded.entries}
    assert [e for e in result.entries if e.name in tensors] == list(loaded.entries)
    assert result.by_name["global_step"].status == "values_changed"
    assert result.by_name["hyper_parameters.lr"].status == "identical"


def test_hugging_face_bin_folders_diff_without_torch(tmp_path: Path) -> None:
    model = bert()
    model.save_pretrained(tmp_path / "single")  # model.safetensors
    for name in ("bin", "flipped"):
        save_bin_shards(model, tmp_path / name)
    shards = sorted((tmp_path / "flipped").glob("pytorch_model-*.bin"))
    assert len(shards) > 1
    shard = torch.load(shards[-1], weights_only=True)
    name = sorted(shard)[0]
    flip(shard[name], 1, 2)
    torch.save(shard, shards[-1])
    same = cli("diff", tmp_path / "bin", tmp_path / "single")
    assert same["code"] == 0 and same["torch"] is False
    pair = (tmp_path / "bin", tmp_path / "flipped")
    assert diff(*pair) == _loaded_diff(*pair)
    (changed,) = diff(*pair).changed
    assert (changed.name, changed.kind, changed.bit) == (name, "bit-flip", 2)


def test_malicious_torch_files_never_run(saved: dict[str, Path], tmp_path: Path,
                                         run_cli: Any) -> None:
    """Each file's payload runs under a plain torch.load in a throwaway process; diff
    lists none of them and runs none of them."""
    import pickle_corpus
    from torchverity.pickles._listing import list_torch_zip

    sentinel = tmp_path / "SENTINEL"
    cases = pickle_corpus.live_torch_files(tmp_path / "bad", sentinel)
    assert len(cases) >= 5
    for case in cases:
        assert list_torch_zip(case.path) is None, case.name
        result = run_cli("diff", saved["a"], case.path)
        assert result.code in (1, 2) and "Traceback" not in result.err, case.name
        assert not sentinel.exists(), f"{case.name}: the payload ran"

