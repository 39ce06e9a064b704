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
(threads) and ``"ray"`` (actors, extra ``ray``). How a job runs (workers,
retries, engine, durability, ...) is a :class:`BatchOptions`, given as
``options=`` or as keyword arguments. See docs/batch.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torchverity.batch._item import BatchItem, ItemFn
from torchverity.batch._model import GivenFn, ModelSpec
from torchverity.batch._options import BatchFields, BatchOptions, PathLike
from torchverity.batch._run import BatchReport, ItemProblem, execute
from torchverity.batch._verify import BatchProblem, BatchVerifyResult, verify_batch

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "BatchFields",
    "BatchItem",
    "BatchOptions",
    "BatchProblem",
    "BatchReport",
    "BatchVerifyResult",
    "ItemProblem",
    "run_batch",
    "run_model_batch",
    "verify_batch",
]

Progress = Callable[[int, int], None]


def run_batch(
    inputs: PathLike,
    fn: ItemFn,
    out: PathLike,
    options: BatchOptions | None = None,
    *,
    name: str | None = None,
    model_fingerprint: str | None = None,
    progress: Progress | None = None,
    **fields: Unpack[BatchFields],
) -> BatchReport:
    """Run (or resume) ``fn`` over every file of ``inputs`` (a folder or a list file).

    ``options`` (a :class:`BatchOptions`; its fields may also be given as
    keyword arguments, which replace its values) says how the job runs.
    ``name`` (default ``module:qualname`` of ``fn``), ``model_fingerprint``
    and ``options.settings`` identify the job: resuming with other values is
    refused unless ``force=True``, which deletes the previous outputs and
    starts over. ``progress(done, total)`` is called as items reach a final
    state. ``golden`` (a file from ``torchverity.golden.record``) gates the
    job: the model behind ``fn`` (``fn.model``) must pass ``golden.check``
    before the first item and again after the run, or this run's outputs are
    discarded. ``durability="group"`` (default) makes outputs durable with one
    ``syncfs`` of the output filesystem per commit point (Linux; elsewhere it
    is ``"file"``); ``"file"`` fsyncs every output before its rename; both
    keep committed outputs through a power cut. ``"lazy"`` flushes nothing but
    the journal and relies on the re-hash of committed outputs that every
    rerun does (see docs/batch.md). With ``engine="ray"`` the function must be
    picklable.
    """
    opts = (options or BatchOptions()).replaced(fields)
    label = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    factory = GivenFn(fn, label, model_fingerprint, opts.golden_file)
    return execute(Path(inputs), Path(out), opts, factory, progress)


def run_model_batch(
    inputs: PathLike,
    model: str,
    out: PathLike,
    options: BatchOptions | None = None,
    *,
    weights: PathLike | None = None,
    strip_prefix: Sequence[str] = (),
    key_map: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    **fields: Unpack[BatchFields],
) -> BatchReport:
    """``torchverity batch run``: ``model`` is ``module:build``, ``build(state) -> fn``.

    ``options`` and keyword arguments as for :func:`run_batch`. The weights
    are loaded with ``torchverity.load(weights, sidecar="require")`` before
    the first item; their SHA-256 and content fingerprint enter the job
    fingerprint. Without ``weights``, ``build()`` is called with no argument.
    With ``golden``, the returned function's ``model`` attribute is checked
    against the golden file before the first item and after the run.
    ``strip_prefix`` and ``key_map`` rename the state's keys before ``build``
    sees them, as :func:`torchverity.load` does.
    """
    opts = (options or BatchOptions()).replaced(fields)
    factory = ModelSpec(model, os.fspath(weights) if weights is not None else None,
                        opts.golden_file, tuple(strip_prefix), tuple((key_map or {}).items()))
    return execute(Path(inputs), Path(out), opts, factory, progress)
