"""``inspect`` of a file whose bytes are damaged or cut short names what is wrong and gives
the restore step (not a step that runs inspect again)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

RESTORE = "next: restore the file from a good copy or download it again (torchverity verify"


def _zero_header(path: Path) -> str:
    path.write_bytes(bytes(8))  # a length of 0 and no header: the rest was never written
    return "a damaged .safetensors file: its header length is 0"


def _cut_safetensors(path: Path) -> str:
    save_file({"w": torch.ones(1000)}, str(path))
    path.write_bytes(path.read_bytes()[:100])
    return "tensors need 4000 data bytes but the file holds 28 (truncated?)"


def _cut_zip(path: Path) -> str:
    torch.save({"w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:1500])
    return "malformed"


@pytest.mark.parametrize(("name", "make", "code"), [
    ("model.safetensors", _zero_header, 2),
    ("model.safetensors", _cut_safetensors, 1),
    ("model.pt", _cut_zip, 1),
])
def test_inspect_of_a_damaged_file_names_it_and_gives_the_restore_step(
        tmp_path: Path, run_cli: Callable[..., Any], name: str,
        make: Callable[[Path], str], code: int) -> None:
    path = tmp_path / name
    said = make(path)
    result = run_cli("inspect", path)
    assert result.code == code, (result.out, result.err)
    assert said in result.out + result.err
    assert f"{RESTORE} {path} tells a good copy" in result.err
    assert "Traceback" not in result.err
