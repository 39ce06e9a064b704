"""A batch journal whose output paths leave ``--out`` (``..``, absolute, through a symlink)
is refused with exit 2 by ``batch run`` and ``batch verify``: nothing outside is read,
deleted or written. A clean journal still resumes and verifies (exit 0).
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torchverity.batch._paths import output_problem

MODEL = "def build(state=None):\n    return lambda item: item.data[::-1]\n"


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        run_cli: Callable[..., Any]) -> tuple[list[str], Path]:
    code = tmp_path / "code"
    code.mkdir()
    (code / "tvpaths_model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(code))
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(3):
        (inputs / f"item{i}.bin").write_bytes(f"input {i}".encode())
    out = tmp_path / "out"
    args = ["batch", "run", "--inputs", str(inputs), "--model", "tvpaths_model:build",
            "--out", str(out), "--workers", "1"]
    assert run_cli(*args).code == 0
    return args, out


def _set_output(out: Path, output: str, state: str) -> None:
    with sqlite3.connect(out / "batch-journal.sqlite") as conn:
        conn.execute("UPDATE items SET output = ?, state = ? WHERE id = 1", (output, state))


@pytest.mark.parametrize("state", ["committed", "pending"])
@pytest.mark.parametrize("kind", ["dotdot", "nested-dotdot", "absolute"])
def test_an_output_path_leaving_out_is_refused(job: tuple[list[str], Path], tmp_path: Path,
                                               run_cli: Callable[..., Any], kind: str,
                                               state: str) -> None:
    args, out = job
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    output = {"dotdot": "../victim.txt", "nested-dotdot": "data/../../victim.txt",
              "absolute": str(victim)}[kind]
    _set_output(out, output, state)
    for command in (args, ["batch", "verify", str(out)]):
        result = run_cli(*command)
        assert result.code == 2, (command, result.err)
        assert "nothing outside" in result.err and "internal error" not in result.err
        assert victim.read_text() == "not yours"


def test_an_output_reached_through_a_symlink_is_refused(job: tuple[list[str], Path],
                                                        tmp_path: Path,
                                                        run_cli: Callable[..., Any]) -> None:
    args, out = job
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours")
    target = next((out / "data").rglob("*.out"))
    target.unlink()
    target.symlink_to(victim)
    for command in (args, ["batch", "verify", str(out)]):
        result = run_cli(*command)
        assert result.code == 2 and "symbolic link" in result.err, result.err
        assert victim.read_text() == "not yours"


def test_a_clean_journal_still_resumes_and_verifies(job: tuple[list[str], Path],
                                                    run_cli: Callable[..., Any]) -> None:
    args, out = job
    assert run_cli(*args).code == 0
    assert run_cli("batch", "verify", str(out)).code == 0


@pytest.mark.parametrize(("rel", "ok"), [
    ("data/a.out", True), ("data/sub/a.out", True), ("data/..a.out", True),
    ("../a", False), ("/etc/passwd", False), ("data/../x", False), ("data//x", False),
    ("data", False), ("other/x", False), ("data\\..\\x", False), ("", False), (3, False),
])
def test_output_paths_judged(rel: object, ok: bool) -> None:
    assert (output_problem(rel) is None) is ok


@pytest.mark.parametrize(("sql", "named"), [
    ("UPDATE items SET size = 'many' WHERE id = 2",
     "items row 2: size should be a byte count (an integer, 0 or more), not a text value"),
    ("UPDATE items SET output_digest = NULL WHERE id = 1",
     "items row 1: output_digest should be a SHA-256 (64 hex digits) (every committed item "
     "has one), not nothing"),
    ("UPDATE job SET value = '{\"inputs\": \"/elsewhere\"}' WHERE key = 'job'",
     "job value 'job' is not a job description"),
    ("INSERT OR REPLACE INTO job VALUES ('command', X'00')",
     "job value 'command' holds a value of type blob, not text"),
])
def test_a_bad_journal_field_is_named(job: tuple[list[str], Path], run_cli: Callable[..., Any],
                                      sql: str, named: str) -> None:
    args, out = job
    with sqlite3.connect(out / "batch-journal.sqlite") as conn:
        conn.execute(sql)
    for command in (args, ["batch", "verify", str(out)]):
        result = run_cli(*command)
        assert result.code == 2 and named in result.err, result.err
        assert "next: restore the journal from a backup" in result.err


@pytest.mark.parametrize("kind", ["output-is-a-folder", "data-is-a-file"])
def test_something_else_at_an_output_name_is_refused(job: tuple[list[str], Path],
                                                     run_cli: Callable[..., Any],
                                                     kind: str) -> None:
    args, out = job
    target = next((out / "data").rglob("*.out"))
    if kind == "output-is-a-folder":
        target.unlink()
        target.mkdir()
        (target / "keep.txt").write_text("yours")
        named = "is a folder where an output file belongs"
    else:
        target = out / "data"
        shutil.rmtree(target)
        target.write_text("yours")
        named = "data is a file where the folder of outputs belongs"
    for command in (args, ["batch", "verify", str(out)]):
        result = run_cli(*command)
        assert result.code == 2 and named in result.err, result.err
    assert target.exists()  # nothing of the user's was deleted
