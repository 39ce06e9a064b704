"""``torchverity demo`` runs every step and passes: a skipped step is a failure unless asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest


@pytest.mark.slow
def test_the_whole_demo_passes_with_no_step_skipped() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torchverity", "demo", "--json"], capture_output=True,
        text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    verdicts = {s["name"]: s["verdict"] for s in result["steps"]}
    assert result["ok"] and len(verdicts) >= 10
    assert set(verdicts.values()) == {"passed"}, verdicts
    assert {"files", "checkpoint", "provenance", "pickle", "protect", "guard", "distributed",
            "inference", "serve", "batch"} <= set(verdicts)


def test_skip_is_said_in_the_summary(run_cli: Callable[..., Any]) -> None:
    result = run_cli("demo", "--only", "files,serve", "--skip", "serve")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert any(line.startswith("passed") and " files " in line for line in lines)
    assert any(line.startswith("skipped") and " serve " in line and "--skip" in line
               for line in lines)
    assert lines[-1] == "demo finished: 1 of 2 steps passed, 1 skipped"


def test_an_unknown_step_name_is_a_usage_error(run_cli: Callable[..., Any]) -> None:
    result = run_cli("demo", "--skip", "serving")
    assert result.code == 2
    assert "no step named serving (--skip)" in result.err
    assert "serve" in result.err.split("the steps are:")[1]
