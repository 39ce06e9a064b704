"""The local engine: a pool of threads in the driver process.

Reading, hashing, fsync and torch all release the GIL, so threads keep the
cores busy without copying the model into other processes. At most
``workers`` threads run the model at once; the other threads read and verify
inputs and hash and write outputs (temp, fsync, rename) meanwhile, so the
checks overlap the model's compute and the filesystem can group concurrent
fsyncs into one journal commit. The
driver alone records outcomes in the journal.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from torchverity.batch._item import (
    ItemFn,
    ItemResult,
    OutputWriteError,
    committed,
    read_input,
    run_fn,
    write_output,
)
from torchverity.batch._journal import WorkItem
from torchverity.batch._model import golden_gate

EngineEvent = ItemResult | OutputWriteError
# Threads that verify, hash and fsync while the model threads go on computing.
HELPER_THREADS = 4


class LocalEngine:
    """Runs ``fn`` on ``workers`` threads at a time."""

    name = "local"

    def __init__(self, fn: ItemFn, out: Path, workers: int, *, fsync: bool) -> None:
        self.capacity = workers + HELPER_THREADS
        self._fn = fn
        self._out = out
        self._fsync = fsync
        self._compute_slots = threading.BoundedSemaphore(workers)
        self._pool = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="tv-batch")
        self._futures: set[Future[ItemResult]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    def submit(self, work: WorkItem) -> None:
        self._futures.add(self._pool.submit(self._process, work))

    def _process(self, work: WorkItem) -> ItemResult:
        # Only the model holds a compute slot: reading and hashing the input, hashing
        # and writing the output overlap with other items' compute.
        data = read_input(work)
        if isinstance(data, ItemResult):
            return data
        with self._compute_slots:
            view = run_fn(work, self._fn, data)
        if isinstance(view, ItemResult):
            return view
        result = committed(work, view)
        write_output(self._out, work, view, fsync=self._fsync)
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

    def recheck(self, golden: str) -> None:
        golden_gate(self._fn, golden, "after producing this run's outputs")

    def close(self) -> None:
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)
