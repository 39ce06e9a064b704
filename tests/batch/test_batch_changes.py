"""Inputs that change between runs, through the real CLI, journal and files.

A folder that gained inputs: the rerun processes the new ones and ``batch verify``
reports them before that. An input edited after its output was committed: verify
re-hashes the inputs and names it, the rerun redoes it. An input deleted after its
output was committed: verify and the rerun name its stale output, which only
``--prune-removed`` deletes. ``--retry-failed`` retries failed items without redoing
the committed ones. Clean reruns change nothing. Every count is of the inputs that
exist, and every failure ends with the command to run next.
"""

from __future__ import annotations

import json
import shlex
import textwrap
from pathlib import Path

import pytest

FORMAT_DOC = Path(__file__).parents[2] / "docs/formats/batch.md"

MODELS = textwrap.dedent(
    """
    import os
    import time

    def build():
        time.sleep(float(os.environ.get("TV_CHANGES_BUILD_DELAY", "0")))
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


def test_verify_counts_the_inputs_that_exist(run_cli, job: dict[str, Path]) -> None:
    assert _run(run_cli, job).code == 0
    (job["inputs"] / "4.txt").write_text("item 4")
    report = json.loads(run_cli("batch", "verify", "--json", job["out"]).out)
    assert (report["items"], report["committed"]) == (5, 4)
    human = run_cli("batch", "verify", job["out"])
    assert human.code == 1 and "(4 of 5 inputs committed)" in human.out


def test_a_removed_input_is_reported_and_pruned_only_on_request(run_cli,
                                                                job: dict[str, Path]) -> None:
    assert _run(run_cli, job).code == 0
    stale = job["out"] / "data" / "1.txt.out"
    (job["inputs"] / "1.txt").unlink()
    code, problems = _verify(run_cli, job)
    assert code == 1 and [(p["kind"], p["key"]) for p in problems] == [("input-removed",
                                                                         "1.txt")]
    assert "data/1.txt.out is stale" in problems[0]["detail"]
    assert json.loads(run_cli("batch", "verify", "--json", job["out"]).out)["items"] == 3

    kept = _run(run_cli, job)  # a plain rerun deletes nothing, and says why it is not ok
    report = json.loads(kept.out)
    assert kept.code == 1 and stale.read_bytes() == b"ITEM 1"
    assert (report["removed"], report["pruned"], report["total"]) == (["1.txt"], [], 3)
    assert [(p["key"], p["state"]) for p in report["problems"]] == [("1.txt", "input-removed")]
    assert "--prune-removed" in report["next_step"]

    pruned = _run(run_cli, job, "--prune-removed")
    report = json.loads(pruned.out)
    assert pruned.code == 0 and not stale.exists()
    assert (report["removed"], report["pruned"], report["total"]) == ([], ["1.txt"], 3)
    assert "data/1.txt.out" not in (job["out"] / "manifest-sha256.txt").read_text()
    assert _verify(run_cli, job) == (0, [])
    restored = _run(run_cli, job)  # the job goes on as one of three inputs
    assert restored.code == 0 and json.loads(restored.out)["processed"] == 0


def test_an_input_missing_from_a_list_file_is_reported(run_cli, job: dict[str, Path]) -> None:
    listing = job["inputs"].parent / "inputs.txt"
    listing.write_text("in/0.txt\nin/1.txt\nin/2.txt\n")
    job = {**job, "inputs": listing}
    assert _run(run_cli, job).code == 0
    (listing.parent / "in" / "2.txt").unlink()
    code, problems = _verify(run_cli, job)
    assert code == 1 and [(p["kind"], p["key"]) for p in problems] == [("input-removed",
                                                                         "in/2.txt")]


def test_failures_end_with_the_command_that_retries_them(
    run_cli, job: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    spaced = job["inputs"].rename(job["inputs"].with_name("my inputs"))
    job = {**job, "inputs": spaced}
    (spaced / "9.txt").write_text("bad input")
    args = ["batch", "run", "--inputs", spaced, "--model", "tv_changes_models:build",
            "--out", job["out"], "--retries", "0"]
    first = run_cli(*args)
    assert first.code == 1
    command = (f"torchverity batch run --inputs {shlex.quote(str(spaced))} --model "
               f"tv_changes_models:build --out {job['out']} --retries 0 --retry-failed")
    step = f"next: fix the failed inputs or the model, then rerun: {command}"
    assert first.out.splitlines()[-1] == step
    verified = run_cli("batch", "verify", job["out"])
    assert verified.code == 1 and verified.out.splitlines()[-1] == step

    monkeypatch.setenv("TV_CHANGES_HEALED", "1")
    words = shlex.split(command)
    assert words[0] == "torchverity"
    healed = run_cli(*words[1:])  # the step as printed runs, and finishes the job
    assert healed.code == 0 and "ok: 5 outputs committed" in healed.out


def test_the_resume_line_counts_new_and_edited_inputs(run_cli, job: dict[str, Path]) -> None:
    assert _run(run_cli, job).code == 0
    (job["inputs"] / "4.txt").write_text("item 4")
    (job["inputs"] / "2.txt").write_text("item 2, corrected")
    rerun = _run(run_cli, job)
    report = json.loads(rerun.out)
    assert (report["new_inputs"], report["edited_inputs"]) == (1, 1)
    (job["inputs"] / "5.txt").write_text("item 5")
    human = run_cli("batch", "run", "--inputs", job["inputs"], "--model",
                    "tv_changes_models:build", "--out", job["out"])
    assert "0 damaged outputs redone, 1 new inputs queued, 0 edited inputs redone" in human.err


def test_stats_count_failed_items_and_rate_over_the_runs_time(
    run_cli, job: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    (job["inputs"] / "9.txt").write_text("bad input")
    monkeypatch.setenv("TV_CHANGES_BUILD_DELAY", "0.5")  # start-up the rate must include
    result = _run(run_cli, job)
    report = json.loads(result.out)
    assert result.code == 1 and (report["committed"], report["failed"]) == (4, 1)
    assert report["processed"] == 5
    assert report["seconds"] >= 0.5
    assert report["items_per_s"] == pytest.approx(5 / report["seconds"], abs=0.1)


def test_prune_refuses_inputs_it_cannot_list(run_cli, job: dict[str, Path]) -> None:
    assert _run(run_cli, job).code == 0
    for name in ("0.txt", "1.txt", "2.txt", "3.txt"):  # an unmounted share looks empty
        (job["inputs"] / name).unlink()
    result = run_cli("batch", "run", "--inputs", job["inputs"], "--model",
                     "tv_changes_models:build", "--out", job["out"], "--prune-removed")
    assert result.code == 2 and "nothing was pruned" in result.err
    assert len(list((job["out"] / "data").iterdir())) == 4
    assert _verify(run_cli, job) == (0, [])  # unlisted inputs are not removed ones


def _another_job(job: dict[str, Path], name: str) -> dict[str, Path]:
    """A second job beside ``job``, with the same model and an empty inputs folder."""
    inputs = job["inputs"].parent / f"{name}_in"
    inputs.mkdir()
    return {"inputs": inputs, "out": job["out"].parent / f"{name}_out"}


def test_failed_attempts_are_counted_per_run(run_cli, job: dict[str, Path]) -> None:
    """--retries bounds one run: verify reports that run's attempts, and the total apart
    (an attempt that once committed the item counts in the total only)."""
    assert _run(run_cli, job).code == 0
    (job["inputs"] / "1.txt").write_text("bad bytes")
    failed = json.loads(_run(run_cli, job, "--retries", "1").out)
    [problem] = failed["problems"]
    assert (problem["attempts"], problem["run_attempts"]) == (3, 2)
    documented = FORMAT_DOC.read_text().split('"problems": [{', 1)[1].split("}]", 1)[0]
    assert all(f'"{key}"' in documented for key in problem), documented
    _, [found] = _verify(run_cli, job)
    assert found["detail"].startswith("after 2 attempts in its latest run (3 in all): ")
    again = json.loads(_run(run_cli, job, "--retries", "1", "--retry-failed").out)
    assert (again["problems"][0]["attempts"], again["problems"][0]["run_attempts"]) == (5, 2)
    _, [found] = _verify(run_cli, job)
    assert found["detail"].startswith("after 2 attempts in its latest run (5 in all): ")
    # A rerun that does not try the item again leaves the latest run's count as it was.
    (job["inputs"] / "4.txt").write_text("item 4")
    assert json.loads(_run(run_cli, job).out)["problems"][0]["run_attempts"] == 2
    fresh = _another_job(job, "fresh")
    (fresh["inputs"] / "0.txt").write_text("bad")
    assert _run(run_cli, fresh).code == 1
    _, [only] = _verify(run_cli, fresh)
    assert only["detail"].startswith("after 1 attempt: ")


def test_verify_counts_only_intact_outputs_as_committed(run_cli, job: dict[str, Path]) -> None:
    assert _run(run_cli, job).code == 0
    (job["out"] / "data" / "0.txt.out").unlink()
    (job["out"] / "data" / "1.txt.out").write_bytes(b"ITEM 1, DAMAGED")
    (job["inputs"] / "2.txt").write_text("item 2, edited")
    report = json.loads(run_cli("batch", "verify", "--json", job["out"]).out)
    assert {p["kind"] for p in report["problems"]} == {"missing-output", "output-mismatch",
                                                       "input-changed"}
    assert (report["items"], report["committed"]) == (4, 1)
    human = run_cli("batch", "verify", job["out"])
    assert human.code == 1 and "(1 of 4 inputs committed)" in human.out


def test_verify_of_a_folder_that_is_not_there_says_so(run_cli, tmp_path: Path) -> None:
    for path in (tmp_path / "nope", tmp_path / "a_file"):
        if path.name == "a_file":
            path.write_text("not a folder")
        result = run_cli("batch", "verify", path)
        assert result.code == 2 and "no batch journal" not in result.err
        what = "is not a folder" if path.exists() else "does not exist"
        assert f"{path}: {what}" in result.err and "next: " in result.err, result.err
        assert "Traceback" not in result.err
