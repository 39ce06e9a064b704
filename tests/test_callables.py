"""The user's model factory (``--model MODULE:CALLABLE`` of serve, golden and batch) failing,
at import or when called: named as the user's code failing, exit 2, never an internal error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity

FACTORIES = '''
import torch

def build(*args):
    raise ValueError("hidden size 37 does not divide into 4 heads")

def good(*args):
    return torch.nn.Linear(4, 2)
'''


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the factories' modules, the current folder (as uvicorn resolves apps)."""
    (tmp_path / "tv_factories.py").write_text(FACTORIES)
    (tmp_path / "tv_broken_import.py").write_text("raise RuntimeError('config.yaml not found')\n")
    torchverity.save(torch.nn.Linear(4, 2).state_dict(), tmp_path / "w.pt")
    (tmp_path / "inputs").mkdir()
    torch.save(torch.ones(4), tmp_path / "inputs" / "a.pt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _commands(spec: str, root: Path) -> list[list[str]]:
    return [
        ["serve", "--model", spec, "--weights", str(root / "w.pt"), "--check"],
        ["golden", "record", "--model", spec, "--golden", str(root / "g.json"),
         "--shape", "1,4"],
        ["batch", "run", "--inputs", str(root / "inputs"), "--model", spec,
         "--weights", str(root / "w.pt"), "--out", str(root / "out")],
    ]


@pytest.mark.parametrize(("spec", "said"), [
    ("tv_factories:build", "calling 'tv_factories:build' raised ValueError: hidden size 37"),
    ("tv_broken_import:build", "importing module 'tv_broken_import' raised RuntimeError: "
                               "config.yaml not found"),
])
def test_a_failing_model_factory_is_named_as_the_users_code(
        models: Path, run_cli: Callable[..., Any], spec: str, said: str) -> None:
    for argv in _commands(spec, models):
        done = run_cli(*argv)
        assert done.code == 2, (argv, done.err)
        assert said in done.err and "internal error" not in done.err, (argv, done.err)
        assert "TORCHVERITY_DEBUG=1" in done.err
