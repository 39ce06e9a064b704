"""Inputs that change between runs: a folder that gained inputs, an input edited after its
output was committed, failed items retried on request.

On every resume the inputs folder (when reachable) is listed and hashed again and
compared with the journal by key: new inputs become new pending items; an input whose
bytes differ from the listed ones has its old output deleted and is redone. ``batch
verify`` runs the same comparison to report both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torchverity.batch._bag import write_text
from torchverity.batch._inputs import InputRecord, list_inputs, manifest_lines, manifest_root
from torchverity.batch._journal import FAILED, ItemRow, Journal
from torchverity.errors import InputError

ChangeKind = Literal["new-input", "input-edited"]


@dataclass(frozen=True)
class InputChange:
    kind: ChangeKind
    key: str
    record: InputRecord
    row: ItemRow | None  # None for a new input


def input_changes(inputs: Path, out: Path, rows: list[ItemRow]) -> list[InputChange] | None:
    """How the inputs now differ from the journal's rows; None when they cannot be listed."""
    if not inputs.exists():
        return None
    try:
        records = list_inputs(inputs, exclude=out)
    except InputError:
        return None
    by_key = {r.key: r for r in rows}
    changes = []
    for record in records:
        row = by_key.get(record.key)
        if row is None:
            changes.append(InputChange("new-input", record.key, record, None))
        elif row.digest != record.digest:
            changes.append(InputChange("input-edited", record.key, record, row))
    return changes


def apply_input_changes(journal: Journal, out: Path, inputs: Path, suffix: str,
                        data_dir: str, manifest_name: str) -> list[InputChange]:
    """Queue new inputs and redo edited ones; returns what changed (nothing when unreachable)."""
    changes = input_changes(inputs, out, journal.items()) or []
    if not changes:
        return []
    added = [c.record for c in changes if c.kind == "new-input"]
    outputs = [f"{data_dir}/{r.key}{suffix}" for r in added]
    for output in outputs:
        (out / output).parent.mkdir(parents=True, exist_ok=True)
    edited = [c for c in changes if c.kind == "input-edited" and c.row is not None]
    for change in edited:
        assert change.row is not None
        (out / change.row.output).unlink(missing_ok=True)
    journal.add_items(added, outputs)
    journal.relist([(c.row.id, c.record) for c in edited if c.row is not None],
                   "input edited after it was listed: redone")
    records = sorted((r for r in _current(journal)), key=lambda r: r.key)
    write_text(out, manifest_name, "".join(manifest_lines(records)))
    journal.set_job({"inputs_root": manifest_root(records)})
    return changes


def retry_failed(journal: Journal) -> int:
    """Failed items back to pending (their next run gets the full retry budget)."""
    failed = [r.id for r in journal.items(FAILED)]
    if failed:
        journal.reset(failed, "retried on request (--retry-failed)")
    return len(failed)


def _current(journal: Journal) -> list[InputRecord]:
    return [InputRecord(r.key, r.path, r.size, r.mtime_ns, r.digest) for r in journal.items()]


def inputs_of(job: dict[str, str]) -> Path | None:
    """The inputs folder or list file the job recorded, if it says."""
    import json

    try:
        doc = json.loads(job.get("job", "{}"))
    except ValueError:
        return None
    where = doc.get("inputs") if isinstance(doc, dict) else None
    return Path(where) if isinstance(where, str) and where else None


__all__ = ["InputChange", "apply_input_changes", "input_changes", "inputs_of", "retry_failed"]
