"""``torchverity demo``: the end-to-end tour on built-in data."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "demo", _run,
        help="run the end-to-end demo on built-in data",
        description="Run every capability's check on built-in data (no downloads). Every step "
        "must pass: a step whose extra is missing fails unless it is named in --skip.",
    )
    p.add_argument("--dir", type=Path, help="keep the demo's files in this folder")
    p.add_argument("--only", type=_names, action="extend", default=[], metavar="STEP[,STEP]",
                   help="run only these steps (names as in the summary, e.g. serve)")
    p.add_argument("--skip", type=_names, action="extend", default=[], metavar="STEP[,STEP]",
                   help="do not run these steps")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.demo import run_demo

    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
        results = run_demo(args.dir, out, args.only, args.skip)
    else:
        with tempfile.TemporaryDirectory(prefix="torchverity-demo-") as tmp:
            results = run_demo(Path(tmp), out, args.only, args.skip)
    ok = all(r.verdict != "failed" for r in results)

    def render() -> None:
        out.line("")
        for r in results:
            detail = f"{r.seconds:6.1f} s" if r.verdict == "passed" else r.reason
            out.line(f"{r.verdict:8} {r.name:14} {r.title}  [{detail}]")
        passed = sum(r.verdict == "passed" for r in results)
        skipped = sum(r.verdict == "skipped" for r in results)
        tail = f", {skipped} skipped" if skipped else ""
        verdict = "finished" if ok else "FAILED"
        out.line(f"demo {verdict}: {passed} of {len(results)} steps passed{tail}")

    return out.result({"ok": ok, "steps": results}, render)
