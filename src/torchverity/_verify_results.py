"""What verification reports: each path ok, mismatched, missing or extra, and where in a
damaged checkpoint the damage is (see :mod:`torchverity.verify`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "mismatched", "missing", "extra"]
STATUSES: tuple[Status, ...] = ("ok", "mismatched", "missing", "extra")


@dataclass(frozen=True)
class VerifyEntry:
    """One file's verdict: its status, the digests and sizes compared, the damaged tensors."""

    path: str
    status: Status
    expected: str | None = None
    actual: str | None = None
    expected_size: int | None = None
    actual_size: int | None = None
    tensors: tuple[str, ...] = ()


class EntryTally:
    """What every per-file result derives from its entries: counts, problems, JSON rows."""

    entries: tuple[VerifyEntry, ...]

    @property
    def counts(self) -> dict[str, int]:
        counted = Counter(e.status for e in self.entries)
        return {s: counted.get(s, 0) for s in STATUSES}

    @property
    def problems(self) -> tuple[VerifyEntry, ...]:
        return tuple(e for e in self.entries if e.status != "ok")

    def entries_json(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in vars(e).items() if v not in (None, ())} for e in self.entries]


@dataclass(frozen=True)
class VerifyResult(EntryTally):
    """The outcome for one target: a file (against its sidecar) or a folder (manifest)."""

    target: str
    kind: Literal["file", "directory"]
    algo: str
    entries: tuple[VerifyEntry, ...]
    record: str
    certification: dict[str, Any] | None = None  # a training guard's, from meta.json
    # torchverity's sidecars and meta.json of listed files that the manifest does not list
    # (written after it): not foreign files, so they fail nothing.
    unlisted_records: tuple[str, ...] = ()
    # Files no record covers (a folder checked by its sidecars): not checked, so they fail
    # nothing, but the reader must not take the verdict to cover them.
    unrecorded: tuple[str, ...] = ()
    # Files no record covers that are a Git LFS pointer or an HTML page: broken downloads
    # fail with no record to compare them with.
    broken: tuple[str, ...] = ()
    # Recorded files that --exclude skipped: not checked, named so that the verdict is not
    # taken to cover them.
    skipped: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(e.status == "ok" for e in self.entries) and not self.broken

    @property
    def certified(self) -> bool | None:
        """Whether a training guard certified the weights when saved (None: no record)."""
        return None if self.certification is None else bool(self.certification["certified"])

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "kind": self.kind,
            "algorithm": self.algo,
            "record": self.record,
            "ok": self.ok,
            "counts": self.counts,
            # Only for files a training guard recorded: other records keep their shape.
            **({"certified": self.certified, "certification": self.certification}
               if self.certification is not None else {}),
            "entries": self.entries_json(),
            **({"unlisted_records": list(self.unlisted_records)}
               if self.unlisted_records else {}),
            **({"unrecorded": list(self.unrecorded)} if self.unrecorded else {}),
            **({"broken_downloads": list(self.broken)} if self.broken else {}),
            **({"skipped": list(self.skipped)} if self.skipped else {}),
        }


def _damaged_tensors(path: Path) -> tuple[str, ...]:
    """For a checkpoint saved with its meta.json, the tensors the damage hit."""
    from torchverity.checkpoint._meta import meta_path_for

    if not meta_path_for(path).is_file():
        return ()  # no record of its tensors: torch is not needed (nor imported)
    from torchverity.checkpoint._damage import locate_damage

    return tuple(locate_damage(path))
