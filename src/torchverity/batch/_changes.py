"""Inputs that change between runs: a folder that gained inputs, an input edited after its
output was committed, an input deleted, failed items retried on request.

On every resume the inputs folder (when reachable) is listed and hashed again and
compared with the journal by key: new inputs become new pending items; an input whose
bytes differ from the listed ones has its old output deleted and is redone; an input
that is gone is not run, and its output (stale: nothing can redo it) is kept and
reported until the user restores the input or asks for it to be pruned. ``batch
verify`` runs the same comparison to report all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torchverity.batch._bag import write_text
from torchverity.batch._inputs import InputRecord, list_inputs, manifest_lines, manifest_root
from torchverity.batch._journal import COMMITTED, FAILED, ItemRow, Journal
from torchverity.errors import InputError

ChangeKind = Literal["new-input", "input-edited", "input-removed"]
# The flags of the step after a run or verify: what each asks a rerun to do, and its name in
# the Python API (a job started there has no command to print).
RETRY_FAILED = ("--retry-failed", "retry_failed=True")
PRUNE_REMOVED = ("--prune-removed", "prune_removed=True")


@dataclass(frozen=True)
class InputChange:
    """An input that differs from the journal's record of it: new, edited or removed."""

    kind: ChangeKind
    key: str
    record: InputRecord | None  # None for a removed input
    row: ItemRow | None  # None for a new input


@dataclass(frozen=True)
class AppliedChanges:
    """What a resume found in the inputs and did about it."""

    new: int
    edited: int
    removed: tuple[ItemRow, ...]  # inputs gone, left in the job (not run, output kept)
    pruned: tuple[str, ...]  # keys of inputs gone, deleted from the job with their output


def input_changes(inputs: Path, out: Path, rows: list[ItemRow]) -> list[InputChange] | None:
    """How the inputs now differ from the journal's rows; None when they cannot be listed.

    An inputs folder that is missing or lists no file at all counts as unreachable (an
    unmounted share looks like that), never as every input removed.
    """
    if not inputs.exists():
        return None
    try:
        records = list_inputs(inputs, exclude=out, skip_missing=True)
    except InputError:
        return None
    by_key = {r.key: r for r in rows}
    changes = []
    for record in records:
        row = by_key.pop(record.key, None)
        if row is None:
            changes.append(InputChange("new-input", record.key, record, None))
        elif row.digest != record.digest:
            changes.append(InputChange("input-edited", record.key, record, row))
    changes += [InputChange("input-removed", row.key, None, row) for row in by_key.values()]
    return changes


def removed_detail(row: ItemRow, inputs: Path | str) -> str:
    """Why a removed input is a problem: what is left of it in the job."""
    if row.state == COMMITTED:
        left = f"its output {row.output} is stale (there is no input to redo it from)"
    else:
        left = f"it was {row.state} and has no output"
    return f"the input is gone from {inputs}: {left}"


def apply_input_changes(journal: Journal, out: Path, inputs: Path, suffix: str,
                        data_dir: str, manifest_name: str, prune: bool) -> AppliedChanges:
    """Queue new inputs, redo edited ones, prune removed ones when asked; nothing when the
    inputs cannot be listed."""
    changes = input_changes(inputs, out, journal.items())
    if changes is None and prune:
        raise InputError(
            f"{inputs}: cannot list the inputs (missing, empty or unreadable), so no input "
            "can be told removed; nothing was pruned",
            path=inputs,
            hint="mount or restore the inputs folder, then rerun with --prune-removed",
        )
    changes = changes or []
    added = [c.record for c in changes if c.kind == "new-input" and c.record is not None]
    outputs = [f"{data_dir}/{r.key}{suffix}" for r in added]
    for output in outputs:
        (out / output).parent.mkdir(parents=True, exist_ok=True)
    edited = [(c.row, c.record) for c in changes
              if c.kind == "input-edited" and c.row is not None and c.record is not None]
    for row, _ in edited:
        (out / row.output).unlink(missing_ok=True)
    removed = tuple(c.row for c in changes if c.kind == "input-removed" and c.row is not None)
    pruned = removed if prune else ()
    for row in pruned:
        (out / row.output).unlink(missing_ok=True)
    journal.add_items(added, outputs)
    journal.relist([(row.id, record) for row, record in edited],
                   "input edited after it was listed: redone")
    journal.drop(pruned, f"input gone from {inputs}: item and output deleted (--prune-removed)")
    if added or edited or pruned:
        records = sorted((r for r in _current(journal)), key=lambda r: r.key)
        write_text(out, manifest_name, "".join(manifest_lines(records)))
        journal.set_job({"inputs_root": manifest_root(records)})
    return AppliedChanges(len(added), len(edited), () if prune else removed,
                          tuple(r.key for r in pruned))


def next_step(command: str | None, *, rerun: bool, failed: bool, removed: bool) -> str | None:
    """What to do about a job that is not done, ending with the rerun that does it.

    ``command`` is the job's ``torchverity batch run`` command (None for a job run from
    Python, whose call the step names instead).
    """
    if not (rerun or failed or removed):
        return None
    flags = [flag for flag, wanted in ((RETRY_FAILED, failed), (PRUNE_REMOVED, removed))
             if wanted]
    if command is None:
        how = ", ".join(api for _, api in flags)
        call = "the same run_batch/run_model_batch call" + (f" with {how}" if how else "")
    else:
        call = " ".join([command, *(cli for cli, _ in flags)])
    if failed and removed:
        lead = ("fix the failed inputs or the model, and restore the removed inputs or drop "
                "them with their stale outputs; then rerun")
    elif failed:
        lead = "fix the failed inputs or the model, then rerun"
    elif removed:
        lead = "restore the removed inputs, or drop them with their stale outputs"
    else:
        lead = "rerun"
    return f"{lead}: {call}"


def retry_failed(journal: Journal, skip: set[int]) -> int:
    """Failed items back to pending (their next run gets the full retry budget); not those in
    ``skip`` (their input is gone: nothing could succeed)."""
    failed = [r.id for r in journal.items(FAILED) if r.id not in skip]
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


__all__ = [
    "AppliedChanges", "InputChange", "apply_input_changes", "input_changes", "inputs_of",
    "next_step", "removed_detail", "retry_failed",
]
