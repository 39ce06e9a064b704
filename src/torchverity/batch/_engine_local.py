"""The local engine: the driver's own thread, or a pool of threads in the driver process.

With one worker and small items (the default durability), the driver's
thread runs every item itself, one after the other: read and verify, model,
hash, write and rename, with no hand-over to another thread per item (each
cost the model more than the checks it took over). The commit points run on
a thread of their own (see ``_scheduler.Committer``), so the model never waits for
the disk.

Otherwise threads: reading, hashing, fsync and torch all release the GIL, so
threads keep the cores busy without copying the model into other processes.
At most ``workers`` threads run the model at once; once items of at least
``HELPER_MIN_BYTES`` arrive (and always when every output is fsynced), helper
threads read and verify inputs and hash and write outputs (temp, fsync,
rename) meanwhile, so the checks overlap the model's compute and the
filesystem can group concurrent fsyncs into one journal commit. The driver
alone records outcomes in the journal.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from pathlib import Path

from torchverity.batch._item import (
    EngineName,
    ItemFn,
    ItemResult,
    OutputWriteError,
    committed,
    compute,
    read_input,
    run_fn,
    write_output,
)
from torchverity.batch._journal import WorkItem
from torchverity.batch._model import golden_gate

EngineEvent = ItemResult | OutputWriteError
# Threads that read, verify, hash and write while the model threads compute: one per
# model thread keeps the model busy (more only contend for the cores: +26% CPU on 10 KiB
# items with 4); with an fsync per output, more of them hide its latency.
FSYNC_HELPER_THREADS = 4
# Below this input size a helper thread costs the model more than the checks it takes
# over: a second Python thread takes the GIL at each of the model's small torch calls.
# bench_batch MLP, loaded 2-core machine, overhead vs a plain loop without / with one
# helper: 10 KiB +13% / +35%, 16 KiB +4% / +16%, 32 KiB +16% / +9%, 128 KiB +10% / +6%,
# 1 MiB +15% / +0.4%.
HELPER_MIN_BYTES = 32 * 1024
# Items queued ahead of the threads (not read yet, so they cost no memory): enough
# that the model never waits while the driver runs a slow commit point (a flush on a
# busy disk can take a quarter of a second).
BACKLOG = 256
# While this many items are queued, the driver lets results gather this long after the
# first before it collects them: it wakes every few ms instead of once per item, so it
# takes the GIL from the pool threads less often (1500 x 10 KiB without a model: 18%
# less CPU). The queued items keep the model busy; near the end it wakes per item again.
GATHER_ABOVE = 64
GATHER_S = 0.005
# Items handed to the driver's own thread at a time: the scheduler's bookkeeping
# between batches costs a few microseconds, not a few per item.
INLINE_BACKLOG = 16


def _thread_setup() -> None:
    """Give pool threads the caller's torch thread count.

    ``torch.set_num_threads`` binds OpenMP only in the thread that calls it;
    a new thread falls back to one OpenMP thread per core, which on a busy
    machine made the same model up to 8x slower in the pool than in the caller.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(torch.get_num_threads())


