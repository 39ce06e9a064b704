"""``torchverity demo``: every capability shows its check on built-in data.

Each step is a module ``torchverity.demo._sNN_<name>`` with a ``TITLE``, a
``run(ctx)`` function and, when it needs an extra, ``NEEDS`` (extra names);
steps run in ``NN`` order in one scratch folder. A step asserts what it shows
(``ctx.expect``), so the demo fails loudly if a capability stops working. A step
whose extra is missing fails too, unless the user asked to skip it
(``torchverity demo --skip serve``): a demo that quietly shows less is no proof.
Adding a capability adds a step module: this file does not change.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import pkgutil
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from torchverity.cli._output import Output
from torchverity.errors import CheckFailedError, TorchVerityError, UsageError

# The modules each extra brings, as far as a demo step needs them.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "httpx"),
    "sign": ("model_signing", "OpenSSL", "in_toto_attestation", "cryptography"),
    "lightning": ("lightning",),
    "hf": ("transformers",),
    "onnx": ("onnx", "onnxruntime"),
}
Verdict = Literal["passed", "failed", "skipped"]


class DemoFailure(CheckFailedError):
    """A demo step did not show what it promised."""


@dataclass
class DemoContext:
    """What a step gets: a scratch folder, the output, and helpers to run the CLI."""

    workdir: Path
    out: Output

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

    def expect_refused(self, who: str, load: Callable[[], object], tensors: list[str],
                       what: str) -> None:
        """Expect ``load`` to raise :class:`IntegrityError` naming exactly ``tensors``."""
        from torchverity.errors import IntegrityError

        try:
            load()
        except IntegrityError as exc:
            self.say(f"{who} was refused: {exc.message}")
            self.expect(exc.tensors == tensors, what)
        else:
            self.expect(False, what)


def small_model() -> Any:
    """The small MLP several steps train or save, with the same weights every run."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


@dataclass(frozen=True)
class StepResult:
    """One step's verdict; ``reason`` says why it failed or was skipped."""

    name: str
    title: str
    verdict: Verdict
    seconds: float
    reason: str = ""


def step_name(step: ModuleType) -> str:
    """``torchverity.demo._s70_serve`` -> ``serve``: what ``--only`` and ``--skip`` take."""
    return step.__name__.rpartition(".")[2].split("_", 2)[2]


def steps() -> Iterator[ModuleType]:
    package = importlib.import_module(__name__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_s"):
            yield importlib.import_module(f"{__name__}.{info.name}")


def _missing_extras(step: ModuleType) -> list[str]:
    needs: Sequence[str] = getattr(step, "NEEDS", ())
    return [extra for extra in needs
            if any(importlib.util.find_spec(m) is None for m in EXTRA_MODULES[extra])]


def _check_names(given: Sequence[str], known: Sequence[str], flag: str) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise UsageError(f"demo: no step named {', '.join(unknown)} ({flag})",
                         hint=f"the steps are: {' '.join(known)}")


def _run_step(step: ModuleType, ctx: DemoContext) -> StepResult:
    name, start = step_name(step), time.perf_counter()
    missing = _missing_extras(step)
    if missing:
        extras = ",".join(missing)
        reason = (f"needs the {extras} extra: pip install 'torchverity[{extras}]' "
                  f"(or run torchverity demo --skip {name})")
        ctx.say(f"  FAILED: {reason}")
        return StepResult(name, step.TITLE, "failed", 0.0, reason)
    try:
        step.run(ctx)
    except TorchVerityError as exc:
        ctx.say(f"  FAILED: {exc}")
        return StepResult(name, step.TITLE, "failed", _since(start), exc.message)
    return StepResult(name, step.TITLE, "passed", _since(start))


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 2)


def run_demo(workdir: Path, out: Output, only: Sequence[str] = (),
             skip: Sequence[str] = ()) -> list[StepResult]:
    """Run every step (or those named in ``only``) except those in ``skip``; a failing step
    does not stop the ones after it, so the summary shows every verdict."""
    found = list(steps())
    names = [step_name(s) for s in found]
    _check_names(only, names, "--only")
    _check_names(skip, names, "--skip")
    ctx = DemoContext(workdir=workdir, out=out)
    results = []
    for step in found:
        name = step_name(step)
        if only and name not in only:
            continue
        if name in skip:
            results.append(StepResult(name, step.TITLE, "skipped", 0.0, "asked with --skip"))
            continue
        out.info(f"\n== {step.TITLE}")
        results.append(_run_step(step, ctx))
    return results
