"""The driver: open or start a job, clean up after a crash, schedule items, record outcomes.

Ordering that makes outputs exactly-once, whatever moment the process dies:

1. a worker writes ``data/<key><suffix>`` through a temp file and a rename
   (with an fsync of the file first under ``file`` durability);
2. the driver makes a group of such outputs durable: an fsync of their
   folders, or one ``syncfs`` of the filesystem (``group``, the default on Linux);
3. then records the group as committed in one durable journal transaction.

Steps 2 and 3 (a commit point) run on a committer thread, one commit point at
a time, while the items go on: the group is handed over only once all its
outputs are renamed, so its flush starts after their renames, and the journal
is used by no other thread until that commit point has ended.

A crash before 3 leaves files the journal does not call committed; the next
run deletes them (orphans) and processes those items again. Committed
outputs are re-hashed on every resume and redone if damaged or missing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchverity.batch._bag import BAG_INFO_TXT, BAGIT_TXT, write_bag, write_text
from torchverity.batch._changes import (
    AppliedChanges,
    apply_input_changes,
    next_step,
    removed_detail,
    retry_failed,
)
from torchverity.batch._inputs import list_inputs, manifest_lines, manifest_root
from torchverity.batch._item import (
    TMP_SUFFIX,
    Durability,
    EngineName,
    ItemFn,
    OutputWriteError,
    file_sha256,
    fsync_dirs,
)
from torchverity.batch._journal import (
    CHANGED,
    COMMITTED,
    FAILED,
    JOURNAL_NAME,
    PENDING,
    ItemRow,
    Journal,
)
from torchverity.batch._journal_check import fingerprint_of
from torchverity.batch._model import ModelFactory
from torchverity.batch._options import BatchOptions
from torchverity.batch._paths import DATA_DIR
from torchverity.batch._scheduler import Engine, Scheduler
from torchverity.errors import BatchError, IntegrityError
from torchverity.manifest import SHA256SUM_NAME, ManifestEntry

JOB_FORMAT = "torchverity-batch-job/1"
INPUTS_MANIFEST = "inputs-sha256.txt"
LOCK_NAME = ".batch.lock"


@dataclass(frozen=True)
class ItemProblem:
    """An input that did not end with a committed output, or that is gone, and why."""

    key: str
    state: str
    attempts: int
    error: str | None
    # A failed item's attempts in the latest run that tried it (what --retries bounds);
    # None for other states, or when the journal cannot tell.
    run_attempts: int | None = None


@dataclass(frozen=True)
class BatchReport:
    """The outcome of ``run_batch``: counts over the whole job, and this run's share."""

    out: str
    fingerprint: str
    engine: EngineName
    total: int
    committed: int
    failed: int
    changed: int
    pending: int
    processed: int
    retries: int
    resumed: bool
    interrupted: int
    orphans_removed: int
    repaired: tuple[str, ...]
    new_inputs: int
    edited_inputs: int
    failed_retried: int
    removed: tuple[str, ...]  # inputs gone, their items kept (not run, outputs stale)
    pruned: tuple[str, ...]
    seconds: float
    items_per_s: float  # processed / seconds: the whole run, start-up and listing included
    problems: tuple[ItemProblem, ...]
    manifest: str | None
    command: str | None  # the `torchverity batch run` command of this job, when it has one
    next_step: str | None

    @property
    def ok(self) -> bool:
        return self.committed == self.total and not self.removed


