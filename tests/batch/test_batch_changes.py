"""Inputs that change between runs, through the real CLI, journal and files.

A folder that gained inputs: the rerun processes the new ones and ``batch verify``
reports them before that. An input edited after its output was committed: verify
re-hashes the inputs and names it, the rerun redoes it. ``--retry-failed`` retries
failed items without redoing the committed ones. Clean reruns change nothing.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

MODELS = textwrap.dedent(
    """
    import os

    def build():
        def fn(item):
            if item.data.startswith(b"bad") and not os.environ.get("TV_CHANGES_HEALED"):
                raise RuntimeError("cannot process " + item.key)
            return item.data.upper()
        return fn
    """
)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    (tmp_path / "tv_changes_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(4):
        (inputs / f"{i}.txt").write_text(f"item {i}")
    return {"inputs": inputs, "out": tmp_path / "out"}


def _run(run_cli, job: dict[str, Path], *extra: str):
    return run_cli("batch", "run", "--inputs", job["inputs"], "--model",
                   "tv_changes_models:build", "--out", job["out"], "--retries", "0",
                   "--json", *extra)


def _verify(run_cli, job: dict[str, Path]) -> tuple[int, list[dict[str, str]]]:
    result = run_cli("batch", "verify", "--json", job["out"])
    return result.code, json.loads(result.out).get("problems", [])


def test_new_inputs_are_reported_then_processed(run_cli, job: dict[str, Path]) -> None:
    assert _run(run_cli, job).code == 0
    assert _verify(run_cli, job) == (0, [])  # clean: no false alarm
    (job["inputs"] / "4.txt").write_text("item 4")
    code, problems = _verify(run_cli, job)
    assert code == 1 and [(p["kind"], p["key"]) for p in problems] == [("new-input", "4.txt")]
    rerun = _run(run_cli, job)
    assert rerun.code == 0 and json.loads(rerun.out)["total"] == 5
    assert (job["out"] / "data" / "4.txt.out").read_bytes() == b"ITEM 4"
    assert _verify(run_cli, job) == (0, [])


def test_an_edited_input_is_reported_and_redone(run_cli, job: dict[str, Path]) -> None:
    assert _run(run_cli, job).code == 0
    (job["inputs"] / "2.txt").write_text("item 2, corrected")
    code, problems = _verify(run_cli, job)
    assert code == 1 and [(p["kind"], p["key"]) for p in problems] == [("input-changed",
                                                                         "2.txt")]
    assert "after its output was committed" in problems[0]["detail"]
    rerun = _run(run_cli, job)
    assert rerun.code == 0 and json.loads(rerun.out)["processed"] == 1
    assert (job["out"] / "data" / "2.txt.out").read_bytes() == b"ITEM 2, CORRECTED"
    assert _verify(run_cli, job) == (0, [])
    again = _run(run_cli, job)  # nothing changed: nothing redone
    assert again.code == 0 and json.loads(again.out)["processed"] == 0


def test_retry_failed_without_force(run_cli, job: dict[str, Path],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (job["inputs"] / "9.txt").write_text("bad input")
    first = _run(run_cli, job)
    assert first.code == 1 and json.loads(first.out)["failed"] == 1
    monkeypatch.setenv("TV_CHANGES_HEALED", "1")
    plain = _run(run_cli, job)  # a plain rerun keeps the verdict
    assert plain.code == 1 and json.loads(plain.out)["processed"] == 0
    retried = _run(run_cli, job, "--retry-failed")
    report = json.loads(retried.out)
    assert retried.code == 0 and report["processed"] == 1 and report["committed"] == 5
    assert (job["out"] / "data" / "9.txt.out").read_bytes() == b"BAD INPUT"
