"""inspect, fingerprint and migrate read the tensors of a file the scan finds unsafe, inertly:
each payload is proven live under its plain loader in a throwaway process, and never runs
here. Also: inspect's exit code for needs-review is scan's; an unsafe shard is called unsafe,
not damaged; a TorchScript archive is named as one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import pickle_corpus
import torchverity
from torchverity.checkpoint._file_fingerprint import fingerprint_file
from torchverity.checkpoint._inspect import inspect
from torchverity.pickles._migrate import migrate

KINDS = ("zip", "legacy", "pickle")
# The tensors of pickle_corpus.weights_with, by the names a state dict gives them.
TENSORS = {"model.w": torch.arange(6.0).reshape(2, 3), "model.b": torch.ones(2)}


@pytest.fixture(scope="module")
def evil(tmp_path_factory: pytest.TempPathFactory,
         ) -> tuple[dict[str, pickle_corpus.UnsafeWeights], Path]:
    root = tmp_path_factory.mktemp("unsafe")
    sentinel = root / "SENTINEL"
    return pickle_corpus.unsafe_weights(root / "files", sentinel), sentinel


@pytest.mark.parametrize("kind", KINDS)
def test_inspect_lists_an_unsafe_files_tensors_and_runs_nothing(
        evil: tuple[dict[str, pickle_corpus.UnsafeWeights], Path], kind: str,
        run_cli: Callable[..., Any]) -> None:
    files, sentinel = evil
    path, offender = files[kind].path, files[kind].offender
    r = inspect(path)
    assert r.scan.verdict == "unsafe" and r.not_loaded is None
    assert {t.name: t.shape for t in r.tensors} == {"model.b": (2,), "model.w": (2, 3)}
    assert r.values["epoch"] == "3"
    assert r.fingerprint == torchverity.fingerprint(TENSORS).root
    cli = run_cli("inspect", path)
    assert cli.code == 1
    assert f"scan        unsafe: loading would resolve {offender}" in cli.out, cli.out
    assert "model.w  float32  2x3" in cli.out
    assert f"torchverity: unsafe: {path}: it names globals that run code" in cli.err, cli.err
    assert offender in cli.err and "next: do not load it; extract its tensors" in cli.err
    assert f"torchverity migrate {path} {path}.safetensors" in cli.err
    assert "damaged" not in cli.err and "trust" not in cli.err
    assert not sentinel.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_fingerprint_of_an_unsafe_file_covers_its_tensors_and_runs_nothing(
        evil: tuple[dict[str, pickle_corpus.UnsafeWeights], Path], kind: str,
        run_cli: Callable[..., Any]) -> None:
    files, sentinel = evil
    path, offender = files[kind].path, files[kind].offender
    root = torchverity.fingerprint(TENSORS).root
    assert fingerprint_file(path).root == root
    cli = run_cli("fingerprint", path)
    assert cli.code == 0 and cli.out.startswith(f"{root}  {path}  (")
    assert cli.out.rstrip().endswith(", blake3, 2 entries)")
    assert f"warning: {path}: the scan found it unsafe" in cli.err and offender in cli.err
    assert "nothing from it ran" in cli.err
    doc = json.loads(run_cli("fingerprint", "--json", path).out)
    assert doc["root"] == root and offender in doc["unsafe"][str(path)]
    assert not sentinel.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_migrate_rescues_an_unsafe_file_without_trust_and_runs_nothing(
        evil: tuple[dict[str, pickle_corpus.UnsafeWeights], Path], kind: str, tmp_path: Path,
        run_cli: Callable[..., Any]) -> None:
    files, sentinel = evil
    path, offender = files[kind].path, files[kind].offender
    result = migrate(path, tmp_path / "rescued.pt")
    assert result.scan_verdict == "unsafe" and offender in result.dangerous
    loaded = torch.load(result.target, weights_only=True)
    assert set(loaded) == set(TENSORS)
    assert all(torch.equal(loaded[name], t) for name, t in TENSORS.items())
    user = json.loads(Path(result.meta_path or "").read_text())["user"]
    assert offender in user["dangerous"] and user["content"]["epoch"] == 3
    cli = run_cli("migrate", path, tmp_path / "rescued.safetensors")
    assert cli.code == 0, cli.err
    assert f"{offender} (" in cli.err and "never ran" in cli.err
    assert "do not load the source" in cli.err
    if kind != "pickle":  # scan gives load advice with a torch file's load plan only
        scanned = run_cli("scan", path).out
        assert "do not load this file: it would run code; its tensors and data come out " \
               f"without running it: torchverity migrate {path} NEW.safetensors" in scanned
    assert not sentinel.exists()


def test_inspect_exits_as_scan_does_for_needs_review_and_says_so(
        tmp_path: Path, run_cli: Callable[..., Any], capsys: pytest.CaptureFixture[str]) -> None:
    from torchverity.cli import main

    path = pickle_corpus.user_class_checkpoint(tmp_path / "user.pt")  # a class of your own
    scanned, inspected = run_cli("scan", path), run_cli("inspect", path)
    assert "needs-review" in scanned.out and "scan        needs-review" in inspected.out
    assert scanned.code == inspected.code == 1
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    described = " ".join(capsys.readouterr().out.split())
    assert "the scan finds a file needs-review, unsafe or malformed (as torchverity scan " \
           "exits)" in described, described


def _bin_shards(folder: Path, second: dict[str, Any]) -> Path:
    """Two torch.save shards and their index, as transformers 4.x lays them out."""
    folder.mkdir()
    names = ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin")
    torch.save({"a.w": torch.ones(3)}, folder / names[0])
    torch.save(second, folder / names[1])
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a.w": names[0], "b.w": names[1]}}))
    return folder / names[1]


def test_an_unsafe_shard_is_called_unsafe_not_damaged(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    sentinel = tmp_path / "SENTINEL"
    shard = _bin_shards(tmp_path / "model",
                        {"b.w": torch.zeros(3), "x": pickle_corpus._Evil(sentinel)})
    assert pickle_corpus.payload_runs(shard, sentinel)
    cli = run_cli("inspect", tmp_path / "model")
    assert cli.code == 1
    assert "damaged" not in cli.err and "restore" not in cli.err, cli.err
    assert f"torchverity: unsafe: {shard}: it names globals that run code" in cli.err
    assert f"torchverity migrate {shard} {shard}.safetensors" in cli.err
    assert f"scan        shards: 1 safe, 1 unsafe ({shard.name})" in cli.out, cli.out
    r = inspect(tmp_path / "model")
    assert [s.verdict for s in r.shard_scans] == ["safe", "unsafe"]
    assert [t.name for t in r.tensors] == ["a.w", "b.w"] and r.not_loaded is None
    assert not sentinel.exists()


class _Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_torchscript_archive_is_named_as_one(tmp_path: Path,
                                               run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(_Scripted()), os.fspath(path))
    r = inspect(path)
    assert r.format == "torchscript" and r.scan.format == "torchscript"
    assert {t.name: t.shape for t in r.tensors} == {"lin.weight": (3, 2), "lin.bias": (3,)}
    cli = run_cli("inspect", path)
    assert cli.out.startswith(f"{path}: TorchScript archive (torch.jit.save), ")
    assert cli.code == run_cli("scan", path).code == 1  # needs-review: its code would run
    assert json.loads(run_cli("inspect", "--json", path).out)["format"] == "torchscript"


@pytest.mark.parametrize("kind", KINDS)
def test_diff_never_calls_an_unsafe_file_equal_to_its_clean_copy(
        evil: tuple[dict[str, pickle_corpus.UnsafeWeights], Path], kind: str, tmp_path: Path,
        run_cli: Callable[..., Any]) -> None:
    """Read inertly, the payload is an entry of its own: the same tensors and values beside
    it do not make the two files equal."""
    files, sentinel = evil
    clean = tmp_path / "clean.pt"
    torch.save({"model": {"w": TENSORS["model.w"], "b": TENSORS["model.b"]}, "epoch": 3}, clean)
    done = run_cli("diff", "--json", clean, files[kind].path)
    assert done.code == 1, done.err
    entries = json.loads(done.out)["entries"]
    assert entries and {e["status"] for e in entries} == {"only_in_b"}
    assert all(e["name"].startswith("x.") for e in entries)  # tensors and epoch identical
    assert f"{files[kind].path} is unsafe" in done.err and files[kind].offender in done.err
    assert not sentinel.exists()