def job_fingerprint(inputs: Path, options: BatchOptions,
                    identity: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """SHA-256 of the canonical JSON job description, and that description."""
    from torchverity import __version__

    doc = {
        "format": JOB_FORMAT,
        "torchverity": __version__,
        "model": identity,
        "inputs": os.fspath(inputs.resolve()),
        "suffix": options.suffix,
        "settings": dict(options.setting_pairs),
    }
    return fingerprint_of(doc), doc


def execute(inputs: Path, out: Path, options: BatchOptions, factory: ModelFactory,
            progress: Callable[[int, int], None] | None = None) -> BatchReport:
    """Run (or resume) a job to the end; see the module docstring for the guarantees."""
    start = time.perf_counter()
    out = out.resolve()
    # Weights verified (and, locally, the model built and golden-checked) before
    # anything is written. Ray actors each build and check their own copy later.
    make: Callable[[bool], Engine]
    if options.engine == "local":
        fn, identity = factory.load()
        make = functools.partial(_local_engine, fn, options, out)
    else:
        identity = factory.identity()
        make = functools.partial(_ray_engine, factory, identity, options, out)
    fingerprint, doc = job_fingerprint(inputs, options, identity)
    _prepare_out(out)
    with _exclusive(out):
        job = _Job(inputs, out, options, fingerprint, doc, _command(inputs, out, options, factory))
        return _run_locked(job, make, progress, start)


def _command(inputs: Path, out: Path, options: BatchOptions, factory: ModelFactory) -> str | None:
    """The ``torchverity batch run`` command that runs this job as it runs now, if there is one.

    Absolute paths: ``batch verify`` prints it from wherever it is run. ``--force``,
    ``--retry-failed`` and ``--prune-removed`` are requests of one run, never repeated.
    """
    import shlex

    model = factory.cli_args()
    if model is None or options.settings:
        return None  # a Python function, or settings no option can give
    words = ["torchverity", "batch", "run", "--inputs", os.path.abspath(inputs), *model]
    if options.golden_file is not None:
        words += ["--golden", os.path.abspath(options.golden_file)]
    words += ["--out", os.fspath(out)]
    default = BatchOptions()
    for flag, value, usual in (
        ("--workers", options.workers, default.workers),
        ("--engine", options.engine, default.engine),
        ("--ray-address", options.ray_address, default.ray_address),
        ("--retries", options.retries, default.retries),
        ("--suffix", options.suffix, default.suffix),
        ("--durability", options.durability, default.durability),
    ):
        if value != usual:
            words += [flag, str(value)]
    return shlex.join(words)


@dataclass(frozen=True)
class _Job:
    """One run's job: where it reads and writes, how, and its fingerprint."""

    inputs: Path
    out: Path  # resolved
    options: BatchOptions
    fingerprint: str
    doc: dict[str, Any]
    command: str | None


def _run_locked(job: _Job, make: Callable[[bool], Engine],
                progress: Callable[[int, int], None] | None, start: float) -> BatchReport:
    out, options = job.out, job.options
    journal, resumed = _open_or_create(job)
    try:
        resume = (_resume(journal, job) if resumed
                  else _Resume(0, 0, [], AppliedChanges(0, 0, (), ()), 0))
        journal.start_run()
        skip = frozenset(r.id for r in resume.changes.removed)
        durability = Durability(out, options.durability)
        engine = make(durability.per_file)
        try:
            scheduler = Scheduler(journal, engine, out, options, durability, progress, skip)
            processed, retries = scheduler.run()
            golden = options.golden_file
            if golden and scheduler.committed_ids:
                _golden_after(engine, golden, journal, out, scheduler.committed_ids)
        finally:
            engine.close()
        manifest = _finish(journal, out)
        seconds = time.perf_counter() - start
        return _report(journal, job, engine.name, resumed, resume, processed, retries, seconds,
                       manifest)
    finally:
        journal.close()


@dataclass(frozen=True)
class _Resume:
    """What a resume found and did before the first item."""

    interrupted: int
    orphans: int
    repaired: list[str]
    changes: AppliedChanges
    failed_retried: int


def _resume(journal: Journal, job: _Job) -> _Resume:
    if job.command is not None and journal.job().get("command") != job.command:
        journal.set_job({"command": job.command})
    interrupted, orphans, repaired = _recover(journal, job.out)
    changes = apply_input_changes(journal, job.out, job.inputs, job.options.suffix, DATA_DIR,
                                  INPUTS_MANIFEST, job.options.prune_removed)
    retried = 0
    if job.options.retry_failed:
        retried = retry_failed(journal, {r.id for r in changes.removed})
    return _Resume(interrupted, orphans, repaired, changes, retried)


def _golden_after(engine: Engine, golden: str, journal: Journal, out: Path,
                  ids: list[int]) -> None:
    """Accept this run's outputs only if the model still passes its golden check."""
    try:
        engine.recheck(golden)
    except IntegrityError as exc:
        wanted = set(ids)
        rows = [r for r in journal.items(COMMITTED) if r.id in wanted]
        for row in rows:
            (out / row.output).unlink(missing_ok=True)
        journal.reset([r.id for r in rows], "discarded: the model failed its golden check "
                      "after producing this output")
        raise IntegrityError(
            f"{exc.message}; the {len(rows)} outputs this run produced were discarded and "
            "their items are pending again",
            path=exc.path,
            tensors=exc.tensors,
            hint="check the machine (torchverity selftest), then rerun the same command to "
            "redo them",
        ) from None


def _prepare_out(out: Path) -> None:
    """Create the output folder and prove it takes a file, before any work is done."""
    probe = out / f".torchverity-write-probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise BatchError(
            f"{out}: the output folder is not writable: {exc.strerror or exc}",
            out=out,
            hint="choose a writable --out folder (check its permissions, mount options and "
            "free space)",
        ) from None


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """One driver per output folder: a second one would delete the first one's work."""
    import fcntl

    try:
        fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise BatchError(
            f"{out / LOCK_NAME}: cannot open the job's lock file: {exc.strerror or exc}",
            out=out,
            hint=f"remove what is at {out / LOCK_NAME} (a run creates it as an empty file), "
            "then rerun",
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BatchError(
                f"{out}: another 'torchverity batch run' is working in this folder",
                out=out,
                hint="wait for it to finish (or stop it), then rerun to resume",
            ) from None
        yield  # the kernel drops the lock when this process dies, even by SIGKILL
    finally:
        os.close(fd)


def _open_or_create(job: _Job) -> tuple[Journal, bool]:
    out = job.out
    if job.options.force:
        _discard_job(out)
    elif (out / JOURNAL_NAME).exists():
        journal = Journal.open(out)
        _check_same_job(journal, out, job.fingerprint, job.doc)
        return journal, True
    elif _has_files(out / DATA_DIR):
        raise BatchError(
            f"{out}: holds outputs in {DATA_DIR}/ but no journal ({JOURNAL_NAME} was deleted?): "
            "nothing says which outputs are complete",
            out=out,
            hint="move the folder away and rerun, or rerun with --force to delete those "
            "outputs and start the job again",
        )
    return _create(job), False


def _check_same_job(journal: Journal, out: Path, fingerprint: str, doc: dict[str, Any]) -> None:
    job = journal.job()
    if job.get("fingerprint") == fingerprint:
        return
    old = json.loads(job.get("job", "{}"))
    changed = sorted(k for k in set(old) | set(doc) if old.get(k) != doc.get(k))
    journal.close()
    raise BatchError(
        f"{out}: this folder holds a different job (job fingerprint "
        f"{job.get('fingerprint', '?')[:16]}…, now {fingerprint[:16]}…; differs in: "
        f"{', '.join(changed) or 'unknown'}); resuming would mix outputs of two jobs",
        out=out,
        hint="use a new --out folder, or rerun with --force to delete this job's outputs and "
        "start again",
    )


def _discard_job(out: Path) -> None:
    for name in (JOURNAL_NAME, f"{JOURNAL_NAME}-wal", f"{JOURNAL_NAME}-shm", SHA256SUM_NAME,
                 BAGIT_TXT, BAG_INFO_TXT, INPUTS_MANIFEST):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / DATA_DIR, ignore_errors=True)


