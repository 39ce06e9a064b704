"""``torchverity verify``: files against sidecars, folders against manifests."""

from __future__ import annotations

import argparse
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output
from torchverity.errors import EXIT_CHECK_FAILED


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "verify", _run,
        help="check files and folders against their records",
        description="A file is checked against FILE.sha256 (or .blake3), a folder against its "
        "manifest. Lists ok / mismatched / missing / extra paths; exit 1 if any is not ok.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.verify import verify_path

    results = []
    for path in args.paths:
        with out.progress(None, f"verifying {path}") as advance:
            results.append(verify_path(path, progress=advance))
    ok = all(r.ok for r in results)
    if out.json_mode:
        out.data({"ok": ok, "results": results})
    else:
        for r in results:
            _print_result(r, out)
    return 0 if ok else EXIT_CHECK_FAILED


def _print_result(result: Any, out: Output) -> None:
    counts = ", ".join(f"{n} {s}" for s, n in result.counts.items() if n)
    verdict = "OK" if result.ok else "FAILED"
    out.line(f"{result.target}: {verdict} ({counts}) against {result.record}")
    rows = [(e.status, e.path, e.expected or "-", e.actual or "-") for e in result.problems]
    if rows:
        out.table(("status", "path", "expected", "actual"), rows)
    for e in result.problems:
        if e.tensors:
            out.line(f"{e.path}: damaged tensors (from its meta.json): {', '.join(e.tensors)}")
    if not result.ok:
        out.info(
            f"{result.target}: content differs from what was recorded; restore the listed "
            "paths from a good copy, then rerun torchverity verify"
        )
