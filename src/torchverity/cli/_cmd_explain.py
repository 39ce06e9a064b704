"""``torchverity explain``: cause, fix and checking command for known load/save failures."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.errors import FormatError, InputError, UsageError, shell_path, unreadable

# A log can be huge; failures worth explaining sit in the last part of it.
_LOG_TAIL_BYTES = 16 * 1024 * 1024
_SNIFF_BYTES = 8192
# Control bytes of text: tab, newline, carriage return (progress bars), form feed, escape
# (terminal colours), backspace.
_TEXT_CONTROLS = frozenset(b"\t\n\r\f\x1b\b")
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
        "an error that is not recognised, 2 when the input is empty or binary (not a log).",
    )
    p.add_argument("text", nargs="*", help="the error message (quote it)")
    p.add_argument("--log", type=Path, help="read the messages from this log file")


def _read_log(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - _LOG_TAIL_BYTES))
            return fh.read()
    except OSError as exc:
        raise _unreadable_log(path, exc) from None


def _unreadable_log(path: Path, exc: OSError) -> InputError:
    where = shell_path(path)
    if isinstance(exc, FileNotFoundError):
        hint = (f"check the path (ls {shell_path(path.parent)}); or pipe the failing command's "
                "output in: python train.py 2>&1 | torchverity explain")
    elif isinstance(exc, IsADirectoryError):
        hint = f"pass one log file from it (ls {where})"
    else:
        return unreadable(path, exc)
    return InputError(f"{path}: cannot read log: {exc.strerror or exc}", path=path, hint=hint)


def _stdin_bytes() -> bytes:
    buffer = getattr(sys.stdin, "buffer", None)
    return buffer.read() if buffer is not None else sys.stdin.read().encode("utf-8")


def _source_text(args: argparse.Namespace) -> str:
    if args.text and args.log:
        raise UsageError("give either TEXT or --log, not both")
    if args.log:
        return _as_log(_read_log(args.log), args.log)
    if args.text:
        return _as_log(" ".join(args.text).encode("utf-8"), None)
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError(
            "nothing to explain", hint="torchverity explain 'ERROR MESSAGE' or --log train.log"
        )
    return _as_log(_stdin_bytes(), "stdin")


def _as_log(data: bytes, source: Path | str | None) -> str:
    """The text of a log; an empty or binary input is refused, as it holds no message.
    ``source`` is the log file, "stdin", or None for the TEXT arguments."""
    where = str(source) if source is not None else "TEXT"
    if not data.strip():
        raise InputError(f"{where}: empty: no error message to explain",
                         hint=_empty_hint(source))
    if _binary(data[:_SNIFF_BYTES]):
        what = shell_path(source) if isinstance(source, Path) else "FILE"
        raise FormatError(
            f"{where}: binary data, not a log or an error message",
            hint=f"to see what the file is, torchverity inspect {what}; to explain why it "
                 "failed to load, pass the error that was printed (TEXT or --log LOGFILE)")
    return data.decode("utf-8", "replace")


def _empty_hint(source: Path | str | None) -> str:
    if source == "stdin":
        return ("the command before the pipe printed nothing to stdout; Python writes errors "
                "to stderr, so redirect it into the pipe with 2>&1")
    if isinstance(source, Path):
        return ("the run wrote nothing there yet, or its errors went elsewhere: send stderr "
                "to the log too (2>&1), or pass the error message as TEXT")
    return "quote the error message as TEXT, or pass the run's log with --log LOGFILE"


def _binary(head: bytes) -> bool:
    """NUL bytes, or mostly bytes text never holds, as git and grep tell binary files."""
    if b"\0" in head:
        return True
    odd = sum(1 for b in head if b < 32 and b not in _TEXT_CONTROLS)
    return odd > len(head) // 10


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
