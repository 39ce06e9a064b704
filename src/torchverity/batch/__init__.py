"""Batch jobs where every input ends with exactly one verified output or a recorded reason.

A job maps each input file to one output file in ``OUT/data/``. At the start
it lists every input (key, path, size, mtime, SHA-256) in a SQLite journal in
``OUT``; workers re-verify each input as they read it; outputs are written
through temp file, fsync and rename and only then recorded as committed. Kill
the process at any moment and run the same call again: it resumes, removes
orphans, re-verifies what was committed, and finishes with no lost and no
duplicated outputs. ``verify_batch(OUT)`` reconciles by identity and writes a
BagIt ``manifest-sha256.txt``.

>>> from torchverity.batch import run_batch, verify_batch
>>> report = run_batch("inputs/", lambda item: item.data.upper(), "out/")  # doctest: +SKIP
>>> report.committed == report.total, verify_batch("out/").ok            # doctest: +SKIP
(True, True)

The per-item function receives a :class:`BatchItem` (``key``, ``path``,
``data``: the verified bytes, ``digest``, ``index``) and returns the output as
bytes-like, ``str`` (stored UTF-8) or tensors/state (stored with
``torch.save``). An exception fails the attempt; it is retried with backoff
up to ``retries`` times, then recorded with its error. Engines: ``"local"``
(threads) and ``"ray"`` (actors, extra ``ray``). See docs/batch.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from torchverity.batch._item import BatchItem, DurabilityMode, EngineName, ItemFn
from torchverity.batch._model import GivenFn, ModelSpec
from torchverity.batch._run import (
    BatchReport,
    ItemProblem,
    JobConfig,
    execute,
)
from torchverity.batch._verify import BatchProblem, BatchVerifyResult, verify_batch

__all__ = [
    "BatchItem",
    "BatchProblem",
    "BatchReport",
    "BatchVerifyResult",
    "ItemProblem",
    "run_batch",
    "run_model_batch",
    "verify_batch",
]

Progress = Callable[[int, int], None]
PathLike = str | os.PathLike[str]


def run_batch(
    inputs: PathLike,
    fn: ItemFn,
    out: PathLike,
    *,
    workers: int = 1,
    retries: int = 2,
    backoff: float = 0.1,
    engine: EngineName = "local",
    ray_address: str | None = None,
    force: bool = False,
    suffix: str = ".out",
    durability: DurabilityMode = "group",
    name: str | None = None,
    model_fingerprint: str | None = None,
    golden: PathLike | None = None,
    settings: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    retry_failed: bool = False,
) -> BatchReport:
    """Run (or resume) ``fn`` over every file of ``inputs`` (a folder or a list file).

    ``name`` (default ``module:qualname`` of ``fn``), ``model_fingerprint``
    and ``settings`` identify the job: resuming with other values is refused
    unless ``force=True``, which deletes the previous outputs and starts over.
    ``progress(done, total)`` is called as items reach a final state.
    ``golden`` (a file from ``torchverity.golden.record``) gates the job: the
    model behind ``fn`` (``fn.model``) must pass ``golden.check`` before the
    first item and again after the run, or this run's outputs are discarded.
    ``durability="group"`` (default) makes outputs durable with one ``syncfs``
    of the output filesystem per commit point (Linux; elsewhere it is
    ``"file"``); ``"file"`` fsyncs every output before its rename; both keep
    committed outputs through a power cut. ``"lazy"`` flushes nothing but the
    journal and relies on the re-hash of committed outputs that every rerun
    does (see docs/batch.md). With
    ``engine="ray"`` the function must be picklable.
    """
    label = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    gate = os.fspath(golden) if golden is not None else None
    factory = GivenFn(fn, label, model_fingerprint, gate)
    return execute(_config(inputs, out, workers, retries, backoff, engine, ray_address, force,
                           suffix, durability, gate, settings, retry_failed), factory,
                           progress)


def run_model_batch(
    inputs: PathLike,
    model: str,
    out: PathLike,
    *,
    weights: PathLike | None = None,
    workers: int = 1,
    retries: int = 2,
    backoff: float = 0.1,
    engine: EngineName = "local",
    ray_address: str | None = None,
    force: bool = False,
    suffix: str = ".out",
    durability: DurabilityMode = "group",
    golden: PathLike | None = None,
    settings: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    retry_failed: bool = False,
    strip_prefix: Sequence[str] = (),
    key_map: Mapping[str, str] | None = None,
) -> BatchReport:
    """``torchverity batch run``: ``model`` is ``module:build``, ``build(state) -> fn``.

    The weights are loaded with ``torchverity.load(weights, sidecar="require")``
    before the first item; their SHA-256 and content fingerprint enter the job
    fingerprint. Without ``weights``, ``build()`` is called with no argument.
    With ``golden``, the returned function's ``model`` attribute is checked
    against the golden file before the first item and after the run.
    ``strip_prefix`` and ``key_map`` rename the state's keys before ``build``
    sees them, as :func:`torchverity.load` does.
    """
    gate = os.fspath(golden) if golden is not None else None
    factory = ModelSpec(model, os.fspath(weights) if weights is not None else None, gate,
                        tuple(strip_prefix), tuple((key_map or {}).items()))
    return execute(_config(inputs, out, workers, retries, backoff, engine, ray_address, force,
                           suffix, durability, gate, settings, retry_failed), factory,
                           progress)


def _config(inputs: PathLike, out: PathLike, workers: int, retries: int, backoff: float,
            engine: EngineName, ray_address: str | None, force: bool, suffix: str,
            durability: DurabilityMode,
            golden: str | None, settings: Mapping[str, str] | None,
            retry_failed: bool = False) -> JobConfig:
    return JobConfig(
        inputs=Path(inputs), out=Path(out), suffix=suffix, workers=workers, retries=retries,
        backoff=backoff, engine=engine, ray_address=ray_address, force=force,
        durability=durability, golden=golden,
        settings=tuple(sorted((str(k), str(v)) for k, v in (settings or {}).items())),
        retry_failed=retry_failed,
    )
