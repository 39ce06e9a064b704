"""``torchverity serve --weights`` refuses at start weights that are not weights, naming what
they are before asking for a recorded digest (recording the digest of a Git LFS pointer or a
joblib file would not make it servable)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import pytest

MODEL_SOURCE = '''
import torch

def build():
    model = torch.nn.Linear(4, 2)
    model.input_spec = {"x": ("float32", (-1, 4))}
    return model
'''


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    (tmp_path / "tvweights_serve_model.py").write_text(MODEL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "b" * 64 + "\nsize 99\n")
    joblib.dump({"w": np.ones(3)}, tmp_path / "w.joblib")
    joblib.dump({"w": np.ones(3)}, tmp_path / "wz.joblib", compress=3)
    return {"a Git LFS pointer file": tmp_path / "hub",
            "a joblib file (joblib.dump)": tmp_path / "w.joblib",
            "a zlib-compressed joblib file": tmp_path / "wz.joblib"}


def test_serve_names_weights_that_are_not_weights(served: dict[str, Path],
                                                  run_cli: Callable[..., Any]) -> None:
    for named, weights in served.items():
        args = ("--model", "tvweights_serve_model:build", "--weights", weights, "--check")
        result = run_cli("serve", *args)
        assert result.code == 2, result.err
        assert named in result.err and "Traceback" not in result.err
        assert "no recorded digest" not in result.err and "hash --write" not in result.err
        doc = json.loads(run_cli("serve", "--json", *args).out)
        assert named in json.dumps(doc)
