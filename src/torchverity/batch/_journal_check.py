"""Every field of a batch journal is checked when it is opened, before anything trusts it.

SQLite keeps whatever a damaged or edited file holds: text where a count
belongs, NULL in a digest, a job description that no longer matches its
fingerprint, two items with one output. Each is refused (a ``FormatError``
naming the row, the field and what it should hold) rather than failing later
inside the run, or passing ``batch verify``. The checks run in SQL, one scan
per table, so opening a large journal stays cheap.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torchverity.errors import FormatError

Query = Callable[[str], list[tuple[Any, ...]]]

JOB_KEYS = ("schema", "fingerprint", "job", "inputs_root", "created")
OPTIONAL_JOB_KEYS = ("command",)  # absent from jobs run from Python and older journals
# A digest's type and length; its digits are judged by the comparisons it takes part in (a
# non-hex text matches no file: the item is redone, or verify names it). A GLOB over the
# digits tripled the cost of this scan.
_HEX = "(typeof({c}) = 'text' AND length({c}) = 64)"
_COUNT = "(typeof({c}) = 'integer' AND {c} >= 0)"
_TEXT = "(typeof({c}) = 'text' AND {c} != '')"
_SHA = "a SHA-256 (64 hex digits)"


def fingerprint_of(doc: dict[str, Any]) -> str:
    """The job fingerprint: SHA-256 of the job description's canonical JSON."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_records(path: Path, query: Query, states: Sequence[str], data_dir: str) -> None:
    """Refuse the journal at ``path`` unless every job value, item and event is well-formed."""
    doc = _check_job(path, query)
    _check_rows(path, query, "items", _item_rules(states, data_dir, doc["suffix"]))
    for column in ("id", "key", "output"):
        if query(f"SELECT 1 FROM items GROUP BY {column} HAVING COUNT(*) > 1 LIMIT 1"):
            raise damaged(path, f"two items share one {column}")
    _check_rows(path, query, "events", _EVENT_RULES)


def _item_rules(states: Sequence[str], data_dir: str, suffix: str) -> list[tuple[str, str, str]]:
    names = ", ".join(f"'{s}'" for s in states)
    quoted = suffix.replace("'", "''")
    digest = _HEX.format(c="output_digest")
    size = _COUNT.format(c="output_size")
    return [
        ("id", "typeof(id) = 'integer'", "an integer"),
        ("key", _TEXT.format(c="key"), "a non-empty text"),
        ("path", _TEXT.format(c="path"), "a non-empty text"),
        ("size", _COUNT.format(c="size"), "a byte count (an integer, 0 or more)"),
        ("mtime_ns", "typeof(mtime_ns) = 'integer'", "an integer"),
        ("digest", _HEX.format(c="digest"), _SHA),
        ("output", f"typeof(output) = 'text' AND typeof(key) = 'text' AND "
         f"output = '{data_dir}/' || key || '{quoted}'",
         f"{data_dir}/<key>{suffix}, the job's output name for the item's key"),
        ("state", f"typeof(state) = 'text' AND state IN ({names})", f"one of {names}"),
        ("attempts", _COUNT.format(c="attempts"), "a count (an integer, 0 or more)"),
        ("interrupted", _COUNT.format(c="interrupted"), "a count (an integer, 0 or more)"),
        ("output_digest", f"CASE WHEN state = 'committed' THEN {digest} "
         f"ELSE output_digest IS NULL OR {digest} END",
         f"{_SHA} (every committed item has one)"),
        ("output_size", f"CASE WHEN state = 'committed' THEN {size} "
         f"ELSE output_size IS NULL OR {size} END",
         "a byte count (every committed item has one)"),
        ("error", "error IS NULL OR typeof(error) = 'text'", "a text or nothing"),
        ("updated", "updated IS NULL OR typeof(updated) IN ('integer', 'real')",
         "a Unix time or nothing"),
    ]


_EVENT_RULES = [
    ("at", "typeof(at) IN ('integer', 'real')", "a Unix time"),
    ("item", "item IS NULL OR typeof(item) = 'integer'", "an item id or nothing"),
    ("kind", _TEXT.format(c="kind"), "a non-empty text"),
    ("detail", "typeof(detail) = 'text'", "a text"),
]


def _check_rows(path: Path, query: Query, table: str, rules: list[tuple[str, str, str]]) -> None:
    """One scan: the first row breaking a rule, and which rule it breaks.

    Every rule tests the type first, so none is NULL (a NULL would pass ``NOT``).
    """
    flags = ", ".join(f"({rule})" for _, rule, _ in rules)
    every = " AND ".join(f"({rule})" for _, rule, _ in rules)
    found = query(f"SELECT rowid, {flags} FROM {table} WHERE NOT ({every}) LIMIT 1")
    if not found:
        return
    rowid, *ok = found[0]
    column, _, wanted = next(r for r, good in zip(rules, ok, strict=True) if not good)
    kind = query(f"SELECT typeof({column}) FROM {table} WHERE rowid = {int(rowid)}")[0][0]
    found_kind = "nothing" if kind == "null" else f"a {kind} value that does not fit"
    raise damaged(path, f"{table} row {rowid}: {column} should be {wanted}, not {found_kind}")


def _check_job(path: Path, query: Query) -> dict[str, Any]:
    """The job table: every value text, the description JSON that its fingerprint hashes."""
    rows = {key: kind for key, kind in query("SELECT key, typeof(value) FROM job")}
    for key in JOB_KEYS:
        if rows.get(key) != "text":
            held = "is missing" if key not in rows else f"holds a value of type {rows[key]}"
            raise damaged(path, f"job value '{key}' {held}, not text")
    for key in OPTIONAL_JOB_KEYS:
        if rows.get(key, "text") != "text":
            raise damaged(path, f"job value '{key}' holds a value of type {rows[key]}, not text")
    job: dict[str, str] = dict(query("SELECT key, value FROM job"))
    for key in ("fingerprint", "inputs_root"):
        if len(job[key]) != 64 or job[key].strip("0123456789abcdef"):
            raise damaged(path, f"job value '{key}' is not {_SHA}")
    try:
        float(job["created"])
        doc = json.loads(job["job"])
    except ValueError:
        raise damaged(path, "job value 'created' or 'job' does not parse (a Unix time, "
                            "a JSON object)") from None
    except RecursionError:
        raise damaged(path, "job value 'job' is nested too deeply to be a job "
                            "description") from None
    wanted = {"inputs": str, "suffix": str, "model": dict, "settings": dict}
    if not isinstance(doc, dict) or any(not isinstance(doc.get(k), t) for k, t in wanted.items()):
        raise damaged(path, "job value 'job' is not a job description (a JSON object with "
                            "inputs, suffix, model and settings)")
    if fingerprint_of(doc) != job["fingerprint"]:
        raise damaged(path, "job value 'job' does not hash to the job's fingerprint: the job "
                            "description was changed")
    return doc


def damaged(path: Path, detail: str) -> FormatError:
    """The journal at ``path`` cannot be trusted: nothing says which outputs are complete."""
    return FormatError(
        f"{path}: the batch journal is damaged: {detail}",
        path=path,
        hint="restore the journal from a backup, or rerun with --force to start the job "
        "again in this folder (never trust outputs whose journal is gone)",
    )
