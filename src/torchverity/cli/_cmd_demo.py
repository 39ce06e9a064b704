"""``torchverity demo``: the end-to-end tour on built-in data."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from torchverity.cli._output import Output


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "demo",
        parents=[common],
        help="run the end-to-end demo on built-in data",
        description="Run every capability's check on built-in data (no downloads).",
    )
    p.add_argument("--dir", type=Path, help="keep the demo's files in this folder")
    p.add_argument("--only", help="run only the steps whose name contains this text")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.demo import run_demo

    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
        summary = run_demo(args.dir, out, args.only)
    else:
        with tempfile.TemporaryDirectory(prefix="torchverity-demo-") as tmp:
            summary = run_demo(Path(tmp), out, args.only)
    if out.json_mode:
        out.data({"ok": True, "steps": summary})
    else:
        out.line(f"demo finished: {len(summary)} steps passed")
    return 0
