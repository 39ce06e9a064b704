"""The bottom of the protect package: events, trust, the re-entrancy guard, the calling line.

Standard library only: the interpreter-start hook imports it before torch.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

Policy = Literal["warn", "refuse"]
POLICIES: tuple[Policy, ...] = get_args(Policy)
EventKind = Literal[
    "started", "verified", "mismatch", "refused", "unsafe-load", "fallback", "partial-load",
    "load-failure", "saved", "swallowed", "summary", "unchecked-signature",
]
PUBLIC_KEY_ENV = "TORCHVERITY_PUBLIC_KEY"  # the startup hook's key for model signatures
CHAIN_ENV = "TORCHVERITY_CERTIFICATE_CHAIN"  # or its CA certificates, os.pathsep-separated
_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Event:
    """One thing the switch saw: ``where`` is the calling line (``file:line``)."""

    kind: EventKind
    api: str
    message: str
    path: str | None = None
    where: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind, "api": self.api, "message": self.message}
        if self.path is not None:
            data["path"] = self.path
        if self.where is not None:
            data["where"] = self.where
        data.update(self.detail)
        return data


@dataclass(frozen=True)
class Trust:
    """The key, or the certificate chain, that signatures must verify with."""

    public_key: Path | None = None
    certificate_chain: tuple[Path, ...] = ()

    @property
    def given(self) -> bool:
        return self.public_key is not None or bool(self.certificate_chain)


@dataclass
class SignatureCache:
    """Verified signatures by path, with the ``stat`` of the signature file they came from."""

    entries: dict[str, tuple[tuple[int, int, int], Any]] = field(default_factory=dict)
    folders_checked: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    unchecked: set[str] = field(default_factory=set)  # signatures found with no key to check


_local = threading.local()


def depth() -> int:
    return int(getattr(_local, "depth", 0))


class _Inside:
    """Calls made while one watched call runs (torchverity's own reads) pass straight through."""

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1


_INSIDE = _Inside()


def inside() -> _Inside:
    return _INSIDE


def caller_site() -> str | None:
    """``file:line`` of the first frame outside this package: the code that made the call."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _HERE:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def append_jsonl(path: Path, event: Event) -> None:
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pid": os.getpid(),
              **event.to_dict()}
    line = json.dumps(record, default=str) + "\n"
    try:
        # One write of one line in append mode: processes sharing the log never interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        say(f"cannot write the log {path}: {exc.strerror or exc}")


def say(text: str) -> None:
    try:
        sys.stderr.write(f"torchverity protect: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed at shutdown: the JSONL log still has it
        pass
