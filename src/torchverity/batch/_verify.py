"""``batch verify``: reconcile a job's outputs with its inputs by identity, never by counts.

Every input id in the journal must have exactly one output at its
deterministic name whose SHA-256 equals the journal's; no other file may sit
in ``data/``; and ``manifest-sha256.txt`` must list exactly the committed
outputs with the same digests. A matching count proves nothing: one public
incident had as many duplicates as losses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torchverity.batch._bag import bag_problems, write_bag
from torchverity.batch._changes import (
    InputChange,
    input_changes,
    inputs_of,
    next_step,
    removed_detail,
)
from torchverity.batch._journal import CHANGED, COMMITTED, ItemRow, Journal
from torchverity.batch._paths import DATA_DIR
from torchverity.batch._run import stored_digests
from torchverity.errors import BatchError, TorchVerityError
from torchverity.manifest import SHA256SUM_NAME, ManifestEntry, read_manifest

# Problem kinds, in the order a reader should fix them.
KINDS = (
    "missing-output", "output-mismatch", "extra-output", "manifest-mismatch", "bag-mismatch",
    "failed", "input-changed", "input-removed", "new-input", "not-done",
)
# Problems that leave a committed item without a usable output.
_NOT_INTACT = {"missing-output", "output-mismatch", "input-changed"}
# What a rerun of the job (with no flag) puts right; "failed" and "input-removed" need one.
_RERUN_FIXES = {"missing-output", "output-mismatch", "manifest-mismatch", "bag-mismatch",
                "input-changed", "new-input", "not-done"}


@dataclass(frozen=True)
class BatchProblem:
    """One reason the job's outputs are not exactly one verified output per input."""

    kind: str
    key: str | None
    path: str | None
    detail: str


@dataclass(frozen=True)
class BatchVerifyResult:
    """The reconciliation of one output folder.

    ``items`` and ``committed`` count the inputs that exist (when the inputs can be
    listed; else the journal's items): a new input counts, a removed one does not.
    """

    out: str
    items: int
    committed: int
    problems: tuple[BatchProblem, ...]
    manifest: str | None
    manifest_written: bool
    next_step: str | None

    @property
    def ok(self) -> bool:
        return not self.problems


def _existing_folder(out: str | os.PathLike[str]) -> Path:
    root = Path(out).resolve()
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise BatchError(f"{out}: {what}; batch verify reads the --out folder of a batch job",
                         out=root, hint="check the path: it is the folder given as --out to "
                                        "'torchverity batch run', which holds batch-journal.sqlite")
    return root


def verify_batch(out: str | os.PathLike[str]) -> BatchVerifyResult:
    """Check every output against the journal and the bag manifest; write the manifest if absent."""
    root = _existing_folder(out)
    journal = Journal.open(root, read_only=True)
    try:
        rows = journal.items()
        job = journal.job()
        tries = journal.run_attempts()
    finally:
        journal.close()
    inputs = inputs_of(job)
    changes = input_changes(inputs, root, rows) if inputs is not None else None
    gone = {c.key for c in changes or [] if c.kind == "input-removed"}
    committed = [r for r in rows if r.state == COMMITTED]
    problems = [*_check_items(root, [r for r in rows if r.key not in gone], committed, tries),
                *_extra_files(root, rows), *_input_problems(changes or [], inputs)]
    manifest_path = root / SHA256SUM_NAME
    entries = [ManifestEntry(r.output, int(r.output_size or 0), str(r.output_digest))
               for r in committed]
    written = False
    if manifest_path.exists():
        problems += _check_manifest(manifest_path, committed)
        problems += [BatchProblem("bag-mismatch", None, name, detail)
                     for name, detail in bag_problems(root, entries)]
    elif not problems and committed and os.access(root, os.W_OK):
        write_bag(root, entries)
        written = True
    problems.sort(key=lambda p: (KINDS.index(p.kind), p.key or "", p.path or ""))
    kinds = {p.kind for p in problems}
    new = sum(c.kind == "new-input" for c in changes or [])
    # A committed output counts only while it is intact and its input is the one it was
    # made from: the summary must not call a deleted or stale output committed.
    spoiled = {p.key for p in problems if p.kind in _NOT_INTACT}
    return BatchVerifyResult(
        out=os.fspath(root), items=len(rows) - len(gone) + new,
        committed=sum(r.key not in gone and r.key not in spoiled for r in committed),
        problems=tuple(problems), manifest=os.fspath(manifest_path) if manifest_path.is_file()
        else None, manifest_written=written,
        next_step=_next_step(job.get("command"), kinds),
    )


