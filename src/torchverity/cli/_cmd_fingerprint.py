"""``torchverity fingerprint``: the content fingerprint of a checkpoint."""

from __future__ import annotations

import argparse
import os
from typing import Any, get_args

from torchverity.checkpoint._fp_record import NamedMode
from torchverity.cli._command import add_command
from torchverity.cli._output import Output


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "fingerprint", _run,
        help="content fingerprint of a checkpoint (same for .pt, .safetensors, shards)",
        description="Print the root digest over every tensor's name, dtype, shape and bytes. "
        "It depends only on content: the same tensors saved in any format, order or layout "
        "give the same root. Never executes code from the file.",
    )
    p.add_argument("path", metavar="PATH", help="a .pt/.bin/.safetensors file, sharded folder, "
                   "or pipeline folder (diffusers: one fingerprint per component)")
    p.add_argument("--tensors", action="store_true", help="also list each tensor's digest")
    p.add_argument("--mode", choices=get_args(NamedMode), default="exact",
                   help="exact: BLAKE3 (default); device: the tvsum64x2 device checksum; "
                        "sha256: the exact mode of records made before BLAKE3")


def _run(args: argparse.Namespace, out: Output) -> int:
    from torchverity.checkpoint._file_fingerprint import fingerprint_file
    from torchverity.checkpoint._folders import pipeline_components

    parts = pipeline_components(args.path)
    if parts:  # a pipeline (diffusers): one fingerprint per component, as each is read
        prints = {part: fingerprint_file(part, mode=args.mode) for part in parts}

        def render() -> None:
            for part, fp in prints.items():
                _render(fp, os.fspath(part), args.tensors, out)

        return out.result({"ok": True, "path": args.path,
                           "components": {p.name: fp.to_dict() for p, fp in prints.items()}},
                          render)
    fp = fingerprint_file(args.path, mode=args.mode)
    return out.result({"ok": True, "path": args.path, **fp.to_dict()},
                      lambda: _render(fp, args.path, args.tensors, out))


def _render(fp: Any, path: str, tensors: bool, out: Output) -> None:
    out.line(f"{fp.root}  {path}  ({fp.algo}, {len(fp.entries)} entries)")
    if tensors:
        rows = [(e.name, e.dtype, "x".join(map(str, e.shape)) or "()", e.digest)
                for e in fp.entries]
        out.table(("name", "dtype", "shape", "digest"), rows)

