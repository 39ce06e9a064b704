"""A file that exists but cannot be read: exit 2 with the reason and a step that fits,
never a traceback, from every command that opens it (plain and --json)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch


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
