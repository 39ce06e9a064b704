"""Folder scans reach every file a loader can reach: through symlinked folders (a pipeline
whose component is a link to another folder), with links looping back ending; links to
nothing, pipes and sockets are named as unread, never passed over; and no command waits
on a pipe given as its file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pickle_corpus import Touch, run_plain_loader
from torchverity.pickles._scan import scan

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX links and FIFOs")

def _evil(path: Path, sentinel: Path) -> Path:
    torch.save({"w": torch.ones(2), "x": Touch(sentinel)}, path)
    return path


def _pipeline(root: Path) -> tuple[Path, Path]:
    """A pipeline folder (transformers' own save_pretrained files) whose text_encoder is a
    link to a folder beside it, as a cache or a hand-made pipeline lays it out."""
    from torch_zip_artifacts import bert

    pipe, real = root / "pipe", root / "real"
    bert().save_pretrained(pipe)
    real.mkdir()
    (pipe / "text_encoder").symlink_to("../real", target_is_directory=True)
    return pipe, real


def test_a_folder_scan_follows_linked_folders_as_loaders_do(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    live = tmp_path / "live"
    live.mkdir()
    ran = live / "RAN"
    run_plain_loader((_evil(live / "m.bin", ran)), "torch")
    assert ran.exists(), "the payload did not run under torch.load(weights_only=False)"

    sentinel = tmp_path / "SENTINEL"
    pipe, real = _pipeline(tmp_path / "repo")
    _evil(real / "pytorch_model.bin", sentinel)
    linked = pipe / "text_encoder" / "pytorch_model.bin"
    res = run_cli("scan", "--json", pipe)
    assert res.code == 1, (res.out, res.err)
    files = {f["path"]: f for f in json.loads(res.out)["files"]}
    assert files[os.fspath(linked)]["verdict"] == "unsafe", files
    assert files[os.fspath(pipe / "model.safetensors")]["verdict"] == "safe"
    human = run_cli("scan", pipe)
    assert f"{linked}: unsafe" in human.out and "posix.system" in human.out
    # Given the parent, the file is named by its own path, once.
    report = scan(tmp_path / "repo")
    named = [r.path for r in report.results if r.path.endswith("pytorch_model.bin")]
    assert named == [os.fspath(real / "pytorch_model.bin")], named

    # A link back up (a loop) ends the walk; every file is still judged once.
    (real / "up").symlink_to("..", target_is_directory=True)
    (real / "self").symlink_to(".", target_is_directory=True)
    report = scan(pipe)
    paths = [r.path for r in report.results]
    assert len(paths) == len({os.path.realpath(p) for p in paths}) == 2, paths
    assert {r.verdict for r in report.results} == {"safe", "unsafe"}

    # Clean: the same layout with a real checkpoint behind the link passes, judged.
    torch.save({"w": torch.ones(2)}, real / "pytorch_model.bin")
    res = run_cli("scan", "--json", pipe)
    doc = json.loads(res.out)
    assert res.code == 0, (res.out, res.err)
    assert {f["path"]: f["verdict"] for f in doc["files"]}[os.fspath(linked)] == "safe"
    assert not doc["unreadable"]
    assert not sentinel.exists()


def test_links_to_nothing_and_pipes_in_a_folder_are_unread_not_passed(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    from torch_zip_artifacts import bert

    folder = tmp_path / "snapshot"
    bert().save_pretrained(folder)
    clean = run_cli("scan", folder)
    assert clean.code == 0, clean.err  # no false alarm on the intact folder

    dangling = folder / "model-2.safetensors"
    dangling.symlink_to("../blobs/abc123")  # the blob a cache entry names was never fetched
    res = run_cli("scan", "--json", folder)
    assert res.code == 2, (res.out, res.err)
    (unread,) = json.loads(res.out)["unreadable"]
    assert unread["path"] == os.fspath(dangling)
    assert "a symbolic link to ../blobs/abc123, which does not exist" in unread["reason"]
    assert "download it again" in unread["hint"]
    human = run_cli("scan", folder)
    assert f"{dangling}: unreadable (not scanned)" in human.out
    assert f"torchverity scan {folder}" not in human.err
    dangling.unlink()

    pipe = folder / "pytorch_model.bin"
    os.mkfifo(pipe)
    res = run_cli("scan", "--json", folder)
    assert res.code == 2, (res.out, res.err)
    (unread,) = json.loads(res.out)["unreadable"]
    assert unread["path"] == os.fspath(pipe) and "a named pipe (FIFO)" in unread["reason"]
    pipe.unlink()
    assert run_cli("scan", folder).code == 0


@pytest.mark.parametrize("command", ["scan", "inspect", "fingerprint", "hash", "migrate",
                                     "verify"])
def test_no_command_waits_on_a_pipe(tmp_path: Path, command: str) -> None:
    """Opening a FIFO for reading waits for a writer: each command refuses it at once,
    exit 2, saying what it is (run in a child, so a wait fails the test, not the run)."""
    pipe = tmp_path / "model.pt"
    os.mkfifo(pipe)
    if command == "verify":  # verify reads a file its sidecar covers
        torch.save({"w": torch.ones(2)}, tmp_path / "good.pt")
        subprocess.run([sys.executable, "-m", "torchverity", "hash", "--write",
                        tmp_path / "good.pt"], check=True, timeout=120, capture_output=True)
        shutil.copy(tmp_path / "good.pt.blake3", tmp_path / "model.pt.blake3")
        (tmp_path / "model.pt.blake3").write_text(
            (tmp_path / "model.pt.blake3").read_text().replace("good.pt", "model.pt"))
    args = [pipe, tmp_path / "out.safetensors"] if command == "migrate" else [pipe]
    done = subprocess.run([sys.executable, "-m", "torchverity", command, *map(str, args)],
                          timeout=60, capture_output=True, text=True)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"{pipe}: a named pipe (FIFO), not a regular file" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "no such file" not in done.stderr
    assert f"ls -l {pipe}" in done.stderr
