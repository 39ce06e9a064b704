"""``torchverity demo``: every capability shows its check on built-in data.

Each step is a module ``torchverity.demo._sNN_<name>`` with a ``TITLE`` and a
``run(ctx)`` function; steps run in ``NN`` order in one scratch folder. A step
asserts what it shows (``ctx.expect``), so the demo fails loudly if a
capability stops working. Adding a capability adds a step module: this file
does not change.
"""

from __future__ import annotations

import importlib
import io
import pkgutil
import shlex
import time
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from torchverity.cli._output import Output
from torchverity.errors import CheckFailedError


class DemoFailure(CheckFailedError):
    """A demo step did not show what it promised."""


@dataclass
class DemoContext:
    """What a step gets: a scratch folder, the output, and helpers to run the CLI."""

    workdir: Path
    out: Output
    state: dict[str, object] = field(default_factory=dict)

    def say(self, text: str) -> None:
        self.out.info(text)

    def cli(self, *args: str, expect: int | None = 0) -> tuple[int, str, str]:
        """Run ``torchverity ARGS`` in-process, echo it like a shell, check the exit code."""
        from torchverity.cli import main

        self.say(f"  $ torchverity {shlex.join(args)}")
        stdout, stderr = io.StringIO(), io.StringIO()
        with redirect_stdout(stdout), redirect_stderr(stderr):
            rc = main(list(args))
        for text in (stdout.getvalue(), stderr.getvalue()):
            for line in text.rstrip("\n").splitlines():
                self.say(f"    {line}")
        self.say(f"    [exit {rc}]")
        if expect is not None and rc != expect:
            raise DemoFailure(
                f"demo: 'torchverity {shlex.join(args)}' exited {rc}, expected {expect}",
                hint="rerun the command above by hand to see why",
            )
        return rc, stdout.getvalue(), stderr.getvalue()

    def expect(self, condition: bool, what: str) -> None:
        if not condition:
            raise DemoFailure(f"demo: expected {what}", hint="run with TORCHVERITY_DEBUG=1")
        self.say(f"  ok: {what}")


def steps() -> Iterator[ModuleType]:
    package = importlib.import_module(__name__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_s"):
            yield importlib.import_module(f"{__name__}.{info.name}")


def run_demo(workdir: Path, out: Output, only: str | None = None) -> list[dict[str, object]]:
    """Run every step (or those whose module name contains ``only``); return a summary."""
    ctx = DemoContext(workdir=workdir, out=out)
    summary: list[dict[str, object]] = []
    for step in steps():
        if only and only not in step.__name__:
            continue
        out.info(f"\n== {step.TITLE}")
        start = time.perf_counter()
        step.run(ctx)
        summary.append({"step": step.TITLE, "seconds": round(time.perf_counter() - start, 2)})
    return summary
