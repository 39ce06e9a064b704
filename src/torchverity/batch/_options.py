"""How a batch job runs: the options every entry point shares (Python API and CLI).

:class:`BatchOptions` is the one place these options are named, defaulted and
checked; ``run_batch`` and ``run_model_batch`` take one (``options=``) and also
accept its fields as keyword arguments (:class:`BatchFields`), which replace the
object's values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict, get_args

from torchverity.batch._item import DURABILITY, TMP_SUFFIX, DurabilityMode, EngineName
from torchverity.errors import UsageError

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class BatchOptions:
    """How a job runs; ``suffix`` and ``settings`` also enter the job fingerprint.

    ``workers``: items processed at once (threads, or Ray actors).
    ``retries``: retries per failing item in this run, after ``backoff`` seconds,
    doubling (at most 10 s). ``engine``: ``"local"`` or ``"ray"`` (joining
    ``ray_address`` when given). ``force``: delete the folder's previous job and
    start over. ``suffix``: output name is ``data/<key><suffix>``.
    ``durability``: ``"group"``, ``"file"`` or ``"lazy"`` (docs/batch.md).
    ``golden``: a golden file the model must pass before the first item and
    after the run. ``settings``: strings that identify the job beside its model.
    ``retry_failed``: on resume, failed items get a new round of attempts.
    ``prune_removed``: on resume, items whose input is gone from the inputs folder
    are deleted from the job with their outputs (otherwise they are kept and
    reported as ``input-removed``).
    Bad values raise :class:`~torchverity.errors.UsageError` here, before any work.
    """

    workers: int = 1
    retries: int = 2
    backoff: float = 0.1
    engine: EngineName = "local"
    ray_address: str | None = None
    force: bool = False
    suffix: str = ".out"
    durability: DurabilityMode = "group"
    golden: PathLike | None = None
    settings: Mapping[str, str] = field(default_factory=dict)
    retry_failed: bool = False
    prune_removed: bool = False

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise UsageError(f"workers (--workers) must be at least 1, not {self.workers}")
        if self.retries < 0:
            raise UsageError(f"retries (--retries) must be 0 or more, not {self.retries}")
        if self.durability not in DURABILITY:
            raise UsageError(f"unknown durability '{self.durability}'",
                             hint=f"use one of: {', '.join(DURABILITY)}")
        if self.engine not in get_args(EngineName):
            raise UsageError(f"unknown engine '{self.engine}'",
                             hint=f"use one of: {', '.join(get_args(EngineName))}")
        if not self.suffix or "/" in self.suffix or self.suffix.endswith(TMP_SUFFIX):
            raise UsageError(
                f"output suffix '{self.suffix}' cannot work",
                hint=f"use a non-empty suffix without '/' that does not end in {TMP_SUFFIX}",
            )

    @property
    def golden_file(self) -> str | None:
        return os.fspath(self.golden) if self.golden is not None else None

    @property
    def setting_pairs(self) -> tuple[tuple[str, str], ...]:
        """The settings as the job fingerprint records them: sorted string pairs."""
        return tuple(sorted((str(k), str(v)) for k, v in self.settings.items()))

    def replaced(self, fields: BatchFields) -> BatchOptions:
        """These options with ``fields`` (keyword arguments of an entry point) put in."""
        return dataclasses.replace(self, **fields) if fields else self


class BatchFields(TypedDict, total=False):
    """:class:`BatchOptions`' fields as keyword arguments of ``run_batch``/``run_model_batch``."""

    workers: int
    retries: int
    backoff: float
    engine: EngineName
    ray_address: str | None
    force: bool
    suffix: str
    durability: DurabilityMode
    golden: PathLike | None
    settings: Mapping[str, str]
    retry_failed: bool
    prune_removed: bool
