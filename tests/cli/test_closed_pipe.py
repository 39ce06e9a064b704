"""A reader that stops early (``torchverity inspect X | head -1``): the command runs to its
end and exits with its own verdict, with no internal error and nothing on stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchverity
from torchverity.inject import flip_bit


def _closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with its stdout a pipe whose reader has already gone."""
    proc = subprocess.Popen([sys.executable, "-m", "torchverity", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout=120), "", err)


@pytest.mark.parametrize("flag", [[], ["--json"]])
def test_a_closed_pipe_ends_the_output_not_the_command(tmp_path: Path, flag: list[str]) -> None:
    path = tmp_path / "model.pt"
    torchverity.save({f"layer{i}": torch.zeros(2) for i in range(200)}, path)
    done = _closed_pipe("inspect", "--limit", "0", *flag, str(path))
    assert (done.returncode, done.stderr) == (0, "")
    flip_bit(path, path.stat().st_size - 300, 2)
    done = _closed_pipe("verify", *flag, str(path))
    assert done.returncode == 1  # the verdict, not a failed write
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
