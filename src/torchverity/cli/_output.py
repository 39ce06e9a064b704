"""Output conventions shared by every command.

Data goes to stdout, diagnostics to stderr. ``--json`` turns stdout into one
JSON document. Rich tables and progress bars appear only when the stream is a
terminal, so pipes and CI logs stay plain and stable.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

from torchverity._jsonable import to_jsonable


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def dumps(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), indent=2, sort_keys=False, allow_nan=False)


@dataclass
class Output:
    """Where a command writes. ``json_mode`` makes stdout a single JSON document."""

    json_mode: bool = False
    stdout: TextIO | None = None
    stderr: TextIO | None = None

    @property
    def out(self) -> TextIO:
        return self.stdout or sys.stdout

    @property
    def err(self) -> TextIO:
        return self.stderr or sys.stderr

    @property
    def fancy(self) -> bool:
        """Rich rendering for people: stdout is a terminal and JSON was not asked for."""
        return not self.json_mode and _is_tty(self.out) and not os.environ.get("NO_COLOR")

    def data(self, obj: Any) -> None:
        """Write the command's JSON result (only in ``--json`` mode)."""
        self.out.write(dumps(obj) + "\n")
        self.out.flush()

    def line(self, text: str = "") -> None:
        """Write one line of human-readable data to stdout (suppressed in JSON mode)."""
        if not self.json_mode:
            self.out.write(text + "\n")

    def info(self, text: str) -> None:
        self.err.write(text + "\n")

    def warn(self, text: str) -> None:
        self.err.write(f"warning: {text}\n")

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
        """A table on stdout: rich on a terminal, aligned plain text otherwise."""
        if self.json_mode:
            return
        if self.fancy:
            from rich.console import Console
            from rich.table import Table

            table = Table(title=title or None)
            for col in columns:
                table.add_column(col)
            for row in rows:
                table.add_row(*(str(c) for c in row))
            Console(file=self.out).print(table)
            return
        self.out.write(render_plain_table(columns, rows, title))

    @contextmanager
    def progress(self, total: int | None, description: str) -> Iterator[Callable[[int], None]]:
        """Yield ``advance(n)``; draws a rich progress bar on stderr when it is a terminal."""
        if self.json_mode or not _is_tty(self.err):
            yield lambda n: None
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        ]
        with Progress(*columns, console=Console(file=self.err), transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)


def render_plain_table(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str = ""
) -> str:
    cells = [[str(c) for c in columns]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = [title] if title else []
    for r in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"