def _has_files(folder: Path) -> bool:
    return folder.is_dir() and any(files for _, _, files in os.walk(folder))


def _create(job: _Job) -> Journal:
    out = job.out
    records = list_inputs(job.inputs, exclude=out)
    outputs = [f"{DATA_DIR}/{r.key}{job.options.suffix}" for r in records]
    # Strings first: a Path per output costs milliseconds per thousand items, at start-up.
    folders = {out / d for d in {os.path.dirname(o) for o in outputs}}
    # Every new folder's entry lives in its parent: all of them up to OUT must be synced
    # (OUT itself by Journal.create, after the journal's rename).
    ancestors = {a for f in folders for a in (f, *f.parents)
                 if a != out and a.is_relative_to(out)}
    try:
        for folder in sorted(folders):
            folder.mkdir(parents=True, exist_ok=True)
        fsync_dirs(ancestors)
    except (OSError, OutputWriteError) as exc:
        raise BatchError(f"{out}: cannot create the output folders: {exc}", out=out) from None
    write_text(out, INPUTS_MANIFEST, "".join(manifest_lines(records)))
    values = {
        "fingerprint": job.fingerprint,
        "job": json.dumps(job.doc, sort_keys=True),
        "inputs_root": manifest_root(records),
        "created": str(time.time()),
    }
    if job.command is not None:
        values["command"] = job.command
    return Journal.create(out, values, records, outputs)


