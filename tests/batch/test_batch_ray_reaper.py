"""A ``batch run --engine ray`` driver that started its own Ray cluster and is killed with
SIGKILL takes that cluster with it: no Ray process outlives it (without the reaper, Ray's
agents do). A clean run leaves nothing behind either."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

MODEL = ("import time\n"
         "def build(state=None):\n"
         "    def fn(item):\n"
         "        time.sleep(0.05)\n"
         "        return item.data[::-1]\n"
         "    return fn\n")


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ray_processes_do_not_outlive_a_killed_driver(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "tvreaper_model.py").write_text(MODEL)
    (tmp_path / "in").mkdir()
    for i in range(400):
        (tmp_path / "in" / f"item{i:04d}.bin").write_bytes(f"input {i}".encode())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "code"), env.get("PYTHONPATH", "")])
    driver = subprocess.Popen(
        [sys.executable, "-m", "torchverity", "batch", "run", "--inputs", str(tmp_path / "in"),
         "--model", "tvreaper_model:build", "--out", str(tmp_path / "out"), "--engine", "ray",
         "--workers", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while not any("ray::_Worker" in _cmdline(p) for p in seen):  # the actor is up
        assert driver.poll() is None and time.monotonic() < deadline, "Ray did not start"
        seen |= _descendants(driver.pid)
        time.sleep(0.2)
    time.sleep(1.0)  # items running
    seen |= _descendants(driver.pid)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 30
    while [p for p in seen if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: _cmdline(p) for p in seen if _alive(p)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, left


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
