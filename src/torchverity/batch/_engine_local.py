"""The local engine: a pool of threads in the driver process.

Reading, hashing, fsync and torch all release the GIL, so threads keep the
cores busy without copying the model into other processes. At most
``workers`` threads run the model at once; extra threads only write outputs
(temp, fsync, rename), so one item's fsync overlaps the next item's compute
and the filesystem can group concurrent fsyncs into one journal commit. The
driver alone records outcomes in the journal.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from torchverity.batch._item import ItemFn, ItemResult, OutputWriteError, compute, write_output
from torchverity.batch._journal import WorkItem

EngineEvent = ItemResult | OutputWriteError
# Threads that may be waiting in fsync while the model threads go on computing.
WRITER_THREADS = 4


class LocalEngine:
    """Runs ``fn`` on ``workers`` threads at a time."""

    name = "local"

    def __init__(self, fn: ItemFn, out: Path, workers: int) -> None:
        self.capacity = workers + WRITER_THREADS
        self._fn = fn
        self._out = out
        self._compute_slots = threading.BoundedSemaphore(workers)
        self._pool = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="tv-batch")
        self._futures: set[Future[ItemResult]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    def submit(self, work: WorkItem) -> None:
        self._futures.add(self._pool.submit(self._process, work))

    def _process(self, work: WorkItem) -> ItemResult:
        with self._compute_slots:
            result, view = compute(work, self._fn)
        if view is not None:
            write_output(self._out, work, view)
        return result

    def wait(self, timeout: float) -> list[EngineEvent]:
        """Results of the items finished within ``timeout`` seconds (maybe none)."""
        if not self._futures:
            return []
        done, _ = wait(self._futures, timeout=timeout, return_when=FIRST_COMPLETED)
        self._futures -= done
        events: list[EngineEvent] = []
        for future in done:
            try:
                events.append(future.result())
            except OutputWriteError as exc:
                events.append(exc)
        return events

    def close(self) -> None:
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)
