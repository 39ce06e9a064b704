"""A save killed at any instant leaves the previous checkpoint or the new one, loadable and
verified, never a mix; a full disk or a read-only folder ends in CheckpointWriteError that
tells the truth about the previous checkpoint.

Every rename(2) of a save is a window: ``strace -e inject=rename:signal=KILL:when=K``
kills the saving process on entering its K-th rename, for every K. Random SIGKILLs cover
the writes between renames.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from crash_harness import count_renames, kill_after, kill_at_rename, need_strace, tmpfs
from torchverity.errors import CheckpointWriteError
from torchverity.verify import verify_path


def _state(value: float, n: int = 6, size: int = 2000) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.full((size,), value + i) for i in range(n)}


A, B, C = _state(1.0), _state(100.0), _state(1000.0)


def _which(obj: Any) -> str:
    """'A' or 'B' when ``obj`` is exactly one of the two saves, else a description of the mix."""
    for name, want in (("A", A), ("B", B), ("C", C)):
        if set(obj) == set(want) and all(torch.equal(obj[k], want[k]) for k in want):
            return name
    return f"a mix: {sorted((k, float(v[0])) for k, v in obj.items())[:6]}"


def _loaded(path: Path) -> str:
    """Which save ``path`` holds, loaded with every record required."""
    obj, report = torchverity.load(path, sidecar="require", with_report=True)
    assert report.verified and report.fingerprint_verified, report
    return _which(obj)


def _save(path: Path, state: dict[str, torch.Tensor], sharded: bool) -> Callable[[], None]:
    def action() -> None:
        if sharded:
            torchverity.save(state, path, shard_bytes=2 * 8000)
        else:
            torchverity.save(state, path)
    return action


def _prepared(tmp_path: Path, name: str, sharded: bool) -> Path:
    """A folder holding save A at ``name`` (copied from a template: a save per run is slow)."""
    template = tmp_path / "template"
    if not template.exists():
        template.mkdir()
        _save(template / name, A, sharded)()
    run = tmp_path / f"run-{time.monotonic_ns()}"
    shutil.copytree(template, run)
    return run / name


def _after_kill(path: Path, sharded: bool) -> str:
    """Check what a killed save left: it loads verified, verify agrees, the next save works."""
    held = _loaded(path)
    assert held in ("A", "B"), held
    if not sharded:
        result = verify_path(path)
        assert result.ok, result.to_dict()
    _save(path, C, sharded)()
    assert _loaded(path) == "C"
    if sharded:  # the killed save's leftovers were swept: every file belongs to the live save
        index = json.loads((path / "model.safetensors.index.json").read_text())
        live = set(index["weight_map"].values()) | {"model.safetensors.index.json"}
        stray = [p.name for p in path.iterdir()
                 if re.sub(r"\.(sha256|blake3|xxh128|meta\.json)(\.pending)?$", "",
                           p.name.lstrip(".")) not in live]
        assert not stray, stray
    return held


CASES = [("model.pt", False), ("model.safetensors", False), ("sharded", True)]


@pytest.mark.parametrize(("name", "sharded"), CASES, ids=["pt", "safetensors", "sharded"])
def test_every_rename_window_leaves_a_verified_checkpoint(tmp_path: Path, name: str,
                                                          sharded: bool) -> None:
    need_strace()
    renames = count_renames(_save(_prepared(tmp_path, name, sharded), B, sharded))
    assert renames == (12 if sharded else 3)
    held = []
    for k in range(1, renames + 1):
        path = _prepared(tmp_path, name, sharded)
        assert kill_at_rename(_save(path, B, sharded), k) == "killed", k
        held.append(_after_kill(path, sharded))
    # Killed on entering the checkpoint's (or the index's) rename, the old save stands;
    # on entering the records' renames after it, the new one.
    assert held == ["A"] * (renames - 2) + ["B"] * 2, held


@pytest.mark.parametrize(("name", "sharded"), CASES, ids=["pt", "safetensors", "sharded"])
def test_random_kills_leave_a_verified_checkpoint(tmp_path: Path, name: str,
                                                  sharded: bool) -> None:
    path = _prepared(tmp_path, name, sharded)
    start = time.perf_counter()
    _save(path, B, sharded)()
    took = time.perf_counter() - start
    rng = random.Random(17)
    seen = []
    for _ in range(12):
        path = _prepared(tmp_path, name, sharded)
        kill_after(_save(path, B, sharded), rng.uniform(0, took * 1.5))
        seen.append(_after_kill(path, sharded))
    assert set(seen) <= {"A", "B"}


def test_an_interrupted_save_is_not_refused_by_load_or_verify(tmp_path: Path) -> None:
    """The windows between a save's renames, built by hand: each record kind still pending."""
    path = _prepared(tmp_path, "model.pt", False)
    new = tmp_path / "new"
    new.mkdir()
    torchverity.save(B, new / "model.pt")
    shutil.copy(new / "model.pt", path)
    shutil.copy(new / "model.pt.blake3", path.parent / ".model.pt.blake3.pending")
    shutil.copy(new / "model.pt.meta.json", path.parent / ".model.pt.meta.json.pending")
    assert verify_path(path).ok and _loaded(path) == "B"  # killed before the sidecar rename
    (path.parent / ".model.pt.blake3.pending").replace(path.parent / "model.pt.blake3")
    assert verify_path(path).ok and _loaded(path) == "B"  # killed before the meta.json rename


