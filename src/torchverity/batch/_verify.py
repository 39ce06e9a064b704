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
from torchverity.batch._changes import input_changes, inputs_of
from torchverity.batch._journal import CHANGED, COMMITTED, ItemRow, Journal
from torchverity.batch._paths import DATA_DIR
from torchverity.batch._run import stored_digests
from torchverity.errors import TorchVerityError
from torchverity.manifest import SHA256SUM_NAME, ManifestEntry, read_manifest

# Problem kinds, in the order a reader should fix them.
KINDS = (
    "missing-output", "output-mismatch", "extra-output", "manifest-mismatch", "bag-mismatch",
    "failed", "input-changed", "new-input", "not-done",
)


@dataclass(frozen=True)
class BatchProblem:
    """One reason the job's outputs are not exactly one verified output per input."""

    kind: str
    key: str | None
    path: str | None
    detail: str


@dataclass(frozen=True)
class BatchVerifyResult:
    """The reconciliation of one output folder."""

    out: str
    items: int
    committed: int
    problems: tuple[BatchProblem, ...]
    manifest: str | None
    manifest_written: bool

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_batch(out: str | os.PathLike[str]) -> BatchVerifyResult:
    """Check every output against the journal and the bag manifest; write the manifest if absent."""
    root = Path(out).resolve()
    journal = Journal.open(root, read_only=True)
    try:
        rows = journal.items()
        inputs = inputs_of(journal.job())
    finally:
        journal.close()
    committed = [r for r in rows if r.state == COMMITTED]
    problems = [*_check_items(root, rows, committed), *_extra_files(root, rows),
                *_input_problems(inputs, root, rows)]
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
    return BatchVerifyResult(
        out=os.fspath(root), items=len(rows), committed=len(committed),
        problems=tuple(problems), manifest=os.fspath(manifest_path) if manifest_path.is_file()
        else None, manifest_written=written,
    )


def _check_items(root: Path, rows: list[ItemRow], committed: list[ItemRow]) -> list[BatchProblem]:
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
            detail = f"after {row.attempts} attempts: {detail}"
        problems.append(BatchProblem(kind, row.key, None, detail))
    return problems


def _input_problems(inputs: Path | None, root: Path, rows: list[ItemRow]) -> list[BatchProblem]:
    """Inputs re-hashed when their folder is reachable: new ones, and ones edited since."""
    changes = input_changes(inputs, root, rows) if inputs is not None else None
    problems = []
    for change in changes or []:
        if change.kind == "new-input":
            problems.append(BatchProblem("new-input", change.key, change.record.path,
                                         "an input the job has not processed yet; "
                                         "rerun torchverity batch run to process it"))
        elif change.row is not None and change.row.state != CHANGED:  # else reported above
            when = ("after its output was committed" if change.row.state == COMMITTED
                    else "since it was listed")
            problems.append(BatchProblem(
                "input-changed", change.key, change.record.path,
                f"edited {when}: sha256 now {change.record.digest}, listed "
                f"{change.row.digest}; rerun torchverity batch run to redo it"))
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
