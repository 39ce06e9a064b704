"""Kill a save at a chosen instant: SIGKILL at its K-th rename (strace fault injection) or
after a random delay, in a child forked from the test process (torch already imported, so a
run costs milliseconds, not an interpreter start-up).

The child waits on a pipe until strace has attached, so the K-th rename counted is the
K-th rename of the save itself.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import pytest

Outcome = Literal["killed", "finished", "failed"]


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A small tmpfs mounted at ``where``, to fill up mid-save (skips without root)."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def need_strace() -> str:
    """The strace binary, or a clear skip (``make test`` installs it)."""
    found = shutil.which("strace")
    if found is None:
        pytest.skip("strace is not installed (apt-get install -y strace; make test does it)")
    return found


def count_renames(action: Callable[[], None]) -> int:
    """How many rename(2) calls one uninterrupted run of ``action`` makes."""
    log = f"/tmp/torchverity-renames-{os.getpid()}-{time.monotonic_ns()}"
    try:
        outcome = run_child(action, strace_args=["-e", "trace=rename", "-o", log])
        assert outcome == "finished", outcome
        with open(log, encoding="utf-8") as fh:
            return sum(1 for line in fh if "rename(" in line and "= 0" in line)
    finally:
        if os.path.exists(log):
            os.unlink(log)


def kill_at_rename(action: Callable[[], None], k: int) -> Outcome:
    """Run ``action`` in a child killed by strace on entering its ``k``-th rename(2)."""
    return run_child(action, strace_args=[
        "-e", "trace=rename", "-e", f"inject=rename:signal=KILL:when={k}", "-o", "/dev/null"])


def kill_after(action: Callable[[], None], delay_s: float) -> Outcome:
    return run_child(action, delay_s=delay_s)


def run_child(action: Callable[[], None], *, strace_args: list[str] | None = None,
              delay_s: float | None = None) -> Outcome:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: wait for the go, act, never return into pytest
        os.close(write_end)
        os.read(read_end, 1)
        sys.dont_write_bytecode = True  # a .pyc written by an import renames too
        code = 0
        try:
            action()
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    os.close(read_end)
    tracer = _attach(pid, strace_args) if strace_args is not None else None
    os.write(write_end, b"x")
    os.close(write_end)
    if delay_s is not None:
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if tracer is not None:
        tracer.wait(timeout=30)
    if os.WIFSIGNALED(status):
        return "killed" if os.WTERMSIG(status) == signal.SIGKILL else "failed"
    return "finished" if os.WEXITSTATUS(status) == 0 else "failed"


def _attach(pid: int, args: list[str]) -> subprocess.Popen[bytes]:
    tracer = subprocess.Popen([need_strace(), "-f", "-qq", "-p", str(pid), *args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while _tracer_of(pid) == 0:
        if time.monotonic() > deadline or tracer.poll() is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.skip("strace cannot attach here (ptrace not permitted)")
        time.sleep(0.005)
    return tracer


def _tracer_of(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0
