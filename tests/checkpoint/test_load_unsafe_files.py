"""torchverity.load of a file whose globals run commands: refused naming them, with the
inert route as the next step, never "trust it"."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import pickle_corpus
import torchverity
from torchverity.errors import UnsafeFileError


@pytest.mark.parametrize("kind", ["zip", "legacy", "pickle"])
def test_an_unsafe_file_is_refused_naming_its_globals_with_the_inert_route(
        tmp_path: Path, kind: str, run_cli: Callable[..., Any]) -> None:
    sentinel = tmp_path / "SENTINEL"
    evil = pickle_corpus.unsafe_weights(tmp_path / "files", sentinel)[kind]
    with pytest.raises(UnsafeFileError) as refused:
        torchverity.load(evil.path, sidecar="ignore")
    error = refused.value
    assert f"it names globals that run code or touch the system: {evil.offender} (" \
        in error.message, error.message
    assert "likely cause" not in error.message and "custom class" not in error.message
    assert error.globals_found == [evil.offender]
    hint = error.hint or ""
    assert hint.startswith("do not load it;") and "trust_sha256" not in hint, hint
    step = f"torchverity migrate {evil.path} {evil.path}.safetensors"
    assert step in hint
    assert run_cli(*step.split()[1:]).code == 0  # the step it gives works, and runs nothing
    loaded = torchverity.load(f"{evil.path}.safetensors")
    assert torch.equal(loaded["model.w"], torch.arange(6.0).reshape(2, 3))
    assert not sentinel.exists()
