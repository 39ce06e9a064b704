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
        part_scans = {part: _scans(part) for part in parts}
        read = {part: _read_as(part, part_scans[part]) for part in parts}
        unsafe = {k: v for part in parts for k, v in _unsafe(part_scans[part]).items()}

        def render() -> None:
            for part, fp in prints.items():
                _render(fp, *read[part], args.tensors, out)

        code = out.result({"ok": True, "path": args.path, "unsafe": _named(unsafe),
                           "components": {p.name: {"file": read[p][0], "format": read[p][1],
                                                   **fp.to_dict()}
                                          for p, fp in prints.items()}},
                          render)
        for part in parts:
            _note(part, *read[part], out)
        _warn_unsafe(unsafe, any(fp.entries for fp in prints.values()), out)
        return code
    fp = fingerprint_file(args.path, mode=args.mode)
    scans = _scans(args.path)
    file, fmt = _read_as(args.path, scans)
    unsafe = _unsafe(scans)
    code = out.result({"ok": True, "path": args.path, "file": file, "format": fmt,
                       "unsafe": _named(unsafe), **fp.to_dict()},
                      lambda: _render(fp, file, fmt, args.tensors, out))
    _note(args.path, file, fmt, out)
    _warn_unsafe(unsafe, bool(fp.entries), out)
    return code


def _scans(path: str | os.PathLike[str]) -> dict[str, ScanResult]:
    """The scans of a checkpoint's pickle files (a .safetensors or ONNX file has no pickle):
    they tell TorchScript and unsafe files apart; fingerprinted all the same, since their
    read runs nothing."""
    from torchverity.checkpoint._onnx import is_onnx
    from torchverity.checkpoint._st_fingerprint import checkpoint_files

    found = {}
    for f in checkpoint_files(path)[0]:
        # Read already, so each is a file of a format its fingerprint was taken from.
        from torchverity.pickles._file_format import checkpoint_format

        if is_onnx(f) or checkpoint_format(f) == "safetensors":
            continue
        from torchverity.pickles._scan import scan_file  # pickles only: the scan is heavy

        found[os.fspath(f)] = scan_file(f)
    return found


def _unsafe(scans: dict[str, ScanResult]) -> dict[str, ScanResult]:
    return {f: scan for f, scan in scans.items() if scan.verdict == "unsafe"}


def _read_as(path: str | os.PathLike[str], scans: dict[str, ScanResult]) -> tuple[str, str]:
    """The file fingerprinted (a sharded checkpoint's index) and its format, named as
    inspect names it."""
    from torchverity.checkpoint._folders import resolve
    from torchverity.checkpoint._onnx import is_onnx
    from torchverity.pickles._file_format import checkpoint_format, named_format

    target = resolve(path)
    if target.index is not None:
        return os.fspath(target.index), "sharded"
    file = target.file
    if is_onnx(file):
        return os.fspath(file), "onnx"
    return os.fspath(file), named_format(checkpoint_format(file), scans.get(os.fspath(file)))


def _note(path: str | os.PathLike[str], file: str, fmt: str, out: Output) -> None:
    """What the fingerprint does not say by itself: which of a folder's weights files it
    covers, and that a TorchScript archive holds code besides its tensors."""
    from torchverity.errors import shell_path

    others = _other_weights(path, file)
    if others:
        chosen = os.path.basename(file)
        why = ("transformers' from_pretrained loads it when both are there (it prefers "
               "safetensors)" if chosen.endswith((".safetensors", ".safetensors.index.json"))
               else "from_pretrained looks for it first")
        out.info(f"note: {path} holds {chosen} and {', '.join(os.path.basename(o) for o in others)}"
                 f"; fingerprinted {chosen}: {why}. The other may hold different tensors: "
                 f"torchverity fingerprint {shell_path(others[0])}")
    if fmt == "torchscript":
        out.info(f"note: {file} is a TorchScript archive (torch.jit.save): it holds code "
                 "besides its weights. The fingerprint covers its tensors only, and none of "
                 f"its code ran; torchverity scan {shell_path(file)} names the code torch.jit.load "
                 "would run")


def _other_weights(path: str | os.PathLike[str], file: str) -> list[str]:
    """The weights files (or indexes) of the folder ``path`` that were not fingerprinted."""
    from pathlib import Path

    from torchverity.checkpoint._folders import WEIGHT_NAMES

    folder = Path(path)
    if not folder.is_dir():
        return []
    if file.endswith(".index.json"):
        found = sorted(folder.glob("*.index.json"))
    else:
        found = [folder / n for n in WEIGHT_NAMES if (folder / n).is_file()]
    return [os.fspath(f) for f in found if f.name != os.path.basename(file)]


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


def _render(fp: Any, file: str, fmt: str, tensors: bool, out: Output) -> None:
    out.line(f"{fp.root}  {file}  ({fmt}, {fp.algo}, {len(fp.entries)} entries)")
    if tensors:
        rows = [(e.name, e.dtype, "x".join(map(str, e.shape)) or "()", e.digest)
                for e in fp.entries]
        out.table(("name", "dtype", "shape", "digest"), rows)
