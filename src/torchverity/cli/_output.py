"""Output conventions shared by every command.

Data goes to stdout, diagnostics to stderr. A command builds its result once and
hands it to :meth:`Output.result`: with ``--json`` stdout becomes that one JSON
document, otherwise the command's renderer writes it for people. Rich tables and
progress bars appear only when the stream is a terminal, so pipes and CI logs
stay plain and stable.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO, cast

from torchverity._jsonable import to_jsonable
from torchverity.errors import EXIT_CHECK_FAILED, EXIT_OK


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _ReaderMayLeave:
    """stdout for a reader that may stop early (``torchverity inspect X | head``): once
    the pipe is closed, the rest of the output goes nowhere and the command runs to its
    end, exiting with its own verdict instead of failing on a write."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self._gone = True
        # What is still buffered is flushed at exit: the descriptor now takes it quietly.
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextmanager
def reader_may_leave() -> Iterator[None]:
    """Within: a closed stdout pipe ends the output, not the command."""
    stream = sys.stdout
    sys.stdout = cast(TextIO, _ReaderMayLeave(stream))
    try:
        yield
    finally:
        sys.stdout = stream


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

    @property
    def live(self) -> bool:
        """Progress bars on stderr: it is a terminal and JSON was not asked for."""
        return not self.json_mode and _is_tty(self.err)

    def result(self, data: Any, render: Callable[[], object] | None = None, *,
               exit_code: int | None = None) -> int:
        """Finish a command with its result and return its exit code.

        With ``--json``, ``data`` is written as the one JSON document on stdout; otherwise
        ``render()`` writes it for people (lines, tables, advice on stderr). ``data`` holds
        ``ok`` (a key or an attribute): the exit code is 0 when it is true and 1 (a check
        failed) when not, unless ``exit_code`` says otherwise.
        """
        if self.json_mode:
            self.out.write(dumps(data) + "\n")
            self.out.flush()
        elif render is not None:
            render()
        if exit_code is not None:
            return exit_code
        ok = data["ok"] if isinstance(data, Mapping) else data.ok
        return EXIT_OK if ok else EXIT_CHECK_FAILED

    def line(self, text: str = "") -> None:
        """Write one line of human-readable data to stdout (suppressed in JSON mode)."""
        if not self.json_mode:
            self.out.write(text + "\n")

    def info(self, text: str) -> None:
        self.err.write(text + "\n")

    def warn(self, text: str) -> None:
        self.err.write(f"warning: {text}\n")

    @contextmanager
    def warnings_of(self, wanted: type[Warning]) -> Iterator[None]:
        """Python warnings of class ``wanted`` raised inside, written as this command's own."""
        import warnings

        with warnings.catch_warnings():
            shown = warnings.showwarning

            def show(message: Warning | str, category: type[Warning], filename: str,
                     lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
                if issubclass(category, wanted):
                    self.warn(str(message))
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            yield

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
        if not self.live:
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
