"""The driver's loop: feed the engine, retry failed items with backoff, and group outcomes
into commit points, each run on a committer thread (the ordering that makes outputs
exactly-once is told in :mod:`torchverity.batch._run`)."""

from __future__ import annotations

import heapq
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from torchverity.batch._item import Durability, EngineName, ItemResult, OutputWriteError
from torchverity.batch._journal import COMMITTED, FAILED, PENDING, Journal, Outcome, WorkItem
from torchverity.batch._options import BatchOptions
from torchverity.errors import BatchError

# Outcomes wait for a commit point at most this long / this many: bounds both the
# work a crash can lose and the fsyncs per item.
COMMIT_INTERVAL_S = 0.25
COMMIT_EVERY = 256
MAX_BACKOFF_S = 10.0


class Engine(Protocol):
    name: EngineName

    @property
    def backlog(self) -> int: ...  # how many items the driver keeps submitted

    @property
    def in_flight(self) -> int: ...

    def submit(self, work: WorkItem) -> None: ...

    def wait(self, timeout: float) -> list[ItemResult | OutputWriteError]: ...

    def recheck(self, golden: str) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class _RunsOnDriver(Protocol):
    """An engine that may run items on the driver's own thread (the local engine)."""

    def share_lock(self, lock: threading.Lock) -> None: ...

    def stalled_since(self) -> float | None: ...

    def take_finished(self) -> list[ItemResult]: ...


