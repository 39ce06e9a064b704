"""``torchverity scan``: is a pickle-bearing file safe to load, and what does it need?"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output

if TYPE_CHECKING:
    from torchverity.pickles._scan import ScanReport, ScanResult


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "scan", _run,
        help="check checkpoints/pickles for code without running them",
        description="Statically scan torch checkpoints (zip, legacy, tar, TorchScript), pickles, "
        ".npy/.npz, joblib and safetensors files, each the way every loader reads it. Verdicts: "
        "safe, needs-allowlist (with the exact safe_globals code), needs-review (a class whose "
        "code would run), unsafe (code that runs commands, imports or evaluates), malformed. "
        "Folders: only files that can hold a pickle are judged; the others are listed as "
        "skipped. Nothing from the files is imported or run. Exit 1 unless every file is safe "
        "or needs-allowlist.",
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
    rows = _global_rows(result, show_all)
    if rows:
        out.table(["global", "class", "where", "why"], rows)
    for problem in result.problems:
        out.line(f"  problem: {problem}")
    step = _next_step(result)
    if step:
        out.line(f"  next: {step}")
    plan = result.plan
    if plan is None or result.verdict == "malformed":
        return
    dangerous = bool(result.names("dangerous"))
    if dangerous:
        out.line("  do not load this file: it would run code (migrate refuses it too)")
    elif not plan.loadable:
        out.line("  torch.load(weights_only=True) cannot read this file:")
        for note in plan.notes:
            out.line(f"    {note}")
        out.line(f"  convert it: torchverity migrate {result.path} NEW.safetensors")
    elif plan.needs:
        out.line(f"  torch.load(weights_only=True) will ask for {len(plan.needs)} globals:")
        for line in plan.code.rstrip("\n").splitlines():
            out.line(f"    {line}")
        if result.verdict in ("unsafe", "needs-review"):
            out.line("  do not allowlist code you have not read; extract the data instead: "
                     f"torchverity migrate {result.path} NEW.safetensors")


def _next_step(result: ScanResult) -> str:
    """What to do after the scan, for the formats whose answer is not a load plan."""
    path = result.path
    if result.format == "torchscript":
        return ("do not torch.jit.load it unless you trust its code; extract its tensors "
                f"without running it: torchverity migrate {path} NEW.safetensors")
    if result.format == "onnx":
        return f"torchverity inspect {path} lists its initializers"
    if result.format == "git-lfs-pointer":
        return "git lfs pull (or huggingface-cli download) fetches the real file"
    if result.format == "html":
        return "download the file again; check the URL and any access token"
    broken_header = result.format == "safetensors" and result.verdict == "malformed"
    if result.format == "empty" or broken_header:
        return "restore the file from a good copy or download it again"
    return ""


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.pickles._scan import scan

    report = scan(*args.paths)
    code = out.result({"ok": report.ok, "files": report.results, "skipped": report.skipped},
                      lambda: _print(report, out, args.all))
    counts: dict[str, int] = {}
    for r in report.results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    summary = ", ".join(f"{n} {v}" for v, n in counts.items())
    skipped = f"; skipped {len(report.skipped)} that hold no pickle" if report.skipped else ""
    out.info(f"scanned {len(report.results)} files: {summary}{skipped}")
    return code


def _print(report: ScanReport, out: Output, show_all: bool) -> None:
    for result in report.results:
        _print_result(result, out, show_all)
    for item in report.skipped:
        out.line(f"{item.path}: skipped ({item.reason})")
