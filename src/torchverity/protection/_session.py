"""The protected session: its policy, event log and failure ledger.

Every event goes to the JSONL log (when one is set); the ones a person must
see also go to stderr as one ``torchverity protect:`` line.
"""

from __future__ import annotations

import shlex
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from torchverity.protection._failures import Ledger, Swallowed
from torchverity.protection._state import (
    Event,
    Policy,
    SignatureCache,
    Trust,
    append_jsonl,
    depth,
    say,
)


@dataclass
class Session:
    """What protect keeps for this process: its policy, log, counts, ledger and trust."""

    policy: Policy
    log_path: Path | None
    counts: dict[str, int] = field(default_factory=dict)  # events by kind (the log has them)
    ledger: Ledger = field(default_factory=Ledger)
    lock: threading.Lock = field(default_factory=threading.Lock)
    said: set[tuple[str, str | None]] = field(default_factory=set)  # (kind, line) printed
    trust: Trust = field(default_factory=Trust)  # what model signatures must verify with
    signatures: SignatureCache = field(default_factory=SignatureCache)

    def emit(self, event: Event, *, loud: bool, once: bool = False) -> None:
        """Log ``event``; print it if ``loud`` (``once``: first time per kind and line only)."""
        with self.lock:
            self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
            if self.log_path is not None:
                append_jsonl(self.log_path, event)
            if once:
                key = (event.kind, event.where)
                loud = loud and key not in self.said
                self.said.add(key)
        if loud:
            say(event.message)


_current: Session | None = None


def current() -> Session | None:
    return _current


def start(policy: Policy, log_path: Path | None) -> Session:
    global _current
    _current = Session(policy, log_path)
    return _current


def stop() -> Session | None:
    global _current
    session, _current = _current, None
    return session


def active() -> Session | None:
    """The session a watched call reports to, or None (off, or inside a watched call)."""
    if _current is None or depth():
        return None
    return _current


def summarize(session: Session, *, final: bool) -> list[Swallowed]:
    """Log each swallowed failure and print the loud summary; returns them."""
    swallowed = session.ledger.swallowed()
    for s in swallowed:
        session.emit(Event("swallowed", s.api, s.sentence(), s.path, s.where, s.to_dict()),
                     loud=False)
    counts = dict(session.counts)
    if swallowed:
        _print_box(swallowed, session.policy, final)
    session.emit(Event("summary", "protect", f"{len(swallowed)} swallowed load failure(s)",
                       detail={"counts": counts, "swallowed": len(swallowed),
                               "policy": session.policy}), loud=False)
    session.ledger.release()
    return swallowed


def _print_box(swallowed: list[Swallowed], policy: str, final: bool) -> None:
    bar = "=" * 78
    lines = [bar, f"torchverity protect: {len(swallowed)} checkpoint load failure(s) were caught "
             "and not re-raised:"]
    for i, s in enumerate(swallowed, 1):
        lines.append(f"  {i}. {s.sentence()}")
        if s.where:
            lines.append(f"     the load was called at {s.where}")
    if policy == "refuse" and final:
        lines.append("  policy refuse: the process exits with status 1")
    lines.append(f"  next: torchverity explain {shlex.quote(swallowed[0].error)} gives the cause "
                 "and the fix; re-raise the error in its except block to stop the run")
    lines.append(bar)
    try:
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
