"""``torchverity explain``: cause, fix and checking command for known load/save failures."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.errors import InputError, UsageError

# A log can be huge; failures worth explaining sit in the last part of it.
_LOG_TAIL_BYTES = 16 * 1024 * 1024
# An error that names the GPU stack or a compiled library may come from the environment
# (versions, drivers, devices), which doctor checks; any other points at the code or file.
_ENVIRONMENT = re.compile(
    r"CUDA|cuDNN|cuBLAS|NCCL|NVIDIA|\bdriver\b|ROCm|\bHIP\b|GLIBC|undefined symbol|"
    r"shared object|DLL load failed|ImportError|compiled (?:with|against|for)", re.IGNORECASE)


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "explain", _run,
        help="explain a checkpoint save/load error message",
        description="Recognise known failure messages around saving and loading (in TEXT, a "
        "log file, or stdin; terminal escapes are ignored) and print, once per cause, the "
        "cause, the fix and the torchverity command that checks it. Exit 1 when the text holds "
        "an error that is not recognised.",
    )
    p.add_argument("text", nargs="*", help="the error message (quote it)")
    p.add_argument("--log", type=Path, help="read the messages from this log file")


def _read_log(path: Path) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - _LOG_TAIL_BYTES))
            return fh.read().decode("utf-8", "replace")
    except OSError as exc:
        raise InputError(f"{path}: cannot read log: {exc.strerror or exc}", path=path) from None


def _source_text(args: argparse.Namespace) -> str:
    if args.text and args.log:
        raise UsageError("give either TEXT or --log, not both")
    if args.log:
        return _read_log(args.log)
    if args.text:
        return " ".join(args.text)
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError(
            "nothing to explain", hint="torchverity explain 'ERROR MESSAGE' or --log train.log"
        )
    return sys.stdin.read()


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.pickles._explain import explain_text, unexplained

    text = _source_text(args)
    found = explain_text(text)
    unknown = unexplained(text)

    def render() -> None:
        for item in found:
            times = f" ({item.tally})" if item.count > 1 else ""
            out.line(f"[{item.key}] {item.evidence}{times}")
            out.line(f"  cause: {item.cause}")
            out.line(f"  fix:   {item.fix}")
            out.line(f"  check: {item.command}")
        for line in unknown:
            out.line(f"[unexplained] {line}")
        if unknown:
            out.warn(f"{len(unknown)} error(s) in the text not recognised as a save/load "
                     f"failure (the [unexplained] lines): {_next_step(unknown)}")
        elif not found:
            out.line("no save/load error found in the text")

    return out.result({"ok": not unknown, "recognised": len(found), "explanations": found,
                       "unexplained": unknown}, render)


def _next_step(unknown: list[str]) -> str:
    steps = []
    if any(_ENVIRONMENT.search(line) for line in unknown):
        steps.append("one names the GPU stack or a library, so the environment may be the "
                     "cause: torchverity doctor checks its versions, driver and devices")
    if not all(_ENVIRONMENT.search(line) for line in unknown):
        steps.append("if one came from loading a checkpoint, torchverity inspect FILE lists "
                     "what the file holds (keys, shapes, dtypes) to compare with what the code "
                     "expects; otherwise the traceback above the error is the lead")
    return "; ".join(steps)
