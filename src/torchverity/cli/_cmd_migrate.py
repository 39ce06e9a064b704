"""``torchverity migrate``: legacy full-pickle checkpoint -> clean state_dict + meta.json."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torchverity.cli._command import add_command
from torchverity.cli._output import Output


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "migrate", _run,
        help="convert a legacy checkpoint to a weights_only-loadable state_dict",
        description="Extract the tensors of a legacy checkpoint (custom classes, whole models, "
        "optimizers, Namespace, numpy) into NEW (.safetensors or .pt) and its non-tensor data "
        "into NEW.meta.json, without running the file's code. Unknown classes become inert "
        "placeholders; nothing from the file runs (TorchScript and nested archives included). "
        "Files with code-running globals are refused unless --trust-sha256 names the file's "
        "digest (they are still read inertly).",
    )
    p.add_argument("source", type=Path, help="the legacy checkpoint")
    p.add_argument("target", type=Path, help="the new file (.safetensors or .pt)")
    p.add_argument("--trust-sha256", metavar="HEX",
                   help="the source's SHA-256: migrate it although it names code-running "
                        "globals (still inert)")
    p.add_argument("--nested", action="store_true",
                   help="write NEW.pt as {'model': state_dict, 'optimizer': state_dict} "
                        "({'optimizer': ...} for a file holding an optimizer alone)")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.pickles._migrate import migrate

    result = migrate(args.source, args.target, trust_sha256=args.trust_sha256,
                     nested=args.nested)

    def render() -> None:
        out.line(f"migrated {result.source} -> {result.target}: {result.tensors} tensors, "
                 f"read back bit for bit ({result.mode} unpickling)")
        if result.placeholders:
            out.line("  rebuilt as inert placeholders (nothing ran): "
                     + ", ".join(result.placeholders))
        if result.crc_checked:
            out.line(f"  source tensor records match their zip CRC-32: {result.crc_checked}")
        out.line(f"  sha256 {result.digest}")
        out.line(f"  sidecar {result.sidecar}, meta {result.meta_path}")
        for item in result.skipped:
            out.warn(f"not migrated: {item}")

    return out.result({"ok": True, "result": result}, render)
