"""The threads and files behind one save: long-lived workers, the replaced file let go."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchverity
from torchverity.checkpoint._hashing_reader import lane
from torchverity.digest import digest_file


def _settled() -> None:
    """Wait until the background work of earlier saves is done (each lane runs in order)."""
    for name in ("release", "sync"):
        lane(name).submit(lambda: None).result()


def _open_deleted(folder: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith(os.fspath(folder)) and link.endswith("(deleted)"):
            out.append(link)
    return out


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_the_replaced_file_is_closed_and_its_mode_kept(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torchverity.save({"w": torch.ones(1000)}, path)
    path.chmod(0o640)
    for i in range(3):
        report = torchverity.save({"w": torch.full((1000,), float(i))}, path)
        assert report.digest == digest_file(path).hexdigest
    _settled()
    assert _open_deleted(tmp_path) == []  # the old versions were freed, none is held
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert torch.equal(torchverity.load(path)["w"], torch.full((1000,), 2.0))


_FORKED = """
import os, sys, time
from pathlib import Path
import torch
import torchverity

folder = Path(sys.argv[1])
state = {"w": torch.randn(300, 300)}
torchverity.save(state, folder / "parent.pt")
torchverity.load(folder / "parent.pt")
pid = os.fork()
if pid == 0:
    try:
        torchverity.save(state, folder / "child.pt")
        ok = torch.equal(torchverity.load(folder / "child.pt")["w"], state["w"])
        os._exit(0 if ok else 1)
    except BaseException:
        os._exit(2)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
os.waitpid(pid, 0)
sys.exit(3)
"""


def test_a_forked_child_saves_and_loads_with_its_own_workers(tmp_path: Path) -> None:
    """The parent's worker threads do not exist in a fork: the child starts its own. In a
    process of its own: a test worker whose earlier tests ran torch's OpenMP threads would
    hang any forked child in its next parallel torch op, whatever this package does."""
    run = subprocess.run([sys.executable, "-c", _FORKED, str(tmp_path)], timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, check=False)
    assert run.returncode != 3, "the forked child hung waiting for its parent's worker threads"
    assert run.returncode == 0, run.stderr
