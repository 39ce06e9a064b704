"""``torchverity diff``: compare two checkpoints tensor by tensor, down to the bit."""

from __future__ import annotations

import argparse
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "diff", _run,
        help="compare two checkpoints tensor by tensor (bit flips, drift, shape changes)",
        description="Compare A and B (.pt, .safetensors or sharded folders, in any mix; two "
        "pipeline folders such as diffusers' component by component, as unet/NAME). Each "
        "value change is classified: bit-flip (which bit: sign, exponent or mantissa), "
        "few-bits, drift (within --rtol/--atol) or large. Exit 0 when equal within "
        "tolerance, 1 otherwise. Never executes code from the files; .safetensors and torch.save "
        "zip files are listed and hashed without loading them, and only tensors whose bytes "
        "differ are loaded.",
    )
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--all", action="store_true", help="also list identical tensors")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.checkpoint._diff import diff

    result = diff(args.a, args.b, rtol=args.rtol, atol=args.atol)

    def render() -> None:
        shown = result.entries if args.all else result.changed
        if shown:
            out.table(("tensor", "change", "detail"), [
                (e.name, e.kind if e.status == "values_changed" else e.status.replace("_", " "),
                 e.describe()) for e in shown])
        counts = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in result.counts.items() if n)
        verdict = "equal" if result.equal else "DIFFERENT"
        tolerance = f" within rtol={args.rtol} atol={args.atol}" if args.rtol or args.atol else ""
        out.line(f"{verdict}{tolerance}: {len(result.entries)} entries ({counts})")

    code = out.result({"ok": result.equal, **result.to_dict()}, render)
    for path in (args.a, args.b):
        _warn_if_unsafe(path, out)
    return code


def _warn_if_unsafe(path: str, out: Output) -> None:
    """A side whose pickle names code-running globals: read inertly here (its payload is
    an entry of the diff), and never to be loaded."""
    from pathlib import Path

    from torchverity.pickles._file_format import checkpoint_format

    if not Path(path).is_file() or checkpoint_format(Path(path)) not in ("pt", "pt-legacy",
                                                                          "pickle"):
        return
    from torchverity.pickles._dangerous import dangerous_globals, describe_globals, rescue_step
    from torchverity.pickles._scan import scan_file

    scan = scan_file(path)
    if scan.verdict == "unsafe":
        out.err.write(f"torchverity: warning: {path} is unsafe: it names "
                      f"{describe_globals(dangerous_globals(scan))}; read inertly, nothing "
                      f"ran\n  next: {rescue_step(scan)}\n")
