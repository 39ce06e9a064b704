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


class _Config:
    """A custom class in a checkpoint: weights_only refuses it, its code is not malicious."""

    def __init__(self) -> None:
        self.width = 4


def test_refusals_give_the_cause_not_torchs_advice_to_turn_weights_only_off(
        tmp_path: Path) -> None:
    """torch's message goes on to suggest weights_only=False; the refusal gives the cause, and
    the digest to trust comes from the publisher, not from inspecting the file itself."""
    scripted = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), scripted)
    custom = tmp_path / "custom.pt"
    torch.save({"w": torch.ones(2), "config": _Config()}, custom)
    for path, cause in ((scripted, "TorchScript archive"), (custom, "outside its allowlist")):
        with pytest.raises(UnsafeFileError) as refused:
            torchverity.load(path, sidecar="ignore")
        message, hint = refused.value.message, refused.value.hint or ""
        assert cause in message, message
        assert "weights_only` set to `False`" not in message and "two options" not in message
        assert "inspect shows" not in hint, hint
    assert "trust_sha256=<the SHA-256 they list>" in hint
    assert "torchverity hash --algo sha256 FILE" in hint