class Committer:
    """Runs commit points (flush the outputs, then the journal transaction) on a thread.

    Both flushes (``syncfs`` or fsyncs, SQLite's fsync) release the GIL, so the
    items go on meanwhile; with one worker the model runs on the driver's own
    thread and would otherwise wait for the disk at every commit point.
    """

    def __init__(self, journal: Journal, durability: Durability) -> None:
        self._journal = journal
        self._durability = durability
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, folders: set[Path], outcomes: list[Outcome], running: list[int]) -> None:
        """Start a commit point once the previous one has ended (raising its error)."""
        self.wait()
        self._thread = threading.Thread(target=self._commit, args=(folders, outcomes, running),
                                        name="tv-journal-commit", daemon=True)
        self._thread.start()

    def _commit(self, folders: set[Path], outcomes: list[Outcome], running: list[int]) -> None:
        try:
            # The outputs and their renames are on disk before the journal says so.
            self._durability.commit_point(folders)
            self._journal.record(outcomes, running)
        except BaseException as exc:  # the driver re-raises it at its next step
            self._error = exc

    def settle(self) -> None:
        """Wait for the commit point in flight; keep its error for ``wait``."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self) -> None:
        """Wait for the commit point in flight and raise its error, if it had one."""
        self.settle()
        error, self._error = self._error, None
        if error is not None:
            raise error


class Scheduler:
    """Feeds the engine, applies retries with backoff, and groups outcomes into commit points."""

    def __init__(self, journal: Journal, engine: Engine, out: Path, options: BatchOptions,
                 durability: Durability, progress: Callable[[int, int], None] | None,
                 skip: frozenset[int]) -> None:
        self.journal = journal
        self.skip = skip  # items whose input is gone: not run, not counted
        self.committer = Committer(journal, durability)
        self.engine = engine
        self.out = out
        self.options = options
        self.progress = progress or (lambda done, total: None)
        self.todo: deque[WorkItem] = deque()
        self.delayed: list[tuple[float, int, WorkItem]] = []
        self.running: dict[int, WorkItem] = {}
        self.marked: set[int] = set()  # in flight and recorded as running (journal)
        self.failures: dict[int, int] = {}
        self.buffer: list[Outcome] = []
        self.folders: set[str] = set()  # of this commit point's outputs, relative to out
        self.last_commit = time.monotonic()
        self.processed = 0
        self.retries = 0
        self.committed_ids: list[int] = []
        # The scheduler's state belongs to whoever holds this lock: the driver's thread,
        # or the watchdog while an item runs long on the driver's thread.
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.watch_error: BaseException | None = None

    def run(self) -> tuple[int, int]:
        work = [w for w in self.journal.pending_work() if w.id not in self.skip]
        self.total = sum(self.journal.counts().values()) - len(self.skip)
        self.done = self.total - len(work)
        self.progress(self.done, self.total)
        self.todo.extend(work)
        fatal: OutputWriteError | None = None
        try:
            try:
                fatal = self._loop()
                self.committer.wait()
            finally:
                self.committer.settle()  # whatever happened: the journal is free again
        except BatchError as exc:  # the journal itself could not be written
            raise self._stopped(exc.message, None) from None
        except OutputWriteError as exc:  # a commit point could not flush the outputs
            fatal = exc
        except KeyboardInterrupt:
            if self.buffer:
                self._commit()  # finished outputs stay done; the rest resumes next run
                self.committer.wait()
            raise
        if fatal is not None:
            what = f"cannot write output {fatal.path}: {fatal.error.strerror or fatal.error}"
            raise self._stopped(what, os.fspath(fatal.path))
        return self.processed, self.retries

    def _loop(self) -> OutputWriteError | None:
        fatal = None
        self.lock.acquire()
        watchdog = None
        if isinstance(self.engine, _RunsOnDriver):
            self.engine.share_lock(self.lock)
            watchdog = threading.Thread(target=self._watch, args=(self.engine,),
                                        name="tv-journal-watch", daemon=True)
            watchdog.start()
        try:
            while fatal is None and (self.todo or self.delayed or self.engine.in_flight):
                self._release_delayed()
                self._submit()
                fatal = self._collect()
                idle = not (self.todo or self.engine.in_flight)  # the end, or a backoff
                self._maybe_commit(force=fatal is not None or idle)
                if self.watch_error is not None:
                    raise self.watch_error
        finally:
            self.stop.set()
            self.lock.release()
            if watchdog is not None:
                watchdog.join()
        return fatal

    def _watch(self, engine: _RunsOnDriver) -> None:
        """Record what finished while one item runs long on the driver's thread.

        Otherwise outputs written before a slow or hung item would wait for it to
        end before they are committed (and be redone if the job is then killed).
        """
        while not self.stop.wait(COMMIT_INTERVAL_S):
            since = engine.stalled_since()
            if since is None or time.monotonic() - since < COMMIT_INTERVAL_S:
                continue
            with self.lock:
                if self.stop.is_set() or engine.stalled_since() != since:
                    continue  # the item ended meanwhile: the driver records it
                try:
                    for result in engine.take_finished():
                        self._outcome(result)
                    self._maybe_commit(force=False)
                except BaseException as exc:  # the driver raises it when the item ends
                    self.watch_error = exc
                    return

    def _release_delayed(self) -> None:
        now = time.monotonic()
        while self.delayed and self.delayed[0][0] <= now:
            self.todo.append(heapq.heappop(self.delayed)[2])

    def _submit(self) -> None:
        room = self.engine.backlog - self.engine.in_flight
        for _ in range(min(room, len(self.todo))):
            work = self.todo.popleft()
            self.running[work.id] = work
            self.engine.submit(work)

    def _collect(self) -> OutputWriteError | None:
        timeout = COMMIT_INTERVAL_S
        if self.delayed:
            timeout = max(0.0, min(timeout, self.delayed[0][0] - time.monotonic()))
        if not self.engine.in_flight:
            time.sleep(timeout)
            return None
        fatal = None
        for event in self.engine.wait(timeout):
            if isinstance(event, OutputWriteError):
                fatal = fatal or event
            else:
                self._outcome(event)
        return fatal

    def _outcome(self, result: ItemResult) -> None:
        work = self.running.pop(result.id)
        self.marked.discard(work.id)  # a retry must be marked running again
        if result.status == FAILED:
            failures = self.failures.get(work.id, 0) + 1
            self.failures[work.id] = failures
            if failures <= self.options.retries:
                self.retries += 1
                self.buffer.append(Outcome(work.id, PENDING, error=result.error))
                delay = min(MAX_BACKOFF_S, self.options.backoff * 2 ** (failures - 1))
                retry = WorkItem(work.id, work.key, work.path, work.size, work.digest,
                                 work.output, work.attempt + 1)
                heapq.heappush(self.delayed, (time.monotonic() + delay, work.id, retry))
                return
        if result.status == COMMITTED:
            self.folders.add(os.path.dirname(work.output))
            self.committed_ids.append(work.id)
        self.buffer.append(
            Outcome(work.id, result.status, result.output_digest, result.output_size, result.error)
        )
        self.processed += 1
        self.done += 1
        self.progress(self.done, self.total)

    def _maybe_commit(self, force: bool) -> None:
        if self.committer.busy and not force:
            return  # outcomes keep gathering until the commit point in flight ends
        due = time.monotonic() - self.last_commit >= COMMIT_INTERVAL_S
        unmarked = due and not self.marked.issuperset(self.running)
        if (self.buffer and (force or due or len(self.buffer) >= COMMIT_EVERY)) or unmarked:
            self._commit()

    def _commit(self) -> None:
        # Every buffered outcome's output is renamed already: the commit point's flush
        # starts after that, on the committer thread.
        started = sorted(i for i in self.running if i not in self.marked)
        self.marked = set(self.running)
        self.committer.start({self.out / f for f in self.folders}, self.buffer, started)
        self.buffer, self.folders = [], set()
        self.last_commit = time.monotonic()

    def _stopped(self, what: str, item: str | None) -> BatchError:
        committed = sum(r.id not in self.skip for r in self.journal.items(COMMITTED))
        return BatchError(
            f"{what}; the job stopped with {committed} of {self.total} items committed",
            out=self.out,
            item=item,
            hint="free space or fix permissions of the --out folder, then rerun the same "
            "command: it resumes where it stopped",
        )
