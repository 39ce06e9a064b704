"""``torchverity run``: a command run with every checkpoint load and save watched."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.errors import InputError, UsageError
from torchverity.protection._state import POLICIES, EventKind, Policy

# What a run summary counts, in the order it lists them.
_KINDS: tuple[EventKind, ...] = (
    "verified", "saved", "mismatch", "refused", "unsafe-load", "fallback", "partial-load",
    "load-failure", "swallowed")
_PROBLEMS: tuple[EventKind, ...] = ("mismatch", "refused", "fallback", "partial-load")


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "run", _run,
        help="run a command with every checkpoint load and save verified",
        description="Run COMMAND (or python -m MODULE) with TORCHVERITY_PROTECT set: every "
        "Python process it starts verifies the checkpoints it loads against their records, "
        "saves them atomically with records, and lists load failures that were caught and "
        "not re-raised. Exit status: the command's own, or 1 under --policy refuse when a "
        "load failure was swallowed.",
    )
    p.add_argument("--policy", choices=POLICIES, default="warn",
                   help="refuse: a file that does not match its record raises, and a swallowed "
                        "load failure fails the run; warn (default): both are reported")
    p.add_argument("--log", type=Path, metavar="FILE",
                   help="keep the JSONL event log of every protected process here (replaced)")
    p.add_argument("--public-key", type=Path, metavar="PEM",
                   help="OpenSSF model signatures (model.sig, FILE.sig) beside loaded files must "
                        "verify with this public key")
    p.add_argument("--certificate", type=Path, action="append", default=[], metavar="PEM",
                   help="or with these CA certificates, for certificate signatures (repeatable)")
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ...",
                   help="run a Python module and its arguments with this interpreter "
                        "(like python -m)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command and its arguments, after --")


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.module:
        command = [sys.executable, "-m", *args.module, *command]
    if not command:
        raise UsageError("torchverity run needs a command to run",
                         hint="torchverity run --policy refuse -- python train.py")
    return command


def _trust(args: argparse.Namespace) -> dict[str, str]:
    """The startup hook's variables for what model signatures must verify with."""
    if args.public_key and args.certificate:
        raise UsageError("give --public-key or --certificate, not both",
                         hint="torchverity run --public-key pub.pem -- python train.py")
    for pem in [args.public_key, *args.certificate]:
        if pem is not None and not pem.is_file():
            raise InputError(f"{pem}: no such key or certificate file", path=pem)
    if args.public_key:
        return {"TORCHVERITY_PUBLIC_KEY": os.fspath(args.public_key.resolve())}
    if args.certificate:
        return {"TORCHVERITY_CERTIFICATE_CHAIN": os.pathsep.join(
            os.fspath(c.resolve()) for c in args.certificate)}
    return {}


def _run(args: argparse.Namespace, out: Output) -> int:
    command = _command(args)
    with tempfile.TemporaryDirectory(prefix="torchverity-run-") as tmp:
        log = args.log or Path(tmp) / "protect.jsonl"
        if args.log:
            log.unlink(missing_ok=True)
        env = {**os.environ, "TORCHVERITY_PROTECT": args.policy,
               "TORCHVERITY_PROTECT_LOG": os.fspath(log.resolve()), **_trust(args)}
        try:
            status = subprocess.call(command, env=env)
        except FileNotFoundError:
            raise InputError(f"{command[0]}: command not found", path=command[0],
                             hint=f"check the command; which {command[0]}") from None
        events = _read_log(log)
    summary = _summary(events, status, args.policy)
    # A command that failed exits with its own status (killed by signal N: 128+N, as shells do);
    # one that succeeded, by the summary's verdict.
    own = 128 - status if status < 0 else status
    return out.result(summary, lambda: _print(summary, out), exit_code=own or None)


def _read_log(log: Path) -> list[dict[str, Any]]:
    try:
        lines = log.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:  # a process killed mid-write leaves a partial last line
            continue
    return events


def _summary(events: list[dict[str, Any]], status: int, policy: Policy) -> dict[str, Any]:
    counts = {kind: sum(1 for e in events if e.get("kind") == kind) for kind in _KINDS}
    return {
        "ok": status == 0 and not (policy == "refuse" and counts["swallowed"]),
        "exit_status": status,
        "policy": policy,
        "processes": sum(1 for e in events if e.get("kind") == "started"),
        "counts": counts,
        "swallowed": [e for e in events if e.get("kind") == "swallowed"],
        "problems": [e for e in events if e.get("kind") in _PROBLEMS],
    }


def _print(summary: dict[str, Any], out: Output) -> None:
    """On stderr: stdout belongs to the command that ran."""
    c = summary["counts"]
    out.info(f"torchverity run: {summary['processes']} protected process(es), exit status "
             f"{summary['exit_status']}: {c['verified']} verified load(s), {c['saved']} "
             f"recorded save(s), {c['mismatch'] + c['refused']} mismatch(es) "
             f"({c['refused']} refused), {c['unsafe-load'] + c['fallback']} unsafe load(s), "
             f"{c['partial-load']} partial state_dict load(s), {len(summary['swallowed'])} "
             "swallowed load failure(s)")
    for e in summary["swallowed"]:
        out.info(f"  swallowed: {e['message']}")
    for e in summary["problems"]:
        out.info(f"  {e['kind']}: {e['message']}")
    if not summary["processes"]:
        out.warn("no protected Python process started: the command's interpreter does not "
                 "have torchverity's startup hook (torchverity-protect.pth); install torchverity "
                 "into it (pip install torchverity), or call torchverity.protect() in the program")
