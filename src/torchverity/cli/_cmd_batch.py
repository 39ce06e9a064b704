"""``torchverity batch run|verify``: exactly-once batch jobs with a journal, and reconciliation."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from torchverity.batch._item import DurabilityMode, EngineName
from torchverity.cli._fit_args import add_fit_args, fit_kwargs
from torchverity.cli._output import Output
from torchverity.errors import shell_path

if TYPE_CHECKING:
    from torchverity.batch import BatchReport, BatchVerifyResult

_MAX_LISTED = 20
_REDRAW_S = 0.1  # rich redraws the bar 10 times a second


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "batch", help="run batch inference with a crash-safe journal; verify its outputs",
        description="Batch jobs where every input ends with exactly one verified output "
        "or a recorded reason (see docs/batch.md).",
    )
    sub = p.add_subparsers(dest="batch_command", metavar="SUBCOMMAND")
    run = sub.add_parser(
        "run", parents=[common], help="run or resume a job",
        description="Run MODEL over every input file. Rerunning the same command after a "
        "crash resumes the job with no lost and no duplicated outputs.",
    )
    run.add_argument("--inputs", required=True, type=Path,
                     help="folder of input files, or a text file with one path per line")
    run.add_argument("--model", required=True, metavar="MODULE:CALLABLE",
                     help="build(state) -> fn(item) -> bytes|str|tensor (build() without "
                     "--weights)")
    run.add_argument("--weights", type=Path,
                     help="checkpoint, verified against its sidecar or manifest before any item")
    add_fit_args(run, strict=False)
    run.add_argument("--golden", type=Path, metavar="FILE",
                     help="golden file: the model (fn.model) must pass it before the first "
                     "item and after the run, or the run's outputs are discarded")
    run.add_argument("--out", required=True, type=Path,
                     help="output folder: data/, journal, manifest-sha256.txt")
    run.add_argument("--workers", type=int, default=1, help="parallel workers (default 1)")
    run.add_argument("--engine", choices=get_args(EngineName), default="local",
                     help="local threads or Ray actors (extra 'ray')")
    run.add_argument("--ray-address", help="Ray cluster to join (default: RAY_ADDRESS or a "
                     "new local one)")
    run.add_argument("--retries", type=int, default=2,
                     help="retries per failing item, with backoff (default 2)")
    run.add_argument("--suffix", default=".out", help="appended to each input's key to name "
                     "its output (default .out)")
    run.add_argument("--durability", choices=get_args(DurabilityMode), default="group",
                     help="group: one syncfs of the output filesystem per commit point "
                     "(default; Linux, elsewhere file); file: fsync every output; lazy: no "
                     "flush, outputs lost by a power cut are found and redone by the "
                     "rerun's re-hash")
    run.add_argument("--retry-failed", action="store_true",
                     help="give failed items a new round of attempts (committed outputs stay); "
                     "new and edited inputs are always picked up on a rerun")
    run.add_argument("--prune-removed", action="store_true",
                     help="delete the items whose input is gone from --inputs, with their "
                     "stale outputs (without it they are kept and reported as input-removed)")
    run.add_argument("--force", action="store_true",
                     help="start over: delete this folder's previous job and outputs")
    run.set_defaults(func=_run)
    verify = sub.add_parser(
        "verify", parents=[common], help="reconcile outputs with inputs by identity",
        description="Check that every input has exactly one output whose digest matches the "
        "journal, nothing extra; write/check manifest-sha256.txt. Exit 1 with the problems.",
    )
    verify.add_argument("out", type=Path, help="the --out folder of a batch job")
    verify.set_defaults(func=_verify)
    p.set_defaults(func=lambda args, out: _help(p, out))


def _help(parser: argparse.ArgumentParser, out: Output) -> int:
    parser.print_help(out.err)
    return 2


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.batch import BatchOptions, run_model_batch
    from torchverity.checkpoint._results import CheckpointWarning

    options = BatchOptions(
        workers=args.workers, retries=args.retries, engine=args.engine,
        ray_address=args.ray_address, force=args.force, suffix=args.suffix,
        durability=args.durability, golden=args.golden, retry_failed=args.retry_failed,
        prune_removed=args.prune_removed,
    )
    with out.warnings_of(CheckpointWarning), _progress(out) as progress:
        report = run_model_batch(
            args.inputs, args.model, args.out, options, weights=args.weights,
            strip_prefix=args.strip_prefix, key_map=fit_kwargs(args)["key_map"],
            progress=progress,
        )
    return out.result({"ok": report.ok, **_as_dict(report)}, lambda: _print_report(report, out))


def _as_dict(obj: Any) -> dict[str, Any]:
    from torchverity._jsonable import to_jsonable

    data: dict[str, Any] = to_jsonable(obj)
    return data


def _print_report(report: BatchReport, out: Output) -> None:
    if report.resumed:
        extra = [f"{report.failed_retried} failed items retried"] if report.failed_retried else []
        extra += [f"{len(report.removed)} removed inputs kept"] if report.removed else []
        extra += [f"{len(report.pruned)} removed inputs pruned"] if report.pruned else []
        out.info(
            f"resumed job {report.fingerprint[:16]}…: {report.interrupted} interrupted items "
            f"requeued, {report.orphans_removed} orphan files removed, "
            f"{len(report.repaired)} damaged outputs redone, {report.new_inputs} new inputs "
            f"queued, {report.edited_inputs} edited inputs redone"
            + "".join(f", {part}" for part in extra)
        )
    for key in report.repaired:
        out.warn(f"{key}: its committed output was damaged or missing; processed again")
    for key in report.pruned:
        out.warn(f"{key}: its input is gone; its item and output were deleted")
    rows = [
        ("committed", report.committed), ("failed", report.failed),
        ("input-changed", report.changed), ("pending", report.pending),
        ("total", report.total), ("input-removed", len(report.removed)),
        ("processed now", report.processed), ("retries", report.retries),
        ("time", f"{report.seconds:.2f} s"), ("items/s", report.items_per_s),
    ]
    out.table(["", "items"], rows, title=f"batch {report.out} ({report.engine})")
    for problem in report.problems[:_MAX_LISTED]:
        out.line(f"{problem.state}: {problem.key}: {problem.error or ''}".rstrip(": "))
    if len(report.problems) > _MAX_LISTED:
        out.line(f"... and {len(report.problems) - _MAX_LISTED} more (see --json)")
    if report.ok:
        out.line(f"ok: {report.committed} outputs committed; check them with: "
                 f"torchverity batch verify {shell_path(report.out)}")
    elif report.next_step:
        out.line(f"next: {report.next_step}")


def _verify(args: argparse.Namespace, out: Output) -> int:
    from torchverity.batch import verify_batch

    result = verify_batch(args.out)
    return out.result({"ok": result.ok, **_as_dict(result)}, lambda: _print_verify(result, out))


def _print_verify(result: BatchVerifyResult, out: Output) -> None:
    for problem in result.problems[:_MAX_LISTED]:
        where = ": ".join(x for x in (problem.key, problem.path) if x)
        out.line(f"{problem.kind}: {where}: {problem.detail}")
    if len(result.problems) > _MAX_LISTED:
        out.line(f"... and {len(result.problems) - _MAX_LISTED} more (see --json)")
    if result.ok:
        note = " (written now)" if result.manifest_written else ""
        out.line(f"ok: {result.items} inputs, each with exactly one verified output; "
                 f"manifest {result.manifest}{note}")
    else:
        out.line(f"FAILED: {len(result.problems)} problems in {result.out} "
                 f"({result.committed} of {result.items} inputs committed)")
        if result.next_step:
            out.line(f"next: {result.next_step}")


@contextmanager
def _progress(out: Output) -> Iterator[Callable[[int, int], None]]:
    """A bar with items/s and ETA on stderr when it is a terminal; otherwise nothing."""
    if not out.live:
        yield lambda done, total: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = [
        TextColumn("batch"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]} items/s"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=Console(file=out.err), transient=True) as bar:
        task = bar.add_task("batch", total=None, rate="-")
        last = [-1.0]

        def advance(done: int, total: int) -> None:
            # With one worker this runs on the model's thread: an update per item (tens of
            # microseconds) is wasted work above the bar's own 10 redraws per second.
            now = time.monotonic()
            if done < total and now - last[0] < _REDRAW_S:
                return
            last[0] = now
            speed = bar.tasks[0].speed
            bar.update(task, completed=done, total=total,
                       rate=f"{speed:.1f}" if speed else "-")

        yield advance
