"""Shared helpers for the benchmark scripts: timing, machine description, markdown output."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "benchmarks"
WORK = ROOT / "benchmarks" / "_work"


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """Best wall time of ``repeat`` runs: the least disturbed by other load."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def median_of(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> str:
    try:
        load = f", load average {os.getloadavg()[0]:.1f}"
    except OSError:
        load = ""
    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores{load}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(str(c) for c in r) + " |\n" for r in rows)


def write_results(area: str, title: str, command: str, body: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{area}.md"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    path.write_text(f"# {title}\n\nMeasured {stamp} on {machine()}.\n"
                    f"Command: `{command}`\n\n{body}")
    return path
