"""``torchverity serve`` and the input spec: a model that declares none gets a spec read off
its first layer as the hint; a spec the model refuses is said at start (a probe of zeros),
not left to fail the first request."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchverity

MODEL_SOURCE = '''
import torch

def classifier():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
'''


@pytest.fixture
def weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "tvspec_models.py").write_text(MODEL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from tvspec_models import classifier  # type: ignore[import-not-found]

    path = tmp_path / "model.pt"
    torchverity.save(classifier().state_dict(), path)
    return path


def test_a_missing_spec_is_suggested_from_the_first_layer(
        weights: Path, run_cli: Callable[..., Any]) -> None:
    res = run_cli("serve", "--check", "--model", "tvspec_models:classifier", "--weights", weights)
    assert res.code == 2 and "--input-spec x:float32:-1,16 (-1 = any size)" in res.err, res.err


def test_a_spec_the_model_refuses_is_said_at_start(
        weights: Path, run_cli: Callable[..., Any]) -> None:
    base = ("serve", "--check", "--model", "tvspec_models:classifier", "--weights", weights)
    wrong = run_cli(*base, "--input-spec", "x:float32:-1,4")
    assert wrong.code == 0  # a probe is no proof: the model may take other sizes
    assert "raised RuntimeError" in wrong.err and "requests of that shape will fail" in wrong.err
    doc = json.loads(run_cli(*base, "--json", "--input-spec", "x:float32:-1,4").out)
    assert any("requests of that shape will fail" in w for w in doc["warnings"])
    right = run_cli(*base, "--input-spec", "x:float32:-1,16")
    assert right.code == 0 and "will fail" not in right.err, right.err
    assert torch.is_grad_enabled()  # the probe ran under no_grad and left it as it was
