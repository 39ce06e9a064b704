"""``torchverity fingerprint``: the content fingerprint of a checkpoint."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, get_args

from torchverity.checkpoint._fp_record import NamedMode
from torchverity.cli._command import add_command
from torchverity.cli._output import Output

if TYPE_CHECKING:
    from torchverity.pickles._scan import ScanResult


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(
        subparsers, common, "fingerprint", _run,
        help="content fingerprint of a checkpoint (same for .pt, .safetensors, shards)",
        description="Print the root digest over every tensor's name, dtype, shape and bytes. "
        "It depends only on content: the same tensors saved in any format, order or layout "
        "give the same root. Never executes code from the file: a file the scan finds unsafe "
        "is fingerprinted from an inert read, with a warning naming its code-running globals.",
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
        unsafe = {k: v for part in parts for k, v in _unsafe_files(part).items()}

        def render() -> None:
            for part, fp in prints.items():
                _render(fp, os.fspath(part), args.tensors, out)

        code = out.result({"ok": True, "path": args.path, "unsafe": _named(unsafe),
                           "components": {p.name: fp.to_dict() for p, fp in prints.items()}},
                          render)
        _warn_unsafe(unsafe, any(fp.entries for fp in prints.values()), out)
        return code
    fp = fingerprint_file(args.path, mode=args.mode)
    unsafe = _unsafe_files(args.path)
    code = out.result({"ok": True, "path": args.path, "unsafe": _named(unsafe),
                       **fp.to_dict()},
                      lambda: _render(fp, args.path, args.tensors, out))
    _warn_unsafe(unsafe, bool(fp.entries), out)
    return code


def _unsafe_files(path: str | os.PathLike[str]) -> dict[str, ScanResult]:
    """The pickle files of a checkpoint the scan finds unsafe, with their scans:
    fingerprinted all the same, since their read runs nothing."""
    from torchverity.checkpoint._onnx import is_onnx
    from torchverity.checkpoint._st_fingerprint import checkpoint_files

    found = {}
    for f in checkpoint_files(path)[0]:
        # Read already, so each is a file of a format its fingerprint was taken from.
        from torchverity.pickles._file_format import checkpoint_format

        if is_onnx(f) or checkpoint_format(f) == "safetensors":
            continue
        from torchverity.pickles._scan import scan_file  # pickles only: the scan is heavy

        scan = scan_file(f)
        if scan.verdict == "unsafe":
            found[os.fspath(f)] = scan
    return found


def _named(unsafe: dict[str, ScanResult]) -> dict[str, dict[str, str]]:
    """Each unsafe file's code-running globals, with why (the JSON report's ``unsafe``)."""
    from torchverity.pickles._dangerous import dangerous_globals

    return {path: dangerous_globals(scan) for path, scan in unsafe.items()}


def _warn_unsafe(unsafe: dict[str, ScanResult], tensors: bool, out: Output) -> None:
    """Each unsafe file named, with the way to its ``tensors`` when there are some."""
    from torchverity.pickles._dangerous import dangerous_globals, describe_globals, rescue_step

    for path, scan in unsafe.items():
        step = rescue_step(scan) if tensors else "do not load it"
        out.warn(f"{path}: the scan found it unsafe: it names globals that run code or touch "
                 f"the system: {describe_globals(dangerous_globals(scan))}; fingerprinted "
                 f"from an inert read, so nothing from it ran; {step}")


def _render(fp: Any, path: str, tensors: bool, out: Output) -> None:
    out.line(f"{fp.root}  {path}  ({fp.algo}, {len(fp.entries)} entries)")
    if tensors:
        rows = [(e.name, e.dtype, "x".join(map(str, e.shape)) or "()", e.digest)
                for e in fp.entries]
        out.table(("name", "dtype", "shape", "digest"), rows)