def _next_step(command: str | None, kinds: set[str]) -> str | None:
    step = next_step(command, rerun=bool(kinds & _RERUN_FIXES), failed="failed" in kinds,
                     removed="input-removed" in kinds)
    if "extra-output" not in kinds:
        return step
    # A run never deletes a file it did not write: only the user can.
    extra = (f"move the extra files out of {DATA_DIR}/ (a copy or a stray file: no input "
             "committed them)")
    return f"{extra}; {step}" if step else extra


def _attempts_text(row: ItemRow, tries: dict[int, int]) -> str:
    """How often a failed item was tried: its latest run's share (what ``--retries``
    bounds) and, when earlier runs tried it too, the total."""
    latest = tries.get(row.id, row.attempts)
    plural = "" if latest == 1 else "s"
    if latest == row.attempts:
        return f"after {latest} attempt{plural}"
    return f"after {latest} attempt{plural} in its latest run ({row.attempts} in all)"


def _check_items(root: Path, rows: list[ItemRow], committed: list[ItemRow],
                 tries: dict[int, int]) -> list[BatchProblem]:
    """Each committed output against its digest; ``rows`` (those of inputs that exist) that
    have not ended with an output."""
    problems: list[BatchProblem] = []
    for row, found in zip(committed, stored_digests(root, committed), strict=True):
        if found is None:
            problems.append(BatchProblem("missing-output", row.key, row.output,
                                         "committed in the journal but the file is gone"))
        elif found[0] != row.output_digest:
            problems.append(BatchProblem(
                "output-mismatch", row.key, row.output,
                f"sha256 is {found[0]}, the journal recorded {row.output_digest}",
            ))
    for row in rows:
        if row.state == COMMITTED:
            continue
        kind = {"failed": "failed", "input-changed": "input-changed"}.get(row.state, "not-done")
        detail = row.error or f"state is {row.state}: the job has not finished"
        if kind == "failed":
            detail = f"{_attempts_text(row, tries)}: {detail}"
        problems.append(BatchProblem(kind, row.key, None, detail))
    return problems


def _input_problems(changes: list[InputChange], inputs: Path | None) -> list[BatchProblem]:
    """Inputs re-hashed when their folder is reachable: new ones, ones edited since, and
    ones gone."""
    problems = []
    for change in changes:
        row, record = change.row, change.record
        if change.kind == "new-input" and record is not None:
            problems.append(BatchProblem("new-input", change.key, record.path,
                                         "an input the job has not processed yet; "
                                         "rerun torchverity batch run to process it"))
        elif change.kind == "input-removed" and row is not None and inputs is not None:
            problems.append(BatchProblem("input-removed", change.key, row.path,
                                         removed_detail(row, inputs)))
        elif row is not None and record is not None and row.state != CHANGED:  # else above
            when = ("after its output was committed" if row.state == COMMITTED
                    else "since it was listed")
            problems.append(BatchProblem(
                "input-changed", change.key, record.path,
                f"edited {when}: sha256 now {record.digest}, listed "
                f"{row.digest}; rerun torchverity batch run to redo it"))
    return problems


def _extra_files(root: Path, rows: list[ItemRow]) -> list[BatchProblem]:
    """Files in data/ that are not the committed output of some input (duplicates, orphans)."""
    expected = {r.output for r in rows if r.state == COMMITTED}
    problems = []
    for folder, _, files in os.walk(root / DATA_DIR):
        for name in files:
            rel = (Path(folder) / name).relative_to(root).as_posix()
            if rel not in expected:
                problems.append(BatchProblem(
                    "extra-output", None, rel, "not the committed output of any input",
                ))
    return problems


def _check_manifest(path: Path, committed: list[ItemRow]) -> list[BatchProblem]:
    if not path.is_file():
        return [BatchProblem("manifest-mismatch", None, SHA256SUM_NAME,
                             "is not a file: move it away and rerun verify to write the "
                             "manifest")]
    try:
        listed = {e.path: e.digest for e in read_manifest(path).entries}
    except TorchVerityError as exc:
        return [BatchProblem("manifest-mismatch", None, SHA256SUM_NAME, exc.message)]
    problems = []
    for row in committed:
        digest = listed.pop(row.output, None)
        if digest != row.output_digest:
            what = "is not listed" if digest is None else f"is listed with sha256 {digest}"
            problems.append(BatchProblem("manifest-mismatch", row.key, row.output,
                                         f"{what}; the journal recorded {row.output_digest}"))
    for extra in sorted(listed):
        problems.append(BatchProblem("manifest-mismatch", None, extra,
                                     f"listed in {SHA256SUM_NAME} but no input committed it"))
    return problems
