"""``torchverity doctor``: versions, load safety, determinism, GPU ECC and a short self-test."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output

if TYPE_CHECKING:
    from torchverity.doctor import Level

_MARK: dict[Level, str] = {"ok": "ok", "info": "info", "warn": "WARN", "fail": "FAIL"}


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "doctor", _run,
        help="check this environment for silent-corruption risks",
        description="Versions (Python, torch, CUDA, cuDNN, driver), the effective torch.load "
        "weights_only default and the variables that change it, determinism settings, GPU ECC "
        "counters (with nvidia-ml-py) and a short self-test. Exit 1 if anything fails.",
    )
    p.add_argument("--seconds", type=float, help="self-test length per device (default: 1 round)")
    p.add_argument("--no-selftest", action="store_true", help="skip the self-test")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.doctor import diagnose

    report = diagnose(selftest_seconds=args.seconds, selftest=not args.no_selftest)

    def render() -> None:
        out.table(("component", "version"), [(k, v or "-") for k, v in report.versions.items()],
                  title="versions")
        out.table(("setting", "value"), [(k, v) for k, v in report.determinism.items()],
                  title="determinism")
        out.table(("", "topic", "finding"), [(_MARK[f.level], f.topic, f.message)
                                             for f in report.findings], title="findings")
        for f in report.findings:
            if f.hint and f.level in ("warn", "fail"):
                out.info(f"{f.topic}: next: {f.hint}")
        out.line(f"doctor: {'ok' if report.ok else 'FAILED'}")

    return out.result(report, render)
