"""The provenance demo step runs and shows what it promises."""

from __future__ import annotations

import io
from pathlib import Path

import pytest


def test_provenance_demo_step_passes(tmp_path: Path) -> None:
    pytest.importorskip("model_signing")
    from torchverity.cli._output import Output
    from torchverity.demo import run_demo

    err = io.StringIO()
    summary = run_demo(tmp_path, Output(stdout=io.StringIO(), stderr=err), only=["provenance"])
    assert [(s.name, s.verdict) for s in summary] == [("provenance", "passed")], err.getvalue()
    text = err.getvalue()
    assert "ok: the signature refuses it and names model.pt" in text
    assert "ok: torchverity.load on the cached path refuses the damaged blob" in text
    assert "reused 2 recorded digests" in text