class LocalEngine:
    """Runs ``fn`` on ``workers`` threads at a time."""

    name: EngineName = "local"

    def __init__(self, fn: ItemFn, out: Path, workers: int, *, fsync: bool) -> None:
        self._workers = workers
        self._helpers = FSYNC_HELPER_THREADS if fsync else workers
        self._fn = fn
        self._out = out
        self._fsync = fsync
        self._compute_slots = threading.BoundedSemaphore(workers)
        # Plain queues in and out: per item, far cheaper than an executor's futures.
        self._todo: queue.SimpleQueue[WorkItem | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[EngineEvent | BaseException] = queue.SimpleQueue()
        self._in_flight = 0
        self._threads: list[threading.Thread] = []
        # Items the driver's thread runs itself, while there is no pool.
        self._inline: deque[WorkItem] = deque()
        self._finished: list[ItemResult] = []
        self._running_since: float | None = None
        # Held by the driver's thread except while an item runs (see share_lock).
        self._lock = threading.Lock()
        self._lock.acquire()
        # An fsync's latency is worth hiding whatever the item size.
        self._helping = fsync
        if fsync or workers > 1:
            self._start_threads(workers + (self._helpers if fsync else 0))

    @property
    def backlog(self) -> int:
        if not self._threads:
            return INLINE_BACKLOG
        return self._workers + self._helpers + BACKLOG

    def _start_threads(self, count: int) -> None:
        first = len(self._threads)
        new = [threading.Thread(target=self._loop, name=f"tv-batch-{i}", daemon=True)
               for i in range(first, first + count)]
        self._threads += new
        for thread in new:
            thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight + len(self._inline)

    def submit(self, work: WorkItem) -> None:
        if not self._helping and work.size >= HELPER_MIN_BYTES:
            self._helping = True
            # The model moves to a pool thread (the first item large enough to need a
            # helper); items the driver had not started yet go with it, in order.
            self._start_threads(self._helpers + (0 if self._threads else self._workers))
            while self._inline:
                self._enqueue(self._inline.popleft())
        if self._threads:
            self._enqueue(work)
        else:
            self._inline.append(work)

    def _enqueue(self, work: WorkItem) -> None:
        self._in_flight += 1
        self._todo.put(work)

    def _loop(self) -> None:
        _thread_setup()
        while (work := self._todo.get()) is not None:
            try:
                self._done.put(self._item(work))
            except BaseException as exc:  # the driver re-raises it: it must not wait forever
                self._done.put(exc)

    def _item(self, work: WorkItem) -> ItemResult:
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
        if self._inline:
            return self._run_inline(time.monotonic() + timeout)
        if not self._in_flight:
            return []
        events: list[EngineEvent] = []
        try:
            event = self._done.get(timeout=timeout)
            if self._in_flight > GATHER_ABOVE:
                time.sleep(GATHER_S)
            while True:
                self._in_flight -= 1
                if isinstance(event, BaseException) and not isinstance(event, OutputWriteError):
                    raise event
                events.append(event)
                event = self._done.get_nowait()
        except queue.Empty:
            pass
        return events

    def _run_inline(self, deadline: float) -> list[EngineEvent]:
        """Run submitted items on this thread until none is left or ``deadline`` passes."""
        while self._inline:
            work = self._inline.popleft()
            self._running_since = time.monotonic()
            # While the item runs, the driver's lock is free: if it runs long (or hangs),
            # the scheduler's watchdog records the items finished before it.
            self._lock.release()
            try:
                result, view = compute(work, self._fn)
            finally:
                self._lock.acquire()
                self._running_since = None
            if view is not None:
                try:
                    write_output(self._out, work, view, fsync=self._fsync)
                except OutputWriteError as exc:  # fatal: the scheduler stops the job
                    return [*self.take_finished(), exc]
            self._finished.append(result)
            if time.monotonic() >= deadline:
                break
        return list(self.take_finished())

    def share_lock(self, lock: threading.Lock) -> None:
        """The driver's lock (held by this thread): released only while an item runs."""
        self._lock = lock

    def stalled_since(self) -> float | None:
        """When the item now running on the driver's thread started (None: none is)."""
        return self._running_since

    def take_finished(self) -> list[ItemResult]:
        """The items the driver's thread finished and has not reported yet (call with the
        driver's lock held)."""
        finished, self._finished = self._finished, []
        return finished

    def recheck(self, golden: str) -> None:
        golden_gate(self._fn, golden, "after producing this run's outputs")

    def close(self) -> None:
        """Drop the items not started (they resume next run), finish those started."""
        self._inline.clear()
        try:
            while True:
                self._todo.get_nowait()
        except queue.Empty:
            pass
        for _ in self._threads:
            self._todo.put(None)
        for thread in self._threads:
            thread.join()
