"""Checkpoints whose pickle is somewhere else than the file given: a torch.save that failed
before writing data.pkl, and a sharded checkpoint's index, which stands for its shards."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pickle_corpus import payload_runs
from torch_zip_artifacts import bert, save_bin_shards
from torchverity.pickles import scan, scan_file


def _failed_save(path: Path, *, into_open_file: bool) -> Path:
    """torch.save of a dict whose second value cannot be pickled, as it fails for real."""
    obj = {"w": torch.ones(3), "step": lambda: 0}
    with pytest.raises((pickle.PicklingError, AttributeError)):
        if into_open_file:
            with open(path, "wb") as fh:
                torch.save(obj, fh)
        else:
            torch.save(obj, path)
    return path


def test_a_torch_save_that_failed_while_pickling_is_malformed(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    for into_open_file in (False, True):
        path = _failed_save(tmp_path / f"failed_{into_open_file}.pt",
                            into_open_file=into_open_file)
        names = zipfile.ZipFile(path).namelist()
        assert names and not [n for n in names if n.endswith("data.pkl")], names
        with pytest.raises(RuntimeError, match=r"failed locating file data\.pkl"):
            torch.load(path, weights_only=True)
        result = scan_file(path)
        assert (result.verdict, result.format) == ("malformed", "torch-zip"), result.reason
        assert "a torch.save that failed while pickling" in result.reason
        res = run_cli("scan", path)
        assert res.code == 1 and "save the checkpoint again" in res.out, res.out
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3), "step": 3}, good)
    assert scan_file(good).verdict == "safe"


class _Evil:
    def __init__(self, sentinel: Path) -> None:
        self.cmd = f"touch {sentinel}"

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.cmd,)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A BERT saved as .bin shards and as .safetensors shards, each with its index."""
    root = tmp_path_factory.mktemp("sharded")
    model = bert()
    save_bin_shards(model, root / "bin")
    model.save_pretrained(root / "st", max_shard_size="40KB")
    return root / "bin", root / "st"


def _index_run(index: Path, run_cli: Callable[..., Any]) -> tuple[int, list[dict[str, Any]]]:
    res = run_cli("scan", "--json", index)
    return res.code, json.loads(res.out)["files"]


def test_an_index_given_by_itself_stands_for_its_shards(
        sharded: tuple[Path, Path], tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    for folder, index_name in zip(sharded, ("pytorch_model.bin.index.json",
                                            "model.safetensors.index.json"), strict=True):
        index = folder / index_name
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        assert len(shards) > 1
        code, files = _index_run(index, run_cli)
        assert code == 0 and [Path(f["path"]).name for f in files] == [index_name, *shards]
        assert (files[0]["verdict"], files[0]["format"]) == ("safe", "index"), files[0]
        assert all(f["verdict"] == "safe" for f in files)

    bins = sharded[0]
    bad = tmp_path / "bin"
    bad.mkdir()
    for f in bins.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    index = bad / "pytorch_model.bin.index.json"
    last = sorted(set(json.loads(index.read_text())["weight_map"].values()))[-1]
    live = tmp_path / "live.bin"
    torch.save({"x": _Evil(tmp_path / "RAN")}, live)
    assert payload_runs(live, tmp_path / "RAN")  # a throwaway torch.load runs it
    sentinel = tmp_path / "SENTINEL"
    torch.save({"x": _Evil(sentinel)}, bad / last)
    code, files = _index_run(index, run_cli)
    assert code == 1
    assert files[0]["verdict"] == "unsafe" and last in files[0]["reason"], files[0]
    assert {Path(f["path"]).name: f["verdict"] for f in files}[last] == "unsafe"
    res = run_cli("scan", index)
    assert f"{index}: unsafe (index): sharded checkpoint" in res.out, res.out

    st = tmp_path / "st"
    st.mkdir()
    for f in sharded[1].iterdir():
        (st / f.name).write_bytes(f.read_bytes())
    index = st / "model.safetensors.index.json"
    gone = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
    (st / gone).unlink()
    code, files = _index_run(index, run_cli)
    assert code == 1 and files[0]["verdict"] == "malformed", files[0]
    assert f"shard {gone} is named by the index and does not exist" in files[0]["problems"]
    report = scan(index)
    assert not report.ok and gone not in {Path(r.path).name for r in report.results}
    assert not sentinel.exists()


def test_a_folder_scan_names_the_shards_its_index_lists_and_the_folder_lacks(
        sharded: tuple[Path, Path], tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    """Scanning the folder and scanning its index agree: a complete sharded checkpoint
    passes (the index is a text file among the rest), one with a shard gone fails,
    naming it."""
    for folder, index_name in zip(sharded, ("pytorch_model.bin.index.json",
                                            "model.safetensors.index.json"), strict=True):
        res = run_cli("scan", "--json", folder)
        report = json.loads(res.out)
        assert res.code == 0 and all(f["verdict"] == "safe" for f in report["files"]), res.out
        assert index_name in {Path(s["path"]).name for s in report["skipped"]}
        copy = tmp_path / folder.name
        copy.mkdir()
        for f in folder.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        index = copy / index_name
        gone = sorted(set(json.loads(index.read_text())["weight_map"].values()))[-1]
        (copy / gone).unlink()
        res = run_cli("scan", "--json", copy)
        files = {Path(f["path"]).name: f for f in json.loads(res.out)["files"]}
        assert res.code == 1, res.out
        assert (files[index_name]["verdict"], files[index_name]["format"]) == ("malformed",
                                                                                 "index")
        assert files[index_name]["problems"] == [
            f"shard {gone} is named by the index and does not exist"]
        assert gone not in files and all(f["verdict"] == "safe" for name, f in files.items()
                                         if name != index_name)
    other = tmp_path / "other"  # an *.index.json of something else stays a text file
    other.mkdir()
    (other / "faiss.index.json").write_text(json.dumps({"dim": 8, "metric": "l2"}))
    torch.save({"w": torch.ones(2)}, other / "model.pt")
    res = run_cli("scan", other)
    assert res.code == 0 and "faiss.index.json: skipped" in res.out + res.err, res.out
