"""The batch journal: one SQLite file in the output folder, the job's single source of truth.

Write-ahead logging keeps the file consistent whatever moment the process is
killed at. Every transaction is a commit point run with ``synchronous=FULL``,
so it is on disk before anything that depends on it; items in flight are
marked ``running`` inside the commit points, which costs no extra flush. Only
the driver process opens it for writing. The schema is documented in
docs/formats/batch.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchverity.batch._inputs import JOURNAL_NAME, InputRecord
from torchverity.batch._journal_check import check_records, damaged
from torchverity.batch._paths import DATA_DIR, check_outputs
from torchverity.digest import fsync_path
from torchverity.errors import BatchError, FormatError

SCHEMA_VERSION = 1
PENDING, RUNNING, COMMITTED, FAILED, CHANGED = (
    "pending", "running", "committed", "failed", "input-changed"
)
STATES = (PENDING, RUNNING, COMMITTED, FAILED, CHANGED)
# An event with no item: a run started. Attempts "in a run" are counted between these.
RUN_EVENT = "run"

_SCHEMA = f"""
CREATE TABLE job (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE items (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    path TEXT NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    digest TEXT NOT NULL,
    output TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL CHECK (state IN ({", ".join(repr(s) for s in STATES)})),
    attempts INTEGER NOT NULL DEFAULT 0,
    interrupted INTEGER NOT NULL DEFAULT 0,
    output_digest TEXT,
    output_size INTEGER,
    error TEXT,
    updated REAL
);
CREATE INDEX items_state ON items (state);
CREATE TABLE events (
    at REAL NOT NULL,
    item INTEGER REFERENCES items (id),
    kind TEXT NOT NULL,
    detail TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class WorkItem:
    """What a worker needs to process one item (plain values: it travels to Ray actors)."""

    id: int
    key: str
    path: str
    size: int
    digest: str
    output: str
    attempt: int


@dataclass(frozen=True)
class ItemRow:
    """One item as the journal records it."""

    id: int
    key: str
    path: str
    size: int
    mtime_ns: int
    digest: str
    output: str
    state: str
    attempts: int
    interrupted: int
    output_digest: str | None
    output_size: int | None
    error: str | None


@dataclass(frozen=True)
class Outcome:
    """A state change to record at the next commit point."""

    id: int
    state: str
    output_digest: str | None = None
    output_size: int | None = None
    error: str | None = None


class Journal:
    """The driver's handle on the journal file."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn

    # ------------------------------------------------------------ opening

    @classmethod
    def create(cls, out: Path, job: dict[str, str], records: Sequence[InputRecord],
               outputs: Sequence[str]) -> Journal:
        """A new journal holding the job description and every input as ``pending``.

        Built under a temporary name and renamed into place once complete, so a
        journal that exists is always a whole one, whenever a crash happens.
        Nothing reads the file before its rename, so it is built without
        SQLite's own flushes and without a rollback journal (the rows go
        straight into the file, not through the WAL and a checkpoint copy), and
        made durable by one fsync before the rename; it is switched to WAL last.
        """
        path = out / JOURNAL_NAME
        building = out / f".{JOURNAL_NAME}.building"
        discard_building(out)
        journal = cls(building, _connect(building, out, mode="OFF"))
        journal._conn.execute("PRAGMA synchronous = OFF")
        journal._fill(job, records, outputs)
        try:
            journal._conn.execute("PRAGMA journal_mode = WAL")
        except sqlite3.DatabaseError as exc:
            raise _write_failed(building, exc) from None
        journal.close()
        try:
            fsync_path(building)
            os.replace(building, path)
            fsync_path(out)
        except OSError as exc:
            raise BatchError(f"{path}: cannot create the batch journal: {exc.strerror or exc}",
                             out=out) from None
        return cls(path, _connect(path, out))

    def _fill(self, job: dict[str, str], records: Sequence[InputRecord],
              outputs: Sequence[str]) -> None:
        journal = self
        with journal._transaction():
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    journal._conn.execute(statement)
            rows = [("schema", str(SCHEMA_VERSION)), *job.items()]
            journal._conn.executemany("INSERT INTO job VALUES (?, ?)", rows)
            journal._conn.executemany(
                "INSERT INTO items (id, key, path, size, mtime_ns, digest, output, state)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, 'pending')",
                [
                    (i, r.key, r.path, r.size, r.mtime_ns, r.digest, o)
                    for i, (r, o) in enumerate(zip(records, outputs, strict=True), 1)
                ],
            )

    @classmethod
    def open(cls, out: Path, *, read_only: bool = False) -> Journal:
        """Open an existing journal, refusing a missing, corrupt or foreign one.

        ``read_only`` on a folder that cannot be written (an archived bag on
        read-only media) opens the file as immutable: no WAL index is needed.
        """
        path = out / JOURNAL_NAME
        if not path.is_file():
            raise BatchError(
                f"{out}: no batch journal ({JOURNAL_NAME}) in this folder",
                out=out,
                hint="name the --out folder of a 'torchverity batch run' job",
            )
        if read_only and not os.access(out, os.W_OK):
            journal = cls(path, _connect_immutable(path))
        else:
            journal = cls(path, _connect(path, out))
        try:
            journal._check()
            check_outputs(path, out, (row[0] for row in journal._query("SELECT output FROM items")))
            check_records(path, journal._query, STATES, DATA_DIR)
        except BaseException:
            journal.close()
            raise
        return journal

    def _check(self) -> None:
        try:
            status = self._conn.execute("PRAGMA quick_check").fetchone()[0]
            schema = self._conn.execute("SELECT value FROM job WHERE key = 'schema'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise _corrupt(self.path, str(exc)) from None
        if status != "ok":
            raise _corrupt(self.path, status)
        if schema is None or schema[0] != str(SCHEMA_VERSION):
            raise FormatError(
                f"{self.path}: journal schema {schema[0] if schema else '?'} is not "
                f"{SCHEMA_VERSION}",
                path=self.path,
                hint="finish or verify this job with the torchverity version that started it",
            )

    def close(self) -> None:
        self._conn.close()

    # ------------------------------------------------------------ reading

    def job(self) -> dict[str, str]:
        return dict(self._query("SELECT key, value FROM job"))

    def counts(self) -> dict[str, int]:
        found = dict(self._query("SELECT state, COUNT(*) FROM items GROUP BY state"))
        return {state: int(found.get(state, 0)) for state in STATES}

    def items(self, *states: str) -> list[ItemRow]:
        sql = f"SELECT {', '.join(ItemRow.__dataclass_fields__)} FROM items"
        params: tuple[str, ...] = ()
        if states:
            sql += f" WHERE state IN ({', '.join('?' * len(states))})"
            params = states
        return [ItemRow(*row) for row in self._query(sql + " ORDER BY id", params)]

    def pending_work(self) -> list[WorkItem]:
        """Every pending item as the engines take it (its next attempt's number)."""
        sql = ("SELECT id, key, path, size, digest, output, attempts + 1 FROM items"
               " WHERE state = 'pending' ORDER BY id")
        return [WorkItem(*row) for row in self._query(sql)]

    def run_attempts(self) -> dict[int, int]:
        """Each item's attempts that failed in the latest run that tried it, by item id.

        ``attempts`` counts every attempt since the item was listed; a failed item's latest
        run alone is what ``--retries`` bounded. Items whose failures all predate the
        first run mark (a journal from an older version) are left out."""
        rows = self._query(
            "SELECT item, kind FROM events WHERE kind IN (?, ?, ?) ORDER BY rowid",
            (RUN_EVENT, PENDING, FAILED))
        run = 0
        latest: dict[int, tuple[int, int]] = {}  # item -> (run, failures in that run)
        for item, kind in rows:
            if kind == RUN_EVENT:
                run += 1
            elif item is not None:
                seen_in, count = latest.get(item, (run, 0))
                latest[item] = (run, count + 1 if seen_in == run else 1)
        return {item: count for item, (seen_in, count) in latest.items() if seen_in > 0}

    def committed_outputs(self) -> list[tuple[str, int, str]]:
        """(output, size, digest) of every committed item: only the columns the bag needs."""
        return self._query("SELECT output, output_size, output_digest FROM items"
                           " WHERE state = 'committed' ORDER BY id")

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise _corrupt(self.path, str(exc)) from None

    # ------------------------------------------------------------ writing

    def start_run(self) -> None:
        """Mark where this run's events begin (see :meth:`run_attempts`)."""
        with self._transaction():
            self._events([(None, RUN_EVENT, "started")])

    def recover(self) -> list[ItemRow]:
        """Items a killed run left ``running`` go back to ``pending``; returns them."""
        interrupted = self.items(RUNNING)
        if interrupted:
            with self._transaction():
                self._conn.execute(
                    "UPDATE items SET state = 'pending', interrupted = interrupted + 1,"
                    " updated = ? WHERE state = 'running'", (time.time(),)
                )
                self._events((r.id, "interrupted", f"attempt {r.attempts}") for r in interrupted)
        return interrupted

    def record(self, outcomes: Sequence[Outcome], running: Sequence[int] = ()) -> None:
        """A commit point: every outcome (one ended attempt each) is on disk when this returns.

        ``running`` are items now in flight; marking them in the same
        transaction costs no extra commit, and a crash then finds them ``running``.
        """
        now = time.time()
        with self._transaction():
            self._conn.executemany(
                "UPDATE items SET state = ?, output_digest = ?, output_size = ?, error = ?,"
                " attempts = attempts + 1, updated = ? WHERE id = ?",
                [(o.state, o.output_digest, o.output_size, o.error, now, o.id) for o in outcomes],
            )
            self._conn.executemany(
                "UPDATE items SET state = 'running', updated = ?"
                " WHERE id = ? AND state = 'pending'",
                [(now, i) for i in running],
            )
            self._events((o.id, o.state, o.error) for o in outcomes if o.error)

    def reset(self, ids: Iterable[int], why: str) -> None:
        """Send committed items back to ``pending`` (their output was lost or damaged)."""
        rows = [(i, "repaired", why) for i in ids]
        with self._transaction():
            self._conn.executemany(
                "UPDATE items SET state = 'pending', output_digest = NULL, output_size = NULL,"
                " error = ? WHERE id = ?", [(why, i) for i, _, _ in rows]
            )
            self._events(rows)

    def add_items(self, records: Sequence[InputRecord], outputs: Sequence[str]) -> None:
        """Inputs that appeared after the job was listed, as new pending items."""
        if not records:
            return
        with self._transaction():
            (top,) = self._conn.execute("SELECT COALESCE(MAX(id), 0) FROM items").fetchone()
            rows = [(top + i, r.key, r.path, r.size, r.mtime_ns, r.digest, o)
                    for i, (r, o) in enumerate(zip(records, outputs, strict=True), 1)]
            self._conn.executemany(
                "INSERT INTO items (id, key, path, size, mtime_ns, digest, output, state)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, 'pending')", rows)
            self._events((row[0], "new-input", "listed on resume") for row in rows)

    def relist(self, changed: Sequence[tuple[int, InputRecord]], why: str) -> None:
        """Items whose input bytes changed: the new listing, and pending again."""
        if not changed:
            return
        with self._transaction():
            self._conn.executemany(
                "UPDATE items SET path = ?, size = ?, mtime_ns = ?, digest = ?, state = 'pending',"
                " output_digest = NULL, output_size = NULL, error = ? WHERE id = ?",
                [(r.path, r.size, r.mtime_ns, r.digest, why, i) for i, r in changed])
            self._events((i, "input-edited", why) for i, _ in changed)

    def drop(self, rows: Sequence[ItemRow], why: str) -> None:
        """Delete items from the job (their inputs are gone); their history stays, by key.

        The events lose their item id: a new input may later take the same id.
        """
        if not rows:
            return
        with self._transaction():
            self._conn.executemany(
                "UPDATE events SET item = NULL, detail = ? || ': ' || detail WHERE item = ?",
                [(r.key, r.id) for r in rows])
            self._conn.executemany("DELETE FROM items WHERE id = ?", [(r.id,) for r in rows])
            self._events((None, "pruned", f"{r.key}: {why}") for r in rows)

    def set_job(self, values: dict[str, str]) -> None:
        with self._transaction():
            self._conn.executemany("INSERT OR REPLACE INTO job VALUES (?, ?)", values.items())

    def _events(self, rows: Iterable[tuple[int | None, str, str | None]]) -> None:
        now = time.time()
        self._conn.executemany(
            "INSERT INTO events VALUES (?, ?, ?, ?)", [(now, i, k, d or "") for i, k, d in rows]
        )

    def _transaction(self) -> _Transaction:
        return _Transaction(self)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT; the connection runs with synchronous=FULL."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal

    def __enter__(self) -> None:
        self._journal._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        conn = self._journal._conn
        if exc_type is None:
            try:
                conn.execute("COMMIT")
                return
            except sqlite3.Error as error:
                exc = error
        if conn.in_transaction:  # SQLite has already rolled back after some errors
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        if isinstance(exc, sqlite3.Error):
            raise _write_failed(self._journal.path, exc) from None


def discard_building(out: Path) -> None:
    """Remove a journal that a crash left half-built (and its WAL files)."""
    for suffix in ("", "-wal", "-shm"):
        path = out / f".{JOURNAL_NAME}.building{suffix}"
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise BatchError(f"{path}: cannot remove a half-built journal: "
                             f"{exc.strerror or exc}", out=out,
                             hint=f"move {path} away, then rerun the same command") from None


def _connect(path: Path, out: Path, mode: str = "WAL") -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA journal_mode = {mode}")
        conn.execute("PRAGMA synchronous = FULL")
    except sqlite3.DatabaseError as exc:
        if "not a database" in str(exc) or "malformed" in str(exc):
            raise _corrupt(path, str(exc)) from None
        raise _write_failed(path, exc) from None
    return conn


def _connect_immutable(path: Path) -> sqlite3.Connection:
    try:
        return sqlite3.connect(f"file:{path}?immutable=1", uri=True, check_same_thread=False)
    except sqlite3.DatabaseError as exc:
        raise _corrupt(path, str(exc)) from None


def _corrupt(path: Path, detail: str) -> FormatError:
    return damaged(path, f"SQLite says: {detail}")


def _write_failed(path: Path, error: sqlite3.Error) -> BatchError:
    return BatchError(
        f"{path}: cannot write the batch journal: {error}",
        out=path.parent,
        hint="check free space and permissions of the --out folder, then rerun the same "
        "command to resume",
    )


def job_value(job: dict[str, str], key: str) -> Any:
    """A JSON value stored in the job table."""
    return json.loads(job[key])
