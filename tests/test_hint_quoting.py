"""A ``next:`` step names paths as one shell word each, so a path with spaces, quotes or
non-ASCII letters can be pasted into a shell as printed and does what the step says."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity
from torchverity.errors import TorchVerityError


def _next_command(err: str) -> list[str]:
    step = next(line for line in err.splitlines() if line.strip().startswith("next:"))
    command = step.split("next:", 1)[1]
    command = command[command.index("torchverity "):]
    for end in (" (or ", "; "):  # the first command of the step
        command = command.split(end, 1)[0]
    return shlex.split(command)


def test_the_hash_step_for_a_missing_sidecar_runs_as_printed(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "my models ü" / "it's a ckpt.pt"
    path.parent.mkdir()
    torch.save({"w": torch.ones(3)}, path)
    refused = run_cli("verify", path)
    assert refused.code == 2
    words = _next_command(refused.err)
    assert words == ["torchverity", "hash", "--write", str(path)]
    assert run_cli(*words[1:]).code == 0
    assert run_cli("verify", path).code == 0


def test_a_load_refused_for_a_missing_sidecar_names_the_file_as_one_word(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "my models ü" / "final weights.pt"
    path.parent.mkdir()
    torch.save({"w": torch.ones(3)}, path)
    with pytest.raises(TorchVerityError) as info:
        torchverity.load(path, sidecar="require")
    hint = info.value.hint or ""
    assert f"torchverity hash --write {shlex.quote(str(path))}" in hint
    assert run_cli("hash", "--write", path).code == 0
    assert torch.equal(torchverity.load(path, sidecar="require")["w"], torch.ones(3))
