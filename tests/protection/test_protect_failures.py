"""Swallowed load failures, through the interpreter-start hook in fresh interpreters."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from protect_helpers import run_python

MODEL = """
import torch

class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
"""
# The loader from the users' articles, line for line.
LOADER = """
import torch

def load_checkpoint(path):
    try:
        return torch.load(path)
    except Exception:
        # 这里有时会吞掉异常，或者只 print 一行
        print("load failed, use default init")
        return None
"""
TRAIN = """
from loader import load_checkpoint

ckpt = load_checkpoint("checkpoint_with_custom_class.pth")
print("training from", "scratch" if ckpt is None else "the checkpoint")
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project with a legacy (pre-1.6 format) checkpoint holding a whole model object."""
    (tmp_path / "mymodel.py").write_text(MODEL)
    (tmp_path / "loader.py").write_text(LOADER)
    (tmp_path / "train.py").write_text(TRAIN)
    done = run_python("""
        import torch
        from mymodel import MyModel
        checkpoint = {"model": MyModel(), "epoch": 10, "config": {"lr": 1e-3}}
        torch.save(checkpoint, "checkpoint_with_custom_class.pth",
                   _use_new_zipfile_serialization=False)
    """, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "checkpoint_with_custom_class.pth").read_bytes()[:2] == b"\x80\x02"
    return tmp_path


def _train(python: str, project: Path, policy: str | None) -> tuple[int, str, str, list[dict]]:
    env = {} if policy is None else {"TORCHVERITY_PROTECT": policy,
                                     "TORCHVERITY_PROTECT_LOG": str(project / "log.jsonl")}
    done = run_python((project / "train.py").read_text(), python=python, cwd=project, env=env)
    log = project / "log.jsonl"
    events = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return done.returncode, done.stdout, done.stderr, events


def test_without_the_variable_nothing_changes(hooked_python: str, project: Path) -> None:
    code, out, err, events = _train(hooked_python, project, None)
    assert code == 0 and "load failed, use default init" in out
    assert "torchverity" not in err and events == []


@pytest.mark.parametrize("policy", ["warn", "refuse"])
def test_the_swallowed_weights_only_failure_is_named_at_exit(
        hooked_python: str, project: Path, policy: str) -> None:
    code, out, err, events = _train(hooked_python, project, policy)
    # The run goes on exactly as before ...
    assert "load failed, use default init" in out and "training from scratch" in out
    # ... but the exit summary names the failure, the file and the catching line.
    ckpt = project / "checkpoint_with_custom_class.pth"
    catching = f"{project / 'loader.py'}:7 (load_checkpoint)"
    assert f"torch.load of {ckpt} raised UnpicklingError" in err
    assert "Unsupported global: GLOBAL mymodel.MyModel" in err
    assert f"caught in {catching}; the process went on" in err
    [swallowed] = [e for e in events if e["kind"] == "swallowed"]
    assert swallowed["caught_in"] == catching
    assert swallowed["where"] == f"{project / 'loader.py'}:6"
    assert code == (1 if policy == "refuse" else 0)


def test_a_failure_that_stops_the_program_is_not_called_swallowed(
        hooked_python: str, project: Path) -> None:
    (project / "loader.py").write_text(LOADER.replace(
        'print("load failed, use default init")', "raise"))
    code, _out, err, events = _train(hooked_python, project, "refuse")
    assert code == 1 and "Traceback" in err and "UnpicklingError" in err
    assert "caught and not re-raised" not in err
    assert [e for e in events if e["kind"] == "swallowed"] == []
    assert [e["kind"] for e in events if e["kind"] == "load-failure"] == ["load-failure"]


def test_a_failure_that_ends_a_thread_is_not_called_swallowed(
        hooked_python: str, project: Path) -> None:
    (project / "train.py").write_text(textwrap.dedent("""
        import threading, torch
        t = threading.Thread(target=torch.load, args=("checkpoint_with_custom_class.pth",))
        t.start(); t.join()
    """))
    code, _out, err, events = _train(hooked_python, project, "refuse")
    assert code == 0 and "Exception in thread" in err
    assert [e for e in events if e["kind"] == "swallowed"] == []
