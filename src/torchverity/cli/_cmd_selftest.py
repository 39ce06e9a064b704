"""``torchverity selftest``: known-answer, repeat and reference tests of a device."""

from __future__ import annotations

import argparse
from typing import Any

from torchverity.cli._command import add_command, at_least
from torchverity.cli._output import Output


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "selftest", _run,
        help="test that a device computes and stores correctly",
        description="Known-answer tests (integer-valued matmul, convolution and reductions with "
        "exact results), repeat-run determinism and comparison with a float64 CPU reference in "
        "float32, float16 and bfloat16, plus a memory pattern test. Exit 1 on any failure.",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default cpu)")
    p.add_argument("--seconds", type=float, default=5.0,
                   help="keep testing with fresh inputs for about this long (default 5)")
    p.add_argument("--memory-mb", type=at_least(0), help="pattern-test buffer size (0 skips it)")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.selftest import run_selftest

    result = run_selftest(args.device, args.seconds, memory_mb=args.memory_mb)

    def render() -> None:
        columns, rows = result.table()
        out.table(columns, rows, title=f"selftest {result.device} ({result.device_name})")
        verdict = "passed" if result.ok else "FAILED"
        out.line(f"selftest {verdict}: {len(result.checks)} checks, {result.rounds} round(s) "
                 f"in {result.seconds:.1f} s")
        for c in result.failures:
            out.line(f"  {c.kernel} {c.dtype} {c.test}: {c.failures} of {c.runs} failed; "
                     f"{c.detail}")
        if not result.ok:
            out.info(f"{result.device} returned wrong results: do not trust it for training or "
                     "inference; rerun with --seconds 60 to confirm, then drain the machine")

    return out.result(result, render)
