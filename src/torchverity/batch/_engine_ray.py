"""The Ray engine: one actor per worker, each holding its own copy of the model.

Actors read and verify their inputs (the inputs must be on storage every node
sees at the same path), run the model, and return the output bytes with
their digest. The driver hashes the bytes again as it receives them, writes
the file (temp, fsync, rename) and keeps the journal, so the guarantees are
those of the local engine. Ray's own retries are off: the driver decides
every retry and records it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from torchverity.batch._item import (
    EngineName,
    ItemFn,
    ItemResult,
    OutputWriteError,
    compute,
    write_output,
)
from torchverity.batch._journal import FAILED, WorkItem
from torchverity.batch._model import ModelFactory, golden_gate
from torchverity.errors import BatchError, TorchVerityError, require_extra

EngineEvent = ItemResult | OutputWriteError


class _Worker:
    """The actor body: builds the model once, then processes items one at a time."""

    def __init__(self, factory: ModelFactory) -> None:
        self._factory = factory
        self._fn: ItemFn | None = None

    def identity(self) -> dict[str, str]:
        """Build the model (first call) and say which one it is.

        Loading here rather than in ``__init__`` makes a failure (weights,
        golden check) reach the driver as a task error with its original cause.
        """
        self._fn, ident = self._factory.load()
        return ident

    def recheck(self, golden: str) -> None:
        assert self._fn is not None
        golden_gate(self._fn, golden, "after producing this run's outputs")

    def process(self, work: WorkItem) -> ItemResult:
        assert self._fn is not None
        result, view = compute(work, self._fn)
        if view is None:
            return result
        return dataclasses.replace(result, payload=bytes(view))


class RayEngine:
    """Runs the per-item function on ``workers`` Ray actors (one CPU each)."""

    name: EngineName = "ray"

    def __init__(self, factory: ModelFactory, identity: dict[str, str], out: Path,
                 workers: int, address: str | None = None, *, fsync: bool = True) -> None:
        self._ray = require_extra("ray", extra="ray", feature="the Ray engine (--engine ray)")
        self._owns = not self._ray.is_initialized()
        self._reaper: Any = None
        if self._owns:
            self._init(address, workers)
        self.backlog = 2 * workers  # one item computing and one waiting per actor
        self._out = out
        self._fsync = fsync
        self._factory = factory
        self._actor_cls = self._ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(
            _Worker
        )
        self._identity = identity
        self._actors = self._start_actors(workers)
        self._load = {i: 0 for i in range(workers)}
        self._refs: dict[Any, tuple[int, WorkItem]] = {}

    def _init(self, address: str | None, workers: int) -> None:
        import logging
        import os

        options: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
        if address:
            options["address"] = address
        elif not os.environ.get("RAY_ADDRESS"):
            options["num_cpus"] = workers
        self._ray.init(**options)
        if not address and not os.environ.get("RAY_ADDRESS"):
            from torchverity.batch._ray_reaper import start_reaper

            self._reaper = start_reaper()  # the cluster is ours: it dies with this driver

    def _start_actors(self, count: int) -> list[Any]:
        """Start actors and wait until each has built its model (in parallel)."""
        actors = [self._actor_cls.remote(self._factory) for _ in range(count)]
        try:
            found = self._ray.get([a.identity.remote() for a in actors])
        except self._ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, TorchVerityError):  # e.g. weights or golden check
                raise exc.cause from None
            raise BatchError(
                f"a Ray worker could not load the model: {_cause(exc)}",
                hint="the model module and weights must be importable/readable on every node",
            ) from None
        except self._ray.exceptions.RayError as exc:
            raise BatchError(
                f"a Ray worker could not load the model: {_cause(exc)}",
                hint="the model module and weights must be importable/readable on every node",
            ) from None
        for got in found:
            if got != self._identity:
                raise BatchError(
                    f"a Ray worker loaded a different model: {got} instead of {self._identity}",
                    hint="every node must see the same weights file and model code",
                )
        return actors

    @property
    def in_flight(self) -> int:
        return len(self._refs)

    def submit(self, work: WorkItem) -> None:
        slot = min(self._load, key=self._load.__getitem__)
        self._load[slot] += 1
        self._refs[self._actors[slot].process.remote(work)] = (slot, work)

    def wait(self, timeout: float) -> list[EngineEvent]:
        if not self._refs:
            return []
        ready, _ = self._ray.wait(list(self._refs), num_returns=1, timeout=timeout)
        if ready:  # collect everything else that is already done too
            ready, _ = self._ray.wait(list(self._refs), num_returns=len(self._refs), timeout=0)
        events: list[EngineEvent] = []
        for ref in ready:
            slot, work = self._refs.pop(ref)
            self._load[slot] -= 1
            events.append(self._receive(ref, slot, work))
        return events

    def _receive(self, ref: Any, slot: int, work: WorkItem) -> EngineEvent:
        try:
            result: ItemResult = self._ray.get(ref)
        except self._ray.exceptions.RayActorError as exc:
            self._actors[slot] = self._start_actors(1)[0]
            return ItemResult(work.id, FAILED, error=f"Ray worker died: {_cause(exc)}")
        except self._ray.exceptions.RayError as exc:
            return ItemResult(work.id, FAILED, error=f"Ray task failed: {_cause(exc)}")
        if result.payload is None:
            return result
        if hashlib.sha256(result.payload).hexdigest() != result.output_digest:
            return ItemResult(work.id, FAILED,
                              error="output bytes changed between worker and driver")
        try:
            write_output(self._out, work, memoryview(result.payload), fsync=self._fsync)
        except OutputWriteError as exc:
            return exc
        return dataclasses.replace(result, payload=None)

    def recheck(self, golden: str) -> None:
        """Every actor reruns the golden check on its own copy of the model."""
        try:
            self._ray.get([actor.recheck.remote(golden) for actor in self._actors])
        except self._ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, TorchVerityError):
                raise exc.cause from None
            raise

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)
        if self._owns:
            self._ray.shutdown()
        if self._reaper is not None:
            from torchverity.batch._ray_reaper import stop_reaper

            stop_reaper(self._reaper)


def _cause(exc: Exception) -> str:
    return str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