def _recover(journal: Journal, out: Path) -> tuple[int, int, list[str]]:
    """After a crash: requeue running items, delete orphans, re-verify committed outputs."""
    interrupted = len(journal.recover())
    items = journal.items()
    committed = {i.output: i for i in items if i.state == COMMITTED}
    uncommitted = {i.output for i in items if i.state != COMMITTED}
    orphans = 0
    for folder, _, files in os.walk(out / DATA_DIR):
        for name in files:
            path = Path(folder) / name
            if name.endswith(TMP_SUFFIX) or path.relative_to(out).as_posix() in uncommitted:
                path.unlink()
                orphans += 1
    rows = list(committed.values())
    damaged = [r for r, found in zip(rows, stored_digests(out, rows), strict=True)
               if found is None or found[0] != r.output_digest]
    for row in damaged:
        (out / row.output).unlink(missing_ok=True)
    if damaged:
        journal.reset([r.id for r in damaged], "committed output was damaged or missing")
    return interrupted, orphans, [r.key for r in damaged]


def stored_digests(out: Path, rows: list[ItemRow]) -> list[tuple[str, int] | None]:
    """SHA-256 and size of each row's output file (None when missing), on all cores."""
    if not rows:
        return []
    with ThreadPoolExecutor(max_workers=min(len(rows), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda r: file_sha256(out / r.output), rows))


def _local_engine(fn: ItemFn, options: BatchOptions, out: Path, fsync: bool) -> Engine:
    from torchverity.batch._engine_local import LocalEngine

    return LocalEngine(fn, out, options.workers, fsync=fsync)


def _ray_engine(factory: ModelFactory, identity: dict[str, str], options: BatchOptions,
                out: Path, fsync: bool) -> Engine:
    from torchverity.batch._engine_ray import RayEngine

    return RayEngine(factory, identity, out, options.workers, options.ray_address, fsync=fsync)


def _finish(journal: Journal, out: Path) -> str | None:
    """When every item has its final state, write the bag manifest of the outputs."""
    counts = journal.counts()
    if counts[PENDING] or not counts[COMMITTED]:
        return None
    entries = [ManifestEntry(*row) for row in journal.committed_outputs()]
    return os.fspath(write_bag(out, entries))


def _report(journal: Journal, job: _Job, engine: EngineName, resumed: bool, resume: _Resume,
            processed: int, retries: int, seconds: float, manifest: str | None) -> BatchReport:
    # Counts are of the inputs that exist: a removed input's item (not run this time, so
    # its state is the one it was found in) is reported on its own.
    removed = resume.changes.removed
    counts = journal.counts()
    for row in removed:
        counts[row.state] -= 1
    gone = {r.id for r in removed}
    tries = journal.run_attempts()
    problems = tuple(
        ItemProblem(r.key, r.state, r.attempts, r.error,
                    tries.get(r.id) if r.state == FAILED else None)
        for r in journal.items(FAILED, CHANGED, PENDING) if r.id not in gone
    ) + tuple(ItemProblem(r.key, "input-removed", r.attempts, removed_detail(r, job.doc["inputs"]))
              for r in removed)
    return BatchReport(
        out=os.fspath(job.out), fingerprint=job.fingerprint, engine=engine,
        total=sum(counts.values()), committed=counts[COMMITTED], failed=counts[FAILED],
        changed=counts[CHANGED], pending=counts[PENDING], processed=processed, retries=retries,
        resumed=resumed, interrupted=resume.interrupted, orphans_removed=resume.orphans,
        repaired=tuple(resume.repaired), new_inputs=resume.changes.new,
        edited_inputs=resume.changes.edited, failed_retried=resume.failed_retried,
        removed=tuple(r.key for r in removed), pruned=resume.changes.pruned,
        seconds=round(seconds, 3),
        items_per_s=round(processed / seconds, 1) if seconds > 0 else 0.0,
        problems=problems, manifest=manifest, command=job.command,
        next_step=next_step(job.command, rerun=bool(counts[PENDING] or counts[CHANGED]),
                            failed=bool(counts[FAILED]), removed=bool(removed)),
    )
