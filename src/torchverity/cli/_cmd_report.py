"""``torchverity report EVENTS.jsonl [--plot out.png]``: what a guarded run went through."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "report", _run,
        help="summarise a TrainingGuard event log",
        description="Summarise a TrainingGuard event log (JSONL): anomalies, skipped steps, "
                    "rollbacks, replays; optionally plot loss and grad norm with anomalies marked. "
                    "Exit 1 when the run had an anomaly, a skipped step or a rollback.",
    )
    p.add_argument("events", type=Path, help="the log= file written by TrainingGuard")
    p.add_argument("--plot", type=Path, metavar="PNG",
                   help="also draw loss and grad norm to this PNG (needs torchverity[plot])")


def _suspects(record: dict[str, Any]) -> str:
    names = list(record.get("suspects") or [])
    if len(names) > 3:
        return ", ".join(names[:3]) + f" (+{len(names) - 3})"
    return ", ".join(names) or "-"


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.report import plot, summarize

    report = summarize(args.events)
    png = plot(args.events, args.plot) if args.plot else None

    def render() -> None:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts.items()))
        out.line(f"{report.path}: {report.steps} steps, {len(report.anomalies)} anomalies"
                 + (f" ({counts})" if counts else ""))
        replays = ", ".join(f"{k} {v}" for k, v in sorted(report.replays.items())) or "none"
        out.line(f"skipped {report.skipped}, rollbacks {report.rollbacks}, replays: {replays}, "
                 f"checkpoints {report.checkpoints}")
        if report.anomalies:
            rows = [(a.get("step"), a.get("kind"), a.get("action"), a.get("replay", "-"),
                     a.get("rank", 0), _suspects(a)) for a in report.anomalies]
            out.table(["step", "kind", "action", "replay", "rank", "suspects"], rows)
        if not report.finished:
            out.warn(f"{report.path}: no summary event: the run did not finish (crashed or still "
                     "running)" + ("; its last line is torn" if report.torn_last_line else ""))
        if png:
            out.info(f"plot written to {png}")

    return out.result({"ok": report.clean, **_jsonable(report), "plot": str(png) if png else None},
                      render)


def _jsonable(report: Any) -> dict[str, Any]:
    import dataclasses

    data = dataclasses.asdict(report)
    data["anomalies"] = list(data["anomalies"])
    return data
