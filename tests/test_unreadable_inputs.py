"""A file that exists but cannot be read: exit 2 with the reason and a step that fits,
never a traceback, from every command that opens it (plain and --json); a folder scan
names it and still judges every other file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pickle_corpus


def _unprivileged() -> list[str]:
    """A prefix that runs a command without root's right to read any file."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: every file is readable")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


def test_unreadable_file_gets_a_permissions_step(tmp_path: Path) -> None:
    path = tmp_path / "my run" / "model ü.pt"
    path.parent.mkdir()
    torch.save({"w": torch.ones(2)}, path)
    path.chmod(0)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TORCHVERITY_DEBUG", None)
    commands = [["scan", path], ["scan", path.parent], ["inspect", path], ["fingerprint", path],
                ["migrate", path, tmp_path / "out.safetensors"]]
    for args in commands:
        for extra in ([], ["--json"]):
            res = subprocess.run([*_unprivileged(), sys.executable, "-m", "torchverity",
                                  *map(str, args), *extra], env=env, capture_output=True,
                                 text=True, timeout=120)
            assert res.returncode == 2, (args, res.stdout, res.stderr)
            assert "Traceback" not in res.stderr and "cannot read: Permission denied" in res.stderr
            assert "next: check its permissions (ls -l '" in res.stderr, res.stderr
            if extra:
                assert json.loads(res.stdout)["ok"] is False


def _scan(*args: Path | str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TORCHVERITY_DEBUG", None)
    return subprocess.run([*_unprivileged(), sys.executable, "-m", "torchverity", "scan",
                           *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_an_unreadable_file_does_not_stop_a_folder_scan(tmp_path: Path) -> None:
    folder = tmp_path / "run 1"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "good.pt")
    torch.save({"w": torch.ones(2)}, folder / "z_locked.pt")
    (folder / "z_locked.pt").chmod(0)
    locked_dir = folder / "locked"
    locked_dir.mkdir()
    torch.save({"w": torch.ones(2)}, locked_dir / "inside.pt")
    locked_dir.chmod(0)
    try:
        res = _scan(folder)
        assert res.returncode == 2, (res.stdout, res.stderr)
        assert f"{folder / 'good.pt'}: safe (torch-zip)" in res.stdout
        for name in ("z_locked.pt", "locked"):
            assert f"{folder / name}: unreadable (not scanned)" in res.stdout
            assert f"{folder / name}: cannot read: Permission denied (not scanned)" in res.stderr
        assert ": safe" not in res.stdout.replace(f"{folder / 'good.pt'}: safe", "")
        assert "next: check its permissions (ls -l '" in res.stderr
        assert "scanned 1 files: 1 safe; 2 unreadable" in res.stderr
        sentinel = tmp_path / "SENTINEL"
        evil = next(c for c in pickle_corpus.malicious(tmp_path / "bad", sentinel)
                    if c.name == "torch_zip_reduce").path
        shutil.copy(evil, folder / "evil.pt")
        res = _scan(folder, "--json")
        assert res.returncode == 1, res.stderr  # a failed check outranks the unreadable file
        doc = json.loads(res.stdout)
        verdicts = {Path(f["path"]).name: f["verdict"] for f in doc["files"]}
        assert verdicts == {"evil.pt": "unsafe", "good.pt": "safe"}
        assert sorted(Path(u["path"]).name for u in doc["unreadable"]) == ["locked", "z_locked.pt"]
        assert doc["ok"] is False and not sentinel.exists()
    finally:
        locked_dir.chmod(0o755)


def test_an_unreadable_file_among_named_files(tmp_path: Path) -> None:
    good, locked = tmp_path / "good.pt", tmp_path / "locked.pt"
    torch.save({"w": torch.ones(2)}, good)
    torch.save({"w": torch.ones(2)}, locked)
    locked.chmod(0)
    res = _scan(locked, good)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert f"{good}: safe" in res.stdout and f"{locked}: unreadable (not scanned)" in res.stdout
    good.unlink()
    res = _scan(tmp_path)  # a folder of one unreadable file: named, not called empty
    assert res.returncode == 2 and f"{locked}: unreadable (not scanned)" in res.stdout
    assert "nothing to scan" not in res.stderr, res.stderr
