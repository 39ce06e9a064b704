"""Ray processes must not outlive a killed driver.

A driver that starts its own local Ray cluster (``ray.init`` without an address)
owns processes (GCS, raylet, agents, workers) that SIGKILL leaves running: some
agents never notice the driver is gone. :func:`start_reaper` starts a small
stdlib-only process that holds a pipe from the driver and keeps a list of the
driver's descendants; when the pipe closes without the driver saying goodbye
(the driver died), it kills every process on that list (checked by start
time, so a reused pid is never hit).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys

_REFRESH_S = 0.2
_GOODBYE = b"done\n"


def start_reaper() -> subprocess.Popen[bytes]:
    """Watch this process; returns the reaper (call :func:`stop_reaper` on a clean exit)."""
    return subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__),
                             str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def stop_reaper(reaper: subprocess.Popen[bytes]) -> None:
    """A clean shutdown: the reaper leaves without killing anything."""
    try:
        assert reaper.stdin is not None
        reaper.stdin.write(_GOODBYE)
        reaper.stdin.close()
    except OSError:
        pass
    try:
        reaper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        reaper.kill()


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Every process below ``root`` now, with its start time."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _stat(int(name))
            if found is not None:
                children.setdefault(found[0], []).append(int(name))
                starts[int(name)] = found[1]
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out and child != os.getpid():
                out[child] = starts[child]
                todo.append(child)
    return out


def _watch(driver: int) -> None:
    known: dict[int, str] = {}
    said = b""
    while True:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], _REFRESH_S)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 64)
            if not chunk:
                break
            said += chunk
            continue
        known.update(_descendants(driver))
        known = {pid: start for pid, start in known.items() if _stat(pid) is not None}
    if said.endswith(_GOODBYE):
        return
    known.update({p: s for pid in list(known) for p, s in _descendants(pid).items()})
    for pid, start in known.items():
        current = _stat(pid)
        if current is not None and current[1] == start:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
