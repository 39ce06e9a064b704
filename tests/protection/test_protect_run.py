"""``torchverity run``: a command run with the switch on in every Python process it starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from protect_helpers import SRC

import torchverity


def _run(hooked_python: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([hooked_python, "-m", "torchverity", "run", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env=env)


LOADER = """
import sys, torch
try:
    state = torch.load(sys.argv[1])
except Exception:
    print("load failed, use default init")
"""


def test_refuse_fails_a_run_that_swallowed_a_damaged_checkpoint(
        hooked_python: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "model.pt"
    torchverity.save({"w": torch_ones()}, ckpt)
    (tmp_path / "loader.py").write_text(LOADER)
    clean = _run(hooked_python, tmp_path, "--policy", "refuse", "--", hooked_python,
                 "loader.py", str(ckpt))
    assert clean.returncode == 0, clean.stderr
    assert "1 protected process(es), exit status 0: 1 verified load(s)" in clean.stderr
    from protect_helpers import flip_tensor_bit

    flip_tensor_bit(ckpt)
    bad = _run(hooked_python, tmp_path, "--policy", "refuse", "--json", "--log",
               str(tmp_path / "events.jsonl"), "--", hooked_python, "loader.py", str(ckpt))
    assert bad.returncode == 1
    assert "load failed, use default init" in bad.stdout
    summary = json.loads(bad.stdout[bad.stdout.index("{"):])
    assert summary["ok"] is False and summary["counts"]["refused"] == 1
    [swallowed] = summary["swallowed"]
    assert swallowed["path"] == str(ckpt) and swallowed["caught_in"].endswith(
        "loader.py:5 (<module>)")
    kinds = [json.loads(x)["kind"] for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kinds[0] == "started" and "swallowed" in kinds


def test_warn_reports_and_keeps_the_commands_exit_status(
        hooked_python: str, tmp_path: Path) -> None:
    pkg = tmp_path / "job"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(
        "import sys, torch\n"
        "torch.load(sys.argv[1], weights_only=False)\n"
        "sys.exit(int(sys.argv[2]))\n")
    ckpt = tmp_path / "model.pt"
    torchverity.save({"w": torch_ones()}, ckpt)
    done = _run(hooked_python, tmp_path, "-m", "job", str(ckpt), "4")
    assert done.returncode == 4
    assert "torch.load(weights_only=False) of" in done.stderr
    assert "1 unsafe load(s)" in done.stderr


def test_no_command_is_a_usage_error(hooked_python: str, tmp_path: Path) -> None:
    done = _run(hooked_python, tmp_path, "--policy", "refuse")
    assert done.returncode == 2
    assert "torchverity run needs a command" in done.stderr


def test_a_command_without_the_hook_is_called_out(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "torchverity", "run", "--", "/bin/true"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0
    assert "no protected Python process started" in done.stderr


def torch_ones() -> object:
    import torch

    return torch.ones(16)


def test_a_command_that_does_not_exist_is_an_input_error(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "torchverity", "run", "--", "no-such-trainer"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "no-such-trainer: command not found" in done.stderr and "Traceback" not in done.stderr
