"""The local engine: a pool of threads in the driver process.

Reading, hashing, fsync and torch all release the GIL, so threads keep the
cores busy without copying the model into other processes. Each worker
writes its item's output file itself (temp, fsync, rename); the driver alone
records outcomes in the journal.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from torchverity.batch._item import ItemFn, ItemResult, OutputWriteError, process
from torchverity.batch._journal import WorkItem

EngineEvent = ItemResult | OutputWriteError


class LocalEngine:
    """Runs ``fn`` on ``workers`` threads."""

    name = "local"

    def __init__(self, fn: ItemFn, out: Path, workers: int) -> None:
        self.capacity = workers
        self._fn = fn
        self._out = out
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tv-batch")
        self._futures: set[Future[ItemResult]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    def submit(self, work: WorkItem) -> None:
        self._futures.add(self._pool.submit(process, work, self._fn, self._out))

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
