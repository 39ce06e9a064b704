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
        "optimizers, Namespace, numpy) into NEW (.safetensors, .pt or .pth) and its non-tensor "
        "data into NEW.meta.json, without running the file's code. Unknown classes become inert "
        "placeholders; nothing from the file runs (TorchScript and nested archives included). "
        "A file with code-running globals (scan: unsafe) is migrated too: those globals are "
        "named in a warning and in NEW.meta.json, and never run. Malformed files are refused.",
    )
    p.add_argument("source", type=Path, help="the legacy checkpoint")
    p.add_argument("target", type=Path, help="the new file (.safetensors, .pt or .pth)")
    p.add_argument("--trust-sha256", metavar="HEX",
                   help="the source's SHA-256: refuse to migrate any other bytes (optional: "
                        "nothing from the file runs either way)")
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
        if result.dangerous:
            from torchverity.pickles._dangerous import describe_globals

            out.warn(f"{result.source} names globals that run code or touch the system: "
                     f"{describe_globals(result.dangerous)}; they were rebuilt as inert "
                     f"placeholders and never ran. Use {result.target}; do not load the "
                     "source itself")

    return out.result({"ok": True, "result": result}, render)
