"""``torchverity scan``: is a pickle-bearing file safe to load, and what does it need?"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.errors import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, shell_path

if TYPE_CHECKING:
    from torchverity.pickles._scan import ScanReport, ScanResult, Skipped


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "scan", _run,
        help="check checkpoints/pickles for code without running them",
        description="Statically scan torch checkpoints (zip, legacy, tar, TorchScript), pickles, "
        ".npy/.npz, joblib and safetensors files, each the way every loader reads it. Verdicts: "
        "safe, needs-allowlist (with the exact safe_globals code), needs-review (a class whose "
        "code would run), unsafe (code that runs commands, imports or evaluates), malformed. "
        "Folders: only files that can hold a pickle are judged; the others are listed as "
        "skipped; a file reached through symlinks (a Hugging Face cache) is judged once; a "
        "sharded checkpoint's *.index.json given as a file is judged with its shards. "
        "Nothing from the files is imported or run. Exit 1 unless every file is safe or "
        "needs-allowlist; else 2 if a file cannot be read (the others are still scanned) or "
        "a folder holds no file to judge.",
    )
    p.add_argument("paths", nargs="+", type=Path, help="files or folders (scanned recursively)")
    p.add_argument("--all", action="store_true", help="list torch-allowlisted globals too")


def _global_rows(result: ScanResult, show_all: bool) -> list[list[str]]:
    rows: list[list[str]] = []
    seen: set[str] = set()
    for g in result.globals:
        if g.name in seen or (g.category == "torch" and not show_all):
            continue
        seen.add(g.name)
        rows.append([g.name, g.category, f"{g.entry}@{g.offset} {g.opcode}", g.reason])
    return rows


def _print_result(result: ScanResult, out: Output, show_all: bool) -> None:
    out.line(f"{result.path}: {result.verdict} ({result.format}): {result.reason}")
    if result.aliases:
        out.line(f"  same file as: {', '.join(result.aliases)}")
    rows = _global_rows(result, show_all)
    if rows:
        out.table(["global", "class", "where", "why"], rows)
    for problem in result.problems:
        out.line(f"  problem: {problem}")
    from torchverity.pickles._scan import next_step

    step = next_step(result)
    if step:
        out.line(f"  next: {step}")
    plan = result.plan
    if plan is None or result.verdict == "malformed":
        return
    dangerous = bool(result.names("dangerous"))
    if dangerous:
        from torchverity.pickles._dangerous import MIGRATABLE

        rescue = (f"; its tensors and data come out without running it: torchverity migrate "
                  f"{shell_path(result.path)} NEW.safetensors"
                  if result.format in MIGRATABLE else "")
        out.line(f"  do not load this file: it would run code{rescue}")
    elif not plan.loadable:
        out.line("  torch.load cannot read this file, with any weights_only setting; the file "
                 "is intact (it reads in full):" if plan.torch_cannot_read else
                 "  torch.load(weights_only=True) cannot read this file:")
        for note in plan.notes:
            out.line(f"    {note}")
        out.line(f"  convert it: torchverity migrate {shell_path(result.path)} NEW.safetensors")
    elif plan.needs:
        out.line(f"  torch.load(weights_only=True) will ask for {len(plan.needs)} globals:")
        for line in plan.code.rstrip("\n").splitlines():
            out.line(f"    {line}")
        if result.verdict in ("unsafe", "needs-review"):
            out.line("  do not allowlist code you have not read; extract the data instead: "
                     f"torchverity migrate {shell_path(result.path)} NEW.safetensors")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.pickles._scan import scan

    report = scan(*args.paths)
    code = out.result({"ok": report.ok, "files": report.results, "skipped": report.skipped,
                       "unreadable": report.unreadable, "empty": report.empty},
                      lambda: _print(report, out, args.all), exit_code=_exit_code(report))
    for item in report.unreadable:
        out.info(f"torchverity: error: {item.reason} (not scanned)\n  next: {item.hint}")
    for folder in report.empty:
        out.info(_nothing_judged(folder, report.skipped))
    counts: dict[str, int] = {}
    for r in report.results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    summary = ", ".join(f"{n} {v}" for v, n in counts.items()) or "nothing judged"
    skipped = f"; skipped {len(report.skipped)} that hold no pickle" if report.skipped else ""
    unread = f"; {len(report.unreadable)} unreadable" if report.unreadable else ""
    out.info(f"scanned {len(report.results)} files: {summary}{skipped}{unread}")
    return code


def _exit_code(report: ScanReport) -> int:
    """1 when a file failed its check; else 2 when a file could not be read or a folder
    held nothing to judge (nothing vouches for it); else 0."""
    if not all(r.ok for r in report.results):
        return EXIT_CHECK_FAILED
    return EXIT_USAGE if report.unreadable or report.empty else EXIT_OK


def _nothing_judged(folder: str, skipped: tuple[Skipped, ...]) -> str:
    quoted = shlex.quote(folder)
    inside = [s for s in skipped if Path(s.path).is_relative_to(folder)]
    if not inside:
        return (f"torchverity: error: {folder}: nothing to scan: the folder holds no file\n"
                f"  next: check the path (ls -la {quoted}); point scan at the folder or files "
                "that hold the weights")
    kinds = ", ".join(sorted({s.reason for s in inside}))
    return (f"torchverity: error: {folder}: nothing to scan: none of its {len(inside)} files "
            f"can hold a pickle (skipped: {kinds}), so this scan vouches for nothing\n"
            f"  next: {_unscanned_step(quoted, inside)}")


def _unscanned_step(quoted: str, inside: list[Skipped]) -> str:
    """ONNX weights are initializers, not pickles: name the commands that read them."""
    from torchverity.pickles._scan import SKIPPED_ONNX

    onnx = [s.path for s in inside if s.reason == SKIPPED_ONNX]
    if not onnx:
        return (f"check the path (ls -la {quoted}); point scan at the files that hold the "
                "weights")
    model = shell_path(onnx[0])
    return (f"ONNX models hold initializers, not pickles: torchverity inspect {model} lists "
            f"them and torchverity fingerprint {model} hashes them")


def _print(report: ScanReport, out: Output, show_all: bool) -> None:
    for result in report.results:
        _print_result(result, out, show_all)
    for item in report.skipped:
        out.line(f"{item.path}: skipped ({item.reason})")
    for unread in report.unreadable:
        out.line(f"{unread.path}: unreadable (not scanned)")
