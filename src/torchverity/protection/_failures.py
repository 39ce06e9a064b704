"""Failures of watched loads: recorded as they are raised, judged when the process ends.

Each exception a watched load raises is kept with its file and the calling
line. Its traceback grows by one entry per frame it unwinds through, so when
the process ends the first entry is the frame that caught it; that frame's
exception table gives the line of the ``except`` (or ``with``) that did. An
exception that reached ``sys.excepthook`` / ``threading.excepthook`` (itself or
as the cause or context of the one that did), or that was being handled when
``sys.exit`` was called, was not swallowed; every other one was, and the
summary names it.
"""

from __future__ import annotations

import dis
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import CodeType, TracebackType
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TELLING = re.compile(r"WeightsUnpickler error|Unsupported (global|operand)")
_Hook = tuple[Any, str, Callable[..., Any], Callable[..., Any]]  # owner, name, ours, previous
_KEEP = 200  # failures kept with their exception (and its frames) per session


@dataclass
class Failure:
    """A load that failed under protect: where it came from, how it failed, what followed."""

    api: str
    path: str | None
    error: str
    where: str | None
    weights_only: bool | None
    exc: BaseException | None
    escaped: bool = False
    retried_at: str | None = None  # a later weights_only=False load of the same file


@dataclass(frozen=True)
class Swallowed:
    """A load failure that was caught and not re-raised: what the summary lists."""

    api: str
    path: str | None
    error: str
    where: str | None
    caught_in: str | None
    retried_at: str | None

    def sentence(self) -> str:
        what = f"{self.api} of {self.path}" if self.path else self.api
        caught = f"caught in {self.caught_in}" if self.caught_in else "caught"
        retry = (f"; retried with weights_only=False at {self.retried_at} (the file's pickle "
                 "ran with full trust)" if self.retried_at else "")
        return f"{what} raised {self.error}; {caught}; the process went on{retry}"

    def to_dict(self) -> dict[str, Any]:
        return {"api": self.api, "path": self.path, "error": self.error, "where": self.where,
                "caught_in": self.caught_in, "retried_at": self.retried_at}


class Ledger:
    """The failures of one session, and the hooks that see which ones escaped."""

    def __init__(self) -> None:
        self.failures: list[Failure] = []
        self.lock = threading.Lock()
        self._hooks: tuple[_Hook, ...] | None = None
        self.exit_status: Any = None  # what sys.exit was asked for, if it was called

    def record(self, exc: BaseException, api: str, path: str | None, where: str | None,
               weights_only: bool | None) -> Failure:
        failure = Failure(api, path, describe(exc), where, weights_only, None)
        with self.lock:
            if len(self.failures) < _KEEP:
                failure.exc = exc
            self.failures.append(failure)
        return failure

    def failed_safe_load(self, path: str) -> Failure | None:
        """The last failure of a weights_only load of ``path`` (a later unsafe load retries it)."""
        with self.lock:
            return next((f for f in reversed(self.failures)
                         if f.path == path and f.weights_only), None)

    def mark_escaped(self, exc: BaseException | None) -> None:
        chain = set(_chain(exc))
        with self.lock:
            for f in self.failures:
                if f.exc is not None and id(f.exc) in chain:
                    f.escaped = True

    def swallowed(self) -> list[Swallowed]:
        with self.lock:
            return [Swallowed(f.api, f.path, f.error, f.where, catching_site(f.exc),
                              f.retried_at) for f in self.failures if not f.escaped]

    def release(self) -> None:
        """Drop the exceptions (and the frames they hold) once judged."""
        with self.lock:
            for f in self.failures:
                f.exc = None

    def install_hooks(self) -> None:
        old_sys, old_thread, old_exit = sys.excepthook, threading.excepthook, sys.exit

        def sys_hook(kind: type[BaseException], value: BaseException,
                     tb: TracebackType | None) -> None:
            self.mark_escaped(value)
            old_sys(kind, value, tb)

        def thread_hook(args: Any) -> None:
            self.mark_escaped(args.exc_value)
            old_thread(args)

        def exit_hook(status: Any = None) -> Any:
            # sys.exit() inside an ``except`` block stops the program because of that error.
            self.mark_escaped(sys.exc_info()[1])
            self.exit_status = status
            return old_exit(status)

        sys.excepthook, threading.excepthook, sys.exit = sys_hook, thread_hook, exit_hook
        self._hooks = ((sys, "excepthook", sys_hook, old_sys),
                       (threading, "excepthook", thread_hook, old_thread),
                       (sys, "exit", exit_hook, old_exit))

    def remove_hooks(self) -> None:
        """Put the previous hooks back, except where the program installed its own since."""
        for owner, name, mine, old in self._hooks or ():
            if getattr(owner, name) is mine:
                setattr(owner, name, old)
        self._hooks = None


def _chain(exc: BaseException | None) -> Iterable[int]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield id(exc)
        for inner in getattr(exc, "exceptions", ()):  # exception groups
            yield from _chain(inner)
        exc = exc.__cause__ or exc.__context__


def describe(exc: BaseException) -> str:
    """``Type: the line of the message that says what failed`` (torch's may start with advice)."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    first = next((line for line in lines if _TELLING.search(line)), lines[0] if lines else "")
    if len(first) > 200:
        first = first[:197] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def catching_site(exc: BaseException | None) -> str | None:
    """``file:line (function)`` of the handler that stopped ``exc``; None when unknown."""
    tb = exc.__traceback__ if exc is not None else None
    if tb is None:
        return None
    code = tb.tb_frame.f_code
    line = handler_line(code, tb.tb_lasti) or tb.tb_lineno
    return f"{code.co_filename}:{line} ({code.co_name})"


def handler_line(code: CodeType, lasti: int) -> int | None:
    """The source line of the exception handler covering instruction ``lasti`` in ``code``."""
    parse = getattr(dis, "_parse_exception_table", None)
    if parse is None:
        return None
    try:
        entries = parse(code)
    except Exception:  # a code object this Python cannot describe: fall back to the call line
        return None
    target = next((e.target for e in entries if e.start <= lasti < e.end), None)
    if target is None:
        return None
    # The handler starts with PUSH_EXC_INFO, which keeps the line of the code it
    # interrupted; the next instruction has the ``except`` (or ``with``) line.
    index = target // 2
    if code.co_code[target] == dis.opmap.get("PUSH_EXC_INFO"):
        index += 1
    positions = list(code.co_positions())  # type: ignore[attr-defined]  # Python 3.11+
    return positions[index][0] if index < len(positions) else None
