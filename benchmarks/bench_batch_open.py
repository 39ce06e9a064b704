"""What opening a batch journal costs on resume and verify, part by part, beside SQLite's own check.

Builds a finished job of N items (a real journal and N small output files in
``data/``), then times, interleaved round by round (so each part meets the same
load): SQLite's ``PRAGMA quick_check`` (the baseline: what the journal cost to
open before any field was checked), the output-name check (paths, symlinks
and misfits in ``data/``, one listing of the folder), the field check (every
job value, item and event, one SQL scan per table), the whole
``Journal.open``, and one ``Journal.items()`` read (a resume does several).
Reports the median CPU seconds of each and its ratio to ``quick_check``.

    python benchmarks/bench_batch_open.py --items 100000 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from torchverity.batch._inputs import InputRecord
from torchverity.batch._journal import COMMITTED, STATES, Journal, Outcome
from torchverity.batch._journal_check import check_records, fingerprint_of
from torchverity.batch._paths import DATA_DIR, check_outputs


def build(out: Path, n: int) -> None:
    records, outputs = [], []
    for i in range(n):
        key = f"part{i % 10}/item{i:07d}.bin"
        records.append(InputRecord(key, f"/in/{key}", 100, 1_700_000_000 * 10**9, f"{i:064x}"))
        outputs.append(f"{DATA_DIR}/{key}.out")
    for output in outputs:
        (out / output).parent.mkdir(parents=True, exist_ok=True)
        (out / output).write_bytes(b"0123456789")
    doc = {"format": "torchverity-batch-job/1", "torchverity": "bench", "inputs": "/in",
           "model": {"model": "bench:build"}, "suffix": ".out", "settings": {}}
    job = {"fingerprint": fingerprint_of(doc), "job": json.dumps(doc, sort_keys=True),
           "inputs_root": "0" * 64, "created": str(time.time())}
    journal = Journal.create(out, job, records, outputs)
    journal.record([Outcome(i, COMMITTED, f"{i:064x}", 10) for i in range(1, n + 1)])
    journal.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        build(out, args.items)
        journal = Journal.open(out)
        query = journal._query
        parts: dict[str, Callable[[], object]] = {
            "sqlite quick_check": lambda: query("PRAGMA quick_check"),
            "output names and data/": lambda: check_outputs(
                journal.path, out, (r[0] for r in query("SELECT output FROM items"))),
            "fields": lambda: check_records(journal.path, query, STATES, DATA_DIR),
            "Journal.open (all)": lambda: Journal.open(out).close(),
            "one items() read": journal.items,
        }
        times: dict[str, list[float]] = {name: [] for name in parts}
        for round_ in range(args.rounds):
            order = list(parts)[round_ % len(parts):] + list(parts)[:round_ % len(parts)]
            for name in order:
                start = time.process_time()
                parts[name]()
                times[name].append(time.process_time() - start)
        journal.close()
    base = statistics.median(times["sqlite quick_check"])
    print(f"{args.items} items, {args.rounds} rounds (median CPU seconds)")
    print(f"{'part':26s} {'seconds':>8s} {'x quick_check':>14s}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:26s} {median:8.3f} {median / base:14.2f}")


if __name__ == "__main__":
    main()