def test_stale_temp_files_are_swept_and_ignored(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    torchverity.save(A, folder, shard_bytes=16000)
    dead = 2 ** 22 + 12345  # above the kernel's pid_max: no such process
    stale = [folder / f".model.safetensors.index.json.tmp-{dead}",
             folder / ".model-00002-of-00009.g7.safetensors.blake3.pending",
             folder / "model-00003-of-00009.g7.safetensors"]
    for p in stale:
        p.write_text("left by a killed save")
    assert _loaded(folder) == "A"
    torchverity.save(B, folder, shard_bytes=16000)
    assert _loaded(folder) == "B"
    assert not [p for p in stale if p.exists()]


def _remount_read_only(where: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)


@pytest.mark.parametrize(("name", "sharded"), CASES, ids=["pt", "safetensors", "sharded"])
def test_a_disk_that_fills_mid_save_leaves_the_previous_checkpoint(tmp_path: Path, name: str,
                                                                   sharded: bool) -> None:
    with tmpfs(tmp_path / "disk", "600k") as disk:
        path = disk / name
        _save(path, A, sharded)()
        big = _state(5.0, n=8, size=20000)  # 640 kB: does not fit beside A
        with pytest.raises(CheckpointWriteError) as caught:
            _save(path, big, sharded)()
        assert caught.value.previous_intact and "intact" in caught.value.message
        assert "disk is full" in caught.value.message
        assert _loaded(path) == "A"
        _save(path, B, sharded)()  # the failed save gave its space back
        assert _loaded(path) == "B"


@pytest.mark.parametrize(("name", "sharded"), CASES, ids=["pt", "safetensors", "sharded"])
def test_a_read_only_folder_is_a_write_error(tmp_path: Path, name: str, sharded: bool) -> None:
    with tmpfs(tmp_path / "disk", "1m") as disk:
        _save(disk / name, A, sharded)()
        _remount_read_only(disk)
        with pytest.raises(CheckpointWriteError) as caught:
            _save(disk / name, B, sharded)()
        assert "read-only" in caught.value.message and caught.value.previous_intact
        if sharded:  # save() makes a sharded checkpoint's folder
            with pytest.raises(CheckpointWriteError) as caught:
                _save(disk / "new" / name, B, sharded)()
            assert not caught.value.previous_intact and "no checkpoint was created" in str(
                caught.value)
        assert _loaded(disk / name) == "A"


def test_the_documented_shard_names_are_the_ones_written(tmp_path: Path) -> None:
    """docs/formats/checkpoint.md: HF names first, then ``.gN.`` and ``generation: N``."""
    doc = (Path(__file__).parents[2] / "docs/formats/checkpoint.md").read_text()
    assert "model-00001-of-00003.gN.safetensors" in doc and '"generation": N' in doc
    folder = tmp_path / "sharded"
    for generation in (1, 2, 3):
        torchverity.save(A, folder, shard_bytes=16000)
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        tag = f".g{generation}" if generation > 1 else ""
        assert sorted(set(index["weight_map"].values())) == [
            f"model-0000{i}-of-00003{tag}.safetensors" for i in (1, 2, 3)]
        assert index["metadata"].get("generation", 1) == generation
        assert sorted(p.name for p in folder.glob("model-*.safetensors")) == sorted(
            set(index["weight_map"].values()))


def test_a_save_replaces_a_folder_whose_index_is_damaged(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    torchverity.save(A, folder, shard_bytes=16000)
    (folder / "model.safetensors.index.json").write_text("{torn")
    torchverity.save(B, folder, shard_bytes=16000)
    assert _loaded(folder) == "B"
